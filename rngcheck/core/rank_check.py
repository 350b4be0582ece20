"""What the mode needs of the cross-rank check, as a typed Protocol.

The mode and its parts (``session/``) call the rank checker through :class:`RankCheck`, never
through ``Any``: a method renamed or re-typed in ``ranks/checker.py`` is a type error where the
mode calls it, not an ``AttributeError`` in a job's first step. ``RankChecker`` conforms
structurally (it imports nothing from here, as ``core/`` imports no check); ``mode.py`` assigns
what ``ranks/startup.start`` returns to a ``RankCheck``, which is where mypy proves it conforms.

This is the other half of ``handle.py``: that is what a check receives from the mode, this is what
the mode asks of the rank check. Parameter names are the checker's own, so that a call by keyword
reads the same on both sides.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Protocol

from .events import RandomOpEvent
from .findings import Finding, Note

__all__ = ["RankCheck", "StepOutcome"]


class StepOutcome(Protocol):
    """The verdict of a settled step-level round (``ranks/step_digest.py``'s ``StepVerdict``),
    the same on every rank."""

    @property
    def step(self) -> int:
        """The first step whose generator digests drifted apart, else the round's last step."""
        ...

    @property
    def escalate(self) -> bool:
        """Every rank checks the coming step op by op."""
        ...

    @property
    def drifted(self) -> tuple[int, ...]:
        """The digest slots whose generators drifted apart across the ranks."""
        ...


class RankCheck(Protocol):
    """The rank checker as the mode uses it (``ranks/checker.py``'s ``RankChecker``)."""

    # -- the random-op path (session/recorder.py) ----------------------------------------------

    def on_event(self, event: RandomOpEvent, mesh: Any = None, written: Any = None) -> None:
        """A random op was drawn: judge it, and compare it at the next exchange point.
        ``mesh``: a DTensor op's mesh and placements (what ``mesh_of`` gave); ``written``: an
        in-place op's target."""
        ...

    def on_collective(self, func: Any, args: tuple = ()) -> None:
        """A collective of the program: an exchange point when it spans the group."""
        ...

    def mesh_of(self, args: tuple, kwargs: dict) -> Any:
        """The DeviceMesh a random op runs over (a DTensor op), with its DTensor's placements,
        or None."""
        ...

    # -- optimizer steps and the step level (session/steps.py) ---------------------------------

    @property
    def apart(self) -> bool:
        """A rank ran out of inputs in torch's Join: steps count on no rank from here (P7)."""
        ...

    def on_step(self, optimizer: Any) -> None:
        """A training step ended (a step of the lead optimizer)."""
        ...

    def replicas_trained(self, optimizer: Any) -> Collection[Any] | None:
        """A new lead's parameters, held weakly, when it trains replicas, else None."""
        ...

    def trains_replicas(self, optimizer: Any, lead: Collection[Any] = ()) -> bool:
        """Whether ``optimizer`` trains what every rank trains (or ``lead``'s parameters)."""
        ...

    def step_level(
        self, step: int, generators: Sequence[Any], escalate: bool, sampled: bool
    ) -> StepOutcome | None:
        """level="step": post this step's generator digests and this rank's wish to escalate;
        the verdict of the previous round, or None."""
        ...

    def set_checking(self, checking: bool, rebase: tuple[int, ...] = ()) -> None:
        """level="step": whether the coming step is checked op by op."""
        ...

    @property
    def wants_passes(self) -> bool:
        """level="step", between samples: the orders drawn as passes over the data begin are
        worth a window checked op by op."""
        ...

    def pass_window(self, open_: bool) -> None:
        """Such a window opens (True) or closes (False)."""
        ...

    @property
    def passes_compared(self) -> int:
        """Passes over the data whose orders were compared at the step level."""
        ...

    # -- the mode's lifecycle and its report (mode.py, session/closing.py) ---------------------

    def renders(self, finding: Finding) -> bool:
        """Whether this rank draws ``finding`` (one merged rendering across the ranks)."""
        ...

    def adopt_splits(self, events: Iterable[RandomOpEvent]) -> int:
        """Random ops drawn before the checker started that it compares from here on; how many."""
        ...

    def check(self) -> None:
        """Exchange now (a collective: every rank calls it)."""
        ...

    def finish(self) -> StepOutcome | None:
        """The block ended normally: the last exchanges; the last step-level verdict, or None."""
        ...

    def close(self, exc: BaseException | None = None) -> None:
        """Stop; ``exc``: the exception that ended the checked block, if any."""
        ...

    def publish(self) -> None:
        """Put the exchange counters, and what was compared and how, in the report's metadata."""
        ...

    def notes(self) -> list[Note]:
        """What was left uncompared, and why, for the report."""
        ...
