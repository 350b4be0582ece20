"""The one place that knows torch.utils.checkpoint's private names, per torch version, and the
small shims that mark a region's two passes for the tracker.

rngcheck sees a checkpointed region by wrapping the function torch calls for each region, looked
up by name at call time inside torch (so a ``from torch.utils.checkpoint import checkpoint`` done
before the mode started, and Hugging Face's ``functools.partial(checkpoint, ...)``, are covered):

- ``use_reentrant=False``: the generator that drives one region. torch 2.14 moved it to
  ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, preserve_rng_state, ...)``
  (the old positional ``_checkpoint_without_reentrant_generator`` stays as a shim that calls it);
  torch 2.9 to 2.13 call ``_checkpoint_without_reentrant_generator(fn, preserve_rng_state,
  context_fn, determinism_check, debug, early_stop, *args, **kwargs)``. Both are bound through
  their own signature, so one wrapper serves both.
- ``use_reentrant=True``: ``CheckpointFunction.apply(function, preserve_rng_state, *args)``.

:data:`HOOKS` is chosen once, from the running torch's version (:func:`hooks_for`); a name it
expects and does not find is a loud ``RNGCheckCoverageWarning``, never silence. A second net
catches what a future torch might route around these names: :func:`checkpoint_frame_on_stack`
tells whether torch's checkpoint code is running below a random op that no known region claimed
(the mode turns that into the same warning and a report note).
"""

from __future__ import annotations

import inspect
import itertools
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.utils.checkpoint as tuc

from ..core.dispatch import DynamoSkippedMode
from ..core.events import FORWARD, RECOMPUTE, Phase
from ..core.ops import OpKind, classify
from .region import Region, devices_of

__all__ = [
    "HOOKS",
    "TORCH_VERSION",
    "CheckpointHooks",
    "FunctionShim",
    "TorchCheckpointPatches",
    "layout_of",
    "checkpoint_frame_on_stack",
    "hooks_for",
    "two_passes",
]

COMPOSABLE = "torch.distributed._composable.checkpoint_activation"


def _version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


TORCH_VERSION = _version(torch.__version__)


@dataclass(frozen=True, slots=True)
class CheckpointHooks:
    """The names rngcheck wraps in ``torch.utils.checkpoint`` for one range of torch versions."""

    since: tuple[int, int]  # the first torch version these names apply to
    nonreentrant: str  # drives one use_reentrant=False region (a generator function)
    reentrant: str = "CheckpointFunction"  # the autograd.Function of use_reentrant=True


# Newest first: the first entry whose ``since`` is at or below the running torch applies.
_TABLE = (
    CheckpointHooks(since=(2, 14), nonreentrant="_checkpoint_without_reentrant_generator_impl"),
    CheckpointHooks(since=(2, 0), nonreentrant="_checkpoint_without_reentrant_generator"),
)


def hooks_for(version: tuple[int, int]) -> CheckpointHooks:
    """The hook names for a torch version (the version test lives here and nowhere else)."""
    for hooks in _TABLE:
        if version >= hooks.since:
            return hooks
    return _TABLE[-1]


HOOKS = hooks_for(TORCH_VERSION)


