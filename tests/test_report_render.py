"""Findings as users meet them: raised errors, warnings, records, JSON reports and renderings."""

from __future__ import annotations

import io
import json
import os
import re
import warnings

import pytest
import torch
from _recompute_util import marked_line
from rich.console import Console
from torch.utils.checkpoint import checkpoint

import rngcheck
from rngcheck.core.findings import format_ranks
from rngcheck.output.report import Report
from rngcheck.output.sink import FindingSink

THIS = os.path.basename(__file__)


def _at(marker: str) -> int:
    """The line number of this file's line ending in ``# <- marker``."""
    return marked_line(marker, __file__)[1]


def _buggy_step(gen: torch.Generator) -> None:
    """A checkpointed block drawing from a user generator: the recompute draws other numbers."""
    layer = torch.nn.Linear(8, 8)

    def block(x):
        return layer(x) * (torch.rand(x.shape, generator=gen) > 0.5)  # <- the-random-op

    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()  # <- the-backward


def _record_finding() -> rngcheck.Finding:
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _buggy_step(torch.Generator().manual_seed(0))
    assert len(mode.report.findings) == 1
    return mode.report.findings[0]


def test_finding_fields_point_at_the_user_line():
    finding = _record_finding()
    assert finding.kind is rngcheck.FindingKind.RECOMPUTE_MISMATCH
    assert finding.op == "aten.rand.generator"
    assert finding.differs == "state"
    assert finding.stack.call_site.short_location == f"{THIS}:{_at('the-random-op')}"
    assert finding.stack.call_site.name == "block"
    # Torch internals are filtered from the user frames, and the other side's stack goes
    # through the user's backward() call.
    assert all("torch" + os.sep not in f.filename for f in finding.stack.user_frames)
    lines = [f.lineno for f in finding.other_stack.user_frames]
    assert _at("the-backward") in lines and _at("the-random-op") in lines
    assert [s.label for s in finding.sides] == ["forward", "recompute"]
    assert "generator=" in finding.cause and "torch.utils.checkpoint" in finding.cause


def test_raise_renders_then_raises_the_kind_specific_error():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    with (
        pytest.raises(rngcheck.RecomputeMismatchError) as info,
        rngcheck.RNGConsistencyMode(console=console),
    ):
        _buggy_step(torch.Generator().manual_seed(0))
    err = info.value
    assert isinstance(err, rngcheck.RNGCheckError)
    assert err.finding.kind is rngcheck.FindingKind.RECOMPUTE_MISMATCH
    # The explanation once: drawn in full, then an error whose message is one line.
    assert str(err) == (
        f"recompute_mismatch: aten.rand.generator at {THIS}:{_at('the-random-op')} "
        "(rngcheck drew the finding above)"
    )
    text = out.getvalue()
    assert "checkpoint recompute drew different random numbers" in text
    assert f'{THIS}", line {_at("the-random-op")}' in text
    assert text.count("Likely cause:") == 1


def test_an_error_raised_where_nothing_was_drawn_carries_the_whole_finding():
    # Another rank draws a finding that several ranks see: this one raises with it all.
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _buggy_step(torch.Generator().manual_seed(0))
    (finding,) = mode.report.findings
    out = io.StringIO()
    sink = FindingSink(Report(), "raise", Console(file=out, force_terminal=False))
    sink.renders = lambda _finding: False
    with pytest.raises(rngcheck.RecomputeMismatchError) as info:
        sink.emit(finding)
    assert out.getvalue() == ""
    assert str(info.value).startswith("checkpoint recompute drew different random numbers: ")
    assert "Likely cause:" in str(info.value) and f"{THIS}:{_at('the-random-op')}" in str(
        info.value
    )


