"""Long runs: one bug that recurs at every step is one finding with a count and the steps it was
seen at (in the drawing, the report, JSON and `rngcheck show`), distinct bugs stay distinct, the
totals are true when findings are not kept, and known findings can be ignored (counted, never
silently dropped). Real checkpointing, real optimizers, a real RNGCHECK=1 process."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _recompute_util import marked_line
from rich.console import Console
from torch import nn
from torch.utils.checkpoint import checkpoint

import rngcheck
from rngcheck.output.render import format_report
from rngcheck.output.report import Report
from rngcheck.output.sink import MAX_FINDINGS

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TITLE = "checkpoint recompute drew different random numbers"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(x), 0.2)  # <- recurring dropout


class Net(nn.Module):
    """Two checkpointed layers whose recompute does not replay the RNG: the same bug in each."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False)
        return x.sum()


def _train(model: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 8)
    for _ in range(steps):
        model(x).backward()
        opt.step()
        opt.zero_grad()


def test_a_thousand_steps_of_one_bug_print_one_finding_and_a_count():
    torch.manual_seed(0)
    model = Net()
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    with (
        pytest.warns(rngcheck.RNGCheckWarning),
        rngcheck.RNGConsistencyMode(on_finding="warn", console=console) as mode,
    ):
        _train(model, 1000)
    text = out.getvalue()
    assert text.count(TITLE) == 1, text[:3000]
    # Both layers' recomputes hit it at every step: 2,000 occurrences of one finding.
    assert text.rstrip().endswith("was seen 2000 times in all, steps 1 to 1000"), text[-500:]
    (finding,) = mode.report.findings
    assert (finding.count, finding.first_step, finding.last_step) == (2000, 1, 1000)
    # The layer is named: model's child and class, the checkpoint numbered from 1 in this mode.
    assert finding.region.startswith("checkpoint #2 (non-reentrant) of layers.1 (Block) at ")
    file, line = marked_line("recurring dropout")
    assert finding.site == f"{os.path.basename(file)}:{line}"
    assert len(text.splitlines()) < 80


def test_distinct_bugs_stay_distinct_and_reading_the_report_does_not_change_it():
    gen = torch.Generator().manual_seed(3)

    def noisy(x):
        return x * (torch.rand(x.shape, generator=gen) > 0.5)  # <- user generator

    torch.manual_seed(0)
    model = Net()
    lin = nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        for _ in range(3):
            model(torch.randn(2, 8)).backward()
            checkpoint(noisy, lin(torch.randn(2, 8)), use_reentrant=False).sum().backward()
            opt.step()
    first = mode.report.to_dict()
    assert mode.report.to_dict() == first and mode.report.to_dict() == first  # reads are pure
    sites = sorted(f.site for f in mode.report.findings)
    assert len(sites) == 2 and sites[0] != sites[1]
    counts = {f.site: (f.count, f.first_step, f.last_step) for f in mode.report.findings}
    _, noisy_line = marked_line("user generator")
    _, dropout_line = marked_line("recurring dropout")
    assert counts == {
        f"test_long_runs.py:{noisy_line}": (3, 1, 3),
        f"test_long_runs.py:{dropout_line}": (6, 1, 3),
    }
    assert "rngcheck: " in format_report(mode.report)
    assert "2 finding(s) (9 occurrences)" in format_report(mode.report)


def test_findings_past_the_kept_ones_are_counted_and_the_totals_stay_true():
    # MAX_FINDINGS + 5 distinct bugs: one checkpointed function per (synthetic) source file.
    blocks = []
    for i in range(MAX_FINDINGS + 5):
        scope: dict = {"torch": torch}
        source = "def block(x, g):\n    return x * (torch.rand(x.shape, generator=g) > 0.5)\n"
        exec(compile(source, f"/generated/bug_{i}.py", "exec"), scope)
        blocks.append(scope["block"])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, requires_grad=True)
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        for _ in range(2):  # each bug twice: repeats of kept and of dropped findings
            for block in blocks:
                checkpoint(block, x, gen, use_reentrant=False).sum().backward()
    report = mode.report
    assert len(report.findings) == MAX_FINDINGS and report.findings_dropped == 5
    assert all(f.count == 2 for f in report.findings)
    assert report.distinct == MAX_FINDINGS + 5
    notes = [n for n in mode.report.notes if n.kind == "findings_dropped"]
    assert len(notes) == 1 and notes[0].count == 5  # once, however often the report is read
    assert "105 finding(s) (200 occurrences), 5 of them not kept" in format_report(report)
    saved = Report.from_json(report.to_json())
    assert saved.findings_dropped == 5 and saved.distinct == MAX_FINDINGS + 5


