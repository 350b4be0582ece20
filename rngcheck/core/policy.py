"""Expectations: which ranks must agree on a generator's state ("same"), which must not ("differ"),
and which ops to leave alone ("ignore"), scoped to a region of code with :func:`expect`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["EXPECTATIONS", "Expectation", "current_expectation", "expect", "validate_choice"]

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
