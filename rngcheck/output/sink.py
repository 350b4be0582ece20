"""Where findings go: into the report (one record per bug, its recurrences counted; a bounded
number kept, the rest counted), onto the console (one merged rendering across ranks), and out as a
warning or an error, as ``on_finding`` says.

The mode hands :meth:`FindingSink.emit` to every check; this is the one module on the random-op
path that knows how findings are drawn.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..core.findings import Finding, RNGCheckWarning, error_for
from ..core.policy import IgnoreRule
from .report import Report

__all__ = ["MAX_FINDINGS", "FindingSink"]

MAX_FINDINGS = 100  # distinct findings kept; past this, counted, not kept (a broken loop)
_MAX_DROPPED_KEYS = 10_000  # distinct findings not kept that are still told apart from repeats


class FindingSink:
    """Records, draws, warns about or raises each finding of one mode.

    One bug that recurs (every step, in every layer that runs the same line) is one finding: the
    first occurrence is kept and drawn in full, the later ones counted on it (``count``, and the
    steps of the first and last), so a long run's output and report stay readable.
    """

    def __init__(
        self,
        report: Report,
        on_finding: str,
        console: Any = None,
        ignore: tuple[IgnoreRule, ...] = (),
        step: Callable[[int], int] = lambda _seq: 0,
    ) -> None:
        self.report = report
        self.on_finding = on_finding
        self.console = console
        self.ignore = ignore
        self.step = step  # the optimizer step (1-based, 0: unknown) of a random op's seq
        self.occurrences = 0  # every finding emitted and not ignored, repeats included
        # Who draws a finding seen by several ranks: the rank checker's rule once it runs.
        self.renders: Callable[[Finding], bool] = lambda _finding: True
        # Told after each finding is recorded, before it is drawn or raised (True: a new distinct
        # one): the mode keeps the report on disk current (session/keeper.py).
        self.recorded: Callable[[bool], None] = lambda _new: None
        self._kept: dict[tuple[Any, ...], int] = {}  # key -> index in report.findings
        self._dropped: dict[tuple[Any, ...], int] = {}  # key -> occurrences, not kept
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def dropped(self) -> int:
        """Distinct findings that were not kept (past ``MAX_FINDINGS``)."""
        return self.report.findings_dropped

    def emit(
        self, finding: Finding, earlier: tuple[int, int] = (0, 0), raising: bool = True
    ) -> None:
        """Record a finding (or count it on its first occurrence); draw it the first time; warn
        or raise as configured. ``earlier``: occurrences of it found before another way, and the
        step of the first (level="step": between sampled steps), counted on it. ``raising``:
        False when the checked block ended by an exception, the one to see (recorded and drawn
        only)."""
        if self.ignore and self._ignored(finding):
            return
        # A rank finding's seq may be another rank's op: it is found at this rank's step now,
        # unless it says its step (one compared rounds after it happened: a pass's order).
        step = finding.first_step or self.step(-1 if finding.ranks else finding.seq)
        more, since = earlier
        key = finding.key
        repeat: bool | None
        with self._lock:
            self.occurrences += 1 + more
            index = self._kept.get(key)
            if index is not None:  # the same bug again: counted, not drawn again
                first = self.report.findings[index]
                self.report.findings[index] = replace(
                    first,
                    count=first.count + 1 + more,
                    first_step=min(since, first.first_step or since) if since else first.first_step,
                    last_step=step or first.last_step,
                )
                repeat = True
            elif len(self.report.findings) >= MAX_FINDINGS:
                if key not in self._dropped:
                    self.report.findings_dropped += 1
                    if len(self._dropped) < _MAX_DROPPED_KEYS:
                        self._dropped[key] = 0
                if key in self._dropped:
                    self._dropped[key] += 1
                repeat = None  # counted, not kept
            else:
                self._kept[key] = len(self.report.findings)
                record = replace(
                    finding, count=finding.count + more, first_step=since or step, last_step=step
                )
                self.report.findings.append(record)
                if more or since:  # drawn and raised with what was found before it
                    finding = record
                repeat = False
        self.recorded(repeat is False)  # (saved now if new, before it is raised)
        if repeat is None or self.on_finding == "record":
            return
        if not repeat and self.renders(finding):
            from .render import print_finding

            print_finding(finding, console=self.console, world_size=self.report.world_size)
        if not raising:
            return
        if self.on_finding == "warn":
            self._warn(finding)
            return
        # Drawn above (on the rank that draws it): the error's message is then the short form.
        raise error_for(finding, drawn=not repeat and self.renders(finding))

    def _ignored(self, finding: Finding) -> bool:
        sites = [(f.filename, f.lineno) for f in (finding.stack.call_site,) if f is not None]
        sites += [
            (f.filename, f.lineno)
            for s in finding.sides
            if s.event is not None
            for f in (s.event.stack.call_site,)
            if f is not None
        ]
        for rule in self.ignore:
            if rule.matches(finding.kind.value, sites):
                with self._lock:
                    counts = self.report.ignored
                    counts[rule.text] = counts.get(rule.text, 0) + 1
                return True
        return False

    def close(self) -> None:
        """At the end of the run: one line for each finding that recurred (drawn in full the
        first time), so a warned run ends with its counts."""
        if self.on_finding != "warn":
            return
        repeated = [f for f in self.report.findings if f.count > 1 and self.renders(f)]
        if repeated or self.report.findings_dropped:
            from .render import print_repeats

            print_repeats(self.report, repeated, console=self.console)

    def _warn(self, finding: Finding) -> None:
        site = finding.stack.call_site
        key = (finding.kind.value, site.location if site else "")
        if key in self._warned:
            return
        self._warned.add(key)
        message = f"rngcheck: {finding.title}: {finding.message}"
        if site is not None:
            warnings.warn_explicit(message, RNGCheckWarning, site.filename, site.lineno)
        else:
            warnings.warn(message, RNGCheckWarning, stacklevel=3)
