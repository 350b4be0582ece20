"""Recording random ops: the hot path of a mode run op by op.

The interceptor (``core/dispatch.py``) hands every random op and collective to
:meth:`Recorder.on_special`. For a random op the recorder finds the generator it draws from, reads
its state before and after, explains a state that moved out of band (``core/seeding.py``), builds
the frozen ``RandomOpEvent`` and hands it to the event window, the trace and each check. A call of
an inductor graph is read the same way, as one draw (:meth:`Recorder.on_compiled_graph`).

Every check is reached through an attribute of the recorder itself (the mode sets them as it
starts the checks): one attribute read per op, as when this was the mode's own code, never a hop
through the mode.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..core.compiled import CompiledCall, CompiledGraphHook, compiled_call
from ..core.digest import tensor_digest
from ..core.dispatch import Intercepting
from ..core.events import (
    BACKWARD,
    FORWARD,
    RECOMPUTE,
    EventWindow,
    OutOfBandChange,
    Phase,
    RandomOpEvent,
)
from ..core.generators import GeneratorRegistry
from ..core.ops import (
    OpKind,
    op_device,
    op_generator,
    op_name,
    state_determines_output,
    summarize_args,
    writes_first_argument,
)
from ..core.policy import current_expectation
from ..core.rank_check import RankCheck
from ..core.seeding import SeedCallLog
from ..core.stacks import Stack, user_frame
from ..output.trace import TraceFeed
from ..recompute.compiled import CompiledRecomputes
from ..recompute.inferred import InferredRecomputes, driver_frame
from ..recompute.torch_hooks import checkpoint_frame_on_stack
from ..recompute.tracker import RecomputeTracker
from .closing import MAX_NOTE_SITES

__all__ = ["Recorder"]


class Recorder:
    """The random-op path of one mode: random ops in, events out to the window, the trace and the
    checks. Builds and owns the compiled-graph hook (the mode installs it); keeps what backward
    drew outside every region for the closing notes (``closing.py``).

    ``coverage(what)`` is the mode's loud coverage gap; ``load_xla()`` loads the torch_xla
    support once torch_xla is imported (True when loaded). The checks, the trace, the interceptor
    and the process are the mode's to set (``tracker``, ``inferred``, ``compiled``, ``trace``,
    ``ranks``, ``interceptor``, ``pid``).
    """

    __slots__ = (
        "_coverage",
        "_expect",
        "_generators",
        "_load_xla",
        "_seeds",
        "_window",
        "backward_sites",
        "compiled",
        "drew_instead",
        "graph_hook",
        "hook_draws",
        "inferred",
        "interceptor",
        "pid",
        "ranks",
        "tracker",
        "trace",
        "unseen_checkpoint",
    )

    def __init__(
        self,
        window: EventWindow,
        generators: GeneratorRegistry,
        seeds: SeedCallLog,
        expect: str,
        coverage: Callable[[str], None],
        load_xla: Callable[[], bool],
    ) -> None:
        self._window = window
        self._generators = generators
        self._seeds = seeds
        self._expect = expect  # the mode's default expectation (outside every expect(...) block)
        self._coverage = coverage
        self._load_xla = load_xla
        self.graph_hook = CompiledGraphHook(self.on_compiled_graph)
        self.tracker: RecomputeTracker | None = None
        self.inferred: InferredRecomputes | None = None
        self.compiled: CompiledRecomputes | None = None
        self.trace: TraceFeed | None = None
        self.ranks: RankCheck | None = None
        self.interceptor: Intercepting | None = None
        self.pid = os.getpid()
        self.unseen_checkpoint = False  # warned once that a checkpoint region went unseen
        # For the closing notes: backward's random ops outside every region, by site
        # ([count, stack, op]), and those a communication hook drew (hook -> count).
        self.backward_sites: dict[str, list[Any]] = {}
        self.hook_draws: dict[Any, int] = {}
        # DTensor random ops that drew from the device's default generator instead of the one
        # passed as generator=, by (site, op, passed, drawn from): [count, stack].
        self.drew_instead: dict[tuple[str, str, str, str], list[Any]] = {}

    def on_special(self, kind: OpKind, func: Any, args: tuple, kwargs: dict) -> Any:
        """The interceptor's callback: a random op or a collective, which it runs."""
        if os.getpid() != self.pid:
            # A forked child (a DataLoader worker) inherits the pushed mode but not the rank
            # group's peers: checking there would exchange from the wrong process and hang.
            return func(*args, **kwargs)
        if kind is OpKind.RANDOM:
            return self._on_random(func, args, kwargs)
        if self.ranks is not None:
            self.ranks.on_collective(func, args)
        return func(*args, **kwargs)

    def _tracked(self, args: tuple, kwargs: dict, device: torch.device) -> Any:
        """The registry entry of the generator an op draws from, or None (no adapter)."""
        gen_arg = op_generator(args, kwargs)
        if gen_arg is not None:
            return self._generators.user(gen_arg, _first_use_site)
        tracked = self._generators.default(device)
        if tracked is None and device.type == "xla" and self._load_xla():
            tracked = self._generators.default(device)  # torch_xla imported after the mode began
        return tracked

    def _event(
        self,
        op: str,
        summary: tuple[str, ...],
        tracked: Any,
        stack: Stack | None = None,
        **fields: Any,
    ) -> RandomOpEvent:
        tracker = self.tracker
        return RandomOpEvent(
            seq=self._window.total,
            op=op,
            generator=tracked.ident,
            device=tracked.ident.device,
            args=summary,
            stack=stack if stack is not None else Stack.capture(),
            expect=self._expectation(),
            region=tracker.innermost() if tracker is not None else "",
            **fields,
        )

    def _on_random(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tracker = self.tracker
        if tracker is not None:
            tracker.recorded += 1  # seen by this mode (a SAC cache's observer compares it)
        device = op_device(args, kwargs)
        if device.type == "meta":
            return func(*args, **kwargs)
        tracked = self._tracked(args, kwargs, device)
        if tracked is None:  # a device type rngcheck has no adapter for: run, note nothing
            return func(*args, **kwargs)
        before, oob, mark = self._before_draw(tracked)
        # On a mesh without DTensor's RNG tracker (a CPU mesh), DTensor drops the generator= of
        # a random op and draws from the device's default generator: read that one too.
        instead = drawn = None
        if not tracked.ident.is_default and _on_dtensor(args):
            instead = self._generators.default(device)
            drawn = self._before_draw(instead) if instead is not None else None
        out = func(*args, **kwargs)
        after = tracked.read()
        if after is not None and after == before:
            moved = instead.read() if instead is not None else None
            if instead is None or drawn is None or moved is None or moved == drawn[0]:
                # Tagged random, but it drew nothing (CPU SDPA with dropout_p=0 picks a
                # random-tagged kernel under no_grad and an untagged one with grad, so a
                # reentrant recompute would "miss" it): not a draw of the program. The
                # generator's last state stays as it was, so a change before this op is still
                # seen at the next one that draws. Seen before a selective checkpoint's cache
                # (the selective route), its recompute's op that drew nothing was answered from
                # the cache: what a dispatch mode below the cache is told by an observer above it.
                if tracker is not None and tracker.sees_first and tracker.in_cached_recompute():
                    self.record_cached(func, args, kwargs)
                return out
            # It drew from the default generator, not the one passed: a draw from the one that
            # moved (what the ranks must agree on), and a note that torch ignored the argument.
            self._drew_instead(op_name(func), tracked.ident, instead.ident)
            tracked, (before, oob, mark), after = instead, drawn, moved
        call = compiled_call()
        if call is not None:
            # A compiled graph's draw (its first call, before the graph hook was in place): from
            # now on its calls run with the mode set aside (see on_compiled_graph).
            self.graph_hook.install()
            op, summary = f"compiled_graph.{call.kind}", tuple[str, ...]()
        else:
            op, summary = op_name(func), summarize_args(func, args, kwargs)
            if tracker is not None and not tracker.active() and not self.unseen_checkpoint:
                self._check_coverage(op)
        mesh = written = None
        if self.ranks is not None:
            # A DTensor op is checked over its own mesh (DTensor's contract), not the mode's
            # group; an in-place op's target tells a parameter's initialisation (replicated.py).
            mesh = self.ranks.mesh_of(args, kwargs)
            written = args[0] if args and writes_first_argument(func) else None
        self._drawn(op, summary, tracked, before, after, oob, mark, out, call, mesh, written, func)
        return out

    def _before_draw(self, tracked: Any) -> tuple[int | None, OutOfBandChange | None, int]:
        """The generator's state before a draw, how it changed since its last draw, if it did,
        and the seeding-call counter now."""
        before = tracked.read()
        oob = None
        if before is not None and tracked.last_after is not None and before != tracked.last_after:
            oob = self._out_of_band(tracked)
        return before, oob, self._seeds.counter

    def _drawn(
        self,
        op: str,
        summary: tuple[str, ...],
        tracked: Any,
        before: int | None,
        after: int | None,
        oob: OutOfBandChange | None,
        seed_mark: int,
        out: Any,
        call: CompiledCall | None,
        mesh: Any = None,
        written: Any = None,
        func: Any = None,
    ) -> None:
        """A draw happened: note the generator's new state, build the event, and hand it on.
        ``func``: the op that drew (None: a compiled graph)."""
        tracked.last_after = after
        tracked.seed_mark = seed_mark
        if isinstance(tracked.handle, torch.Generator):
            tracked.initial_seed = tracked.handle.initial_seed()
        tracker = self.tracker
        in_region = tracker is not None and tracker.active()
        phase = self._phase()
        stack = None
        if call is not None and call.sources:
            # The user's line of the graph's random op (its FX stack trace), not the generated
            # code's: the stack up to the compiled function's call, then that line.
            stack = Stack.capture(innermost=call.sources[0])
        inferred = self.inferred
        # A compiled graph's draw has no output of its own (its seeds, or the graph's outputs
        # with saved activations): its generator's states are what is compared. Nor has a draw
        # whose state and arguments decide its output (dropout's bernoulli_ on the CPU): the
        # recompute comparison compares those first, and the same ones made the same output.
        digest = (
            call is None
            and (
                in_region
                or (
                    inferred is not None
                    and (
                        phase is BACKWARD or (inferred.watching and inferred.watches(user_frame()))
                    )
                )
            )
            and (before is None or not _decided(func, tracked.ident.device))
        )
        event = self._event(
            op,
            summary,
            tracked,
            stack=stack,
            before=before,
            after=after,
            phase=phase,
            output=tensor_digest(out) if digest else None,
            out_of_band=oob,
            seed=tracked.initial_seed,
            compiled=call.label if call is not None else "",
        )
        self._record(event, mesh, written, call)

    def on_compiled_graph(self, graph: Any, run: Callable[[], Any]) -> Any:
        """A call of an inductor graph: it runs with the mode set aside (its kernels dispatched
        from compiled code cost what they cost without the checker), and what it drew is read as
        the generators' states before and after the call, like one random op."""
        interceptor = self.interceptor
        if interceptor is None or interceptor.suspended or os.getpid() != self.pid:
            return run()
        call = compiled_call(graph=graph) or CompiledCall(kind="forward", function=None, sources=())
        devices = {"cpu", *(getattr(graph, "device_types", ()) or ())}
        tracked = [
            t for t in (self._generators.default(torch.device(d)) for d in sorted(devices)) if t
        ]
        befores = [self._before_draw(t) for t in tracked]
        with interceptor.set_aside() as aside:
            out = run()
        if not aside:  # another mode above (AOT's first-call analyser): ops came through one by one
            return out
        for t, (before, oob, mark) in zip(tracked, befores, strict=True):
            after = t.read()
            if after is not None and after != before:
                op = f"compiled_graph.{call.kind}"
                self._drawn(op, (), t, before, after, oob, mark, out, call)
        return out

    def _check_coverage(self, op: str) -> None:
        """A random op outside every region rngcheck knows: is a torch checkpoint running it?"""
        if checkpoint_frame_on_stack():
            self.unseen_checkpoint = True
            self._coverage(
                f"a torch.utils.checkpoint region ran random ops ({op}) that rngcheck "
                f"did not see begin, on torch {torch.__version__}: either the region started "
                "before the mode was entered, or this torch runs checkpoint through code "
                "rngcheck does not hook. Recomputes of such regions are not compared"
            )

    def record_cached(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A random op that a selective-checkpoint cache answered without running it (the
        recompute tracker calls this)."""
        interceptor = self.interceptor
        if interceptor is not None and interceptor.suspended:
            return  # between sampled steps: no op is recorded (the probe checks the region)
        tracked = self._tracked(args, kwargs, op_device(args, kwargs))
        if tracked is not None:
            event = self._event(
                op_name(func),
                summarize_args(func, args, kwargs),
                tracked,
                before=None,
                after=None,
                phase=RECOMPUTE,
                cached=True,
            )
            self._record(event)

    def _record(
        self,
        event: RandomOpEvent,
        mesh: Any = None,
        written: Any = None,
        call: CompiledCall | None = None,
    ) -> None:
        self._window.add(event)
        if self.trace is not None:
            self.trace.add(event)
        inferred, compiled = self.inferred, self.compiled
        if event.phase is BACKWARD:
            if call is not None and call.kind == "backward":
                if compiled is not None:  # a compiled backward's draw: a recompute of the graph's
                    compiled.on_backward(event, call)
            # A hand-written checkpoint's recompute (compared there), or randomness that belongs
            # in backward (a note).
            elif inferred is None or not inferred.on_backward(event, driver_frame()):
                self._note_backward(event)
        elif event.phase is FORWARD and not event.region:
            if call is not None and compiled is not None:
                compiled.on_forward(event, call)
            if inferred is not None:
                inferred.on_forward(event)
        if self.tracker is not None:
            self.tracker.on_event(event)
        if self.ranks is not None:  # "ignore" ops too: not compared, but they move generators
            self.ranks.on_event(event, mesh, written)

    def _phase(self) -> Phase:
        tracker = self.tracker
        if tracker is not None and tracker.in_recompute():
            return RECOMPUTE
        if torch._C._current_graph_task_id() != -1:
            return BACKWARD
        return FORWARD

    def _expectation(self) -> str:
        exp = current_expectation()
        return exp.policy if exp is not None else self._expect

    def _out_of_band(self, tracked: Any) -> OutOfBandChange:
        calls = self._seeds.since(tracked.seed_mark, tracked.ident.device)
        new_seed = None
        handle = tracked.handle
        if isinstance(handle, torch.Generator) and tracked.initial_seed is not None:
            seed = handle.initial_seed()
            if seed != tracked.initial_seed:
                new_seed = seed
        return OutOfBandChange(calls=calls, new_seed=new_seed)

    def _drew_instead(self, op: str, passed: Any, drawn: Any) -> None:
        """Note a random op that drew from ``drawn`` although ``passed`` was its generator=."""
        site = Stack.capture()
        key = (site.describe(), op, passed.label, drawn.label)
        entry = self.drew_instead.get(key)
        if entry is not None:
            entry[0] += 1
        elif len(self.drew_instead) < MAX_NOTE_SITES:
            self.drew_instead[key] = [1, site]

    def _note_backward(self, event: RandomOpEvent) -> None:
        from ..ranks.scopes import sketch

        hook = sketch()
        if hook is not None:  # randomness that belongs in backward: the gradient exchange's own
            self.hook_draws[hook] = self.hook_draws.get(hook, 0) + 1
            return
        site = event.site
        entry = self.backward_sites.get(site)
        if entry is not None:
            entry[0] += 1
        elif len(self.backward_sites) < MAX_NOTE_SITES:
            self.backward_sites[site] = [1, event.stack, event.op]


# Devices whose generator state, as read, decides what a draw makes: the CPU's whole Mersenne
# Twister state, CUDA's Philox seed and offset (torch_xla's state is the seed alone).
_STATE_DEVICES = frozenset({"cpu", "cuda"})


def _decided(func: Any, device: str) -> bool:
    """Whether ``func``'s draw on ``device`` ("cuda:0") makes an output its state before and its
    arguments decide."""
    return (
        func is not None
        and device.partition(":")[0] in _STATE_DEVICES
        and state_determines_output(func)
    )


def _on_dtensor(args: tuple) -> bool:
    """Whether an op's first argument is a DTensor (its placements over a DeviceMesh)."""
    return bool(args) and hasattr(args[0], "placements") and hasattr(args[0], "device_mesh")


def _first_use_site() -> str:
    site = Stack.capture().call_site
    return site.short_location if site is not None else ""
