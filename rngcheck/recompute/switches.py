"""``Module.train()`` and ``Module.eval()`` calls on the modules of checkpointed regions that wait
for their recompute.

A checkpoint recomputes its function with the modules as they are when backward runs. A module
switched to ``eval()`` between the forward and ``loss.backward()`` recomputes without its
dropout (one switched to ``train()`` with it): the recompute runs fewer random ops than the
forward (or more), and the gradients belong to a forward that never ran. The op-by-op comparison
sees only that the counts differ; this module keeps the call that did it, so the cause names it
and its line (a :class:`~rngcheck.core.findings.Culprit`).

Only calls that change the training flag of a module a waiting region holds are kept (the
checkpointed module or one of its submodules, whichever module the call was made on); a region
whose function is no module's (a closure) holds none. ``Module.train``/``eval`` are wrapped while
the tracker is installed and put back on uninstall. They run a few times a step at most (Hugging
Face's Trainer calls ``model.train()`` every step), never per op; with no region waiting, a call
costs a look at the waiting regions.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from torch import nn

from ..core.stacks import Stack
from .region import Region

__all__ = ["ModeSwitches", "Switch", "standing"]

log = logging.getLogger(__name__)


def standing(region: Region) -> Switch | None:
    """The last call that switched ``region``'s modules, if they are not now in the modes they
    ran its forward in (an ``eval()`` undone by ``train()`` before backward changed nothing);
    None when none did."""
    held = region.held() if region.held is not None else None
    if not region.switches or held is None or region.modes is None:
        return None
    modes = region.modes
    if all(modes.get(id(m), m.training) == m.training for m in held.modules()):
        return None
    return region.switches[-1]


class Switch(NamedTuple):
    """A call that switched modules of a waiting region between training and evaluation."""

    call: str  # "Sequential.eval()", "Dropout.train(False)"
    training: bool  # the mode it switched them to
    stack: Stack


class _Depth(threading.local):
    def __init__(self) -> None:
        self.n = 0  # eval() calls train(False), which calls train() on every child


class ModeSwitches:
    """Wraps ``nn.Module.train`` and ``nn.Module.eval`` for one tracker. ``waiting()``: the
    regions whose forward ended and whose recompute has not begun."""

    def __init__(self, waiting: Callable[[], Iterable[Region]]) -> None:
        self._waiting = waiting
        self._depth = _Depth()
        self._saved: list[tuple[str, Any]] = []

    def install(self) -> None:
        if self._saved:
            return
        for name in ("train", "eval"):
            original = nn.Module.__dict__[name]
            self._saved.append((name, original))
            setattr(nn.Module, name, self._wrap(name, original))

    def uninstall(self) -> None:
        saved, self._saved = self._saved, []
        for name, original in reversed(saved):
            setattr(nn.Module, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        switches = self

        def wrapper(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            depth = switches._depth
            if depth.n:  # (eval()'s train(False), train()'s children)
                return original(module, *args, **kwargs)
            depth.n += 1
            try:
                seen = switches._before(module)
                result = original(module, *args, **kwargs)
                if seen is not None:
                    switches._after(name, module, args, kwargs, *seen)
                return result
            finally:
                depth.n -= 1

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__rngcheck_original__ = original  # type: ignore[attr-defined]
        return wrapper

    def _before(self, module: nn.Module) -> tuple[dict[int, bool], list[Region]] | None:
        """The training flags of ``module``'s modules before a call, by id, and the waiting
        regions that hold a module; None when none does (or reading them failed)."""
        try:
            regions = [r for r in self._waiting() if r.held is not None]
            if not regions:
                return None
            return {id(m): m.training for m in module.modules()}, regions
        except Exception:  # noqa: BLE001 - a checker's bug must never reach training
            log.exception("rngcheck could not read a train()/eval() call")
            return None

    def _after(
        self,
        name: str,
        module: nn.Module,
        args: tuple,
        kwargs: dict,
        before: dict[int, bool],
        regions: list[Region],
    ) -> None:
        """Keep the call on every waiting region whose modules it switched (``before``: the
        training flags of ``module``'s modules before the call, by id)."""
        try:
            changed = {id(m) for m in module.modules() if before.get(id(m)) != m.training}
            if not changed:
                return
            training = module.training
            stack: Stack | None = None
            for region in regions:
                held = region.held() if region.held is not None else None
                if held is None or not any(id(m) in changed for m in held.modules()):
                    continue
                if region.modes is None:  # the modes its forward ran in, before the first switch
                    region.modes = {id(m): before.get(id(m), m.training) for m in held.modules()}
                if stack is None:
                    stack = Stack.capture()
                    told = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
                    call = f"{type(module).__name__}.{name}({told})"  # (its line shows which)
                region.switches = (*region.switches, Switch(call, training, stack))
        except Exception:  # noqa: BLE001 - a checker's bug must never reach training
            log.exception("rngcheck could not note a train()/eval() call")
