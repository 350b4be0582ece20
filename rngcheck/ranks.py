"""Cross-rank exchange of RNG digests over torch.distributed, and the first divergent random op.

Every random op the mode sees becomes a row of five int64s (its structure: op, generator and
arguments; the stream it belongs to: expectation and rank group; the state before; after; the
expectation's code). Rows wait in this rank's pending window until an exchange point: every
random op (``sync="op"``) or optimizer steps, every ``config.every`` random ops, ``mode.check()``
and exit (``sync="step"``), plus every torch.distributed collective the mode sees (an alignment
point in both modes).

At an exchange each rank folds its window into a fixed vector (the exchange round and point, a
digest of the ops' structure, a digest of the group-wide "same" stream, each packed as ``(x, -x)``
so one all-reduce MAX yields max and min) and the ranks run one all-reduce over the checker's own
gloo group: equal max and min mean every rank agrees. That costs the same 72 bytes whatever the
world size. Streams over parts of the group (``expect("differ")``, ``expect(group=...)``, sub-mesh
DTensors) are then checked on small gloo groups their members make on first use (an all-reduce of
two int64, or an all-gather of one per member for "differ"), plus one flag all-reduce so the whole
group agrees on the outcome. Only on a mismatch do the ranks gather their rows (the window, ints
only) and then the detail of the one divergent op (JSON text in a uint8 tensor; never pickle), so
every rank builds the same finding from the same data.

With ``sync="step"`` the all-reduce of an optimizer step or an every-N point is posted and not
waited for there (``async_op=True``): the round stays in flight, its window kept, and is settled
(waited for, with the timeout, and judged) at the next exchange point, before that point posts
its own round, so every rank settles round r at the same place in its sequence of side-group
collectives and a mismatch found one exchange late still gathers round r's rows. Collectives,
``mode.check()`` and exit wait for their own round too: no rank walks into a collective the others
will not make with a mismatch still unknown. ``sync="op"`` waits at every exchange.

Every collective passes the checker's group; a rank that does not arrive within the timeout (by
default the process group's own) gives a ``rank_missing`` finding (gloo honours the group timeout)
instead of a hang, and after any finding the checker stops exchanging. Localising and describing the
divergence from the gathered data is ``rank_findings.py``'s job.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist

from .data_parallel import DataParallelTracker, Wrapper
from .events import Phase, RandomOpEvent
from .policy import current_expectation
from .rank_findings import (
    POLICY_CODE,
    Point,
    Row,
    build_finding,
    init_finding,
    localise,
    per_rank_seeding,
    point_text,
)
from .report import Finding, FindingKind, Note, Side, format_ranks
from .stacks import Stack

__all__ = ["ExchangeStats", "RankChecker", "exchange_stats", "op_mesh", "start"]

log = logging.getLogger(__name__)

# (x, -x) for the round, the point, the structure, the group-wide stream and the parameter
# initialisations (Rule 4; 0 until they are settled), then a flag: streams over parts of the group.
_HEADER = 11
_INIT_SLOT = 8
_MASK62 = (1 << 62) - 1
_ROW = len(Row._fields)
_MAX_INIT = 100_000  # parameter initialisations kept for the settle point
_MAX_GROUPS = 256  # resolved group specs kept
# With sync="step", the rounds of these points stay in flight until the next exchange point. A
# collective (an alignment point), mode.check() and exit wait for their own round: a rank must
# not walk into a collective that the others will not make before the mismatch is known.
_PIPELINED = frozenset({Point.OPTIMIZER_STEP, Point.EVERY})


@dataclass(slots=True)
class ExchangeStats:
    """What the exchanges cost this rank: collective calls and bytes sent, fast path and slow."""

    exchanges: int = 0
    fast_calls: int = 0
    fast_bytes: int = 0
    slow_calls: int = 0
    slow_bytes: int = 0
    setup_calls: int = 0
    setup_bytes: int = 0
    mismatches: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


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
    ignored_before: dict[int, tuple[int, str, str, str]]
    vec: torch.Tensor
    parts: dict[int, list[tuple[int, ...]]]
    stack: Stack | None  # where this rank posted it (pipelined rounds); else taken when settled
    init: list[_Init] | None = None  # the parameter initialisations this round settles
    held: list[Finding] | None = None  # per-rank seeding held back until this round (Rule 3)
    work: Any = None


@dataclass(slots=True)
class _Init:
    """A random op that initialised a parameter: its state is compared at the settle point, and
    not at all if a data-parallel wrapper broadcasts that parameter first (Rule 4)."""

    row: Row
    event: RandomOpEvent
    storage: int  # the parameter's storage, as the wrapper's broadcast names it
    parameter: weakref.ref[Any]  # dead once replaced (tied weights, or sharded into new storage)


def _h62(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK62


@lru_cache(maxsize=4096)
def _text_hash(*parts: str) -> int:
    return _h62("\x1f".join(parts).encode()) or 1


def _fold(values: Iterable[int]) -> int:
    """A 62-bit digest of a sequence of signed 64-bit ints (never 0)."""
    ints = list(values)
    return _h62(struct.pack(f"<{len(ints)}q", *ints)) or 1


# ---------------------------------------------------------------------------------------------
# Groups: which ranks an expectation spans, as the partition that contains this rank.


def op_mesh(args: tuple, kwargs: dict) -> Any:
    """The DeviceMesh of an op's first DTensor argument, or None."""
    for v in (*args, *kwargs.values()):
        mesh = getattr(v, "device_mesh", None)
        if mesh is not None and hasattr(v, "placements"):
            return mesh
    return None


