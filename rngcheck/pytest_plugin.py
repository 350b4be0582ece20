"""pytest plugin (the ``pytest11`` entry point ``rngcheck``): check tests' random ops.

- ``pytest --rngcheck`` (or ``RNGCHECK=1 pytest``) runs every test's call under an
  :class:`~rngcheck.RNGConsistencyMode` and fails the tests that produce findings, with the
  rendered finding in the failure report.
- ``@pytest.mark.rngcheck`` checks one test (or a module, with ``pytestmark``) without the option;
  its keyword arguments go to the mode (``@pytest.mark.rngcheck(check_recompute=True)``);
  ``@pytest.mark.rngcheck(enabled=False)`` leaves a test out (one that starts its own mode).
- The ``rngcheck_mode`` fixture hands a test the active mode (its report, ``check()``); on its own
  it starts a recording mode that does not fail the test, so the test can assert on the findings.

Only the test's call phase is checked, not its fixtures' set-up and teardown. The plugin is loaded
in every pytest run of an environment where rngcheck is installed: when nothing asks for checking
it adds no header line, starts no mode and leaves every test alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

_ENABLED = pytest.StashKey[bool]()
_MODE = pytest.StashKey[Any]()  # the mode checking the running test, if any
_ON_VALUES = ("1", "true", "on", "yes")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rngcheck", "rngcheck: find RNG drift in PyTorch")
    group.addoption(
        "--rngcheck",
        action="store_true",
        default=os.environ.get("RNGCHECK", "").strip().lower() in _ON_VALUES,
        help="run every test under rngcheck's RNGConsistencyMode; fail tests with findings "
        "(default: on when RNGCHECK=1)",
    )
    group.addoption(
        "--rngcheck-expect",
        default=os.environ.get("RNGCHECK_EXPECT", "same").strip().lower(),
        help="the mode's default expectation across ranks: same, differ or ignore "
        "(default: RNGCHECK_EXPECT, else same)",
    )
    group.addoption(
        "--rngcheck-sync",
        default=os.environ.get("RNGCHECK_SYNC", "step").strip().lower(),
        help="when ranks exchange digests: op, step or off (default: RNGCHECK_SYNC, else step)",
    )
    group.addoption(
        "--rngcheck-report",
        default=None,
        metavar="DIR",
        help="save the JSON report of each test with findings in DIR (read with `rngcheck show`)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "rngcheck(enabled=True, **mode_kwargs): check this test's random ops with rngcheck "
        "(enabled=False: never check it, even with --rngcheck)",
    )
    config.stash[_ENABLED] = bool(config.getoption("rngcheck"))
    if config.stash[_ENABLED]:
        from .core.config import Config

        try:  # bad option values fail the run at once, naming the valid ones
            Config(
                expect=config.getoption("rngcheck_expect"), sync=config.getoption("rngcheck_sync")
            )
        except ValueError as e:
            raise pytest.UsageError(f"--rngcheck: {e}") from None


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.stash.get(_ENABLED, False):
        return None
    return (
        f"rngcheck: every test runs under RNGConsistencyMode (expect="
        f"{config.getoption('rngcheck_expect')}, sync={config.getoption('rngcheck_sync')}); "
        "reproduce one with: pytest --rngcheck NODEID"
    )


def _mode_kwargs(item: pytest.Item) -> dict[str, Any] | None:
    """The mode's arguments for this test, or None when the test is not to be checked."""
    marker = item.get_closest_marker("rngcheck")
    kwargs: dict[str, Any] = {}
    if marker is not None:
        kwargs = dict(marker.kwargs)
        if not kwargs.pop("enabled", marker.args[0] if marker.args else True):
            return None
    elif not item.config.stash.get(_ENABLED, False):
        return None
    kwargs.setdefault("expect", item.config.getoption("rngcheck_expect"))
    kwargs.setdefault("sync", item.config.getoption("rngcheck_sync"))
    kwargs["on_finding"] = "record"  # the test fails after its call, with every finding listed
    return kwargs


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    kwargs = _mode_kwargs(item)
    if kwargs is None:
        return (yield)
    from .mode import RNGConsistencyMode

    mode = RNGConsistencyMode(**kwargs)
    item.stash[_MODE] = mode
    try:
        with mode:
            result = yield
    except BaseException:
        _attach(item, mode)  # the test failed on its own: show the findings next to its error
        raise
    finally:
        del item.stash[_MODE]
    report = mode.report
    if not report.ok:
        _save(item, report)
        pytest.fail(_failure_text(item, report), pytrace=False)
    return result


def _failure_text(item: pytest.Item, report: Any) -> str:
    from .output.render import format_finding

    parts = [format_finding(f) for f in report.findings]
    parts.append(
        f"rngcheck: {len(report.findings)} finding(s) in {report.random_ops} random op(s). "
        f"Reproduce: pytest --rngcheck {item.nodeid}"
    )
    return "\n".join(parts)


def _attach(item: pytest.Item, mode: Any) -> None:
    report = mode.report
    if not report.ok:
        _save(item, report)
        item.add_report_section("call", "rngcheck", _failure_text(item, report))


def _save(item: pytest.Item, report: Any) -> None:
    directory = item.config.getoption("rngcheck_report")
    if not directory:
        return
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid).strip("_") + ".json"
    report.meta.setdefault("run_id", item.nodeid)
    report.meta.setdefault("test", item.nodeid)
    report.save(os.path.join(directory, name))


@pytest.fixture
def rngcheck_mode(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The RNGConsistencyMode checking this test.

    With ``--rngcheck`` or the marker it is the plugin's mode (findings fail the test). On its own,
    a recording mode around the test, which does not fail it: assert on ``rngcheck_mode.report``.
    """
    item = request.node
    if _mode_kwargs(item) is not None:
        # The plugin enters its mode around the call, after fixtures are set up: hand out a view
        # that finds it when the test runs.
        yield _PluginMode(item)
        return
    from .mode import RNGConsistencyMode

    with RNGConsistencyMode(on_finding="record") as mode:
        yield mode


class _PluginMode:
    """Forwards to the mode the plugin runs around this test's call."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item

    def __getattr__(self, name: str) -> Any:
        mode = self._item.stash.get(_MODE, None)
        if mode is None:
            raise RuntimeError("the rngcheck mode runs only during the test's call")
        return getattr(mode, name)
