"""The RNGCHECK_* variables: one table (name, valid values, default, what it does, its parser),
read and validated at the edge into :class:`EnvSettings`. The docs render this
table; a bad value names the variable and its valid values."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.config import LEVELS, ON_FINDING, RANGES, ROUTES, SYNC_MODES
from ..core.policy import EXPECTATIONS, IgnoreRule, parse_ignore

__all__ = [
    "OFF_VALUES",
    "ON_VALUES",
    "VARIABLES",
    "EnvError",
    "EnvSettings",
    "Variable",
    "settings_from_env",
]

ON_VALUES = ("1", "true", "on", "yes")
OFF_VALUES = ("0", "false", "off", "no", "")


class EnvError(ValueError):
    """An RNGCHECK_* variable has a value rngcheck cannot use. The message names it and the valid
    values."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Variable:
    """One environment variable: its name, what it takes, its default, and what it does."""

    name: str
    values: str  # the valid values, as the docs' table and error messages show them
    default: str
    help: str
    parse: Callable[[str, str], Any] = field(repr=False)


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ON_VALUES:
        return True
    if value in OFF_VALUES:
        return False
    raise EnvError(
        f"{name}={raw!r} is not valid: use one of {', '.join(ON_VALUES)} (on) or "
        f"{', '.join(v for v in OFF_VALUES if v)} (off)"
    )


def _switch(name: str, raw: str) -> bool:
    """A flag that an empty value does not turn off: only ``RNGCHECK`` itself reads empty as off
    (the startup hook does, before anything is imported); elsewhere an empty value is a mistake
    (``RNGCHECK_RECOMPUTE=$UNSET_VAR``), refused like an empty value of any other variable."""
    if not raw.strip():
        raise EnvError(
            f"{name} is set but empty: use one of {', '.join(ON_VALUES)} (on) or "
            f"{', '.join(v for v in OFF_VALUES if v)} (off), or unset it"
        )
    return _flag(name, raw)


