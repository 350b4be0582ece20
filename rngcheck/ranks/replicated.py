"""Replicated parameters: they must start equal on every rank that holds them.

The parameters a wrapper or a DTensor placement says are replicated are compared across their
group by digest at the settle point (:class:`Replicas`); the initialisations rngcheck recorded for
them explain a difference instead of deciding it.

A random op that initialises a parameter (an in-place op on an ``nn.Parameter``) before the
program's first step is not compared as it is drawn: its order is, its state waits for the
settle point (the first step, a wrapper's forward, ``check()`` or exit; the same exchange on
every rank, P5). There the initialisations of the parameters a data-parallel wrapper
broadcast as it was built (DDP; FSDP with ``sync_module_states``; DeepSpeed; ZeRO-3's
``zero.Init``) are dropped: the broadcast overwrote what they drew. A parameter that no longer
exists drew into nothing that trains, and is dropped too (tied weights). The rest are compared.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..core.digest import resolve_digest, tensor_digest
from ..core.events import RandomOpEvent
from ..core.findings import Finding
from .integrations.records import Wrapper
from .program import Program, optimizer_parameters
from .protocol import POLICY_CODE, Row, text_hash

__all__ = [
    "Differs",
    "Held",
    "Init",
    "Initialisations",
    "Replicas",
    "first_difference",
    "parameter_digest",
    "rows",
]

_MAX_INIT = 100_000  # parameter initialisations kept for the settle point


@dataclass(slots=True)
class Init:
    """A random op that initialised a parameter: its state is compared at the settle point, and
    not at all if a data-parallel wrapper broadcasts that parameter first."""

    row: Row
    event: RandomOpEvent
    parameter: weakref.ref[Any]  # dead once replaced (tied weights, or re-made)


class Initialisations:
    """The parameter initialisations waiting for the settle point, and what left them out."""

    def __init__(self) -> None:
        self.pending: list[Init] = []
        self.due = False  # the next exchange settles them
        self.settled = False
        self.broadcast: dict[str, int] = {}  # wrapper label -> initialisations it overwrote
        self.replaced = 0  # initialisations of parameters gone by the settle point
        self.compared = 0  # initialisations compared at the settle point
        self.held: list[Finding] = []  # per-rank seeding seen before the program was known DP

    def defer(self, row: Row, event: RandomOpEvent, written: Any, mesh: Any) -> Row:
        """The row to post now for a compared op: a parameter's initialisation before the settle
        point posts its order alone (its state waits for the settle point)."""
        if (
            self.settled
            or not isinstance(written, torch.nn.Parameter)
            or len(self.pending) >= _MAX_INIT
        ):
            return row
        self.pending.append(Init(row, event, weakref.ref(written)))
        return row._replace(stream=0)

    def settle_due(self) -> None:
        """The program reached its first step (or a data-parallel forward, check() or exit): the
        next exchange settles the initialisations and the held per-rank findings."""
        if not self.settled:
            self.due = True

    def take(
        self, wrappers: list[Wrapper], by_digest: set[int]
    ) -> tuple[list[Init], list[Init], list[Finding]] | None:
        """At the exchange that settles them (the same one on every rank, P5): the
        initialisations to compare, those of parameters compared by digest instead (``by_digest``:
        their ids; these explain a difference), and the per-rank findings held back; or None
        when this is not that exchange."""
        if not self.due:
            return None
        live, self.pending = self._live(self.pending, wrappers), []
        inits: list[Init] = []
        explaining: list[Init] = []
        for init in live:
            (explaining if id(init.parameter()) in by_digest else inits).append(init)
        self.compared += len(inits)
        held, self.held = self.held, []
        self.due, self.settled = False, True
        return inits, explaining, held

    def put_back(self, inits: list[Init], explaining: list[Init], held: list[Finding]) -> None:
        """A round that settled them met a rank that ran out of inputs in torch's Join: they are
        settled at the first exchange after it, on every rank (P7)."""
        self.pending = [*inits, *explaining, *self.pending]
        self.compared -= len(inits)
        self.held = [*held, *self.held]
        self.settled = False

    def on_wrapper(self, wrapper: Wrapper) -> None:
        """A wrapper that broadcasts the module's states is being built: what it overwrites
        drew nothing that stays. (A parameter that no longer exists is left to ``_live``.)"""
        if not wrapper.broadcasts:
            return
        kept = [i for i in self.pending if not wrapper.overwrites(i.parameter())]
        covered = len(self.pending) - len(kept)
        if covered:
            self.pending = kept
            self.broadcast[wrapper.label] = self.broadcast.get(wrapper.label, 0) + covered

    def _live(self, inits: list[Init], wrappers: list[Wrapper]) -> list[Init]:
        """After a wrapper broadcast: the initialisation of a parameter that no longer exists
        (replaced by a tied one, or re-made before the wrapper was built) drew into nothing that
        trains, and is left out. Garbage is collected first, so that what is left out does not
        depend on when each rank's collector last ran (P5)."""
        if not inits or not any(w.broadcasts for w in wrappers):
            return inits
        gc.collect()
        kept = [i for i in inits if i.parameter() is not None]
        self.replaced += len(inits) - len(kept)
        return kept


