"""Library functions known by their code objects, so that a walk of the live frames can tell, one
dict lookup a frame, that a random op runs inside one of them (a sampler's ``__iter__``, a
communication hook). A frame runs one code object exactly: a subclass that overrides the method
runs its own, and is not taken for the library's."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from types import CodeType
from typing import Generic, TypeVar

__all__ = ["KnownCode"]

V = TypeVar("V")


class KnownCode(Generic[V]):
    """``entries``: (a module, a function's qualified name in it: ``"Class.method"`` or a module's
    function) -> what to say of a frame running it. :meth:`table` resolves them as their modules
    are imported; a function a version lacks stays unknown."""

    def __init__(self, entries: Mapping[tuple[str, str], V]) -> None:
        self._entries = dict(entries)
        # Keyed by id(): a code object hashes and compares by its contents (recursively: a
        # module's code hashes every function in it), and a frame runs this very object. Kept
        # alive in _held.
        self._codes: dict[int, V] = {}
        self._held: list[CodeType] = []
        self._waiting = {module for module, _ in self._entries}  # modules not imported yet

    def table(self) -> dict[int, V]:
        """The code objects (by id) of the known functions whose modules are imported by now (one
        that is being imported is tried again at the next call). Safe on several threads at once:
        the worst is one resolved twice, alike."""
        for module in tuple(self._waiting):
            mod = sys.modules.get(module)
            if mod is None or getattr(getattr(mod, "__spec__", None), "_initializing", False):
                continue
            for (where, qualname), entry in self._entries.items():
                if where != module:
                    continue
                owner, _, name = qualname.rpartition(".")
                if owner:  # the class's own function (not one it inherits), as a frame of it runs
                    cls = getattr(mod, owner, None)
                    func = vars(cls).get(name) if isinstance(cls, type) else None
                else:  # a module's function
                    func = vars(mod).get(name)
                # (the function itself, should a version wrap it: a wrapper's code is shared)
                code = getattr(inspect.unwrap(func) if func is not None else None, "__code__", None)
                if isinstance(code, CodeType):
                    self._held.append(code)
                    self._codes[id(code)] = entry
            self._waiting.discard(module)
        return self._codes
