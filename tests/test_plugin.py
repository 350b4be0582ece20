"""The pytest plugin, as a user meets it: real pytest sessions (pytester, in a fresh process, with
the plugin loaded from its pytest11 entry point) over the sample tests in
tests/scripts/sample_tests.py, with and without --rngcheck. Outcomes are pytester's counts and, per
test, pytest's own reports (a conftest in the session writes them out), not regexes over text."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rngcheck.cli import main as cli_main
from rngcheck.output.report import Report

pytestmark = pytest.mark.slow  # each test runs a pytest session in a fresh process

SAMPLE = Path(__file__).resolve().parent / "scripts" / "sample_tests.py"
TITLE = "rngcheck: checkpoint recompute drew different random numbers [recompute_mismatch]"

# Writes each test's call-phase report (outcome, failure text, report sections) as JSON.
_RECORDER = """
import json

_reports = {}


def pytest_runtest_logreport(report):
    if report.when == "call":
        _reports[report.nodeid.split("::")[-1]] = {
            "outcome": report.outcome,
            "longrepr": report.longreprtext,
            "sections": dict(report.sections),
        }


def pytest_sessionfinish(session):
    with open("reports.json", "w") as f:
        json.dump(_reports, f)
"""


def _run(pytester: pytest.Pytester, *args: str) -> tuple[Any, dict[str, Any]]:
    """A pytest session over the sample tests; pytester's result and each test's report."""
    pytester.makepyfile(sample_tests=SAMPLE.read_text())
    pytester.makeconftest(_RECORDER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "sample_tests.py", *args)
    return result, json.loads((pytester.path / "reports.json").read_text())


def _outcomes(reports: dict[str, Any]) -> dict[str, str]:
    return {name: r["outcome"] for name, r in reports.items()}


def test_without_the_option_only_marked_tests_are_checked(pytester: pytest.Pytester) -> None:
    result, reports = _run(pytester)
    result.assert_outcomes(passed=4, failed=2)
    assert _outcomes(reports) == {
        "test_clean": "passed",
        "test_buggy": "passed",  # not checked: nothing asked for it
        "test_marked_buggy": "failed",  # the marker checks it anyway
        "test_opted_out": "passed",
        "test_fixture_sees_findings": "passed",  # the fixture alone records, it does not fail
        "test_fails_on_its_own": "failed",
    }
    marked = reports["test_marked_buggy"]["longrepr"]
    assert TITLE in marked
    assert "Reproduce: pytest --rngcheck sample_tests.py::test_marked_buggy" in marked
    own = reports["test_fails_on_its_own"]
    assert not [name for name in own["sections"] if "rngcheck" in name]  # not checked: nothing


def test_rngcheck_fails_tests_with_findings_and_saves_their_reports(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # RNGCHECK=1 turns --rngcheck on (and the startup hook stays out of the pytest process: no
    # second mode, no "already active" error).
    monkeypatch.setenv("RNGCHECK", "1")
    result, reports = _run(pytester, "--rngcheck-report", "reports")
    result.assert_outcomes(passed=2, failed=4)
    assert _outcomes(reports) == {
        "test_clean": "passed",
        "test_buggy": "failed",
        "test_marked_buggy": "failed",
        "test_opted_out": "passed",  # marked enabled=False: runs its own mode undisturbed
        "test_fixture_sees_findings": "failed",  # with the option, the fixture is the plugin's
        "test_fails_on_its_own": "failed",
    }
    buggy = reports["test_buggy"]["longrepr"]
    assert TITLE in buggy
    assert "Likely cause: Generator #1 (cpu, first used at sample_tests.py:" in buggy
    assert 'File "' in buggy and "sample_tests.py" in buggy  # the user's frames, both sides
    assert "Reproduce: pytest --rngcheck sample_tests.py::test_buggy" in buggy
    assert "Traceback" not in buggy and "pytest_plugin.py" not in buggy  # no plugin internals
    own = reports["test_fails_on_its_own"]
    assert "AssertionError: the test's own failure" in own["longrepr"]
    assert TITLE in own["sections"]["Captured rngcheck call"]  # its findings beside its failure
    saved = sorted(os.listdir(pytester.path / "reports"))
    assert saved == [
        "sample_tests.py_test_buggy.json",
        "sample_tests.py_test_fails_on_its_own.json",
        "sample_tests.py_test_fixture_sees_findings.json",
        "sample_tests.py_test_marked_buggy.json",
    ]
    report = Report.load(pytester.path / "reports" / "sample_tests.py_test_buggy.json")
    assert report.meta["test"] == "sample_tests.py::test_buggy"
    assert [f.kind.value for f in report.findings] == ["recompute_mismatch"]
    assert cli_main(["show", str(pytester.path / "reports")]) == 1


def test_the_header_says_how_to_reproduce_only_when_checking(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(sample_tests=SAMPLE.read_text())
    on = pytester.runpytest_subprocess("--rngcheck", "-k", "clean", "sample_tests.py")
    on.assert_outcomes(passed=1, deselected=5)
    header = "rngcheck: every test runs under RNGConsistencyMode (expect=same, sync=step); "
    on.stdout.fnmatch_lines([header + "reproduce one with: pytest --rngcheck NODEID"])
    off = pytester.runpytest_subprocess("-k", "clean", "sample_tests.py")
    off.assert_outcomes(passed=1, deselected=5)
    off.stdout.no_fnmatch_line("rngcheck: every test runs*")


def test_bad_option_values_stop_the_run_naming_the_valid_ones(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(sample_tests=SAMPLE.read_text())
    result = pytester.runpytest_subprocess("--rngcheck", "--rngcheck-sync=sometimes")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--rngcheck: sync must be one of 'op', 'step', 'off'; got 'sometimes'*"]
    )
