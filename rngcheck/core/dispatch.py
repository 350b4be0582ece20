"""The private dispatch mode: it only intercepts. Everything it sees that is not plain compute (a
random op, a collective) goes to the one callback its owner gave it; the owner keeps the results.

A non-random op costs one dict lookup over a no-op dispatch mode (:data:`~rngcheck.core.ops.KINDS`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode_temporarily,
)

from .ops import KINDS, OpKind

__all__ = ["Interceptor"]

OnSpecial = Callable[[OpKind, Any, tuple, dict], Any]


class Interceptor(TorchDispatchMode):
    """Hands random ops and collectives to ``on_special(kind, func, args, kwargs)``, which runs
    them; every other op runs as it came."""

    # Higher-order operators come through too (a compiled graph running outside inductor's graph
    # hook runs its functionalised random ops as run_and_save_rng_state / run_with_rng_state):
    # the random ones are checked, the others run as they came.
    supports_higher_order_operators = True

    def __init__(self, on_special: OnSpecial) -> None:
        super().__init__()
        self._on_special = on_special
        self.suspended = False  # off the dispatch stack between sampled steps (level="step")

    def suspend(self) -> bool:
        """Leave the dispatch stack until :meth:`resume` (ops then cost nothing here). Only from
        the top of the stack: under another mode it stays, and returns False."""
        if self.suspended:
            return True
        stack = _get_current_dispatch_mode_stack()
        if not stack or stack[-1] is not self:
            return False
        super().__exit__(None, None, None)  # torch's own exit: its mode flags restored too
        self.suspended = True
        return True

    def resume(self) -> None:
        """Back on top of the dispatch stack."""
        if self.suspended:
            self.suspended = False
            super().__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.suspended:  # already off the stack
            self.suspended = False
            return
        super().__exit__(exc_type, exc, tb)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile compiles and runs under this mode as it would without it (otherwise dynamo
        # falls back to eager, and the run checked is not the run that trains); what the compiled
        # artifact dispatches at run time, its seed draws among them, still reaches the mode.
        return True

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[bool]:
        """Take this mode off the dispatch stack for the block, when it is on top: yields True.
        Under another mode it stays (yields False), and the block's ops come through as usual."""
        stack = _get_current_dispatch_mode_stack()
        if not stack or stack[-1] is not self:
            yield False
            return
        with _pop_mode_temporarily():
            yield True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kind = KINDS[func]
        if not kind:
            return func(*args, **(kwargs or {}))
        return self._on_special(kind, func, args, kwargs or {})
