"""The saved reports of a run, merged: one file per rank, grouped by run, each finding once with
the ranks that recorded it (what ``rngcheck show`` draws)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .report import (
    NotAReport,
    Report,
    ReportTooLarge,
    is_report_data,
    read_report_text,
    starts_as_report,
)

__all__ = [
    "MergedFinding",
    "ReportError",
    "ReportFiles",
    "Run",
    "is_trace",
    "load_runs",
    "report_files",
]


class ReportError(ValueError):
    """A path that is not a readable rngcheck report (the message says which, and why)."""


@dataclass(frozen=True)
class ReportFiles:
    """The files ``rngcheck show`` reads: those named, and the ``*.json`` of the directories
    named. A directory's file that is not an rngcheck report (a run directory also holds the
    training's own JSON: Hugging Face's ``config.json``, ``trainer_state.json``) is skipped; a
    file named on its own must be one."""

    files: list[str]
    in_directories: frozenset[str] = frozenset()


def report_files(paths: Sequence[str]) -> ReportFiles:
    files: list[str] = []
    in_directories: set[str] = set()
    for path in paths:
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(path, "*.json")))
            if not found:
                raise ReportError(f"{path}: no *.json reports in this directory")
            files.extend(found)
            in_directories.update(found)
        elif os.path.exists(path):
            files.append(path)
        else:
            raise ReportError(f"{path}: no such file or directory")
    named = {p for p in paths if not os.path.isdir(p)}  # a file named on its own is strict
    return ReportFiles(files, frozenset(in_directories - named))


def _foreign(path: str) -> bool:
    """Whether ``path`` holds something other than an rngcheck report: not text, not JSON, or
    JSON without rngcheck's ``format`` field (a report of another format version is a report).
    ``{"format": 1}`` without the fields every report has is not one. A file that begins as a
    report does is one, whatever follows: cut off, or past the size cap, loading it names it
    (rather than have ``show`` count its rank as one that wrote no report)."""
    try:
        text = read_report_text(path)
        data = json.loads(text)
    except ReportTooLarge:
        return not _begins_as_report(path)
    except UnicodeDecodeError:
        return True
    except json.JSONDecodeError:
        return not starts_as_report(text)
    except OSError:
        return False  # unreadable: loading it names the error
    return not is_report_data(data)


def _begins_as_report(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return starts_as_report(f.read(256).decode("utf-8", errors="replace"))
    except OSError:
        return False


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

    @property
    def unfinished(self) -> list[int]:
        """Ranks whose report was last saved while the run went (``completed`` false, and no
        ``ended_by``): the process was killed, or still runs."""
        return [
            r for r, rep in sorted(self.reports.items()) if not rep.completed and not _ended(rep)
        ]

    @property
    def crashed(self) -> list[int]:
        """Ranks whose checking ended by an exception (``completed`` false, ``ended_by`` says)."""
        return [r for r, rep in sorted(self.reports.items()) if not rep.completed and _ended(rep)]

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


def _ended(report: Any) -> bool:
    return bool(report.meta.get("ended_by"))


def load_runs(files: Sequence[str], skip_foreign: frozenset[str] = frozenset()) -> list[Run]:
    """The runs of the reports in ``files``, merged; a file of ``skip_foreign`` (a directory's)
    that is not an rngcheck report is left out. Raises ReportError when another file cannot be
    read as one, or when a directory held no report at all."""
    loaded = []
    skipped = []
    for path in files:
        if path in skip_foreign and _foreign(path):
            skipped.append(path)
            continue
        try:
            loaded.append((Report.load(path), path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            hint = " (a trace? use `rngcheck diff`)" if is_trace(path) else ""
            if isinstance(e, NotAReport):  # its message is whole
                what = f"{e}{hint}"
            else:
                what = f"not a readable rngcheck report{hint}: {e}"
            raise ReportError(f"{path}: {what}") from None
    if not loaded:
        where = sorted({os.path.dirname(p) or "." for p in skipped})
        raise ReportError(
            f"{', '.join(where)}: no rngcheck report among its {len(skipped)} *.json file(s); "
            "show reads the reports written by report_path= or RNGCHECK_REPORT"
        )
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
            return '"rngcheck-trace"' in f.readline(4096)  # (a bounded line: /dev/zero has none)
    except (OSError, UnicodeDecodeError):
        return False
