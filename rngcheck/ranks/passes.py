"""``level="step"``: the start of each pass over the data, checked op by op between samples.

A sampler that splits one order among the ranks (an order every rank walks: accelerate's
``BatchSamplerShard`` under Hugging Face's Trainer, torch's ``DistributedSampler``) draws that
order once a pass, as the pass begins: at a step the schedule rarely samples (one in
``sample_every``), and from a generator the step digests may not compare (the default generator,
which the ranks' dropout moves apart on purpose). So between samples the mode's interception is
back while a DataLoader iterator of this process asks its sampler for a pass's first indices:
as it is made or reset (a sampler whose ``__iter__`` draws at once) and over its first batch
(one that draws when first asked; a multi-worker loader's ``_reset`` asks for several batches'
indices). The rank checker digests the orders drawn there (``RankChecker.pass_window``).

What runs in those windows costs what it costs at the op level (the first batch is fetched and
collated under the dispatch mode in a single-process loader); between them the patched
``__next__`` reads one counter per batch. Installed for the mode's lifetime only, at
``level="step"`` across ranks.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["PassStarts"]

Window = Callable[[], AbstractContextManager[Any]]


def _windowed(original: Callable[..., Any], window: Window) -> Callable[..., Any]:
    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        with window():
            return original(*args, **kwargs)

    return run


class PassStarts:
    """Opens ``window()`` where DataLoader iterators ask their sampler for a pass's first
    indices (nested windows are the outer one's: the mode's window does nothing inside one)."""

    def __init__(self, window: Window) -> None:
        self._window = window
        self._saved: list[tuple[type, str, Any, Any]] = []  # class, name, original, ours
        self._lock = threading.Lock()

    def install(self) -> None:
        from torch.utils.data import dataloader as dl

        window = self._window
        base_next = dl._BaseDataLoaderIter.__next__

        @functools.wraps(base_next)
        def __next__(self: Any) -> Any:
            if self._num_yielded:
                return base_next(self)
            with window():  # the first batch of a pass: a lazy sampler draws the order here
                return base_next(self)

        patches = [
            # (the base class's __init__ runs before a multi-worker loader starts its workers)
            (
                dl._BaseDataLoaderIter,
                "__init__",
                _windowed(dl._BaseDataLoaderIter.__init__, window),
            ),
            (dl._BaseDataLoaderIter, "_reset", _windowed(dl._BaseDataLoaderIter._reset, window)),
            (
                dl._MultiProcessingDataLoaderIter,
                "_reset",
                _windowed(dl._MultiProcessingDataLoaderIter._reset, window),
            ),
            (dl._BaseDataLoaderIter, "__next__", __next__),
        ]
        with self._lock:
            if self._saved:
                return
            for cls, name, ours in patches:
                self._saved.append((cls, name, cls.__dict__[name], ours))
                setattr(cls, name, ours)

    def uninstall(self) -> None:
        """Put torch's methods back, where they are still ours (a patch made over ours stays)."""
        with self._lock:
            saved, self._saved = self._saved, []
            for cls, name, original, ours in reversed(saved):
                if cls.__dict__.get(name) is ours:
                    setattr(cls, name, original)
