"""The checker's configuration: one validated, frozen dataclass. Environment variables are read at
the edge (``rngcheck.env``, the CLI, the pytest plugin) and turned into one of these."""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from .policy import EXPECTATIONS, IgnoreRule, parse_ignore, validate_choice

__all__ = [
    "LEVELS",
    "ON_FINDING",
    "RANGES",
    "ROUTES",
    "SYNC_MODES",
    "Config",
    "OutputError",
    "Range",
    "check_writable",
    "prepare_output",
    "remove_folders",
]

ON_FINDING = ("raise", "warn", "record")
SYNC_MODES = ("op", "step", "off")
LEVELS = ("op", "step")
# How ops reach the checker (core/dispatch.py): auto takes the selective route where this torch
# serves it (or the one RNGCHECK_ROUTE names).
ROUTES = ("auto", "selective", "dispatch_mode")


@dataclass(frozen=True, slots=True, kw_only=True)
class Range:
    """The values one numeric setting takes. Every route checks against the same table
    (:data:`RANGES`): the mode's keyword arguments here, the ``RNGCHECK_*`` variables in
    ``rngcheck.env.variables`` (whose table the docs render), and through them the pytest plugin.
    A value outside it is refused by name before anything starts: past the top, a deque, a
    ``timedelta`` or torch.distributed fails later with an ``OverflowError`` that names nothing."""

    low: int | float
    high: int | float
    whole: bool = True  # a count (int); else a number of seconds (int or float)
    example: str
    none: str = ""  # what None means, where None is allowed

    def __str__(self) -> str:
        return self.text()

    def text(self, symbol: str = "") -> str:
        """``a whole number N from 1 to 1,000`` (with ``symbol`` "N"), as errors and docs say it."""
        bounds = f"from {_number(self.low)} to {_number(self.high)}"
        if self.whole:
            return f"{'a whole number ' + symbol if symbol else 'a whole number'} {bounds}"
        return f"a number of seconds {bounds} ({self.high / 86400:g} days)"

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is of the right type and within the bounds (never a bool)."""
        if isinstance(value, bool) or not isinstance(value, int if self.whole else (int, float)):
            return False
        return bool(self.low <= value <= self.high)  # (NaN is in no range)

    def check(self, name: str, value: Any) -> None:
        """A ValueError naming ``name`` and the range, unless ``value`` is in it (or None, where
        None is allowed)."""
        if (value is None and self.none) or self.holds(value):
            return
        alternative = f", or None for {self.none}" if self.none else ""
        raise ValueError(f"{name} must be {self}{alternative}; got {_shown(value)}")


def _number(x: int | float) -> str:
    return f"{int(x):,}" if x == int(x) else f"{x:g}"


def _shown(value: Any) -> str:
    try:
        return repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"an integer of {value.bit_length()} bits"


_COUNT = 1_000_000_000  # more steps or random ops than any run has between two checks

# The numeric settings, by the mode's argument name (see Range).
RANGES: dict[str, Range] = {
    # Each kept event holds its call stack, about 3 KiB (docs/performance.md): 3 GiB at the top.
    "window": Range(low=1, high=1_000_000, example="4096"),
    "every_ops": Range(low=1, high=_COUNT, example="1024"),
    "every_steps": Range(low=1, high=_COUNT, example="10"),
    "sample_every": Range(low=1, high=_COUNT, example="100"),
    # At least 1: the op level learns the program on the first step.
    "sample_first": Range(low=1, high=_COUNT, example="2"),
    # torch.distributed's timeouts are whole milliseconds (under 1 ms is 0); 30 days is past
    # any wait a job means. The default, None, follows the process group's own.
    "timeout": Range(
        low=0.001,
        high=30 * 86400,
        whole=False,
        example="600",
        none="the process group's own timeout",
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Validated settings of an :class:`~rngcheck.RNGConsistencyMode`."""

    group: Any = None
    expect: str = "same"
    sync: str = "step"
    on_finding: str = "raise"
    check_recompute: bool = True
    window: int = 4096  # recent events kept in memory
    every_ops: int = 1024  # with sync="step", also exchange after this many random ops
    every_steps: int = 1  # with sync="step", exchange at every Nth optimizer step only
    # Seconds a rank waits for the others at an exchange; None: the process group's own timeout.
    timeout: float | None = None
    trace: str | None = None  # path to write the full random-op trace to (for `rngcheck diff`)
    report_path: str | None = None  # where to write this rank's JSON report
    ignore: tuple[IgnoreRule, ...] = ()  # known findings left out (counted as ignored)
    # "op": every random op is intercepted. "step": op by op on sampled steps only (the first
    # ``sample_first``, then one in ``sample_every``, and the step after any sign of trouble);
    # the other steps check generator states at optimizer steps and checkpoint regions.
    level: str = "op"
    sample_every: int = 100
    sample_first: int = 2
    # Across ranks: nothing learnt from a mismatch (per-rank seeds, lines drawing each rank's own
    # arguments or counts) exempts a draw; every such difference is a finding (for CI).
    strict: bool = False
    route: str = "auto"

    def __post_init__(self) -> None:
        for name in ("trace", "report_path"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                    raise ValueError(
                        f"{name} must be a file path (a str or os.PathLike), or None; got {value!r}"
                    )
                object.__setattr__(self, name, os.fspath(value))
        object.__setattr__(self, "ignore", parse_ignore("ignore", self.ignore))
        validate_choice("expect", self.expect, EXPECTATIONS)
        validate_choice("sync", self.sync, SYNC_MODES)
        validate_choice("on_finding", self.on_finding, ON_FINDING)
        validate_choice("level", self.level, LEVELS)
        validate_choice("route", self.route, ROUTES)
        for name in ("check_recompute", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        for name, allowed in RANGES.items():
            allowed.check(name, getattr(self, name))


class OutputError(ValueError):
    """A report or trace path that can never be written; the message says which part fails."""


def prepare_output(path: str, directory: bool = False) -> tuple[str, ...]:
    """Prove now that ``path`` (a file to write, or with ``directory`` a folder to write files in)
    can be written, by doing what writing it does: create the folders it needs, and create (then
    remove) a temporary file in the last one, as a save does before it renames that file into
    place. ``os.access`` is no proof: it is true for root on a folder nothing can be created in
    (``/proc``, a read-only mount). Returns the folders created here, outermost first; they stay
    (the files go there). Raises :class:`OutputError` after removing them again, when it fails."""
    path = os.path.abspath(path)
    if not directory and os.path.isdir(path):
        raise OutputError(f"{path} is a directory; give the path of a file to write")
    folder = path if directory else os.path.dirname(path)
    missing = []
    existing = folder
    while not os.path.exists(existing):  # the nearest part that exists: the rest is created
        missing.append(existing)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OutputError(f"{existing} is a file, not a folder")
    created: list[str] = []
    try:
        for part in reversed(missing):
            try:
                os.mkdir(part)
            except FileExistsError:  # another rank made it meanwhile
                continue
            except OSError as e:
                raise OutputError(f"the folder {part} cannot be created ({e.strerror})") from None
            created.append(part)
        try:
            fd, probe = tempfile.mkstemp(prefix=".rngcheck-probe-", suffix=".tmp", dir=folder)
        except OSError as e:
            raise OutputError(
                f"no file can be created in the folder {folder} ({e.strerror})"
            ) from None
        os.close(fd)
        os.unlink(probe)
    except OutputError:
        remove_folders(created)
        raise
    return tuple(created)


def remove_folders(folders: tuple[str, ...] | list[str]) -> None:
    """Remove ``folders`` (outermost first, as :func:`prepare_output` returns them) that are still
    empty: what was created for files that were never written."""
    for folder in reversed(folders):
        with contextlib.suppress(OSError):  # not empty (a file was written there), or gone
            os.rmdir(folder)


def check_writable(name: str, path: str) -> None:
    """Fail now, not after hours of training, when ``path`` can never be written (see
    :func:`prepare_output`; the folders it needs are created now)."""
    try:
        prepare_output(path)
    except OutputError as e:
        raise OutputError(
            f"{name}={path!r} cannot be written: {e}. Give a file path in a folder that exists or "
            "can be created, and that this process can write"
        ) from None
