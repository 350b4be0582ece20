"""What a check claims about the user's program: findings (with both sides of a comparison), notes,
and the errors and warnings raised for them. Records only: checks make them, the report collects
them, the renderer draws them. They serialise to JSON (never pickle)."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .events import RandomOpEvent, SeedCall
from .stacks import Frame, Stack

__all__ = [
    "Culprit",
    "CulpritKind",
    "Finding",
    "FindingKind",
    "Likely",
    "Note",
    "RNGCheckCoverageWarning",
    "RNGCheckError",
    "RNGCheckWarning",
    "RankCollisionError",
    "RankDivergenceError",
    "RankMissingError",
    "RecomputeMismatchError",
    "Side",
]

REPORT_FORMAT = 1


class FindingKind(str, enum.Enum):
    RANK_DIVERGENCE = "rank_divergence"
    RANK_COLLISION = "rank_collision"
    RECOMPUTE_MISMATCH = "recompute_mismatch"
    RANK_MISSING = "rank_missing"

    def __str__(self) -> str:
        return self.value


def format_ranks(ranks: Iterable[int], world_size: int = 0) -> str:
    """Rank ranges a person reads at a glance: ``0-3,6``, with ``of 8`` when the world size is
    known (``0-1 of 2``)."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "-"
    parts: list[str] = []
    start = prev = ordered[0]
    following: list[int | None] = [*ordered[1:], None]
    for r in following:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts) + (f" of {world_size}" if world_size > 0 else "")


# What varies between occurrences of one bug: state digests, counters, region numbers.
_VARYING = re.compile(r"\b[0-9a-f]{16}\b|\d+")


@dataclass(frozen=True, slots=True, kw_only=True)
class Side:
    """One side of a comparison: the forward or the recompute, or a group of ranks."""

    label: str  # "forward", "recompute", "majority", "outliers"
    ranks: tuple[int, ...] = ()
    event: RandomOpEvent | None = None  # the op this side ran at the point of divergence
    note: str = ""  # what this side did instead, when it ran no op there ("ran no random op")

    @property
    def stack(self) -> Stack:
        return self.event.stack if self.event is not None else Stack.empty()

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "ranks": list(self.ranks),
            "event": self.event.to_dict() if self.event is not None else None,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Side:
        ev = data.get("event")
        return cls(
            label=data["label"],
            ranks=tuple(data.get("ranks", ())),
            event=RandomOpEvent.from_dict(ev) if ev else None,
            note=data.get("note", ""),
        )


class CulpritKind(str, enum.Enum):
    """What kind of call a likely cause blames."""

    SEED = "seed"  # a seeding call: torch.manual_seed(1235), a reseed
    RESTORE = "restore"  # a saved state set back: torch.set_rng_state, a tracker's fork()
    MODE = "mode"  # a module switched between training and evaluation: model.eval()

    def __str__(self) -> str:
        return self.value


# The APIs that set a saved state rather than seed (core/seeding.py's targets, torch_xla's).
_RESTORES = ("set_rng_state", "set_rng_state_all", "set_state")


