"""Fresh randomness in a compiled backward: a random op the compiler's partitioner recomputed in
the backward graph without replaying its state (pytorch issue 190758).

A compiled function's forward graph draws its random kernels' seeds once per call; its backward
graph draws none, unless the partitioner chose to recompute a random op there (a memory budget
below 1, a recompute policy) instead of saving its output. If that backward draw starts from the
state the forward's draw started from, the recompute replays the forward's randomness (quiet);
otherwise its dropout mask is not the one the forward applied, and the gradients belong to another
network: a ``recompute_mismatch`` pairing the backward's draw with its forward's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.compiled import CompiledCall
from ..core.events import RandomOpEvent
from ..core.findings import Finding
from .region import Region, mismatch_finding

__all__ = ["CompiledRecomputes", "compiler_settings"]

_MAX_FUNCTIONS = 1024  # compiled functions whose last forward draw is kept


def compiler_settings() -> str:
    """The compiler settings that make the partitioner recompute ops in backward, as text ("" when
    none is set): the memory budget, a recompute-views setting."""
    import torch._functorch.config as functorch_config

    said = []
    budget = getattr(functorch_config, "activation_memory_budget", 1.0)
    if budget < 1.0:
        said.append(f"torch._functorch.config.activation_memory_budget is {budget:g}")
    if getattr(functorch_config, "recompute_views", False):
        said.append("torch._functorch.config.recompute_views is on")
    return "; ".join(said)


class CompiledRecomputes:
    """Pairs each compiled backward's random draw with its compiled forward's, and compares."""

    def __init__(self, emit: Callable[[Finding], None]) -> None:
        self._emit = emit
        self._forward: dict[Any, RandomOpEvent] = {}  # compiled function -> its last forward draw
        self._reported: set[Any] = set()  # compiled functions already reported (one finding each)
        self.stats = {"forward_draws": 0, "backward_draws": 0}

    def on_forward(self, event: RandomOpEvent, call: CompiledCall) -> None:
        self.stats["forward_draws"] += 1
        if call.function is None:
            return
        if len(self._forward) >= _MAX_FUNCTIONS:  # functions compiled afresh in a loop
            self._forward.clear()
        self._forward[call.function] = event

    def on_backward(self, event: RandomOpEvent, call: CompiledCall) -> None:
        """A random draw in a compiled backward graph: compare it with its forward's."""
        self.stats["backward_draws"] += 1
        f = self._forward.get(call.function)
        if f is None or call.function in self._reported or "ignore" in (event.expect, f.expect):
            return
        if event.before is not None and event.before == f.before and event.after == f.after:
            return  # the backward replayed the forward's state: the same numbers
        self._reported.add(call.function)
        where = event.stack.call_site
        region = Region(
            kind="compiled",
            name="compiled backward",
            site=where.short_location if where is not None else event.site,
        )
        region.forward.append(f)
        region.recompute.append(event)
        detail = (
            f"the compiled backward drew from {event.generator.label} again ({event.op}), from "
            "another state than the compiled forward's draw, so the random ops it recomputes "
            "draw different numbers"
        )
        self._emit(
            mismatch_finding(region, 0, f, event, "state", detail, compiled_cause(event, call))
        )


def compiled_cause(event: RandomOpEvent, call: CompiledCall) -> str:
    lines = ", ".join(f"{s.short_location} ({s.line})" for s in call.sources) or "its random ops"
    settings = compiler_settings()
    why = f" ({settings})" if settings else ""
    return (
        "the compiler's partitioner recomputed a random op in the compiled backward instead of "
        f"saving its output{why}, and the recompute draws new random numbers instead of replaying "
        f"the forward's state: the gradients of {lines} belong to a mask the forward never "
        "applied (pytorch issue 190758). Keep random ops out of the recompute: leave "
        "activation_memory_budget at 1.0, or save their outputs in the recompute policy."
    )
