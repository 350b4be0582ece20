"""The recompute check: the random ops of a checkpointed region's forward, compared op by op with
its recompute.

Regions are found without the user changing a line: ``torch_hooks.py`` wraps the functions torch
calls for each checkpointed region (per torch version), torch_xla's checkpoint gets the same shim
(``xla.py``), and custom checkpoint functions mark their passes (``marked.py``). Selective
checkpointing's cached ops are noted by an observer on top of its recompute context.

Each recompute op is compared with the forward's op at the same position: op, arguments,
generator, state before, output digest. The first difference is one finding per region (a nested
region replaying an op its outer region already reported is not reported again), with a likely
cause worked out from what the two events and their out-of-band seeding calls show
(``causes.py``). A non-reentrant recompute that stops early is a correct prefix.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from ..core.digest import LazyDigest, resolve_all
from ..core.events import FORWARD, RECOMPUTE, Phase, RandomOpEvent
from ..core.findings import Finding, Likely
from ..core.stacks import user_site
from .causes import control_flow, first_difference, likely_cause, output_difference
from .modules import ModuleNames
from .probe import StateProbe
from .region import Region, devices_of, mismatch_finding
from .switches import ModeSwitches
from .torch_hooks import TorchCheckpointPatches

__all__ = ["RecomputeTracker"]

# Past this many random ops in one region's forward we stop recording it and compare only the
# recorded prefix: memory stays bounded even for a region that wraps a whole model with
# per-element random ops.
_MAX_REGION_OPS = 100_000
_MAX_REPORTED = 4096
_MAX_WAITING = 4096


class _Local(threading.local):
    def __init__(self) -> None:
        self.active: list[tuple[Region, Phase]] = []


class RecomputeTracker:
    """Keeps the active regions of each thread and compares recomputes with their forwards.

    ``emit`` receives each finding; ``record_cached(func, args, kwargs)`` turns a random op that a
    selective-checkpoint cache answered into an event (the mode builds events).
    """

    _installed: ClassVar[RecomputeTracker | None] = None  # the one whose hooks are in torch now

    def __init__(
        self,
        emit: Callable[[Finding], None],
        record_cached: Callable[[Any, tuple, dict], None] = lambda *_: None,
    ) -> None:
        self._emit = emit
        self.record_cached = record_cached
        self._local = _Local()
        self._patches = TorchCheckpointPatches(self)
        # The seq of each recompute op a finding was about. A reentrant outer recompute replays
        # its inner checkpoint's forward; when the outer already reported the op that replay
        # drew, the inner region comparing against that same op is the same bug, not a new one.
        self._reported: set[int] = set()
        self.recorded = 0  # random ops the mode intercepted (the SAC observer watches it)
        # Whether the checker sees a random op before any dispatch mode (the selective route),
        # so before a selective checkpoint's cache; else after them (the dispatch-mode route).
        self.sees_first = False
        # False once the mode has exited: a region whose forward ran inside the mode may
        # recompute after it (backward outside the `with`); with no ops recorded any more, that
        # recompute must not be compared, or it would look like it ran no random op at all.
        self.live = False
        # What was checked, for the report: regions entered, recomputes run, ops compared.
        self.stats = {"regions": 0, "recomputes": 0, "compared_ops": 0, "unpaired": 0}
        self._numbers = itertools.count(1)
        # Both passes of a region made between sampled steps, as one context torch enters for
        # its forward and again for each recompute (``context_fn`` returns it twice); a partial,
        # so making one costs no call of rngcheck's around the class's own.
        self.probed_passes: Callable[[Region], _ProbedPasses] = functools.partial(
            _ProbedPasses, self
        )
        # Both passes of a call between sampled steps that generator states cannot check (see
        # _RestoredPasses), from its function: no region is made for it.
        self.restored_passes: Callable[[Any], _RestoredPasses] = functools.partial(
            _RestoredPasses, self
        )
        self._modules = ModuleNames()
        # Module.train()/eval() calls on the modules of regions that wait for their recompute.
        self._switches = ModeSwitches(self._waiting_regions)
        self.probe: StateProbe | None = None  # level="step": generator states, between samples
        # Regions whose forward ended and whose recompute has not begun, by number (held
        # weakly: a graph freed without backward takes its regions with it; the dead ones are
        # dropped when asked, which costs less than a WeakSet's callbacks twice a region).
        self._waiting: dict[int, weakref.ReferenceType[Region | _RestoredPasses]] = {}

    @classmethod
    def installed(cls) -> RecomputeTracker | None:
        """The tracker whose hooks are in torch now (what a marked region reports to)."""
        return cls._installed

    @property
    def coverage_gaps(self) -> list[str]:
        """Why some checkpoint regions cannot be seen on this torch (the mode warns and notes)."""
        return self._patches.gaps

    def install(self) -> None:
        self.live = True
        self._patches.install()
        self._switches.install()
        RecomputeTracker._installed = self

    def uninstall(self) -> None:
        self.live = False
        self._switches.uninstall()
        self._patches.uninstall()
        if RecomputeTracker._installed is self:
            RecomputeTracker._installed = None

    # -- state queried on the hot path of random ops -------------------------------------------

    def active(self) -> bool:
        return bool(self._local.active)

    def waiting(self) -> bool:
        """Whether a checkpointed forward still waits for its recompute."""
        waiting = self._waiting
        for number, region in list(waiting.items()):
            if region() is not None:
                return True
            waiting.pop(number, None)  # (another thread may have dropped it first)
        return False

    def _waiting_regions(self) -> list[Region]:
        """The regions whose forward ended and whose recompute has not begun (not a
        _RestoredPasses, which records nothing)."""
        found = [ref() for ref in list(self._waiting.values())]
        return [r for r in found if isinstance(r, Region)]

    def _forward_ended(self, region: Region | _RestoredPasses) -> None:
        """A region's forward ended normally: it waits for its recompute."""
        waiting = self._waiting
        if len(waiting) >= _MAX_WAITING:  # forwards run without backward (evaluation)
            for number, alive in list(waiting.items()):
                if alive() is None:
                    waiting.pop(number, None)
            if len(waiting) >= _MAX_WAITING:
                waiting.clear()  # rather forget than grow: a switch is postponed less
        waiting[region.number] = weakref.ref(region)

    def _recompute_begins(self, region: Region, probing: bool) -> None:
        """A recompute of ``region`` begins, watched by generator states (``probing``) or op
        by op; one watched the other way than its forward has nothing to be compared with."""
        self._waiting.pop(region.number, None)
        stats = self.stats
        stats["recomputes"] += 1
        region.unpaired = region.by_probe is not probing
        if region.unpaired:
            stats["unpaired"] += 1

    def in_recompute(self) -> bool:
        return any(phase is RECOMPUTE for _, phase in self._local.active)

    def in_cached_recompute(self) -> bool:
        """Whether the innermost region is a selective checkpoint's recompute, whose cache may
        answer a random op without running it."""
        active = self._local.active
        return bool(active) and active[-1][1] is RECOMPUTE and active[-1][0].selective

    def innermost(self) -> str:
        # The title, with the user's line: cheap now that a region finds its site by a frame
        # walk when it is made (summarising a captured stack here cost ~45 us per region).
        active = self._local.active
        return active[-1][0].title if active else ""

    # -- regions ----------------------------------------------------------------------------------

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
    ) -> Region:
        """A region entered now (``devices``: those of ``args`` when not given)."""
        self.stats["regions"] += 1
        held, module = self._modules.held(function) if function is not None else (None, "")
        probe = self.probe
        # Between sampled steps a region of a layer is named by the layer (a dict lookup once
        # known) and its line is not looked for (walking to the user's frame was a fifth of a
        # region's cost there): the step after a finding, checked op by op, names the line.
        site = "" if module and probe is not None and probe.active else user_site()
        return Region(
            number=next(self._numbers),  # (unique across threads: waiting regions by number)
            kind=kind,
            name=name,
            site=site,
            module=module,
            held=held,
            preserve_rng_state=preserve_rng_state,
            devices=devices_of(args) if devices is None else devices,
            early_stop=early_stop,
        )

    def phase(self, region: Region, phase: Phase) -> _PhaseBlock:
        """A ``with`` block for one pass of ``region`` (a small class: it runs twice a region)."""
        return _PhaseBlock(self, region, phase)

    def on_event(self, event: RandomOpEvent) -> None:
        """Record a random op in every active region of this thread, in the innermost pass of
        each (a recompute that torch runs inside the region's own forward, for
        ``torch.autograd.grad`` in the checkpointed function, replays the forward's first ops:
        they are the recompute's, not more of the forward's); compare recomputes."""
        active = list(self._local.active)
        if len(active) > 1:
            innermost: dict[int, tuple[Region, Phase]] = {}
            for entry in active:
                innermost[id(entry[0])] = entry
            active = [entry for entry in active if innermost[id(entry[0])] is entry]
        for region, phase in active:
            if phase is FORWARD:
                if len(region.forward) < _MAX_REGION_OPS:
                    region.forward.append(event)
                else:
                    region.truncated = True
            else:
                region.recompute.append(event)
                if not (region.failed or region.unpaired):
                    self._compare(region, len(region.recompute) - 1)

    # -- comparison ------------------------------------------------------------------------------

    def _compare(self, region: Region, k: int) -> None:
        r = region.recompute[k]
        # Under expect("ignore") in the forward or in the recompute, an op is not compared (the
        # backward that recomputes usually runs outside the block that scoped the forward).
        if r.expect == "ignore" or (
            k < len(region.forward) and region.forward[k].expect == "ignore"
        ):
            return
        self.stats["compared_ops"] += 1
        if k >= len(region.forward):
            if region.truncated or region.replaying:
                return  # (a replay inside the forward runs ahead of it)
            self._mismatch(
                region,
                k,
                None,
                r,
                "op",
                f"the recompute ran random op #{k} ({r.op}) but the forward ran only "
                f"{len(region.forward)} random op(s) in this region",
                control_flow(region),
            )
            return
        f = region.forward[k]
        # Two outputs, one still on the device: compared at the recompute's end, fetched together.
        due = (
            f.output is not None and r.output is not None and (_waits(f.output) or _waits(r.output))
        )
        differs, detail = first_difference(f, r, outputs=not due)
        if differs:
            self._mismatch(region, k, f, r, differs, detail, likely_cause(region, k, f, r, differs))
        elif due:
            region.outputs_due.append(k)

    def _compare_outputs(self, region: Region) -> None:
        """Compare the outputs that waited on the device (one fetch per device): the first that
        differs is the region's mismatch, before any found after it."""
        due, region.outputs_due = region.outputs_due, []
        if not due or region.failed:
            return
        pairs = [(k, region.forward[k], region.recompute[k]) for k in due]
        resolve_all(e.output for _, f, r in pairs for e in (f, r))
        for k, f, r in pairs:
            differs, detail = output_difference(f, r)
            if differs:
                self._mismatch(
                    region, k, f, r, differs, detail, likely_cause(region, k, f, r, differs)
                )
                return

    def _check_complete(self, region: Region) -> None:
        if (
            region.failed
            or region.unpaired
            or region.truncated
            or len(region.recompute) >= len(region.forward)
        ):
            return
        k = len(region.recompute)
        f = region.forward[k]
        if f.expect == "ignore":
            return
        self._mismatch(
            region,
            k,
            f,
            None,
            "op",
            f"the recompute ended after {k} random op(s); the forward ran {len(region.forward)} "
            f"(the first one missing is {f.op})",
            control_flow(region),
        )

    def _mismatch(
        self,
        region: Region,
        k: int,
        f: RandomOpEvent | None,
        r: RandomOpEvent | None,
        differs: str,
        detail: str,
        cause: Likely,
    ) -> None:
        if region.outputs_due and k > region.outputs_due[0]:
            self._compare_outputs(region)  # an earlier op's output may be the first difference
            if region.failed:
                return
        region.failed = True
        if f is not None and f.seq in self._reported:
            return
        if r is not None:
            if len(self._reported) >= _MAX_REPORTED:  # replays happen in the same backward
                self._reported.clear()
            self._reported.add(r.seq)
        self._emit(mismatch_finding(region, k, f, r, differs, detail, *cause))