@dataclass(frozen=True, slots=True, kw_only=True)
class Culprit:
    """A call the likely cause names, as data: what was called (``torch.manual_seed(1235)``), on
    which ranks (empty in a single process), and its stack, whose innermost user frame
    (``frame``) is the line to fix. CI annotations and editors link that frame; the cause's
    words name the same call."""

    kind: CulpritKind
    call: str
    stack: Stack
    ranks: tuple[int, ...] = ()

    @property
    def frame(self) -> Frame | None:
        """The user's line that made the call (None when no frame was captured)."""
        return self.stack.call_site

    @property
    def site(self) -> str:
        return self.stack.describe()

    @classmethod
    def of_call(cls, call: SeedCall, ranks: tuple[int, ...] = ()) -> Culprit:
        """A seeding or restoring call the checker saw, as a culprit."""
        restore = call.api.rpartition(".")[2] in _RESTORES
        kind = CulpritKind.RESTORE if restore else CulpritKind.SEED
        return cls(kind=kind, call=f"{call.api}({call.argument})", stack=call.stack, ranks=ranks)

    def to_dict(self) -> dict[str, Any]:
        frame = self.frame
        return {
            "kind": self.kind.value,
            "call": self.call,
            "ranks": list(self.ranks),
            "frame": frame.to_dict() if frame is not None else None,  # (for annotations)
            "stack": self.stack.to_list(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Culprit:
        return cls(
            kind=CulpritKind(data["kind"]),
            call=str(data["call"]),
            stack=Stack.from_list(data.get("stack", [])),
            ranks=tuple(int(r) for r in data.get("ranks", ())),
        )


class Likely(NamedTuple):
    """A likely cause, as a check's table of causes gives it: its words, and the calls they name
    (each with its frame), for ``Finding.cause`` and ``Finding.culprits``."""

    text: str
    culprits: tuple[Culprit, ...] = ()


def culprits_of(calls: Iterable[SeedCall], ranks: tuple[int, ...] = ()) -> tuple[Culprit, ...]:
    """The user's seeding and restoring calls among ``calls`` (not torch's own: a checkpoint's
    restore has no user line), as culprits on ``ranks``."""
    return tuple(Culprit.of_call(c, ranks) for c in calls if not c.by_torch)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """Something went wrong with randomness: what, where (both sides), and the likely cause."""

    kind: FindingKind
    message: str  # one sentence: what diverged
    op: str  # the first op where it diverged
    cause: str = ""  # the likely cause in words, with call sites where known
    differs: str = ""  # which element differs first: "op", "argument", "generator", "state", ...
    ranks: tuple[int, ...] = ()  # ranks involved (empty in a single process)
    region: str = ""  # the checkpoint region, for recompute findings
    stack: Stack = field(default_factory=Stack.empty)  # this side's (or the majority's) call site
    other_stack: Stack | None = None  # the other side's, where a finding compares two sides
    sides: tuple[Side, ...] = ()
    seq: int = -1  # the random op's sequence number
    context: tuple[RandomOpEvent, ...] = ()  # events around the finding, for saved reports
    # One bug recurs at every step: its occurrences are counted on the first one's record.
    count: int = 1  # occurrences of this finding (the same key)
    first_step: int = 0  # the optimizer step of the first occurrence (1-based; 0: unknown)
    last_step: int = 0  # and of the last
    # level="step": how a finding first found between sampled steps (by generator states) was
    # then named op by op ("" when it was found op by op)
    found_by: str = ""
    # The calls the cause names (a seeding call, a reseed, a restore, a switch to eval()), each
    # with its frame: what annotations and editors link, beside the words of ``cause``.
    culprits: tuple[Culprit, ...] = ()

    @property
    def key(self) -> tuple[Any, ...]:
        """What the finding is, not when it happened: its kind, op, the user's site on each side
        and the cause, with digests and counters taken out (a bug that recurs every step, or in
        every layer that shares one line, is one finding seen many times)."""
        sides = tuple(
            (s.label, s.event.op, s.event.site) if s.event is not None else (s.label, s.note)
            for s in self.sides
        )
        cause = _VARYING.sub("#", self.cause)
        return (self.kind.value, self.op, self.differs, self.ranks, self.site, sides, cause)

    @property
    def title(self) -> str:
        return {
            FindingKind.RANK_DIVERGENCE: "RNG state diverged across ranks",
            FindingKind.RANK_COLLISION: "ranks that must differ share an RNG state",
            FindingKind.RECOMPUTE_MISMATCH: "checkpoint recompute drew different random numbers",
            FindingKind.RANK_MISSING: "a rank stopped reaching the RNG check",
        }[self.kind]

    @property
    def site(self) -> str:
        return self.stack.describe()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "message": self.message,
            "op": self.op,
            "cause": self.cause,
            "differs": self.differs,
            "ranks": list(self.ranks),
            "region": self.region,
            "stack": self.stack.to_list(),
            "other_stack": self.other_stack.to_list() if self.other_stack is not None else None,
            "sides": [s.to_dict() for s in self.sides],
            "seq": self.seq,
            "context": [e.to_dict() for e in self.context],
            "count": self.count,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "found_by": self.found_by,
            "culprits": [c.to_dict() for c in self.culprits],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        other = data.get("other_stack")
        return cls(
            kind=FindingKind(data["kind"]),
            message=data["message"],
            op=data.get("op", ""),
            cause=data.get("cause", ""),
            differs=data.get("differs", ""),
            ranks=tuple(data.get("ranks", ())),
            region=data.get("region", ""),
            stack=Stack.from_list(data.get("stack", [])),
            other_stack=Stack.from_list(other) if other is not None else None,
            sides=tuple(Side.from_dict(s) for s in data.get("sides", [])),
            seq=int(data.get("seq", -1)),
            context=tuple(RandomOpEvent.from_dict(e) for e in data.get("context", [])),
            count=int(data.get("count", 1)),
            first_step=int(data.get("first_step", 0)),
            last_step=int(data.get("last_step", 0)),
            found_by=data.get("found_by", ""),
            culprits=tuple(Culprit.from_dict(c) for c in data.get("culprits", [])),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Note:
    """Something worth knowing that is not a finding (fresh randomness during backward, say)."""

    kind: str
    message: str
    count: int = 1
    stack: Stack = field(default_factory=Stack.empty)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "count": self.count,
            "stack": self.stack.to_list(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Note:
        return cls(
            kind=data["kind"],
            message=data["message"],
            count=int(data.get("count", 1)),
            stack=Stack.from_list(data.get("stack", [])),
        )


class RNGCheckWarning(UserWarning):
    """Warned for a finding when ``on_finding="warn"``."""


class RNGCheckCoverageWarning(RNGCheckWarning):
    """rngcheck could not check something it was asked to check (a checkpoint region it did not
    see begin, a torch whose checkpoint internals it does not know). Never silence: a user must not
    believe an unchecked run is clean. Turn it into an error in a test suite with
    ``-W error::rngcheck.RNGCheckCoverageWarning``."""


class RNGCheckError(RuntimeError):
    """Raised for a finding when ``on_finding="raise"``; ``.finding`` carries the details.

    When rngcheck drew the finding just before raising (``drawn``), the message is one line (kind,
    op, site) pointing at the drawing, so the explanation is shown once; otherwise (no console,
    another rank draws it) the message carries it all."""

    def __init__(self, finding: Finding, drawn: bool = False) -> None:
        self.finding = finding
        where = f" at {finding.site}" if finding.stack.frames else ""
        if drawn:
            text = f"{finding.kind.value}: {finding.op}{where} (rngcheck drew the finding above)"
        else:
            cause = f"\nLikely cause: {finding.cause}" if finding.cause else ""
            text = f"{finding.title}: {finding.message}{where}{cause}"
        super().__init__(text)


class RankDivergenceError(RNGCheckError):
    """Ranks that must hold the same RNG state do not."""


class RankCollisionError(RNGCheckError):
    """Ranks that must hold different RNG states share one."""


class RecomputeMismatchError(RNGCheckError):
    """A checkpoint recompute drew different random numbers than its forward."""


class RankMissingError(RNGCheckError):
    """A rank did not reach the RNG exchange in time."""


_ERRORS: dict[FindingKind, type[RNGCheckError]] = {
    FindingKind.RANK_DIVERGENCE: RankDivergenceError,
    FindingKind.RANK_COLLISION: RankCollisionError,
    FindingKind.RECOMPUTE_MISMATCH: RecomputeMismatchError,
    FindingKind.RANK_MISSING: RankMissingError,
}


def error_for(finding: Finding, drawn: bool = False) -> RNGCheckError:
    return _ERRORS[finding.kind](finding, drawn)
