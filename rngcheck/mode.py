"""RNGConsistencyMode: the public checker and the one place that composes the rest.

It owns the configuration, the events, the report and the lifecycle: it pushes the private
dispatch mode (``core/dispatch.py``) that only intercepts, starts the checks and hands each a small
handle (``core/handle.py``), never itself, and builds its parts (``session/``) and wires the checks
into them: the recorder (random ops: the hot path), the step control (the optimizer-step hook and
the level of each step) and the report's close (``closing.py``). Data flows one way: op -> event
(``core``) -> checks (``recompute``, ``ranks``) -> finding -> sink and report (``output``) ->
render. This module is also the one place that knows the active mode.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .core.config import Config, check_writable
from .core.dispatch import Intercepting, choose_route, make_interceptor
from .core.events import EventWindow, RandomOpEvent
from .core.findings import Finding, Note, RNGCheckCoverageWarning
from .core.generators import GeneratorRegistry
from .core.handle import CheckerHandle
from .core.rank_check import RankCheck
from .core.seeding import SeedCallLog
from .output.report import Report, ended_by
from .output.sink import FindingSink
from .output.trace import TraceFeed
from .recompute.compiled import CompiledRecomputes
from .recompute.held import HeldFindings
from .recompute.inferred import InferredRecomputes
from .recompute.probe import StateProbe
from .recompute.tracker import RecomputeTracker
from .session.closing import finalize, save_report, write_outputs
from .session.keeper import ReportKeeper
from .session.recorder import Recorder
from .session.steps import StepControl

__all__ = ["RNGConsistencyMode", "active_mode", "exchange_stats", "run_checked"]

log = logging.getLogger(__name__)

_ACTIVE: RNGConsistencyMode | None = None
_ACTIVE_LOCK = threading.Lock()


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
        report_path: a path to write this rank's JSON report to. It is kept current while the
            run goes (at each new finding, and every few seconds at exchanges and optimizer
            steps), so a process killed by a signal leaves its findings on disk; ``completed``
            in it is True once the checked block ended without an exception.
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
        route: how ops reach the checker. ``"selective"``: kernels for the random ops and
            collectives only, every other op runs as without the checker; ``"dispatch_mode"``: a
            ``TorchDispatchMode`` that sees every op (slower). ``"auto"`` (default): selective
            where this torch serves it, or the route the ``RNGCHECK_ROUTE`` variable names. The
            route taken is in the report's metadata (``route``). Both check the same.
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
        route: str = "auto",
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
            route=route,
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
        self._window = EventWindow(size=window)
        self._generators = GeneratorRegistry()
        self._seeds = SeedCallLog()
        # The optimizer-step hook and the level of each step (and so a finding's step).
        self._steps = StepControl(self.config, self._window, self._generators, self._seeds)
        self._sink = FindingSink(
            self._report, on_finding, console, ignore=self.config.ignore, step=self._steps.step_of
        )
        # The report on disk kept current while the run goes (no signal handler: keeper.py).
        self._keeper = ReportKeeper(
            self._save_now,
            lambda: self.config.report_path,
            lambda: (self._window.total, self._sink.occurrences, self._report.findings_dropped),
        )
        self._sink.recorded = self._keeper.finding
        self._keep_hook: Any = None
        self._interceptor: Intercepting | None = None
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
        self._thread = threading.get_ident()  # the thread whose dispatch stack the mode is on
        # level="step": the checkpoint probe between sampled steps, and its findings, held until
        # a step checked op by op names them
        self._probe: StateProbe | None = None
        self._held = (
            HeldFindings(self._sink.emit, lambda: self._steps.step_of(-1))
            if self.config.level == "step"
            else None
        )
        self._passes: Any = None  # across ranks: each data pass's first batch op by op (passes.py)
        # The random-op path: the hot path, with its own references to the checks (see _wire).
        self._recorder = Recorder(
            self._window,
            self._generators,
            self._seeds,
            self.config.expect,
            self._coverage_gap,
            self._load_xla,
        )
        self._wire()

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

            self._step_hook = register_optimizer_step_post_hook(self._steps.on_step)
            self._report.completed = False  # until the block ends without an exception
            self._keep_hook = register_optimizer_step_post_hook(self._keeper.progress)  # (after)
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
                    steps = self._steps
                    self._probe = StateProbe(
                        steps.probe_generators, held.between_samples, steps.request_escalation
                    )
                    self.recompute_tracker.probe = self._probe
            self._load_xla()
            self._ranks = self._start_ranks()
            if self.config.trace:
                self._trace = TraceFeed(self.config.trace, self._trace_meta)
            self._recorder.graph_hook.install()
            route, why = choose_route(self.config.route)
            self._report.meta["route"] = route
            if why:
                self._report.meta["route_fallback"] = why
            self._interceptor = make_interceptor(route, self._recorder.on_special)
            if self.recompute_tracker is not None:
                self.recompute_tracker.sees_first = route == "selective"
            self._wire()
            self._interceptor.__enter__()
            self._steps.start()
            self._keeper.start()
            self._keeper.save()  # on disk from the start: a killed process leaves one
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
                    self._steps.late_drift = last.step
            if self._held is not None:  # (after an exception: recorded, not raised)
                self._held.close(raising=exc_type is None)
        finally:
            # (a finding the last exchange raised still ran the checking to its end)
            self._report.completed = exc_type is None
            if exc is not None:  # (RNGCHECK=1 has named it already, in its own words)
                self._report.meta.setdefault("ended_by", ended_by(exc))
            self._teardown()

    def _teardown(self) -> None:
        global _ACTIVE
        self._keeper.stop()
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
            for hook in (self._step_hook, self._keep_hook):
                if hook is not None:
                    hook.remove()
            self._step_hook = self._keep_hook = None
            if self._xla is not None:
                self._xla.uninstall()
                self._xla = None
            self._seeds.uninstall()
            self._finalize_report()
            write_outputs(self._report, self._window, self.config, self._trace)
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
        """Hand the parts the checks, the trace and the interceptor as the mode now holds them
        (at construction, at ``__enter__``, when the rank check starts, when the interceptor is
        popped): they read their own references, never the mode's."""
        rec, steps = self._recorder, self._steps
        rec.tracker = steps.tracker = self.recompute_tracker
        rec.inferred = steps.inferred = self._inferred
        rec.ranks = steps.ranks = self._ranks
        rec.interceptor = steps.interceptor = self._interceptor
        rec.pid = steps.pid = self._pid
        rec.compiled, rec.trace = self._compiled, self._trace
        steps.held, steps.probe, steps.thread = self._held, self._probe, self._thread

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
            progress=self._keeper.progress,
        )

    def _start_ranks(self) -> RankCheck | None:
        if self.config.sync == "off":
            return None
        from .ranks.startup import start

        # Typed: here mypy proves that the RankChecker start() returns is a RankCheck.
        ranks: RankCheck | None = start(self._handle())
        if ranks is not None:
            self._sink.renders = ranks.renders  # one merged rendering across ranks
            if self._steps.schedule is not None:
                from .ranks.passes import PassStarts

                self._passes = PassStarts(self._steps.pass_window)
                self._passes.install()
        return ranks

    def bind_distributed(self) -> None:
        """Start the cross-rank checks now that torch.distributed is initialised.

        ``__enter__`` does this itself when the process group already exists; the environment
        activation calls it once the training script has initialised torch.distributed.
        Must be called on every rank of the group (it may create the checker's side group).
        """
        if self._entered and self._ranks is None:
            self._ranks = self._start_ranks()
            self._wire()
            self._steps.between = False  # the next switch tells the new checker the level, in full
            # The splits drawn before it, compared from here on: only from a window that still
            # holds every op drawn before (a rank that dropped some could not tell its splits).
            if self._ranks is not None and self._window.total == len(self._window.events):
                self._ranks.adopt_splits(self._window.events)

    def leave_forked_child(self) -> None:
        """In a forked child (a DataLoader worker) that inherited the running checker: stop seeing
        ops there (``rngcheck.env`` calls it after a fork; the parent goes on checking)."""
        if self._interceptor is not None:
            self._interceptor.leave_forked_child()

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
        finalize(
            self._report,
            self._window,
            self._recorder,
            self._steps,
            tracker=self.recompute_tracker,
            inferred=self._inferred,
            compiled=self._compiled,
            probe=self._probe,
            ranks=self._ranks,
            dropped=self._sink.dropped,
            running=self._interceptor is not None,
        )
        if self._keeper.saves:  # what keeping the report on disk cost (session/keeper.py)
            self._report.meta["report_saves"] = {
                "while_running": self._keeper.saves,
                "seconds": round(self._keeper.seconds, 4),
            }

    def _save_now(self, path: str) -> None:
        """The keeper's save: the report brought up to date and written while the run goes."""
        self._finalize_report()
        save_report(self._report, self._window, path, final=False)

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
