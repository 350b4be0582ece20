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
    assert "_pytest" not in buggy and "pluggy" not in buggy  # nor pytest's own frames
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


def _set_environ(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    """Exactly these RNGCHECK* variables for the sessions this test starts."""
    for name in [k for k in os.environ if k.startswith(("RNGCHECK", "_RNGCHECK"))]:
        monkeypatch.delenv(name)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


# Writes what the test process has imported by the time a test runs.
_PROBE = """
import json
import sys


def test_probe():
    with open("imported.json", "w") as f:
        json.dump({m: m in sys.modules for m in ("rngcheck.pytest_plugin", "torch")}, f)
"""


@pytest.mark.parametrize(
    ("args", "rngcheck_env", "torch_imported"),
    [
        ((), None, False),  # nothing asks for checking
        ((), "0", False),  # RNGCHECK set, but off
        (("--rngcheck",), None, True),  # the control: checking imports torch, and the probe sees it
    ],
    ids=["nothing", "off", "checking"],
)
def test_a_run_that_asks_for_nothing_never_imports_torch(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    rngcheck_env: str | None,
    torch_imported: bool,
) -> None:
    # The session runs in a fresh process without this suite's conftest (which imports torch):
    # only the plugin, loaded from its pytest11 entry point, could bring torch in.
    _set_environ(monkeypatch, {} if rngcheck_env is None else {"RNGCHECK": rngcheck_env})
    pytester.makepyfile(test_probe=_PROBE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=1)
    imported = json.loads((pytester.path / "imported.json").read_text())
    assert imported == {"rngcheck.pytest_plugin": True, "torch": torch_imported}


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (
            {"RNGCHECK": "1", "RNGCHECK_ON_FINDING": "boom"},
            (),
            "RNGCHECK_ON_FINDING='boom' is not valid: use one of raise, warn, record",
        ),
        (
            {"RNGCHECK_EVERY_STEPS": "0"},
            ("--rngcheck",),
            "RNGCHECK_EVERY_STEPS='0' is not valid: use a whole number from 1 to "
            "1,000,000,000, e.g. 10",
        ),
        (  # was accepted under pytest (an OverflowError where a script starts)
            {"RNGCHECK_WINDOW": "99999999999999999999999"},
            ("--rngcheck",),
            "RNGCHECK_WINDOW='99999999999999999999999' is not valid: use a whole number from 1 "
            "to 1,000,000, e.g. 4096",
        ),
        (  # was read as off
            {"RNGCHECK_RECOMPUTE": ""},
            ("--rngcheck",),
            "RNGCHECK_RECOMPUTE is set but empty: use one of 1, true, on, yes (on) or 0, false, "
            "off, no (off), or unset it",
        ),
        (
            {"RNGCHECK": "yes please"},
            (),
            "RNGCHECK='yes please' is not valid: use one of 1, true, on, yes (on) or 0, false, "
            "off, no (off)",
        ),
        (
            {"RNGCHECK_ON_FINDNG": "record"},
            ("--rngcheck",),
            "unknown variable RNGCHECK_ON_FINDNG (a typo?): rngcheck reads RNGCHECK, ",
        ),
    ],
    ids=["choice", "number", "past-range", "empty", "switch", "unknown"],
)
def test_bad_environment_values_stop_the_run_as_they_stop_a_script(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    args: tuple[str, ...],
    message: str,
) -> None:
    _set_environ(monkeypatch, env)
    pytester.makepyfile(sample_tests=SAMPLE.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0].startswith(f"ERROR: rngcheck: {message}")
    assert "Traceback" not in result.stderr.str()


@pytest.mark.parametrize("given", ["blocker.txt", "blocker.txt/reports"])
def test_a_report_directory_that_can_never_be_written_stops_the_run(
    pytester: pytest.Pytester, given: str
) -> None:
    pytester.makepyfile(sample_tests=SAMPLE.read_text())
    blocker = pytester.makefile(".txt", blocker="not a directory")
    # Without --rngcheck too: the marked tests save their reports there.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--rngcheck-report", given)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == (
        f"ERROR: --rngcheck-report expects a directory to save reports in (created if missing); "
        f"got {given!r}, but {blocker} is a file, not a folder. Give a directory that exists "
        "or can be created, and that this user can write"
    )
    assert "Traceback" not in result.stderr.str()


def test_a_report_directory_nothing_can_be_made_in_stops_the_run_even_as_root(
    pytester: pytest.Pytester,
) -> None:
    # os.access says yes to root for /proc; creating the directory says no.
    pytester.makepyfile(sample_tests=SAMPLE.read_text())
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--rngcheck-report", "/proc/forbidden"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0].startswith(
        "ERROR: --rngcheck-report expects a directory to save reports in (created if missing); "
        "got '/proc/forbidden', but the folder /proc/forbidden cannot be created ("
    )


