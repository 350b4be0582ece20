"""DeepSpeed: its engine (``deepspeed.initialize``), ZeRO-3's ``zero.Init`` and
``GatheredParameters``. The engine trains each rank of its data-parallel group (sequence-parallel
ranks included) on its own batch, and broadcasts the model's parameters as it is built, unless
ZeRO-3 made them partitioned at creation; ``zero.Init`` broadcasts each parameter from one rank as
it is made. ``GatheredParameters(params, modifier_rank=r)`` broadcasts rank r's values as it
exits: what is drawn inside it is rank r's alone (Hugging Face initialises a model made from a
config so, on rank 0)."""

from __future__ import annotations

from typing import Any

from . import register
from .common import group_ranks, read, states
from .records import (
    BroadcastRegion,
    Integration,
    ParameterBroadcast,
    Wrapper,
    WrapperBroadcast,
    WrapperForward,
)

_ENGINE = "deepspeed.runtime.engine"
_ZERO = "deepspeed.runtime.zero.partition_parameters"
_KIND = "DeepSpeedEngine"


def _engine(engine: Any, broadcasting: bool) -> Wrapper:
    """The ranks that see different data: data parallel, and sequence parallel (Ulysses) inside
    it; it broadcasts the module's parameters over that group (when it has a backend). No peers:
    DeepSpeed's own tensor parallelism holds no DTensors."""
    ranks = group_ranks(read(engine, "seq_data_parallel_group"))
    broadcasts = broadcasting and read(engine, "dist_backend") is not None
    held = states(read(engine, "module"), False) if broadcasts else {}
    # (ZeRO-3 partitions the parameters: each rank holds a shard, not the whole)
    whole = read(engine, "zero_optimization_stage")() < 3
    return Wrapper(
        kind=_KIND, ranks=ranks, broadcasts=broadcasts, replicates=whole, peers=(), **held
    )


def _running(engine: Any) -> Wrapper:
    return _engine(engine, False)


def _modifier(region: Any) -> int | None:
    """The global rank a GatheredParameters region broadcasts from (None without
    ``modifier_rank``, or when the region is a no-op on parameters that are not partitioned)."""
    if not read(region, "enabled"):
        return None
    src = read(region, "src_rank")
    return src if type(src) is int else None


register(
    Integration(
        name="deepspeed",
        library="deepspeed",
        hooks=(
            WrapperBroadcast(
                module=_ENGINE,
                attribute=f"{_KIND}._broadcast_model",
                label=_KIND,
                describe=_engine,
            ),
            WrapperForward(
                module=_ENGINE, attribute=f"{_KIND}.forward", label=_KIND, describe=_running
            ),
            ParameterBroadcast(
                module=_ZERO,
                attribute="Init._zero_init_param",
                label="deepspeed.zero.Init",
                kind="deepspeed.zero.Init",
                group=lambda init, param: init.get_partition_dp_group(param),
            ),
            BroadcastRegion(
                module=_ZERO,
                attribute="GatheredParameters",
                label="deepspeed GatheredParameters",
                rank=_modifier,
                what=(
                    "the parameters it gathered are rank {rank}'s as it exits (ZeRO-3; Hugging "
                    "Face initialises a model's weights so)"
                ),
                alone="(ZeRO-3: the parameters it gathered are that rank's as it exits)",
            ),
        ),
    )
)
