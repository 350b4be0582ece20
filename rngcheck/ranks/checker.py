"""The rank checker: this rank's random ops in, rounds of the exchange protocol out
(``protocol.py``), and a finding when the ranks that must agree do not.

Rows wait in the pending window until an exchange point: every random op (``sync="op"``) or
optimizer steps, every ``every_ops`` random ops, ``check()`` and exit (``sync="step"``), plus every
torch.distributed collective the mode sees (an alignment point in both modes). Which rows are
compared follows the data-parallel rules (Rules 1 to 8, docs/data-parallel.md):
ops of a data-parallel forward/backward (but among its tensor-parallel peers, who share a batch),
of per-rank streams, of one rank reading every rank's batches and of a rank loading its own share
of the data are not compared, parameter
initialisations are settled at the first step unless a wrapper broadcast them, an order a
sampler splits among the ranks is compared by state, and a generate() call on a model no
wrapper wraps is compared as a call, not by what it samples.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..core.comm_hooks import FORKING_HOOKS, comm_hook_drawing
from ..core.events import BACKWARD, FORWARD, RandomOpEvent
from ..core.findings import Finding, FindingKind, Note
from ..core.handle import CheckerHandle
from ..core.policy import current_expectation
from ..core.stacks import Stack
from .board import Board
from .data_parallel import DataParallelTracker, Wrapper, optimizer_parameters
from .data_reading import (
    DISPATCHER_MODULES,
    NOT_READING,
    SPLITS_A_DATASET,
    Reading,
    data_reading,
    drawn_by_random_split,
)
from .exchange import PeerLost, SideGroup
from .findings import (
    DATA_PARALLEL_WHY,
    DISPATCHED_WHY,
    GATHERED_WHY,
    GENERATE_WHY,
    JOIN_WHY,
    OWN_ARGUMENTS_WHY,
    OWN_COUNT_WHY,
    PIPELINE_ORDER,
    PIPELINE_WHY,
    SAMPLED_WHY,
    SHARE_WHY,
    STAGE_INIT_WHY,
    Detail,
    Uncompared,
    build_finding,
    count_key,
    counts_may_apply,
    data_parallel_drift,
    init_finding,
    line_key,
    missing_finding,
    own_arguments,
    own_count,
    pass_order_finding,
    per_rank_seeding,
    point_text,
    reseeded_by_user,
)
from .groups import GroupResolver, op_mesh
from .localise import localise
from .protocol import (
    PEERS,
    PIPELINED,
    POLICY_CODE,
    ExchangeStats,
    Point,
    Row,
    disagreement,
    fast_vector,
    gen_key,
    ident_key,
    joined,
    text_hash,
)
from .step_digest import (
    NO_PASS,
    STEPS_PER_ROUND,
    OrderSplit,
    StepDigests,
    StepVerdict,
    generator_name,
    seed_value,
    slot_of,
    slot_values,
)

__all__ = ["RankChecker"]

log = logging.getLogger(__name__)

_PROCESS_GROUP = dist.ProcessGroup  # (a collective's group, unboxed from its op's arguments)
_MAX_INIT = 100_000  # parameter initialisations kept for the settle point
_PASSES_KEPT = 64  # passes over the data whose first order draw is kept, for a finding


@dataclass(slots=True)
class _Init:
    """A random op that initialised a parameter: its state is compared at the settle point, and
    not at all if a data-parallel wrapper broadcasts that parameter first (Rule 4)."""

    row: Row
    event: RandomOpEvent
    parameter: weakref.ref[Any]  # dead once replaced (tied weights, or re-made)


class _Unchecked(NamedTuple):
    """Random ops a rank drew from a generator without comparing them, since its last checked
    op: their count, the last of them, and why. Made into an :class:`Uncompared` (with the last
    op's line) only when a divergence is localised: finding a line summarises the op's stack, a
    cost every uncompared op (each one of a data-parallel forward) would pay otherwise."""

    ops: int
    event: RandomOpEvent
    why: str
    read_alone: str = ""  # why the rank drew some of them alone, by design (Rule 6)

    def public(self) -> Uncompared:
        return Uncompared(self.ops, self.event.op, self.event.site, self.why, self.read_alone)


class _Judged(NamedTuple):
    """What the data-parallel rules say of one random op (``RankChecker._judge``)."""

    why: str  # why it is not compared across the ranks ("" when it is)
    order: str  # the sampler splitting among the ranks the order it drew, or random_split (Rule 5)
    call: str  # the generate() call it is the first op of, compared as that call (Rule 8), or ""
    peers: tuple[int, ...] = ()  # compared among these ranks alone, outside the group's order
    across: str = ""  # ... and why not across the group (Rule 2: the wrapper's), with peers


_COMPARED = _Judged("", "", "")


@dataclass(slots=True)
class _Round:
    """One exchange round: the fast vector sent, and the window it covers (kept until the round
    is settled, so a mismatch found one exchange later still localises the first divergent op)."""

    number: int
    point: Point
    where: str
    rows: list[Row]
    events: list[RandomOpEvent]
    first_use: set[int]
    uncompared: dict[int, _Unchecked]
    orders: dict[int, str]  # pending index -> the sampler splitting the order it drew (Rule 5)
    calls: dict[int, str]  # pending index -> the generate() call it was compared as (Rule 8)
    vec: torch.Tensor
    parts: dict[int, list[Row]]
    stack: Stack | None  # where this rank posted it (pipelined rounds); else taken when settled
    init: list[_Init] | None = None  # the parameter initialisations this round settles
    held: list[Finding] | None = None  # per-rank seeding held back until this round (Rule 3)
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
        self._cfg = handle.config
        self._domain = domain
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.stats = ExchangeStats()
        self._side = SideGroup(side, domain, rank, timeout, self.stats)
        self._board = Board(self._side.name)
        self._groups = GroupResolver(rank, world, domain)
        self._pending: list[RandomOpEvent] = []
        self._rows: list[Row] = []
        self._in_order = 0  # rows in the group's order in the window (all but peers rows)
        self._round = 0
        self._inflight: _Round | None = None  # posted, not yet waited for
        self._stopped = False
        self._finished = False
        self._busy = False
        # The group-wide "same" stream rides in the fast vector; streams over parts of the group
        # ("differ" ones, expect(group=...), sub-mesh DTensors) go through small gloo groups.
        self._whole_stream = text_hash("same", ",".join(map(str, domain)))
        self._stream_members: dict[int, tuple[int, ...]] = {}
        self._lock = threading.RLock()  # random ops in backward may arrive on autograd threads
        self._seen_generators: set[str] = set()
        self._first_use: set[int] = set()  # pending indices that are a generator's first op
        self._uncompared: dict[str, _Unchecked] = {}  # generator -> its uncompared ops since
        self._uncompared_before: dict[int, _Unchecked] = {}  # pending index -> those ops
        self._orders: dict[int, str] = {}  # pending index -> its sharding sampler (Rule 5)
        self._calls: dict[int, str] = {}  # pending index -> its generate() call (Rule 8)
        # Data parallelism, the rules of docs/data-parallel.md (cited as Rule N):
        # Rule 2, ops of a data-parallel forward/backward are not compared; Rule 3, a generator
        # seeded per rank in a data-parallel program is a per-rank stream; Rule 4, parameter
        # initialisations are settled at the first step, unless a wrapper broadcast them;
        # Rule 5, an order a sampler splits among the ranks is compared by state; Rule 6, the
        # ops of one rank reading every rank's batches (data_reading.py) or modifying parameters
        # ZeRO-3 broadcasts from it (data_parallel.py) are not compared; Rule 7, nor those of a
        # rank loading its own share of the data (data_reading.py); Rule 8, what a generate()
        # call on a model no wrapper wraps samples (the call itself is compared, by its first
        # op's place and the state it starts from); Rule 9, nor what a line draws from a default
        # generator with each rank's own arguments (findings.own_arguments), once seen so.
        self._dp = DataParallelTracker(  # installed last
            self._on_wrapper, self._settle_due, self._on_join
        )
        self._per_rank: dict[int, str] = {}  # generator digest -> why it is a per-rank stream
        self._per_rank_keys: set[str] = set()
        # Rule 2's wake: a generator the ranks moved apart in a data-parallel forward/backward
        # (per-rank shapes), loading their own shares of the data (Rule 7), or one rank alone
        # reading every rank's batches (Rule 6), is compared by what runs, not by state, until it
        # is reseeded.
        # gen_key -> (its initial seed on this rank then, how the ranks moved it apart).
        self._drifted: dict[str, tuple[int | None, str]] = {}
        # gen_key -> (the generator, how the ranks moved it apart: Rule 2's wake, Rules 6 and 7)
        self._drift_notes: dict[str, tuple[str, str]] = {}
        self._read_alone: dict[str, int] = {}  # why -> random ops this rank drew alone for it
        self._peer_sets: dict[tuple[int, ...], tuple[int, ...]] = {}  # a wrapper's peers, kept
        self._peer_streams: dict[int, tuple[int, ...]] = {}  # their streams -> members
        self._gathered: dict[int, int] = {}  # modifier rank -> ops in its GatheredParameters
        self._modifying = f"{GATHERED_WHY}{rank}"  # ... whose modifier is this rank: its own
        self._shares: dict[str, int] = {}  # what splits the data -> ops loading this rank's share
        # Rule 9: (generator, op) -> the lines that draw it with each rank's own arguments or a
        # number of times of each rank's own (as findings.line_key gives them; True: the
        # latter), and (line, which) -> the ops drawn there
        self._own_lines: dict[tuple[str, str], dict[tuple[tuple[str, int], ...], bool]] = {}
        self._own_drawn: dict[tuple[str, bool], int] = {}
        self._sampled: dict[str, int] = {}  # model class -> ops of its generate() calls, uncompared
        self._init: list[_Init] = []
        self._init_due = False  # the next exchange settles the parameter initialisations
        self._init_settled = False
        self._broadcast_inits: dict[str, int] = {}  # wrapper label -> initialisations it covered
        self._stage_inits: dict[str, int] = {}  # pipeline stage -> its own initialisations
        self._spans: dict[str, bool] = {}  # process group name -> it holds every rank here
        self._replaced_inits = 0  # initialisations of parameters gone by the settle point
        self._held: list[Finding] = []  # per-rank seeding seen before the program was known DP
        # every_steps > 1: only every Nth optimizer step is checked. Steps in between record no
        # rows and treat no collective as an alignment point, so they cost nothing here; a
        # divergence that starts on one still shows at the next checked step (the states differ).
        self._steps = 0
        self._checking = True
        # level="step": the mode decides which steps are checked op by op (set_checking), and
        # every step exchanges its generators' digests (step_level).
        self._digests: StepDigests | None = None
        self._rebase: frozenset[int] = frozenset()
        # level="step", between samples: the orders drawn at the start of each pass over the
        # data that a sampler splits among the ranks (Rule 5; passes.py), for the step rounds.
        self._in_pass = False  # the mode's window over a pass's first batch is open
        self._pass_begun = False  # ... and an order was drawn in it
        self._pass = NO_PASS  # passes so far, the latest one's digest, its first draw's seed
        # pass -> its first draw, the sampler, the step it was drawn at (on this rank)
        self._pass_draws: dict[int, tuple[RandomOpEvent | None, str, int]] = {}
        if self._cfg.level == "step":
            # (on a gloo group of its own, ``step_side``, closed with the checker)
            steps = SideGroup(step_side or side, domain, rank, timeout, self.stats)
            self._digests = StepDigests(steps, own_group=step_side is not None)
        # torch's Join (P7): per Join region this thread is in, innermost last, its label when
        # its group is this checker's ("" for one over a subgroup: not followed); whether a rank
        # is known to have run out of inputs in them; the random ops drawn from then, per Join.
        self._joins: list[str] = []
        self.apart = False
        self._join_ops: dict[str, int] = {}
        handle.identify(rank, world)
        self.publish()
        self._dp.install()  # last: nothing after it can fail and leave its patches behind

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
            if self._in_pass:
                self._pass_draw(event)
            return
        why, order, call, peers, across = self._judge(event, mesh)
        if not why and written is not None and self._dp.stages and not self._init_settled:
            why = self._stage_init(event, written)
        if why:
            with self._lock:
                self._skip(event, why)
            return
        with self._lock:
            self._add(event, mesh, written, order, call, peers)
            if call:  # (a generate() call's first op: what it drew is the rank's own, as the rest)
                self._uncompared[gen_key(event)] = _Unchecked(1, event, call, "")
            if peers:
                # Across the wrapper's group it is Rule 2's, as any op of its forward, and it
                # posts no round: the group's rounds follow the group's order (P1), and the
                # other data-parallel ranks may run other ops here.
                self._skip(event, across)
                return
        if any(self._joins):  # P7: Join's own rounds only
            return
        if self._cfg.sync == "op":
            self._exchange(Point.RANDOM_OP, event.op)
        elif self._in_order >= self._cfg.every_ops:
            self._exchange(Point.EVERY, "")

    def adopt_splits(self, events: Iterable[RandomOpEvent]) -> int:
        """Random ops that torch's random_split drew before this checker started (under
        RNGCHECK=1 it starts as the script initialises torch.distributed, and a script that reads
        its rank from the environment may split its data before that): compared at the first
        exchange point, by state, as the splits drawn later are (Rule 5). Each rank adopts its
        own, in order, from the same schedule (P5); how many it adopted."""
        if self._stopped or not self._checking:
            return 0
        picked = [e for e in events if e.expect == "same" and drawn_by_random_split(e)]
        with self._lock:
            for event in picked:
                self._add(event, None, None, SPLITS_A_DATASET)
        return len(picked)

    @property
    def wants_passes(self) -> bool:
        """level="step", between samples, in a data-parallel program: the orders drawn as passes
        over the data begin are worth a window (passes.py)."""
        return (
            self._digests is not None
            and not self._checking
            and not self._stopped
            and bool(self._dp.wrappers)
        )

    def pass_window(self, open_: bool) -> None:
        """level="step", between samples: the mode's window over the first batch of a pass
        over the data opens (its random ops now reach :meth:`on_event`) or closes."""
        self._in_pass = open_
        self._pass_begun = False

    @property
    def passes_apart(self) -> int:
        """Step rounds through whose second half the ranks had begun different numbers of
        passes over the data."""
        return self._digests.passes_apart if self._digests is not None else 0

    @property
    def passes_compared(self) -> int:
        """Passes over the data begun between samples whose orders were compared across ranks."""
        return self._digests.passes_compared if self._digests is not None else 0

    def _pass_draw(self, event: RandomOpEvent) -> None:
        """A random op of a pass's first batch, between samples: an order that a sampler splits
        among the ranks (Rule 5) joins the digest of this pass, which the step round compares
        (every rank must draw it alike, whatever the generator); anything else is not looked at."""
        if (
            event.expect == "ignore"
            or not (self._dp.wrappers or self._dp.stages)
            or current_expectation() is not None
        ):
            return
        reading = data_reading()
        order = reading.order or self._pipeline_order(reading)
        if not order or order == SPLITS_A_DATASET:  # (a split is no pass's order)
            return
        with self._lock:
            passes, digest, seed = self._pass
            if not self._pass_begun:
                self._pass_begun = True
                passes, digest, seed = passes + 1, 0, seed_value(event.seed)
                self._pass_draws[passes] = (event, order, self._steps + 1)
                if len(self._pass_draws) > _PASSES_KEPT:
                    del self._pass_draws[min(self._pass_draws)]
            name = generator_name(event.generator)  # (a user generator's number may differ)
            digest = text_hash(str(digest), str(name), event.op, str(event.before))
            self._pass = (passes, digest, seed)

    def _order_finding(self, split: OrderSplit) -> Finding:
        event, order, step = self._pass_draws.get(split.number, (None, "", split.step))
        return pass_order_finding(event, order, step, split.seeds, self.rank, self._domain)

    def _skip(self, event: RandomOpEvent, why: str) -> None:
        """Not compared (across the group), but it still moves its generator: remembered so
        that a divergence it causes in a checked op later can be pinned on it."""
        read = why if why.startswith(DISPATCHED_WHY) or why == self._modifying else ""
        key = gen_key(event)
        last = self._uncompared.get(key)
        if last is not None:
            self._uncompared[key] = _Unchecked(last.ops + 1, event, why, read or last.read_alone)
        else:
            self._uncompared[key] = _Unchecked(1, event, why, read)

    @staticmethod
    def mesh_of(args: tuple, kwargs: dict) -> Any:
        """The DeviceMesh a random op runs over (a DTensor op), or None."""
        return op_mesh(args, kwargs)

    def on_collective(self, func: Any, args: tuple = ()) -> None:
        """A collective is an exchange point, but not one in the backward of a DDP that holds
        a communication hook: each rank sees as many of the hook's collectives as its futures'
        timing allows."""
        self._dp.refresh()
        if (
            self._checking
            and not any(self._joins)
            and self._spans_domain(args)
            and not self._dp.in_hooked_backward()
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
        self._settle_due()
        self._exchange(Point.CHECK, "mode.check()")

    def finish(self) -> StepVerdict | None:
        """The block ends normally: the last exchanges. Returns the verdict of the last
        step-level round (level="step"), or None."""
        self._finished = True
        self._settle_due()
        verdict = None
        if self._digests is not None and not self._stopped:
            # The steps not yet sent, before the exit round (the same order everywhere).
            verdict = self.step_level(self._steps + 1, [], False, False, post=False)
        self._exchange(Point.EXIT, "")
        return verdict

    def close(self, exc: BaseException | None = None) -> None:
        """Stop; ``exc``: the exception that ended the checked block (else the one in flight)."""
        if self._digests is not None:
            self._digests.drop()
            self._digests.close()
        self._dp.uninstall()
        if not (self._finished or self._stopped):
            # Leaving early (an exception in the block): tell the ranks that will wait for us.
            exc = exc if exc is not None else sys.exc_info()[1]
            why = f"{type(exc).__name__}: {exc}" if exc is not None else "no exception seen"
            self._board.post_left(self.rank, why[:300])
        self._stopped = True
        self._inflight = None  # not waited for: the others learn from the store, or time out
        self._pending.clear()
        self._rows.clear()
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
        self._dp.on_step()
        self._dp.refresh(if_imported=True)
        self._settle_due()
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
        if self._digests is None:
            self._checking = self._steps % self._cfg.every_steps == 0

    def trains_replicas(self, optimizer: Any, lead: Collection[Any] = ()) -> bool:
        """Whether ``optimizer`` steps parameters of a known data-parallel wrapper's module or
        of a pipeline stage, the training every rank runs, or of ``lead`` (the lead's, as
        :meth:`replicas_trained` read them; see the mode's ``_takes_over``)."""
        return self._dp.trains(optimizer, lead)

    def replicas_trained(self, optimizer: Any) -> weakref.WeakSet[Any] | None:
        """A new lead's parameters, held weakly, when it trains replicas (above), else None."""
        if not self._dp.trains(optimizer):
            return None
        return weakref.WeakSet(optimizer_parameters(optimizer))

    def set_checking(self, checking: bool, rebase: tuple[int, ...] = ()) -> None:
        """level="step": whether the coming step is checked op by op (the same on every rank).
        ``rebase``: the digest slots that drifted apart between samples. Their generators
        already differ as the step starts, so in it they are compared op for op (what ran, with
        which arguments) but not by state: a rank that keeps drawing extra numbers is named at
        its op and line, not at the first op that met the earlier difference."""
        self._checking = checking
        self._rebase = frozenset(rebase) if checking else frozenset()

    def step_level(
        self, step: int, generators: Any, escalate: bool, sampled: bool, post: bool = True
    ) -> StepVerdict | None:
        """level="step", at every optimizer step: post the digests of this step's ``generators``
        (the mode's tracked ones) and this rank's wish to escalate; returns the verdict of the
        previous step's round (the same on every rank), or None. A rank that does not arrive in
        time is a rank_missing finding."""
        digests = self._digests
        if digests is None or self._stopped or self._side.group is None:
            return None
        finding = None
        verdict = None
        orders: list[Finding] = []
        with self._lock:
            self._busy = True
            self._round += 1  # one numbering for every exchange (the store's arrival notes)
            try:
                if post:  # (the digests' own tensor work is hidden from the mode)
                    slots = slot_values(self._agreeing(generators))
                    verdict = digests.exchange(step, slots, escalate, sampled, self._pass)
                else:
                    verdict = digests.finish()
                if verdict is not None:
                    orders = [self._order_finding(split) for split in verdict.orders]
            except PeerLost as e:
                self._stopped = True
                digests.drop()
                sent = _Round(
                    number=self._round,
                    point=Point.OPTIMIZER_STEP,
                    where=f"the step-level exchange of step {step}",
                    rows=[],
                    events=[],
                    first_use=set(),
                    uncompared={},
                    orders={},
                    calls={},
                    vec=torch.zeros(1, dtype=torch.int64),
                    parts={},
                    stack=None,
                )
                finding = self._missing(sent, Point.OPTIMIZER_STEP, sent.where, e.__cause__ or e)
            finally:
                self._busy = False  # (the counters reach the report when it is read: publish)
        for found in [*orders, finding]:
            if found is not None:
                self._handle.emit(found)
        return verdict

    def _agreeing(self, generators: list[Any]) -> list[Any]:
        """The generators whose digests the step level compares: not a per-rank stream (Rule 3)
        nor one the ranks moved apart on purpose (Rule 2's wake, Rules 6 and 7). Their states
        differ by design; in a slot shared with a generator that must agree, they would hide its
        drift (the slot agrees at no sampled step, so it is never in the baseline). Every rank
        learns both at the same exchange, from the gathered details, so every rank leaves the
        same ones out."""
        if not (self._per_rank_keys or self._drifted):
            return generators
        apart = self._per_rank_keys | self._drifted.keys()
        return [t for t in generators if ident_key(t.ident) not in apart]

    # -- which rows are compared -----------------------------------------------------------------

    def _judge(self, event: RandomOpEvent, mesh: Any) -> _Judged:
        """Why this op is not compared across ranks ("" when it is), the sampler that splits
        among the ranks the order it drew (Rule 5; "" when none, known in a data-parallel
        program only; or torch's random_split, also before the first step), and, for the first
        op of a generate() call on a model no wrapper wraps, why the call's ops are this rank's
        own (the op is compared as the call; "" for any other), and, for an op of a
        data-parallel forward whose wrapper has tensor-parallel peers, those peers (the op is
        compared among them alone). A draw of torch's PowerSGD hook in a wrapper's backward is
        compared by state, as an order is, with the hook in the order's place (Rule 10). The
        frames are walked once, in a data-parallel program, one that loaded a dispatcher (Rule
        6) or reads its own share of the data (Rule 7, also before the first step), and for the
        ops of a wrapper's backward only once the PowerSGD hook is imported."""
        if event.expect == "ignore":
            return _Judged("under expect('ignore')", "", "")
        if mesh is not None:  # declared: DTensor's contract (its mesh) ...
            return self._dtensor(event, mesh)
        declared = current_expectation() is not None  # the user's expect block
        src = None if declared else self._dp.modifier()
        if src is not None:  # Rule 6, ZeRO-3: rank src modifies, the region broadcasts from it
            self._gathered[src] = self._gathered.get(src, 0) + 1
            return _Judged(f"{GATHERED_WHY}{src}", "", "")
        if not declared:
            wrapper = self._dp.current(event.phase is not FORWARD)
            if wrapper is not None and self.rank in wrapper.ranks:  # Rule 2
                hook = (
                    comm_hook_drawing()
                    if event.phase is BACKWARD and self._spans_group(wrapper)
                    else ""
                )
                if hook:  # Rule 10: the gradient exchange's own draws, by state (as Rule 5's)
                    return _Judged("", hook, "")
                return self._own_batch(wrapper, DATA_PARALLEL_WHY)
            wrapper = self._dp.generating()
            if wrapper is not None and self.rank in wrapper.ranks:  # Rule 2: its module samples
                return self._own_batch(wrapper, GENERATE_WHY)
            call = self._dp.sampling()
            if call is not None:  # Rule 8: the call is compared, what it samples is the rank's
                why = f"{SAMPLED_WHY}{call.label}"
                if call.drew:
                    self._sampled[call.label] = self._sampled.get(call.label, 0) + 1
                    return _Judged(why, "", "")
                call.drew = True
                return _Judged("", "", why)
        # (Rule 7 holds without a known wrapper, which one built before the mode is until its
        # first forward: the frames are walked until the first step, and on once a rank's own
        # share of the data was seen)
        walk = (
            self._dp.wrappers
            or self._dp.stages
            or self._shares
            or not self._init_settled
            or any(m in sys.modules for m in DISPATCHER_MODULES)
        )
        reading = data_reading() if walk else NOT_READING
        if reading.dispatcher and not declared:  # Rule 6: this rank reads for every rank
            why = f"{DISPATCHED_WHY}{reading.dispatcher}"
            self._read_alone[why] = self._read_alone.get(why, 0) + 1
            return _Judged(why, "", "")
        order = (reading.order if self._dp.wrappers else "") or self._pipeline_order(reading)
        if reading.order == SPLITS_A_DATASET:
            # (a dataset's split also before any wrapper is built; but not from a generator the
            # ranks are known to seed apart on purpose (Rule 3): a rank may split alone there)
            order = "" if gen_key(event) in self._per_rank_keys else SPLITS_A_DATASET
        if reading.share and not (declared or order):  # Rule 7
            self._shares[reading.share] = self._shares.get(reading.share, 0) + 1
            return _Judged(f"{SHARE_WHY}{reading.share}", "", "")
        if self._own_lines and not (declared or order):
            own = self._own_line(event)
            if own is not None:  # Rule 9: a line that draws with each rank's own arguments
                self._own_drawn[own] = self._own_drawn.get(own, 0) + 1
                site, counts = own
                return _Judged(f"{OWN_COUNT_WHY if counts else OWN_ARGUMENTS_WHY}{site}", "", "")
        if not (declared or order) and gen_key(event) in self._per_rank_keys:  # Rule 3
            return _Judged("on a per-rank stream", "", "")
        return _Judged("", order, "") if order else _COMPARED

    def _pipeline_order(self, reading: Reading) -> str:
        """Rule 5, pipelines: the order a sampler drew for this rank alone, in a program that
        built a pipeline stage (every stage reads the same batches, so it must agree); ""
        otherwise."""
        return f"{reading.shuffle}{PIPELINE_ORDER}" if reading.shuffle and self._dp.stages else ""

    def _stage_init(self, event: RandomOpEvent, written: Any) -> str:
        """Rule 4, pipelines: the initialisation of a parameter of a pipeline stage this rank
        holds is the stage's own (each rank initialises its own layers, in amounts of its own),
        a DTensor's too (``fully_shard`` over each stage's data-parallel ranks: the stages'
        meshes differ, and so do their initialisations); "" for any other op."""
        if not isinstance(written, torch.nn.Parameter) or current_expectation() is not None:
            return ""
        stage = self._dp.stage_holding(written)
        if stage:
            self._stage_inits[stage] = self._stage_inits.get(stage, 0) + 1
            return f"{STAGE_INIT_WHY}{stage}"
        return ""

    def _own_line(self, event: RandomOpEvent) -> tuple[str, bool] | None:
        """Rule 9: the line (``file.py:12``) of an op drawn where the ranks drew that op from its
        generator with arguments of their own or a number of times of their own (True), as
        learnt at an exchange; None for any other op, and for one that a user's seeding call
        reached first (compared: a rank that reseeds or restores alone there is found)."""
        lines = self._own_lines.get((gen_key(event), event.op))
        if lines is None or reseeded_by_user(event):
            return None
        counts = lines.get(line_key(event))
        return None if counts is None else (event.site, counts)

    def _learn_own_line(self, event: RandomOpEvent, *, by_counts: bool, drawn: int) -> None:
        """Rule 9: ``event``'s line draws its op from its generator with each rank's own
        arguments, or (``by_counts``) a number of times of each rank's own, from here; ``drawn``
        of this round's ops there on this rank. A line already learnt keeps how it was."""
        lines = self._own_lines.setdefault((gen_key(event), event.op), {})
        key = (event.site, lines.setdefault(line_key(event), by_counts))
        self._own_drawn[key] = self._own_drawn.get(key, 0) + drawn

    def _dtensor(self, event: RandomOpEvent, mesh: Any) -> _Judged:
        """A DTensor random op: compared over its mesh, in the group's order; but inside a
        data-parallel forward whose tensor-parallel peers hold that mesh (dropout on
        sequence-parallel or replicated DTensor activations), among the peers, outside the
        group's order: the other data-parallel groups draw for their own batches' shapes."""
        if not self._dp.wrappers or current_expectation() is not None:
            return _COMPARED
        wrapper = self._dp.current(event.phase is not FORWARD)
        if wrapper is None or self.rank not in wrapper.ranks:
            return _COMPARED
        peers = self._peers_of(wrapper)
        members = self._groups.members(None, mesh)
        if not peers or members is None or not set(members) <= set(peers):
            return _COMPARED
        return self._own_batch(wrapper, DATA_PARALLEL_WHY)

    def _spans_group(self, wrapper: Wrapper) -> bool:
        """Rule 10: whether ``wrapper``'s ranks hold every rank of the mode's group and it has no
        tensor-parallel peers, so that its communication hook runs alike on every rank compared
        (a DDP over a subgroup, a pipeline stage's, reduces buckets of its own)."""
        return set(wrapper.ranks) >= set(self._domain) and not self._peers_of(wrapper)

    def _own_batch(self, wrapper: Wrapper, why: str) -> _Judged:
        """Rule 2: an op of the wrapper's forward/backward (``why``: DATA_PARALLEL_WHY; a
        pipeline schedule's step, PIPELINE_WHY) or of generate() on its module (GENERATE_WHY),
        this rank's own across the wrapper's group;
        compared among its tensor-parallel peers, if it has any."""
        if wrapper.pipeline and why == DATA_PARALLEL_WHY:
            why = PIPELINE_WHY
        peers = self._peers_of(wrapper)
        self._dp.count(wrapper, generated=why == GENERATE_WHY, peers=bool(peers))
        if peers:  # ... compared among the ranks that share this rank's batch
            return _Judged("", "", "", peers, f"{why}{wrapper.label}")
        return _Judged(f"{why}{wrapper.label}", "", "")

    def _peers_of(self, wrapper: Wrapper) -> tuple[int, ...]:
        """The wrapper's tensor-parallel peers in the mode's group (() when fewer than two)."""
        if not wrapper.peers:
            return ()
        hit = self._peer_sets.get(wrapper.peers)
        if hit is None:
            kept = tuple(r for r in wrapper.peers if r in self._domain)
            hit = self._peer_sets[wrapper.peers] = kept if len(kept) > 1 else ()
            if hit:  # checked at every round from now on, rows or none (P4)
                stream = text_hash("peers", ",".join(map(str, hit)))
                self._peer_streams[stream] = hit
                self._stream_members[stream] = hit
        return hit

    def _add(
        self,
        event: RandomOpEvent,
        mesh: Any,
        written: Any,
        order: str,
        call: str = "",
        peers: tuple[int, ...] = (),
    ) -> None:
        """Record a compared op; ``order``: the sampler splitting the order it drew (Rule 5);
        ``call``: the generate() call it is the first op of, compared as that call: the state
        it starts from (what it samples, its arguments and the state after, are the rank's
        own); ``peers``: the ranks it is compared among alone (a data-parallel forward's
        tensor-parallel peers: by state always, outside the group's order)."""
        exp = current_expectation()
        if peers:
            members: tuple[int, ...] | None = peers
            policy = "peers"
        else:
            spec = exp.group if exp is not None else None
            members = self._groups.members(spec, mesh)
            policy = event.expect if event.expect in POLICY_CODE else "same"
        stream = text_hash(policy, ",".join(map(str, members))) if members else 0
        declared = exp is not None or mesh is not None
        code = POLICY_CODE["declared" if declared and policy == "same" else policy]
        if members:
            self._stream_members[stream] = members
        gen = gen_key(event)
        # (a communication hook draws in a fork of the generator, undone as it returns: like a
        # peers row, its row sees what the generator drew uncompared and leaves it, and its
        # first use, to the generator's next row of its own)
        forked = order in FORKING_HOOKS
        aside = peers or forked
        # (first uses: among the peers, in a hook's fork, and the group's)
        seen = f"{gen} peers" if peers else f"{gen} fork" if forked else gen
        if seen not in self._seen_generators:
            self._seen_generators.add(seen)
            self._first_use.add(len(self._pending))
        uncompared = self._uncompared.get(gen) if aside else self._uncompared.pop(gen, None)
        if uncompared is not None:
            self._uncompared_before[len(self._pending)] = uncompared
        if not peers:
            self._in_order += 1
        # Rule 5: an order that a sampler splits among the ranks is compared by state, whatever
        # the other rules say of its generator.
        if order:
            self._orders[len(self._pending)] = order
        if call:
            self._calls[len(self._pending)] = call
        rebased = bool(self._rebase) and slot_of(event.generator) in self._rebase
        drifted = self._drifted.get(gen) if self._drifted and not forked else None
        if drifted is not None:
            oob = event.out_of_band
            if event.seed == drifted[0] and not (oob is not None and oob.user_calls):
                rebased = True
            else:  # reseeded or restored since (by the user): its states are compared again
                del self._drifted[gen]
        # (an order, and a forward's op among its peers, who share a batch: always by state)
        rebased = rebased and not (order or peers)
        row = Row(
            # (a generate() call's row: the state it starts from is compared, not what it drew)
            structure=text_hash(call, gen) if call else text_hash(event.op, gen, *event.args),
            stream=stream,
            before=event.before if event.before is not None and not rebased else 0,
            after=event.after if event.after is not None and not (rebased or call) else 0,
            policy=code,
            # (an order's rows stay when Rules 2 and 3 drop or relax its generator's rows)
            generator=text_hash(gen, "order")
            if order
            else text_hash(gen, "peers")
            if peers
            else text_hash(gen),
        )
        if (
            stream
            and not peers
            and not self._init_settled
            and mesh is None
            and isinstance(written, torch.nn.Parameter)
            and len(self._init) < _MAX_INIT
        ):
            # A parameter's initialisation (Rule 4): its order is compared now, its state at the
            # settle point, and not at all if a data-parallel wrapper broadcasts the parameter.
            self._init.append(_Init(row, event, weakref.ref(written)))
            row = row._replace(stream=0)
        self._pending.append(event)
        self._rows.append(row)

    def _settle_due(self) -> None:
        """The program reached its first step (or a data-parallel forward, check() or exit): the
        next exchange settles the parameter initialisations and the held per-rank findings."""
        if not self._init_settled:
            self._init_due = True

    def _on_wrapper(self, wrapper: Wrapper) -> None:
        """A data-parallel wrapper is being built (before its own collectives) or first ran."""
        with self._lock:
            # Its peers' stream is known from here on every peer, at the same point of the
            # program, before any of its ops (P4: every peer checks it at every round).
            self._peers_of(wrapper)
        if not wrapper.broadcasts:
            return
        with self._lock:
            # (A parameter that no longer exists is left to the settle point: _live_inits.)
            kept = [i for i in self._init if not wrapper.overwrites(i.parameter())]
            covered = len(self._init) - len(kept)
            if covered:  # Rule 4: the broadcast overwrites whatever these drew
                self._init = kept
                self._broadcast_inits[wrapper.label] = (
                    self._broadcast_inits.get(wrapper.label, 0) + covered
                )

    def _live_inits(self, inits: list[_Init]) -> list[_Init]:
        """Rule 4 at the settle point, after a wrapper broadcast: the initialisation of a
        parameter that no longer exists (replaced by a tied one, or re-made before the wrapper
        was built) drew into nothing that trains, and is left out. Garbage is collected first,
        so that what is left out does not depend on when each rank's collector last ran (P5)."""
        if not inits or not any(w.broadcasts for w in self._dp.wrappers):
            return inits
        gc.collect()
        kept = [i for i in inits if i.parameter() is not None]
        self._replaced_inits += len(inits) - len(kept)
        return kept

    def notes(self) -> list[Note]:
        """What the data-parallel rules left uncompared, for the report (``rngcheck show``)."""
        rank = self.rank
        replaced = {"": self._replaced_inits} if self._replaced_inits else {}
        apart = {"": self.passes_apart} if self.passes_apart else {}
        out = [
            *_counted(
                apart,
                lambda _: (
                    f"round(s) of {STEPS_PER_ROUND} steps through whose second half the ranks had "
                    "begun different numbers of passes over the data (a DataLoader over a sampler "
                    "that splits its order among the ranks, iterated on some ranks only): the "
                    "orders of the passes begun then are not compared, those after each such "
                    "round again."
                ),
            ),
            *_counted(
                self._dp.ops,
                lambda label: (
                    f"random op(s) in the forward and backward of {label} "
                    "(data-parallel: each rank draws for its own batch)."
                ),
            ),
            *_counted(
                self._dp.staged,
                lambda label: (
                    f"random op(s) in the pipeline stages {label} runs (its stages' forwards "
                    "and backwards: each rank runs its own layers)."
                ),
            ),
            *_counted(
                self._dp.peer_ops,
                lambda label: (
                    f"random op(s) of the module {label} wraps (its forward, backward and "
                    "generate()) across its ranks, each drawing for its own batch; compared "
                    "only among the ranks that share this rank's batch (its tensor-parallel "
                    "peers)."
                ),
            ),
            *_counted(
                self._dp.generated,
                lambda label: (
                    f"random op(s) in generate() of the module {label} wraps "
                    "(data-parallel: each rank samples for its own inputs)."
                ),
            ),
            *_counted(
                self._sampled,
                lambda label: (
                    f"random op(s) in generate() of {label}, which no data-parallel wrapper "
                    "wraps: each rank samples for its own inputs (its calls are compared across "
                    "the ranks, one for one, with the state each starts from)."
                ),
            ),
            *_counted(
                self._stage_inits,
                lambda stage: (
                    f"parameter initialisation(s) of {stage}, this rank's own layers (each "
                    "rank initialises the stages it holds)."
                ),
            ),
            *_counted(
                self._broadcast_inits,
                lambda label: (
                    f"parameter initialisation(s); {label} broadcast the module's "
                    "states from one rank when it was built."
                ),
            ),
            *_counted(
                self._read_alone,
                lambda why: (
                    f"random op(s) rank {rank} drew alone, reading every rank's batches for "
                    f"{why.removeprefix(DISPATCHED_WHY)} (the other ranks receive the batches by "
                    "broadcast)."
                ),
            ),
            *_counted(
                self._gathered,
                lambda src: (
                    f"random op(s) drawn inside a deepspeed GatheredParameters region broadcast "
                    f"by rank {src}: the parameters it gathered are rank {src}'s as it exits "
                    "(ZeRO-3; Hugging Face initialises a model's weights so)."
                ),
            ),
            *_counted(
                self._shares,
                lambda split: (
                    f"random op(s) drawn while loading rank {rank}'s own share of the data, "
                    f"split among the ranks by {split} (a dataset's or collator's draws for "
                    "the rank's own samples: each rank draws for its own batch)."
                ),
            ),
            *_counted(
                self._join_ops,
                lambda label: (
                    f"random op(s) drawn in {label} from the last iteration every rank ran "
                    "together, as a rank ran out of inputs (uneven inputs: from there each rank "
                    "runs its own number of iterations, until every rank has)."
                ),
            ),
            *_counted(
                self._own_drawn,
                lambda line: (
                    f"random op(s) drawn at {line[0]} from a default generator a number of times "
                    "of each rank's own (the ranks looped there over their own data, in a "
                    "data-parallel program: each rank draws for its own batch)."
                    if line[1]
                    else f"random op(s) drawn at {line[0]} from a default generator with "
                    "arguments of each rank's own (the ranks drew there for their own batch "
                    "shapes, in a data-parallel program: each rank draws for its own batch)."
                ),
            ),
        ]
        out.extend(
            Note(
                kind="not_compared",
                message=f"not compared by state: {generator} after {how}; its later random ops "
                "are compared by what runs, until it is reseeded. It differs across ranks from "
                "there: draw replicated decisions (a shuffle, a sampled task) from a generator of "
                "their own.",
            )
            for generator, how in self._drift_notes.values()
        )
        counts = self._digests.steps_apart if self._digests is not None else None
        if counts is not None:
            out.append(
                Note(
                    kind="not_compared",
                    message=f"not compared: the generators' digests at the step level, from "
                    f"the round of {STEPS_PER_ROUND} steps that found the ranks counting "
                    f"different numbers of training steps ({counts[0]} to {counts[1]} exchanged: "
                    "some rank stepped its optimizer more often than another) to the end of "
                    "the block, where their steps no longer pair.",
                )
            )
        out += _counted(
            replaced,
            lambda _: (
                "parameter initialisation(s) of parameters that no longer existed at the "
                "first step (replaced before training, as weight tying does)."
            ),
        )
        if self._dp.wrappers:
            programs = "; ".join(w.label for w in self._dp.wrappers)
            out.extend(
                Note(
                    kind="not_compared",
                    message=f"not compared: {why}, in a data-parallel program ({programs}): "
                    "a per-rank stream (seed + rank, per-rank data generators).",
                )
                for why in self._per_rank.values()
            )
        return out

    # -- torch's Join: uneven inputs (P7) ---------------------------------------------------------

    def _on_join(self, what: str, join: Any) -> None:
        """What the data-parallel tracker saw of a Join on this thread (see JoinEvent)."""
        if what == "enter":
            self._joins.append(self._join_label(join) if self._join_spans(join) else "")
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
                for event in self._pending:
                    self._join_skip(event)
                self._clear()
            self.apart = False
            self._settle_due()

    def _go_apart(self, events: Iterable[RandomOpEvent]) -> None:
        """A rank has run out of inputs: the ranks' windows (``events``, and this rank's since)
        are not compared; nothing is until this rank's Join.__exit__ returns."""
        self.apart = True
        for event in [*events, *self._pending]:
            self._join_skip(event)
        self._clear()

    def _join_skip(self, event: RandomOpEvent) -> None:
        label = next((j for j in self._joins if j), "Join")  # the outermost one followed
        self._join_ops[label] = self._join_ops.get(label, 0) + 1
        self._skip(event, f"{JOIN_WHY}{label}")

    @staticmethod
    def _join_label(join: Any) -> str:
        kinds = ", ".join(type(j).__name__ for j in getattr(join, "_joinables", ()))
        return f"Join([{kinds}])"

    def _join_spans(self, join: Any) -> bool:
        """Whether a Join's process group holds every rank this checker exchanges with."""
        try:
            group = join._process_group or dist.distributed_c10d._get_default_group()
            return set(dist.get_process_group_ranks(group)).issuperset(self._domain)
        except Exception:  # noqa: BLE001 - a Join torch changed: not followed
            log.debug("rngcheck could not read a Join's process group", exc_info=True)
            return False

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
        init = held = None
        if self._init_due:
            # Rule 4's settle point; the per-rank seeding held back (Rule 3) is judged here too,
            # after the initialisations (they come first in the program). P5: every rank gets
            # here at the same round.
            init, self._init = self._live_inits(self._init), []
            held, self._held = self._held, []
            self._init_due, self._init_settled = False, True
        self._round += 1
        self.stats.exchanges += 1
        init_rows = [i.row for i in init] if init is not None else None
        vec, parts = fast_vector(
            self._round,
            point,
            self._rows,
            self._whole_stream,
            init_rows,
            self._peer_streams,
            joined=joined,
        )
        # level="step": a sampled step's round is judged at once (the next step may be unchecked).
        # A Join round is settled at the iteration's optimizer step, or the next exchange (P7).
        pipelined = point is Point.JOIN or (
            self._cfg.sync == "step" and point in PIPELINED and self._digests is None
        )
        sent = _Round(
            number=self._round,
            point=point,
            where=where,
            rows=self._rows,
            events=self._pending,
            first_use=self._first_use,
            uncompared=self._uncompared_before,
            orders=self._orders,
            calls=self._calls,
            vec=vec,
            parts=parts,
            # (a Join round is judged only when no rank ran out, and an empty one can differ only
            # in its point: its stack is taken then, if ever)
            stack=Stack.capture()
            if pipelined and not joined and (self._rows or point is not Point.JOIN)
            else None,
            init=init,
            held=held or None,
        )
        self._clear()  # the window now belongs to the round until it is settled
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
                self._go_apart(sent.events)
                if sent.init is not None:
                    # Its parameter initialisations are settled at the first exchange after
                    # the Join, on every rank (a rank that ran out may not have sent them).
                    self._init = [*sent.init, *self._init]
                    self._held = [*(sent.held or ()), *self._held]
                    self._init_settled = False
                return None
            mismatch, init_mismatch = disagreement(sent.vec)
            if not mismatch and int(sent.vec[-1]) > 0:
                # P4: the streams over parts of the group, then one flag for the whole group.
                local = self._side.check_partial_streams(sent.parts, self._stream_members)
                flag = torch.tensor([1 if local else 0], dtype=torch.int64)
                self._side.all_reduce_max(flag, fast=True)
                mismatch = bool(flag[0])
            finding = None
            if mismatch:
                self.stats.mismatches += 1
                finding = self._slow_path(sent, sent.rows, sent.events, init=False)
            if finding is None and init_mismatch and not self._stopped:
                self.stats.mismatches += 1
                assert sent.init is not None
                finding = self._slow_path(
                    sent, [i.row for i in sent.init], [i.event for i in sent.init], init=True
                )
            if finding is None and sent.held and not self._dp.active:
                finding = sent.held[0]  # seeded per rank, and the program is not data-parallel
            if finding is not None:
                self._stopped = True  # P6
                self._clear()
            return finding
        except PeerLost as e:  # gloo: the group timeout, or a peer that went away
            self._stopped = True
            return self._missing(sent, point, where, e.__cause__ or e)

    def _clear(self) -> None:
        self._rows = []
        self._in_order = 0
        self._pending = []
        self._first_use = set()
        self._uncompared_before = {}
        self._orders = {}
        self._calls = {}

    # -- slow path: gather the windows, find the first divergent op, gather its detail -------

    def _slow_path(
        self, sent: _Round, rows: list[Row], events: list[RandomOpEvent], *, init: bool
    ) -> Finding | None:
        """Gather every rank's rows, find the first divergent op, gather its detail, and judge it.

        A divergence explained by per-rank seeding is not a finding in a data-parallel program
        (Rule 3): the generator becomes a per-rank stream, its rows leave the comparison, and the
        rest of the round is judged again (every rank runs the same loop on the same gathered
        data, P5). ``init``: ``rows`` are the parameter initialisations settled this round
        (Rule 4).
        """
        if not init:  # a mark per peers stream: its members with no rows in it are still seen
            rows = rows + [
                Row(0, stream, 0, 0, PEERS, 0)
                for stream in sent.parts
                if stream in self._peer_streams
            ]
        windows, points = self._side.gather_rows(rows, sent.point)
        if init:
            points = dict.fromkeys(points, sent.point)
        stack = sent.stack if sent.stack is not None else Stack.capture()
        where = point_text(points[self.rank], sent.where, stack)
        dropped: dict[int, set[int]] = {}  # rows at a line Rule 9 learnt by counts, per rank
        while True:
            # Per-rank streams leave the comparison (Rule 3), but not parameter initialisations:
            # a replicated parameter drawn from a per-rank stream is still wrong (Rule 4).
            skip = () if init else self._per_rank
            kept = {
                r: [
                    i
                    for i, row in enumerate(w)
                    if row.generator not in skip and i not in dropped.get(r, ())
                ]
                for r, w in windows.items()
            }
            view = {r: [windows[r][i] for i in kept[r]] for r in windows}
            spot = localise(view, points)
            if spot is None:  # no divergence left (or two streams shared a hashed slot)
                return None
            at = spot.index_for(self.rank, view[self.rank])
            index = kept[self.rank][at] if 0 <= at < len(kept[self.rank]) else -1
            event = events[index] if 0 <= index < len(events) else None  # (not a mark)
            unchecked = sent.uncompared.get(index)
            # (Rule 9's counts: only in a data-parallel program, which own_count asks every rank)
            counting = not init and bool(self._dp.wrappers) and counts_may_apply(spot)
            lines, spot_line = (
                _count_lines(spot, view, windows[self.rank], events, index)
                if counting
                else ({}, "")
            )
            order = sent.orders.get(index, "") if not init else ""
            mine = Detail(
                event=event,
                point=where,
                seed_calls=self._seed_calls(event)
                if event is not None and (init or index in sent.first_use)
                else (),
                uncompared=None if init or unchecked is None else unchecked.public(),
                wrappers=tuple(w.label for w in self._dp.wrappers),
                # (a hook's fork of the generator starts where the hook seeded it)
                drifted=self._drifted.get(gen_key(event), (None, ""))[1]
                if event is not None and order not in FORKING_HOOKS
                else "",
                order=order,
                call=sent.calls.get(index, "") if not init else "",
                peers=any(self._peers_of(w) for w in self._dp.wrappers),
                lines=lines,
                spot_line=spot_line,
                spot_at=index if 0 <= index < len(events) else len(windows[self.rank]),
            )
            details = {
                r: Detail.from_dict(d) for r, d in self._side.gather_json(mine.to_dict()).items()
            }
            try:
                finding = build_finding(spot, view, details, self._domain)
            except Exception as e:  # noqa: BLE001 - never let a describing bug escape into training
                log.exception("rngcheck could not describe a cross-rank divergence")
                return Finding(
                    kind=FindingKind.RANK_DIVERGENCE,
                    message=(
                        f"the ranks disagree at random op {spot.index} of exchange "
                        f"#{sent.number} ({spot.kind}); rngcheck could not describe it "
                        f"({type(e).__name__}: {e})"
                    ),
                    op=event.op if event is not None else "",
                    differs=spot.kind,
                    ranks=self._domain,
                    stack=stack,
                )
            if init:
                return init_finding(finding, details)
            seeded = per_rank_seeding(spot, details)
            if seeded is None:
                drift = data_parallel_drift(spot, details)
                own = None if drift is not None else own_arguments(spot, details)
                if own is not None:
                    # Rule 9: this line's draws from the generator are each rank's own from
                    # here, and the generator is in the wake (below); this round's op there
                    # leaves the comparison on every rank.
                    event_o = details[self.rank].event  # (own_arguments: every rank has one)
                    assert event_o is not None
                    self._learn_own_line(event_o, by_counts=False, drawn=1)
                    common = text_hash(gen_key(event_o), event_o.op, "own arguments")
                    for r, w in windows.items():
                        pos = spot.index_for(r, view[r])
                        if pos < len(kept[r]):
                            i = kept[r][pos]
                            w[i] = w[i]._replace(structure=common, before=0, after=0)
                    drift = own
                counted = own_count(spot, details) if drift is None else None
                if counted is not None:
                    # Rule 9, counts: that line's draws from the generator are each rank's own
                    # from here, however many, and the generator is in the wake (below, from the
                    # seed every rank drew there with); this round's ops there leave the
                    # comparison on every rank.
                    extra, event_c, how = counted
                    there = details[extra].spot_line
                    for r, d in details.items():
                        dropped.setdefault(r, set()).update(d.lines.get(there, ()))
                    drawn = len(details[self.rank].lines.get(there, ()))
                    self._learn_own_line(event_c, by_counts=True, drawn=drawn)
                    self._drifted.setdefault(gen_key(event_c), (event_c.seed, how))
                    drift = (event_c, how)
                if drift is None:
                    return finding
                # Rule 2's wake (and Rules 6 and 7's): from here this generator is compared by what
                # runs, not by state (until it is reseeded); this round is judged again without
                # its states.
                event_d, how = drift
                key = gen_key(event_d)
                mine_d = details[self.rank].event
                if key not in self._drifted:
                    self._drifted[key] = (mine_d.seed if mine_d is not None else None, how)
                self._drift_notes.setdefault(key, (event_d.generator.label, how))
                gen = text_hash(key)
                windows = {
                    r: [
                        row._replace(before=0, after=0) if row.generator == gen else row
                        for row in w
                    ]
                    for r, w in windows.items()
                }
                continue
            # Rule 3: a per-rank stream. Its rows leave the comparison from here on; the finding
            # is held until the settle point when the program is not known data-parallel yet.
            first, why = seeded
            key = gen_key(first)
            self._per_rank[text_hash(key)] = why
            self._per_rank_keys.add(key)
            if not details[min(details)].wrappers:
                if self._init_settled:
                    return finding  # past the settle point and not data-parallel: a finding
                self._held.append(finding)

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
        return missing_finding(
            rank=self.rank,
            domain=self._domain,
            arrived=arrived,
            left=self._board.left(missing or (self.rank,)),
            number=sent.number,
            here=here,
            sent_at=sent_at,
            timeout=self.timeout,
            last=sent.events[-1] if sent.events else None,
            stack=stack,
            error=error,
        )

    def publish(self) -> None:
        """The exchange counters into the report's metadata (at every op-level exchange; for the
        step level's, when the report is read)."""
        self._handle.meta["rank_exchange"] = self.stats.to_dict()


_COUNT_LINES_READ = 512  # Rule 9, counts: ops whose lines a rank reads (each reads a stack)


def _count_lines(
    spot: Any, view: dict[int, list[Row]], window: list[Row], events: list[Any], at: int
) -> tuple[dict[str, list[int]], str]:
    """Rule 9, counts: this rank's ops of the round that ran an op found at a control-flow
    divergence on any rank (same op, generator and arguments), by ``count_key``, with their
    positions in ``window`` (before and after the divergence: a line learnt leaves the round
    whole); and the key of this rank's op at the divergence (``at``), "". Each one's line is
    read from its stack (about a millisecond): past ``_COUNT_LINES_READ`` of them, none are
    (the clause does not apply)."""
    structures = set()
    for r, w in view.items():
        p = spot.index_for(r, w)
        if p < len(w):
            structures.add(w[p].structure)
    same = POLICY_CODE["same"]  # (a row under expect("differ") or "ignore" is no such op)
    hits = [
        i
        for i, row in enumerate(window)
        if row.structure in structures and row.policy == same and i < len(events)
    ]
    if len(hits) > _COUNT_LINES_READ:
        return {}, ""
    lines: dict[str, list[int]] = {}
    for i in hits:
        key = count_key(events[i], window[i].structure)
        if key:
            lines.setdefault(key, []).append(i)
    mine = next((k for k, found in lines.items() if at in found), "")
    return lines, mine


def _counted(counts: Mapping[Any, int], say: Callable[[Any], str]) -> list[Note]:
    """A not_compared note for each entry of ``counts`` (what -> how many random ops): "not
    compared: N " followed by ``say(what)``."""
    return [
        Note(kind="not_compared", message=f"not compared: {count} {say(what)}", count=count)
        for what, count in counts.items()
    ]
