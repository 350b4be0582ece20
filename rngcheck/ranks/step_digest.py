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

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import torch

from ..core.dispatch import unseen
from .protocol import text_hash

__all__ = [
    "NO_PASS",
    "SLOTS",
    "STEPS_PER_ROUND",
    "OrderSplit",
    "StepDigests",
    "StepVerdict",
    "generator_name",
    "seed_value",
    "seeds_said",
    "slot_of",
    "slot_values",
]

# Generators share slots by the hash of their name; a slot agrees when all of it does. Those
# whose states differ by design (per-rank streams, generators moved apart on purpose) are left
# out once the op level knows them (RankChecker._agreeing); one it does not know hides the drift
# of any other generator in its slot: 32 slots make that 1 chance in 32 per such generator.
SLOTS = 32
_BITS = torch.tensor([1 << i for i in range(SLOTS)], dtype=torch.int64)  # slot -> its bit
_MASK = (1 << 62) - 1  # digests as non-negative int64 that negate safely


@lru_cache(maxsize=1024)
def generator_name(ident: Any) -> int:
    """A generator's name as every rank gives it, hashed: a default by its device type
    (``cuda``, not this rank's ``cuda:3``), a user generator by device type and the line that
    first used it."""
    device = ident.device.split(":")[0]
    return text_hash(f"default {device}" if ident.is_default else f"{device} {ident.origin}")


def slot_of(ident: Any) -> int:
    """The slot of the generator named ``ident`` (a GeneratorId)."""
    return generator_name(ident) % SLOTS


def slot_values(generators: Iterable[Any]) -> list[int]:
    """Per slot, the XOR of the (name-salted) digests of the generators in it (each one's
    state digest)."""
    slots = [0] * SLOTS
    for t in generators:
        digest = t.read()
        if digest is None:
            continue
        salt = generator_name(t.ident)
        slots[salt % SLOTS] ^= (digest ^ salt) & _MASK
    return slots


@dataclass(frozen=True, slots=True)
class OrderSplit:
    """The ranks drew the order of a pass over the data (a sampler splits it among them) apart:
    ``number``, the pass, by this rank's count (passes.py); ``step``, the
    step whose row compared it (once every rank had begun it); ``seeds``, the smallest and the
    largest initial seed across the ranks of the generator of its first draw, as
    :func:`seed_value` gives them."""

    step: int
    number: int
    seeds: tuple[int, int]


_SEED_SHOWN = 1 << 32  # a seed below this is sent as it is, any other as a hash of it


def seed_value(seed: int | None) -> int:
    """A generator's initial seed in a step row: itself when small (said in a finding), else a
    62-bit hash of it (compared only)."""
    if seed is None:
        return 0
    return seed if 0 <= seed < _SEED_SHOWN else text_hash(str(seed)) | _SEED_SHOWN


def seeds_said(low: int, high: int) -> str:
    """The seeds of an :class:`OrderSplit` in words, when they differ ("" when they agree)."""
    if low == high:
        return ""
    if high < _SEED_SHOWN:
        return f"initial seeds from {low} to {high}"
    return "initial seeds that differ"


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """What one settled round says: whether every rank escalates, and the slots that drifted
    (``step``: the first step whose digests drifted, else the round's last step), and the
    passes over the data whose orders the ranks drew apart (``passes.py``)."""

    step: int
    escalate: bool
    drifted: tuple[int, ...] = ()
    orders: tuple[OrderSplit, ...] = ()


STEPS_PER_ROUND = 32  # the digests of this many steps travel in one all-reduce
# Then, for the orders drawn at the start of each pass over the data (passes.py): the passes so
# far, a digest of the latest one's draws and the initial seed of its first draw's generator.
_COLUMNS = SLOTS + 3
_ROW = 2 * _COLUMNS + 1  # a step's part of a round: [v, -v] per column, then its escalation wish
NO_PASS = (0, 0, 0)
# After the rows, every round ends with [c, -c, n, -n]: c, 1 in a closing round (the mode ends)
# and 0 in any other; n, the rows this rank has sent in all, this round's included. Every round
# has the same size (a closing one pads its rows with zeros), so ranks that counted different
# steps never pair collectives of different sizes (gloo aborts the job on that), and they learn
# it from n.
_TRAILER = 4
_CLOSING_TRIES = 4  # closing rounds a rank posts while another still posts rows, at most


