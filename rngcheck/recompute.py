"""Checkpoint regions: the random ops of a region's forward, compared op by op with its recompute.

How regions are found, without the user changing a line:
- ``use_reentrant=False``: ``torch.utils.checkpoint.checkpoint`` drives the module-level generator
  ``_checkpoint_without_reentrant_generator``; we wrap it, so the forward is the span between its
  first and last step and the recompute is the ``fn`` it calls back from backward.
- ``use_reentrant=True``: ``checkpoint`` calls ``CheckpointFunction.apply(function, ...)``; we put a
  shim in its place whose wrapped ``function`` knows its first call is the forward and any later
  call the recompute.
Both are looked up by name at call time inside torch, so ``from torch.utils.checkpoint import
checkpoint`` done before the mode started is covered too, and so is ``checkpoint_sequential``.
Selective checkpointing serves saved ops from a cache above our dispatch mode, where we would not
see them; an observer mode stacked on top of its recompute context notes each op it swallows.

Custom checkpoint functions (Megatron's, DeepSpeed's, torch_xla's, hand-written) mark their two
passes with :func:`checkpoint_region`.
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

from .events import Phase, RandomOpEvent, SeedCall
from .ops import OpKind, classify
from .report import Finding, FindingKind, Side
from .stacks import Stack

__all__ = ["CheckpointRegion", "RecomputeTracker", "checkpoint_region"]

# Past this many random ops in one region's forward we stop recording it (and say so): memory
# stays bounded even for a region that wraps a whole model with per-element random ops.
_MAX_REGION_OPS = 100_000
_region_numbers = itertools.count(1)
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"
# Seeding APIs that reseed (as opposed to set_rng_state, which swaps a saved state in).
_RESEED_APIS = ("manual_seed", "manual_seed_all", "seed", "seed_all")


@dataclass(eq=False, slots=True, kw_only=True)
class Region:
    """One checkpointed call: its forward's random ops and, once backward runs, its recompute's."""

    number: int
    kind: str  # "non-reentrant", "reentrant", or "custom"
    name: str
    stack: Stack
    preserve_rng_state: bool | None = True  # None: unknown (custom checkpoint functions)
    selective: bool = False
    devices: tuple[str, ...] = ()  # device types of the tensor arguments (what torch stashes)
    forward: list[RandomOpEvent] = field(default_factory=list)
    recompute: list[RandomOpEvent] = field(default_factory=list)
    forward_done: bool = False
    recomputing: bool = False
    failed: bool = False  # a mismatch was reported: do not report this region again
    truncated: bool = False

    @property
    def title(self) -> str:
        return f"{self.name} ({self.kind}) at {self.stack.describe()}"


class _Local(threading.local):
    def __init__(self) -> None:
        self.active: list[tuple[Region, Phase]] = []


class RecomputeTracker:
    """Keeps the active regions of each thread and compares recomputes with their forwards."""

    def __init__(self, emit: Callable[[Finding], None]) -> None:
        self._emit = emit
        self._local = _Local()
        self._saved: list[tuple[Any, str, Any]] = []
        # One finding per distinct mismatch (op, element, both call sites): a training loop with
        # the bug, or a nested region replaying its inner one, reports it once, not every step.
        self._reported: set[tuple[str, str, str, str]] = set()
        self.recorded = 0  # random ops recorded by the main mode (the SAC observer watches it)
        # False once the mode has exited: a region whose forward ran inside the mode may
        # recompute after it (backward outside the `with`); with no ops recorded any more, that
        # recompute must not be compared, or it would look like it ran no random op at all.
        self.live = False

    # -- state queried on the hot path of random ops -------------------------------------------

    def active(self) -> bool:
        return bool(self._local.active)

    def in_recompute(self) -> bool:
        return any(phase is Phase.RECOMPUTE for _, phase in self._local.active)

    def innermost(self) -> str:
        active = self._local.active
        return active[-1][0].title if active else ""

    # -- installing the hooks into torch.utils.checkpoint ---------------------------------------

    def install(self) -> None:
        self.live = True
        original = tuc._checkpoint_without_reentrant_generator

        def nonreentrant(*args: Any, **kwargs: Any) -> Iterator[None]:
            return self._nonreentrant_gen(original, *args, **kwargs)

        self._patch(tuc, "_checkpoint_without_reentrant_generator", nonreentrant)
        self._patch(tuc, "CheckpointFunction", _ReentrantShim(self, tuc.CheckpointFunction))
        # torch.distributed's composable ``checkpoint(module)`` imported the generator by name;
        # patch its copy too when that module is loaded (importing it here would pull in
        # torch.distributed for every user).
        composable = sys.modules.get(_COMPOSABLE)
        if getattr(composable, "_checkpoint_without_reentrant_generator", None) is original:
            self._patch(composable, "_checkpoint_without_reentrant_generator", nonreentrant)

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
                copy = sys.modules.get(_COMPOSABLE)
                if copy is not None and getattr(copy, name, None) is replacement:
                    setattr(copy, name, original)

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _nonreentrant_gen(
        self,
        original: Callable[..., Any],
        fn: Callable[..., Any],
        preserve_rng_state: bool = True,
        context_fn: Callable[[], Any] = tuc.noop_context_fn,
        *rest: Any,
        **kwargs: Any,
    ) -> Iterator[None]:
        region = self.new_region(
            kind="non-reentrant",
            preserve_rng_state=bool(preserve_rng_state),
            selective=context_fn is not tuc.noop_context_fn,
            args=rest[3:],
            skip=3,
        )

        def recompute_fn(*args: Any, **kw: Any) -> Any:
            with self.phase(region, Phase.RECOMPUTE):
                return fn(*args, **kw)

        if context_fn is not tuc.noop_context_fn and not torch.compiler.is_compiling():
            user_context_fn = context_fn

            def context_fn() -> tuple[Any, Any]:
                forward_ctx, recompute_ctx = user_context_fn()
                return forward_ctx, _ObservedRecompute(recompute_ctx, self)

        inner = original(recompute_fn, preserve_rng_state, context_fn, *rest, **kwargs)
        with self.phase(region, Phase.FORWARD):
            yield from inner

    # -- regions ----------------------------------------------------------------------------------

    def new_region(
        self,
        *,
        kind: str,
        preserve_rng_state: bool | None,
        selective: bool = False,
        args: tuple = (),
        name: str | None = None,
        skip: int = 0,
    ) -> Region:
        number = next(_region_numbers)
        devices = sorted({a.device.type for a in args if isinstance(a, torch.Tensor)})
        return Region(
            number=number,
            kind=kind,
            name=name or f"checkpoint #{number}",
            stack=Stack.capture(skip=skip + 1),
            preserve_rng_state=preserve_rng_state,
            selective=selective,
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
            region.recomputing = True
        else:
            region.forward = []
            region.forward_done = False
        entry = (region, phase)
        active.append(entry)
        stopped_early = False
        completed = False
        try:
            yield
            completed = True
        except tuc._StopRecomputationError:
            stopped_early = True  # non-reentrant early stop: the recompute is a prefix. Correct.
            raise
        finally:
            _remove(active, entry)
            if phase is Phase.FORWARD:
                region.forward_done = True
            else:
                region.recomputing = False
                if completed and not stopped_early:
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
                _control_flow_cause(),
            )
            return
        f = region.forward[k]
        differs, detail = _first_difference(f, r)
        if differs:
            self._mismatch(region, k, f, r, differs, detail, _cause(region, k, f, r, differs))

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
            _control_flow_cause(),
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
        key = (shown.op, differs, f.site if f else "", r.site if r else "")
        if key in self._reported:
            return
        self._reported.add(key)
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


def _first_difference(f: RandomOpEvent, r: RandomOpEvent) -> tuple[str, str]:
    """Structure before values: op, arguments, generator, then state, then output."""
    if f.op != r.op:
        return "op", f"the forward ran {f.op} here, the recompute ran {r.op}"
    if f.args != r.args:
        changed = _arg_changes(f.op, f.args, r.args)
        detail = f"{f.op} was called with different arguments: " + "; ".join(changed)
        if f.op.startswith("aten.bernoulli"):
            detail += " (for dropout, bernoulli's p is the keep probability, 1 - dropout p)"
        return "argument", detail
    # A Generator made inside the region is a new object in each pass; it only matters when the
    # two draw from different states.
    same_state = f.before is not None and f.before == r.before
    if f.generator.key != r.generator.key and not same_state:
        return "generator", (
            f"{f.op} drew from {f.generator.label} in the forward but from "
            f"{r.generator.label} in the recompute"
        )
    if r.cached:
        return "", ""
    if f.before is not None and r.before is not None and f.before != r.before:
        return "state", (
            f"{f.op} drew from {r.generator.label} in a different state than in the forward "
            f"(state digest {f.before & 0xFFFFFFFFFFFFFFFF:016x} vs "
            f"{r.before & 0xFFFFFFFFFFFFFFFF:016x}), so it drew different random numbers"
        )
    fo, ro = f.output_digest, r.output_digest
    if fo is not None and ro is not None and fo != ro:
        return "output", f"{f.op} produced a different output than in the forward"
    return "", ""


def _arg_changes(op: str, fwd: tuple[str, ...], rec: tuple[str, ...]) -> list[str]:
    """``p=0.5 (forward) vs p=0.7 (recompute)``: tensors by position, scalars by name.

    The dispatcher leaves out arguments equal to their default, so a side without a named
    argument had the schema's default there.
    """
    f_pos = [a for a in fwd if "=" not in a]
    r_pos = [a for a in rec if "=" not in a]
    f_named = dict(a.split("=", 1) for a in fwd if "=" in a)
    r_named = dict(a.split("=", 1) for a in rec if "=" in a)
    changes = [
        f"argument {i}: {a} (forward) vs {b} (recompute)"
        for i, (a, b) in enumerate(zip(f_pos, r_pos, strict=False))
        if a != b
    ]
    if len(f_pos) != len(r_pos):
        changes.append(f"{len(f_pos)} tensor argument(s) (forward) vs {len(r_pos)} (recompute)")
    for name in [*f_named, *(n for n in r_named if n not in f_named)]:
        a = f_named.get(name) or _schema_default(op, name)
        b = r_named.get(name) or _schema_default(op, name)
        if a != b:
            changes.append(f"{name}={a} (forward) vs {name}={b} (recompute)")
    return changes or [f"{list(fwd)} vs {list(rec)}"]


def _schema_default(op: str, name: str) -> str:
    """The default of argument ``name`` of ``aten.bernoulli_.float``, as text ("?" if unknown)."""
    try:
        namespace, packet, overload = op.split(".")
        schema = getattr(getattr(getattr(torch.ops, namespace), packet), overload)._schema
        for arg in schema.arguments:
            if arg.name == name and arg.has_default_value():
                return str(arg.default_value)
    except (AttributeError, ValueError, RuntimeError):
        pass
    return "<default>"


def _control_flow_cause() -> str:
    return (
        "the region's control flow differs between forward and recompute: a branch on a value "
        "that changed after the forward (a global flag, model.training, a step counter) or on a "
        "random number drawn outside the region. Make the region depend only on its inputs."
    )


def _cause(region: Region, k: int, f: RandomOpEvent, r: RandomOpEvent, differs: str) -> str:
    if differs == "argument":
        return (
            "an argument of the random op changed between forward and backward: a value read "
            "from outside the region (a dropout probability from a schedule, a global) was "
            "updated before backward. Pass it into the checkpointed function as an input, or "
            "change it only after backward."
        )
    if differs == "op":
        return _control_flow_cause()
    if differs == "generator":
        return (
            "the region picks its generator at run time (by device, by a global, by a "
            "tracker's current stream, or makes a new torch.Generator with a different seed in "
            "each pass), and the choice changed before the recompute. Pick the generator from "
            "the region's inputs, or pass it in as an argument."
        )
    if differs == "output":
        return (
            "same op, arguments and generator state, but a different output: the op's input "
            "differs (a nondeterministic op earlier in the region) or the kernel does not draw "
            "deterministically from its state."
        )
    gen = r.generator
    cached = [e for e in region.recompute[:k] if e.cached and e.generator.key == gen.key]
    if cached:
        first = cached[0]
        return (
            f"selective activation checkpointing saved the output of {first.op} (random op "
            f"#{region.recompute.index(first)}, at {first.site}) instead of recomputing it, so "
            f"in the recompute it did not draw from {gen.label} and every later random op "
            "draws from a shifted state. Make the policy return PREFER_RECOMPUTE/MUST_RECOMPUTE "
            "for random ops, or save all of them."
        )
    reseeds = [c for c in _user_calls(r) if _is_reseed(c)]
    if reseeds:
        return _reseed_cause(gen.label, reseeds, [c for c in _user_calls(f) if _is_reseed(c)])
    swaps_fwd = [c for c in _user_calls(f) if not _is_reseed(c)]
    swaps_rec = [c for c in _user_calls(r) if not _is_reseed(c)]
    if swaps_rec and {_where(c) for c in swaps_fwd} & {_where(c) for c in swaps_rec}:
        return _stream_cause(gen.label, swaps_rec[-1])
    if region.preserve_rng_state is False and gen.is_default and region.kind == "custom":
        return (
            f"the custom checkpoint region was marked restores_rng=False, so {gen.label} was not "
            "restored before the recompute: the recompute continues the stream instead of "
            "replaying it. Stash the generator's state before the forward and restore it "
            "before recomputing."
        )
    if region.preserve_rng_state is False and gen.is_default:
        return (
            f"the region was checkpointed with preserve_rng_state=False, so {gen.label} was not "
            "stashed and restored: the recompute continues the stream instead of replaying "
            "it. Use preserve_rng_state=True (the default) for regions with random ops."
        )
    if not gen.is_default:
        if region.kind == "custom":
            return (
                f"{gen.label} was passed as generator= and the custom checkpoint did not "
                "restore its state before the recompute. Save it with get_state() in the "
                "forward and set_state() it before recomputing."
            )
        return (
            f"{gen.label} was passed as generator=; torch.utils.checkpoint stashes and restores "
            "only the default CPU generator and the default generator of the tensor arguments' "
            "device, so the recompute draws the next numbers from it instead of the same ones. "
            "Save its state with get_state() before the region and set_state() it at the start "
            "of the checkpointed function, or draw this randomness outside the region."
        )
    device_type = gen.device.split(":")[0]
    if region.kind != "custom" and device_type != "cpu" and device_type not in region.devices:
        return (
            f"{gen.label} is used only inside the checkpointed function: torch.utils.checkpoint "
            f"stashes the CPU generator and the default generator of its tensor arguments' "
            f"device ({', '.join(region.devices) or 'none'}) only. Pass a {device_type} tensor "
            "as an argument, or seed that generator inside the function."
        )
    if _continues_forward(region, r) and (region.kind != "custom" or swaps_fwd):
        # The recompute drew from a state the forward left this generator in, although the
        # checkpoint restored the generator at the region's start: something inside the region
        # swapped a saved state in, and that saved state was not rewound. (A custom checkpoint
        # that restores nothing continues the stream too; without a swap seen, blame it.)
        return _stream_cause(gen.label, swaps_fwd[-1] if swaps_fwd else None)
    if region.kind == "custom":
        return (
            f"the custom checkpoint did not restore {gen.label} to its forward state before the "
            "recompute. Stash it with get_state() before the forward and restore it with "
            "set_state() before recomputing."
        )
    return (
        f"{gen.label} was in a different state at this op than in the forward although the "
        "region's start was restored: something inside the region drew from it in one pass "
        "only (an op outside the checker's view, another thread), or it was set with "
        "Generator.set_state."
    )


def _user_calls(e: RandomOpEvent) -> tuple[SeedCall, ...]:
    return e.out_of_band.user_calls if e.out_of_band is not None else ()


def _where(call: SeedCall) -> str:
    return call.stack.describe()


def _is_reseed(call: SeedCall) -> bool:
    return call.api.rsplit(".", 1)[-1] in _RESEED_APIS


def _continues_forward(region: Region, r: RandomOpEvent) -> bool:
    key = r.generator.key
    return r.before is not None and any(
        e.after == r.before for e in region.forward if e.generator.key == key and not e.cached
    )


def _reseed_cause(label: str, in_recompute: list[SeedCall], in_forward: list[SeedCall]) -> str:
    call = in_recompute[-1]
    before = [c for c in in_forward if _where(c) == _where(call)] or in_forward
    forward = (
        f"; in the forward it was {before[-1].api}({before[-1].argument})"
        if before
        else "; the forward ran no such call"
    )
    return (
        f"{label} was reseeded inside the checkpointed region: {call.text} in the "
        f"recompute{forward}. A seed computed from something that changed after the forward "
        "(a step counter, the clock, a global) makes the two passes draw different numbers. "
        "Seed outside the checkpointed function, or pass the seed in as an argument."
    )


def _stream_cause(label: str, swap: SeedCall | None) -> str:
    how = f" by {swap.text}" if swap is not None else ""
    return (
        f"{label} drew in the recompute from the state the forward left it in: a state swapped "
        f"in{how} from a named RNG stream (a Megatron-style tracker's fork()) that the "
        "checkpoint did not rewind. torch.utils.checkpoint restores the default generator at "
        "the region's start, not the tracker's saved stream states, so the recompute continues "
        "the stream instead of replaying it. Save the tracker's states before the region and "
        "restore them before the recompute (as Megatron's CheckpointFunction does with "
        "get_states()/set_states()), or use the tracker's own checkpoint function."
    )


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
            kind="reentrant", preserve_rng_state=bool(preserve_rng_state), args=args, skip=2
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
            kind="custom", preserve_rng_state=self._restores_rng, name=self._name, skip=2
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