class _PhaseBlock:
    """One pass of a region: its random ops are recorded (or, at the step level between samples,
    its generators probed) while it runs."""

    __slots__ = ("_tracker", "_region", "_phase", "_entry", "_states")

    def __init__(self, tracker: RecomputeTracker, region: Region, phase: Phase) -> None:
        self._tracker = tracker
        self._region = region
        self._phase = phase
        self._entry: tuple[Region, Phase] | None = None
        self._states: Any = None

    def __enter__(self) -> None:
        tracker = self._tracker
        if not tracker.live:
            return
        region, phase = self._region, self._phase
        probe = tracker.probe
        probing = probe is not None and probe.active
        if phase is RECOMPUTE:
            tracker._recompute_begins(region, probing)
            if not probing:
                region.recompute = []
                # torch recomputes a region inside its own forward (torch.autograd.grad in the
                # checkpointed function): compared with what the forward ran so far only.
                region.replaying = (region, FORWARD) in tracker._local.active
        else:
            region.by_probe = probing  # (a region's forward runs once: its list is new)
        self._entry = entry = (region, phase)
        tracker._local.active.append(entry)
        if probing:
            self._states = probe.enter(region, phase)  # type: ignore[union-attr]

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        entry = self._entry
        if entry is None:
            return
        tracker, region = self._tracker, self._region
        active = tracker._local.active
        if active and active[-1] is entry:
            active.pop()
        else:
            _remove(active, entry)
        if self._phase is FORWARD:
            if exc_type is None:
                tracker._forward_ended(region)
        elif region.replaying:
            region.replaying = False  # the forward goes on: its length is not known yet
        elif exc_type is None and not region.by_probe:
            # Only a recompute that ran to its end must have run every random op of the
            # forward. A non-reentrant early stop leaves by _StopRecomputationError, and is a
            # correct prefix; any other exception is the user's (or a raised finding) and skips
            # this check too.
            tracker._check_complete(region)
        if self._phase is RECOMPUTE and region.outputs_due:
            tracker._compare_outputs(region)  # (an early stop's too: a correct prefix)
        if self._states is not None and tracker.probe is not None:
            tracker.probe.exit(region, self._phase, self._states, exc_type is None)