@dataclass(slots=True)
class _Step:
    step: int
    sampled: bool  # checked op by op: its agreement is the new baseline
    slots: list[int]
    escalate: bool
    passes: tuple[int, int, int]  # passes since ``base``, the latest one's digest, its seed
    base: int  # this rank's passes before those counted here


@dataclass(slots=True)
class _Posted:
    steps: list[_Step]
    vec: torch.Tensor
    work: Any


class StepDigests:
    """Every step's digests, posted on the checker's side group in rounds of ``per_round`` steps
    (one all-reduce of ``per_round`` x 71 int64, whatever the world size); a round posted at a
    step is settled at the next one, so no rank waits for the others at a step."""

    def __init__(self, side: Any, per_round: int = STEPS_PER_ROUND, own_group: bool = False):
        self._side = side
        self._own_group = own_group  # ``side`` is this object's alone: close() closes it
        self._per_round = per_round
        self._batch: list[_Step] = []
        self._inflight: _Posted | None = None
        self._sent = 0  # rows posted so far (this rank's steps exchanged)
        self._baseline = 0  # bit i: slot i agreed at the last step checked op by op
        # Passes over the data: each rank counts them from ``_pass_base`` (its own count at the
        # last row of the latest round whose second half found the ranks at different counts:
        # counted again from there, alike), and the latest one compared.
        self._pass_base = 0
        self._judged = 0
        self.passes_compared = 0
        self.passes_apart = 0  # rounds whose second half found the ranks at different counts
        self.rounds = 0
        self.drifts = 0
        # The steps exchanged in all, fewest and most across the ranks, once they differed
        # (then no later round is compared: their rows no longer pair step for step)
        self.steps_apart: tuple[int, int] | None = None

    def exchange(
        self,
        step: int,
        slots: list[int],
        escalate: bool,
        sampled: bool,
        passes: tuple[int, int, int] = NO_PASS,
    ) -> StepVerdict | None:
        """Settle the round in flight (its verdict, or None), then add this step's digests and
        post them once the round is full. Raises PeerLost (from the side group) when a rank does
        not arrive in time."""
        verdict = self.settle()
        count, digest, seed = passes
        relative = (count - self._pass_base, digest, seed)
        self._batch.append(_Step(step, sampled, slots, escalate, relative, self._pass_base))
        if len(self._batch) >= self._per_round:
            self._post()
        return verdict

    def finish(self) -> StepVerdict | None:
        """The mode ends: settle the round in flight, then post the steps not yet sent in a
        closing round, until every rank's round is a closing one (a rank that counted more
        steps may still post a full round against it). Their rows are compared only when every
        rank exchanged as many; ``steps_apart`` keeps the counts when they differ."""
        first = self.settle()
        steps, self._batch = self._batch, []
        total = self._sent + len(steps)
        for _ in range(_CLOSING_TRIES):
            vec = self._vector(steps, closing=True, total=total)
            with unseen():  # (not the mode's to see)
                self._side.all_reduce_max(vec, fast=True)
            if self._closing_all(vec):
                break
            self._counts_apart(vec)  # (met a round another rank still posted: apart)
        else:
            # Another rank still posts rounds: it waits for this rank's closing round no longer
            # than the timeout, and reports it.
            return first
        if not self._counts_apart(vec) and steps:
            self.rounds += 1  # (the closing round compared the last steps)
            last = self._judge(_Posted(steps, vec, None))
            if first is None:
                return last
            kept = first if first.drifted else last
            return replace(kept, orders=first.orders + last.orders)
        return first

    def _vector(self, steps: list[_Step], *, closing: bool, total: int) -> torch.Tensor:
        with unseen(), torch.no_grad():  # (not the mode's to see)
            vec = torch.zeros(self._per_round * _ROW + _TRAILER, dtype=torch.int64)
            if steps:
                digests = torch.tensor([[*s.slots, *s.passes] for s in steps], dtype=torch.int64)
                wishes = torch.tensor([[int(s.escalate)] for s in steps], dtype=torch.int64)
                rows = torch.cat([digests, -digests, wishes], dim=1).flatten()
                vec[: rows.numel()] = rows
            c = int(closing)
            vec[-_TRAILER:] = torch.tensor([c, -c, total, -total], dtype=torch.int64)
        return vec

    @staticmethod
    def _closing_all(vec: torch.Tensor) -> bool:
        return -int(vec[-_TRAILER + 1]) == 1  # the smallest c: 1 when every round closed

    def _counts_apart(self, vec: torch.Tensor) -> bool:
        """Whether the ranks have exchanged different numbers of steps, by a settled round (or
        met another's closing round with one of theirs); kept in ``steps_apart``."""
        high, low = int(vec[-2]), -int(vec[-1])
        mixed = int(vec[-_TRAILER]) == 1 and not self._closing_all(vec)
        if high == low and not mixed:
            return self.steps_apart is not None
        if self.steps_apart is None:
            self.steps_apart = (low, high)
        return True

    def _post(self) -> None:
        steps, self._batch = self._batch, []
        self._sent += len(steps)
        vec = self._vector(steps, closing=False, total=self._sent)
        with unseen():
            work = self._side.all_reduce_max(vec, fast=True, async_op=True)
        self._inflight = _Posted(steps, vec, work)
        self.rounds += 1

    def settle(self) -> StepVerdict | None:
        posted, self._inflight = self._inflight, None
        if posted is None:
            return None
        self._side.wait(posted.work)
        if self._counts_apart(posted.vec):
            return None  # the ranks' rows no longer pair step for step: not compared
        return self._judge(posted)

    def _judge(self, posted: _Posted) -> StepVerdict:
        with unseen(), torch.no_grad():
            rows = posted.vec[: len(posted.steps) * _ROW].view(len(posted.steps), _ROW)
            # A column agrees when its largest value is minus its smallest: each step's agreeing
            # slots as the bits of one int, its passes' largest and smallest values, and its
            # escalation wish.
            same = rows[:, :SLOTS] == -rows[:, _COLUMNS : _COLUMNS + SLOTS]
            agreed = (same.to(torch.int64) * _BITS).sum(dim=1).tolist()
            largest = rows[:, SLOTS:_COLUMNS].tolist()
            smallest = (-rows[:, _COLUMNS + SLOTS : 2 * _COLUMNS]).tolist()
            wishes = rows[:, -1].tolist()
        escalate = any(wishes)
        drifted: tuple[int, ...] = ()
        drift_step = 0
        orders: list[OrderSplit] = []
        for k, (s, agree) in enumerate(zip(posted.steps, agreed, strict=True)):
            (passes, digest, seed), low = largest[k], smallest[k]
            # A pass is compared once every rank has begun it (its latest pass then, on each):
            # ranks may begin a pass a step apart.
            if passes > self._judged and passes == low[0]:
                self._judged = passes
                self.passes_compared += 1
                if digest != low[1]:  # (the pass by this rank's own count)
                    orders.append(OrderSplit(s.step, s.base + passes, (low[2], seed)))
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
        last = posted.steps[-1]
        half = len(largest) // 2
        if all(
            high[0] != low[0] for high, low in zip(largest[half:], smallest[half:], strict=True)
        ):
            # The ranks' pass counts differed all through the round's second half: they began
            # different numbers of passes (a loader iterated on some ranks only), not the same
            # pass a step apart. From here each counts again from its count at the last row.
            self._pass_base = last.base + last.passes[0]
            self._judged = 0
            self.passes_apart += 1
        return StepVerdict(drift_step or last.step, escalate, drifted, tuple(orders))

    def close(self) -> None:
        if self._own_group:
            self._side.close()

    def drop(self) -> None:
        """Forget the round in flight (the checker stops; the others learn it from the store)."""
        self._inflight = None
        self._batch = []
