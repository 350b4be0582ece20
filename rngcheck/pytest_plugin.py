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
it adds no header line, starts no mode, leaves every test alone and imports no torch.

Bad input stops the run at configure time with a usage error: an option value, an RNGCHECK*
variable (validated by the parser of ``RNGCHECK=1 python train.py``, whenever ``--rngcheck`` or
``RNGCHECK`` is set), or a ``--rngcheck-report`` directory that could never be written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

_ENABLED = pytest.StashKey[bool]()
_MODE = pytest.StashKey[Any]()  # the mode checking the running test, if any
_IGNORED = pytest.StashKey[dict]()  # rule -> findings it left out, over the session
_ENV_IGNORE = pytest.StashKey[tuple]()  # RNGCHECK_IGNORE's rules, for every checked test
_REPORT_DIR = pytest.StashKey[str | None]()  # --rngcheck-report, absolute (tests may chdir)
_CREATED = pytest.StashKey[tuple]()  # the folders of --rngcheck-report made at configure
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
    config.addinivalue_line(
        "markers",
        "rngcheck_ignore(*rules, reason=None): leave known rngcheck findings out of this test "
        "(rules like 'recompute_mismatch@modeling_foo.py:120'); they are counted as ignored",
    )
    config.stash[_ENABLED] = bool(config.getoption("rngcheck"))
    directory = config.getoption("rngcheck_report")
    config.stash[_REPORT_DIR] = _report_dir(config, directory) if directory else None
    config.stash[_ENV_IGNORE] = _check_environment(config.stash[_ENABLED])
    if config.stash[_ENABLED]:
        from .core.config import Config

        try:  # bad option values fail the run at once, naming the valid ones
            Config(
                expect=config.getoption("rngcheck_expect"), sync=config.getoption("rngcheck_sync")
            )
        except ValueError as e:
            raise pytest.UsageError(f"--rngcheck: {e}") from None


def _report_dir(config: pytest.Config, directory: str) -> str:
    """The absolute report directory, created now to prove it can be (a UsageError now, not a
    plugin traceback in place of a test's finding later); removed at the end of the session
    if no test saved a report in it."""
    from .core.config import OutputError, prepare_output  # no torch behind it

    path = os.path.abspath(directory)
    try:
        config.stash[_CREATED] = prepare_output(path, directory=True)
    except OutputError as e:
        raise pytest.UsageError(
            f"--rngcheck-report expects a directory to save reports in (created if missing); "
            f"got {directory!r}, but {e}. Give a directory that exists or can be created, and "
            "that this user can write"
        ) from None
    return path


def pytest_unconfigure(config: pytest.Config) -> None:
    created = config.stash.get(_CREATED, ())
    if created:  # only tests with findings save a report: a clean run leaves no empty folder
        from .core.config import remove_folders

        remove_folders(created)


def _check_environment(enabled: bool) -> tuple[Any, ...]:
    """Validate the RNGCHECK* variables the way ``RNGCHECK=1 python train.py`` does (the same
    parser), so that a typo fails the run at once instead of being ignored under pytest. Returns
    the RNGCHECK_IGNORE rules, which apply to every checked test."""
    value = os.environ.get("RNGCHECK", "")
    if not enabled and not value.strip() and "RNGCHECK_IGNORE" not in os.environ:
        return ()  # nothing asks for checking: import nothing
    from .env.variables import OFF_VALUES, EnvError, settings_from_env

    environ = dict(os.environ)
    if value.strip().lower() in OFF_VALUES and enabled:
        environ["RNGCHECK"] = "1"  # --rngcheck: read them as RNGCHECK=1 would (unknown names too)
    try:
        settings = settings_from_env(environ)
    except EnvError as e:
        raise pytest.UsageError(f"rngcheck: {e}") from None
    return tuple(settings.mode_kwargs["ignore"])


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.stash.get(_ENABLED, False):
        return None
    return (
        f"rngcheck: every test runs under RNGConsistencyMode (expect="
        f"{config.getoption('rngcheck_expect')}, sync={config.getoption('rngcheck_sync')}); "
        "reproduce one with: pytest --rngcheck NODEID"
    )


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


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
    ignore = [*item.config.stash.get(_ENV_IGNORE, ()), *_as_list(kwargs.get("ignore"))]
    for mark in item.iter_markers("rngcheck_ignore"):
        ignore.extend(mark.args)
    if ignore:
        kwargs["ignore"] = ignore
    kwargs["on_finding"] = "record"  # the test fails after its call, with every finding listed
    return kwargs


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    kwargs = _mode_kwargs(item)
    if kwargs is None:
        return (yield)
    from .mode import RNGConsistencyMode

    try:
        mode = RNGConsistencyMode(**kwargs)
    except (TypeError, ValueError) as e:  # the marker's arguments: say which, not a traceback
        problem = f"rngcheck: this test's rngcheck markers ask for {kwargs}: {e}"
    else:
        problem = ""
    if problem:
        pytest.fail(problem, pytrace=False)
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
    if report.ignored:  # never silent: beside the test, and in the session's summary
        ignored = item.config.stash.setdefault(_IGNORED, {})
        for rule, count in report.ignored.items():
            ignored[rule] = ignored.get(rule, 0) + count
        item.add_report_section("call", "rngcheck", _ignored_text(report.ignored))
    if not report.ok:
        _save(item, report)
        pytest.fail(_failure_text(item, report), pytrace=False)
    return result


def _ignored_text(ignored: dict[str, int]) -> str:
    rules = ", ".join(f"{rule} x{count}" for rule, count in sorted(ignored.items()))
    return f"rngcheck: ignored: {sum(ignored.values())} finding occurrence(s) ({rules})"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    ignored = config.stash.get(_IGNORED, None)
    if ignored:
        terminalreporter.write_line(_ignored_text(ignored))


def _failure_text(item: pytest.Item, report: Any) -> str:
    from .output.render import format_finding, summary_line

    parts = [format_finding(f, report.world_size) for f in report.findings]
    parts.append(f"{summary_line(report)}. Reproduce: pytest --rngcheck {item.nodeid}")
    return "\n".join(parts)


def _attach(item: pytest.Item, mode: Any) -> None:
    report = mode.report
    if not report.ok:
        _save(item, report)
        item.add_report_section("call", "rngcheck", _failure_text(item, report))


def _save(item: pytest.Item, report: Any) -> None:
    directory = item.config.stash.get(_REPORT_DIR, None)
    if not directory:
        return
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid).strip("_") + ".json"
    report.meta.setdefault("run_id", item.nodeid)
    report.meta.setdefault("test", item.nodeid)
    path = os.path.join(directory, name)
    try:
        report.save(path)
    except OSError as e:  # (the disk filled up, say): said beside the finding, never instead of it
        item.add_report_section("call", "rngcheck report", f"could not save {path}: {e}")


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
