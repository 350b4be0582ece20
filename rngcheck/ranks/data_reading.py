"""How the ranks read their data: samplers that split one order among them (Rule 5 of
docs/data-parallel.md), a dispatcher that reads every rank's batches on one rank (Rule 6), and a
rank's own share of the data being read (Rule 7).

**Rule 5.** accelerate's ``BatchSamplerShard`` (what Hugging Face's Trainer uses), Lightning's
``DistributedSamplerWrapper`` and torch's ``DistributedSampler`` each make every rank walk the
same order of the whole dataset and keep its own share of it. A random op drawn while one of them
iterates (the inner sampler's shuffle) is a replicated decision whatever the generator: if the
ranks draw different orders, each keeps its share of a different order, and a pass over the data
gives some samples to two ranks and others to none. So such a draw is compared by state even on a
generator the other rules leave uncompared by state (a per-rank stream, Rule 3; one the
data-parallel forward moved apart, Rule 2's wake).

accelerate's ``IterableDatasetShard`` (an ``IterableDataset`` under accelerate with
``dispatch_batches=False``, which accelerate's own error for batches of different sizes
suggests) does the same with a stream: every rank iterates the whole dataset and keeps its share
of each global batch, so what the dataset draws as it iterates (a shuffle, a shuffle buffer, a
mix of sources) must be drawn alike too. (Draws there that only augment a sample would be
harmless if they differed, but they are compared as well: accelerate synchronises the dataset's
own ``generator`` each pass, the place for them.)

torch's ``random_split`` (a dataset into training and validation sets) is a replicated decision too:
ranks that draw its permutation apart each hold out different samples, so one rank trains on what
another validates on, and a sampler then splits a different training set on each rank. It is one
whether or not a wrapper is built yet (a script splits its data before it wraps its model), and
before the first step in a program with none (ranks that share a batch, under tensor or pipeline
parallelism, then read different data; later there it is compared as any op). Not from a generator
already known to be seeded per rank on purpose (Rule 3): a rank may split alone there (a subset for
its logs). A rank that splits a shard of its own marks the split with ``rngcheck.expect("differ")``.

Known by the function that iterates the inner order (its code object): a sampler of the
user's that shards by rank after shuffling with its own per-rank stream is not one, and is left
to the other rules; nor is a subclass of torch's ``DistributedSampler`` that overrides
``__iter__`` (it may shard first). Draws with replacement (``WeightedRandomSampler``,
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

**Rule 7.** A random op drawn while torch's DataLoader fetches a batch in this process (its
fetcher: a map-style dataset's ``__getitem__``, then the ``collate_fn``) from data split among
the ranks (the loader's sampler, or its dataset, holds a rank and a number of ranks above one:
torch's ``DistributedSampler`` and its subclasses, accelerate's ``BatchSamplerShard`` and
``IterableDatasetShard``, samplers of the same pattern) is drawn for this rank's own samples: a
collator's masking (Hugging Face's ``DataCollatorForLanguageModeling``), an augmentation, each
over the rank's own batch shapes. Not compared across the ranks, as Rule 2 leaves a
data-parallel forward's draws; a generator they moved apart is compared by what runs, not by
state. What an ``IterableDataset`` draws as it is iterated is not: a stream may shuffle
before it splits itself by rank (every rank must then draw alike; under
``IterableDatasetShard`` that is Rule 5's), so only its collation is the rank's own.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, NamedTuple

from ..core.known_code import KnownCode

__all__ = [
    "DISPATCHERS",
    "FETCHING",
    "DISPATCHER_MODULES",
    "NOT_READING",
    "SHARDING_SAMPLERS",
    "SPLITS_A_DATASET",
    "Reading",
    "data_reading",
    "drawn_by_random_split",
]

_ACCELERATE = "accelerate.data_loader"
SPLITS_A_DATASET = "torch's random_split"
_LIGHTNING = "Lightning's DistributedSamplerWrapper"
# (a module, a function's qualified name in it) -> the sampler that splits the order it iterates
SHARDING_SAMPLERS: dict[tuple[str, str], str] = {
    (_ACCELERATE, "BatchSamplerShard._iter_with_split"): "accelerate's BatchSamplerShard",
    (_ACCELERATE, "BatchSamplerShard._iter_with_no_split"): "accelerate's BatchSamplerShard",
    (_ACCELERATE, "IterableDatasetShard.__iter__"): "accelerate's IterableDatasetShard",
    # (transformers' own, which its Trainer no longer uses, but scripts may)
    (
        "transformers.trainer_pt_utils",
        "IterableDatasetShard.__iter__",
    ): "transformers' IterableDatasetShard",
    # _DatasetSamplerWrapper materialises the inner sampler's order for the wrapper to split
    ("lightning.fabric.utilities.distributed", "_DatasetSamplerWrapper.reset"): _LIGHTNING,
    ("lightning.fabric.utilities.distributed", "_DatasetSamplerWrapper.__getitem__"): _LIGHTNING,
    ("lightning_fabric.utilities.distributed", "_DatasetSamplerWrapper.reset"): _LIGHTNING,
    ("lightning_fabric.utilities.distributed", "_DatasetSamplerWrapper.__getitem__"): _LIGHTNING,
    ("torch.utils.data.distributed", "DistributedSampler.__iter__"): "torch's DistributedSampler",
    # (a function, not a sampler: the permutation that splits a dataset into train and
    # validation sets, which every rank must draw alike; known before any wrapper is)
    ("torch.utils.data.dataset", "random_split"): SPLITS_A_DATASET,
}
# (a module, a function's qualified name in it) -> a sampler that draws this rank's order of the
# whole dataset alone: no order to split among data-parallel ranks, but one that every stage of a
# pipeline must walk alike (the first stage reads the inputs, the last the labels), with
# replacement or without
SHUFFLING_SAMPLERS: dict[tuple[str, str], str] = {
    ("torch.utils.data.sampler", "RandomSampler.__iter__"): "torch's RandomSampler",
    ("torch.utils.data.sampler", "SubsetRandomSampler.__iter__"): "torch's SubsetRandomSampler",
    ("torch.utils.data.sampler", "WeightedRandomSampler.__iter__"): (
        "torch's WeightedRandomSampler"
    ),
}
# (a module, a function's qualified name in it) -> the dispatcher that reads there, on one rank,
# the batches of every rank
DISPATCHERS: dict[tuple[str, str], str] = {
    (_ACCELERATE, "DataLoaderDispatcher._fetch_batches"): "accelerate's DataLoaderDispatcher",
}
DISPATCHER_MODULES = tuple({module for module, _ in DISPATCHERS})  # where a dispatcher lives
# (a module, a function's qualified name in it) -> what it is, for Rule 7: torch's fetchers (a
# batch read from the dataset and collated, in this process) and the single-process DataLoader
# iterator that calls them (it holds the loader's sampler and dataset)
_DATA = "torch.utils.data"
FETCHING: dict[tuple[str, str], str] = {
    (f"{_DATA}._utils.fetch", "_MapDatasetFetcher.fetch"): "fetch",
    (f"{_DATA}._utils.fetch", "_IterableDatasetFetcher.fetch"): "fetch",
    (f"{_DATA}.dataloader", "_SingleProcessDataLoaderIter._next_data"): "loader",
}
_MAX_DEPTH = 256  # frames walked at most (a sampler iterates a few frames above the op)
_SAMPLER_DEPTH = 6  # samplers followed at most from a loader (batch sampler, skip, shard, ...)
# (the number of ranks, this rank's index among them), as the samplers that split data name them
_SPLITS = (
    ("num_replicas", "rank"),  # torch's DistributedSampler and its kind
    ("num_processes", "process_index"),  # accelerate's shards
    ("data_parallel_size", "data_parallel_rank"),  # Megatron-LM's samplers
)
# An IterableDataset of Hugging Face's datasets split by split_dataset_by_node keeps the split in
# its DistributedConfig (rank, world_size) here (read only there: "world_size" and "rank" are
# too common a pair to read on any sampler or dataset):
_HF_SPLIT = "_distributed"
_HF_SPLITS = (("world_size", "rank"),)
_HF_SPLIT_LABEL = "Hugging Face datasets' split_dataset_by_node"

# The functions above by their code objects: code -> (label, kind)
_KNOWN = KnownCode(
    {
        **{key: (label, "order") for key, label in SHARDING_SAMPLERS.items()},
        **{key: (label, "dispatcher") for key, label in DISPATCHERS.items()},
        **{key: (label, "shuffle") for key, label in SHUFFLING_SAMPLERS.items()},
        **{key: ("", kind) for key, kind in FETCHING.items()},
    }
)


class Reading(NamedTuple):
    """What reads the data a random op draws for."""

    order: str = ""  # the sampler splitting among the ranks the order drawn, or random_split
    dispatcher: str = ""  # the dispatcher reading on this rank every rank's batches (Rule 6)
    share: str = ""  # what splits among the ranks the data fetched here for this rank (Rule 7)
    shuffle: str = ""  # the sampler drawing this rank's order of the whole dataset (not a share)


NOT_READING = Reading()


def data_reading(skip: int = 0) -> Reading:
    """What reads the data the caller is drawing for on this thread: the sampler that splits
    among the ranks the order being drawn (not one drawing with replacement), the dispatcher
    this rank reads every rank's batches for, and what splits among the ranks the data a
    DataLoader is fetching for this rank, or :data:`NOT_READING`. A walk of the live frames, a
    few microseconds (about 0.2 us a frame): the rank checker calls it for the random ops it
    compares in a data-parallel program, one that loaded a dispatcher or read its own share of
    the data, and before the first step, which run outside the wrappers' forward and backward
    (a shuffle, a collator's masking, a draw in the training loop)."""
    known = _KNOWN.table()
    frame: FrameType | None = sys._getframe(skip + 1)
    depth = 0
    inner: list[FrameType] = []  # the samplers' __iter__ frames below the wrapper's
    order: str | None = None  # the innermost sampler's label ("" with replacement), once met
    fetching = False  # a fetcher's frame is below: the op draws for a batch being read
    share = shuffle = ""
    below: FrameType | None = None  # the frame the current one called
    while frame is not None and depth < _MAX_DEPTH:
        code = frame.f_code
        hit = known.get(id(code))
        if hit is not None:
            label, kind = hit
            if kind == "dispatcher":  # one rank reads for all, whatever splits an order below it
                return Reading(dispatcher=label)
            if kind == "order":
                if order is None:
                    order = "" if any(_with_replacement(f) for f in inner) else label
            elif kind == "shuffle":
                if order is None:
                    inner.append(frame)  # (under a splitting sampler: with replacement or not)
                    shuffle = shuffle or label
            elif kind == "fetch":
                # (an order drawn in the stream under it is Rule 5's, any stream draw not ours)
                fetching = order is None and not _iterating(frame, below)
            elif fetching and not share:  # the loader whose fetcher is below
                share = _split_of(frame.f_locals.get("self"))
        elif order is None and code.co_name == "__iter__":
            inner.append(frame)
        below, frame = frame, frame.f_back
        depth += 1
    if order or share or shuffle:
        return Reading(order=order or "", share=share, shuffle=shuffle)
    return NOT_READING


_SPLIT_FILE = "torch/utils/data/dataset.py"


def drawn_by_random_split(event: Any) -> bool:
    """Whether torch's ``random_split`` drew the random op ``event`` (a RandomOpEvent), read from
    its captured stack: for ops recorded before the rank checker started, whose frames are gone."""
    return any(
        f.name == "random_split" and f.filename.replace("\\", "/").endswith(_SPLIT_FILE)
        for f in event.stack.frames
    )


def _with_replacement(frame: FrameType) -> bool:
    return getattr(frame.f_locals.get("self"), "replacement", False) is True


def _iterating(fetch: FrameType, callee: FrameType | None) -> bool:
    """Whether an iterable-style fetcher's frame is running its dataset's iterator (``callee``,
    the frame it called, is that iterator's: a generator's frame, or a method of the iterator
    object), not its ``collate_fn``."""
    it = getattr(fetch.f_locals.get("self"), "dataset_iter", None)
    if it is None or callee is None:
        return False
    return callee is getattr(it, "gi_frame", None) or callee.f_locals.get("self") is it


def _split_of(loader_iter: object) -> str:
    """What splits among the ranks the data of a single-process DataLoader iterator, in words
    ("torch's DistributedSampler"): its dataset (accelerate's ``IterableDatasetShard``, a
    Hugging Face streaming dataset split by ``split_dataset_by_node``) or a sampler in the chain
    from its index sampler (a batch sampler, a skip, a shard) that holds a rank and a number of
    ranks above one; "" when none does (every rank may read the same data, and what is drawn
    for it must agree)."""
    dataset = _attribute(loader_iter, "_dataset")
    candidates = [(dataset, _SPLITS), (_attribute(dataset, _HF_SPLIT), _HF_SPLITS)]
    sampler = _attribute(loader_iter, "_index_sampler")
    for _ in range(_SAMPLER_DEPTH):
        if sampler is None:
            break
        candidates.append((sampler, _SPLITS))
        inner = _attribute(sampler, "batch_sampler")
        sampler = inner if inner is not None else _attribute(sampler, "sampler")
    for obj, splits in candidates:
        for size, index in splits:
            n = _attribute(obj, size)
            if type(n) is int and n > 1 and type(_attribute(obj, index)) is int:
                if splits is _HF_SPLITS:
                    return _HF_SPLIT_LABEL
                cls = type(obj)
                top = cls.__module__.partition(".")[0]
                return cls.__name__ if top == "__main__" else f"{top}'s {cls.__name__}"
    return ""


def _attribute(obj: object, name: str) -> Any:
    """``obj.name``, or None when it has none or reading it raises (the user's samplers and
    datasets: a property that raises must not reach training; unknown means compared)."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001
        return None
