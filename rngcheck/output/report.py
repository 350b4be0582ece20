"""The report that collects one run's findings and notes, with its counters and metadata. Data
only: drawing is ``render.py``'s job. Reports serialise to JSON (never pickle) and load back for
the CLI; a report is saved atomically."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..core.findings import Finding, Note, RNGCheckError, error_for

__all__ = [
    "MAX_REPORT_BYTES",
    "REPORT_FORMAT",
    "NotAReport",
    "Report",
    "ReportTooLarge",
    "broken_report",
    "ended_by",
    "is_report_data",
    "read_report_text",
    "starts_as_report",
]

REPORT_FORMAT = 1
# The most read from one report file. A report keeps at most 100 findings (output/sink.py), each
# with its stacks and the events around it: tens of KiB each, a few MiB in all. A file past this
# is not one (``rngcheck show /dev/zero`` read until the kernel killed it).
MAX_REPORT_BYTES = 64 * 1024 * 1024
# The fields every report of format 1 has (Report.to_dict writes them all): ``{"format": 1}``
# alone is not an empty report.
_FIELDS = (
    "rank",
    "world_size",
    "random_ops",
    "ops_by_name",
    "ops_by_generator",
    "findings",
    "notes",
    "meta",
)
# How every saved report begins: its format version, a number (a trace's is a string).
_REPORT_START = re.compile(r'\s*\{\s*"format"\s*:\s*\d')


class NotAReport(ValueError):
    """A file (or a dict) that is not a report this rngcheck reads. The message says why, whole:
    it follows the file's path as it is."""


class ReportTooLarge(NotAReport):
    """A file past :data:`MAX_REPORT_BYTES`: not read further."""


def read_report_text(path: str | os.PathLike[str]) -> str:
    """The text of a report file, reading at most :data:`MAX_REPORT_BYTES` (of a device or a pipe
    too, which nothing else would end). Raises ReportTooLarge past it, OSError when unreadable,
    UnicodeDecodeError when not text."""
    with open(path, "rb") as f:
        info = os.fstat(f.fileno())
        too_large = stat.S_ISREG(info.st_mode) and info.st_size > MAX_REPORT_BYTES
        data = b"" if too_large else f.read(MAX_REPORT_BYTES + 1)
    if too_large or len(data) > MAX_REPORT_BYTES:
        size = f"{info.st_size:,} bytes" if too_large else f"over {MAX_REPORT_BYTES:,} bytes"
        raise ReportTooLarge(
            f"too large for an rngcheck report ({size}; rngcheck reads at most "
            f"{MAX_REPORT_BYTES // 2**20} MiB of one, and a report is a few MiB at most)"
        )
    return data.decode("utf-8")


def starts_as_report(head: str) -> bool:
    """Whether text begins as every saved report does (``{"format": ...``), whatever follows: a
    report cut off is still a report to name, not a file of the training's own to skip."""
    return _REPORT_START.match(head) is not None


def is_report_data(data: Any) -> bool:
    """Whether parsed JSON is a report: rngcheck's ``format`` (a version number) and, in this
    format, every field a report has. A report of another version is one (reading it says to
    re-create it); ``{"format": 1}`` alone, or another tool's ``{"format": "png"}``, is not."""
    if not isinstance(data, dict):
        return False
    version = data.get("format")
    if isinstance(version, bool) or not isinstance(version, int):
        return False
    return version != REPORT_FORMAT or all(name in data for name in _FIELDS)


def broken_report(text: str, error: json.JSONDecodeError) -> str:
    """The words for a report that is not valid JSON (it begins as one): cut off (it does not end
    as every saved report does, with ``}``) or broken inside; "" when ``text`` is something
    else that is not JSON."""
    if not starts_as_report(text):
        return ""
    if not text.rstrip().endswith("}"):
        what = f"cut off after {len(text.encode()):,} bytes (an incomplete copy?)"
    else:
        what = f"not valid JSON ({error.msg}, line {error.lineno})"
    return f"an rngcheck report {what}: its findings are unknown"