@dataclass(frozen=True, slots=True)
class _Layout:
    """The entry's parameters (read once from its signature), so a call is read by position or
    name as torch makes it, without ``inspect`` binding on every region. Both torch layouts:
    up to 2.13 ``(fn, preserve_rng_state=True, context_fn=..., ..., *args, **kwargs)``; from
    2.14 ``(fn, args, kwargs, *, preserve_rng_state=True, context_fn=..., ...)``."""

    position: dict[str, int]  # parameters a call may pass by position
    defaults: dict[str, Any]
    varargs_at: int | None  # where ``*args`` (the region's inputs) starts, when the entry has one
    # Up to 2.13 torch passes every parameter before the inputs by position: where fn,
    # preserve_rng_state, context_fn, debug and early_stop are then, and where the inputs start.
    positional: tuple[int, int, int, int, int, int] | None = None

    @classmethod
    def of(cls, original: Callable[..., Any]) -> _Layout:
        P = inspect.Parameter
        position: dict[str, int] = {}
        defaults: dict[str, Any] = {}
        named: set[str] = set()
        varargs_at: int | None = None
        for p in inspect.signature(original).parameters.values():
            if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
                position[p.name] = len(position)
            elif p.kind is P.VAR_POSITIONAL:
                varargs_at = len(position)
                continue
            elif p.kind is P.VAR_KEYWORD:
                continue
            named.add(p.name)
            if p.default is not P.empty:
                defaults[p.name] = p.default
        wanted: tuple[str, ...] = ("fn", "preserve_rng_state", "context_fn")
        if varargs_at is None:  # torch 2.14: the region's inputs are one tuple named ``args``
            wanted += ("args",)
        for needed in wanted:
            if needed not in named:
                raise TypeError(
                    f"{original!r} has no {needed!r} parameter: torch's checkpoint entry changed "
                    f"its signature to {inspect.signature(original)}"
                )
        names = ("fn", "preserve_rng_state", "context_fn", "debug", "early_stop")
        positional = None
        if varargs_at is not None and all(n in position for n in names):
            fn_at, preserve_at, context_at, debug_at, stop_at = (position[n] for n in names)
            positional = (fn_at, preserve_at, context_at, debug_at, stop_at, varargs_at)
        return cls(position, defaults, varargs_at, positional)

    def read(
        self, args: tuple, kwargs: dict
    ) -> tuple[Callable[..., Any], bool, Any, bool, bool, tuple]:
        """(fn, preserve_rng_state, context_fn, debug, early_stop, the region's input arguments)
        of one call (``debug`` and ``early_stop``: the call's arguments; torch's global switches
        override them; an entry without ``early_stop`` runs every recompute to its end)."""
        fast = self.positional
        if fast is not None and len(args) >= fast[5]:
            fn_at, preserve_at, context_at, debug_at, stop_at, inputs_at = fast
            context_fn = args[context_at]
            return (
                args[fn_at],
                bool(args[preserve_at]),
                context_fn if context_fn is not None else tuc.noop_context_fn,
                bool(args[debug_at]),
                bool(args[stop_at]),
                args[inputs_at:],
            )
        get, defaults = self.get, self.defaults
        context_fn = get("context_fn", args, kwargs)
        return (
            get("fn", args, kwargs),
            bool(get("preserve_rng_state", args, kwargs)),
            context_fn if context_fn is not None else tuc.noop_context_fn,
            "debug" in defaults and bool(get("debug", args, kwargs)),
            "early_stop" in defaults and bool(get("early_stop", args, kwargs)),
            self.inputs(args, kwargs),
        )

    def call(
        self, original: Callable[..., Any], args: tuple, kwargs: dict, fn: Any, context_fn: Any
    ) -> Any:
        """Call ``original`` with the arguments of a call but ``fn`` and ``context_fn``
        replaced."""
        fast = self.positional
        if fast is not None and len(args) >= fast[5]:
            replaced = list(args)
            replaced[fast[0]], replaced[fast[2]] = fn, context_fn
            return original(*replaced, **kwargs)
        new_args, new_kwargs = list(args), dict(kwargs)
        for name, value in (("fn", fn), ("context_fn", context_fn)):
            i = self.position.get(name)
            if i is not None and i < len(new_args):
                new_args[i] = value
            else:
                new_kwargs[name] = value
        return original(*new_args, **new_kwargs)

    def get(self, name: str, args: tuple, kwargs: dict) -> Any:
        i = self.position.get(name)
        if i is not None and i < len(args):
            return args[i]
        return kwargs[name] if name in kwargs else self.defaults[name]

    def inputs(self, args: tuple, kwargs: dict) -> tuple[Any, ...]:
        """The region's input arguments."""
        if self.varargs_at is not None:
            return tuple(args[self.varargs_at :])
        return tuple(self.get("args", args, kwargs))


_LAYOUTS: dict[Any, _Layout] = {}


def layout_of(original: Callable[..., Any]) -> _Layout:
    """How to read a call of the non-reentrant entry ``original`` (read from its own signature
    once; either torch layout)."""
    layout = _LAYOUTS.get(original)
    if layout is None:
        layout = _LAYOUTS[original] = _Layout.of(original)
    return layout


