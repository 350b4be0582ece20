"""PyTorch Lightning: its ``DistributedSamplerWrapper`` wraps a sampler of the user's so that every
rank walks the order it draws and keeps its share (``_DatasetSamplerWrapper`` materialises that
order), in ``lightning.fabric`` and in the standalone ``lightning_fabric``. Lightning makes its
``DistributedSampler`` with the seed ``seed_everything`` was given: a rank-dependent seed there
gives each rank its share of a different shuffle (the hint below)."""

from __future__ import annotations

from ..verdict import Reason
from . import register
from .records import Frames, Integration, Role, SeedHint

_LABEL = "Lightning's DistributedSamplerWrapper"
_HINT = (
    "PyTorch Lightning makes the sampler with the seed seed_everything was given (its "
    "PL_GLOBAL_SEED): give seed_everything the same seed on every rank, and draw what must "
    "differ per rank (augmentation, noise) from a generator of its own seeded with the rank"
)

register(
    Integration(
        name="lightning",
        library="lightning",
        hooks=tuple(
            Frames(
                module=f"{package}.utilities.distributed",
                attribute=f"_DatasetSamplerWrapper.{name}",
                label=_LABEL,
                role=Role.ORDER,
                scope=Reason.ORDER,
            )
            for package in ("lightning.fabric", "lightning_fabric")
            for name in ("reset", "__getitem__")
        ),
        # lightning (lightning.pytorch, lightning.fabric), and the standalone packages
        hints=(
            SeedHint(
                paths=("/lightning/", "/pytorch_lightning/", "/lightning_fabric/"), text=_HINT
            ),
        ),
    )
)
