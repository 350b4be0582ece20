"""The two routes by which the checker sees ops, and the choice between them. Either only
intercepts: everything it sees that is not plain compute (a random op, a collective) goes to the
one callback its owner gave it; the owner keeps the results.

- ``selective`` (``core/selective.py``): kernels for the random ops and collectives only, at a
  dispatch key the checker includes while it runs; every other op costs nothing.
- ``dispatch_mode`` (:class:`Interceptor` here): a ``TorchDispatchMode``, which sees every op; a
  non-random op costs one dict lookup over a no-op dispatch mode
  (:data:`~rngcheck.core.ops.KINDS`), and a dispatch mode's Python call.

``route="auto"`` (the default) takes the selective route where this torch serves it, unless the
``RNGCHECK_ROUTE`` variable names a route for every checker of the process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from types import CodeType, FunctionType
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _pop_mode_temporarily,
)

from .config import ROUTES
from .ops import KINDS, OpKind

__all__ = [
    "DynamoSkippedMode",
    "Intercepting",
    "Interceptor",
    "choose_route",
    "make_interceptor",
    "unseen",
]

if TYPE_CHECKING:
    from .selective import SelectiveInterceptor

OnSpecial = Callable[[OpKind, Any, tuple, dict], Any]


def _dynamo_skipper() -> Callable[[CodeType], None] | None:
    """Marks a code object so that Dynamo never compiles its frames nor any frame they call
    (``FrameExecStrategy(SKIP, SKIP)``, read by the C frame evaluator); None on a torch without
    it. What ``torch._disable_dynamo`` gives ``__torch_dispatch__`` (torch wraps every mode's
    in it by default), at no cost per call: that wrapper's Python layers, paid by every op
    that reaches the mode, cost the benchmark's d=32 training step about 5% of its time."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )

        skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
        set_code_exec_strategy((lambda: None).__code__, skip)  # (a build without Dynamo)
    except Exception:
        return None

    def mark(code: CodeType) -> None:
        set_code_exec_strategy(code, skip)

    return mark


_SKIP_DYNAMO = _dynamo_skipper()


class DynamoSkippedMode(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` Dynamo never compiles, marked once on its code
    object instead of wrapped per call (torch's wrapper where the mark is missing, or where the
    method is not a plain function of its own whose code can carry it)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch asks while it makes a subclass (its __init_subclass__), and wraps when True.
        own = cls.__dict__.get("__torch_dispatch__")
        return _SKIP_DYNAMO is None or (own is not None and not isinstance(own, FunctionType))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        own = cls.__dict__.get("__torch_dispatch__")
        super().__init_subclass__(**kwargs)
        # Marked only as written and left unwrapped: a wrapper's code (torch's own is shared by
        # every torch._disable_dynamo) must never be marked.
        unwrapped = cls.__dict__.get("__torch_dispatch__") is own
        if _SKIP_DYNAMO is not None and unwrapped and isinstance(own, FunctionType):
            _SKIP_DYNAMO(own.__code__)


class Interceptor(DynamoSkippedMode):
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

    def heal(self) -> bool:
        """(The selective route's: nothing takes this mode off the stack behind its back.)"""
        return False

    def leave_forked_child(self) -> None:
        """In a forked child (a DataLoader worker), which inherited the dispatch stack: off it."""
        stack = _get_current_dispatch_mode_stack()
        if stack and stack[-1] is self:
            _pop_mode()
        self.suspended = True

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


_KEY_OF_SELECTIVE = torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch)


@contextlib.contextmanager
def unseen() -> Iterator[None]:
    """The checker's own ops (its exchanges' collectives, its digests' reads): seen by neither
    route (nor by any other dispatch mode or tensor subclass), wherever they run: inside the
    callback or from an optimizer-step hook, where the selective route's key is still included."""
    with torch._C._DisableTorchDispatch(), torch._C._ExcludeDispatchKeyGuard(_KEY_OF_SELECTIVE):
        yield


Intercepting: TypeAlias = "Interceptor | SelectiveInterceptor"  # either route's interceptor


def choose_route(route: str) -> tuple[str, str]:
    """The route a checker asked for as ``route`` takes, and why when that is not what it asked
    (or, for "auto", why not the selective one): ``("selective", "")``, or
    ``("dispatch_mode", "torch 2.x lacks ...")``."""
    if route == "auto":
        named = os.environ.get("RNGCHECK_ROUTE", "").strip()
        if named:
            if named not in ROUTES:
                raise ValueError(
                    f"RNGCHECK_ROUTE={named!r} is not a route; expected one of "
                    f"{', '.join(ROUTES)} (auto: selective where this torch serves it), or unset"
                )
            route = named
    if route == "dispatch_mode":
        return route, ""
    from .selective import unavailable

    why = unavailable()
    if not why:
        return "selective", ""
    if route == "selective":
        raise RuntimeError(
            f"route='selective' cannot serve here: {why}. Use route='auto', which takes the "
            "dispatch-mode route where the selective one cannot serve"
        )
    return "dispatch_mode", why


def make_interceptor(route: str, on_special: OnSpecial) -> Intercepting:
    """The interceptor of a chosen route (:func:`choose_route`)."""
    if route == "selective":
        from .selective import SelectiveInterceptor

        return SelectiveInterceptor(on_special)
    return Interceptor(on_special)
