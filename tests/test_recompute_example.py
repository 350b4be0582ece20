"""examples/checkpoint_dropout.py (the demo) runs, shows both mismatches, then the quiet report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "checkpoint_dropout.py"


def test_checkpoint_dropout_example():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("[recompute_mismatch]") == 2
    assert "was passed as generator=" in out
    assert "preserve_rng_state=False, so default cpu was not stashed" in out
    assert out.count("dropout masks of forward and recompute equal: False") == 2
    assert out.rstrip().endswith("no findings")
    assert "dropout masks of forward and recompute equal: True" in out
    # each finding points at the model's own random-op line
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    for needle in ("bernoulli_(1 - P, generator=self.generator)", "F.dropout(h, P"):
        [lineno] = [i for i, line in enumerate(lines, 1) if needle in line]
        assert f"at checkpoint_dropout.py:{lineno}" in out
    # The README shows this run's first finding: its recurring count and summary lines are real.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for shown in (
        "Recurring: seen 30 times in all, steps 1 to 30",
        "rngcheck: 90 random op(s) checked, 1 finding(s) (30 occurrences)",
        "random op #0 of checkpoint #1 (reentrant) of Model at checkpoint_dropout.py:",
    ):
        assert shown in readme and shown in out, shown
