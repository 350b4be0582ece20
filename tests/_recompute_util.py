"""Helpers shared by the recompute tests: run code under a recording checker, find marked lines,
and assert a recompute finding completely (kind, op, differing element, user line, cause)."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

import rngcheck
from rngcheck import Finding, FindingKind, Report


def run(fn: Callable[[], Any], **mode_kwargs: Any) -> Report:
    """Run ``fn`` under a recording RNGConsistencyMode and return its report."""
    mode_kwargs.setdefault("on_finding", "record")
    with rngcheck.RNGConsistencyMode(**mode_kwargs) as mode:
        fn()
    return mode.report


def marked_line(marker: str, path: str | None = None) -> tuple[str, int]:
    """The file and line number of the line ending in ``# <- marker`` (in the caller's file)."""
    if path is None:
        path = inspect.stack()[1].filename
    with open(path, encoding="utf-8") as f:
        hits = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# <- {marker}")]
    assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times in {path}"
    return path, hits[0]


def short(marker: str, path: str) -> str:
    """``test_x.py:12`` for a marker, the way reports print call sites."""
    file, line = marked_line(marker, path)
    return f"{os.path.basename(file)}:{line}"


def assert_recompute_finding(
    report: Report,
    *,
    op: str,
    differs: str,
    at: str,
    cause: Iterable[str],
    sides: tuple[str, ...] = ("forward", "recompute"),
) -> Finding:
    """Exactly one recompute_mismatch finding, at the line marked ``at`` in the caller's file.

    ``sides`` names the sides that ran the op (both, unless one pass ran no random op there);
    each of those must point at the marked line too. Every string of ``cause`` must appear in
    the finding's cause text.
    """
    path = inspect.stack()[1].filename
    file, line = marked_line(at, path)
    assert len(report.findings) == 1, [f.message for f in report.findings]
    finding = report.findings[0]
    assert finding.kind is FindingKind.RECOMPUTE_MISMATCH
    assert finding.op == op, finding.op
    assert finding.differs == differs, (finding.differs, finding.message)
    site = finding.stack.call_site
    assert site is not None
    assert (site.filename, site.lineno) == (file, line), (site.location, line)
    labels = {s.label: s for s in finding.sides}
    assert set(labels) == {"forward", "recompute"}
    for label in sides:
        event = labels[label].event
        assert event is not None, label
        assert event.site == f"{os.path.basename(file)}:{line}", (label, event.site)
        assert event.op == op
    recompute = labels["recompute"].event
    if recompute is not None:  # the finding carries the recompute's stack as its other stack
        assert finding.other_stack is not None
        assert finding.other_stack.describe() == recompute.site
    for text in cause:
        assert text in finding.cause, f"{text!r} not in cause: {finding.cause}"
    assert finding.region, "a recompute finding names its region"
    return finding


def assert_culprit(finding: Finding, kind: str, call: str, marker: str, path: str) -> None:
    """The finding blames exactly one call, ``call`` of kind ``kind``, as a frame at the line
    marked ``marker`` in ``path`` (in the API and in the finding's JSON); its cause names it
    with that line."""
    assert [c.call for c in finding.culprits] == [call], finding.culprits
    culprit = finding.culprits[0]
    file, line = marked_line(marker, path)
    assert culprit.kind.value == kind
    assert culprit.frame is not None
    assert (culprit.frame.filename, culprit.frame.lineno) == (file, line), culprit.frame
    data = finding.to_dict()["culprits"][0]
    assert (data["frame"]["filename"], data["frame"]["lineno"]) == (file, line)
    assert (data["kind"], data["call"]) == (kind, call)
    assert f"{call} at {os.path.basename(file)}:{line}" in finding.cause, finding.cause


class CPURNGStatesTracker:
    """Megatron's CudaRNGStatesTracker on CPU: named streams swapped in and out of the default
    generator with torch.get_rng_state/set_rng_state."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        outside = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(outside)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states[name])  # <- tracker swap in
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outside)