def test_a_known_finding_is_ignored_by_kind_and_site_and_counted():
    torch.manual_seed(0)
    model = Net()
    _, line = marked_line("recurring dropout")
    rule = f"recompute_mismatch@test_long_runs.py:{line}"
    with rngcheck.RNGConsistencyMode(on_finding="raise", ignore=[rule]) as mode:
        _train(model, 3)
    assert mode.report.ok
    assert mode.report.ignored == {rule: 6}
    assert format_report(mode.report).startswith("rngcheck: ")
    assert "no findings, ignored: 6" in format_report(mode.report)
    # Another site is not covered by the rule.
    other = f"recompute_mismatch@test_long_runs.py:{line + 1}"
    with rngcheck.RNGConsistencyMode(on_finding="record", ignore=other) as mode:
        _train(model, 1)
    assert not mode.report.ok and mode.report.ignored == {}


def test_expect_ignore_around_the_forward_covers_the_recompute_in_backward():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 8)
    with rngcheck.RNGConsistencyMode(on_finding="raise") as mode:
        with rngcheck.expect("ignore"):
            loss = model(x)
        loss.backward()  # the recompute runs here, outside the block
    assert mode.report.ok
    with rngcheck.RNGConsistencyMode(on_finding="record") as mode:
        model(x).backward()
    assert not mode.report.ok  # the same code unscoped is found


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("boom@x.py:3", "is not a rule of the form KIND, KIND@FILE:LINE"),
        (42, "must be a string or a list of strings"),
        (["@"], "is not a rule of the form"),
    ],
)
def test_bad_ignore_rules_are_refused_where_they_are_given(value, message):
    with pytest.raises(ValueError, match=message):
        rngcheck.RNGConsistencyMode(ignore=value)


@pytest.mark.slow
def test_a_recorded_run_under_rngcheck_1_draws_the_bug_once_with_its_count(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RNGCHECK", "_RNGCHECK"))}
    env.update(
        RNGCHECK="1",
        RNGCHECK_ON_FINDING="record",
        RNGCHECK_REPORT=str(tmp_path),
        TRAIN_STEPS="300",
        OMP_NUM_THREADS="1",
    )
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "train_buggy.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count(TITLE) == 1, r.stderr[-3000:]
    assert "Recurring: seen 300 times in all, steps 1 to 300" in r.stderr
    assert "random op(s) checked, 1 finding(s) (300 occurrences)" in r.stderr
    (saved,) = tmp_path.glob("*.json")
    (finding,) = Report.load(saved).findings
    assert (finding.count, finding.first_step, finding.last_step) == (300, 1, 300)
    assert finding.region.startswith("checkpoint #1 (non-reentrant) of Block at ")


def test_rngcheck_ignore_and_the_level_variables_are_read_and_validated_for_every_route():
    from rngcheck.env import EnvError, settings_from_env

    env = {
        "RNGCHECK": "1",
        "RNGCHECK_IGNORE": "recompute_mismatch@modeling_foo.py:120, @train.py",
        "RNGCHECK_LEVEL": "step",
        "RNGCHECK_SAMPLE_EVERY": "50",
    }
    kwargs = settings_from_env(env).mode_kwargs
    assert [r.text for r in kwargs["ignore"]] == [
        "recompute_mismatch@modeling_foo.py:120",
        "@train.py",
    ]
    assert (kwargs["level"], kwargs["sample_every"], kwargs["sample_first"]) == ("step", 50, 2)
    mode = rngcheck.RNGConsistencyMode(**kwargs)  # what RNGCHECK=1 starts
    assert mode.config.level == "step" and len(mode.config.ignore) == 2
    for name, value, says in (
        ("RNGCHECK_IGNORE", "boom@x.py", "'boom@x.py' is not a rule of the form KIND"),
        (
            "RNGCHECK_LEVEL",
            "sometimes",
            "RNGCHECK_LEVEL='sometimes' is not valid: use one of op, step",
        ),
        ("RNGCHECK_SAMPLE_EVERY", "0", "RNGCHECK_SAMPLE_EVERY='0' is not valid"),
    ):
        with pytest.raises(EnvError, match=re.escape(says)):
            settings_from_env({"RNGCHECK": "1", name: value})


def test_the_step_of_a_random_op_is_kept_in_runs_flat_when_steps_draw_nothing():
    """StepEnds answers like a per-step array of totals, and steps that record no random op
    (level="step" between samples) add nothing to it."""
    import array
    import bisect
    import random

    from rngcheck.core.schedule import StepEnds

    rng = random.Random(0)
    for _ in range(100):
        ends, plain, total = StepEnds(), array.array("q"), 0
        for _ in range(rng.randint(0, 60)):
            total += rng.choice([0, 0, 1, 3])
            ends.end_step(total)
            plain.append(total)
        assert len(ends) == len(plain)
        for seq in range(total + 3):
            assert ends.step_of(seq) == bisect.bisect_right(plain, seq) + 1
    quiet = StepEnds()
    quiet.end_step(8)
    for _ in range(100_000):
        quiet.end_step(8)
    assert len(quiet) == 100_001 and len(quiet._totals) == 1 and quiet.step_of(3) == 1