def targets() -> list[tuple[Any, str]]:
    """(owner, attribute) pairs to wrap for the non-reentrant entry: torch.utils.checkpoint's,
    and the composable ``checkpoint(module)``'s copy of the name when that module is loaded
    (importing it here would pull in torch.distributed for every user)."""
    found: list[tuple[Any, str]] = [(tuc, HOOKS.nonreentrant)]
    composable = sys.modules.get(COMPOSABLE)
    if composable is not None and getattr(composable, HOOKS.nonreentrant, None) is getattr(
        tuc, HOOKS.nonreentrant, None
    ):
        found.append((composable, HOOKS.nonreentrant))
    return found


def missing_names() -> list[str]:
    """The hook names this torch should have and does not (an internals change)."""
    return [
        f"torch.utils.checkpoint.{name}"
        for name in (HOOKS.nonreentrant, HOOKS.reentrant)
        if not hasattr(tuc, name)
    ]


# Frames that mean "a checkpointed region is running": the forward (``checkpoint()`` or
# ``_checkpoint_impl`` calls the user's function directly; ``CheckpointFunction.forward``) and the
# recompute (the unpack hook and its ``recompute_fn``; ``CheckpointFunction.backward``).
# Matched by file and function name, not by the names rngcheck wraps, so a torch that routes its
# regions around those wraps is still noticed. ``checkpoint_sequential`` runs its last segment
# unchecked from a closure named ``forward`` in the same file: that one is not a region.
_TORCH_DIR = os.path.dirname(os.path.dirname(tuc.__file__))
_CHECKPOINT_FILES = frozenset(
    {
        tuc.__file__,
        os.path.join(_TORCH_DIR, "distributed", "_composable", "checkpoint_activation.py"),
    }
)
_REGION_FUNCTIONS = frozenset({"checkpoint", "_checkpoint_impl", "unpack_hook", "recompute_fn"})
_REGION_CODES = frozenset(
    getattr(getattr(tuc.CheckpointFunction, name, None), "__code__", None)
    for name in ("forward", "backward")
) - {None}

# torch.compile's checkpoint operator (``tag_activation_checkpoint``), run as captured (a backend
# without AOT autograd), calls torch.utils.checkpoint with preserve_rng_state=False on an FX
# Interpreter's ``run``, or (torch 2.13 on) on a closure of its own around one.
_COMPILE_OPERATOR = frozenset({"torch._higher_order_ops.wrap", "torch.fx.interpreter"})


def checkpoint_frame_on_stack(skip: int = 1) -> bool:
    """Whether a torch checkpoint region is running below the caller, by its frames (a walk of a
    few microseconds, done only for random ops outside every region rngcheck knows)."""
    frame: Any = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        if code.co_filename in _CHECKPOINT_FILES and (
            code.co_name in _REGION_FUNCTIONS or code in _REGION_CODES
        ):
            return True
        frame = frame.f_back
    return False


# -- marking the passes -------------------------------------------------------------------------


class Tracker(Protocol):
    """What the shims need of the recompute tracker."""

    recorded: int
    sees_first: bool  # the selective route: the checker sees a random op before the SAC cache
    probe: Any  # level="step": the generator-state probe (``active`` between sampled steps)

    def new_region(
        self,
        *,
        kind: str,
        preserve_rng_state: bool | None,
        args: tuple = (),
        name: str = "",
        function: Any = None,
        devices: tuple[str, ...] | None = None,
        early_stop: bool = False,
    ) -> Region: ...

    def phase(self, region: Region, phase: Phase) -> Any: ...

    def probed_passes(self, region: Region) -> Callable[[], tuple[Any, Any]]: ...

    def restored_passes(self, function: Any) -> Callable[[], tuple[Any, Any]]: ...

    def record_cached(self, func: Any, args: tuple, kwargs: dict) -> None: ...


def two_passes(tracker: Tracker, region: Region, function: Callable[..., Any]) -> Any:
    """``function`` wrapped so its first call is the region's forward and every later call a
    recompute (reentrant checkpoints, torch_xla's, run their function exactly so)."""
    calls = itertools.count()

    def run(*inner: Any) -> Any:
        phase = FORWARD if next(calls) == 0 else RECOMPUTE
        with tracker.phase(region, phase):
            return function(*inner)

    return run