class _Passes:
    """Both passes of one checkpointed call made between sampled steps (level="step"), as the
    context torch's checkpoint enters for its forward and again for each recompute
    (``context_fn`` returns it twice); the first entry is the forward (a recompute may also run
    inside it: ``torch.autograd.grad`` in the checkpointed function). A pass that runs while
    ops are checked one by one is a :class:`_PhaseBlock`; a subclass says what its other passes
    do (``__enter__``, ``_ended``)."""

    __slots__ = ("_tracker", "_forward_ran", "_open")

    def __init__(self, tracker: RecomputeTracker) -> None:
        self._tracker = tracker
        self._forward_ran = False
        # The passes open now, innermost last: a subclass's record of one, or the _PhaseBlock
        # that runs it.
        self._open: list[Any] = []

    def __call__(self) -> tuple[_Passes, _Passes]:
        return self, self  # torch's context_fn: (the forward's context, the recompute's)

    def _block(self, region: Region, phase: Phase) -> None:
        block = _PhaseBlock(self._tracker, region, phase)
        self._open.append(block)
        block.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._open:
            return
        opened = self._open.pop()
        if isinstance(opened, _PhaseBlock):
            opened.__exit__(exc_type, exc, tb)
        else:
            self._ended(opened, exc_type is None)

    def _ended(self, opened: Any, completed: bool) -> None:
        raise NotImplementedError


