"""torch's data loading (``torch.utils.data``): its samplers, ``random_split`` and the DataLoader's
fetchers.

- ``DistributedSampler`` makes every rank walk the same order of the whole dataset and keep its
  own share: what is drawn while it iterates (the order) feeds a decision every rank must share,
  so it agrees by state over the group, whatever else moved the generator.
- ``random_split`` divides a dataset (training and validation sets) by one permutation that
  every rank must draw alike, also before any wrapper is built.
- ``RandomSampler``, ``SubsetRandomSampler`` and ``WeightedRandomSampler`` draw this rank's order
  of the whole dataset: in a program with pipeline stages every stage walks it (the first reads
  the inputs, the last the labels), so it agrees there; under a sampler that splits an order,
  one drawing with replacement makes the split no order.
- The DataLoader's fetchers read a batch in this process (a dataset's ``__getitem__``, then the
  ``collate_fn``): through a sampler that splits the data among the ranks (``num_replicas`` and
  ``rank``), that batch is this rank's own share, and what is drawn for it (a collator's masking)
  is the rank's own.
"""

from __future__ import annotations

from typing import Any

from ..verdict import Reason
from . import register
from .common import read
from .records import Frames, Integration, Role, ShareSplit

_DATA = "torch.utils.data"
_SPLIT_WHAT = (
    "{order} divides a dataset into parts (training and validation sets) by a permutation, and "
    "the ranks drew it from {gen} in different states: each rank holds out different samples "
    "and keeps a different training set. In data-parallel training the samples one rank "
    "validates on are trained on by another (validation no longer measures unseen data), and a "
    "sampler that divides the training set among the ranks divides a different set on each, so "
    "an epoch trains on some samples twice and on others never; ranks that share a batch "
    "(tensor or pipeline parallelism) read different data."
)
_SPLIT_ADVICE = (
    "Give random_split a generator seeded alike on every rank "
    "(generator=torch.Generator().manual_seed(seed)); where each rank splits a shard of "
    "its own on purpose, mark the split with rngcheck.expect('differ')"
)


def _dataset_iter(fetcher: Any) -> Any:
    """The dataset iterator an iterable-style fetcher runs."""
    return read(fetcher, "dataset_iter")


def _loader(loader_iter: Any) -> tuple[Any, Any]:
    """A single-process DataLoader iterator's dataset and index sampler."""
    return read(loader_iter, "_dataset"), read(loader_iter, "_index_sampler")


def _sampler(name: str) -> Frames:
    return Frames(
        module=f"{_DATA}.sampler",
        attribute=f"{name}.__iter__",
        label=f"torch's {name}",
        role=Role.SAMPLER,
        scope=Reason.STAGE_ORDER,
    )


register(
    Integration(
        name="torch.utils.data",
        library="torch",
        hooks=(
            Frames(
                module=f"{_DATA}.distributed",
                attribute="DistributedSampler.__iter__",
                label="torch's DistributedSampler",
                role=Role.ORDER,
                scope=Reason.ORDER,
                advice=(
                    "Give DistributedSampler the same seed= on every rank (it reseeds with "
                    "seed + epoch itself)"
                ),
            ),
            Frames(
                module=f"{_DATA}.dataset",
                attribute="random_split",
                label="torch's random_split",
                role=Role.ORDER,
                scope=Reason.SPLIT,
                what=_SPLIT_WHAT,
                advice=_SPLIT_ADVICE,
                anywhere=True,
                on_per_rank=False,
            ),
            _sampler("RandomSampler"),
            _sampler("SubsetRandomSampler"),
            _sampler("WeightedRandomSampler"),
            Frames(
                module=f"{_DATA}._utils.fetch",
                attribute="_MapDatasetFetcher.fetch",
                role=Role.FETCH,
                scope=Reason.OWN_SHARE,
            ),
            Frames(
                module=f"{_DATA}._utils.fetch",
                attribute="_IterableDatasetFetcher.fetch",
                role=Role.FETCH,
                scope=Reason.OWN_SHARE,
                reads=_dataset_iter,
            ),
            Frames(
                module=f"{_DATA}.dataloader",
                attribute="_SingleProcessDataLoaderIter._next_data",
                role=Role.LOADER,
                scope=Reason.OWN_SHARE,
                reads=_loader,
            ),
        ),
        shares=(ShareSplit(size="num_replicas", index="rank"),),
    )
)
