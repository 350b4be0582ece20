"""The cross-rank check of ``level="step"``: the digests of the generators rngcheck knows, taken
at every training step and exchanged in one small all-reduce per ``STEPS_PER_ROUND`` steps,
whatever the world size (O(1): a MAX over ``[d, -d]`` gives the largest and the smallest value of
each slot). One round for several steps: a collective's launch (and the work of gloo's threads,
which compete with the ranks for the cores) cost a 2-rank step of a small model about 8% of its
time on 2 cores when posted every step, 5% to 10% of wall time every 8 steps, 0% to 3% every 32.

Which generators must agree is learned, not assumed: at each step checked op by op the slots that
agree become the baseline; between samples a baseline slot that stops agreeing means a generator
drifted apart since the last sample. That is not a finding on its own (data-parallel programs may
draw per-rank amounts on purpose, which the op level knows how to judge): it escalates, and the
next step is checked op by op, where the op level names what diverged. A rank's own request to
escalate (a recompute mismatch found there) rides in the same vector, so every rank escalates at
the same step (protocol rule P5).

The round posted at a step is settled at the next one (pipelined, so no rank waits for the others
at a step), bounded by the timeout like every exchange. A drift is therefore seen at most
``STEPS_PER_ROUND`` steps after it began, and the step after that runs op by op.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from .protocol import text_hash

__all__ = ["SLOTS", "StepDigests", "StepVerdict", "slot_of", "slot_values"]

# Generators share slots by the hash of their name; a slot agrees when all of it does. Those
# whose states differ by design (per-rank streams, generators moved apart on purpose) are left
# out once the op level knows them (RankChecker._agreeing); one it does not know hides the drift
# of any other generator in its slot: 32 slots make that 1 chance in 32 per such generator.
SLOTS = 32
_BITS = torch.tensor([1 << i for i in range(SLOTS)], dtype=torch.int64)  # slot -> its bit
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
    """Per slot, the XOR of the (name-salted) digests of the generators in it. A CPU state's
    bytes are summarised by CRC-32 and Adler-32 (64 bits, a fifth of blake2b's time on its
    5,056 bytes, every step): these digests are only compared across the ranks of one run."""
    slots = [0] * SLOTS
    for t in generators:
        state = t.snapshot()
        if state is None:
            continue
        digest = zlib.crc32(state) | zlib.adler32(state) << 32 if type(state) is bytes else state
        salt = _salt(t.ident)
        slots[salt % SLOTS] ^= (digest ^ salt) & _MASK
    return slots


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """What one settled round says: whether every rank escalates, and the slots that drifted
    (``step``: the first step whose digests drifted, else the round's last step)."""

    step: int
    escalate: bool
    drifted: tuple[int, ...] = ()


STEPS_PER_ROUND = 32  # the digests of this many steps travel in one all-reduce
_ROW = 2 * SLOTS + 1  # a step's part of a round: [d, -d] per slot, then its escalation wish


@dataclass(slots=True)
class _Step:
    step: int
    sampled: bool  # checked op by op: its agreement is the new baseline
    slots: list[int]
    escalate: bool


@dataclass(slots=True)
class _Posted:
    steps: list[_Step]
    vec: torch.Tensor
    work: Any


class StepDigests:
    """Every step's digests, posted on the checker's side group in rounds of ``per_round`` steps
    (one all-reduce of ``per_round`` x 65 int64, whatever the world size); a round posted at a
    step is settled at the next one, so no rank waits for the others at a step."""

    def __init__(self, side: Any, per_round: int = STEPS_PER_ROUND) -> None:
        self._side = side
        self._per_round = per_round
        self._batch: list[_Step] = []
        self._inflight: _Posted | None = None
        self._baseline = 0  # bit i: slot i agreed at the last step checked op by op
        self.rounds = 0
        self.drifts = 0

    def exchange(
        self, step: int, slots: list[int], escalate: bool, sampled: bool
    ) -> StepVerdict | None:
        """Settle the round in flight (its verdict, or None), then add this step's digests and
        post them once the round is full. Raises PeerLost (from the side group) when a rank does
        not arrive in time."""
        verdict = self.settle()
        self._batch.append(_Step(step, sampled, slots, escalate))
        if len(self._batch) >= self._per_round:
            self._post()
        return verdict

    def finish(self) -> StepVerdict | None:
        """The mode ends: settle the round in flight, then post and settle the steps not yet
        sent (every rank has the same ones)."""
        verdict = self.settle()
        if self._batch:
            self._post()
            last = self.settle()
            if verdict is None or not verdict.drifted:
                verdict = last
        return verdict

    def _post(self) -> None:
        steps, self._batch = self._batch, []
        with torch._C._DisableTorchDispatch(), torch.no_grad():  # (not the mode's to see)
            digests = torch.tensor([s.slots for s in steps], dtype=torch.int64)
            wishes = torch.tensor([[int(s.escalate)] for s in steps], dtype=torch.int64)
            vec = torch.cat([digests, -digests, wishes], dim=1).flatten()
            work = self._side.all_reduce_max(vec, fast=True, async_op=True)
        self._inflight = _Posted(steps, vec, work)
        self.rounds += 1

    def settle(self) -> StepVerdict | None:
        posted, self._inflight = self._inflight, None
        if posted is None:
            return None
        self._side.wait(posted.work)
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            rows = posted.vec.view(len(posted.steps), _ROW)
            # A slot agrees when its largest value is minus its smallest: each step's agreeing
            # slots as the bits of one int, and its escalation wish.
            same = rows[:, :SLOTS] == -rows[:, SLOTS : 2 * SLOTS]
            agreed = (same.to(torch.int64) * _BITS).sum(dim=1).tolist()
            wishes = rows[:, -1].tolist()
        escalate = any(wishes)
        drifted: tuple[int, ...] = ()
        drift_step = 0
        for s, agree in zip(posted.steps, agreed, strict=True):
            if s.sampled:
                self._baseline = agree
                continue
            lost = self._baseline & ~agree
            if lost:
                self._baseline &= agree  # escalate once per drift, not at every later step
                if not drift_step:
                    drift_step = s.step
                    self.drifts += 1
                drifted = tuple(sorted({*drifted, *(i for i in range(SLOTS) if lost >> i & 1)}))
                escalate = True
        return StepVerdict(drift_step or posted.steps[-1].step, escalate, drifted)

    def drop(self) -> None:
        """Forget the round in flight (the checker stops; the others learn it from the store)."""
        self._inflight = None
        self._batch = []
