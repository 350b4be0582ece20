"""Which optimizer steps are checked op by op at ``level="step"``: the first ``sample_first``,
then one in ``sample_every``, and the step after any sign of trouble (escalation), so a bug that
recurs is named to its op and line. The same decisions on every rank: they depend on the step
count and on escalations the ranks agreed on (the rank checker all-reduces the request)."""

from __future__ import annotations

import array
import bisect
from dataclasses import dataclass, field

__all__ = ["StepEnds", "StepSchedule"]

_MAX_RANGES = 64  # op-level step ranges kept for the report (the first and the latest)


@dataclass(slots=True)
class StepSchedule:
    """The level of each training step. Step numbers count from 1; step ``n`` runs between the
    ``n-1``-th and the ``n``-th step of the lead optimizer (``session/steps.py``)."""

    sample_every: int
    sample_first: int
    step: int = 1  # the step running now
    current_op_level: bool = True  # whether it is checked op by op
    escalate: bool = False  # asked for: the next step is checked op by op
    escalations: int = 0
    op_steps: int = 0  # steps checked op by op so far (the current one included)
    _ranges: list[list[int]] = field(default_factory=list)  # op-level steps, as [first, last]
    _dropped: int = 0
    _owed: bool = False  # a step meant to run op by op ran without it: the next one does

    def op_level(self, step: int) -> bool:
        return step <= self.sample_first or step % self.sample_every == 0

    def start(self) -> None:
        """The mode begins at step 1, op by op (it learns the program)."""
        self.current_op_level = True
        self._note(self.step)

    def ran(self, op_level: bool) -> None:
        """The step now ending ran at another level than decided (its switch was held back):
        record what ran. A step meant to run op by op that did not is owed: the next one does."""
        if op_level == self.current_op_level:
            return
        self.current_op_level = op_level
        if op_level:
            self._note(self.step)
            return
        self.op_steps -= 1
        last = self._ranges[-1]
        if last[0] == last[1]:
            self._ranges.pop()
        else:
            last[1] -= 1
        self._owed = True

    def advance(self) -> bool:
        """An optimizer step ended: move to the next step; True when it is checked op by op."""
        self.step += 1
        op = self.op_level(self.step) or self.escalate or self._owed
        self._owed = False
        if self.escalate:
            self.escalations += 1
            self.escalate = False
        if op:
            self._note(self.step)
        self.current_op_level = op
        return op

    def _note(self, step: int) -> None:
        self.op_steps += 1
        if self._ranges and self._ranges[-1][1] == step - 1:
            self._ranges[-1][1] = step
            return
        if len(self._ranges) >= _MAX_RANGES:  # keep the first ranges and the latest one
            self._ranges.pop(_MAX_RANGES // 2)
            self._dropped += 1
        self._ranges.append([step, step])

    def summary(self) -> dict[str, object]:
        """For the report: how each completed training step was checked."""
        done = self.step - 1
        ranges = [(a, min(b, done)) for a, b in self._ranges if a <= done]
        op_done = self.op_steps - (1 if self.current_op_level else 0)
        return {
            "level": "step",
            "steps": done,  # training steps completed
            "op_level": [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges],
            "op_level_ranges_not_listed": self._dropped,
            "op_level_steps": op_done,
            "step_level_steps": done - op_done,
            "escalations": self.escalations,
            "sample_first": self.sample_first,
            "sample_every": self.sample_every,
        }


_MAX_RUNS = 1 << 16  # step-end runs kept; the oldest half goes past it (far outside any window)


class StepEnds:
    """How many random ops were recorded by the end of each optimizer step, to tell the step of
    a random op (its sequence number). Kept as runs of steps that end at the same total: steps
    that record no random op (``level="step"`` between samples) cost nothing, so memory stays
    flat on a long run; past ``_MAX_RUNS`` runs the oldest half is dropped (random ops that old
    are long out of the event window)."""

    __slots__ = ("_totals", "_firsts", "_steps")

    def __init__(self) -> None:
        self._totals = array.array("q")  # the distinct totals, increasing
        self._firsts = array.array("q")  # the 0-based step whose end first had that total
        self._steps = 0

    def __len__(self) -> int:
        return self._steps

    def end_step(self, total: int) -> None:
        """An optimizer step ended with ``total`` random ops recorded so far."""
        totals = self._totals
        if not totals or totals[-1] != total:
            if len(totals) >= _MAX_RUNS:
                half = _MAX_RUNS // 2
                del totals[:half]
                del self._firsts[:half]
            totals.append(total)
            self._firsts.append(self._steps)
        self._steps += 1

    def step_of(self, seq: int) -> int:
        """The 1-based step that drew random op ``seq`` (the first step whose end passed it)."""
        j = bisect.bisect_right(self._totals, seq)
        return (self._firsts[j] if j < len(self._totals) else self._steps) + 1
