"""The small, typed handle a check receives from the mode that runs it: the checks (recompute,
ranks, and whatever comes) never see the mode itself, and nothing imports the mode back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import Config
from .events import SeedCall
from .findings import Finding

__all__ = ["CheckerHandle"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckerHandle:
    """What a check may ask of the mode.

    ``emit(finding)`` hands a finding to the mode's sink (it records, renders, warns or raises as
    configured). ``seeding_calls(mark, device)`` lists the seeding API calls seen since the
    counter ``mark`` that reached ``device``'s generators. ``meta`` is the report's metadata, where
    a check keeps its own keys; ``identify(rank, world_size)`` names the process in the report;
    ``coverage(what)`` says, loudly (a ``RNGCheckCoverageWarning`` and a report note), that
    something the check was asked to check it cannot; ``progress()``, after each exchange, lets
    the mode keep the report on disk current (it saves every few seconds at most).
    """

    config: Config
    emit: Callable[[Finding], None]
    seeding_calls: Callable[[int, str], tuple[SeedCall, ...]]
    meta: dict[str, Any] = field(default_factory=dict)
    identify: Callable[[int, int], None] = lambda _rank, _world: None
    coverage: Callable[[str], None] = lambda _what: None
    progress: Callable[[], None] = lambda: None
