"""Where findings go: into the report (a bounded number kept, the rest counted), onto the console
(one merged rendering across ranks), and out as a warning or an error, as ``on_finding`` says.

The mode hands :meth:`FindingSink.emit` to every check; this is the one module on the random-op
path that knows how findings are drawn.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

from ..core.findings import Finding, RNGCheckWarning, error_for
from .report import Report

__all__ = ["MAX_FINDINGS", "FindingSink"]

MAX_FINDINGS = 100  # past this, findings are counted, not kept (a broken loop reports once)


class FindingSink:
    """Records, draws, warns about or raises each finding of one mode."""

    def __init__(self, report: Report, on_finding: str, console: Any = None) -> None:
        self.report = report
        self.on_finding = on_finding
        self.console = console
        self.dropped = 0
        # Who draws a finding seen by several ranks: the rank checker's rule once it runs.
        self.renders: Callable[[Finding], bool] = lambda _finding: True
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def emit(self, finding: Finding) -> None:
        """Record a finding; render it; warn or raise as configured."""
        with self._lock:
            if len(self.report.findings) >= MAX_FINDINGS:
                self.dropped += 1
                return
            self.report.findings.append(finding)
        if self.on_finding == "record":
            return
        if self.renders(finding):
            from .render import print_finding

            print_finding(finding, console=self.console)
        if self.on_finding == "warn":
            self._warn(finding)
            return
        raise error_for(finding)

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
