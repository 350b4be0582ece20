"""Hugging Face's accelerate (what its Trainer uses).

- ``BatchSamplerShard`` makes every rank walk the same order of the whole dataset and keep its
  share; ``IterableDatasetShard`` (an ``IterableDataset`` with ``dispatch_batches=False``) has
  every rank iterate the whole stream and keep its share of each global batch. What is drawn while
  they iterate decides the order (or the stream) every rank shares: it agrees by state.
- ``DataLoaderDispatcher`` (``dispatch_batches=True``, the default for an ``IterableDataset``)
  iterates the DataLoader on process 0 alone, in ``_fetch_batches``, and broadcasts the batches:
  what is drawn there is that rank's alone.
- Its shards name their split ``num_processes`` and ``process_index``.
"""

from __future__ import annotations

from ..verdict import Reason
from . import register
from .common import STREAM_ADVICE, STREAM_WHAT
from .records import Frames, Integration, Role, ShareSplit

_MODULE = "accelerate.data_loader"
_SHARD = "accelerate's BatchSamplerShard"
_SHARD_ADVICE = (
    "{alike}; under Hugging Face's Trainer, a sampler made without a generator "
    "(group_by_length's) gets one that accelerate synchronises across the ranks each epoch "
    "with accelerator_config={'use_seedable_sampler': False}, and the default sampler "
    "draws alike when every rank is seeded alike (set_seed without device_specific, the "
    "same data_seed)"
)

register(
    Integration(
        name="accelerate",
        library="accelerate",
        hooks=(
            *(
                Frames(
                    module=_MODULE,
                    attribute=f"BatchSamplerShard.{name}",
                    label=_SHARD,
                    role=Role.ORDER,
                    scope=Reason.ORDER,
                    advice=_SHARD_ADVICE,
                )
                for name in ("_iter_with_split", "_iter_with_no_split")
            ),
            Frames(
                module=_MODULE,
                attribute="IterableDatasetShard.__iter__",
                label="accelerate's IterableDatasetShard",
                role=Role.ORDER,
                scope=Reason.ORDER,
                what=STREAM_WHAT,
                advice=STREAM_ADVICE,
            ),
            Frames(
                module=_MODULE,
                attribute="DataLoaderDispatcher._fetch_batches",
                label="accelerate's DataLoaderDispatcher",
                role=Role.READER,
                scope=Reason.READ_ALONE,
            ),
        ),
        shares=(ShareSplit(size="num_processes", index="process_index"),),
    )
)