# -- replicated parameters as an invariant ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Held:
    """A parameter this rank holds whole, which a wrapper or a DTensor placement says is
    replicated over ``members``: every one of them must hold the same values."""

    members: tuple[int, ...]
    name: str  # as every member names it ("0.weight"; a DTensor's place among the optimizer's)
    owner: str  # what says so ("DistributedDataParallel over ranks 0-1")
    parameter: Any
    digest: int  # its values, read as the settling round is posted

    @property
    def stream(self) -> int:
        return text_hash("replicated", ",".join(map(str, self.members)))


class Replicas:
    """The parameters said replicated (:class:`Held`), compared by digest across their group at
    the settle point: a wrapper that holds its module whole on every rank of its group (DDP,
    DeepSpeed below ZeRO-3) says so of its module's parameters, a DTensor says so of the mesh
    dimensions it is ``Replicate`` on. Sharded parameters (FSDP, ``fully_shard``'s ``Shard``)
    differ by design; their initialisations are compared instead."""

    def __init__(self, program: Program, rank: int, domain: tuple[int, ...]) -> None:
        self._program = program
        self._rank = rank
        self._domain = frozenset(domain)
        self._optimizer: weakref.ref[Any] | None = None  # the first that stepped: its DTensors
        self.compared = 0  # parameters compared by digest
        # level="step": a sampled step compares them again, read at its first wrapper forward
        # (before its optimizer step) and posted with the next round
        self.sampling = False
        self._sampled: list[Held] | None = None

    def on_forward(self) -> None:
        """A wrapper's outermost forward begins: in a sampled step, read them now (every rank
        runs this forward, so the next round carries them on every rank, P5)."""
        if self.sampling and self._sampled is None:
            self._sampled = self.held()
            self.sampling = False

    def take_sampled(self) -> list[Held]:
        """What a sampled step read, for the round being posted (once)."""
        sampled, self._sampled = self._sampled, None
        return sampled or []

    def on_step(self, optimizer: Any) -> None:
        if self._optimizer is None:
            self._optimizer = weakref.ref(optimizer)

    def held(self) -> list[Held]:
        """What this rank holds that must agree, the same list (names, order) on every member,
        with the digests of its values now. Read as the settling round is posted: at the first
        exchange point after a wrapper's first forward (before any optimizer step: a sharding
        optimizer, ZeroRedundancyOptimizer, updates each rank's shard before it broadcasts), or
        after the first step in a program with none."""
        out: list[Held] = []
        seen: set[int] = set()
        for module, wrapper in list(self._program.known.items()):
            if not wrapper.replicates:
                continue
            members = self._members(wrapper.ranks)
            for name, p in module.named_parameters():
                if members:
                    out.append(Held(members, name, wrapper.label, p, parameter_digest(p)))
                out += self._placed(p, name, seen)
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is not None:
            for i, p in enumerate(optimizer_parameters(optimizer)):
                out += self._placed(p, f"parameter {i} of {type(optimizer).__name__}", seen)
        return out

    def _members(self, ranks: Any) -> tuple[int, ...]:
        members = tuple(r for r in sorted(ranks) if r in self._domain)
        return members if len(members) > 1 and self._rank in members else ()

    def _placed(self, p: Any, name: str, seen: set[int]) -> list[Held]:
        """A DTensor's mesh dimensions it is replicated on (each once per parameter)."""
        placements = getattr(p, "placements", None)
        mesh = getattr(p, "device_mesh", None)
        if placements is None or mesh is None or id(p) in seen:
            return []
        seen.add(id(p))
        grid = mesh.mesh
        where = (grid == self._rank).nonzero()
        if len(where) == 0:
            return []
        coord = where[0].tolist()
        out = []
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():
                continue
            line = tuple(slice(None) if d == dim else c for d, c in enumerate(coord))
            members = self._members(int(r) for r in grid[line].flatten().tolist())
            if members:
                names = mesh.mesh_dim_names
                axis = repr(names[dim]) if names else str(dim)
                owner = f"a DTensor replicated over mesh dimension {axis}"
                out.append(Held(members, name, owner, p, parameter_digest(p)))
        return out