def test_warn_warns_once_per_call_site_at_the_user_line():
    console = Console(file=io.StringIO(), force_terminal=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rngcheck.RNGConsistencyMode(on_finding="warn", console=console) as mode:
            gen = torch.Generator().manual_seed(0)
            for _ in range(3):
                _buggy_step(gen)
    ours = [w for w in caught if issubclass(w.category, rngcheck.RNGCheckWarning)]
    assert [f.count for f in mode.report.findings] == [3]  # one bug, seen at each step
    assert len(ours) == 1
    assert os.path.basename(ours[0].filename) == THIS
    assert ours[0].lineno == _at("the-random-op")


def test_record_is_silent():
    out = io.StringIO()
    with rngcheck.RNGConsistencyMode(on_finding="record", console=Console(file=out)) as mode:
        _buggy_step(torch.Generator().manual_seed(0))
    assert not mode.report.ok
    assert out.getvalue() == ""
    with pytest.raises(rngcheck.RecomputeMismatchError):
        mode.report.raise_if_findings()


def test_report_round_trips_through_json(tmp_path):
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        torch.rand(2)
        _buggy_step(torch.Generator().manual_seed(0))
    path = tmp_path / "sub" / "report.json"
    mode.report.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == 1 and data["findings"][0]["kind"] == "recompute_mismatch"
    loaded = rngcheck.Report.load(path)
    assert loaded.to_dict() == mode.report.to_dict()
    f = loaded.findings[0]
    assert f.stack.call_site.lineno == _at("the-random-op")
    assert f.sides[1].event.generator.label.startswith("Generator #1")
    assert not [p for p in os.listdir(path.parent) if p.endswith(".tmp")]  # atomic, no leftovers
    with pytest.raises(ValueError, match="unsupported rngcheck report format"):
        rngcheck.Report.from_dict({"format": 99})


def _frames_in(data: object) -> list[dict]:
    """Every frame record anywhere in a report's JSON."""
    if isinstance(data, dict):
        own = [data] if {"filename", "lineno", "name"} <= set(data) else []
        return own + [f for v in data.values() for f in _frames_in(v)]
    if isinstance(data, list):
        return [f for v in data for f in _frames_in(v)]
    return []


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_stacks_a_report_records_hold_none_of_the_checkers_frames(reentrant):
    """The interceptor, the recorder, the mode and the checkpoint shims run below every random
    op and every seeding call: none of their frames reaches a recorded stack (the JSON report
    of a plain checkpoint finding held core/dispatch.py, session/recorder.py and
    recompute/torch_hooks.py), while torch's and the user's frames stay."""
    layer = torch.nn.Linear(8, 8)
    gen = torch.Generator().manual_seed(0)

    def block(x):
        torch.manual_seed(3)  # a seeding call: its stack is recorded too
        return layer(x) * (torch.rand(x.shape, generator=gen) > 0.5)

    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        x = torch.randn(4, 8, requires_grad=True)
        checkpoint(block, x, use_reentrant=reentrant).sum().backward()
    data = json.loads(json.dumps(mode.report.to_dict()))
    assert len(data["findings"]) == 1
    frames = _frames_in(data)
    files = {f["filename"] for f in frames}
    package = os.path.dirname(rngcheck.__file__) + os.sep
    assert not [f for f in files if f.startswith(package)], sorted(files)
    assert __file__ in files and any(f.endswith("checkpoint.py") for f in files)
    assert len(frames) > 10  # (the forward's, the recompute's and the context's stacks)


def _reseeded_step() -> None:
    """A checkpointed block that reseeds from a step counter moved before backward."""
    layer = torch.nn.Linear(8, 8)
    step = {"n": 0}

    def block(x):
        torch.manual_seed(step["n"])  # <- the-reseed
        return torch.nn.functional.dropout(layer(x), 0.5)

    y = checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
    step["n"] += 1
    y.sum().backward()


def test_the_call_a_cause_names_is_a_frame_of_the_finding_in_json_and_drawings(tmp_path):
    """The reseed the cause names is ``finding.culprits``: a frame in the API, in the saved
    JSON (``culprits[i].frame``, what an annotation links) and loaded back, and drawn with its
    source line on a terminal and in logs."""
    with rngcheck.RNGConsistencyMode(on_finding="record", report_path=str(tmp_path / "r.json")):
        _reseeded_step()
    line = _at("the-reseed")
    data = json.loads((tmp_path / "r.json").read_text())
    [culprit] = data["findings"][0]["culprits"]
    assert (culprit["kind"], culprit["call"], culprit["ranks"]) == (
        "seed",
        "torch.manual_seed(1)",
        [],
    )
    assert (culprit["frame"]["filename"], culprit["frame"]["lineno"]) == (__file__, line)
    assert culprit["frame"]["line"] == 'torch.manual_seed(step["n"])  # <- the-reseed'
    assert culprit["stack"][-1] == culprit["frame"]
    finding = rngcheck.Report.load(tmp_path / "r.json").findings[0]
    assert finding.culprits[0].frame.lineno == line
    assert finding.culprits[0].kind is rngcheck.CulpritKind.SEED
    assert f"torch.manual_seed(1) at {THIS}:{line}" in finding.cause
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=160, color_system=None).print(
        rngcheck.render_finding(finding)
    )
    drawn = out.getvalue()
    assert f"culprit: torch.manual_seed(1) at {THIS}:{line}" in drawn
    assert 'torch.manual_seed(step["n"])' in drawn  # its source line, in a traceback
    plain = rngcheck.format_finding(finding)
    assert f"  culprit: torch.manual_seed(1) at {THIS}:{line}" in plain
    assert f'    File "{__file__}", line {line}, in block' in plain.split("culprit stack")[1]


