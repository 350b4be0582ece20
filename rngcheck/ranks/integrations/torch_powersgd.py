"""torch's PowerSGD communication hook (``powerSGD_hook``, ``batched_powerSGD_hook``, registered
with ``DistributedDataParallel.register_comm_hook``). It compresses each gradient bucket in
backward as ``M ~ P Q^T``: it draws ``Q`` from a normal distribution (at each compression, or at
the first one with ``warm_start=True``), inside ``fork_rng`` of the default CPU generator,
reseeded from ``PowerSGDState``'s own generator (``random_seed``) so that, in torch's words, "the
initial random values are the same across all the DDP replicas". What ``Q`` feeds, the
all-reduced sketch, is replicated over the wrapper's group: its draws must agree there, by state,
whatever the wrapper's backward says of the rest (each rank's own dropout)."""

from __future__ import annotations

from ..verdict import Reason
from . import register
from .records import Frames, Integration, Role

_MODULE = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
_LABEL = "torch's PowerSGD hook"
_WHAT = (
    "{order} compresses each gradient bucket by a sketch M Q of random values Q that every "
    "replica must draw alike (torch seeds them from PowerSGDState's random_seed for that), and "
    "the ranks drew them from {gen} in different states: the all-reduced sketch mixes a "
    "different random projection of each rank's gradient, so the mean gradient is projected "
    "onto another subspace than PowerSGD computes (at every compressed step with "
    "warm_start=False, at the first one with warm_start=True); the replicas stay equal and "
    "nothing fails, and training may converge worse."
)
_ADVICE = (
    "Give PowerSGDState the same random_seed on every rank (its default, 0, is the same), "
    "and restore the same state on every rank when resuming (the seeds above are the ones "
    "the hook drew from its own generator, which random_seed seeds)"
)

register(
    Integration(
        name="torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
        library="torch",
        hooks=tuple(
            Frames(
                module=_MODULE,
                attribute=name,
                label=_LABEL,
                role=Role.SKETCH,
                scope=Reason.SKETCH,
                what=_WHAT,
                advice=_ADVICE,
                forks=True,
            )
            # (its create_low_rank_tensor draws, nested in it: the walk meets the hook's frame)
            for name in ("powerSGD_hook", "batched_powerSGD_hook")
        ),
    )
)
