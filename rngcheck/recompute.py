"""Checkpoint regions: the random ops of a region's forward, compared op by op with its recompute.

How regions are found, without the user changing a line: ``torch_checkpoint.py`` names the
functions torch calls for each checkpointed region (per torch version) and this tracker wraps them.
- ``use_reentrant=False``: the generator that drives one region; the forward is the span between
  its first and last step and the recompute is the ``fn`` it calls back from backward.
- ``use_reentrant=True``: ``CheckpointFunction.apply(function, ...)``; a shim's wrapped
  ``function`` knows its first call is the forward and any later call the recompute.
Both are looked up by name at call time inside torch, so ``from torch.utils.checkpoint import
checkpoint`` done before the mode started is covered too, and so is ``checkpoint_sequential``.
torch.distributed's composable ``checkpoint(module)`` holds its own copy of the generator's name;
it is patched when loaded, and handed the original back on exit even when torch imported it
(lazily, from inside a checkpoint call) while we were installed.
Selective checkpointing serves saved ops from a cache above our dispatch mode, where we would not
see them; an observer mode stacked on top of its recompute context notes each op it swallows.

Custom checkpoint functions (Megatron's, DeepSpeed's, torch_xla's, hand-written) mark their two
passes with :func:`checkpoint_region`.

Each recompute op is compared with the forward's op at the same position: op, arguments,
generator, state before, output digest. The first difference is one finding per region (a nested
region replaying an op its outer region already reported is not reported again), with a likely
cause worked out from what the two events and their out-of-band seeding calls show.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as tuc
from torch.utils._python_dispatch import TorchDispatchMode

from . import torch_checkpoint
from .events import Phase, RandomOpEvent
from .ops import OpKind, classify
from .recompute_causes import control_flow_cause, first_difference, likely_cause
from .report import Finding, FindingKind, Side
from .stacks import user_site

__all__ = ["CheckpointRegion", "RecomputeTracker", "checkpoint_region"]

# Past this many random ops in one region's forward we stop recording it and compare only the
# recorded prefix: memory stays bounded even for a region that wraps a whole model with
# per-element random ops.
_MAX_REGION_OPS = 100_000
_MAX_REPORTED = 4096
_region_numbers = itertools.count(1)


@dataclass(eq=False, slots=True, kw_only=True)
class Region:
    """One checkpointed call: its forward's random ops and, once backward runs, its recompute's."""

    number: int
    kind: str  # "non-reentrant", "reentrant", or "custom"
    name: str
    site: str  # "train.py:40": the user's line that entered the region
    preserve_rng_state: bool | None = True  # None: unknown (custom checkpoint functions)
    devices: tuple[str, ...] = ()  # device types of the tensor arguments (what torch stashes)
    forward: list[RandomOpEvent] = field(default_factory=list)
    recompute: list[RandomOpEvent] = field(default_factory=list)
    failed: bool = False  # a mismatch was reported: do not report this region again
    truncated: bool = False

    @property
    def title(self) -> str:
        return f"{self.name} ({self.kind}) at {self.site}"


class _Local(threading.local):
    def __init__(self) -> None:
        self.active: list[tuple[Region, Phase]] = []


class RecomputeTracker:
    """Keeps the active regions of each thread and compares recomputes with their forwards."""

    def __init__(self, emit: Callable[[Finding], None]) -> None:
        self._emit = emit
        self._local = _Local()
        self._saved: list[tuple[Any, str, Any]] = []
        # The seq of each recompute op a finding was about. A reentrant outer recompute replays
        # its inner checkpoint's forward; when the outer already reported the op that replay
        # drew, the inner region comparing against that same op is the same bug, not a new one.
        self._reported: set[int] = set()
        self.recorded = 0  # random ops recorded by the main mode (the SAC observer watches it)
        # False once the mode has exited: a region whose forward ran inside the mode may
        # recompute after it (backward outside the `with`); with no ops recorded any more, that
        # recompute must not be compared, or it would look like it ran no random op at all.
        self.live = False
        # Why some checkpoint regions cannot be seen on this torch (the mode warns and notes).
        self.coverage_gaps: list[str] = []

    # -- state queried on the hot path of random ops -------------------------------------------

    def active(self) -> bool:
        return bool(self._local.active)

    def in_recompute(self) -> bool:
        return any(phase is Phase.RECOMPUTE for _, phase in self._local.active)

    def innermost(self) -> str:
        # The title, with the user's line: cheap now that a region finds its site by a frame
        # walk when it is made (summarising a captured stack here cost ~45 us per region).
        active = self._local.active
        return active[-1][0].title if active else ""

    # -- installing the hooks into torch.utils.checkpoint ---------------------------------------

    def install(self) -> None:
        """Wrap torch's checkpoint entry points (see ``torch_checkpoint.py`` for which names, per
        torch version). A name this torch lacks is warned about loudly, never skipped silently."""
        self.live = True
        missing = torch_checkpoint.missing_names()
        if missing:
            self.coverage_gaps.append(
                f"torch {torch.__version__} has no {', '.join(missing)}: rngcheck cannot see "
                "these checkpoint regions begin, so their recomputes are not compared"
            )
        hooks = torch_checkpoint.HOOKS
        original = getattr(tuc, hooks.nonreentrant, None)
        if original is not None:

            def nonreentrant(*args: Any, **kwargs: Any) -> Iterator[None]:
                return self._nonreentrant_gen(original, args, kwargs)

            for owner, name in torch_checkpoint.targets():
                self._patch(owner, name, nonreentrant)
        reentrant = getattr(tuc, hooks.reentrant, None)
        if reentrant is not None:
            self._patch(tuc, hooks.reentrant, _ReentrantShim(self, reentrant))

    def uninstall(self) -> None:
        self.live = False
        saved, self._saved = self._saved, []
        for owner, name, original in reversed(saved):
            replacement = getattr(owner, name, None)
            setattr(owner, name, original)
            # torch imports the composable checkpoint lazily, from inside a checkpoint call: if
            # that happened while we were installed, it copied our wrapper by name and would keep
            # it (and this tracker) forever. Hand it the original too.
            if owner is tuc:
                copy = sys.modules.get(torch_checkpoint.COMPOSABLE)
                if copy is not None and getattr(copy, name, None) is replacement:
                    setattr(copy, name, original)

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _nonreentrant_gen(
        self, original: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Iterator[None]:
        call = torch_checkpoint.bind_nonreentrant(original, args, kwargs)
        region = self.new_region(
            kind="non-reentrant",
            preserve_rng_state=call.preserve_rng_state,
            args=call.tensor_args,
        )
        fn = call.fn

        def recompute_fn(*inner: Any, **kw: Any) -> Any:
            with self.phase(region, Phase.RECOMPUTE):
                return fn(*inner, **kw)

        context_fn = call.context_fn
        if context_fn is not tuc.noop_context_fn and not torch.compiler.is_compiling():
            user_context_fn = context_fn

            def context_fn() -> tuple[Any, Any]:
                forward_ctx, recompute_ctx = user_context_fn()
                return forward_ctx, _ObservedRecompute(recompute_ctx, self)

        inner = call.call(original, recompute_fn, context_fn)
        with self.phase(region, Phase.FORWARD):
            yield from inner

    # -- regions ----------------------------------------------------------------------------------

    def new_region(
        self,
        *,
        kind: str,
        preserve_rng_state: bool | None,
        args: tuple = (),
        name: str | None = None,
    ) -> Region:
        number = next(_region_numbers)
        devices = sorted({a.device.type for a in args if isinstance(a, torch.Tensor)})
        return Region(
            number=number,
            kind=kind,
            name=name or f"checkpoint #{number}",
            site=user_site(),
            preserve_rng_state=preserve_rng_state,
            devices=tuple(devices),
        )

    @contextlib.contextmanager
    def phase(self, region: Region, phase: Phase) -> Iterator[None]:
        if not self.live:
            yield
            return
        active = self._local.active
        if phase is Phase.RECOMPUTE:
            region.recompute = []
        else:
            region.forward = []
        entry = (region, phase)
        active.append(entry)
        try:
            yield
        finally:
            _remove(active, entry)
        # Only a recompute that ran to its end must have run every random op of the forward. A
        # non-reentrant early stop leaves by _StopRecomputationError, and is a correct prefix;
        # any other exception is the user's (or a raised finding) and skips this check too.
        if phase is Phase.RECOMPUTE:
            self._check_complete(region)

    def on_event(self, event: RandomOpEvent) -> None:
        """Record a random op in every active region of this thread; compare recomputes."""
        self.recorded += 1
        for region, phase in list(self._local.active):
            if phase is Phase.FORWARD:
                if len(region.forward) < _MAX_REGION_OPS:
                    region.forward.append(event)
                else:
                    region.truncated = True
            else:
                region.recompute.append(event)
                if not region.failed and event.expect != "ignore":
                    self._compare(region, len(region.recompute) - 1)

    # -- comparison ------------------------------------------------------------------------------

    def _compare(self, region: Region, k: int) -> None:
        r = region.recompute[k]
        if k >= len(region.forward):
            if region.truncated:
                return
            self._mismatch(
                region,
                k,
                None,
                r,
                "op",
                f"the recompute ran random op #{k} ({r.op}) but the forward ran only "
                f"{len(region.forward)} random op(s) in this region",
                control_flow_cause(),
            )
            return
        f = region.forward[k]
        differs, detail = first_difference(f, r)
        if differs:
            self._mismatch(region, k, f, r, differs, detail, likely_cause(region, k, f, r, differs))

    def _check_complete(self, region: Region) -> None:
        if region.failed or region.truncated or len(region.recompute) >= len(region.forward):
            return
        k = len(region.recompute)
        f = region.forward[k]
        self._mismatch(
            region,
            k,
            f,
            None,
            "op",
            f"the recompute ended after {k} random op(s); the forward ran {len(region.forward)} "
            f"(the first one missing is {f.op})",
            control_flow_cause(),
        )

    def _mismatch(
        self,
        region: Region,
        k: int,
        f: RandomOpEvent | None,
        r: RandomOpEvent | None,
        differs: str,
        detail: str,
        cause: str,
    ) -> None:
        region.failed = True
        shown = r if r is not None else f
        assert shown is not None
        if f is not None and f.seq in self._reported:
            return
        if r is not None:
            if len(self._reported) >= _MAX_REPORTED:  # replays happen in the same backward
                self._reported.clear()
            self._reported.add(r.seq)
        finding = Finding(
            kind=FindingKind.RECOMPUTE_MISMATCH,
            message=f"random op #{k} of {region.title}: {detail}",
            op=shown.op,
            cause=cause,
            differs=differs,
            region=region.title,
            stack=(f or shown).stack,
            other_stack=r.stack if r is not None else None,
            sides=(
                Side(label="forward", event=f, note="" if f else "ran no random op here"),
                Side(label="recompute", event=r, note="" if r else "ran no random op here"),
            ),
            seq=shown.seq,
            context=tuple(region.forward[max(0, k - 4) : k + 2]),
        )
        self._emit(finding)


def _remove(active: list[tuple[Region, Phase]], entry: tuple[Region, Phase]) -> None:
    for i in range(len(active) - 1, -1, -1):
        if active[i] is entry:
            del active[i]
            return


class _ReentrantShim:
    """Stands in for ``CheckpointFunction`` so ``checkpoint(use_reentrant=True)`` is tracked."""

    def __init__(self, tracker: RecomputeTracker, original: Any) -> None:
        self._tracker = tracker
        self._original = original

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)

    def apply(self, function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        tracker = self._tracker
        region = tracker.new_region(
            kind="reentrant", preserve_rng_state=bool(preserve_rng_state), args=args
        )
        calls = itertools.count()

        def run(*inner: Any) -> Any:
            phase = Phase.FORWARD if next(calls) == 0 else Phase.RECOMPUTE
            with tracker.phase(region, phase):
                return function(*inner)

        return self._original.apply(run, preserve_rng_state, *args)


class _ObservedRecompute:
    """A selective-checkpoint recompute context with an observer on top that sees cached ops."""

    def __init__(self, inner: Any, tracker: RecomputeTracker) -> None:
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


class _CacheObserver(TorchDispatchMode):
    """Notes random ops that a mode between it and rngcheck's mode answered without running."""

    def __init__(self, tracker: RecomputeTracker) -> None:
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
        if self._tracker.recorded == seen and _CHECKER is not None:
            _CHECKER.record_cached(func, args, kwargs)
        return out


