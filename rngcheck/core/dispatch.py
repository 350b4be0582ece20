"""The private dispatch mode: it only intercepts. Everything it sees that is not plain compute (a
random op, a collective) goes to the one callback its owner gave it; the owner keeps the results.

A non-random op costs one dict lookup over a no-op dispatch mode (:data:`~rngcheck.core.ops.KINDS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from .ops import KINDS, OpKind

__all__ = ["Interceptor"]

OnSpecial = Callable[[OpKind, Any, tuple, dict], Any]


class Interceptor(TorchDispatchMode):
    """Hands random ops and collectives to ``on_special(kind, func, args, kwargs)``, which runs
    them; every other op runs as it came."""

    def __init__(self, on_special: OnSpecial) -> None:
        super().__init__()
        self._on_special = on_special

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kind = KINDS[func]
        if not kind:
            return func(*args, **(kwargs or {}))
        return self._on_special(kind, func, args, kwargs or {})
