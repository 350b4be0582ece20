"""The checker's configuration: one validated, frozen dataclass. Environment variables are read at
the edge (``rngcheck.env``, the CLI, the pytest plugin) and turned into one of these."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from .policy import EXPECTATIONS, IgnoreRule, parse_ignore, validate_choice

__all__ = ["LEVELS", "ON_FINDING", "SYNC_MODES", "Config", "check_writable", "unwritable"]

ON_FINDING = ("raise", "warn", "record")
SYNC_MODES = ("op", "step", "off")
LEVELS = ("op", "step")


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
        _positive_int("sample_every", self.sample_every)
        _positive_int("sample_first", self.sample_first)  # the op level learns the program
        for name in ("check_recompute", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        _positive_int("window", self.window)
        _positive_int("every_ops", self.every_ops)
        _positive_int("every_steps", self.every_steps)
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise ValueError(
                "timeout must be a positive number of seconds (e.g. 600), or None for the "
                f"process group's own timeout; got {self.timeout!r}"
            )


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def unwritable(path: str, directory: bool = False) -> str:
    """Why ``path`` (a file to write, or with ``directory`` a folder to write files in) can never
    be written, or ``""`` when it can: the nearest part of it that exists must be a writable
    folder (the rest is created), and a file path must not be a directory."""
    path = os.path.abspath(path)
    if not directory and os.path.isdir(path):
        return f"{path} is a directory; give the path of a file to write"
    existing = path if directory else os.path.dirname(path)
    while not os.path.exists(existing):  # the nearest part that exists: it creates the rest
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the folder {existing} is not writable by this process"
    return ""


def check_writable(name: str, path: str) -> None:
    """Fail now, not after hours of training, when ``path`` can never be written."""
    problem = unwritable(path)
    if problem:
        raise ValueError(
            f"{name}={path!r} cannot be written: {problem}. Give a file path in a folder that "
            "exists or can be created, and that this process can write"
        )
