"""Run callbacks right after one of a few named modules is imported, before the importing code
can use what it defines: how rngcheck patches a class whose module the program imports after the
mode started (``from torch.distributed.fsdp import FullyShardedDataParallel`` inside a function,
as accelerate does).

One finder, first on ``sys.meta_path`` while anything is watched, answers for the watched names
only: it asks the other finders for the module's spec and puts a loader in front of theirs that
runs the module, gives the module its own loader back, then calls the callbacks. Every other
import costs one set lookup. (A finder another package puts in front of it later, and that
answers for a watched name itself, goes around it: the wrappers are then patched at the mode's
next refresh.)
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["watch_imports"]

log = logging.getLogger(__name__)

Callback = Callable[[str], None]


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the callbacks."""

    def __init__(self, loader: Any, finder: _Finder) -> None:
        self.loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def __getattr__(self, name: str) -> Any:
        # The rest of the module's loader (get_filename, get_code, is_package, get_source,
        # get_resource_reader), for who asks the spec's loader before the import (runpy).
        return getattr(self.loader, name)

    def exec_module(self, module: Any) -> None:
        # The module keeps its own loader (importlib.resources and inspect read it).
        if getattr(module, "__loader__", None) in (None, self):
            module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        self.loader.exec_module(module)
        self._finder.imported(spec.name if spec is not None else module.__name__)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asking = threading.local()  # the names this thread is finding now
        self._watches: dict[int, tuple[frozenset[str], Callback]] = {}
        self._names: frozenset[str] = frozenset()
        self._next = 0

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self._names:
            return None
        asking: set[str] = self._asking.__dict__.setdefault("names", set())
        if fullname in asking:  # another finder asked the import system again: answer once
            return None
        asking.add(fullname)
        try:
            for finder in list(sys.meta_path):  # the others' answer, as import would ask them
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is None:
                    continue
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec  # (a namespace package, an old-style loader: as it is)
            return None
        finally:
            asking.discard(fullname)

    def imported(self, name: str) -> None:
        with self._lock:
            callbacks = [cb for names, cb in self._watches.values() if name in names]
        for callback in callbacks:
            try:
                callback(name)
            except Exception:  # noqa: BLE001 - the user's import must never fail through us
                log.exception("rngcheck: the post-import hook for %s failed", name)

    def add(self, names: frozenset[str], callback: Callback) -> Callable[[], None]:
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._watches[key] = (names, callback)
            self._update()

        def remove() -> None:
            with self._lock:
                self._watches.pop(key, None)
                self._update()

        return remove

    def _update(self) -> None:
        self._names = frozenset().union(*(names for names, _ in self._watches.values()))
        if self._names and self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        elif not self._names and self in sys.meta_path:
            sys.meta_path.remove(self)


_FINDER = _Finder()


def watch_imports(names: Iterable[str], callback: Callback) -> Callable[[], None]:
    """Call ``callback(name)`` right after any of the modules ``names`` is imported (executed);
    returns the function that stops watching."""
    return _FINDER.add(frozenset(names), callback)
