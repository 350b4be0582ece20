"""The report at its close: the counters, metadata and notes of what the run saw, brought up to
date each time the report is read (``mode.report``, the saves while the run goes and at exit), and
the report and trace written at exit.

Reading never adds twice: the counters and metadata are set, not added to, and the notes derived
here (``DERIVED_NOTES``) are dropped and rebuilt from what the parts and the checks hold now.
Notes the run appended itself (a coverage gap, ``not_checked``) are kept as they are.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..core.config import Config
from ..core.events import EventWindow
from ..core.findings import Note, RNGCheckWarning
from ..core.rank_check import RankCheck
from ..output.report import Report
from ..output.trace import TraceFeed, write_trace
from ..recompute.compiled import CompiledRecomputes
from ..recompute.inferred import InferredRecomputes
from ..recompute.probe import StateProbe
from ..recompute.tracker import RecomputeTracker

if TYPE_CHECKING:  # (they import this module's MAX_NOTE_SITES)
    from .recorder import Recorder
    from .steps import StepControl

__all__ = ["DERIVED_NOTES", "MAX_NOTE_SITES", "finalize", "save_report", "write_outputs"]

_CONTEXT_AFTER = 2  # the events after a finding's op that its context holds
MAX_NOTE_SITES = 64  # distinct sites a note keeps (backward's draws; steps drifted apart)
# Rebuilt at every read of the report.
DERIVED_NOTES = (
    "backward_random_ops",
    "comm_hook_random_ops",
    "drew_from_default",
    "findings_dropped",
    "learnt",
    "not_compared",
    "route_healed",
    "step_level_drift",
)


def finalize(
    report: Report,
    window: EventWindow,
    recorder: Recorder,
    steps: StepControl,
    *,
    tracker: RecomputeTracker | None,
    inferred: InferredRecomputes | None,
    compiled: CompiledRecomputes | None,
    probe: StateProbe | None,
    ranks: RankCheck | None,
    dropped: int,
    running: bool = False,
) -> None:
    """Bring ``report``'s counters, metadata and derived notes up to date. The checks are the
    mode's (None where not started); ``dropped``: findings the sink did not keep; ``running``:
    read while the block still runs (a report kept on disk, ``mode.report`` inside the block),
    where a run without an optimizer step so far may still have one."""
    r = report
    r.random_ops = window.total
    r.ops_by_name = dict(window.by_op)
    r.ops_by_generator = dict(window.by_generator)
    if steps.ended:
        r.meta["optimizer_steps"] = len(steps.ended)
    elif not running and any(f.first_step for f in r.findings):  # no optimizer steps at all
        r.findings = [replace(f, first_step=0, last_step=0) for f in r.findings]
    if tracker is not None:
        r.meta["recompute"] = dict(tracker.stats)
    if ranks is not None:
        ranks.publish()
    if inferred is not None and inferred.stats["regions"]:
        r.meta["inferred_recompute"] = dict(inferred.stats)
    if compiled is not None and compiled.stats["forward_draws"]:
        r.meta["compiled"] = dict(compiled.stats)
    if steps.schedule is not None:
        r.meta["level"] = _levels(steps.schedule.summary(), steps, probe, ranks)
    notes = [n for n in r.notes if n.kind not in DERIVED_NOTES]
    notes += _backward_notes(recorder.backward_sites)
    notes += _instead_notes(recorder.drew_instead)
    if recorder.hook_draws:
        from ..ranks.explain import sketch_note

        notes += [sketch_note(hook, count) for hook, count in recorder.hook_draws.items()]
    if ranks is not None:
        notes.extend(ranks.notes())
    notes += _drift_notes(steps.drifts, steps.late_drift)
    if steps.healed:
        notes.append(_healed_note(steps.healed))
    if dropped:
        notes.append(
            Note(
                kind="findings_dropped",
                message=f"{dropped} further finding(s) were not kept.",
                count=dropped,
            )
        )
    r.notes = notes


def write_outputs(
    report: Report, window: EventWindow, config: Config, trace: TraceFeed | None
) -> None:
    """At exit: save the report to ``config.report_path`` and write the trace to ``config.trace``,
    where set. A file that cannot be written is a warning, not an error."""
    if config.report_path:
        try:
            save_report(report, window, config.report_path, final=True)
        except OSError as e:
            _output_failed("report", config.report_path, e)
    if config.trace:
        try:
            # The whole stream, streamed to disk as it ran, not just the window.
            stream = trace.stream() if trace is not None else []
            write_trace(config.trace, stream, report)
        except OSError as e:
            _output_failed("trace", config.trace, e)


def save_report(report: Report, window: EventWindow, path: str, *, final: bool) -> None:
    """Save ``report`` (brought up to date by the caller) at ``path``, atomically, with the
    events around each finding and the time of the save (``meta["saved_at"]``). ``final``: at
    the end of the run, when every finding takes its context for good; while the run goes
    (:mod:`.keeper`), a finding keeps its context only once the window holds the events after
    it too, and the file gets the context as far as it goes. Raises OSError."""
    around = window.around
    newest = window.total - 1
    findings = []
    for i, f in enumerate(report.findings):
        if not f.context and f.seq >= 0:
            f = replace(f, context=tuple(around(f.seq, after=_CONTEXT_AFTER)))
            if final or f.seq + _CONTEXT_AFTER <= newest:  # its context is whole: keep it
                report.findings[i] = f
        findings.append(f)
    report.meta["saved_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # (a copy with the findings as far as they go; the report itself keeps what is final)
    (report if final else replace(report, findings=findings)).save(path)


def _output_failed(what: str, path: str, error: OSError) -> None:
    # stacklevel 4: the line of the mode's __exit__ (or __enter__) that closed it
    # (write_outputs <- _teardown <- __exit__).
    warnings.warn(
        f"rngcheck could not write its {what} to {path}: {error}", RNGCheckWarning, stacklevel=4
    )


def _levels(
    levels: dict[str, object], steps: StepControl, probe: StateProbe | None, ranks: RankCheck | None
) -> dict[str, object]:
    """``level="step"``'s metadata: the schedule's summary ``levels``, and what the step level
    saw."""
    if probe is not None:
        levels["checkpoint_probe"] = dict(probe.stats)
    levels["drifted_at_steps"] = list(steps.drifts) + (
        [steps.late_drift] if steps.late_drift else []
    )
    levels["stayed_op_level_steps"] = steps.stuck_steps
    if ranks is not None:  # orders drawn as passes over the data began (passes.py)
        levels["data_passes_compared"] = ranks.passes_compared
    # Switches held back while a checkpointed forward waited for its recompute.
    levels["postponed_switches"] = steps.postponements
    return levels


def _backward_notes(sites: dict[str, list[Any]]) -> list[Note]:
    """Random ops in backward outside every region, by site: ``[count, stack, op]`` each."""
    return [
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
        for site, (count, stack, op) in sites.items()
    ]


def _instead_notes(drew: dict[tuple[str, str, str, str], list[Any]]) -> list[Note]:
    """DTensor random ops that drew from the default generator instead of the generator= they
    were passed, by (site, op, passed, drawn from): ``[count, stack]`` each."""
    return [
        Note(
            kind="drew_from_default",
            message=(
                f"{count} DTensor random op(s) ({op}) at {site} were passed generator="
                f"{passed} but drew from {drawn}: on a mesh without DTensor's RNG tracker (a "
                "CPU mesh) torch drops the generator= of a DTensor random op and draws from the "
                "default generator (and torch.distributed.tensor._random.manual_seed does "
                f"nothing there). They were checked as draws from {drawn}, the generator "
                "that moved; seed and restore that one, or run the op on the local tensor "
                "(to_local()) with the generator."
            ),
            count=count,
            stack=stack,
        )
        for (site, op, passed, drawn), (count, stack) in drew.items()
    ]


def _healed_note(steps: list[int]) -> Note:
    """The selective route's key was taken out of the include set (by an export's pre-dispatch
    tracing inside the checked block) and put back at these optimizer steps' ends."""
    at = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    return Note(
        kind="route_healed",
        message=(
            f"the selective route's dispatch key was taken out of the include set during step(s) "
            f"{at} (torch does so when an export's pre-dispatch tracing ends) and put back at the "
            "step's end: random ops run between were not seen. Export outside the checked "
            "block, or use route='dispatch_mode'."
        ),
        count=len(steps),
    )


def _drift_notes(drifts: list[int], late_drift: int) -> list[Note]:
    """``level="step"`` across ranks: the steps whose generators drifted apart between samples
    (each followed by a step checked op by op), and a drift after the last step."""
    notes = []
    if drifts:
        drifted = ", ".join(map(str, drifts[:8])) + (", ..." if len(drifts) > 8 else "")
        notes.append(
            Note(
                kind="step_level_drift",
                message=(
                    f"generators drifted apart across ranks between sampled steps (seen at "
                    f"step(s) {drifted}); the following steps were checked op by op, where the "
                    "op level judged them (a data-parallel program may draw per-rank amounts "
                    "on purpose)."
                ),
                count=len(drifts),
            )
        )
    if late_drift:
        notes.append(
            Note(
                kind="step_level_drift",
                message=(
                    f"generators drifted apart across ranks at step {late_drift}, "
                    "between sampled steps, in the last steps of the run: it ended before a "
                    "step could be checked op by op, so what drew differently is not named "
                    "(a data-parallel program may draw per-rank amounts on purpose)."
                ),
            )
        )
    return notes
