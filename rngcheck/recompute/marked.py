"""Marks for the two passes of a custom checkpoint function (Megatron's, DeepSpeed's, a
hand-written one), so rngcheck compares them like torch's own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..core.events import Phase
from .region import Region
from .tracker import RecomputeTracker

__all__ = ["CheckpointRegion", "checkpoint_region"]


class CheckpointRegion:
    """Marks the two passes of a custom checkpoint function so rngcheck compares them.

    Example, in a Megatron-style ``torch.autograd.Function``::

        # forward
        ctx.rng_region = rngcheck.checkpoint_region("transformer layer")
        with ctx.rng_region.forward():
            outputs = run_function(*args)
        # backward, after restoring the RNG states
        with ctx.rng_region.recompute():
            outputs = ctx.run_function(*detached_inputs)

    Outside an active :class:`RNGConsistencyMode` both blocks do nothing, so the markers can stay
    in library code. A ``recompute()`` may run several times (one per backward).
    ``restores_rng=False`` says the function deliberately restores no generator state, so a
    mismatch's cause names that.

    Known limitations:
        One marker is one call: make a new one per forward (store it on ``ctx``). The two passes
        must run on the thread that ran them (autograd's device threads included) while the same
        mode is active; a recompute after the mode exited is not compared.
    """

    def __init__(self, name: str | None = None, *, restores_rng: bool | None = None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(
                f"checkpoint_region name must be a str or None; got {type(name).__name__}"
            )
        self._name = name
        self._restores_rng = restores_rng
        self._region: Region | None = None
        self._tracker: RecomputeTracker | None = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        tracker = RecomputeTracker.installed()
        if tracker is None:
            yield
            return
        self._tracker = tracker
        self._region = tracker.new_region(
            kind="custom", preserve_rng_state=self._restores_rng, name=self._name or ""
        )
        with tracker.phase(self._region, Phase.FORWARD):
            yield

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        tracker, region = self._tracker, self._region
        if tracker is None or region is None or RecomputeTracker.installed() is not tracker:
            yield
            return
        with tracker.phase(region, Phase.RECOMPUTE):
            yield


def checkpoint_region(
    name: str | None = None, *, restores_rng: bool | None = None
) -> CheckpointRegion:
    """A marker for one checkpointed call of a custom checkpoint function (see CheckpointRegion)."""
    return CheckpointRegion(name, restores_rng=restores_rng)
