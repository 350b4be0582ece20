"""Samplers that split one order among the ranks (Rule 5 of docs/data-parallel.md).

accelerate's ``BatchSamplerShard`` (what Hugging Face's Trainer uses), Lightning's
``DistributedSamplerWrapper`` and torch's ``DistributedSampler`` each make every rank walk the
same order of the whole dataset and keep its own share of it. A random op drawn while one of them
iterates (the inner sampler's shuffle) is a replicated decision whatever the generator: if the
ranks draw different orders, each keeps its share of a different order, and a pass over the data
gives some samples to two ranks and others to none. So such a draw is compared by state even on a
generator the other rules leave uncompared by state (a per-rank stream, Rule 3; one the
data-parallel forward moved apart, Rule 2's wake).

Known by the function that iterates the inner order (its file and name): a sampler of the
user's that shards by rank after shuffling with its own per-rank stream is not one, and is left
to the other rules; nor is a subclass of torch's ``DistributedSampler`` that overrides
``__iter__`` (it may shard first). A dataset's own draws under accelerate's
``IterableDatasetShard`` are not either: they mix the order (a shuffle buffer) with per-sample
augmentation, which may differ. Draws with replacement (``WeightedRandomSampler``,
``RandomSampler(replacement=True)``) are no order: each rank's share is independent draws
whether or not the ranks draw alike, so a sampler with ``replacement=True`` under the wrapper is
not one.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from types import FrameType

__all__ = ["SHARDING_SAMPLERS", "sharding_sampler"]

_SEP = os.sep
_LIGHTNING = "Lightning's DistributedSamplerWrapper"
_ACCELERATE = "accelerate's BatchSamplerShard"
# (the end of a file's path, a function in it) -> the sampler that splits the order it iterates
SHARDING_SAMPLERS: dict[tuple[str, str], str] = {
    (f"{_SEP}accelerate{_SEP}data_loader.py", "_iter_with_split"): _ACCELERATE,
    (f"{_SEP}accelerate{_SEP}data_loader.py", "_iter_with_no_split"): _ACCELERATE,
    # _DatasetSamplerWrapper materialises the inner sampler's order for the wrapper to split
    (f"{_SEP}lightning{_SEP}fabric{_SEP}utilities{_SEP}distributed.py", "reset"): _LIGHTNING,
    (f"{_SEP}lightning{_SEP}fabric{_SEP}utilities{_SEP}distributed.py", "__getitem__"): _LIGHTNING,
    (f"{_SEP}lightning_fabric{_SEP}utilities{_SEP}distributed.py", "reset"): _LIGHTNING,
    (f"{_SEP}lightning_fabric{_SEP}utilities{_SEP}distributed.py", "__getitem__"): _LIGHTNING,
    (f"{_SEP}torch{_SEP}utils{_SEP}data{_SEP}distributed.py", "__iter__"): (
        "torch's DistributedSampler"
    ),
}
_NAMES = frozenset(name for _, name in SHARDING_SAMPLERS)
_MAX_DEPTH = 256  # frames walked at most (a sampler iterates a few frames above the op)


@lru_cache(maxsize=1024)
def _label(filename: str, name: str) -> str:
    for (tail, fn), label in SHARDING_SAMPLERS.items():
        if name == fn and filename.endswith(tail):
            return label
    return ""


def sharding_sampler(skip: int = 0) -> str:
    """The sampler that splits among the ranks the order the caller is drawing for (its label),
    or "" when no such sampler is iterating on this thread (or the sampler under it draws with
    replacement). A walk of the live frames, a few microseconds (about 0.2 us a frame): the
    rank checker calls it for the random ops it compares in a data-parallel program, which
    run outside the wrappers' forward and backward (a shuffle, a draw in the training loop)."""
    frame: FrameType | None = sys._getframe(skip + 1)
    depth = 0
    inner: list[FrameType] = []  # the samplers' __iter__ frames below the wrapper's
    while frame is not None and depth < _MAX_DEPTH:
        code = frame.f_code
        name = code.co_name
        if name in _NAMES:
            label = _label(code.co_filename, name)
            if label:
                return "" if any(_with_replacement(f) for f in inner) else label
            if name == "__iter__":
                inner.append(frame)
        frame = frame.f_back
        depth += 1
    return ""


def _with_replacement(frame: FrameType) -> bool:
    return getattr(frame.f_locals.get("self"), "replacement", False) is True
