"""The cross-rank check of ``level="step"``: at every optimizer step, one small all-reduce of the
digests of the generators rngcheck knows, whatever the world size (O(1): a MAX over ``[d, -d]``
gives the largest and the smallest value of each slot).

Which generators must agree is learned, not assumed: at each step checked op by op the slots that
agree become the baseline; between samples a baseline slot that stops agreeing means a generator
drifted apart since the last sample. That is not a finding on its own (data-parallel programs may
draw per-rank amounts on purpose, which the op level knows how to judge): it escalates, and the
next step is checked op by op, where the op level names what diverged. A rank's own request to
escalate (a recompute mismatch found there) rides in the same vector, so every rank escalates at
the same step (protocol rule P5).

The round posted at a step is settled at the next one (pipelined, so no rank waits for the others
at a step), bounded by the timeout like every exchange.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from .protocol import text_hash

__all__ = ["SLOTS", "StepDigests", "StepVerdict", "slot_of", "slot_values"]

SLOTS = 8  # generators share slots by the hash of their name; a slot agrees when all of it does
_MASK = (1 << 62) - 1  # digests as non-negative int64 that negate safely


@lru_cache(maxsize=1024)
def _salt(ident: Any) -> int:
    """A generator's name as every rank gives it, hashed: a default by its device type
    (``cuda``, not this rank's ``cuda:3``), a user generator by device type and the line that
    first used it."""
    device = ident.device.split(":")[0]
    return text_hash(f"default {device}" if ident.is_default else f"{device} {ident.origin}")


def slot_of(ident: Any) -> int:
    """The slot of the generator named ``ident`` (a GeneratorId)."""
    return _salt(ident) % SLOTS


def slot_values(generators: Iterable[Any]) -> list[int]:
    """Per slot, the XOR of the (name-salted) digests of the generators in it."""
    slots = [0] * SLOTS
    for t in generators:
        digest = t.read()
        if digest is None:
            continue
        salt = _salt(t.ident)
        slots[salt % SLOTS] ^= (digest ^ salt) & _MASK
    return slots


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """What one settled round says: whether every rank escalates, and the slots that drifted."""

    step: int
    escalate: bool
    drifted: tuple[int, ...] = ()


@dataclass(slots=True)
class _Posted:
    step: int
    sampled: bool  # posted at a step checked op by op: its agreement is the new baseline
    vec: torch.Tensor
    work: Any


class StepDigests:
    """Posts one round per optimizer step on the checker's side group and settles the previous."""

    def __init__(self, side: Any) -> None:
        self._side = side
        self._inflight: _Posted | None = None
        self._baseline = 0  # bit i: slot i agreed at the last step checked op by op
        self.rounds = 0
        self.drifts = 0

    def exchange(
        self, step: int, slots: list[int], escalate: bool, sampled: bool
    ) -> StepVerdict | None:
        """Settle the round of the previous step (its verdict, or None), then post this step's.
        Raises PeerLost (from the side group) when a rank does not arrive in time."""
        verdict = self.settle()
        vec = torch.tensor([*slots, *(-v for v in slots), 1 if escalate else 0], dtype=torch.int64)
        work = self._side.all_reduce_max(vec, fast=True, async_op=True)
        self._inflight = _Posted(step, sampled, vec, work)
        self.rounds += 1
        return verdict

    def settle(self) -> StepVerdict | None:
        posted, self._inflight = self._inflight, None
        if posted is None:
            return None
        self._side.wait(posted.work)
        values = posted.vec.tolist()
        agree = 0
        for i in range(SLOTS):
            if values[i] == -values[SLOTS + i]:
                agree |= 1 << i
        escalate = bool(values[-1])
        drifted: tuple[int, ...] = ()
        if posted.sampled:
            self._baseline = agree
        else:
            lost = self._baseline & ~agree
            if lost:
                drifted = tuple(i for i in range(SLOTS) if lost >> i & 1)
                self._baseline &= agree  # escalate once per drift, not at every later step
                self.drifts += 1
                escalate = True
        return StepVerdict(posted.step, escalate, drifted)

    def drop(self) -> None:
        """Forget the round in flight (the checker stops; the others learn it from the store)."""
        self._inflight = None
