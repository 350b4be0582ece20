"""The recompute check: an activation-checkpoint recompute must draw the numbers its forward drew.

``tracker.py`` compares the passes; ``torch_hooks.py`` finds torch's regions (per torch version);
``xla.py`` torch_xla's; ``marked.py`` custom checkpoint functions; ``causes.py`` explains a
mismatch.
"""

from .marked import CheckpointRegion, checkpoint_region
from .tracker import RecomputeTracker

__all__ = ["CheckpointRegion", "RecomputeTracker", "checkpoint_region"]