class TorchCheckpointPatches:
    """torch.utils.checkpoint's entry points wrapped for one tracker; :meth:`uninstall` puts every
    original back (the composable checkpoint's copy too, even one torch imported meanwhile)."""

    def __init__(self, tracker: Tracker) -> None:
        self._tracker = tracker
        self._saved: list[tuple[Any, str, Any]] = []
        self.gaps: list[str] = []  # what this torch does not let rngcheck see (warned loudly)

    def install(self) -> None:
        missing = missing_names()
        if missing:
            self.gaps.append(
                f"torch {torch.__version__} has no {', '.join(missing)}: rngcheck cannot see "
                "these checkpoint regions begin, so their recomputes are not compared"
            )
        original = getattr(tuc, HOOKS.nonreentrant, None)
        layout: _Layout | None = None
        if original is not None:
            try:
                layout = layout_of(original)
            except TypeError as e:  # a torch whose entry reads its call differently
                self.gaps.append(
                    f"torch {torch.__version__}: {e}; rngcheck cannot read these checkpoint "
                    "regions, so their recomputes are not compared"
                )
        if original is not None and layout is not None:
            entry, read = original, layout

            def nonreentrant(*args: Any, **kwargs: Any) -> Iterator[None]:
                return self._nonreentrant(entry, read, args, kwargs)

            for owner, name in targets():
                self._patch(owner, name, nonreentrant)
        reentrant = getattr(tuc, HOOKS.reentrant, None)
        if reentrant is not None:
            self._patch(tuc, HOOKS.reentrant, FunctionShim(self._tracker, reentrant))

    def uninstall(self) -> None:
        saved, self._saved = self._saved, []
        for owner, name, original in reversed(saved):
            replacement = getattr(owner, name, None)
            setattr(owner, name, original)
            # torch imports the composable checkpoint lazily, from inside a checkpoint call: if
            # that happened while we were installed, it copied our wrapper by name and would keep
            # it (and this tracker) forever. Hand it the original too.
            if owner is tuc:
                copy = sys.modules.get(COMPOSABLE)
                if copy is not None and getattr(copy, name, None) is replacement:
                    setattr(copy, name, original)

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _nonreentrant(
        self, original: Callable[..., Any], layout: _Layout, args: tuple, kwargs: dict
    ) -> Iterator[None]:
        tracker = self._tracker
        fn, preserve, context_fn, debug, early_stop, inputs = layout.read(args, kwargs)
        switch = getattr(tuc, "_enable_checkpoint_early_stop", None)  # torch's, read as it does
        early_stop = early_stop if switch is None else bool(switch)
        devices = devices_of(inputs)
        probe = tracker.probe
        probed = None
        if (
            probe is not None
            and probe.active
            and context_fn is tuc.noop_context_fn
            and not _torch_contexts(debug)
        ):
            # Between sampled steps (level="step"): torch's own forward and recompute contexts
            # mark the two passes, with no generator or function of rngcheck's around torch's
            # (a third of a region's cost there). torch enters neither under no_grad, where
            # nothing is recomputed.
            if preserve and early_stop and probe.left_to_torch(devices):
                # torch restores its one generator and stops its recompute early: no state
                # would show a thing, so none is read and no region is made (the passes are
                # still marked: a recompute run op by op is given its region).
                return layout.call(original, args, kwargs, fn, tracker.restored_passes(fn))
            probed = tracker.probed_passes
        region = tracker.new_region(
            kind="non-reentrant",
            preserve_rng_state=preserve,
            function=fn,
            devices=devices,
            early_stop=early_stop,
        )
        if preserve is False and getattr(fn, "__module__", None) in _COMPILE_OPERATOR:
            region.by_compile = True
        if probed is not None:
            return layout.call(original, args, kwargs, fn, probed(region))
        return self._around(original, layout, args, kwargs, region, fn, context_fn)

    def _around(
        self,
        original: Callable[..., Any],
        layout: _Layout,
        args: tuple,
        kwargs: dict,
        region: Region,
        fn: Callable[..., Any],
        context_fn: Any,
    ) -> Iterator[None]:
        """torch's generator for one region, its forward and its function's recomputes marked
        from outside (so every context_fn, debug=True and traced code keep working)."""
        tracker = self._tracker

        def recompute_fn(*inner: Any, **kw: Any) -> Any:
            with tracker.phase(region, RECOMPUTE):
                return fn(*inner, **kw)

        if context_fn is not tuc.noop_context_fn:
            region.selective = True
            # The selective route sees each op before the cache and tells a cached answer by
            # the generator that did not move: no observer there.
            if not torch.compiler.is_compiling() and not tracker.sees_first:
                user_context_fn = context_fn

                def context_fn() -> tuple[Any, Any]:
                    forward_ctx, recompute_ctx = user_context_fn()
                    return forward_ctx, _ObservedRecompute(recompute_ctx, tracker)

        inner = layout.call(original, args, kwargs, recompute_fn, context_fn)
        with tracker.phase(region, FORWARD):
            yield from inner


