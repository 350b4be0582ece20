"""The saved reports of a run, merged: one file per rank, grouped by run, each finding once with
the ranks that recorded it (what ``rngcheck show`` draws)."""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .report import Report

__all__ = ["MergedFinding", "ReportError", "Run", "is_trace", "load_runs", "report_files"]


class ReportError(ValueError):
    """A path that is not a readable rngcheck report (the message says which, and why)."""


def report_files(paths: Sequence[str]) -> list[str]:
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(path, "*.json")))
            if not found:
                raise ReportError(f"{path}: no *.json reports in this directory")
            files.extend(found)
        elif os.path.exists(path):
            files.append(path)
        else:
            raise ReportError(f"{path}: no such file or directory")
    return files


@dataclass
class MergedFinding:
    finding: Any  # as the first of its ranks (the lowest, files being sorted) recorded it
    rank: int = 0
    seen_on: set[int] = field(default_factory=set)


@dataclass
class Run:
    """The reports of one run (one file per rank), merged."""

    run_id: str
    reports: dict[int, Any] = field(default_factory=dict)  # rank -> Report
    files: dict[int, str] = field(default_factory=dict)
    findings: dict[tuple, MergedFinding] = field(default_factory=dict)
    notes: dict[tuple, tuple[Any, set[int]]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return max(r.world_size for r in self.reports.values())

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.reports]

    def add(self, report: Any, path: str) -> None:
        self.reports[report.rank] = report
        self.files[report.rank] = path
        for f in report.findings:
            # Every rank records the same rank finding: merge them. Local findings (a recompute
            # mismatch) merge when the ranks hit the same one at the same op and line, as SPMD
            # ranks do (not by message: it numbers checkpoint regions per process).
            key = (f.kind.value, f.op, f.seq, f.ranks, f.differs, f.site)
            entry = self.findings.setdefault(key, MergedFinding(f, report.rank))
            entry.seen_on.add(report.rank)
        for n in report.notes:
            entry_n = self.notes.setdefault((n.kind, n.message), (n, set()))
            entry_n[1].add(report.rank)


def load_runs(files: Sequence[str]) -> list[Run]:
    loaded = []
    for path in files:
        try:
            loaded.append((Report.load(path), path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            hint = " (a trace? use `rngcheck diff`)" if is_trace(path) else ""
            what = (
                str(e)
                if str(e).startswith("not an rngcheck report")
                else (f"not a readable rngcheck report{hint}: {e}")
            )
            raise ReportError(f"{path}: {what}") from None
    runs: dict[str, Run] = {}
    for report, path in sorted(loaded, key=lambda rp: rp[0].rank):  # lowest rank speaks first
        run_id = str(report.meta.get("run_id") or path)
        run = runs.setdefault(run_id, Run(run_id))
        if report.rank in run.reports:
            raise ReportError(
                f"{path} and {run.files[report.rank]} are both rank {report.rank} of run "
                f"{run_id}: show one run's files at a time"
            )
        run.add(report, path)
    return list(runs.values())


def is_trace(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return '"rngcheck-trace"' in f.readline()
    except (OSError, UnicodeDecodeError):
        return False