def _is_mesh(spec: Any) -> bool:
    return hasattr(spec, "mesh") and hasattr(spec, "mesh_dim_names") and hasattr(spec, "ndim")


def _mesh_slice(mesh: Any, dims: Sequence[str], rank: int) -> tuple[int, ...] | None:
    """The ranks of ``mesh`` that share this rank's coordinates outside ``dims``."""
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [d for d in dims if d not in names]
    if unknown:
        raise ValueError(
            f"mesh dimension(s) {unknown} are not in the DeviceMesh's dimensions {names}; "
            "name dimensions of the mesh the op runs on"
        )
    ranks = mesh.mesh
    where = (ranks == rank).nonzero()
    if where.numel() == 0:
        return None
    coord = where[0].tolist()
    index = tuple(slice(None) if names[i] in dims else coord[i] for i in range(len(names)))
    return tuple(sorted(int(r) for r in ranks[index].flatten().tolist()))


def resolve_group(spec: Any, rank: int, world: int, mesh: Any = None) -> tuple[int, ...] | None:
    """This rank's partition of ``spec`` (sorted ranks), or None when the rank is not a member.

    ``spec``: None (``mesh``'s ranks, or the world), a ProcessGroup, a list of ranks, a
    DeviceMesh, or mesh dimension names (resolved against ``mesh``, or ``spec`` the DeviceMesh).
    """
    if spec is None:
        ranks = mesh.mesh.flatten().tolist() if mesh is not None else range(world)
    elif isinstance(spec, dist.ProcessGroup):
        ranks = dist.get_process_group_ranks(spec)
    elif _is_mesh(spec):
        ranks = spec.mesh.flatten().tolist()
    elif isinstance(spec, str) or (
        isinstance(spec, (list, tuple)) and spec and all(isinstance(d, str) for d in spec)
    ):
        dims = (spec,) if isinstance(spec, str) else tuple(spec)
        if mesh is None:
            raise ValueError(
                f"group={spec!r} names mesh dimensions, but there is no DeviceMesh to find them "
                "in: pass the DeviceMesh (mesh['tp']) instead, or use the names inside DTensor "
                "ops (they resolve against the op's own mesh)"
            )
        return _mesh_slice(mesh, dims, rank)
    elif isinstance(spec, (list, tuple, range)) and all(isinstance(r, int) for r in spec):
        ranks = spec
    elif spec == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    else:
        raise TypeError(
            "an rngcheck group must be None, a ProcessGroup, a list of ranks, a DeviceMesh or "
            f"mesh dimension names; got {type(spec).__name__} {spec!r}"
        )
    members = tuple(sorted({int(r) for r in ranks}))
    return members if rank in members else None


# ---------------------------------------------------------------------------------------------
# The checker