_dispatch_mode = torch._C._get_dispatch_mode
_PROXY = torch._C._TorchDispatchModeKey.PROXY


def _torch_contexts(debug: bool) -> bool:
    """Whether torch wants a call's contexts its own way: its checkpoint debug mode (its global
    switch, else the call's ``debug``) brings its own context_fn, and while torch traces the
    call (torch.compile, export) a context_fn must give dispatch modes (torch's own test, and
    the flag behind ``torch.compiler.is_compiling()``, read directly: this runs every region)."""
    enabled = getattr(tuc, "_checkpoint_debug_enabled", None)
    return (
        (debug if enabled is None else bool(enabled))
        or _dispatch_mode(_PROXY) is not None
        or (getattr(torch.compiler, "_is_compiling_flag", True) and torch.compiler.is_compiling())
    )


class FunctionShim:
    """Stands in for an autograd ``CheckpointFunction`` (torch's reentrant checkpoint, torch_xla's)
    so that its first call of the function is a region's forward and later calls recomputes."""

    kind = "reentrant"
    name = ""

    def __init__(self, tracker: Tracker, original: Any) -> None:
        self._tracker = tracker
        self._original = original

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)

    def passes(self, function: Callable[..., Any], preserve: bool, args: tuple) -> Any:
        """``function`` wrapped for a new region (see :func:`two_passes`)."""
        region = self._tracker.new_region(
            kind=self.kind,
            preserve_rng_state=bool(preserve),
            args=args,
            name=self.name,
            function=function,
        )
        return two_passes(self._tracker, region, function)

    def apply(self, function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        run = self.passes(function, preserve_rng_state, args)
        return self._original.apply(run, preserve_rng_state, *args)


class _ObservedRecompute:
    """A selective-checkpoint recompute context with an observer on top that sees cached ops."""

    def __init__(self, inner: Any, tracker: Tracker) -> None:
        self._inner = inner
        self._observer = _CacheObserver(tracker)

    def __enter__(self) -> Any:
        result = self._inner.__enter__()
        try:
            self._observer.__enter__()
        except BaseException:
            self._inner.__exit__(None, None, None)
            raise
        return result

    def __exit__(self, *exc: Any) -> Any:
        try:
            self._observer.__exit__(*exc)
        except BaseException:
            self._inner.__exit__(*exc)  # the inner context is left however the observer fails
            raise
        return self._inner.__exit__(*exc)


class _CacheObserver(DynamoSkippedMode):
    """Notes random ops that a mode between it and rngcheck's mode answered without running.

    Selective checkpointing serves saved ops from a cache above rngcheck's dispatch mode, where
    they would not be seen; this observer sits on top of the recompute context and tells the
    tracker about each random op that reached it but not rngcheck's mode."""

    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if classify(func) is not OpKind.RANDOM:
            return func(*args, **kwargs)
        seen = self._tracker.recorded
        out = func(*args, **kwargs)
        if self._tracker.recorded == seen:
            self._tracker.record_cached(func, args, kwargs)
        return out