# The active checker (set by RNGConsistencyMode), for the observer and for checkpoint_region.
_CHECKER: Any = None


def set_active_checker(checker: Any) -> None:
    global _CHECKER
    _CHECKER = checker


class CheckpointRegion:
    """Marks the two passes of a custom checkpoint function so rngcheck compares them.

    Example, in a Megatron-style ``torch.autograd.Function``::

        # forward
        ctx.rng_region = rngcheck.checkpoint_region("transformer layer")
        with ctx.rng_region.forward():
            outputs = run_function(*args)
        # backward, after restoring the RNG states
        with ctx.rng_region.recompute():
            outputs = ctx.run_function(*detached_inputs)

    Outside an active :class:`RNGConsistencyMode` both blocks do nothing, so the markers can stay
    in library code. A ``recompute()`` may run several times (one per backward).
    ``restores_rng=False`` says the function deliberately restores no generator state, so a
    mismatch's cause names that.

    Known limitations:
        One marker is one call: make a new one per forward (store it on ``ctx``). The two passes
        must run on the thread that ran them (autograd's device threads included) while the same
        mode is active; a recompute after the mode exited is not compared.
    """

    def __init__(self, name: str | None = None, *, restores_rng: bool | None = None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(
                f"checkpoint_region name must be a str or None; got {type(name).__name__}"
            )
        self._name = name
        self._restores_rng = restores_rng
        self._region: Region | None = None
        self._tracker: RecomputeTracker | None = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        checker = _CHECKER
        tracker = checker.recompute_tracker if checker is not None else None
        if tracker is None:
            yield
            return
        self._tracker = tracker
        self._region = tracker.new_region(
            kind="custom", preserve_rng_state=self._restores_rng, name=self._name
        )
        with tracker.phase(self._region, Phase.FORWARD):
            yield

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        tracker, region = self._tracker, self._region
        if tracker is None or region is None or _CHECKER is None:
            yield
            return
        with tracker.phase(region, Phase.RECOMPUTE):
            yield


def checkpoint_region(
    name: str | None = None, *, restores_rng: bool | None = None
) -> CheckpointRegion:
    """A marker for one checkpointed call of a custom checkpoint function (see CheckpointRegion)."""
    return CheckpointRegion(name, restores_rng=restores_rng)