class _ProbedPasses(_Passes):
    """Both passes of a region between sampled steps: its generators are probed and nothing else
    is recorded. No op is intercepted between samples, so a pass is not pushed on the thread's
    active regions either (their readers all run on intercepted ops; the level changes only at
    an optimizer step, never inside a pass). A pass that starts while ops are checked one by one
    (the level changed at an optimizer step in between: a GAN's) runs as a :class:`_PhaseBlock`,
    which leaves such a recompute unpaired."""

    __slots__ = ("_region",)

    def __init__(self, tracker: RecomputeTracker, region: Region) -> None:
        super().__init__(tracker)
        self._region = region

    def __enter__(self) -> None:
        tracker, region = self._tracker, self._region
        probe = tracker.probe
        forward = not self._forward_ran
        self._forward_ran = True
        if (
            probe is None
            or not probe.active
            or not tracker.live
            or not (forward or region.by_probe)
        ):
            self._block(region, FORWARD if forward else RECOMPUTE)
            return
        if forward:
            region.by_probe = True
            phase = FORWARD
        else:
            tracker._recompute_begins(region, probing=True)
            phase = RECOMPUTE
        self._open.append((phase, probe.enter(region, phase)))

    def _ended(self, opened: tuple[Phase, Any], completed: bool) -> None:
        phase, states = opened
        tracker, region = self._tracker, self._region
        if phase is FORWARD and completed:
            tracker._forward_ended(region)
        if states is not None and tracker.probe is not None:
            tracker.probe.exit(region, phase, states, completed)


