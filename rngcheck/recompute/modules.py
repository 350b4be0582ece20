"""Which layer a checkpointed call runs: the module's qualified name and class
(``model.layers.3 (LlamaDecoderLayer)``), since every Hugging Face layer enters its checkpoint
from the same line of the same wrapper and the line alone does not tell them apart."""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

from torch import nn

__all__ = ["ModuleNames"]

_MAX_UNWRAP = 8  # partials and bound methods around the module (HF: partial(super().__call__))
_MAX_FRAMES = 64  # frames walked up to the outermost module of a forward
# Attributes by which torch's wrappers hold the module they wrap (checkpoint_wrapper, FSDP1,
# torch.compile): left out of a layer's name, which is then the one the user's model gives it.
_WRAPPED = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})


def _user_name(name: str) -> str:
    """``model.layers.1._checkpoint_wrapped_module`` -> ``model.layers.1``."""
    parts = name.split(".")
    if _WRAPPED.isdisjoint(parts):
        return name
    return ".".join(p for p in parts if p not in _WRAPPED)


class ModuleNames:
    """Names of modules as the outermost module running them calls them (``named_modules()``),
    found once per model and cached weakly: a region's name costs a dict lookup after the first
    step."""

    def __init__(self) -> None:
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # id(module) -> (a weak reference to it, its description): checked by identity.
        self._described: dict[int, tuple[weakref.ReferenceType[nn.Module], str]] = {}

    def describe(self, function: Any) -> str:
        """``"model.layers.3 (LlamaDecoderLayer)"`` when ``function`` is (a wrapper of) a module
        or one of its methods; ``""`` when it is not."""
        return self.held(function)[1]

    def held(self, function: Any) -> tuple[weakref.ReferenceType[nn.Module] | None, str]:
        """A weak reference to the module ``function`` runs (None when it runs none) and what
        :meth:`describe` says of it: the module a checkpointed region holds."""
        # (checkpoint(layer, x): no unwrapping)
        module = function if isinstance(function, nn.Module) else _module_of(function)
        if module is None:
            return None, ""
        known = self._described.get(id(module))  # a dict lookup: no weakref made to ask
        if known is not None and known[0]() is module:
            return known
        name = self._names.get(module)
        if name is None:
            self._learn(module)
            name = self._names.setdefault(module, "")  # "": not in a model (asked once)
        cls = type(module).__name__
        text = f"{name} ({cls})" if name else cls
        if len(self._described) > 65536:
            self._described.clear()
        known = self._described[id(module)] = (weakref.ref(module), text)
        return known

    def known(self, function: Any) -> str:
        """What :meth:`describe` said of ``function``'s module, if it was asked before; else
        ``""`` (nothing is learned: from backward's frames a module's model is not found)."""
        module = function if isinstance(function, nn.Module) else _module_of(function)
        known = self._described.get(id(module)) if module is not None else None
        return known[1] if known is not None and known[0]() is module else ""

    def _learn(self, module: nn.Module) -> None:
        """Name every module of the outermost module on the stack that contains ``module``."""
        frame: Any = sys._getframe(2)
        outer: list[nn.Module] = []
        for _ in range(_MAX_FRAMES):
            if frame is None:
                break
            owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
            if isinstance(owner, nn.Module) and owner not in outer:
                outer.append(owner)
            frame = frame.f_back
        for root in reversed(outer):  # the outermost first
            if root in self._roots:
                continue
            found = False
            for name, m in root.named_modules():
                if m is module:
                    found = True
                self._names.setdefault(m, _user_name(name))
            self._roots.add(root)
            if found:
                return


def _module_of(function: Any) -> nn.Module | None:
    obj = function
    for _ in range(_MAX_UNWRAP):
        if isinstance(obj, nn.Module):
            return obj
        if isinstance(obj, functools.partial):
            # partial(forward, self, ...): HF's layers pass the module as the first argument.
            first = obj.args[0] if obj.args else None
            obj = first if isinstance(first, nn.Module) else obj.func
        elif hasattr(obj, "__self__"):  # a bound method: module.forward, super().__call__
            obj = obj.__self__
        elif hasattr(obj, "__wrapped__"):
            obj = obj.__wrapped__
        else:
            return None
    return None
