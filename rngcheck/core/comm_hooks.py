"""Which of torch's communication hooks draws a random op: its PowerSGD hook (Rule 10 of
docs/data-parallel.md).

``DistributedDataParallel.register_comm_hook(state, powerSGD_hook)`` (or
``batched_powerSGD_hook``) compresses each gradient bucket in backward as ``M ~ P Q^T``: it
draws ``Q`` from a normal distribution (at each compression, or at the first one only with
``warm_start=True``), all-reduces ``P = M Q``, then ``Q = M^T P``. torch draws ``Q`` from the
default CPU generator inside ``fork_rng``, reseeded from ``PowerSGDState``'s own NumPy
generator (``random_seed``, 0 by default), so that, in torch's words, "the initial random values
are the same across all the DDP replicas". Ranks that draw different ``Q`` (a
``random_seed=seed + rank``) all-reduce a mix of different random projections of their
gradients: every rank still applies the same update, so nothing fails and the replicas stay
equal, but the mean gradient is projected onto another subspace than PowerSGD computes (at every
compressed step with ``warm_start=False``, at the first one with ``warm_start=True``).

Such a draw runs in the wrapper's backward, where Rule 2 leaves every draw to the rank (each
rank's dropout over its own batch); the rank checker compares it across the ranks by state
instead, whatever Rules 2, 3 and 9 say of its generator, as Rule 5 compares an order that a
sampler splits, and the mode's note on randomness in backward names the hook instead of taking
its draws for a possible redraw of dropout. Known by the hook's function (its code object) on
the live frames, walked only once the hook's module is imported.
"""

from __future__ import annotations

import sys
from types import FrameType

from .known_code import KnownCode

__all__ = ["FORKING_HOOKS", "POWER_SGD", "comm_hook_drawing"]

_MODULE = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
POWER_SGD = "torch's PowerSGD hook"
# The hooks that draw inside torch.random.fork_rng: the generator is as it was once they return.
FORKING_HOOKS = frozenset({POWER_SGD})
_KNOWN = KnownCode(
    {
        (_MODULE, "powerSGD_hook"): POWER_SGD,
        # (its create_low_rank_tensor draws, nested in it: the walk meets the hook's frame next)
        (_MODULE, "batched_powerSGD_hook"): POWER_SGD,
    }
)
_MAX_DEPTH = 64  # frames walked at most (the hook is a few frames above the op's dispatch)


def comm_hook_drawing(skip: int = 0) -> str:
    """The communication hook of torch's whose randomness the caller draws on this thread
    (:data:`POWER_SGD`), or ""."""
    if _MODULE not in sys.modules:
        return ""
    known = _KNOWN.table()
    frame: FrameType | None = sys._getframe(skip + 1)
    depth = 0
    while frame is not None and depth < _MAX_DEPTH:
        label = known.get(id(frame.f_code))
        if label is not None:
            return label
        frame = frame.f_back
        depth += 1
    return ""