class _RestoredPasses(_Passes):
    """Both passes of a torch.utils.checkpoint call between sampled steps that generator states
    cannot check: the one generator it can draw from is the CPU default, which torch stashes and
    restores for the recompute, and torch stops the recompute once the saved tensors are back
    (early stop). Both passes start in the same state by torch's own restore, and the
    recompute's end, where a different amount of draws would show, is never reached (a
    recompute that does reach it saved fewer tensors, which torch raises as an error itself).
    Only op-by-op checking can tell such a recompute's draws apart: sampled steps do.

    So nothing is read and no :class:`Region` is made. The forward still waits for its
    recompute, so that a switch to op-by-op checking waits for it too and a sampled step holds
    whole forwards and their recomputes (a GAN's generator, whose backward comes after its
    critic's steps, is checked op by op at all only so). A recompute that runs while ops are
    checked one by one all the same (the switch could wait no longer) is given a region there,
    unpaired, so its random ops are not taken for a region rngcheck did not see begin."""

    __slots__ = ("_function", "number", "__weakref__")

    def __init__(self, tracker: RecomputeTracker, function: Any) -> None:
        super().__init__(tracker)
        tracker.stats["regions"] += 1
        self._function = function
        self.number = next(tracker._numbers)  # (checkpoint #N counts the calls)

    def __enter__(self) -> None:
        if not self._forward_ran:
            self._forward_ran = True
            self._open.append(FORWARD)
            return
        tracker = self._tracker
        tracker._waiting.pop(self.number, None)
        probe = tracker.probe
        if not tracker.live or (probe is not None and probe.active):
            tracker.stats["recomputes"] += 1
            self._open.append(RECOMPUTE)
            return
        # Ops are checked one by one now: the forward was not, so nothing is compared; the
        # region is named by its layer only if known already (naming it from backward's frames
        # would lose the layer's qualified name for good).
        region = Region(
            number=self.number,
            kind="non-reentrant",
            site="",
            module=tracker._modules.known(self._function),
            early_stop=True,
            by_probe=True,
        )
        self._block(region, RECOMPUTE)

    def _ended(self, opened: Phase, completed: bool) -> None:
        if opened is FORWARD and completed and self._tracker.live:
            self._tracker._forward_ended(self)


def _remove(active: list[tuple[Region, Phase]], entry: tuple[Region, Phase]) -> None:
    for i in range(len(active) - 1, -1, -1):
        if active[i] is entry:
            del active[i]
            return


def _waits(output: Any) -> bool:
    """Whether an op's output digest still waits on its device."""
    return isinstance(output, LazyDigest) and output.pending
