"""The rank checker: this rank's random ops in, rounds of the exchange protocol out
(``protocol.py``, rules P1 to P7), and a finding when the ranks that must agree do not.

Each op gets its verdict from the judge (``scopes.py``: the one principle, the scopes the
integrations open, what was learnt) and becomes a row of the pending window (``window.py``), or
is left uncompared. Rows wait until an exchange point: every random op (``sync="op"``) or
optimizer steps, every ``every_ops`` random ops, ``check()`` and exit (``sync="step"``), plus
every torch.distributed collective over the whole group (an alignment point in both modes);
inside torch's Join, Join's own points only (P7). A round that does not agree goes to the slow
path (``divergence.py``); parameter initialisations are settled at the first step
(``replicated.py``).
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..core.events import RandomOpEvent
from ..core.findings import Finding, FindingKind, Note
from ..core.handle import CheckerHandle
from ..core.stacks import Stack
from .board import Board
from .divergence import Divergences
from .exchange import PeerLost, SideGroup
from .explain import coverage_text, rank_notes
from .findings import missing_finding, point_text
from .generators import GeneratorStates
from .groups import GroupResolver, op_mesh
from .hooks import Hooks, JoinSeen, library_version
from .integrations.records import Frames, Hook, Integration, Wrapper
from .program import Program, optimizer_parameters
from .protocol import PIPELINED, ExchangeStats, Point, disagreement, fast_vector, joined, text_hash
from .replicated import Init, Initialisations
from .scopes import Judge, peers_stream
from .step_digest import STEPS_PER_ROUND, StepVerdict
from .step_level import StepLevel
from .verdict import Compare, Domain, Reason, Verdict
from .window import Taken, Window

__all__ = ["RankChecker"]

log = logging.getLogger(__name__)

_PROCESS_GROUP = dist.ProcessGroup  # (a collective's group, unboxed from its op's arguments)


@dataclass(slots=True)
class _Round:
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
    work: Any = None


class RankChecker:
    """Exchanges this rank's random-op digests with the other ranks of its group.

    Made by :func:`~rngcheck.ranks.startup.start` on every rank (collectively: it creates the
    checker's gloo groups).

    Known limitations:
        A collective on a subgroup called by a non-member returns without reaching the dispatcher,
        so that rank sees one alignment point fewer: call subgroup collectives on members only.
        ``expect("differ")`` finds ranks that share a state over a whole window (or at one op,
        with ``sync="op"``), not a pair that collides at one op of a longer window. Streams are
        checked within the rank's ``group`` (its partition), not across partitions.
    """

    def __init__(
        self,
        handle: CheckerHandle,
        side: Any,
        domain: tuple[int, ...],
        rank: int,
        world: int,
        timeout: float,
        step_side: Any = None,
    ):
        self._handle = handle
        self._cfg = cfg = handle.config
        self._domain = domain
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.stats = ExchangeStats()
        self._side = SideGroup(side, domain, rank, timeout, self.stats)
        self._board = Board(self._side.name)
        self._round = 0
        self._inflight: _Round | None = None  # posted, not yet waited for
        self._stopped = False
        self._finished = False
        self._busy = False
        self._lock = threading.RLock()  # random ops in backward may arrive on autograd threads
        # The group-wide "same" stream rides in the fast vector; streams over parts of the group
        # ("differ" ones, expect(group=...), sub-mesh DTensors, peers) go through small groups.
        self._whole_stream = text_hash("same", ",".join(map(str, domain)))
        self._stream_members: dict[int, tuple[int, ...]] = {}
        self._peer_streams: dict[int, tuple[int, ...]] = {}  # checked at every round (P4)
        groups = GroupResolver(rank, world, domain)
        self.states = GeneratorStates(strict=cfg.strict)
        self.inits = Initialisations()
        self.program = Program()
        self.judge = Judge(
            self.program, rank, domain, groups, self.states, self._peers, self._read_gap
        )
        self.window = Window(groups, self.states, self._stream_members, self.inits.defer)
        self._divergences = Divergences(
            self._side,
            rank,
            domain,
            self.states,
            self.judge,
            self.inits,
            self._peer_streams,
            self._seed_calls,
        )
        self._hooks = Hooks(
            self.program, self._on_wrapper, self.inits.settle_due, self._on_join, self._gap
        )
        # every_steps > 1: only every Nth optimizer step is checked. Steps in between record no
        # rows and treat no collective as an alignment point, so they cost nothing here; a
        # divergence that starts on one still shows at the next checked step (the states differ).
        self._steps = 0
        self._checking = True
        self._spans: dict[str, bool] = {}  # process group name -> it holds every rank here
        self._steps_level: StepLevel | None = None
        if cfg.level == "step":  # (on a gloo group of its own, ``step_side``)
            steps = SideGroup(step_side or side, domain, rank, timeout, self.stats)
            self._steps_level = StepLevel(
                steps, step_side is not None, self.judge, self.states, rank, domain
            )
        # torch's Join (P7): per Join this thread is in, innermost last, its label when its group
        # is this checker's ("" for one over a subgroup: not followed); whether a rank is known to
        # have run out of inputs in them.
        self._joins: list[str] = []
        self.apart = False
        handle.identify(rank, world)
        self.publish()
        self._hooks.install()  # last: nothing after it can fail and leave its patches behind

    # -- inputs from the mode ----------------------------------------------------------------

    def on_event(self, event: RandomOpEvent, mesh: Any = None, written: Any = None) -> None:
        """A random op of this rank; ``written``: the tensor an in-place op wrote, if any."""
        if self._stopped or self._busy:
            return
        if self.apart:  # P7: each rank runs its own iterations now
            with self._lock:
                self._join_skip(event)
            return
        if not self._checking:
            level = self._steps_level
            if level is not None and level.in_pass:
                with self._lock:
                    level.pass_draw(event, self._steps + 1)
            return
        verdict = self.judge.judge(event, mesh, written)
        with self._lock:
            if not verdict.compared:
                self.window.skip(event, verdict, self.rank)
                return
            self.window.add(event, verdict, mesh, written)
            if verdict.domain is Domain.PEERS:
                # Across the wrapper's group it is the wrapper's, as any op of its forward, and it
                # posts no round: the group's rounds follow the group's order (P1), and the other
                # data-parallel ranks may run other ops here.
                self.window.skip(event, verdict, self.rank)
                return
        if any(self._joins):  # P7: Join's own rounds only
            return
        if self._cfg.sync == "op":
            self._exchange(Point.RANDOM_OP, event.op)
        elif self.window.now.in_order >= self._cfg.every_ops:
            self._exchange(Point.EVERY, "")

    def adopt_splits(self, events: Iterable[RandomOpEvent]) -> int:
        """Random ops drawn before this checker started that an order every rank must draw
        alike explains from their captured stacks (a script that reads its rank from the
        environment may split its data before it initialises torch.distributed): compared at
        the first exchange point, by state, as later ones are. Each rank adopts its own, in
        order, from the same schedule (P5); how many it adopted."""
        if self._stopped or not self._checking:
            return 0
        adopted = 0
        with self._lock:
            for event in events:
                order = self.judge.recorded_order(event) if event.expect == "same" else None
                if order is not None:
                    self.window.add(event, order, None, None)
                    adopted += 1
        return adopted

    @property
    def wants_passes(self) -> bool:
        """level="step", between samples, in a data-parallel program: the orders drawn as passes
        over the data begin are worth a window (passes.py)."""
        return (
            self._steps_level is not None
            and not self._checking
            and not self._stopped
            and self.program.data_parallel
        )

    def pass_window(self, open_: bool) -> None:
        if self._steps_level is not None:
            self._steps_level.pass_window(open_)

    @property
    def passes_apart(self) -> int:
        level = self._steps_level
        return level.digests.passes_apart if level is not None else 0

    @property
    def passes_compared(self) -> int:
        level = self._steps_level
        return level.digests.passes_compared if level is not None else 0

    @staticmethod
    def mesh_of(args: tuple, kwargs: dict) -> Any:
        """The DeviceMesh a random op runs over (a DTensor op), or None."""
        return op_mesh(args, kwargs)

    def on_collective(self, func: Any, args: tuple = ()) -> None:
        """A collective over the whole group is an exchange point, but not one in the backward of
        a wrapper whose communication hook chains its collectives (each rank sees as many of them
        as its futures' timing allows)."""
        self._hooks.refresh()
        if (
            self._checking
            and not any(self._joins)
            and self._spans_domain(args)
            and not self.program.in_chained_backward(torch._C._current_graph_task_id() != -1)
        ):
            self._exchange(Point.COLLECTIVE, str(func))

    def _spans_domain(self, args: tuple) -> bool:
        """Whether a collective (its op's ``args``) runs over every rank this checker exchanges
        with. One over a subgroup (a data-parallel group beside pipeline stages, a
        tensor-parallel group) runs on its ranks only, while the others send, receive or
        compute: waiting for them there would hang until the timeout. True when the op names
        no process group."""
        for arg in args:
            if not isinstance(arg, torch.ScriptObject):
                continue
            try:
                group = _PROCESS_GROUP.unbox(arg)
            except RuntimeError:  # another kind of object (a ReduceOp)
                continue
            name = group.group_name
            spans = self._spans.get(name)
            if spans is None:
                try:
                    ranks = set(dist.get_process_group_ranks(group))
                except (KeyError, ValueError, RuntimeError):  # a group c10d does not list
                    return True  # (aligned on, as every collective was)
                spans = self._spans[name] = ranks.issuperset(self._domain)
            return spans
        return True

    def check(self) -> None:
        if any(self._joins):  # P7: not every rank calls it there
            log.info("rngcheck: mode.check() inside torch's Join is no exchange point")
            return
        self.inits.settle_due()
        self._exchange(Point.CHECK, "mode.check()")

    def finish(self) -> StepVerdict | None:
        """The block ends normally: the last exchanges. Returns the verdict of the last
        step-level round (level="step"), or None."""
        self._finished = True
        self.inits.settle_due()
        verdict = None
        if self._steps_level is not None and not self._stopped:
            # The steps not yet sent, before the exit round (the same order everywhere).
            verdict = self.step_level(self._steps + 1, [], False, False, post=False)
        self._exchange(Point.EXIT, "")
        return verdict

    def close(self, exc: BaseException | None = None) -> None:
        """Stop; ``exc``: the exception that ended the checked block (else the one in flight)."""
        if self._steps_level is not None:
            self._steps_level.digests.drop()
            self._steps_level.digests.close()
        self._hooks.uninstall()
        if not (self._finished or self._stopped):
            # Leaving early (an exception in the block): tell the ranks that will wait for us.
            exc = exc if exc is not None else sys.exc_info()[1]
            why = f"{type(exc).__name__}: {exc}" if exc is not None else "no exception seen"
            self._board.post_left(self.rank, why[:300])
        self._stopped = True
        self._inflight = None  # not waited for: the others learn from the store, or time out
        self.window.take()
        self._side.close()
        self.publish()

    def renders(self, finding: Finding) -> bool:
        """One merged rendering: the lowest rank that is involved (or that waited) draws it."""
        if finding.kind is FindingKind.RANK_MISSING:
            waited = finding.sides[0].ranks if finding.sides else ()
            return self.rank == min(waited or (self.rank,))
        if not finding.ranks:
            return True  # a local finding (a recompute mismatch): each rank draws its own
        return self.rank == min(finding.ranks)

    def on_step(self, optimizer: Any) -> None:
        """An optimizer step ended (the mode calls this, from its one step hook)."""
        self.program.on_step()
        self._hooks.refresh(if_imported=True)
        self.inits.settle_due()
        if any(self._joins):
            # P7: no exchange point, but this iteration's Join round is settled first: a step
            # taken after a rank ran out of inputs counts on no rank.
            inflight = self._inflight
            if inflight is not None and inflight.point is Point.JOIN:
                self._exchange(Point.JOIN, f"{type(optimizer).__name__}.step()", post=False)
            if self.apart:
                return
        elif self._checking and self._cfg.sync == "step":
            self._exchange(Point.OPTIMIZER_STEP, f"{type(optimizer).__name__}.step()")
        self._steps += 1
        if self._steps_level is None:
            self._checking = self._steps % self._cfg.every_steps == 0

    def trains_replicas(self, optimizer: Any, lead: Collection[Any] = ()) -> bool:
        """Whether ``optimizer`` steps parameters of a known data-parallel wrapper's module or
        of a pipeline stage, the training every rank runs, or of ``lead``."""
        return self.program.trains(optimizer, lead)

    def replicas_trained(self, optimizer: Any) -> weakref.WeakSet[Any] | None:
        """A new lead's parameters, held weakly, when it trains replicas (above), else None."""
        if not self.program.trains(optimizer):
            return None
        return weakref.WeakSet(optimizer_parameters(optimizer))

    def set_checking(self, checking: bool, rebase: tuple[int, ...] = ()) -> None:
        """level="step": whether the coming step is checked op by op (the same on every rank).
        ``rebase``: the digest slots that drifted apart between samples: their generators are
        compared op for op in it (what ran, with which arguments) but not by state, so a rank
        that keeps drawing extra numbers is named at its op and line."""
        self._checking = checking
        self.states.set_rebase(rebase if checking else ())

    def step_level(
        self, step: int, generators: Any, escalate: bool, sampled: bool, post: bool = True
    ) -> StepVerdict | None:
        """level="step", at every optimizer step: post the digests of this step's ``generators``
        and this rank's wish to escalate; returns the verdict of the previous step's round (the
        same on every rank), or None. A rank that does not arrive in time is rank_missing."""
        level = self._steps_level
        if level is None or self._stopped or self._side.group is None:
            return None
        found: list[Finding] = []
        verdict = None
        with self._lock:
            self._busy = True
            self._round += 1  # one numbering for every exchange (the store's arrival notes)
            try:
                verdict, found = level.exchange(step, generators, escalate, sampled, post)
            except PeerLost as e:
                self._stopped = True
                level.digests.drop()
                where = f"the step-level exchange of step {step}"
                sent = _Round(self._round, Point.OPTIMIZER_STEP, where, Taken(), _NO_VEC, {}, None)
                found = [self._missing(sent, Point.OPTIMIZER_STEP, where, e.__cause__ or e)]
            finally:
                self._busy = False  # (the counters reach the report when it is read: publish)
        for finding in found:
            self._handle.emit(finding)
        return verdict

    # -- what the hooks tell -------------------------------------------------------------------

    def _on_wrapper(self, wrapper: Wrapper) -> None:
        """A data-parallel wrapper is being built (before its own collectives) or first ran."""
        with self._lock:
            # Its peers' stream is known from here on every peer, at the same point of the
            # program, before any of its ops (P4: every peer checks it at every round).
            self.judge.peers_of(wrapper)
            self.inits.on_wrapper(wrapper)

    def _peers(self, peers: tuple[int, ...]) -> None:
        stream = peers_stream(peers)
        self._peer_streams[stream] = peers
        self._stream_members[stream] = peers

    def _gap(self, integration: Integration, hook: Hook, why: str) -> None:
        """A hook the installed library does not allow: loud, once (the handle warns and notes)."""
        self._handle.coverage(coverage_text(integration, hook, library_version(integration), why))

    def _read_gap(self, hook: Frames, why: str) -> None:
        integration = next(i for i in _registered() if hook in i.hooks)
        self._hooks.gap(integration, hook, f"reading it failed ({why})")

    def notes(self) -> list[Note]:
        """What was left uncompared, and why, for the report (``rngcheck show``)."""
        level = self._steps_level
        return rank_notes(
            exempted=self.judge.exempted,
            broadcast=self.inits.broadcast,
            replaced=self.inits.replaced,
            noted=list(self.states.noted.values()),
            per_rank=list(self.states.per_rank.values()),
            wrappers=[w.label for w in self.program.wrappers],
            passes_apart=self.passes_apart,
            steps_apart=level.digests.steps_apart if level is not None else None,
            steps_per_round=STEPS_PER_ROUND,
        )

    # -- torch's Join: uneven inputs (P7) ---------------------------------------------------------

    def _on_join(self, what: str, join: JoinSeen) -> None:
        """What the hooks saw of a Join on this thread (see hooks.JoinEvent)."""
        if what == "enter":
            self._joins.append(join.label if set(join.ranks) >= set(self._domain) else "")
            return
        if not self._joins or not self._joins[-1]:
            if what == "left" and self._joins:
                self._joins.pop()
            return
        label = self._joins[-1]
        if what == "round":
            self._exchange(Point.JOIN, f"{label}'s notify_join_context")
        elif what == "exit":
            if not self.apart:
                self._exchange(Point.JOIN, f"{label}.__exit__", joined=True)
                with self._lock:
                    self._go_apart(())
        elif what == "left":
            self._joins.pop()
            if any(self._joins):
                return
            # Every rank has run out of inputs and left Join.__exit__ together: the round this
            # rank posted as it ran out is settled, and the ranks compare again from here.
            self._exchange(Point.JOIN, f"{label}.__exit__", post=False)
            with self._lock:
                for event in self.window.take().events:
                    self._join_skip(event)
            self.apart = False
            self.inits.settle_due()

    def _go_apart(self, events: Iterable[RandomOpEvent]) -> None:
        """A rank has run out of inputs: the ranks' windows (``events``, and this rank's since)
        are not compared; nothing is until this rank's Join.__exit__ returns."""
        self.apart = True
        for event in [*events, *self.window.take().events]:
            self._join_skip(event)

    def _join_skip(self, event: RandomOpEvent) -> None:
        label = next((j for j in self._joins if j), "Join")  # the outermost one followed
        self.judge.count(Reason.JOIN, label)
        self.window.skip(event, Verdict(Domain.RANK, Compare.NONE, Reason.JOIN, label), self.rank)

    # -- exchange ----------------------------------------------------------------------------

    def _exchange(
        self, point: Point, where: str, *, post: bool = True, joined: bool = False
    ) -> None:
        """Settle the round in flight, then post this point's (``post``) and, unless pipelined,
        settle it; ``joined``: this rank has run out of inputs inside torch's Join (P7)."""
        if self._stopped or self._busy or self._side.group is None:
            return
        if not dist.is_initialized():  # the program tore torch.distributed down inside the block
            log.info("rngcheck: torch.distributed was destroyed; cross-rank checks end here")
            self._stopped = True
            return
        finding = None
        with self._lock:
            if self._stopped:
                return
            self._busy = True
            try:
                # Our own tensors and collectives must not reach other dispatch modes (or ours).
                with torch._C._DisableTorchDispatch(), torch.no_grad():
                    finding = self._exchange_now(point, where, post, joined)
            finally:
                self._busy = False
                self.publish()
        if finding is not None:
            self._handle.emit(finding)

    def _exchange_now(self, point: Point, where: str, post: bool, joined: bool) -> Finding | None:
        # P2: the round posted at the previous exchange point first, before this one posts its
        # own, so the collectives on the side group stay in the same order everywhere.
        finding = self._settle(point, where)
        if finding is not None or self._stopped or not post:
            return finding
        if point is Point.JOIN and self.apart:  # P7: a rank ran out of inputs: no more rounds
            return None
        # The settle point of the parameter initialisations (and the per-rank seeding held back
        # with them): every rank gets here at the same round (P5).
        settling = self.inits.take(self.program.wrappers)
        self._round += 1
        self.stats.exchanges += 1
        taken = self.window.take()  # (the window belongs to the round until it is settled)
        vec, parts = fast_vector(
            self._round,
            point,
            taken.rows,
            self._whole_stream,
            [i.row for i in settling[0]] if settling is not None else None,
            self._peer_streams,
            joined=joined,
        )
        # level="step": a sampled step's round is judged at once (the next step may be unchecked).
        # A Join round is settled at the iteration's optimizer step, or the next exchange (P7).
        pipelined = point is Point.JOIN or (
            self._cfg.sync == "step" and point in PIPELINED and self._steps_level is None
        )
        sent = _Round(
            number=self._round,
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
            held=settling[1] if settling is not None else [],
        )
        try:
            sent.work = self._side.all_reduce_max(vec, fast=True, async_op=True)
        except PeerLost as e:
            self._stopped = True
            return self._missing(sent, point, where, e.__cause__ or e)
        self._inflight = sent
        if pipelined:
            return None
        return self._settle(point, where)  # P3

    def _settle(self, point: Point, where: str) -> Finding | None:
        """Wait for the round in flight (bounded by the timeout) and judge it; ``point`` and
        ``where``: where this rank is now (it waits there)."""
        sent, self._inflight = self._inflight, None
        if sent is None:
            return None
        try:
            self._side.wait(sent.work)
            if joined(sent.vec):  # P7: a rank ran out of inputs in Join: nothing to compare
                self._go_apart(sent.taken.events)
                if sent.init is not None:
                    # Its parameter initialisations are settled at the first exchange after the
                    # Join, on every rank (a rank that ran out may not have sent them).
                    self.inits.put_back(sent.init, sent.held)
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
            if finding is None and init_mismatch and not self._stopped:
                self.stats.mismatches += 1
                assert sent.init is not None
                rows, events = [i.row for i in sent.init], [i.event for i in sent.init]
                finding = self._divergences.judge_round(sent, rows, events, taken, init=True)
            if finding is None and sent.held and not self.program.data_parallel:
                finding = sent.held[0]  # seeded per rank, and the program is not data-parallel
            if finding is not None:
                self._stopped = True  # P6
                self.window.take()
            return finding
        except PeerLost as e:  # gloo: the group timeout, or a peer that went away
            self._stopped = True
            return self._missing(sent, point, where, e.__cause__ or e)

    def _seed_calls(self, event: RandomOpEvent) -> tuple[Any, ...]:
        """Seeding calls since the mode started that reached this op's generator (its first op)."""
        if event.out_of_band is not None or not event.generator.is_default:
            return ()
        calls = self._handle.seeding_calls(0, event.generator.device)
        return tuple(c for c in calls if not c.by_torch)

    def _missing(self, sent: _Round, point: Point, where: str, error: BaseException) -> Finding:
        """A rank did not arrive at round ``sent`` in time: find out which through the store, and
        say so. ``point`` and ``where``: where this rank waited for it."""
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
        )

    def publish(self) -> None:
        """The exchange counters, and what was compared and how, into the report's metadata (at
        every op-level exchange; for the step level's, when the report is read)."""
        meta = self._handle.meta
        meta["rank_exchange"] = self.stats.to_dict()
        not_compared: dict[str, int] = {}
        for key, count in self.judge.exempted.items():
            reason = "among_peers_only" if key.among else key.reason.value
            not_compared[reason] = not_compared.get(reason, 0) + count
        level = self._steps_level
        meta["rank_compared"] = {
            **self.window.compared,
            "initialisations": self.inits.compared,
            "initialisations_broadcast": sum(self.inits.broadcast.values()),
            "step_rounds": level.digests.rounds if level is not None else 0,
            "not_compared": not_compared,
        }


_NO_VEC = torch.zeros(1, dtype=torch.int64)


def _registered() -> tuple[Integration, ...]:
    from .integrations import registered

    return registered()
