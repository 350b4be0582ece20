"""rngcheck: find random-number-generator drift in PyTorch training.

A ``TorchDispatchMode`` intercepts every random op, fingerprints the state of the generator it
draws from before and after, and reports the first op where ranks that should agree diverge, or
where an activation-checkpoint recompute draws different numbers than its forward.
"""

from .events import OutOfBandChange, Phase, RandomOpEvent, SeedCall
from .generators import GeneratorId
from .mode import RNGConsistencyMode, active_mode, run_checked
from .ops import register_random_op
from .policy import expect
from .ranks import exchange_stats
from .recompute import CheckpointRegion, checkpoint_region
from .render import format_finding, format_report, print_finding, print_report, render_finding
from .report import (
    Finding,
    FindingKind,
    Note,
    RankCollisionError,
    RankDivergenceError,
    RankMissingError,
    RecomputeMismatchError,
    Report,
    RNGCheckCoverageWarning,
    RNGCheckError,
    RNGCheckWarning,
    Side,
)
from .stacks import Frame, Stack

__version__ = "0.1.0"

__all__ = [
    "CheckpointRegion",
    "Finding",
    "FindingKind",
    "Frame",
    "GeneratorId",
    "Note",
    "OutOfBandChange",
    "Phase",
    "RNGCheckCoverageWarning",
    "RNGCheckError",
    "RNGCheckWarning",
    "RNGConsistencyMode",
    "RandomOpEvent",
    "RankCollisionError",
    "RankDivergenceError",
    "RankMissingError",
    "RecomputeMismatchError",
    "Report",
    "SeedCall",
    "Side",
    "Stack",
    "active_mode",
    "checkpoint_region",
    "exchange_stats",
    "expect",
    "format_finding",
    "format_report",
    "print_finding",
    "print_report",
    "register_random_op",
    "render_finding",
    "run_checked",
]
