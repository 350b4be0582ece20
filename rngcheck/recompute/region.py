"""One checkpointed call: its forward's random ops and, once backward runs, its recompute's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..core.events import RandomOpEvent

__all__ = ["Region"]

_numbers = itertools.count(1)


@dataclass(eq=False, slots=True, kw_only=True)
class Region:
    """One checkpointed call: its forward's random ops and, once backward runs, its recompute's."""

    number: int = field(default_factory=lambda: next(_numbers))
    kind: str  # "non-reentrant", "reentrant", "custom" or "torch_xla"
    name: str = ""
    site: str  # "train.py:40": the user's line that entered the region
    preserve_rng_state: bool | None = True  # None: unknown (custom checkpoint functions)
    devices: tuple[str, ...] = ()  # device types of the tensor arguments (what torch stashes)
    forward: list[RandomOpEvent] = field(default_factory=list)
    recompute: list[RandomOpEvent] = field(default_factory=list)
    failed: bool = False  # a mismatch was reported: do not report this region again
    truncated: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"checkpoint #{self.number}"

    @property
    def title(self) -> str:
        return f"{self.name} ({self.kind}) at {self.site}"

    @property
    def custom(self) -> bool:
        """The checkpoint is not torch.utils.checkpoint: causes name its own restore."""
        return self.kind in ("custom", "torch_xla")
