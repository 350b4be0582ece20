"""Megatron-LM: its data samplers name their split ``data_parallel_size`` and
``data_parallel_rank``; what a DataLoader fetches through one is this rank's own share."""

from __future__ import annotations

from . import register
from .records import Integration, ShareSplit

register(
    Integration(
        name="megatron",
        library="megatron",
        distribution="megatron-core",
        shares=(ShareSplit(size="data_parallel_size", index="data_parallel_rank"),),
    )
)
