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
from typing import Any

import torch

from ..core.events import RandomOpEvent
from ..core.findings import Finding, FindingKind, Note
from ..core.handle import CheckerHandle
from .divergence import Divergences
from .exchange import PeerLost, SideGroup
from .explain import coverage_text, rank_notes
from .generators import GeneratorStates
from .groups import GroupResolver, MeshOp, Spans, op_mesh
from .hooks import Hooks, JoinSeen, library_version
from .integrations import registered
from .integrations.records import Frames, Hook, Integration, Wrapper
from .join import Joins
from .program import Program, optimizer_parameters
from .protocol import ExchangeStats, Point, text_hash
from .replicated import Initialisations, Replicas
from .rounds import Round, Rounds
from .scopes import Judge, peers_stream
from .step_digest import STEPS_PER_ROUND, StepVerdict
from .step_level import StepLevel
from .verdict import Domain
from .window import Taken, Window

__all__ = ["RankChecker"]

log = logging.getLogger(__name__)


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
        self._finished = False
        self._lock = threading.RLock()  # random ops in backward may arrive on autograd threads
        # The group-wide "same" stream rides in the fast vector; streams over parts of the group
        # ("differ" ones, expect(group=...), sub-mesh DTensors, peers) go through small groups.
        self._stream_members: dict[int, tuple[int, ...]] = {}
        self._peer_streams: dict[int, tuple[int, ...]] = {}  # checked at every round (P4)
        groups = GroupResolver(rank, world, domain)
        self.states = GeneratorStates(strict=cfg.strict)
        self.inits = Initialisations()
        self.program = Program()
        self.replicas = Replicas(self.program, rank, domain)
        self.judge = Judge(
            self.program,
            rank,
            domain,
            groups,
            self.states,
            self.inits,
            self._peers,
            self._read_gap,
        )
        self.window = Window(groups, self.states, self._stream_members, self.inits.defer)
        divergences = Divergences(
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
            self.program, self._on_wrapper, self._on_forward, self._on_join, self._gap
        )
        # every_steps > 1: only every Nth optimizer step is checked. Steps in between record no
        # rows and treat no collective as an alignment point, so they cost nothing here; a
        # divergence that starts on one still shows at the next checked step (the states differ).
        self._steps = 0
        self._checking = True
        self._spans = Spans(domain)  # whether a collective's group holds every rank here
        self._steps_level: StepLevel | None = None
        if cfg.level == "step":  # (on a gloo group of its own, ``step_side``)
            steps = SideGroup(step_side or side, domain, rank, timeout, self.stats)
            self._steps_level = StepLevel(
                steps, step_side is not None, self.judge, self.states, rank, domain
            )
        # level="step": a sampled step's round is judged at once (the next may be unchecked).
        self.rounds = rounds = Rounds(
            side=self._side,
            domain=domain,
            rank=rank,
            timeout=timeout,
            stats=self.stats,
            pipelines=cfg.sync == "step" and self._steps_level is None,
            whole_stream=text_hash("same", ",".join(map(str, domain))),
            peer_streams=self._peer_streams,
            stream_members=self._stream_members,
            window=self.window,
            inits=self.inits,
            program=self.program,
            divergences=divergences,
            replicas=self.replicas,
            seed_calls=self._seed_calls,
            lock=self._lock,
            emit=handle.emit,
            publish=self.publish,
            progress=handle.progress,
        )
        self._joins = rounds.joins = Joins(
            rank,
            domain,
            rounds.exchange,
            self.window.take,
            lambda event, why: self.window.skip(event, why, rank),
            self.judge.count,
            self.inits.settle_due,
            self._lock,
        )
        handle.identify(rank, world)
        self.publish()
        self._hooks.install()  # last: nothing after it can fail and leave its patches behind

    # -- inputs from the mode ----------------------------------------------------------------

    def on_event(self, event: RandomOpEvent, mesh: Any = None, written: Any = None) -> None:
        """A random op of this rank; ``mesh``: a DTensor op's (a ``MeshOp``, from
        :meth:`mesh_of`); ``written``: the tensor an in-place op wrote, if any."""
        if self.rounds.stopped or self.rounds.busy:
            return
        if self._joins.apart:  # P7: each rank runs its own iterations now
            with self._lock:
                self._joins.skip(event)
            return
        if not self._checking:
            level = self._steps_level
            if level is not None and level.in_pass:
                with self._lock:
                    level.pass_draw(event, self._steps + 1)
            return
        verdict = self.judge.judge(event, mesh.mesh if mesh is not None else None, written)
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
        if self._joins.inside:  # P7: Join's own rounds only
            return
        if self._cfg.sync == "op":
            self.rounds.exchange(Point.RANDOM_OP, event.op)
        elif self.window.now.in_order >= self._cfg.every_ops:
            self.rounds.exchange(Point.EVERY, "")

    def adopt_splits(self, events: Iterable[RandomOpEvent]) -> int:
        """Random ops drawn before this checker started that an order every rank must draw
        alike explains from their captured stacks (a script that reads its rank from the
        environment may split its data before it initialises torch.distributed): compared at
        the first exchange point, by state, as later ones are. Each rank adopts its own, in
        order, from the same schedule (P5); how many it adopted."""
        if self.rounds.stopped or not self._checking:
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
            and not self.rounds.stopped
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
    def mesh_of(args: tuple, kwargs: dict) -> MeshOp | None:
        """The DeviceMesh a random op runs over (a DTensor op) with its DTensor's placements, or
        None."""
        return op_mesh(args, kwargs)

    def on_collective(self, func: Any, args: tuple = ()) -> None:
        """A collective over the whole group is an exchange point, but not one in the backward of
        a wrapper whose communication hook chains its collectives (each rank sees as many of them
        as its futures' timing allows)."""
        self._hooks.refresh()
        if (
            self._checking
            and not self._joins.inside
            and self._spans(args)
            and not self.program.in_chained_backward(torch._C._current_graph_task_id() != -1)
        ):
            self.rounds.exchange(Point.COLLECTIVE, str(func))

    @property
    def apart(self) -> bool:
        """A rank ran out of inputs inside torch's Join: each rank runs its own iterations."""
        return self._joins.apart

    def check(self) -> None:
        if self._joins.inside:  # P7: not every rank calls it there
            log.info("rngcheck: mode.check() inside torch's Join is no exchange point")
            return
        self.inits.settle_due()
        self.rounds.exchange(Point.CHECK, "mode.check()")

    def finish(self) -> StepVerdict | None:
        """The block ends normally: the last exchanges. Returns the verdict of the last
        step-level round (level="step"), or None."""
        self._finished = True
        self.inits.settle_due()
        verdict = None
        if self._steps_level is not None and not self.rounds.stopped:
            # The steps not yet sent, before the exit round (the same order everywhere).
            verdict = self.step_level(self._steps + 1, [], False, False, post=False)
        self.rounds.exchange(Point.EXIT, "")
        return verdict

    def close(self, exc: BaseException | None = None) -> None:
        """Stop; ``exc``: the exception that ended the checked block (else the one in flight)."""
        if self._steps_level is not None:
            self._steps_level.digests.drop()
            self._steps_level.digests.close()
        self._hooks.uninstall()
        rounds = self.rounds
        if not (self._finished or rounds.stopped):
            # Leaving early (an exception in the block): tell the ranks that will wait for us.
            exc = exc if exc is not None else sys.exc_info()[1]
            why = f"{type(exc).__name__}: {exc}" if exc is not None else "no exception seen"
            rounds.post_left(why[:300])
        rounds.stopped = True
        rounds.inflight = None  # not waited for: the others learn from the store, or time out
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
        self.replicas.on_step(optimizer)
        self._hooks.refresh(if_imported=True)
        self.inits.settle_due()
        if self._joins.inside:
            # P7: no exchange point, but this iteration's Join round is settled first: a step
            # taken after a rank ran out of inputs counts on no rank.
            inflight = self.rounds.inflight
            if inflight is not None and inflight.point is Point.JOIN:
                self.rounds.exchange(Point.JOIN, f"{type(optimizer).__name__}.step()", post=False)
            if self._joins.apart:
                return
        elif self._checking and self._cfg.sync == "step":
            self.rounds.exchange(Point.OPTIMIZER_STEP, f"{type(optimizer).__name__}.step()")
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
        # (a sampled step compares the replicated parameters again, read at its first forward)
        self.replicas.sampling = checking and self.inits.settled

    def step_level(
        self, step: int, generators: Any, escalate: bool, sampled: bool, post: bool = True
    ) -> StepVerdict | None:
        """level="step", at every optimizer step: post the digests of this step's ``generators``
        and this rank's wish to escalate; returns the verdict of the previous step's round (the
        same on every rank), or None. A rank that does not arrive in time is rank_missing."""
        level = self._steps_level
        rounds = self.rounds
        if level is None or rounds.stopped or self._side.group is None:
            return None
        found: list[Finding] = []
        verdict = None
        with self._lock:
            rounds.busy = True
            rounds.number += 1  # one numbering for every exchange (the store's arrival notes)
            try:
                verdict, found = level.exchange(step, generators, escalate, sampled, post)
            except PeerLost as e:
                rounds.stopped = True
                level.digests.drop()
                where = f"the step-level exchange of step {step}"
                sent = Round(rounds.number, Point.OPTIMIZER_STEP, where, Taken(), _NO_VEC, {}, None)
                found = [rounds.missing(sent, Point.OPTIMIZER_STEP, where, e.__cause__ or e)]
            finally:
                rounds.busy = False  # (the counters reach the report when it is read: publish)
        for finding in found:
            self._handle.emit(finding)
        self._handle.progress()
        return verdict

    # -- what the hooks tell -------------------------------------------------------------------

    def _on_wrapper(self, wrapper: Wrapper) -> None:
        """A data-parallel wrapper is being built (before its own collectives) or first ran."""
        with self._lock:
            # Its peers' stream is known from here on every peer, at the same point of the
            # program, before any of its ops (P4: every peer checks it at every round).
            self.judge.peers_of(wrapper)
            self.inits.on_wrapper(wrapper)

    def _on_forward(self) -> None:
        """A data-parallel wrapper's outermost forward begins."""
        self.inits.settle_due()
        self.replicas.on_forward()

    def _on_join(self, what: str, join: JoinSeen) -> None:
        self._joins.on_join(what, join)

    def _peers(self, peers: tuple[int, ...]) -> None:
        stream = peers_stream(peers)
        self._peer_streams[stream] = peers
        self._stream_members[stream] = peers

    def _gap(self, integration: Integration, hook: Hook, why: str) -> None:
        """A hook the installed library does not allow: loud, once (the handle warns and notes)."""
        self._handle.coverage(coverage_text(integration, hook, library_version(integration), why))

    def _read_gap(self, hook: Frames, why: str) -> None:
        integration = next(i for i in registered() if hook in i.hooks)
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

    def _seed_calls(self, event: RandomOpEvent) -> tuple[Any, ...]:
        """Seeding calls since the mode started that reached this op's generator (its first op)."""
        if event.out_of_band is not None or not event.generator.is_default:
            return ()
        calls = self._handle.seeding_calls(0, event.generator.device)
        return tuple(c for c in calls if not c.by_torch)

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
            "initialisations_replaced": self.inits.replaced,
            "replicated_parameters": self.replicas.compared,
            "step_rounds": level.digests.rounds if level is not None else 0,
            "not_compared": not_compared,
        }


_NO_VEC = torch.zeros(1, dtype=torch.int64)
