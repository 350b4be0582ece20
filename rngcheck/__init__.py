"""rngcheck: find random-number-generator drift in PyTorch training.

A ``TorchDispatchMode`` intercepts every random op, fingerprints the state of the generator it
draws from before and after, and reports the first op where ranks that should agree diverge, or
where an activation-checkpoint recompute draws different numbers than its forward.

The names below are imported when first used, so ``import rngcheck`` (what the pytest plugin, the
CLI's ``--version`` and the startup hook do) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# public name -> the module that defines it
_WHERE = {
    "RNGConsistencyMode": "rngcheck.mode",
    "active_mode": "rngcheck.mode",
    "exchange_stats": "rngcheck.mode",
    "run_checked": "rngcheck.mode",
    "CheckpointRegion": "rngcheck.recompute.marked",
    "checkpoint_region": "rngcheck.recompute.marked",
    "expect": "rngcheck.core.policy",
    "register_random_op": "rngcheck.core.ops",
    "GeneratorId": "rngcheck.core.generators",
    "OutOfBandChange": "rngcheck.core.events",
    "Phase": "rngcheck.core.events",
    "RandomOpEvent": "rngcheck.core.events",
    "SeedCall": "rngcheck.core.events",
    "Frame": "rngcheck.core.stacks",
    "Stack": "rngcheck.core.stacks",
    "Culprit": "rngcheck.core.findings",
    "CulpritKind": "rngcheck.core.findings",
    "Finding": "rngcheck.core.findings",
    "FindingKind": "rngcheck.core.findings",
    "Note": "rngcheck.core.findings",
    "Side": "rngcheck.core.findings",
    "RNGCheckError": "rngcheck.core.findings",
    "RNGCheckWarning": "rngcheck.core.findings",
    "RNGCheckCoverageWarning": "rngcheck.core.findings",
    "RankCollisionError": "rngcheck.core.findings",
    "RankDivergenceError": "rngcheck.core.findings",
    "RankMissingError": "rngcheck.core.findings",
    "RecomputeMismatchError": "rngcheck.core.findings",
    "Report": "rngcheck.output.report",
    "format_finding": "rngcheck.output.render",
    "format_report": "rngcheck.output.render",
    "print_finding": "rngcheck.output.render",
    "print_report": "rngcheck.output.render",
    "render_finding": "rngcheck.output.render",
}

__all__ = [
    "CheckpointRegion",
    "Culprit",
    "CulpritKind",
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
assert sorted(__all__) == sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rngcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


if TYPE_CHECKING:  # what type checkers and IDEs see
    from .core.events import OutOfBandChange, Phase, RandomOpEvent, SeedCall
    from .core.findings import (
        Culprit,
        CulpritKind,
        Finding,
        FindingKind,
        Note,
        RankCollisionError,
        RankDivergenceError,
        RankMissingError,
        RecomputeMismatchError,
        RNGCheckCoverageWarning,
        RNGCheckError,
        RNGCheckWarning,
        Side,
    )
    from .core.generators import GeneratorId
    from .core.ops import register_random_op
    from .core.policy import expect
    from .core.stacks import Frame, Stack
    from .mode import RNGConsistencyMode, active_mode, exchange_stats, run_checked
    from .output.render import (
        format_finding,
        format_report,
        print_finding,
        print_report,
        render_finding,
    )
    from .output.report import Report
    from .recompute.marked import CheckpointRegion, checkpoint_region
