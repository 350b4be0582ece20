"""The pytest plugin, as a user meets it: real pytest runs (through the pytest11 entry point) on the
sample tests in tests/scripts/sample_tests.py, with and without --rngcheck."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rngcheck.cli import main as cli_main
from rngcheck.output.report import Report

SAMPLE = Path(__file__).resolve().parent / "scripts" / "sample_tests.py"
TIMEOUT = 120
TITLE = "rngcheck: checkpoint recompute drew different random numbers [recompute_mismatch]"


def _pytest(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(SAMPLE, tmp_path / "sample_tests.py")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RNGCHECK", "_RNGCHECK"))}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _outcomes(output: str) -> dict[str, str]:
    return {
        m.group(2): m.group(1)
        for m in re.finditer(r"^(PASSED|FAILED|ERROR) sample_tests\.py::(\w+)", output, re.M)
    }


def _section(output: str, test: str) -> str:
    """The failure report of one test."""
    start = output.index(f"_ {test} _")
    end = output.find("\n__", start + 1)
    return output[start : end if end != -1 else len(output)]


def test_without_the_option_only_marked_tests_are_checked(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "sample_tests.py")
    assert _outcomes(r.stdout) == {
        "test_clean": "PASSED",
        "test_buggy": "PASSED",  # not checked: nothing asked for it
        "test_marked_buggy": "FAILED",  # the marker checks it anyway
        "test_opted_out": "PASSED",
        "test_fixture_sees_findings": "PASSED",  # the fixture alone records, it does not fail
        "test_fails_on_its_own": "FAILED",
    }, r.stdout[-3000:]
    assert "rngcheck: every test runs" not in r.stdout  # no header line when off
    marked = _section(r.stdout, "test_marked_buggy")
    assert TITLE in marked
    assert "Reproduce: pytest --rngcheck sample_tests.py::test_marked_buggy" in marked
    assert "Captured rngcheck call" not in r.stdout


def test_rngcheck_fails_tests_with_findings_and_saves_their_reports(tmp_path: Path) -> None:
    # RNGCHECK=1 turns --rngcheck on (and the startup hook stays out of the pytest process: no
    # second mode, no "already active" error).
    r = _pytest(tmp_path, "sample_tests.py", "--rngcheck-report", "reports", RNGCHECK="1")
    assert _outcomes(r.stdout) == {
        "test_clean": "PASSED",
        "test_buggy": "FAILED",
        "test_marked_buggy": "FAILED",
        "test_opted_out": "PASSED",  # marked enabled=False: runs its own mode undisturbed
        "test_fixture_sees_findings": "FAILED",  # with the option, the fixture is the plugin's mode
        "test_fails_on_its_own": "FAILED",
    }, r.stdout[-3000:]
    header = "rngcheck: every test runs under RNGConsistencyMode (expect=same, sync=step); "
    assert header + "reproduce one with: pytest --rngcheck NODEID" in r.stdout
    buggy = _section(r.stdout, "test_buggy")
    assert TITLE in buggy
    assert "Likely cause: Generator #1 (cpu, first used at sample_tests.py:" in buggy
    assert 'File "' in buggy and "sample_tests.py" in buggy  # the user's frames, both sides
    assert "Reproduce: pytest --rngcheck sample_tests.py::test_buggy" in buggy
    assert "Traceback" not in buggy and "pytest_plugin.py" not in buggy  # no plugin internals
    own = _section(r.stdout, "test_fails_on_its_own")
    assert "AssertionError: the test's own failure" in own
    assert "Captured rngcheck call" in own and TITLE in own
    saved = sorted(os.listdir(tmp_path / "reports"))
    assert saved == [
        "sample_tests.py_test_buggy.json",
        "sample_tests.py_test_fails_on_its_own.json",
        "sample_tests.py_test_fixture_sees_findings.json",
        "sample_tests.py_test_marked_buggy.json",
    ]
    report = Report.load(tmp_path / "reports" / "sample_tests.py_test_buggy.json")
    assert report.meta["test"] == "sample_tests.py::test_buggy"
    assert [f.kind.value for f in report.findings] == ["recompute_mismatch"]
    assert cli_main(["show", str(tmp_path / "reports")]) == 1


def test_bad_option_values_stop_the_run_naming_the_valid_ones(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "sample_tests.py", "--rngcheck", "--rngcheck-sync=sometimes")
    assert r.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--rngcheck: sync must be one of 'op', 'step', 'off'; got 'sometimes'" in r.stderr
