"""What the integrations' hooks learnt of the program while a rank checker runs: the data-parallel
wrappers and pipeline stages it built, the scopes open on each thread (a wrapper's forward, a
``generate()`` call, a region that broadcasts from one rank, torch's ``Join``), and the wrapper
whose backward runs now. ``hooks.py`` writes it; ``scopes.py`` reads it to judge a random op."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from .integrations.records import Wrapper

__all__ = ["Program", "Sampling", "optimizer_parameters"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Sampling:
    """A ``generate()`` call on a model no known wrapper wraps, running on this thread."""

    label: str  # the model's class ("LlamaForCausalLM")
    drew: bool = False  # its first random op was seen (compared as the call)


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[Wrapper] = []  # the wrappers whose forward runs, innermost last
        # the rank each broadcast region entered broadcasts from (None: it broadcasts nothing),
        # with the region's hook
        self.modifiers: list[tuple[int | None, Any]] = []
        self.generating: list[Wrapper] = []  # the wrappers whose modules are in generate()
        self.sampling: list[Sampling] = []  # generate() calls on models no wrapper wraps
        self.joins: list[Any] = []  # the enabled torch Joins entered on this thread


class Program:
    """The program's data-parallel structure, as the hooks saw it (one per rank checker)."""

    def __init__(self) -> None:
        self.local = _Local()
        self.known: weakref.WeakKeyDictionary[Any, Wrapper] = weakref.WeakKeyDictionary()
        self.wrappers: list[Wrapper] = []  # every wrapper seen, in order
        self.stages: weakref.WeakSet[Any] = weakref.WeakSet()  # pipeline stages built or run
        self.backward: Wrapper | None = None  # the wrapper whose forward ran last
        self.chained = False  # a wrapper whose hook chains its backward's collectives ran

    # -- the scope of a random op ----------------------------------------------------------------

    def current(self, in_backward: bool) -> Wrapper | None:
        """The innermost wrapper whose forward runs on this thread; in backward, the one whose
        forward ran last (until the optimizer step): a recompute belongs to it too."""
        stack = self.local.stack
        if stack:
            return stack[-1]
        return self.backward if in_backward else None

    def generating(self) -> Wrapper | None:
        """The wrapper whose module is in ``generate()`` on this thread, or None."""
        generating = self.local.generating
        return generating[-1] if generating else None

    def sampling(self) -> Sampling | None:
        """The outermost ``generate()`` call on a model no known wrapper wraps running on this
        thread (a model's own calls inside it are part of it), or None."""
        calls = self.local.sampling
        return calls[0] if calls else None

    def modifier(self) -> tuple[int, Any] | None:
        """The rank the innermost broadcast region entered on this thread broadcasts from, and
        its hook, or None (none, or one that broadcasts nothing: what it draws is compared, as
        outside)."""
        modifiers = self.local.modifiers
        if not modifiers:
            return None
        rank, hook = modifiers[-1]
        return (rank, hook) if rank is not None else None

    def in_chained_backward(self, in_backward: bool) -> bool:
        """Whether this thread runs backward after the forward, since the last step, of a
        wrapper whose communication hook chains its collectives through futures: each rank's
        thread then sees as many of them as their timing allows (every rank decides it from
        the order its program ran in)."""
        return self.chained and in_backward

    @property
    def data_parallel(self) -> bool:
        """Whether this process runs data-parallel training (a wrapper was built or ran)."""
        return bool(self.wrappers)

    def add(self, module: Any, wrapper: Wrapper) -> bool:
        """Know ``module`` as ``wrapper``'s; True when the wrapper is new."""
        self.known[module] = wrapper
        for stage in wrapper.stages:
            self.stages.add(stage)
        if wrapper in self.wrappers:
            return False
        self.wrappers.append(wrapper)
        return True

    def wrapping(self, model: Any) -> Wrapper | None:
        """The known wrapper whose module ``model`` is (or that ``model`` is: ``fully_shard``),
        also through ``torch.compile`` (accelerate's ``unwrap_model`` returns the original)."""
        try:
            own = self.known.get(model)
            if own is not None:
                return own
            for module, wrapper in list(self.known.items()):
                inner = getattr(module, "module", None)
                if inner is model or getattr(inner, "_orig_mod", None) is model:
                    return wrapper
        except Exception:  # noqa: BLE001 - never break the user's call: compared, then
            log.debug("rngcheck could not tell which wrapper is generating", exc_info=True)
        return None

    def on_step(self) -> None:
        self.backward = None
        self.chained = False

    def clear(self) -> None:
        local = self.local
        for stack in (local.stack, local.modifiers, local.generating, local.sampling):
            stack.clear()
        local.joins.clear()
        self.backward = None
        self.chained = False

    # -- what trains where -----------------------------------------------------------------------

    def trains(self, optimizer: Any, known: Collection[Any] = ()) -> bool:
        """Whether ``optimizer`` steps a parameter of a known wrapper's module or of a pipeline
        stage this rank holds (by identity: DeepSpeed's engine steps flat copies, never these),
        or one of ``known`` (parameters read so before)."""
        params = optimizer_parameters(optimizer)
        if known and any(p in known for p in params):
            return True
        try:
            mine = {id(p) for p in params}
            modules = [*self.known.keys(), *(s.submod for s in list(self.stages))]
            return any(
                id(p) in mine
                for module in modules
                if hasattr(module, "parameters")
                for p in module.parameters()
            )
        except Exception:  # noqa: BLE001 - an optimizer or wrapper of another shape: not known
            log.debug("rngcheck could not read a wrapper's parameters", exc_info=True)
            return False

    def stage_holding(self, parameter: Any) -> str:
        """The pipeline stage whose module holds ``parameter`` ("pipeline stage 1 of 4"), or
        ""."""
        for stage in list(self.stages):
            try:
                if any(p is parameter for p in stage.submod.parameters()):
                    return f"pipeline stage {stage.stage_index} of {stage.num_stages}"
            except Exception:  # noqa: BLE001 - a stage torch changed: compared, as before
                log.debug("rngcheck could not read a pipeline stage's module", exc_info=True)
        return ""


def optimizer_parameters(optimizer: Any) -> list[Any]:
    """An optimizer's parameters (none when it holds them in another shape)."""
    try:
        return [p for group in optimizer.param_groups for p in group["params"]]
    except Exception:  # noqa: BLE001 - an optimizer of another shape: not known
        log.debug("rngcheck could not read an optimizer's parameters", exc_info=True)
        return []
