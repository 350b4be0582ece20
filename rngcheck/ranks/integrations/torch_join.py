"""torch's ``Join`` (``torch.distributed.algorithms.join``; accelerate's ``join_uneven_inputs``
enters it): each rank trains on its own number of batches, and a rank that runs out of inputs
shadows the others' collectives until every rank has. Inside it the only exchange points are the
ones Join itself pairs across the ranks (protocol rule P7); from the first rank's running out
until ``Join.__exit__`` returns, what any rank draws is its own."""

from __future__ import annotations

from typing import Any

from . import register
from .common import read
from .records import Integration, JoinContext


def _group(join: Any) -> Any:
    """Its process group (None: the default group, as Join's own default)."""
    return read(join, "_process_group")


def _first(joinable: Any) -> bool:
    config = read(joinable, "_join_config")
    return bool(config.enable and config.is_first_joinable)


register(
    Integration(
        name="torch.distributed.algorithms.join",
        library="torch",
        hooks=(
            JoinContext(
                module="torch.distributed.algorithms.join",
                attribute="Join",
                label="Join",
                enabled=lambda join: bool(read(join, "_enable")),
                joinables=lambda join: read(join, "_joinables"),
                group=_group,
                first=_first,
            ),
        ),
    )
)
