"""RNGConsistencyMode: the public checker and the one place that composes the rest.

It owns the configuration, the events and the report, pushes the private dispatch mode
(``core/dispatch.py``) that only intercepts, and hands each check a small handle
(``core/handle.py``), never itself. Data flows one way: op -> event (``core``) -> checks
(``recompute``, ``ranks``) -> finding -> sink and report (``output``) -> render. This module is
also the one place that knows the active mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from typing import Any

import torch

from .core.config import Config, check_writable
from .core.dispatch import Interceptor
from .core.events import EventWindow, RandomOpEvent
from .core.findings import Finding, Note, RNGCheckCoverageWarning
from .core.generators import GeneratorRegistry
from .core.handle import CheckerHandle
from .core.rank_check import RankCheck
from .core.schedule import StepEnds, StepSchedule
from .core.seeding import SeedCallLog
from .output.report import Report
from .output.sink import FindingSink
from .output.trace import TraceFeed, write_trace
from .recompute.compiled import CompiledRecomputes
from .recompute.held import HeldFindings
from .recompute.inferred import InferredRecomputes
from .recompute.probe import StateProbe
from .recompute.tracker import RecomputeTracker
from .session.recorder import MAX_NOTE_SITES, Recorder

__all__ = ["RNGConsistencyMode", "active_mode", "exchange_stats", "run_checked"]

log = logging.getLogger(__name__)

_ACTIVE: RNGConsistencyMode | None = None
_ACTIVE_LOCK = threading.Lock()
_TAKEOVER = 16  # steps of another optimizer, with none of the lead's, that make it the lead
# Rebuilt at every read of the report.
_DERIVED_NOTES = (
    "backward_random_ops",
    "comm_hook_random_ops",
    "findings_dropped",
    "learnt",
    "not_compared",
    "step_level_drift",
)
_PROBED_USERS = 8  # user generators a checkpoint region's probe reads at the step level


def active_mode() -> RNGConsistencyMode | None:
    """The RNGConsistencyMode active in this process, if any."""
    return _ACTIVE


class RNGConsistencyMode:
    """Checks every random op for RNG drift across ranks and between checkpoint passes.

    Use it as a context manager around training (or let ``RNGCHECK=1`` start it)::

        with rngcheck.RNGConsistencyMode() as mode:
            train()
        print(mode.report.ok)

    Args:
        group: the ranks that must agree by default: a ProcessGroup, a list of ranks, a DeviceMesh
            or mesh dimension names. None: the whole world. Only matters with several ranks.
        expect: the default expectation, ``"same"``, ``"differ"`` or ``"ignore"``.
        sync: when ranks exchange digests: ``"op"`` (at every random op, exact and blocking),
            ``"step"`` (at optimizer steps, every ``every_ops`` random ops, ``check()`` and exit)
            or ``"off"`` (no cross-rank check).
        on_finding: ``"raise"`` (render, then raise an RNGCheckError at the point of detection),
            ``"warn"`` (render and warn once per call site) or ``"record"`` (keep it in the report).
        check_recompute: compare each activation-checkpoint recompute with its forward.
        window: how many recent random-op events to keep in memory.
        every_ops: with ``sync="step"``, also exchange after this many random ops.
        every_steps: with ``sync="step"``, exchange at every Nth optimizer step only, so a long
            job can keep the checker on cheaply (random ops are still recorded at every step,
            and the first divergent op is still found exactly).
        timeout: seconds to wait for other ranks at an exchange before a ``rank_missing`` finding.
            None (the default): the process group's own timeout, the one torch.distributed's
            collectives give up at, so a rank that is slow but within it is never missing.
        trace: a path to write the random-op trace to at exit (for ``rngcheck diff``).
        report_path: a path to write this rank's JSON report to at exit.
        console: a ``rich.console.Console`` to render findings on (default: stderr).
        level: ``"op"`` (the default: every random op is intercepted and checked) or ``"step"``
            (cheap enough to leave on for a long job: op by op on sampled steps only, the first
            ``sample_first`` and then one in ``sample_every``, and from the step after any sign
            of trouble; the other steps run with no dispatch mode and check generator states at
            optimizer steps, across ranks, and at each checkpoint region's forward and recompute).
        sample_every: with ``level="step"``, check one optimizer step in this many op by op.
        sample_first: with ``level="step"``, check the first optimizer steps op by op.
        strict: across ranks, learn nothing from a mismatch: a generator seeded per rank, or a
            line that draws each rank's own arguments or counts, in a data-parallel program, is
            then a finding, not a per-rank stream (for CI, where a test wants every difference
            reported). The scopes rngcheck knows (a wrapper's forward, a sampler's order) and
            ``expect(...)`` still hold.
        ignore: known findings to leave out, by kind and/or the user's site: a list of
            ``"recompute_mismatch@modeling_foo.py:120"``, ``"rank_divergence"`` or
            ``"@train.py:40"`` (any line of a file: ``"@train.py"``). They are counted in the
            report as ignored. To leave ops unchecked in code, use ``rngcheck.expect("ignore")``.
        every: the former name of ``every_ops`` (deprecated).

    Known limitations:
        Random ops on threads that did not enter the mode are not intercepted (their effect on a
        shared generator shows as an out-of-band change). ``Generator.manual_seed``/``set_state``
        on user generators are seen as changes without a call site. A compiled graph's random
        ops are checked together, as one draw per call of the graph (torch.compile). Seeding
        functions imported by name before the mode started (``from torch import manual_seed``)
        are not attributed.
    """

    def __init__(
        self,
        *,
        group: Any = None,
        expect: str = "same",
        sync: str = "step",
        on_finding: str = "raise",
        check_recompute: bool = True,
        window: int = 4096,
        every_ops: int = 1024,
        every_steps: int = 1,
        timeout: float | None = None,
        trace: str | None = None,
        report_path: str | None = None,
        console: Any = None,
        ignore: Any = (),
        level: str = "op",
        sample_every: int = 100,
        sample_first: int = 2,
        strict: bool = False,
        every: int | None = None,
    ) -> None:
        if every is not None:
            warnings.warn(
                "RNGConsistencyMode(every=...) is now every_ops=...; every= will be removed",
                DeprecationWarning,
                stacklevel=2,
            )
            every_ops = every
        self.config = Config(
            group=group,
            expect=expect,
            sync=sync,
            on_finding=on_finding,
            check_recompute=check_recompute,
            window=window,
            every_ops=every_ops,
            every_steps=every_steps,
            timeout=timeout,
            trace=trace,
            report_path=report_path,
            ignore=ignore,
            level=level,
            sample_every=sample_every,
            sample_first=sample_first,
            strict=strict,
        )
        if console is not None:
            from rich.console import Console

            if not isinstance(console, Console):
                raise ValueError(
                    "console must be a rich.console.Console to draw findings on (e.g. "
                    f"Console(stderr=True)), or None for stderr; got {console!r}"
                )
        self.console = console
        self._report = Report()
        # Random ops drawn by the end of each optimizer step: a finding's step.
        self._step_ends = StepEnds()
        self._in_step_hook = False
        self._sink = FindingSink(
            self._report, on_finding, console, ignore=self.config.ignore, step=self._step_of
        )
        self._window = EventWindow(size=window)
        self._generators = GeneratorRegistry()
        self._seeds = SeedCallLog()
        self._interceptor: Interceptor | None = None
        self.recompute_tracker: RecomputeTracker | None = None
        self._inferred: InferredRecomputes | None = None
        self._compiled: CompiledRecomputes | None = None
        self._step_hook: Any = None
        self._ranks: RankCheck | None = None
        self._trace: TraceFeed | None = None
        self._ended_by: BaseException | None = None  # what ended the block (at __exit__)
        self._xla: Any = None  # torch_xla's checkpoint patch, once torch_xla is imported
        self._xla_loaded = False
        self._entered = False
        self._pid = os.getpid()
        # level="step": which steps run op by op, the checkpoint probe between them, and what
        # the step level saw (escalations wished for here, drifts the ranks agreed on).
        cfg = self.config
        self._schedule = (
            StepSchedule(cfg.sample_every, cfg.sample_first) if cfg.level == "step" else None
        )
        self._probe: StateProbe | None = None
        # level="step": the probe's findings, held until a step checked op by op names them
        self._held = (
            HeldFindings(self._sink.emit, lambda: self._step_of(-1))
            if self._schedule is not None
            else None
        )
        self._probe_cache: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._want_escalation = False
        self._drifts: list[int] = []  # steps whose generators drifted apart across ranks
        self._late_drift = 0  # a drift the last round showed, after the last step
        self._stuck_steps = 0  # steps that stayed op by op (another dispatch mode above ours)
        self._passes: Any = None  # across ranks: each data pass's first batch op by op (passes.py)
        self._in_pass_window = False
        # A training step ends at a step of the lead optimizer (see _on_step); the others that
        # stepped since its last step, held weakly.
        self._lead: weakref.ReferenceType[Any] | None = None
        # Across ranks: the lead's parameters, when it trains a data-parallel wrapper's or a
        # pipeline stage's (read as it became the lead; see _takes_over), else None.
        self._lead_replicas: Collection[Any] | None = None
        # id -> (the optimizer, weakly; its steps since the lead's last step)
        self._since_lead: dict[int, tuple[weakref.ReferenceType[Any], int]] = {}
        self._thread = threading.get_ident()  # the thread whose dispatch stack the mode is on
        # A level switch held back while a checkpointed forward waits for its recompute:
        # (op level, rebased slots), applied at the next optimizer step with none waiting.
        self._postponed: tuple[bool, tuple[int, ...]] | None = None
        self._postponements = 0
        # The last switch went between samples with no drifted slot, and it held: a switch
        # that stays there has nothing to change (the common step at level="step").
        self._between = False
        # The random-op path: the hot path, with its own references to the checks (see _wire).
        self._recorder = Recorder(
            self._window,
            self._generators,
            self._seeds,
            self.config.expect,
            self._coverage_gap,
            self._load_xla,
        )

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> RNGConsistencyMode:
        global _ACTIVE
        with _ACTIVE_LOCK:
            if self._entered:
                raise RuntimeError(
                    "this RNGConsistencyMode is already active; it cannot be entered again while "
                    "it runs. Use one `with` block around the code to check."
                )
            if _ACTIVE is not None:
                raise RuntimeError(
                    "another RNGConsistencyMode is already active in this process (RNGCHECK=1 "
                    "or the pytest --rngcheck option may have started one); exit it before "
                    "entering a new one, or use rngcheck.active_mode() to reach it."
                )
            for name in ("report_path", "trace"):  # fail now, not after hours of training
                path = getattr(self.config, name)
                if path:
                    check_writable(name, path)
            self._entered = True
            self._pid = os.getpid()
            self._thread = threading.get_ident()
            _ACTIVE = self
        try:
            self._seeds.install()
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._step_hook = register_optimizer_step_post_hook(self._on_step)
            if self.config.check_recompute:
                held = self._held
                emit = held.op_by_op if held is not None else self._sink.emit
                self.recompute_tracker = RecomputeTracker(emit, self._recorder.record_cached)
                self.recompute_tracker.install()
                for gap in self.recompute_tracker.coverage_gaps:
                    self._coverage_gap(gap)
                self._inferred = InferredRecomputes(emit, self.config.window)
                self._compiled = CompiledRecomputes(emit)
                if held is not None:
                    self._probe = StateProbe(
                        self._probe_generators, held.between_samples, self._request_escalation
                    )
                    self.recompute_tracker.probe = self._probe
            self._load_xla()
            self._ranks = self._start_ranks()
            if self.config.trace:
                self._trace = TraceFeed(self.config.trace, self._trace_meta)
            self._recorder.graph_hook.install()
            self._interceptor = Interceptor(self._recorder.on_special)
            self._wire()
            self._interceptor.__enter__()
            if self._schedule is not None:
                self._schedule.start()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._ended_by = exc
        try:
            if self._interceptor is not None:
                self._interceptor.__exit__(exc_type, exc, tb)
                self._interceptor = None
                self._wire()
            # The final exchange only when the block ended normally: after an exception, other
            # ranks may never arrive, and the user's exception is the one to see.
            if self._ranks is not None and exc_type is None:
                last = self._ranks.finish()
                if last is not None and last.drifted:  # too late to check a step op by op
                    self._late_drift = last.step
            if self._held is not None:  # (after an exception: recorded, not raised)
                self._held.close(raising=exc_type is None)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        global _ACTIVE
        try:
            if self._interceptor is not None:
                self._interceptor.__exit__(None, None, None)
                self._interceptor = None
                self._wire()
            self._recorder.graph_hook.uninstall()
            if self._passes is not None:
                self._passes.uninstall()
                self._passes = None
            if self._ranks is not None:
                self._ranks.close(self._ended_by)
            if self.recompute_tracker is not None:
                self.recompute_tracker.uninstall()
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            if self._xla is not None:
                self._xla.uninstall()
                self._xla = None
            self._seeds.uninstall()
            self._finalize_report()
            self._write_outputs()
            self._sink.close()
        finally:
            with _ACTIVE_LOCK:
                if _ACTIVE is self:
                    _ACTIVE = None
                self._entered = False

    def _load_xla(self) -> bool:
        """Load the torch_xla support once torch_xla is imported: at ``__enter__``, or at the first
        XLA random op when the mode started first (``RNGCHECK=1`` starts it before any import).
        Never imports torch_xla itself: that starts an XLA runtime."""
        if not self._xla_loaded and "torch_xla" in sys.modules:
            from .core import xla  # noqa: F401 - registers the XLA seed's adapter and seeding APIs

            self._xla_loaded = True
            self._seeds.install()  # watch the XLA seeding APIs too (installs only the new ones)
            if self.recompute_tracker is not None:
                from .recompute.xla import XlaCheckpointPatch

                self._xla = XlaCheckpointPatch(self.recompute_tracker).install()
        return self._xla_loaded

    def _wire(self) -> None:
        """Hand the recorder the checks, the trace and the interceptor as the mode now holds
        them (at ``__enter__``, when the rank check starts, when the interceptor is popped): it
        reads its own references per random op, never the mode's."""
        rec = self._recorder
        rec.tracker, rec.inferred, rec.compiled = (
            self.recompute_tracker,
            self._inferred,
            self._compiled,
        )
        rec.trace, rec.ranks = self._trace, self._ranks
        rec.interceptor, rec.pid = self._interceptor, self._pid

    def _handle(self) -> CheckerHandle:
        def identify(rank: int, world: int) -> None:
            self._report.rank, self._report.world_size = rank, world

        return CheckerHandle(
            config=self.config,
            emit=self._sink.emit,
            seeding_calls=self._seeds.since,
            meta=self._report.meta,
            identify=identify,
            coverage=self._coverage_gap,
        )

    def _start_ranks(self) -> RankCheck | None:
        if self.config.sync == "off":
            return None
        from .ranks.startup import start

        # Typed: here mypy proves that the RankChecker start() returns is a RankCheck.
        ranks: RankCheck | None = start(self._handle())
        if ranks is not None:
            self._sink.renders = ranks.renders  # one merged rendering across ranks
            if self._schedule is not None:
                from .ranks.passes import PassStarts

                self._passes = PassStarts(self._pass_window)
                self._passes.install()
        return ranks

    @contextlib.contextmanager
    def _pass_window(self) -> Iterator[None]:
        """level="step", between samples: a DataLoader iterator asks its sampler for a pass's
        first indices (passes.py). Op by op on this thread meanwhile, so the rank checker sees
        the order the sampler draws; user generators first met here are forgotten after (a
        sampler may make one per pass, as torch's DistributedSampler does: not read at every
        step from then on)."""
        ranks, interceptor = self._ranks, self._interceptor
        if (
            self._in_pass_window
            or ranks is None
            or interceptor is None
            or not ranks.wants_passes
            or threading.get_ident() != self._thread
            or os.getpid() != self._pid
        ):
            yield
            return
        resumed = interceptor.suspended  # (else another mode above ours kept it on the stack)
        if resumed:
            interceptor.resume()
        self._in_pass_window = True
        known = self._generators.user_count
        try:
            if resumed:
                self._after_gap()
            ranks.pass_window(True)
            yield
        finally:
            ranks.pass_window(False)
            self._generators.forget_after(known)
            self._in_pass_window = False
            if resumed:
                interceptor.suspend()

    def bind_distributed(self) -> None:
        """Start the cross-rank checks now that torch.distributed is initialised.

        ``__enter__`` does this itself when the process group already exists; the environment
        activation calls it once the training script has initialised torch.distributed.
        Must be called on every rank of the group (it may create the checker's side group).
        """
        if self._entered and self._ranks is None:
            self._ranks = self._start_ranks()
            self._wire()
            self._between = False  # the next switch tells the new checker the level, in full
            # The splits drawn before it, compared from here on: only from a window that still
            # holds every op drawn before (a rank that dropped some could not tell its splits).
            if self._ranks is not None and self._window.total == len(self._window.events):
                self._ranks.adopt_splits(self._window.events)

    def check(self) -> Report:
        """Exchange with the other ranks now (with several ranks) and return the report.

        With several ranks this is a collective: call it on every rank of the group, at the same
        point (a rank that calls it alone is reported as reaching a different exchange point).
        """
        if self._ranks is not None:
            self._ranks.check()
        return self.report

    def renders(self, finding: Finding) -> bool:
        """Whether this process draws ``finding`` (with several ranks, the lowest rank involved
        draws it, once)."""
        return self._sink.renders(finding)

    def _on_step(self, optimizer: Any, *_: Any) -> None:
        """The one optimizer-step hook: the checks' step work, in one order on every rank.

        A training step ends at a step of the lead optimizer: the first one seen to step, until
        another steps ``_TAKEOVER`` times without it in between (the lead stopped: a second
        training stage with a new optimizer; a GAN's critic stepping 5 times per generator
        step does not take over). A program that steps several optimizers per iteration (Muon
        beside AdamW, a GAN's two networks, a wrapper around an inner optimizer, one optimizer
        per parameter) runs one training step per iteration, not one per optimizer. The rule
        reads only the order of the steps, the same on every rank (not when an optimizer is
        garbage-collected, which may differ)."""
        lead = self._lead() if self._lead is not None else None
        if self._lead is None or (lead is not optimizer and self._takes_over(optimizer)):
            self._lead = weakref.ref(optimizer)
            ranks = self._ranks
            self._lead_replicas = ranks.replicas_trained(optimizer) if ranks is not None else None
        elif lead is not optimizer:
            if (
                self._postponed is not None
                and threading.get_ident() == self._thread
                and not self._regions_waiting()
            ):
                postponed, self._postponed = self._postponed, None
                self._switch(*postponed)
            return
        self._since_lead.clear()
        self._step_ends.end_step(self._window.total)
        self._in_step_hook = True  # what is found here belongs to the step that just ended
        interceptor = self._interceptor
        ran_op_by_op = interceptor is not None and not interceptor.suspended
        try:
            if self._inferred is not None:
                self._inferred.on_step()
            if self._ranks is not None:
                self._ranks.on_step(optimizer)
            # (a step after a rank ran out of inputs in torch's Join counts on no rank: the
            # ranks' schedules stay the same, and it runs at the level it began at)
            apart = self._ranks is not None and self._ranks.apart
            if self._schedule is not None and interceptor is not None and not apart:
                self._next_step(self._schedule, interceptor)
            if self._held is not None:  # last: its findings may raise
                self._held.step_ended(len(self._step_ends), ran_op_by_op)
        finally:
            self._in_step_hook = False

    def _takes_over(self, optimizer: Any) -> bool:
        """Count a step of ``optimizer`` (not the lead) since the lead's last step; True when
        it has now made ``_TAKEOVER`` of them."""
        since = self._since_lead
        known = since.get(id(optimizer))
        count = known[1] + 1 if known is not None and known[0]() is optimizer else 1
        if len(since) > 65536:  # a new optimizer per step, and a lead that stopped
            since.clear()
        since[id(optimizer)] = (weakref.ref(optimizer), count)
        if count < _TAKEOVER:
            return False
        # Across ranks, an optimizer that one rank steps alone (a linear probe rank 0 trains for
        # its logs) must not move that rank's training steps away from the others': where the
        # lead trains a data-parallel wrapper's parameters, only one that does too takes over.
        # Read from what the lead trained as it became the lead, never from whether it (or a
        # wrapper) was garbage-collected since, which may differ across the ranks.
        ranks, held = self._ranks, self._lead_replicas
        return ranks is None or held is None or ranks.trains_replicas(optimizer, held)

    # -- level="step" ------------------------------------------------------------------------

    def _next_step(self, schedule: StepSchedule, interceptor: Interceptor) -> None:
        """Decide how the coming step is checked (the same on every rank) and switch to it."""
        want, self._want_escalation = self._want_escalation, False
        sampled = schedule.current_op_level
        # Across ranks: every ``every_steps``-th step (each step by default) and every sampled
        # one (the baseline); the same steps on every rank.
        if self._ranks is not None and (sampled or schedule.step % self.config.every_steps == 0):
            verdict = self._ranks.step_level(
                schedule.step, self._generators.tracked(), want, sampled
            )
            if verdict is not None and verdict.drifted and len(self._drifts) < MAX_NOTE_SITES:
                self._drifts.append(verdict.step)
            schedule.escalate = verdict is not None and verdict.escalate
        elif self._ranks is not None:  # escalating is agreed on: ask at the next exchange
            verdict = None
            self._want_escalation = want
            schedule.escalate = False
        else:
            verdict = None
            schedule.escalate = want
        held, self._postponed = self._postponed, None
        if self._ranks is None:
            # The step that ends may have run at another level than decided (a switch held back
            # or not possible on another thread): record what ran. (Across ranks the schedule
            # stays the agreed one: it decides which collectives a rank posts.)
            schedule.ran(op_level=not interceptor.suspended)
        op_level = schedule.advance()
        drifted = verdict.drifted if verdict is not None else ()
        # In one process, a switch that would split a checkpointed forward from its recompute
        # (a GAN steps its discriminator between them) waits for the next optimizer step, at
        # most to the next training step. Not across ranks: what waits is each rank's own, and
        # the level decides which collectives a rank posts; there such a recompute is unpaired.
        if (
            self._ranks is None
            and held is None
            and op_level is interceptor.suspended
            and self._regions_waiting()
        ):
            self._postponed = (op_level, drifted)
            self._postponements += 1
            return
        self._switch(op_level, drifted)

    def _regions_waiting(self) -> bool:
        tracker = self.recompute_tracker
        return tracker is not None and tracker.waiting()

    def _switch(self, op_level: bool, drifted: tuple[int, ...]) -> None:
        """Check the coming steps op by op (``op_level``) or by generator states; ``drifted``:
        the digest slots the ranks found drifted apart."""
        interceptor = self._interceptor
        if interceptor is None:
            return
        if self._between and not op_level and not drifted and interceptor.suspended:
            return  # between samples, and staying there: what the last switch set holds
        self._between = False
        if self._ranks is not None:
            self._ranks.set_checking(op_level, drifted)
        if threading.get_ident() != self._thread:
            # An optimizer stepped on another thread (one in backward, on an autograd device
            # thread): the dispatch stack is per thread, so the level stays as it is.
            if op_level is interceptor.suspended:
                self._stuck_steps += 1
            return
        if op_level:
            if interceptor.suspended:
                interceptor.resume()
                self._after_gap()
            if self._probe is not None:
                self._probe.active = False
            self._seeds.quiet = False
        elif interceptor.suspend():
            if self._probe is not None:
                self._probe.active = True
            self._seeds.quiet = True
            self._between = not drifted
        else:
            self._stuck_steps += 1  # another mode above ours: this step stays op by op

    def _request_escalation(self) -> None:
        """The checkpoint probe found a mismatch: check the next step op by op."""
        self._want_escalation = True

    def _after_gap(self) -> None:
        """Back to op by op after unchecked steps: the generators moved unseen meanwhile. Their
        last known state is kept only where a user's seeding call explains the change."""
        for t in self._generators.tracked():
            calls = self._seeds.since(t.seed_mark, t.ident.device)
            if not any(not c.by_torch for c in calls):
                t.last_after = None

    def _probe_generators(self, devices: tuple[str, ...]) -> tuple[Any, ...]:
        """The generators a checkpoint region can draw from: the defaults of the CPU and of the
        region's devices, and the user generators used most recently (one tuple per device set
        while the registry adds nothing)."""
        registry = self._generators
        key = (devices, registry.version)
        found = self._probe_cache.get(key)
        if found is None:
            out: list[Any] = []
            for device in ("cpu", *devices):
                t = registry.default(torch.device(device))
                if t is not None and t not in out:
                    out.append(t)
            found = tuple(out + registry.recent_users(_PROBED_USERS))
            if len(self._probe_cache) > 64:
                self._probe_cache.clear()
            self._probe_cache[(devices, registry.version)] = found  # default() may have added
        return found

    def _step_of(self, seq: int) -> int:
        """The optimizer step (1-based) that drew random op ``seq``; the current one for -1."""
        ends = self._step_ends
        if seq < 0:
            return len(ends) + (0 if self._in_step_hook else 1)
        return ends.step_of(seq)

    # -- results -------------------------------------------------------------------------------

    @property
    def report(self) -> Report:
        self._finalize_report()
        return self._report

    @property
    def events(self) -> list[RandomOpEvent]:
        """The most recent random-op events (up to ``window`` of them), oldest first."""
        return list(self._window.events)

    def _finalize_report(self) -> None:
        """Bring the report's counters and derived notes up to date (reading never adds twice)."""
        r = self._report
        r.random_ops = self._window.total
        r.ops_by_name = dict(self._window.by_op)
        r.ops_by_generator = dict(self._window.by_generator)
        if self._step_ends:
            r.meta["optimizer_steps"] = len(self._step_ends)
        elif any(f.first_step for f in r.findings):  # no optimizer steps: no step to tell
            r.findings = [replace(f, first_step=0, last_step=0) for f in r.findings]
        if self.recompute_tracker is not None:
            r.meta["recompute"] = dict(self.recompute_tracker.stats)
        if self._ranks is not None:
            self._ranks.publish()
        if self._inferred is not None and self._inferred.stats["regions"]:
            r.meta["inferred_recompute"] = dict(self._inferred.stats)
        if self._compiled is not None and self._compiled.stats["forward_draws"]:
            r.meta["compiled"] = dict(self._compiled.stats)
        if self._schedule is not None:
            levels = self._schedule.summary()
            if self._probe is not None:
                levels["checkpoint_probe"] = dict(self._probe.stats)
            levels["drifted_at_steps"] = list(self._drifts) + (
                [self._late_drift] if self._late_drift else []
            )
            levels["stayed_op_level_steps"] = self._stuck_steps
            if self._ranks is not None:  # orders drawn as passes over the data began (passes.py)
                levels["data_passes_compared"] = self._ranks.passes_compared
            # Switches held back while a checkpointed forward waited for its recompute.
            levels["postponed_switches"] = self._postponements
            r.meta["level"] = levels
        notes = [n for n in r.notes if n.kind not in _DERIVED_NOTES]
        for site, (count, stack, op) in self._recorder.backward_sites.items():
            notes.append(
                Note(
                    kind="backward_random_ops",
                    message=(
                        f"{count} random op(s) ({op}) ran during backward at {site}, outside any "
                        "checkpoint region rngcheck knows and re-running no random op of the "
                        "forward. Fresh randomness in backward is how rematerialised graphs "
                        "redraw dropout (pytorch issue 190758); if this is a recompute, mark it "
                        "with rngcheck.checkpoint_region."
                    ),
                    count=count,
                    stack=stack,
                )
            )
        if self._recorder.hook_draws:
            from .ranks.explain import sketch_note

            notes += [sketch_note(hook, count) for hook, count in self._recorder.hook_draws.items()]
        if self._ranks is not None:
            notes.extend(self._ranks.notes())
        if self._drifts:
            steps = ", ".join(map(str, self._drifts[:8])) + (
                ", ..." if len(self._drifts) > 8 else ""
            )
            notes.append(
                Note(
                    kind="step_level_drift",
                    message=(
                        f"generators drifted apart across ranks between sampled steps (seen at "
                        f"step(s) {steps}); the following steps were checked op by op, where the "
                        "op level judged them (a data-parallel program may draw per-rank amounts "
                        "on purpose)."
                    ),
                    count=len(self._drifts),
                )
            )
        if self._late_drift:
            notes.append(
                Note(
                    kind="step_level_drift",
                    message=(
                        f"generators drifted apart across ranks at step {self._late_drift}, "
                        "between sampled steps, in the last steps of the run: it ended before a "
                        "step could be checked op by op, so what drew differently is not named "
                        "(a data-parallel program may draw per-rank amounts on purpose)."
                    ),
                )
            )
        if self._sink.dropped:
            notes.append(
                Note(
                    kind="findings_dropped",
                    message=f"{self._sink.dropped} further finding(s) were not kept.",
                    count=self._sink.dropped,
                )
            )
        r.notes = notes

    def _move_outputs(self, report_path: str | None, trace: str | None) -> None:
        """Write this rank's report and trace elsewhere (RNGCHECK=1 learns a process's rank at
        bind when its launcher set no RANK). The trace streams to a temporary file until exit,
        so nothing written so far moves."""
        self.config = replace(self.config, report_path=report_path, trace=trace)
        if self._trace is not None and trace is not None:
            self._trace.move(trace)

    def _trace_meta(self) -> dict[str, Any]:
        meta = dict(self._report.meta)
        meta.setdefault("rank", self._report.rank)
        meta.setdefault("world_size", self._report.world_size)
        return meta

    def _write_outputs(self) -> None:
        if self.config.report_path:
            # A saved report is read after the run: keep the events around each finding with it.
            around = self._window.around
            self._report.findings = [
                f if f.context or f.seq < 0 else replace(f, context=tuple(around(f.seq)))
                for f in self._report.findings
            ]
            try:
                self._report.save(self.config.report_path)
            except OSError as e:
                self._output_failed("report", self.config.report_path, e)
        if self.config.trace:
            try:
                # The whole stream, streamed to disk as it ran, not just the window.
                stream = self._trace.stream() if self._trace is not None else []
                write_trace(self.config.trace, stream, self._report)
            except OSError as e:
                self._output_failed("trace", self.config.trace, e)

    @staticmethod
    def _output_failed(what: str, path: str, error: OSError) -> None:
        from .core.findings import RNGCheckWarning

        warnings.warn(
            f"rngcheck could not write its {what} to {path}: {error}", RNGCheckWarning, stacklevel=4
        )

    def _coverage_gap(self, what: str) -> None:
        """Something rngcheck was asked to check and cannot: a loud warning and a report note,
        once each, never silence (a user must not believe an unchecked run is clean)."""
        self._report.notes.append(Note(kind="not_checked", message=what))
        warnings.warn(f"rngcheck: {what}.", RNGCheckCoverageWarning, stacklevel=2)


def run_checked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Run ``fn(*args, **kwargs)`` under a recording RNGConsistencyMode and return its report.

    Meant for plain assertions in tests: ``assert rngcheck.run_checked(step).ok``.
    """
    with RNGConsistencyMode(on_finding="record") as mode:
        fn(*args, **kwargs)
    return mode.report


def exchange_stats(mode: RNGConsistencyMode | None = None) -> dict[str, int]:
    """The cross-rank exchange counters of ``mode`` (default: the active mode), as plain data."""
    mode = mode if mode is not None else active_mode()
    if mode is None:
        return {}
    return dict(mode.report.meta.get("rank_exchange", {}))