def parameter_digest(p: Any) -> int:
    """A parameter's digest as the ranks compare it (a DTensor's: this rank's local tensor), 0
    when unreadable. Read as it is (no op on it: the exchange runs with Python dispatch off, where
    an op on a DTensor would run on its storage-less wrapper)."""
    return resolve_digest(tensor_digest(p)) or 0


@dataclass(frozen=True, slots=True)
class Differs:
    """The first replicated parameter whose digests differ among its members (the same answer
    on every rank): its name, what says it is replicated, and each member's digest (None: the
    member holds no such parameter there)."""

    members: tuple[int, ...]
    name: str
    owner: str
    digests: dict[int, int | None]


def rows(held: list[Held]) -> dict[int, list[Row]]:
    """The replicated parameters as rows of their groups' streams (a digest each), which the
    settling round checks with its other streams over parts of the group (P4)."""
    same = POLICY_CODE["same"]
    out: dict[int, list[Row]] = {}
    for h in held:
        out.setdefault(h.stream, []).append(
            Row(text_hash(h.name), h.stream, h.digest, h.digest, same, 0)
        )
    return out


def first_difference(side: Any, held: list[Held]) -> Differs | None:
    """After a settling round found a disagreement: every rank's digests gathered (collective on
    every rank of ``side``), and the first replicated parameter whose digests differ among its
    members, the same on every rank: groups by members, then in the lowest member's order."""
    mine: dict[int, list[Any]] = {}
    members_of: dict[int, tuple[int, ...]] = {}
    for h in held:
        mine.setdefault(h.stream, []).append((h.name, h.owner, h.digest))
        members_of[h.stream] = h.members
    sent = {str(s): [list(members_of[s]), rows] for s, rows in mine.items()}
    streams: dict[tuple[tuple[int, ...], int], dict[int, list[Any]]] = {}
    for rank, data in side.gather_json(sent).items():
        for stream, (members, held_rows) in data.items():
            streams.setdefault((tuple(members), int(stream)), {})[rank] = held_rows
    for members, stream in sorted(streams):
        by_rank = streams[(members, stream)]
        lowest = by_rank[min(by_rank)]
        for i, (name, owner, _) in enumerate(lowest):
            digests: dict[int, int | None] = {}
            for r in members:
                theirs = by_rank.get(r, [])
                digests[r] = theirs[i][2] if i < len(theirs) and theirs[i][0] == name else None
            if len(set(digests.values())) > 1:
                return Differs(members, name, owner, digests)
    return None  # (the disagreement was elsewhere)