def _choice(choices: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise EnvError(f"{name}={raw!r} is not valid: use one of {', '.join(choices)}")
        return value

    return parse


def _number(setting: str) -> Callable[[str, str], Any]:
    """The parser of a numeric variable: the mode's ``setting``, in the range the mode checks
    (``RANGES``, one table for every route), named in the error."""
    allowed = RANGES[setting]

    def parse(name: str, raw: str) -> int | float | None:
        value: int | float | None
        try:
            value = int(raw.strip()) if allowed.whole else float(raw.strip())
        except ValueError:  # (also past int()'s digit limit)
            value = None
        if not allowed.holds(value):
            shown = repr(raw) if len(raw) <= 40 else f"{raw[:20]!r}... ({len(raw)} characters)"
            raise EnvError(f"{name}={shown} is not valid: use {allowed}, e.g. {allowed.example}")
        return value

    return parse


def _path(name: str, raw: str) -> str:
    value = raw.strip()
    if not value:
        raise EnvError(f"{name} is set but empty: use a directory or a file path, or unset it")
    # Absolute now: the script may chdir before the report is written at exit.
    return os.path.abspath(os.path.expanduser(value))


def _ignore(name: str, raw: str) -> tuple[IgnoreRule, ...]:
    try:
        return parse_ignore(name, raw)
    except ValueError as e:
        raise EnvError(str(e)) from None


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            name="RNGCHECK",
            values="1/true/on/yes, 0/false/off/no",
            default="off",
            help="Check this run. Off: nothing of rngcheck is imported.",
            parse=_flag,
        ),
        Variable(
            name="RNGCHECK_ON_FINDING",
            values=", ".join(ON_FINDING),
            default="raise",
            help="raise: stop at the first finding (rendered on stderr, non-zero exit); warn: "
            "render and go on; record: go on, render the findings at exit.",
            parse=_choice(ON_FINDING),
        ),
        Variable(
            name="RNGCHECK_LEVEL",
            values=", ".join(LEVELS),
            default="op",
            help="op: check every random op. step: cheap enough to leave on for a long job; op "
            "by op on sampled steps and from the step after any sign of trouble, generator "
            "states at optimizer steps and checkpoint regions in between.",
            parse=_choice(LEVELS),
        ),
        Variable(
            name="RNGCHECK_SAMPLE_EVERY",
            values=RANGES["sample_every"].text("N"),
            default="100",
            help="With level=step, check one optimizer step in N op by op.",
            parse=_number("sample_every"),
        ),
        Variable(
            name="RNGCHECK_SAMPLE_FIRST",
            values=str(RANGES["sample_first"]),
            default="2",
            help="With level=step, check the first optimizer steps op by op.",
            parse=_number("sample_first"),
        ),
        Variable(
            name="RNGCHECK_SYNC",
            values=", ".join(SYNC_MODES),
            default="step",
            help="When ranks compare digests: at every random op, at optimizer steps, or never.",
            parse=_choice(SYNC_MODES),
        ),
        Variable(
            name="RNGCHECK_EXPECT",
            values=", ".join(EXPECTATIONS),
            default="same",
            help="What ranks' generators must be by default: the same, different, or unchecked.",
            parse=_choice(EXPECTATIONS),
        ),
        Variable(
            name="RNGCHECK_EVERY_STEPS",
            values=RANGES["every_steps"].text("N"),
            default="1",
            help="With sync=step, exchange at every Nth optimizer step only (a long job can keep "
            "the check on cheaply). A divergence is still pinned to its first op. With "
            "level=step, take the generators' digests at every Nth step only.",
            parse=_number("every_steps"),
        ),
        Variable(
            name="RNGCHECK_EVERY_OPS",
            values=str(RANGES["every_ops"]),
            default="1024",
            help="With sync=step, also exchange after this many random ops (jobs without an "
            "optimizer).",
            parse=_number("every_ops"),
        ),
        Variable(
            name="RNGCHECK_TIMEOUT",
            values=str(RANGES["timeout"]),
            default="the process group's timeout",
            help="How long a rank waits for the others at an exchange (then: rank_missing). By "
            "default the timeout of torch.distributed's own process group, so a rank that is "
            "only slow (saving a checkpoint, evaluating) is never reported missing.",
            parse=_number("timeout"),
        ),
        Variable(
            name="RNGCHECK_REPORT",
            values="a directory, or a path with {rank}",
            default="unset: no file",
            help="Where each rank keeps its JSON report (DIR/rank<N>.json): saved at each new "
            "finding and every few seconds as the run goes (a rank killed by a signal leaves it), "
            "and at exit or after a crash. Read with `rngcheck show`.",
            parse=_path,
        ),
        Variable(
            name="RNGCHECK_TRACE",
            values="a directory, or a path with {rank}",
            default="unset: no trace",
            help="Record every random op of the run (DIR/rank<N>.trace.jsonl) for `rngcheck diff`.",
            parse=_path,
        ),
        Variable(
            name="RNGCHECK_RECOMPUTE",
            values="1/true/on/yes, 0/false/off/no",
            default="on",
            help="Compare each activation-checkpoint recompute with its forward.",
            parse=_switch,
        ),
        Variable(
            name="RNGCHECK_STRICT",
            values="1/true/on/yes, 0/false/off/no",
            default="off",
            help="Across ranks, learn nothing from a mismatch (per-rank seeds, lines that draw "
            "each rank's own arguments or counts): report every such difference (for CI).",
            parse=_switch,
        ),
        Variable(
            name="RNGCHECK_ROUTE",
            values=", ".join(ROUTES),
            default="auto",
            help="How ops reach the checker. selective: kernels for the random ops and "
            "collectives only (every other op runs as without the checker); dispatch_mode: a "
            "TorchDispatchMode that sees every op. auto: selective where this torch serves it. "
            "Read by every checker of the process, RNGCHECK=1 or not.",
            parse=_choice(ROUTES),
        ),
        Variable(
            name="RNGCHECK_EVERY",
            values=RANGES["every_steps"].text("N"),
            default="1",
            help="The former name of RNGCHECK_EVERY_STEPS (deprecated; still read).",
            parse=_number("every_steps"),
        ),
        Variable(
            name="RNGCHECK_IGNORE",
            values="KIND, KIND@FILE:LINE, @FILE:LINE or @FILE, comma-separated",
            default="unset: nothing ignored",
            help="Leave known findings out, by kind and/or the user's line (e.g. "
            "recompute_mismatch@modeling_foo.py:120). They are counted in the report and the "
            "closing line as ignored, never dropped silently.",
            parse=_ignore,
        ),
        Variable(
            name="RNGCHECK_WINDOW",
            values=str(RANGES["window"]),
            default="4096",
            help="How many recent random-op events each rank keeps in memory (about 3 KiB each).",
            parse=_number("window"),
        ),
    )
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvSettings:
    """What the environment asks for, validated."""

    enabled: bool
    mode_kwargs: dict[str, Any]  # keyword arguments for RNGConsistencyMode
    rank: int = 0
    world_size: int = 1
    report_template: str | None = None  # as given, before the rank is filled in
    trace_template: str | None = None

    def paths(self, rank: int, world_size: int) -> tuple[str | None, str | None]:
        """The report's and the trace's paths for ``rank`` of ``world_size``."""
        return _paths(self.report_template, self.trace_template, rank, world_size)

    def launcher_paths(self) -> tuple[str | None, str | None]:
        """The report's and the trace's paths for a process that started the ranks itself
        (``torch.multiprocessing.spawn``) and is none of them: ``launcher`` for the rank."""
        return (
            _rank_path(self.report_template, "launcher", 2, "launcher.json")
            if self.report_template
            else None,
            _rank_path(self.trace_template, "launcher", 2, "launcher.trace.jsonl")
            if self.trace_template
            else None,
        )