def ended_by(exc: BaseException) -> str:
    """How an exception that ended a run reads in its report (``meta["ended_by"]``): its type and
    first line, or, for a finding's error (its message is the finding, shown anyway), the
    finding's site."""
    if isinstance(exc, RNGCheckError):
        return f"{type(exc).__name__} at {exc.finding.site}"
    return f"{type(exc).__name__}: {exc}"[:300]


@dataclass(slots=True, kw_only=True)
class Report:
    """What one checker run found. ``ok`` is True when there are no findings."""

    findings: list[Finding] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    random_ops: int = 0
    ops_by_name: dict[str, int] = field(default_factory=dict)
    ops_by_generator: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    findings_dropped: int = 0  # distinct findings past the kept ones: counted, not kept
    ignored: dict[str, int] = field(default_factory=dict)  # ignore rule -> findings it left out
    # Whether the checking ran to its end (the checked block ended without an exception). A mode
    # sets it False as it starts: a report saved while the run goes, or at a crash, says False,
    # and one that a killed process last saved stays so. A report without it (written before
    # the field, or built by hand) reads as complete.
    completed: bool = True

    @property
    def ok(self) -> bool:
        return not self.findings and not self.findings_dropped

    @property
    def distinct(self) -> int:
        """Distinct findings, kept or not."""
        return len(self.findings) + self.findings_dropped

    @property
    def occurrences(self) -> int:
        """Every occurrence of the kept findings (a recurring bug counts each time it recurred)."""
        return sum(f.count for f in self.findings)

    def raise_if_findings(self) -> None:
        """Raise the error of the first finding (the one a user should fix first), if any."""
        if self.findings:
            raise error_for(self.findings[0])

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "random_ops": self.random_ops,
            "ops_by_name": dict(self.ops_by_name),
            "ops_by_generator": dict(self.ops_by_generator),
            "findings": [f.to_dict() for f in self.findings],
            "notes": [n.to_dict() for n in self.notes],
            "meta": dict(self.meta),
            "findings_dropped": self.findings_dropped,
            "ignored": dict(self.ignored),
            "completed": self.completed,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        if not isinstance(data, dict) or "format" not in data:
            raise NotAReport(
                'not an rngcheck report (JSON without rngcheck\'s "format" field); rngcheck '
                "reads the reports written by report_path= or RNGCHECK_REPORT"
            )
        if data.get("format") != REPORT_FORMAT:
            raise NotAReport(
                f"unsupported rngcheck report format {data.get('format')!r}; this rngcheck reads "
                f"format {REPORT_FORMAT}. Re-create the report with this version."
            )
        missing = [name for name in _FIELDS if name not in data]
        if missing:
            raise NotAReport(
                f'not an rngcheck report (JSON with rngcheck\'s "format" field but without '
                f"{', '.join(missing)}, which every report has)"
            )
        return cls(
            findings=[Finding.from_dict(f) for f in data.get("findings", [])],
            notes=[Note.from_dict(n) for n in data.get("notes", [])],
            random_ops=int(data.get("random_ops", 0)),
            ops_by_name=dict(data.get("ops_by_name", {})),
            ops_by_generator=dict(data.get("ops_by_generator", {})),
            rank=int(data.get("rank", 0)),
            world_size=int(data.get("world_size", 1)),
            meta=dict(data.get("meta", {})),
            findings_dropped=int(data.get("findings_dropped", 0)),
            ignored={str(k): int(v) for k, v in data.get("ignored", {}).items()},
            completed=bool(data.get("completed", True)),
        )

    @classmethod
    def from_json(cls, text: str) -> Report:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the report as JSON atomically: readers see the old file or the new, never half."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".rngcheck-", suffix=".json.tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Report:
        """Read a saved report. Raises OSError when it cannot be read, NotAReport when it is not a
        report this rngcheck reads (past :data:`MAX_REPORT_BYTES`, not text, not JSON, cut off,
        or JSON of another kind), ValueError (or KeyError, TypeError) when a field is malformed."""
        try:
            text = read_report_text(path)
        except UnicodeDecodeError:
            raise NotAReport("not an rngcheck report (not text)") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            what = "an empty file" if not text.strip() else f"not JSON: {e.msg}, line {e.lineno}"
            raise NotAReport(broken_report(text, e) or f"not an rngcheck report ({what})") from None
        return cls.from_dict(data)