def test_a_report_directory_is_made_at_start_and_left_only_with_reports_in_it(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        sample_tests=SAMPLE.read_text(),
        test_where="""
import os


def test_made_at_start():
    assert os.path.isdir("out/reports")
""",
    )
    args = ("-p", "no:cacheprovider", "--rngcheck", "--rngcheck-report", "out/reports")
    pytester.runpytest_subprocess(*args, "test_where.py", "-k", "made").assert_outcomes(passed=1)
    assert not (pytester.path / "out").exists()  # a clean run: nothing saved, nothing left
    pytester.runpytest_subprocess(*args, "sample_tests.py", "-k", "test_buggy").assert_outcomes(
        failed=1, deselected=5
    )
    assert os.listdir(pytester.path / "out" / "reports") == ["sample_tests.py_test_buggy.json"]


def test_a_marker_argument_past_its_range_fails_the_test_naming_it(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_window="""
import pytest
import torch


@pytest.mark.rngcheck(window=10**30)
def test_window():
    torch.rand(3)
"""
    )
    pytester.makeconftest(_RECORDER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "test_window.py")
    result.assert_outcomes(failed=1)
    failure = json.loads((pytester.path / "reports.json").read_text())["test_window"]["longrepr"]
    # Was an OverflowError from deep inside the mode ("Python int too large to convert to C
    # ssize_t"), naming nothing.
    assert f"window must be a whole number from 1 to 1,000,000; got {10**30}" in failure
    assert "OverflowError" not in failure and "Traceback" not in failure


def test_a_report_that_cannot_be_saved_is_said_beside_the_finding(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        sample_tests=SAMPLE.read_text(),
        test_blocked="""
import os

import pytest
import torch
from sample_tests import _checkpointed_noise


@pytest.mark.rngcheck
def test_blocked() -> None:
    os.rmdir("reports")  # made when the run started: after that, a file takes its path
    open("reports", "w").close()
    _checkpointed_noise(torch.Generator().manual_seed(0))
""",
    )
    pytester.makeconftest(_RECORDER)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--rngcheck-report", "reports", "test_blocked.py"
    )
    result.assert_outcomes(failed=1)
    blocked = json.loads((pytester.path / "reports.json").read_text())["test_blocked"]
    assert TITLE in blocked["longrepr"]  # the finding, not the plugin's OSError, fails the test
    assert "pytest_plugin.py" not in blocked["longrepr"]
    saved = pytester.path / "reports" / "test_blocked.py_test_blocked.json"
    assert blocked["sections"]["Captured rngcheck report call"].startswith(
        f"could not save {saved}: "
    )


_KNOWN = """
import pytest
import torch
from torch.utils.checkpoint import checkpoint


def _buggy():
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(8, 8)

    def block(x):
        return layer(x) * (torch.rand(x.shape, generator=gen) > 0.5)  # line 11

    checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()


@pytest.mark.rngcheck
@pytest.mark.rngcheck_ignore("recompute_mismatch@known.py:11", reason="upstream bug")
def test_known():
    _buggy()


@pytest.mark.rngcheck
@pytest.mark.rngcheck_ignore("recompute_mismatch@known.py:12")
def test_other_line():
    _buggy()


@pytest.mark.rngcheck
@pytest.mark.rngcheck_ignore("recompute-mismatch")
def test_bad_rule():
    _buggy()
"""


def test_known_findings_are_ignored_by_marker_or_environment_and_counted(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(known=_KNOWN)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "known.py")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    # The rule covers line 11 only; a rule for another line leaves the finding standing.
    assert "FAILED known.py::test_other_line" in out
    assert "rngcheck: ignored: 1 finding occurrence(s) (recompute_mismatch@known.py:11 x1)" in out
    assert "recompute-mismatch' is not a rule of the form KIND, KIND@FILE:LINE" in out
    assert "Traceback" not in out.split("known.py::test_bad_rule")[-1]

    # RNGCHECK_IGNORE applies to every checked test, and is validated like every variable.
    monkeypatch.setenv("RNGCHECK", "1")
    monkeypatch.setenv("RNGCHECK_IGNORE", "recompute_mismatch@known.py")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "known.py", "-k", "not bad")
    result.assert_outcomes(passed=2)
    assert "rngcheck: ignored: 2 finding occurrence(s) (recompute_mismatch@known.py x2)" in (
        result.stdout.str()
    )
    monkeypatch.setenv("RNGCHECK_IGNORE", "boom@known.py")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "known.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "RNGCHECK_IGNORE: 'boom@known.py' is not a rule of the form" in result.stderr.str()