def _paths(
    report: str | None, trace: str | None, rank: int, world_size: int
) -> tuple[str | None, str | None]:
    return (
        _rank_path(report, rank, world_size, "rank{rank}.json") if report else None,
        _rank_path(trace, rank, world_size, "rank{rank}.trace.jsonl") if trace else None,
    )


def _rank_path(template: str, rank: int | str, world_size: int, default_name: str) -> str:
    """``{rank}`` filled in; a directory gets ``default_name``; a plain file of a multi-rank run
    gets the rank before its extension, so ranks never overwrite each other's files."""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    root, ext = os.path.splitext(template)
    if ext in (".json", ".jsonl") and not os.path.isdir(template):
        return f"{root}.rank{rank}{ext}" if world_size > 1 else template
    return os.path.join(template, default_name.format(rank=rank))


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, default))
    except ValueError:
        return default


def settings_from_env(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """Read and validate every ``RNGCHECK*`` variable; an :class:`EnvError` names the bad one."""
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("RNGCHECK") and k not in VARIABLES)
    values: dict[str, Any] = {}
    for name, var in VARIABLES.items():
        if name in environ:
            values[name] = var.parse(name, environ[name])
    enabled = bool(values.get("RNGCHECK", False))
    if enabled and unknown:
        raise EnvError(
            f"unknown variable {unknown[0]} (a typo?): rngcheck reads " + ", ".join(VARIABLES)
        )
    every_steps = values.get("RNGCHECK_EVERY_STEPS", values.get("RNGCHECK_EVERY", 1))
    if "RNGCHECK_EVERY" in values and every_steps != values["RNGCHECK_EVERY"]:
        raise EnvError(
            f"RNGCHECK_EVERY={environ['RNGCHECK_EVERY']!r} and RNGCHECK_EVERY_STEPS="
            f"{environ['RNGCHECK_EVERY_STEPS']!r} disagree: RNGCHECK_EVERY is the former name of "
            "RNGCHECK_EVERY_STEPS; set only RNGCHECK_EVERY_STEPS"
        )
    rank = _env_int(environ, "RANK", 0)
    world_size = _env_int(environ, "WORLD_SIZE", 1)
    report = values.get("RNGCHECK_REPORT")
    trace = values.get("RNGCHECK_TRACE")
    report_path, trace_path = _paths(report, trace, rank, world_size)
    kwargs: dict[str, Any] = {
        "on_finding": values.get("RNGCHECK_ON_FINDING", "raise"),
        "sync": values.get("RNGCHECK_SYNC", "step"),
        "expect": values.get("RNGCHECK_EXPECT", "same"),
        "timeout": values.get("RNGCHECK_TIMEOUT"),
        "every_ops": values.get("RNGCHECK_EVERY_OPS", 1024),
        "every_steps": every_steps,
        "window": values.get("RNGCHECK_WINDOW", 4096),
        "check_recompute": values.get("RNGCHECK_RECOMPUTE", True),
        "strict": values.get("RNGCHECK_STRICT", False),
        "route": values.get("RNGCHECK_ROUTE", "auto"),
        "ignore": values.get("RNGCHECK_IGNORE", ()),
        "level": values.get("RNGCHECK_LEVEL", "op"),
        "sample_every": values.get("RNGCHECK_SAMPLE_EVERY", 100),
        "sample_first": values.get("RNGCHECK_SAMPLE_FIRST", 2),
        "report_path": report_path,
        "trace": trace_path,
    }
    return EnvSettings(
        enabled=enabled,
        mode_kwargs=kwargs,
        rank=rank,
        world_size=world_size,
        report_template=report,
        trace_template=trace,
    )
