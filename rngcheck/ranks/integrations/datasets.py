"""Hugging Face's datasets: a streaming dataset split by ``split_dataset_by_node`` keeps the split
in its ``DistributedConfig`` (``world_size`` and ``rank``) as ``_distributed``; what a DataLoader
fetches from it is this rank's own share. (Read there only: "world_size" and "rank" are too
common a pair to read on any sampler or dataset.)"""

from __future__ import annotations

from . import register
from .records import Integration, ShareSplit

register(
    Integration(
        name="datasets",
        library="datasets",
        shares=(
            ShareSplit(
                size="world_size",
                index="rank",
                holder="_distributed",
                label="Hugging Face datasets' split_dataset_by_node",
            ),
        ),
    )
)
