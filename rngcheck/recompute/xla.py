"""torch_xla support, the recompute half: torch_xla's own activation checkpointing.

``torch_xla.utils.checkpoint.checkpoint`` (reentrant only) and
``torch_xla.distributed.fsdp.checkpoint_module`` (which calls it) go through the module global
``CheckpointFunction``; while a mode is active a shim stands in for it and marks the first call of
the checkpointed function as the region's forward and later calls as its recompute. Loaded only
when the user has already imported torch_xla.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from .torch_hooks import FunctionShim, Tracker

__all__ = ["XlaCheckpointPatch"]

_CHECKPOINT_MODULE = "torch_xla.utils.checkpoint"


class _CheckpointFunctionShim(FunctionShim):
    """Stands in for torch_xla's ``CheckpointFunction``: marks forward and recompute passes.

    Kind "torch_xla": torch_xla restores the XLA seed of the default device itself, not the
    generators of the arguments' devices as torch.utils.checkpoint does; a recompute that
    continues the forward's seed is blamed on a missing XLA seed restore (the bug of pytorch/xla
    PR 4690), not on a Megatron-style named stream."""

    kind = "torch_xla"
    name = "torch_xla checkpoint"

    def apply(self, function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        run = self.passes(function, preserve_rng_state, args)
        owner = getattr(function, "__self__", None)
        if inspect.ismethod(function) and isinstance(owner, torch.nn.Module):
            # torch_xla's backward puts the module's weights and buffers into the recompute's
            # optimization barrier only when run_function is a bound method of that module
            # (checkpoint_module passes one): keep it one, or the XLA graph would change.
            return self._original.apply(
                types.MethodType(lambda _module, *inner: run(*inner), owner),
                preserve_rng_state,
                *args,
            )
        return self._original.apply(run, preserve_rng_state, *args)


class XlaCheckpointPatch:
    """torch_xla's checkpoint marked for one tracker; ``uninstall`` puts the original back."""

    def __init__(self, tracker: Tracker) -> None:
        self._tracker = tracker
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> XlaCheckpointPatch:
        module: Any = importlib.import_module(_CHECKPOINT_MODULE)  # cheap once torch_xla is in
        original = module.CheckpointFunction
        if isinstance(original, _CheckpointFunctionShim):  # left behind by a crashed mode
            original = original._original
        self._saved.append((module, "CheckpointFunction", original))
        module.CheckpointFunction = _CheckpointFunctionShim(self._tracker, original)
        return self

    def uninstall(self) -> None:
        saved, self._saved = self._saved, []
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
