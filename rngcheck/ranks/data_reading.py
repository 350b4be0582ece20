"""How the ranks read their data: samplers that split one order among them (Rule 5 of
docs/data-parallel.md), and a dispatcher that reads every rank's batches on one rank (Rule 6).

**Rule 5.** accelerate's ``BatchSamplerShard`` (what Hugging Face's Trainer uses), Lightning's
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

**Rule 6.** accelerate's ``DataLoaderDispatcher`` (``dispatch_batches=True``, accelerate's
default for an ``IterableDataset``, so Hugging Face's Trainer's too) iterates the DataLoader on
process 0 alone, in its ``_fetch_batches``, and broadcasts the batches to the other ranks. The
random ops drawn there (the sampler's shuffle, a dataset's augmentation or shuffle buffer, a
collator's masking) are that rank's alone by design: not compared across the ranks. A generator
they drew from then differs across the ranks (the default generator, when the sampler or the
dataset draws from it), and is compared by what runs, not by state, as after Rule 2.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from types import FrameType
from typing import NamedTuple

__all__ = ["DISPATCHERS", "SHARDING_SAMPLERS", "Reading", "data_reading"]

_SEP = os.sep
_LIGHTNING = "Lightning's DistributedSamplerWrapper"
_ACCELERATE = "accelerate's BatchSamplerShard"
_ACCELERATE_LOADER = f"{_SEP}accelerate{_SEP}data_loader.py"
# (the end of a file's path, a function in it) -> the sampler that splits the order it iterates
SHARDING_SAMPLERS: dict[tuple[str, str], str] = {
    (_ACCELERATE_LOADER, "_iter_with_split"): _ACCELERATE,
    (_ACCELERATE_LOADER, "_iter_with_no_split"): _ACCELERATE,
    # _DatasetSamplerWrapper materialises the inner sampler's order for the wrapper to split
    (f"{_SEP}lightning{_SEP}fabric{_SEP}utilities{_SEP}distributed.py", "reset"): _LIGHTNING,
    (f"{_SEP}lightning{_SEP}fabric{_SEP}utilities{_SEP}distributed.py", "__getitem__"): _LIGHTNING,
    (f"{_SEP}lightning_fabric{_SEP}utilities{_SEP}distributed.py", "reset"): _LIGHTNING,
    (f"{_SEP}lightning_fabric{_SEP}utilities{_SEP}distributed.py", "__getitem__"): _LIGHTNING,
    (f"{_SEP}torch{_SEP}utils{_SEP}data{_SEP}distributed.py", "__iter__"): (
        "torch's DistributedSampler"
    ),
}
# (the end of a file's path, a function in it) -> the dispatcher that reads there, on one rank,
# the batches of every rank
DISPATCHERS: dict[tuple[str, str], str] = {
    (_ACCELERATE_LOADER, "_fetch_batches"): "accelerate's DataLoaderDispatcher",
}
DISPATCHER_MODULES = ("accelerate.data_loader",)  # where a dispatcher can come from
_NAMES = frozenset(name for _, name in (*SHARDING_SAMPLERS, *DISPATCHERS))
_MAX_DEPTH = 256  # frames walked at most (a sampler iterates a few frames above the op)


class Reading(NamedTuple):
    """What reads the data a random op draws for."""

    order: str = ""  # the sampler splitting among the ranks the order drawn (Rule 5)
    dispatcher: str = ""  # the dispatcher reading on this rank every rank's batches (Rule 6)


NOT_READING = Reading()


@lru_cache(maxsize=1024)
def _label(filename: str, name: str) -> tuple[str, bool]:
    """The sampler or dispatcher a function is part of, and whether it is a dispatcher."""
    for table, dispatcher in ((DISPATCHERS, True), (SHARDING_SAMPLERS, False)):
        for (tail, fn), label in table.items():
            if name == fn and filename.endswith(tail):
                return label, dispatcher
    return "", False


def data_reading(skip: int = 0) -> Reading:
    """What reads the data the caller is drawing for on this thread: the sampler that splits
    among the ranks the order being drawn (not one drawing with replacement), and the dispatcher
    this rank reads every rank's batches for, or :data:`NOT_READING`. A walk of the live
    frames, a few microseconds (about 0.2 us a frame): the rank checker calls it for the random
    ops it compares in a data-parallel program or one that loaded a dispatcher, which run
    outside the wrappers' forward and backward (a shuffle, a draw in the training loop)."""
    frame: FrameType | None = sys._getframe(skip + 1)
    depth = 0
    inner: list[FrameType] = []  # the samplers' __iter__ frames below the wrapper's
    order: str | None = None  # the innermost sampler's label ("" with replacement), once met
    while frame is not None and depth < _MAX_DEPTH:
        code = frame.f_code
        name = code.co_name
        if name in _NAMES:
            label, dispatcher = _label(code.co_filename, name)
            if dispatcher:  # one rank reads for all, whatever splits an order below it
                return Reading(dispatcher=label)
            if order is None:
                if label:
                    order = "" if any(_with_replacement(f) for f in inner) else label
                elif name == "__iter__":
                    inner.append(frame)
        frame = frame.f_back
        depth += 1
    return Reading(order=order) if order else NOT_READING


def _with_replacement(frame: FrameType) -> bool:
    return getattr(frame.f_locals.get("self"), "replacement", False) is True