class RankChecker:
    """Exchanges this rank's random-op digests with the other ranks of its group.

    Made by :func:`start` on every rank (collectively: it creates the checker's gloo groups).

    Known limitations:
        A collective on a subgroup called by a non-member returns without reaching the dispatcher,
        so that rank sees one alignment point fewer: call subgroup collectives on members only.
        ``expect("differ")`` finds ranks that share a state over a whole window (or at one op,
        with ``sync="op"``), not a pair that collides at one op of a longer window. Streams are
        checked within the rank's ``group`` (its partition), not across partitions.
    """

    def __init__(
        self,
        mode: Any,
        side: Any,
        domain: tuple[int, ...],
        rank: int,
        world: int,
        timeout: float,
    ):
        self._mode = mode
        self._cfg = mode.config
        self._side = side
        self._domain = domain
        self._domain_set = frozenset(domain)
        self.rank = rank
        self.world = world
        self.stats = ExchangeStats()
        self._pending: list[RandomOpEvent] = []
        self._rows: list[Row] = []
        self._round = 0
        self._inflight: _Round | None = None  # posted, not yet waited for
        self._stopped = False
        self._finished = False
        self._busy = False
        self._board = _Board(getattr(side, "group_name", "side"))
        # The group-wide "same" stream rides in the fast vector; streams over parts of the group
        # ("differ" ones, expect(group=...), sub-mesh DTensors) go through small gloo groups.
        self._whole_stream = _text_hash("same", ",".join(map(str, domain)))
        self._stream_members: dict[int, tuple[int, ...]] = {}
        self._subgroups: dict[tuple[int, ...], Any] = {}
        self._lock = threading.RLock()  # random ops in backward may arrive on autograd threads
        self._groups: dict[Any, tuple[Any, tuple[int, ...] | None]] = {}
        self._seen_generators: set[str] = set()
        self._first_use: set[int] = set()  # pending indices that are a generator's first op
        # generator -> (count, last op, its site, why) of its uncompared ops since its last row
        self._ignored: dict[str, tuple[int, str, str, str]] = {}
        self._ignored_before: dict[int, tuple[int, str, str, str]] = {}  # pending index -> those
        self._warned_specs: set[str] = set()
        self.timeout = timeout
        self._timeout = timedelta(seconds=timeout)
        # Data parallelism (the rules of "what must agree with what", numbered in the README and
        # cited here): Rule 2, ops of a data-parallel forward/backward are not compared; Rule 3,
        # a generator seeded per rank in a data-parallel program is a per-rank stream; Rule 4,
        # parameter initialisations are settled at the first step, unless a wrapper broadcast them.
        self._dp = DataParallelTracker(self._on_wrapper, self._settle_due)
        self._dp.install()
        self._per_rank: dict[int, str] = {}  # generator digest -> why it is a per-rank stream
        self._per_rank_keys: set[str] = set()
        self._init: list[_Init] = []
        self._init_due = False  # the next exchange settles the parameter initialisations
        self._init_settled = False
        self._broadcast_inits: dict[str, int] = {}  # wrapper label -> initialisations it covered
        self._held: list[Finding] = []  # per-rank seeding seen before the program was known DP
        # every_steps > 1: only every Nth optimizer step is checked. Steps in between record no
        # rows and treat no collective as an alignment point, so they cost nothing here; a
        # divergence that starts on one still shows at the next checked step (the states differ).
        self._steps = 0
        self._checking = True
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook = register_optimizer_step_post_hook(self._on_step)
        report = mode._report
        report.rank, report.world_size = rank, world
        self._publish()

    # -- inputs from the mode ----------------------------------------------------------------

    def on_event(self, event: RandomOpEvent, mesh: Any = None, written: Any = None) -> None:
        """A random op of this rank; ``written``: the tensor an in-place op wrote, if any."""
        if self._stopped or self._busy or not self._checking:
            return
        why = self._uncompared(event, mesh)
        if why:
            # Not compared, but it still moves its generator: remembered so that a divergence
            # it causes in a checked op later can be pinned on it.
            with self._lock:
                count = self._ignored.get(_gen_key(event), (0,))[0]
                self._ignored[_gen_key(event)] = (count + 1, event.op, event.site, why)
            return
        with self._lock:
            self._add(event, mesh, written)
        if self._cfg.sync == "op":
            self._exchange(Point.RANDOM_OP, event.op)
        elif len(self._rows) >= self._cfg.every:
            self._exchange(Point.EVERY, "")

    def _uncompared(self, event: RandomOpEvent, mesh: Any) -> str:
        """Why this op is not compared across ranks ("" when it is)."""
        if event.expect == "ignore":
            return "under expect('ignore')"
        if mesh is not None or current_expectation() is not None:
            return ""  # declared: DTensor's contract (its mesh), or the user's expect block
        wrapper = self._dp.current(event.phase is not Phase.FORWARD)
        if wrapper is not None and self.rank in wrapper.ranks:  # Rule 2
            self._dp.count(wrapper)
            return f"in the data-parallel forward/backward of {wrapper.label}"
        if _gen_key(event) in self._per_rank_keys:  # Rule 3
            return "on a per-rank stream"
        return ""

    def _add(self, event: RandomOpEvent, mesh: Any, written: Any) -> None:
        exp = current_expectation()
        spec = exp.group if exp is not None else None
        members = self._members(spec, mesh)
        policy = event.expect if event.expect in POLICY_CODE else "same"
        stream = _text_hash(policy, ",".join(map(str, members))) if members else 0
        declared = exp is not None or mesh is not None
        code = POLICY_CODE["declared" if declared and policy == "same" else policy]
        if members:
            self._stream_members[stream] = members
        gen = _gen_key(event)
        if gen not in self._seen_generators:
            self._seen_generators.add(gen)
            self._first_use.add(len(self._pending))
        ignored = self._ignored.pop(gen, None)
        if ignored is not None:
            self._ignored_before[len(self._pending)] = ignored
        row = Row(
            structure=_text_hash(event.op, gen, *event.args),
            stream=stream,
            before=event.before if event.before is not None else 0,
            after=event.after if event.after is not None else 0,
            policy=code,
            generator=_text_hash(gen),
        )
        if (
            stream
            and not self._init_settled
            and mesh is None
            and isinstance(written, torch.nn.Parameter)
            and len(self._init) < _MAX_INIT
        ):
            # A parameter's initialisation (Rule 4): its order is compared now, its state at the
            # settle point, and not at all if a data-parallel wrapper broadcasts the parameter.
            storage = written.untyped_storage().data_ptr()
            self._init.append(_Init(row, event, storage, weakref.ref(written)))
            row = row._replace(stream=0)
        self._pending.append(event)
        self._rows.append(row)

    @staticmethod
    def mesh_of(args: tuple, kwargs: dict) -> Any:
        """The DeviceMesh a random op runs over (a DTensor op), or None."""
        return op_mesh(args, kwargs)

    def on_collective(self, func: Any) -> None:
        if self._checking:
            self._exchange(Point.COLLECTIVE, str(func))

    def _on_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._dp.on_step()
        self._dp.refresh()
        self._settle_due()
        if self._checking and self._cfg.sync == "step":
            self._exchange(Point.OPTIMIZER_STEP, f"{type(optimizer).__name__}.step()")
        self._steps += 1
        self._checking = self._steps % self._cfg.every_steps == 0

    def check(self) -> None:
        self._settle_due()
        self._exchange(Point.CHECK, "mode.check()")

    def finish(self) -> None:
        self._finished = True
        self._settle_due()
        self._exchange(Point.EXIT, "")

    # -- data parallelism ------------------------------------------------------------------------

    def _settle_due(self) -> None:
        """The program reached its first step (or a data-parallel forward, check() or exit): the
        next exchange settles the parameter initialisations and the held per-rank findings."""
        if not self._init_settled:
            self._init_due = True

    def _on_wrapper(self, wrapper: Wrapper) -> None:
        """A data-parallel wrapper is being built (before its own collectives) or first ran."""
        if not wrapper.broadcasts:
            return
        with self._lock:
            # A parameter that no longer exists (replaced by a tied one before the wrapper was
            # built) holds nothing replicated once the module's live states are overwritten.
            kept = [
                i
                for i in self._init
                if i.storage not in wrapper.storages and i.parameter() is not None
            ]
            covered = len(self._init) - len(kept)
            if covered:  # Rule 4: the broadcast overwrites whatever these drew
                self._init = kept
                self._broadcast_inits[wrapper.label] = (
                    self._broadcast_inits.get(wrapper.label, 0) + covered
                )

    def notes(self) -> list[Note]:
        """What the data-parallel rules left uncompared, for the report (``rngcheck show``)."""
        out = []
        for label, count in self._dp.ops.items():
            out.append(
                Note(
                    kind="not_compared",
                    message=f"not compared: {count} random op(s) in the forward and backward of "
                    f"{label} (data-parallel: each rank draws for its own batch).",
                    count=count,
                )
            )
        for label, count in self._broadcast_inits.items():
            out.append(
                Note(
                    kind="not_compared",
                    message=f"not compared: {count} parameter initialisation(s); {label} "
                    "broadcast the module's states from one rank when it was built.",
                    count=count,
                )
            )
        if self._dp.wrappers:
            programs = "; ".join(w.label for w in self._dp.wrappers)
            for why in self._per_rank.values():
                out.append(
                    Note(
                        kind="not_compared",
                        message=f"not compared: {why}, in a data-parallel program ({programs}): "
                        "a per-rank stream (seed + rank, per-rank data generators).",
                    )
                )
        return out

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._dp.uninstall()
        if not (self._finished or self._stopped):
            # Leaving early (an exception in the block): tell the ranks that will wait for us.
            exc = sys.exc_info()[1]
            why = f"{type(exc).__name__}: {exc}" if exc is not None else "no exception seen"
            self._board.post_left(self.rank, why[:300])
        self._stopped = True
        self._inflight = None  # not waited for: the others learn from the store, or time out
        self._pending.clear()
        self._rows.clear()
        self._subgroups.clear()  # gloo closes their connections when they are freed
        side, self._side = self._side, None
        if side is not None:
            try:
                dist.destroy_process_group(side)
            except Exception:  # noqa: BLE001 - a group broken by a timeout cannot always be torn down
                log.debug("rngcheck could not destroy its side group", exc_info=True)
        self._publish()

    def renders(self, finding: Finding) -> bool:
        """One merged rendering: the lowest rank that is involved (or that waited) draws it."""
        if finding.kind is FindingKind.RANK_MISSING:
            waited = finding.sides[0].ranks if finding.sides else ()
            return self.rank == min(waited or (self.rank,))
        if not finding.ranks:
            return True  # a local finding (a recompute mismatch): each rank draws its own
        return self.rank == min(finding.ranks)

    # -- groups ------------------------------------------------------------------------------

    def _members(self, spec: Any, mesh: Any) -> tuple[int, ...] | None:
        plain = isinstance(spec, (str, list, tuple, range))
        key = (
            tuple(spec) if plain and not isinstance(spec, str) else spec if plain else id(spec),
            id(mesh),
        )
        hit = self._groups.get(key)
        if hit is None:
            if len(self._groups) >= _MAX_GROUPS:  # groups made afresh in a loop: do not grow
                self._groups.clear()
            try:
                members = resolve_group(spec, self.rank, self.world, mesh)
            except (TypeError, ValueError) as e:
                text = str(e)
                if text not in self._warned_specs:
                    self._warned_specs.add(text)
                    warnings.warn(
                        f"rngcheck: {text}; checking over the mode's group instead", stacklevel=4
                    )
                members = self._domain
            if members is not None:
                members = tuple(r for r in members if r in self._domain_set)
                if len(members) < 2:
                    members = None
            hit = self._groups[key] = ((spec, mesh), members)  # refs keep the ids from reuse
        return hit[1]

    # -- exchange ----------------------------------------------------------------------------

    def _exchange(self, point: Point, where: str) -> None:
        if self._stopped or self._busy or self._side is None:
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
                    finding = self._exchange_now(point, where)
            finally:
                self._busy = False
                self._publish()
        if finding is not None:
            self._mode._emit(finding)

    def _all_reduce(self, kind: str, t: torch.Tensor, op: Any, async_op: bool = False) -> Any:
        nbytes = t.numel() * t.element_size()
        if kind == "fast":
            self.stats.fast_calls += 1
            self.stats.fast_bytes += nbytes
        else:
            self.stats.slow_calls += 1
            self.stats.slow_bytes += nbytes
        try:
            return dist.all_reduce(t, op, group=self._side, async_op=async_op)
        except RuntimeError as e:
            raise _PeerLost(e) from e

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in self._domain]
        self.stats.slow_calls += 1
        self.stats.slow_bytes += t.numel() * t.element_size()
        try:
            dist.all_gather(out, t, group=self._side)
        except RuntimeError as e:
            raise _PeerLost(e) from e
        return out

    def _exchange_now(self, point: Point, where: str) -> Finding | None:
        # The round posted at the previous exchange point first (sync="step" leaves it in flight
        # at optimizer steps and every-N points): every rank settles round r before it posts
        # round r + 1, so the collectives on the side group stay in the same order everywhere.
        finding = self._settle(point, where)
        if finding is not None or self._stopped:
            return finding
        init = held = None
        if self._init_due:
            # Rule 4's settle point; the per-rank seeding held back (Rule 3) is judged here too,
            # after the initialisations (they come first in the program).
            init, self._init = self._init, []
            held, self._held = self._held, []
            self._init_due, self._init_settled = False, True
        self._round += 1
        self.stats.exchanges += 1
        vec, parts = self._fast_vector(point, self._rows, init)
        pipelined = self._cfg.sync == "step" and point in _PIPELINED
        sent = _Round(
            number=self._round,
            point=point,
            where=where,
            rows=self._rows,
            events=self._pending,
            first_use=self._first_use,
            ignored_before=self._ignored_before,
            vec=vec,
            parts=parts,
            stack=Stack.capture() if pipelined else None,
            init=init,
            held=held or None,
        )
        self._clear()  # the window now belongs to the round until it is settled
        try:
            sent.work = self._all_reduce("fast", vec, dist.ReduceOp.MAX, async_op=True)
        except _PeerLost as e:
            self._stopped = True
            return self._missing(sent, point, where, e.__cause__ or e)
        self._inflight = sent
        if pipelined:
            return None
        return self._settle(point, where)

    def _settle(self, point: Point, where: str) -> Finding | None:
        """Wait for the round in flight (bounded by the timeout) and judge it; ``point`` and
        ``where``: where this rank is now (it waits there)."""
        sent, self._inflight = self._inflight, None
        if sent is None:
            return None
        try:
            try:
                sent.work.wait(self._timeout)
            except RuntimeError as e:
                raise _PeerLost(e) from e
            v = sent.vec.tolist()
            mismatch = any(v[i] != -v[i + 1] for i in range(0, _INIT_SLOT, 2))
            init_mismatch = v[_INIT_SLOT] != -v[_INIT_SLOT + 1]
            if not mismatch and v[_HEADER - 1] > 0:
                # Streams over parts of the group: each checked on its own small gloo group (the
                # structure digest above guarantees every member has the same streams), then
                # one flag so that the whole group agrees on whether to gather. Blocking; every
                # rank runs them at the same round (the flag is the all-reduced one).
                local = self._partition_rounds(sent.parts)
                flag = torch.tensor([1 if local else 0], dtype=torch.int64)
                self._all_reduce("fast", flag, dist.ReduceOp.MAX)
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
                self._stopped = True  # one report, then no more exchanges: later ops would differ
                self._clear()
            return finding
        except _PeerLost as e:  # gloo: the group timeout, or a peer that went away
            self._stopped = True
            return self._missing(sent, point, where, e.__cause__ or e)

    def _clear(self) -> None:
        self._rows = []
        self._pending = []
        self._first_use = set()
        self._ignored_before = {}

    def _fast_vector(
        self, point: Point, rows: list[Row], init: list[_Init] | None
    ) -> tuple[torch.Tensor, dict[int, list[Row]]]:
        """The group-wide vector, and this rank's streams over parts of the group."""
        structure = _fold(r.structure for r in rows)
        whole: list[Row] = []
        parts: dict[int, list[Row]] = {}
        for r in rows:
            if r.stream == self._whole_stream:
                whole.append(r)
            elif r.stream:
                parts.setdefault(r.stream, []).append(r)
        x = _fold(v for r in whole for v in (r.structure, r.before, r.after))
        # The parameter initialisations, at the one round that settles them (Rule 4).
        y = 0
        if init is not None:
            y = _fold([len(init), *(v for i in init for v in (i.row.structure, i.row.before))])
        vec = torch.tensor(
            [
                self._round,
                -self._round,
                int(point),
                -int(point),
                structure,
                -structure,
                x,
                -x,
                y,
                -y,
                1 if parts else 0,
            ],
            dtype=torch.int64,
        )
        return vec, parts

    def _partition_rounds(self, parts: dict[int, list[Row]]) -> bool:
        """Check this rank's part-of-the-group streams, in the same (sorted) order on every rank
        so that no two ranks wait for each other in opposite orders. True: one disagrees."""
        bad = False
        for stream in sorted(parts, key=lambda s: (self._stream_members[s], s)):
            members = self._stream_members[stream]
            srows = parts[stream]
            pg = self._subgroup(members)
            if srows[0].policy == POLICY_CODE["differ"]:
                mine = torch.tensor([_fold(v for r in srows for v in (r.structure, r.before))])
                out = [torch.empty_like(mine) for _ in members]
                self._count(mine)
                _wait(lambda pg=pg, out=out, mine=mine: pg.allgather([out], [mine]))
                values = [int(o) for o in out]
                bad = bad or len(set(values)) < len(values)  # two ranks share their states
            else:
                x = _fold([stream, *(v for r in srows for v in (r.structure, r.before, r.after))])
                t = torch.tensor([x, -x], dtype=torch.int64)
                self._count(t)
                _wait(lambda pg=pg, t=t: pg.allreduce([t], _max_options()))
                bad = bad or int(t[0]) != -int(t[1])
        return bad

    def _count(self, t: torch.Tensor) -> None:
        self.stats.fast_calls += 1
        self.stats.fast_bytes += t.numel() * t.element_size()

    def _subgroup(self, members: tuple[int, ...]) -> Any:
        """A gloo group over ``members`` made by them alone (rendezvous on the c10d store under
        this checker's name), created the first time one of their streams is checked."""
        pg = self._subgroups.get(members)
        if pg is None:
            from torch.distributed.distributed_c10d import _get_default_store

            name = f"rngcheck/{self._board.name}/group/{'_'.join(map(str, members))}"
            store = dist.PrefixStore(name, _get_default_store())
            try:
                pg = dist.ProcessGroupGloo(
                    store, members.index(self.rank), len(members), self._timeout
                )
            except RuntimeError as e:
                raise _PeerLost(e) from e
            self._subgroups[members] = pg
            self.stats.setup_calls += 1
        return pg

    # -- slow path: gather the windows, find the first divergent op, gather its detail -------

    def _slow_path(
        self, sent: _Round, rows: list[Row], events: list[RandomOpEvent], *, init: bool
    ) -> Finding | None:
        """Gather every rank's rows, find the first divergent op, gather its detail, and judge it.

        A divergence explained by per-rank seeding is not a finding in a data-parallel program
        (Rule 3): the generator becomes a per-rank stream, its rows leave the comparison, and the
        rest of the round is judged again (every rank runs the same loop on the same gathered
        data). ``init``: ``rows`` are the parameter initialisations settled this round (Rule 4).
        """
        head = torch.tensor([len(rows), sent.number, int(sent.point)], dtype=torch.int64)
        heads = [h.tolist() for h in self._all_gather(head)]
        length = max(h[0] for h in heads)
        mine = torch.zeros((max(length, 1), _ROW), dtype=torch.int64)
        if rows:
            mine[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
        gathered = self._all_gather(mine)
        windows = {
            rank: [Row(*r) for r in t[: h[0]].tolist()]
            for rank, t, h in zip(self._domain, gathered, heads, strict=True)
        }
        points = {rank: Point(h[2]) for rank, h in zip(self._domain, heads, strict=True)}
        stack = sent.stack if sent.stack is not None else Stack.capture()
        where = point_text(points[self.rank], sent.where, stack)
        while True:
            # Per-rank streams leave the comparison (Rule 3), but not parameter initialisations:
            # a replicated parameter drawn from a per-rank stream is still wrong (Rule 4).
            skip = () if init else self._per_rank
            kept = {
                r: [i for i, row in enumerate(w) if row.generator not in skip]
                for r, w in windows.items()
            }
            view = {r: [windows[r][i] for i in kept[r]] for r in windows}
            spot = localise(view, points if not init else dict.fromkeys(points, sent.point))
            if spot is None:  # no divergence left (or two streams shared a hashed slot)
                return None
            at = spot.index_for(self.rank, view[self.rank])
            index = kept[self.rank][at] if 0 <= at < len(kept[self.rank]) else -1
            event = events[index] if index >= 0 else None
            blob = {
                "event": event.to_dict() if event is not None else None,
                "point": where,
                "seed_calls": self._seed_calls(event)
                if event is not None and (init or index in sent.first_use)
                else [],
                "ignored": None if init else sent.ignored_before.get(index),
                "dp": [w.label for w in self._dp.wrappers],
            }
            details = self._gather_text(json.dumps(blob))
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
                return finding
            # Rule 3: a per-rank stream. Its rows leave the comparison from here on; the finding
            # is held until the settle point when the program is not known data-parallel yet.
            first, why = seeded
            key = _gen_key(first)
            self._per_rank[_text_hash(key)] = why
            self._per_rank_keys.add(key)
            if not details[min(details)]["dp"]:
                if self._init_settled:
                    return finding  # past the settle point and not data-parallel: a finding
                self._held.append(finding)

    def _gather_text(self, text: str) -> dict[int, dict[str, Any]]:
        data = text.encode()
        sizes = self._all_gather(torch.tensor([len(data)], dtype=torch.int64))
        longest = max(int(s) for s in sizes)
        buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = self._all_gather(buf)
        return {
            rank: json.loads(bytes(t[: int(s)].tolist()).decode())
            for rank, t, s in zip(self._domain, out, sizes, strict=True)
        }

    def _seed_calls(self, event: RandomOpEvent) -> list[dict[str, Any]]:
        """Seeding calls since the mode started that reached this op's generator (its first op)."""
        if event.out_of_band is not None or not event.generator.is_default:
            return []
        calls = self._mode._seeds.since(0, event.generator.device)
        return [c.to_dict() for c in calls if not c.by_torch]

    def _missing(self, sent: _Round, point: Point, where: str, error: BaseException) -> Finding:
        """A rank did not arrive at round ``sent`` in time: find out which through the store, and
        say so. ``point`` and ``where``: where this rank waited for it."""
        stack = Stack.capture()
        here = point_text(point, where, stack)
        number = sent.number
        # A pipelined round was sent at an earlier point and waited for here.
        sent_at = point_text(sent.point, sent.where, sent.stack) if sent.stack is not None else here
        arrived = self._board.arrivals(number, self.rank, self._domain, min(5.0, self.timeout))
        missing = tuple(r for r in self._domain if r not in arrived)
        late = not missing  # everyone else also gave up here: this rank is the one that came late
        if late:
            missing = (self.rank,)
            arrived = tuple(r for r in self._domain if r != self.rank)
        last = sent.events[-1] if sent.events else None
        left = self._board.left(missing)
        cause = (
            "the missing rank(s) stopped running the code the others run: an early return "
            "or exception on that rank, a hang, a crash, or a different number of optimizer "
            "steps or collectives"
        )
        if left:
            cause = "; ".join(
                f"rank {r} left the checked block early ({why})" for r, why in sorted(left.items())
            )
        cause += (
            ". rngcheck stopped exchanging so the program does not hang on it "
            f"({type(error).__name__}: {str(error).splitlines()[0][:160]})"
        )
        message = (
            f"rank(s) {format_ranks(missing)} did not reach RNG exchange #{number} within "
            f"{self.timeout:g} s; rank(s) {format_ranks(arrived)} waited at {here}"
        )
        if sent_at != here:
            message += f" (exchange #{number} was sent at {sent_at})"
        if late:
            message = (
                f"this rank ({self.rank}) reached RNG exchange #{number} at {sent_at} after "
                f"rank(s) {format_ranks(arrived)} had given up waiting ({self.timeout:g} s)"
            )
        return Finding(
            kind=FindingKind.RANK_MISSING,
            message=message,
            op=last.op if last is not None else "",
            cause=cause,
            differs="arrival",
            ranks=missing,
            stack=stack,
            sides=(
                Side(label="arrived", ranks=arrived, note=f"waited at {here}"),
                Side(label="missing", ranks=missing, note="did not reach the exchange"),
            ),
            seq=last.seq if last is not None else -1,
        )

    def _publish(self) -> None:
        self._mode._report.meta["rank_exchange"] = self.stats.to_dict()


class _PeerLost(Exception):
    """A side-group collective failed: a rank timed out or went away (gloo's RuntimeError)."""


def _gen_key(event: RandomOpEvent) -> str:
    """A generator's name across ranks. Each rank drives its own device (cuda:0 on rank 0,
    cuda:1 on rank 1), so devices compare by type."""
    ident = event.generator
    return f"{ident.kind}#{ident.number}:{ident.device.split(':')[0]}"


def _mismatched(vec: torch.Tensor) -> bool:
    v = vec.tolist()
    return any(v[i] != -v[i + 1] for i in range(0, _HEADER - 1, 2))


def _wait(call: Any) -> None:
    try:
        call().wait()
    except RuntimeError as e:
        raise _PeerLost(e) from e


def _max_options() -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    return opts


class _Board:
    """Notes on the c10d store, written and read only after an exchange failed or a rank left
    early (never on the fast path): who reached the failed exchange, and why a rank left."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._prefix = f"rngcheck/{name}/"
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store: Any = _get_default_store()
        except Exception:  # noqa: BLE001 - no store: findings just say less
            log.debug("rngcheck has no c10d store to leave notes on", exc_info=True)
            self._store = None

    def arrivals(self, round_: int, rank: int, domain: tuple[int, ...], wait: float) -> tuple:
        """The ranks that reached exchange ``round_`` (each posts a key when its wait fails)."""
        if self._store is None:
            return (rank,)
        keys = [f"{self._prefix}{round_}/{r}" for r in domain]
        try:
            self._store.set(keys[domain.index(rank)], "1")
            deadline = time.monotonic() + wait
            while True:
                here = tuple(r for r, k in zip(domain, keys, strict=True) if self._store.check([k]))
                gone = self.left([r for r in domain if r not in here])  # they will not come
                if len(here) + len(gone) == len(domain) or time.monotonic() > deadline:
                    return here
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store's host may be gone too
            log.debug("rngcheck could not read arrivals from the store", exc_info=True)
            return (rank,)

    def post_left(self, rank: int, reason: str) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(f"{self._prefix}left/{rank}", reason)

    def left(self, ranks: Sequence[int]) -> dict[int, str]:
        """Why each of ``ranks`` left the checked block early, where it said so."""
        out: dict[int, str] = {}
        if self._store is None:
            return out
        for r in ranks:
            key = f"{self._prefix}left/{r}"
            with contextlib.suppress(Exception):
                if self._store.check([key]):
                    out[r] = self._store.get(key).decode(errors="replace")
        return out


# ---------------------------------------------------------------------------------------------
# Start-up


def start(mode: Any) -> RankChecker | None:
    """The rank checker for ``mode``, or None in a single process (or outside ``group``).

    Collective: every rank must call it (at ``__enter__``, or ``bind_distributed()``), because it
    creates the checker's gloo groups and agrees on the configuration.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    cfg = mode.config
    rank, world = dist.get_rank(), dist.get_world_size()
    seconds, source = (cfg.timeout, "timeout=") if cfg.timeout is not None else _group_timeout()
    timeout = timedelta(seconds=seconds)
    # A bad group= fails here, the same way on every rank, before any group exists.
    domain = resolve_group(cfg.group, rank, world, cfg.group if _is_mesh(cfg.group) else None)
    with torch._C._DisableTorchDispatch():
        _await_every_rank(rank, world, seconds)
        world_side = dist.new_group(backend="gloo", timeout=timeout)
        try:
            parts, t = _agree(world_side, cfg, domain, world)
        except BaseException:
            dist.destroy_process_group(world_side)
            raise
        side = world_side
        if parts != [tuple(range(world))]:
            side = None
            for part in parts:  # every rank creates every group, in the same order
                g = dist.new_group(ranks=list(part), backend="gloo", timeout=timeout)
                if domain is not None and part == domain:
                    side = g
            dist.destroy_process_group(world_side)
    if domain is None or side is None:
        log.info(
            "rngcheck: rank %d is outside group=%r; it is not checked across ranks", rank, cfg.group
        )
        return None
    checker = RankChecker(mode, side, domain, rank, world, seconds)
    checker.stats.setup_calls, checker.stats.setup_bytes = 1, t.numel() * t.element_size()
    mode._report.meta["rank_timeout"] = {"seconds": seconds, "from": source}
    checker._publish()
    return checker


def _group_timeout() -> tuple[float, str]:
    """The default process group's own timeout: the one torch.distributed's collectives would
    give up at anyway, so a rank that is slow but within it (saving a checkpoint, evaluating)
    is never reported missing. (``Backend.options._timeout``, the same on torch 2.9 to 2.14.)"""
    group = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            seconds = group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - no backend for that device, or another layout
            continue
        if seconds > 0:
            return seconds, "the process group"
    try:
        default = dist.distributed_c10d._get_default_timeout(dist.get_backend())
        return default.total_seconds(), "torch.distributed's default"
    except Exception:  # noqa: BLE001 - a torch without the helper
        return 1800.0, "torch.distributed's default"


_ENTRIES = [0]  # the modes this process started across ranks: the same count on every rank


def _await_every_rank(rank: int, world: int, timeout: float) -> None:
    """Wait until every rank has entered the mode (the start is collective), through the c10d
    store, so a mode entered on some ranks only ends in one clear error on each rank that did,
    instead of a raw store timeout inside torch.distributed.new_group."""
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        store = _get_default_store()
    except Exception:  # noqa: BLE001 - no store to meet on: new_group will tell
        return
    prefix = f"rngcheck/enter/{_ENTRIES[0] + 1}/"
    store.set(f"{prefix}{rank}", "1")
    count = store.add(f"{prefix}count", 1)
    start = time.monotonic()
    pause = 0.01
    warned = False
    while count < world:
        waited = time.monotonic() - start
        if waited > timeout:
            here = [r for r in range(world) if store.check([f"{prefix}{r}"])]
            missing = [r for r in range(world) if r not in here]
            # Leave no trace: this start did not happen, so the next one (on every rank) meets
            # under the same number, from a clean count.
            store.add(f"{prefix}count", -1)
            store.delete_key(f"{prefix}{rank}")
            raise RuntimeError(
                f"rngcheck: the RNGConsistencyMode was entered on {_ranks(here)} of {world} but "
                f"not on {_ranks(missing)} within {timeout:g} s. Checking across ranks is "
                "collective: enter the mode on every rank (the same `with` block, or RNGCHECK=1 "
                "for the whole job), or pass sync='off' where only some ranks run the checked code."
            )
        if not warned and waited > 10:
            warned = True
            warnings.warn(
                f"rngcheck: rank {rank} entered the RNGConsistencyMode and waits for the other "
                f"ranks to enter it too (up to {timeout:g} s)",
                stacklevel=4,
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
        count = store.add(f"{prefix}count", 0)
    _ENTRIES[0] += 1


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {format_ranks(ranks)}"


def _agree(
    world_side: Any, cfg: Any, domain: tuple[int, ...] | None, world: int
) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """One start-up gather (O(world), once): every rank's group and settings, so that all ranks
    create the same side groups in the same order and refuse mismatched settings."""
    mine = [-1] * world
    for r in domain or ():
        mine[r] = 1
    settings = _text_hash(cfg.sync, cfg.expect, str(cfg.every), str(cfg.every_steps))
    t = torch.tensor([settings, *mine], dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=world_side)
    rows = [o.tolist() for o in out]
    if len({r[0] for r in rows}) > 1:
        raise ValueError(
            "rngcheck needs the same sync, expect, every and every_steps on every rank; the ranks "
            "were started with different ones (check the RNGCHECK_* environment of each rank)"
        )
    parts = sorted({tuple(i for i, v in enumerate(r[1:]) if v == 1) for r in rows} - {()})
    _check_disjoint(parts)
    return parts, t


def _check_disjoint(parts: list[tuple[int, ...]]) -> None:
    seen: dict[int, tuple[int, ...]] = {}
    for part in parts:
        for r in part:
            if r in seen:
                raise ValueError(
                    f"rngcheck: the ranks passed overlapping groups {seen[r]} and {part} as "
                    "group=; each rank's group must be a partition of the world (the same list on "
                    "every rank, or one DeviceMesh dimension)"
                )
            seen[r] = part


def exchange_stats(mode: Any = None) -> dict[str, int]:
    """The cross-rank exchange counters of ``mode`` (default: the active mode), as plain data."""
    if mode is None:
        from .mode import active_mode

        mode = active_mode()
    if mode is None:
        return {}
    return dict(mode.report.meta.get("rank_exchange", {}))
