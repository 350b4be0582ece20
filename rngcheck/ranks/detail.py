"""What one rank tells the others about its op at the place their windows first disagree: a
:class:`Detail`, gathered as JSON (never pickle) after a mismatch, so every rank judges and
describes the divergence from the same data (protocol rule P5). Reasons travel typed
(:class:`~rngcheck.ranks.verdict.Verdict`, :class:`~rngcheck.ranks.verdict.Apart`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.events import RandomOpEvent, SeedCall
from .verdict import Apart, Verdict

__all__ = ["Detail", "OnMesh", "Seeded", "Uncompared"]


@dataclass(frozen=True, slots=True)
class Uncompared:
    """Random ops a rank drew from a generator without comparing them, since its last checked
    op: how many, the last of them (its op and line) and its verdict, and, when the rank drew
    some of them alone by design (reading every rank's batches; modifying what a region
    broadcasts from it), that verdict too."""

    ops: int
    op: str
    site: str
    why: Verdict
    alone: Verdict | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ops": self.ops,
            "op": self.op,
            "site": self.site,
            "why": self.why.to_dict(),
            "alone": self.alone.to_dict() if self.alone is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Uncompared:
        alone = data.get("alone")
        return cls(
            ops=int(data["ops"]),
            op=str(data["op"]),
            site=str(data["site"]),
            why=Verdict.from_dict(data["why"]),
            alone=Verdict.from_dict(alone) if alone else None,
        )


@dataclass(frozen=True, slots=True)
class OnMesh:
    """The mesh a DTensor random op ran over, as the op's verdict compared it: the mesh's ranks
    (DTensor's contract: every one holds the same generator state before and after each random
    op), its shape and dimension names, and the placements of the op's DTensor over it."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    placements: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "shape": list(self.shape),
            "dims": list(self.dims),
            "placements": list(self.placements),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OnMesh:
        return cls(
            ranks=tuple(int(r) for r in data.get("ranks", ())),
            shape=tuple(int(n) for n in data.get("shape", ())),
            dims=tuple(str(d) for d in data.get("dims", ())),
            placements=tuple(str(p) for p in data.get("placements", ())),
        )


@dataclass(frozen=True, slots=True)
class Seeded:
    """A generator the ranks seeded differently, as a per-rank stream is learnt from it: its
    name, its initial seeds (each with the ranks that hold it) and each rank's seeding calls."""

    label: str
    seeds: tuple[tuple[int, tuple[int, ...]], ...]
    calls: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Detail:
    """What one rank tells the others about its op at the divergent position."""

    event: RandomOpEvent | None  # None: this rank ran no random op there
    point: str  # where this rank joined the exchange, in words (with its line)
    reached: str = ""  # ... what it joined it at, without the line (the same text on every rank)
    seed_calls: tuple[SeedCall, ...] = ()  # the user's seeding calls that reached the generator
    uncompared: Uncompared | None = None
    wrappers: tuple[str, ...] = ()  # the data-parallel wrappers this rank knows (labels)
    # How the ranks moved the op's generator apart, if this rank compares it by what runs only.
    apart: Apart | None = None
    # The order this op drew, when a scope says every rank walks it (a sampler splitting it
    # among the ranks, a split of the dataset, a pipeline's shuffle, a hook's sketch).
    order: Verdict | None = None
    # The model whose generate() call this op was compared as (its first op); "" for any other.
    call: str = ""
    # Whether a data-parallel wrapper this rank knows has tensor-parallel peers (ranks that
    # compute on this rank's batch: what it draws for that batch must agree among them).
    peers: bool = False
    # Learnt lines, counts: this rank's ops of this round that ran an op found at the divergent
    # position (on any rank), by ``count_key`` (op, generator, its seed and its line), each with
    # its positions in this rank's gathered window; and the key of this rank's op there ("").
    lines: dict[str, list[int]] = field(default_factory=dict)
    spot_line: str = ""
    spot_at: int = -1  # this rank's position at the divergence in its window (its end: no op)
    mesh: OnMesh | None = None  # the mesh of a DTensor op there (None: no DTensor's)

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": self.event.to_dict() if self.event is not None else None,
            "point": self.point,
            "reached": self.reached,
            "seed_calls": [c.to_dict() for c in self.seed_calls],
            "uncompared": self.uncompared.to_dict() if self.uncompared is not None else None,
            "wrappers": list(self.wrappers),
            "apart": self.apart.to_dict() if self.apart is not None else None,
            "order": self.order.to_dict() if self.order is not None else None,
            "call": self.call,
            "peers": self.peers,
            "lines": self.lines,
            "spot_line": self.spot_line,
            "spot_at": self.spot_at,
            "mesh": self.mesh.to_dict() if self.mesh is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Detail:
        event, uncompared = data.get("event"), data.get("uncompared")
        apart, order, mesh = data.get("apart"), data.get("order"), data.get("mesh")
        return cls(
            event=RandomOpEvent.from_dict(event) if event else None,
            point=str(data["point"]),
            reached=str(data.get("reached", "")),
            seed_calls=tuple(SeedCall.from_dict(c) for c in data.get("seed_calls", [])),
            uncompared=Uncompared.from_dict(uncompared) if uncompared else None,
            wrappers=tuple(data.get("wrappers", ())),
            apart=Apart.from_dict(apart) if apart else None,
            order=Verdict.from_dict(order) if order else None,
            call=str(data.get("call", "")),
            peers=bool(data.get("peers", False)),
            lines={str(k): [int(i) for i in v] for k, v in data.get("lines", {}).items()},
            spot_line=str(data.get("spot_line", "")),
            spot_at=int(data.get("spot_at", -1)),
            mesh=OnMesh.from_dict(mesh) if mesh else None,
        )
