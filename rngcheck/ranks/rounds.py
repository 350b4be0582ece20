"""The rounds of the exchange protocol for one rank checker (``protocol.py``, rules P1 to P7): at
an exchange point, settle the round in flight, then post this point's window as a round (the fast
vector over the checker's side group) and, unless pipelined, settle it; a round that does not
agree goes to the slow path (``divergence.py``), a peer that does not arrive is a rank_missing
finding found through the store (``board.py``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..core.dispatch import unseen
from ..core.findings import Finding
from ..core.stacks import Stack
from .board import Board
from .detail import Detail
from .divergence import Divergences
from .exchange import PeerLost, SideGroup, connection_closed
from .findings import missing_finding, point_text, replica_finding
from .program import Program
from .protocol import PIPELINED, ExchangeStats, Point, disagreement, fast_vector, joined
from .replicated import Held, Init, Initialisations, Replicas, first_difference
from .replicated import rows as replica_rows
from .window import Taken, Window

__all__ = ["Round", "Rounds"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Round:
    """One exchange round: the fast vector sent, and the window it covers."""

    number: int
    point: Point
    where: str
    taken: Taken
    vec: torch.Tensor
    parts: dict[int, list[Any]]
    stack: Stack | None  # where this rank posted it (pipelined rounds); else taken when settled
    init: list[Init] | None = None  # the parameter initialisations this round settles
    held: list[Finding] = field(default_factory=list)  # per-rank seeding held back until now
    # ... and the replicated parameters it compares by digest, with the initialisations that
    # explain a difference among them
    replicas: list[Held] | None = None
    explaining: list[Init] = field(default_factory=list)
    work: Any = None


class Rounds:
    """Posts and settles one rank checker's rounds (see the module docstring)."""

    def __init__(
        self,
        *,
        side: SideGroup,
        domain: tuple[int, ...],
        rank: int,
        timeout: float,
        stats: ExchangeStats,
        pipelines: bool,
        whole_stream: int,
        peer_streams: dict[int, tuple[int, ...]],
        stream_members: dict[int, tuple[int, ...]],
        window: Window,
        inits: Initialisations,
        program: Program,
        divergences: Divergences,
        replicas: Replicas,
        seed_calls: Callable[[Any], tuple[Any, ...]],
        lock: Any,
        emit: Callable[[Finding], None],
        publish: Callable[[], None],
        progress: Callable[[], None],
    ) -> None:
        self._side = side
        self._board = Board(side.name)
        self._domain = domain
        self.rank = rank
        self.timeout = timeout
        self.stats = stats
        self._pipelines = pipelines  # sync="step" at the op level: a step's round stays in flight
        self._whole_stream = whole_stream
        self._peer_streams = peer_streams
        self._stream_members = stream_members
        self._window = window
        self._inits = inits
        self._program = program
        self._divergences = divergences
        self._replicas = replicas
        self._seed_calls = seed_calls
        self._lock = lock
        self._emit = emit
        self._publish = publish
        self._progress = progress  # after each exchange: the mode keeps its report on disk current
        self.joins: Any = None  # torch's Join (join.Joins), set by the rank checker
        self.number = 0  # one numbering for every exchange (the store's arrival notes)
        self.inflight: Round | None = None  # posted, not yet waited for
        self.stopped = False
        self.busy = False

    def post_left(self, why: str) -> None:
        """This rank leaves the block early: tell the ranks that will wait for it."""
        self._board.post_left(self.rank, why)

    def exchange(
        self, point: Point, where: str, *, post: bool = True, joined: bool = False
    ) -> None:
        """Settle the round in flight, then post this point's (``post``) and, unless pipelined,
        settle it; ``joined``: this rank has run out of inputs inside torch's Join (P7)."""
        if self.stopped or self.busy or self._side.group is None:
            return
        if not dist.is_initialized():  # the program tore torch.distributed down inside the block
            log.info("rngcheck: torch.distributed was destroyed; cross-rank checks end here")
            self.stopped = True
            return
        finding = None
        with self._lock:
            if self.stopped:
                return
            self.busy = True
            try:
                # Our own tensors and collectives must not reach other dispatch modes (or ours).
                with unseen(), torch.no_grad():
                    finding = self._exchange_now(point, where, post, joined)
            finally:
                self.busy = False
                self._publish()
        if finding is not None:
            self._emit(finding)
        self._progress()

    def _exchange_now(self, point: Point, where: str, post: bool, joined: bool) -> Finding | None:
        # P2: the round posted at the previous exchange point first, before this one posts its
        # own, so the collectives on the side group stay in the same order everywhere.
        finding = self._settle(point, where)
        if finding is not None or self.stopped or not post:
            return finding
        if point is Point.JOIN and self.joins.apart:  # P7: a rank ran out of inputs: no rounds
            return None
        # The settle point of the parameter initialisations (and the per-rank seeding held back
        # with them): every rank gets here at the same round (P5).
        held = self._replicas.held() if self._inits.due else self._replicas.take_sampled()
        settling = self._inits.take(self._program.wrappers, {id(h.parameter) for h in held})
        self.number += 1
        self.stats.exchanges += 1
        taken = self._window.take()  # (the window belongs to the round until it is settled)
        for h in held:  # (streams over the replicated parameters' groups)
            self._stream_members[h.stream] = h.members
        vec, parts = fast_vector(
            self.number,
            point,
            taken.rows,
            self._whole_stream,
            [i.row for i in settling[0]] if settling is not None else None,
            self._peer_streams,
            joined=joined,
            extra=replica_rows(held),
        )
        # level="step": a sampled step's round is judged at once (the next step may be unchecked).
        # A Join round is settled at the iteration's optimizer step, or the next exchange (P7).
        pipelined = point is Point.JOIN or (self._pipelines and point in PIPELINED)
        sent = Round(
            number=self.number,
            point=point,
            where=where,
            taken=taken,
            vec=vec,
            parts=parts,
            # (a Join round is judged only when no rank ran out, and an empty one can differ only
            # in its point: its stack is taken then, if ever)
            stack=Stack.capture()
            if pipelined and not joined and (taken.rows or point is not Point.JOIN)
            else None,
            init=settling[0] if settling is not None else None,
            held=settling[2] if settling is not None else [],
            replicas=held if settling is not None or held else None,
            explaining=settling[1] if settling is not None else [],
        )
        try:
            sent.work = self._side.all_reduce_max(vec, fast=True, async_op=True)
        except PeerLost as e:
            self.stopped = True
            return self.missing(sent, point, where, e.__cause__ or e)
        self.inflight = sent
        if pipelined:
            return None
        return self._settle(point, where)  # P3

    def _settle(self, point: Point, where: str) -> Finding | None:
        """Wait for the round in flight (bounded by the timeout) and judge it; ``point`` and
        ``where``: where this rank is now (it waits there)."""
        sent, self.inflight = self.inflight, None
        if sent is None:
            return None
        waiting = time.monotonic()
        try:
            self._side.wait(sent.work)
            if joined(sent.vec):  # P7: a rank ran out of inputs in Join: nothing to compare
                self.joins.go_apart(sent.taken.events)
                if sent.init is not None:
                    # Its parameter initialisations are settled at the first exchange after the
                    # Join, on every rank (a rank that ran out may not have sent them).
                    self._inits.put_back(sent.init, sent.explaining, sent.held)
                return None
            mismatch, init_mismatch = disagreement(sent.vec)
            if not mismatch and int(sent.vec[-1]) > 0:
                # P4: the streams over parts of the group, then one flag for the whole group.
                local = self._side.check_partial_streams(sent.parts, self._stream_members)
                flag = torch.tensor([1 if local else 0], dtype=torch.int64)
                self._side.all_reduce_max(flag, fast=True)
                mismatch = bool(flag[0])
            finding = None
            taken = sent.taken
            if mismatch:
                self.stats.mismatches += 1
                finding = self._divergences.judge_round(
                    sent, taken.rows, taken.events, taken, init=False
                )
            if finding is None and init_mismatch and not self.stopped:
                self.stats.mismatches += 1
                assert sent.init is not None
                rows, events = [i.row for i in sent.init], [i.event for i in sent.init]
                finding = self._divergences.judge_round(sent, rows, events, taken, init=True)
            if finding is None and sent.held and not self._program.data_parallel:
                # Seeded per rank, and the program is not data-parallel: that draw came first,
                # and replicated parameters that differ in the same round are its consequence
                # (per-rank dropout masks, per-rank gradients), so it is the finding.
                finding = sent.held[0]
            if sent.replicas is not None:
                self._replicas.compared += len(sent.replicas)
                if finding is None and mismatch and not self.stopped:
                    finding = self._replicated(sent)
            if finding is not None:
                self.stopped = True  # P6
                self._window.take()
            else:
                self._count(taken, mismatch)
            return finding
        except PeerLost as e:  # gloo: the group timeout, or a peer that went away
            self.stopped = True
            waited = time.monotonic() - waiting
            return self.missing(sent, point, where, e.__cause__ or e, waited)

    def _count(self, taken: Taken, judged: bool) -> None:
        """What a round that settled without a finding compared (after what its slow path, if
        it ran, learnt)."""
        divergences = self._divergences
        apart = divergences.apart if judged else set()
        skipped = divergences.skipped if judged else set()
        per_rank = self._window.settled(taken, apart, skipped, self._divergences.per_rank)
        for i in per_rank:
            self._divergences.count_per_rank(taken.events[i])

    def _replicated(self, sent: Round) -> Finding | None:
        """A settling round that disagreed: the first replicated parameter whose digests differ
        (gathered), explained by its initialisations where these drew apart; None when the
        disagreement was elsewhere."""
        held = sent.replicas or []
        differs = first_difference(self._side, held)
        if differs is None:
            return None
        event = None
        if self.rank in differs.members:  # (its first initialisation on this rank, if seen)
            mine = [
                h.parameter for h in held if (h.name, h.members) == (differs.name, differs.members)
            ]
            event = next(
                (i.event for i in sent.explaining if mine and i.parameter() is mine[0]), None
            )
        detail = Detail(
            event=event,
            point=sent.where,
            seed_calls=self._seed_calls(event) if event is not None else (),
            wrappers=tuple(w.label for w in self._program.wrappers),
        )
        details = {
            r: Detail.from_dict(d) for r, d in self._side.gather_json(detail.to_dict()).items()
        }
        return replica_finding(
            differs.members, differs.name, differs.owner, differs.digests, details
        )

    def missing(
        self,
        sent: Round,
        point: Point,
        where: str,
        error: BaseException,
        waited: float | None = None,
    ) -> Finding:
        """A rank did not arrive at round ``sent``: its connection closed (its process ended), or
        it did not come in time. Find out which rank through the store, and what it said there,
        and say so. ``point`` and ``where``: where this rank waited for it; ``waited``: for how
        long (None: not known)."""
        stack = Stack.capture()
        here = point_text(point, where, stack)
        # A pipelined round was sent at an earlier point and waited for here.
        sent_at = point_text(sent.point, sent.where, sent.stack) if sent.stack is not None else here
        arrived = self._board.arrivals(sent.number, self.rank, self._domain, min(5.0, self.timeout))
        missing = tuple(r for r in self._domain if r not in arrived)
        events = sent.taken.events
        return missing_finding(
            rank=self.rank,
            domain=self._domain,
            arrived=arrived,
            left=self._board.left(missing or (self.rank,)),
            number=sent.number,
            here=here,
            sent_at=sent_at,
            timeout=self.timeout,
            last=events[-1] if events else None,
            stack=stack,
            error=error,
            closed=connection_closed(error),
            waited=waited,
            store=self._board.unreadable,
        )
