"""Expectations: which ranks must agree on a generator's state ("same"), which must not ("differ"),
and which ops to leave alone ("ignore"), scoped to a region of code with :func:`expect`."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXPECTATIONS",
    "Expectation",
    "IgnoreRule",
    "current_expectation",
    "expect",
    "parse_ignore",
    "validate_choice",
]

EXPECTATIONS = ("same", "differ", "ignore")


def validate_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``; otherwise a ValueError naming them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class Expectation:
    """The policy for the random ops inside one ``expect`` block (or the mode's default)."""

    policy: str
    group: Any = None  # None: the mode's group. A ProcessGroup, rank list, DeviceMesh, dim names


_local = threading.local()


def _stack() -> list[Expectation]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current_expectation() -> Expectation | None:
    """The innermost ``expect`` block's expectation on this thread, or None outside any."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextmanager
def expect(policy: str, group: Any = None) -> Iterator[Expectation]:
    """Set the expectation for the random ops run inside the block.

    ``"same"``: ranks of ``group`` must hold the same generator state before and after each op;
    ``"differ"``: they must not share one (per-rank streams: augmentation, tensor-parallel dropout);
    ``"ignore"``: do not check these ops at all. ``group`` defaults to the mode's group.

    Works whether or not an RNGConsistencyMode is active, so library code can declare its streams
    unconditionally. Blocks nest; the innermost wins.
    """
    validate_choice("rngcheck.expect(policy)", policy, EXPECTATIONS)
    exp = Expectation(policy, group)
    stack = _stack()
    stack.append(exp)
    try:
        yield exp
    finally:
        stack.pop()


# The kinds of finding (FindingKind's values; kept here so the policy does not import findings).
FINDING_KINDS = ("rank_divergence", "rank_collision", "recompute_mismatch", "rank_missing")


@dataclass(frozen=True, slots=True)
class IgnoreRule:
    """A known finding to leave out of a run, by kind and/or the user's site: ``kind``,
    ``kind@file.py:120``, ``@file.py:120`` or ``@path/to/file.py`` (any line of that file).
    Ignored findings are counted in the report, never silently dropped."""

    kind: str = ""  # "" matches every kind
    file: str = ""  # "" matches every site; else a file name or the end of a path
    line: int = 0  # 0: any line of ``file``

    @property
    def text(self) -> str:
        where = f"@{self.file}" + (f":{self.line}" if self.line else "") if self.file else ""
        return f"{self.kind}{where}"

    def matches(self, kind: str, sites: Iterable[tuple[str, int]]) -> bool:
        """Whether a finding of ``kind`` at any of ``sites`` ((filename, line) pairs) is this."""
        if self.kind and self.kind != kind:
            return False
        if not self.file:
            return True
        for filename, line in sites:
            if self.line and line != self.line:
                continue
            name = filename.replace(os.sep, "/")
            if name == self.file or name.endswith("/" + self.file):
                return True
        return False


_IGNORE_FORMAT = (
    "KIND, KIND@FILE:LINE, @FILE:LINE or @FILE, where KIND is one of "
    + ", ".join(FINDING_KINDS)
    + " (e.g. recompute_mismatch@modeling_foo.py:120)"
)


def parse_ignore(name: str, value: Any) -> tuple[IgnoreRule, ...]:
    """Ignore rules from a string (comma-separated) or a sequence of strings; a ValueError that
    names ``name``, the bad entry and the expected form otherwise."""
    if value is None:
        return ()
    items: list[Any]
    if isinstance(value, str):
        items = [v for v in (v.strip() for v in value.split(",")) if v]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(
            f"{name} must be a string or a list of strings of the form {_IGNORE_FORMAT}; got "
            f"{value!r}"
        )
    rules = []
    for item in items:
        if isinstance(item, IgnoreRule):
            rules.append(item)
            continue
        rule = _parse_rule(item.strip()) if isinstance(item, str) else None
        if rule is None:
            raise ValueError(f"{name}: {item!r} is not a rule of the form {_IGNORE_FORMAT}")
        rules.append(rule)
    return tuple(rules)


def _parse_rule(text: str) -> IgnoreRule | None:
    kind, at, where = text.partition("@")
    kind = kind.strip()
    if kind and kind not in FINDING_KINDS:
        return None
    if not at:
        return IgnoreRule(kind=kind) if kind else None
    file, colon, line = where.strip().rpartition(":")
    if not colon or not line.isdigit():
        file, line = where.strip(), "0"
    if not file or (colon and not line.isdigit()):
        return None
    return IgnoreRule(kind=kind, file=file.replace(os.sep, "/"), line=int(line))
