"""Ranks that a checked process starts itself: ``torch.multiprocessing.spawn`` (PyTorch's DDP
tutorial, fairseq, detectron2's ``launch``, Lightning's ``ddp_spawn``), ``start_processes`` and
``multiprocessing`` children started with ``spawn`` or ``forkserver``.

Such a child is not known to be a rank when it starts: a DataLoader worker with a ``spawn``
context starts the same way. It becomes one when it initialises torch.distributed's default
process group, so the startup hook arms it: :func:`when_a_rank` calls back right after the first
``init_process_group`` that leaves the default group up, and the activation starts there (bound
at once). Until then nothing of rngcheck runs in the child but one finder on ``sys.meta_path``
(until torch.distributed is imported) and, after that, the wrapper around
``init_process_group``; both are gone once it has been called.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import sys
import tempfile
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["mark_rank", "ranks_dir", "ranks_started", "when_a_rank"]

_C10D = "torch.distributed.distributed_c10d"
_NAME = "init_process_group"
# Modules holding their own copy of init_process_group (imported by name): torch.distributed's
# star import takes c10d's at its own import, after the patch below; device_mesh's may be later.
_HOLDERS = ("torch.distributed", "torch.distributed.device_mesh")


class _Armed:
    def __init__(self, start: Callable[[], None]) -> None:
        self._start: Callable[[], None] | None = start
        self._unpatch: Callable[[], None] | None = None
        self._unwatch: Callable[[], None] | None = None

    def watch(self) -> None:
        if _C10D in sys.modules:
            self._patch(sys.modules[_C10D])
            return
        from ..core.imports import watch_imports

        self._unwatch = watch_imports([_C10D], self._imported)

    def _imported(self, name: str) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        self._patch(sys.modules[name])

    def _patch(self, c10d: ModuleType) -> None:
        original = getattr(c10d, _NAME, None)
        if original is None:  # a torch built without distributed support
            return

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            # (once: a copy imported by name keeps calling here after the disarm)
            if self._start is not None and c10d.is_initialized():
                start, self._start = self._start, None
                self.disarm()
                start()
            return out

        for module in _holders(c10d):
            if getattr(module, _NAME, None) is original:
                setattr(module, _NAME, init_process_group)
        # (a holder imported after the patch took the wrapper: it gets the original back too)
        self._unpatch = functools.partial(_unpatch, c10d, init_process_group, original)

    def disarm(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None


def _holders(c10d: ModuleType) -> list[ModuleType]:
    return [c10d, *(m for m in map(sys.modules.get, _HOLDERS) if m is not None)]


def _unpatch(c10d: ModuleType, wrapper: Any, original: Any) -> None:
    for module in _holders(c10d):
        if getattr(module, _NAME, None) is wrapper:
            setattr(module, _NAME, original)


def when_a_rank(start: Callable[[], None]) -> None:
    """Call ``start`` right after this process first initialises torch.distributed's default
    process group (through ``torch.distributed.init_process_group`` or ``init_device_mesh``)."""
    _Armed(start).watch()


# -- how the launching process learns that its children are ranks ----------------------------
# Each checked process names a directory (created by the first child that becomes a rank, where
# each such child leaves a file): at its end it is the ranks' launcher when the directory holds
# one, and then saves no report over rank 0's and leaves the closing line to the ranks.


def ranks_dir() -> str:
    """A directory name of this process's own, for :func:`mark_rank` (not created here)."""
    return os.path.join(
        tempfile.gettempdir(), f"rngcheck-ranks-{os.getpid()}-{secrets.token_hex(4)}"
    )


def mark_rank(directory: str | None) -> None:
    """This process, a child of the checked process that named ``directory``, is a rank."""
    if not directory:
        return
    with contextlib.suppress(OSError):  # the launcher then acts as a lone process: no harm
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, str(os.getpid())), "w"):
            pass


def ranks_started(directory: str) -> bool:
    """Whether a child of this process's has become a rank (:func:`mark_rank`)."""
    try:
        return bool(os.listdir(directory))
    except OSError:
        return False
