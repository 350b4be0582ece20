"""level="step": a recompute mismatch found between sampled steps is one finding with the op
by op finding that names it.

Between samples the checkpoint probe knows the region and the generator, not the op or its line:
it asks for the next step to run op by op. Emitted at once, its finding would stop a run under
``on_finding="raise"`` (RNGCHECK=1's default) before that step, so the op and line would never
be named; and under "warn" or "record" the one bug would be two findings. So the probe's finding
is held until a step checked op by op has run after it:

- a recompute mismatch found op by op on one of its generators *names* it: the held occurrences
  are counted on that finding (its first step, and a line on how it was found), and later
  occurrences between samples with the same key are counted on it too;
- if that step found none (a bug of some steps only), or the run ends first, the probe's finding
  is emitted as it is, saying why no op and line are given.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, replace
from typing import Any

from ..core.findings import Finding

__all__ = ["HeldFindings", "NEXT_STEP"]

NEXT_STEP = (
    " The step after this one is checked op by op: its finding names the random op, its line "
    "and the likely cause."
)
_NOT_REPEATED = (
    " Step {step}, checked op by op after it, had no recompute that drew differently from {gen}, "
    "so the op and its line are not known: look for what changes from step to step in this "
    "region (a flag, a schedule, data-dependent control flow)."
)
_RUN_ENDED = (
    " The run ended before a step could be checked op by op, so the op and its line are not known."
)
_DIGESTS = re.compile(r" \([0-9a-f-]{1,16} vs [0-9a-f-]{1,16}\)")  # (shown on the op's sides)
_MAX_HELD = 64  # distinct findings held at once (each a bug; more are emitted as they come)
_MAX_NAMED = 4096


@dataclass(slots=True)
class _Held:
    finding: Finding  # the first occurrence, as the probe worded it
    generator: str  # the label of the generator whose states disagreed
    step: int  # the step it was found at (the step being checked when found)
    last: int  # and the step of its latest occurrence
    count: int = 1


class HeldFindings:
    """The step level's recompute findings, held until a step checked op by op names them.

    ``emit(finding, earlier=(count, first_step), raising=True)``: the mode's finding sink;
    ``step()``: the optimizer step now being run (1-based). Recomputes may run on an autograd
    device thread: the bookkeeping is locked, the emitting (which may raise) is not."""

    def __init__(self, emit: Any, step: Any) -> None:
        self._emit = emit
        self._step = step
        self._held: dict[tuple[Any, ...], _Held] = {}
        # the probe's key -> the op-by-op finding that named it (as first emitted)
        self._named: dict[tuple[Any, ...], Finding] = {}
        self._lock = threading.Lock()

    def between_samples(self, finding: Finding, generator: str) -> None:
        """The probe found ``finding`` (a recompute mismatch on ``generator``)."""
        key = finding.key
        step = self._step()
        with self._lock:
            named = self._named.get(key)
            held = self._held.get(key) if named is None else None
            if held is not None:
                held.count += 1
                held.last = step
                return
            if named is None and len(self._held) < _MAX_HELD:
                self._held[key] = _Held(finding, generator, step, step)
                return
        if named is not None:  # known by its op and line: one more occurrence of that finding
            self._emit(replace(named, count=1, first_step=0, last_step=0, seq=-1, found_by=""))
        else:
            self._emit(finding)

    def op_by_op(self, finding: Finding) -> None:
        """A recompute mismatch found op by op: it names the held findings of its generator."""
        named: list[_Held] = []
        if self._held:
            labels = {s.event.generator.label for s in finding.sides if s.event is not None}
            with self._lock:
                for key in [k for k, h in self._held.items() if h.generator in labels]:
                    named.append(self._held.pop(key))
                    if len(self._named) >= _MAX_NAMED:
                        self._named.clear()
                    self._named[key] = finding
        if not named:
            self._emit(finding)
            return
        first = min(named, key=lambda h: h.step)
        what = _DIGESTS.sub("", first.finding.message.removesuffix(" (checked at the step level)"))
        found_by = (
            f"between sampled steps at step {first.step}, by generator states ({what}); named op "
            f"by op at step {self._step()}"
        )
        count = sum(h.count for h in named)
        self._emit(replace(finding, found_by=found_by), earlier=(count, first.step))

    def step_ended(self, ended: int, op_by_op: bool) -> None:
        """Optimizer step ``ended`` ran op by op (``op_by_op``): what was held since an earlier
        step and not named there is emitted as the probe found it."""
        if not op_by_op or not self._held:
            return
        with self._lock:
            due = [self._held.pop(k) for k, h in list(self._held.items()) if h.step < ended]
        self._release_all(due, _NOT_REPEATED.replace("{step}", str(ended)), True)

    def close(self, raising: bool) -> None:
        """The mode ends: what is still held is emitted (``raising``: False after an exception
        ended the block, which stays the one to see)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        self._release_all(held, _RUN_ENDED, raising)

    def _release_all(self, held: list[_Held], why: str, raising: bool) -> None:
        for i, h in enumerate(held):
            try:
                self._release(h, why, raising)
            except BaseException:  # raised for the first: the others are recorded all the same
                for rest in held[i + 1 :]:
                    self._release(rest, why, False)
                raise

    def _release(self, held: _Held, why: str, raising: bool) -> None:
        finding = held.finding
        cause = finding.cause.removesuffix(NEXT_STEP) + why.replace("{gen}", held.generator)
        self._emit(
            replace(finding, cause=cause, first_step=held.last),  # (the step of its latest)
            earlier=(held.count - 1, held.step),
            raising=raising,
        )