def test_rich_rendering_has_panel_table_and_traceback_with_the_user_line():
    finding = _record_finding()
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140, color_system=None)
    console.print(rngcheck.render_finding(finding))
    text = out.getvalue()
    assert "rngcheck: checkpoint recompute drew different random numbers" in text
    assert "Likely cause:" in text
    # (no output row: rand's output follows from its state and arguments, and is not digested)
    for row in ("op", "generator", "arguments", "state before", "call site"):
        assert row in text
    assert "│ output" not in text
    assert "forward" in text and "recompute" in text
    assert f"{THIS}:{_at('the-random-op')}" in text
    assert "(torch.rand(x.shape, generator=gen) > 0.5)" in text  # the source line, from rich
    assert "torch/utils/checkpoint.py" not in text  # torch frames are filtered


def test_an_output_difference_renders_both_outputs():
    keep = torch.full((4, 8), 0.7)

    def block(x):
        return x * torch.bernoulli(keep)  # reads a global, changed before backward

    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        y = checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
        keep.fill_(0.2)
        y.sum().backward()
    [finding] = mode.report.findings
    assert finding.differs == "output"
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=140, color_system=None).print(
        rngcheck.render_finding(finding)
    )
    [row] = [line for line in out.getvalue().splitlines() if "│ output " in line]
    digests = re.findall(r"[0-9a-f]{16}", row)
    assert len(digests) == 2 and digests[0] != digests[1], row


def test_plain_text_when_not_a_terminal():
    finding = _record_finding()
    out = io.StringIO()
    rngcheck.print_finding(finding, console=Console(file=out, force_terminal=False, width=100))
    text = out.getvalue()
    assert "╭" not in text and "│" not in text  # no box drawing in logs
    assert text.startswith("rngcheck: checkpoint recompute drew different random numbers")
    assert f'File "{__file__}", line {_at("the-random-op")}, in block' in text


def test_print_report_summarises():
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        torch.rand(2)
    out = io.StringIO()
    rngcheck.print_report(mode.report, console=Console(file=out, force_terminal=False))
    assert "rngcheck: 1 random op(s) checked, no findings" in out.getvalue()


def test_format_ranks_is_readable():
    assert format_ranks([0, 1, 2, 3, 6]) == "0-3,6"
    assert format_ranks([5]) == "5"
    assert format_ranks([3, 1, 2]) == "1-3"
    assert format_ranks([0, 1], world_size=2) == "0-1 of 2"
    assert format_ranks([]) == "-"


def test_scalar_arguments_print_as_a_person_wrote_them():
    # kaiming_uniform_'s bound for fan_in=16 (gain sqrt(1/3)): -0.24999999999999997, double
    # arithmetic, not intent.
    bound = -((1 / 3) ** 0.5) * (3 / 16) ** 0.5
    assert repr(bound) == "-0.24999999999999997"
    p = torch.tensor(0.1).item()  # 0.10000000149011612: a float32 read back
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        torch.empty(4).uniform_(bound, -bound)
        torch.empty(4).bernoulli_(p)
    args = [e.args for e in mode.events]
    assert args == [("float32[4]", "from=-0.25", "to=0.25"), ("float32[4]", "p=0.1")]
    assert rngcheck.core.ops.format_float(2.0**-30) == "9.313226e-10"
    assert rngcheck.core.ops.format_float(float("inf")) == "inf"


def test_a_panel_fills_the_terminal_with_a_space_before_each_right_border():
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        _buggy_step(torch.Generator().manual_seed(0))
    (finding,) = mode.report.findings
    for width in (100, 180):
        console = Console(record=True, width=width, force_terminal=True, color_system=None)
        console.print(rngcheck.render_finding(finding))
        lines = console.export_text().splitlines()
        assert all(len(line) == width for line in lines), {len(line) for line in lines}
        inner = [line[:-1].rstrip("│") for line in lines[1:-1]]
        # Every row inside the outer border ends in a space or its own box's border.
        assert all(
            line.endswith((" ", "│", "┃", "┓", "┛", "┐", "┘", "╮", "╯", "┩", "┤")) for line in inner
        )
        tracebacks = [line for line in lines if "Traceback (most recent call last)" in line]
        assert tracebacks and all(
            len(line.rstrip().rstrip("│").rstrip()) > width - 8 for line in tracebacks
        )
        # The sides' table: a space between each cell and the table's borders, left and right.
        table_rows = [line for line in lines if "│ call site " in line]
        assert table_rows and all(re.search(r"[^ ] │ *│$", row) for row in table_rows)
