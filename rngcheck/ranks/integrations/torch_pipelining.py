"""torch's pipelining (``torch.distributed.pipelining``): each rank holds the stages it runs, its
own layers. A schedule's ``step()`` (and ``eval()``, which calls it) runs in the scope of its
stages' group: what the stages draw there is the rank's own. A ``PipelineStage`` is known from its
construction, so the initialisation of its parameters (torchtitan builds stages on the meta device
and initialises them after) is the rank's own too. Every stage reads the same batches, so an
order a sampler draws (torch's, in ``torch_data.py``) must agree across the stages."""

from __future__ import annotations

from typing import Any

from . import register
from .common import group_ranks, read
from .records import Integration, StageInit, Wrapper, WrapperForward

_SCHEDULES = "torch.distributed.pipelining.schedules"


def _schedule(schedule: Any) -> Wrapper | None:
    """A schedule runs one stage (PipelineScheduleSingle) or several (Multi: interleaved, zero
    bubble) of one pipeline, all over one group. No peers: a stage's DTensor meshes do not tell
    the ranks that share its microbatches (tensor parallel) from those that train on other
    batches (fully_shard over a data-parallel dimension)."""
    stages = (
        [read(schedule, "_stage")] if hasattr(schedule, "_stage") else read(schedule, "_stages")
    )
    stages = [s for s in stages if s is not None]
    if not stages:
        return None
    return Wrapper(
        kind=type(schedule).__name__,
        ranks=group_ranks(read(stages[0], "group")),
        stages=tuple(stages),
    )


register(
    Integration(
        name="torch.distributed.pipelining",
        library="torch",
        hooks=(
            StageInit(
                module="torch.distributed.pipelining.stage",
                attribute="_PipelineStageBase.__init__",
                label="PipelineStage",
            ),
            WrapperForward(
                module=_SCHEDULES,
                attribute="PipelineScheduleSingle.step",
                label="a pipeline schedule",
                describe=_schedule,
                layers=True,
            ),
            WrapperForward(
                module=_SCHEDULES,
                attribute="PipelineScheduleMulti.step",
                label="a pipeline schedule (several stages)",
                describe=_schedule,
                layers=True,
            ),
        ),
    )
)
