"""The report that collects one run's findings and notes, with its counters and metadata. Data
only: drawing is ``render.py``'s job. Reports serialise to JSON (never pickle) and load back for
the CLI; a report is saved atomically."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..core.findings import Finding, Note, error_for

__all__ = ["REPORT_FORMAT", "Report"]

REPORT_FORMAT = 1


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
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        if not isinstance(data, dict) or "format" not in data:
            raise ValueError(
                'not an rngcheck report (JSON without rngcheck\'s "format" field); rngcheck '
                "reads the reports written by report_path= or RNGCHECK_REPORT"
            )
        if data.get("format") != REPORT_FORMAT:
            raise ValueError(
                f"unsupported rngcheck report format {data.get('format')!r}; this rngcheck reads "
                f"format {REPORT_FORMAT}. Re-create the report with this version."
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
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())
