"""Frozen records of what the checker saw, and the bounded window that keeps the recent ones.

Records hold no tensors and no live frames: digests are taken at once, stacks are captured
summaries (see ``stacks.py``). Memory is bounded however long training runs: a window of the most
recent events plus per-op counters.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from .digest import LazyDigest, resolve_digest
from .generators import GeneratorId
from .stacks import Stack

__all__ = ["EventWindow", "OutOfBandChange", "Phase", "RandomOpEvent", "SeedCall"]


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"

    def __str__(self) -> str:
        return self.value


# The members as module constants, for hot paths: ``Phase.FORWARD`` is a lookup through the enum
# class each time (about 60 ns, ten times a module global).
FORWARD, BACKWARD, RECOMPUTE = Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE


@dataclass(frozen=True, slots=True, kw_only=True)
class SeedCall:
    """A Python API call that changed a generator's state: ``torch.manual_seed(3)`` at a line."""

    api: str  # "torch.manual_seed"
    argument: str  # "3", or "<state>" for set_rng_state
    stack: Stack
    by_torch: bool = False  # called by torch itself (checkpoint's restore, fork_rng), not the user

    @property
    def text(self) -> str:
        return f"{self.api}({self.argument}) at {self.stack.describe()}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "api": self.api,
            "argument": self.argument,
            "by_torch": self.by_torch,
            "stack": self.stack.to_list(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SeedCall:
        return cls(
            api=data["api"],
            argument=data["argument"],
            by_torch=bool(data.get("by_torch", False)),
            stack=Stack.from_list(data.get("stack", [])),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class OutOfBandChange:
    """A generator's state changed between two random ops on it, outside any op we saw.

    ``calls`` are the seeding APIs seen in between (empty when the change came from somewhere we
    cannot see: another thread, a C++ extension, ``Generator.set_state`` on a user generator).
    ``new_seed`` is set when the generator's ``initial_seed()`` changed, i.e. it was reseeded.
    """

    calls: tuple[SeedCall, ...] = ()
    new_seed: int | None = None

    @property
    def user_calls(self) -> tuple[SeedCall, ...]:
        return tuple(c for c in self.calls if not c.by_torch)

    def describe(self) -> str:
        if self.user_calls:
            return "; ".join(c.text for c in self.user_calls)
        if self.calls:
            return "restored by torch (" + ", ".join(c.api for c in self.calls) + ")"
        if self.new_seed is not None:
            return f"reseeded to {self.new_seed} (Generator.manual_seed, call site not visible)"
        return "changed outside the checker's view (another thread, set_state, or C++ code)"

    def to_dict(self) -> dict[str, Any]:
        return {"calls": [c.to_dict() for c in self.calls], "new_seed": self.new_seed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OutOfBandChange:
        return cls(
            calls=tuple(SeedCall.from_dict(c) for c in data.get("calls", [])),
            new_seed=data.get("new_seed"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomOpEvent:
    """One random op: what ran, on which generator, the state before and after, and where."""

    seq: int  # position among the random ops this mode saw, from 0
    op: str  # "aten.bernoulli_.float"
    generator: GeneratorId
    device: str
    args: tuple[str, ...]  # ("float32[32, 128]", "p=0.1")
    before: int | None  # 64-bit digest of the generator state before the op (None: unreadable)
    after: int | None
    phase: Phase
    stack: Stack
    expect: str = "same"  # the expectation in force for this op ("same", "differ", "ignore")
    output: int | LazyDigest | None = None  # digest of the op's output, inside checkpoint regions
    out_of_band: OutOfBandChange | None = None  # the state changed since the last op on it
    cached: bool = False  # served from a selective-checkpoint cache: the op did not run
    region: str = ""  # innermost checkpoint region, if any
    seed: int | None = None  # the generator's initial_seed() at the op (None: not a Generator)
    compiled: str = ""  # "compiled forward" / "compiled backward": drawn by a compiled graph

    @property
    def output_digest(self) -> int | None:
        return resolve_digest(self.output)

    @property
    def site(self) -> str:
        return self.stack.describe()

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "op": self.op,
            "generator": self.generator.to_dict(),
            "device": self.device,
            "args": list(self.args),
            "before": self.before,
            "after": self.after,
            "phase": self.phase.value,
            "expect": self.expect,
            "output": self.output_digest,
            "out_of_band": self.out_of_band.to_dict() if self.out_of_band else None,
            "cached": self.cached,
            "region": self.region,
            "seed": self.seed,
            "compiled": self.compiled,
            "stack": self.stack.to_list(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RandomOpEvent:
        oob = data.get("out_of_band")
        return cls(
            seq=int(data["seq"]),
            op=data["op"],
            generator=GeneratorId.from_dict(data["generator"]),
            device=data["device"],
            args=tuple(data.get("args", ())),
            before=data.get("before"),
            after=data.get("after"),
            phase=Phase(data.get("phase", "forward")),
            expect=data.get("expect", "same"),
            output=data.get("output"),
            out_of_band=OutOfBandChange.from_dict(oob) if oob else None,
            cached=bool(data.get("cached", False)),
            region=data.get("region", ""),
            seed=data.get("seed"),
            compiled=data.get("compiled", ""),
            stack=Stack.from_list(data.get("stack", [])),
        )


@dataclass(slots=True)
class EventWindow:
    """The most recent events plus counters: constant memory however long the run."""

    size: int
    events: deque[RandomOpEvent] = field(init=False)
    total: int = 0
    by_op: Counter[str] = field(default_factory=Counter)
    by_generator: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.size)

    def add(self, event: RandomOpEvent) -> None:
        self.events.append(event)
        self.total += 1
        # Counter keys are bounded by the number of distinct ops and generators, not by time.
        self.by_op[event.op] += 1
        self.by_generator[event.generator.label] += 1

    def around(self, seq: int, before: int = 8, after: int = 2) -> list[RandomOpEvent]:
        """The window's events near ``seq`` (for a report's context)."""
        return [e for e in self.events if seq - before <= e.seq <= seq + after]
