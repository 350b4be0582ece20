"""Step and level control: the mode's one optimizer-step hook, the lead optimizer whose steps end a
training step, and, at ``level="step"``, which steps run op by op and the switches between the op
level (the interceptor on the dispatch stack) and the step level (off it: generator states read at
optimizer steps and around checkpoint regions), including the switches held back while a
checkpointed forward waits for its recompute.

Every decision here reads only what is the same on every rank (the order of the optimizers'
steps, the step count, verdicts the ranks agreed on), because the level decides which collectives
a rank posts.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Collection, Iterator
from typing import Any

import torch

from ..core.config import Config
from ..core.dispatch import Intercepting
from ..core.events import EventWindow
from ..core.generators import GeneratorRegistry
from ..core.rank_check import RankCheck
from ..core.schedule import StepEnds, StepSchedule
from ..core.seeding import SeedCallLog
from ..recompute.held import HeldFindings
from ..recompute.inferred import InferredRecomputes
from ..recompute.probe import StateProbe
from ..recompute.tracker import RecomputeTracker
from .closing import MAX_NOTE_SITES

__all__ = ["Lead", "StepControl"]

_TAKEOVER = 16  # steps of another optimizer, with none of the lead's, that make it the lead
_PROBED_USERS = 8  # user generators a checkpoint region's probe reads at the step level


class Lead:
    """The lead optimizer: a training step ends at a step of it.

    The lead is the first optimizer seen to step, until another steps ``_TAKEOVER`` times without
    it in between (the lead stopped: a second training stage with a new optimizer; a GAN's critic
    stepping 5 times per generator step does not take over). A program that steps several
    optimizers per iteration (Muon beside AdamW, a GAN's two networks, a wrapper around an inner
    optimizer, one optimizer per parameter) runs one training step per iteration, not one per
    optimizer. The rule reads only the order of the steps, the same on every rank (not when an
    optimizer is garbage-collected, which may differ).
    """

    __slots__ = ("_lead", "_replicas", "_since")

    def __init__(self) -> None:
        self._lead: weakref.ReferenceType[Any] | None = None
        # Across ranks: the lead's parameters, when it trains a data-parallel wrapper's or a
        # pipeline stage's (read as it became the lead; see _takes_over), else None.
        self._replicas: Collection[Any] | None = None
        # id -> (the optimizer, weakly; its steps since the lead's last step)
        self._since: dict[int, tuple[weakref.ReferenceType[Any], int]] = {}

    def ends_step(self, optimizer: Any, ranks: RankCheck | None) -> bool:
        """A step of ``optimizer``: whether it ends a training step (it is the lead's, or it
        made ``optimizer`` the lead)."""
        lead = self._lead() if self._lead is not None else None
        if self._lead is None or (lead is not optimizer and self._takes_over(optimizer, ranks)):
            self._lead = weakref.ref(optimizer)
            self._replicas = ranks.replicas_trained(optimizer) if ranks is not None else None
        elif lead is not optimizer:
            return False
        self._since.clear()
        return True

    def _takes_over(self, optimizer: Any, ranks: RankCheck | None) -> bool:
        """Count a step of ``optimizer`` (not the lead) since the lead's last step; True when
        it has now made ``_TAKEOVER`` of them."""
        since = self._since
        known = since.get(id(optimizer))
        count = known[1] + 1 if known is not None and known[0]() is optimizer else 1
        if len(since) > 65536:  # a new optimizer per step, and a lead that stopped
            since.clear()
        since[id(optimizer)] = (weakref.ref(optimizer), count)
        if count < _TAKEOVER:
            return False
        # Across ranks, an optimizer that one rank steps alone (a linear probe rank 0 trains for
        # its logs) must not move that rank's training steps away from the others': where the
        # lead trains a data-parallel wrapper's parameters, only one that does too takes over.
        # Read from what the lead trained as it became the lead, never from whether it (or a
        # wrapper) was garbage-collected since, which may differ across the ranks.
        held = self._replicas
        return ranks is None or held is None or ranks.trains_replicas(optimizer, held)


class StepControl:
    """The optimizer-step hook and the level of each step, for one mode.

    Owns the training steps' ends (a finding's step), the lead optimizer, and at
    ``level="step"`` the schedule of sampled steps, escalations, drifts the ranks agreed on and
    postponed switches (read for the report by ``closing.py``). The checks, the interceptor, the
    probe, the held findings and where the mode runs (``pid``, ``thread``) are the mode's to set.
    """

    __slots__ = (
        "_every_steps",
        "_generators",
        "_in_pass_window",
        "_in_step_hook",
        "_lead",
        "_postponed",
        "_probe_cache",
        "_seeds",
        "_want_escalation",
        "_window",
        "between",
        "drifts",
        "ended",
        "healed",
        "held",
        "inferred",
        "interceptor",
        "late_drift",
        "pid",
        "postponements",
        "probe",
        "ranks",
        "schedule",
        "stuck_steps",
        "thread",
        "tracker",
    )

    def __init__(
        self,
        config: Config,
        window: EventWindow,
        generators: GeneratorRegistry,
        seeds: SeedCallLog,
    ) -> None:
        self._every_steps = config.every_steps
        self._window = window
        self._generators = generators
        self._seeds = seeds
        # Random ops drawn by the end of each optimizer step: a finding's step.
        self.ended = StepEnds()
        self._in_step_hook = False
        self._lead = Lead()
        # level="step": which steps run op by op, and what the step level saw (escalations
        # wished for here, drifts the ranks agreed on).
        self.schedule = (
            StepSchedule(config.sample_every, config.sample_first)
            if config.level == "step"
            else None
        )
        self._probe_cache: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._want_escalation = False
        self.drifts: list[int] = []  # steps whose generators drifted apart across ranks
        self.late_drift = 0  # a drift the last round showed, after the last step
        self.stuck_steps = 0  # steps that stayed op by op (another dispatch mode above ours)
        self._in_pass_window = False
        # A level switch held back while a checkpointed forward waits for its recompute:
        # (op level, rebased slots), applied at the next optimizer step with none waiting.
        self._postponed: tuple[bool, tuple[int, ...]] | None = None
        self.postponements = 0
        # The last switch went between samples with no drifted slot, and it held: a switch
        # that stays there has nothing to change (the common step at level="step").
        self.between = False
        self.ranks: RankCheck | None = None
        self.interceptor: Intercepting | None = None
        self.tracker: RecomputeTracker | None = None
        self.inferred: InferredRecomputes | None = None
        self.held: HeldFindings | None = None
        self.probe: StateProbe | None = None
        self.pid = os.getpid()
        self.thread = threading.get_ident()  # the thread whose dispatch stack the mode is on
        # Steps at which the selective route found its key taken out of the include set (an
        # export's pre-dispatch tracing ends that way) and put it back.
        self.healed: list[int] = []

    def start(self) -> None:
        """The mode is entered: the step level begins at step 1, op by op."""
        if self.schedule is not None:
            self.schedule.start()

    def on_step(self, optimizer: Any, *_: Any) -> None:
        """The one optimizer-step hook: the checks' step work, in one order on every rank. A
        training step ends at a step of the lead optimizer (:class:`Lead`)."""
        interceptor = self.interceptor
        if (
            interceptor is not None
            and threading.get_ident() == self.thread
            and interceptor.heal()
            and len(self.healed) < MAX_NOTE_SITES
        ):
            self.healed.append(len(self.ended) + 1)
        if not self._lead.ends_step(optimizer, self.ranks):
            if (
                self._postponed is not None
                and threading.get_ident() == self.thread
                and not self._regions_waiting()
            ):
                postponed, self._postponed = self._postponed, None
                self._switch(*postponed)
            return
        self.ended.end_step(self._window.total)
        self._in_step_hook = True  # what is found here belongs to the step that just ended
        interceptor = self.interceptor
        ran_op_by_op = interceptor is not None and not interceptor.suspended
        try:
            if self.inferred is not None:
                self.inferred.on_step()
            if self.ranks is not None:
                self.ranks.on_step(optimizer)
            # (a step after a rank ran out of inputs in torch's Join counts on no rank: the
            # ranks' schedules stay the same, and it runs at the level it began at)
            apart = self.ranks is not None and self.ranks.apart
            if self.schedule is not None and interceptor is not None and not apart:
                self._next_step(self.schedule, interceptor)
            if self.held is not None:  # last: its findings may raise
                self.held.step_ended(len(self.ended), ran_op_by_op)
        finally:
            self._in_step_hook = False

    def step_of(self, seq: int) -> int:
        """The optimizer step (1-based) that drew random op ``seq``; the current one for -1."""
        ends = self.ended
        if seq < 0:
            return len(ends) + (0 if self._in_step_hook else 1)
        return ends.step_of(seq)

    # -- level="step" ------------------------------------------------------------------------

    def _next_step(self, schedule: StepSchedule, interceptor: Intercepting) -> None:
        """Decide how the coming step is checked (the same on every rank) and switch to it."""
        want, self._want_escalation = self._want_escalation, False
        sampled = schedule.current_op_level
        # Across ranks: every ``every_steps``-th step (each step by default) and every sampled
        # one (the baseline); the same steps on every rank.
        if self.ranks is not None and (sampled or schedule.step % self._every_steps == 0):
            verdict = self.ranks.step_level(
                schedule.step, self._generators.tracked(), want, sampled
            )
            if verdict is not None and verdict.drifted and len(self.drifts) < MAX_NOTE_SITES:
                self.drifts.append(verdict.step)
            schedule.escalate = verdict is not None and verdict.escalate
        elif self.ranks is not None:  # escalating is agreed on: ask at the next exchange
            verdict = None
            self._want_escalation = want
            schedule.escalate = False
        else:
            verdict = None
            schedule.escalate = want
        held, self._postponed = self._postponed, None
        if self.ranks is None:
            # The step that ends may have run at another level than decided (a switch held back
            # or not possible on another thread): record what ran. (Across ranks the schedule
            # stays the agreed one: it decides which collectives a rank posts.)
            schedule.ran(op_level=not interceptor.suspended)
        op_level = schedule.advance()
        drifted = verdict.drifted if verdict is not None else ()
        # In one process, a switch that would split a checkpointed forward from its recompute
        # (a GAN steps its discriminator between them) waits for the next optimizer step, at
        # most to the next training step. Not across ranks: what waits is each rank's own, and
        # the level decides which collectives a rank posts; there such a recompute is unpaired.
        if (
            self.ranks is None
            and held is None
            and op_level is interceptor.suspended
            and self._regions_waiting()
        ):
            self._postponed = (op_level, drifted)
            self.postponements += 1
            return
        self._switch(op_level, drifted)

    def _regions_waiting(self) -> bool:
        tracker = self.tracker
        return tracker is not None and tracker.waiting()

    def _switch(self, op_level: bool, drifted: tuple[int, ...]) -> None:
        """Check the coming steps op by op (``op_level``) or by generator states; ``drifted``:
        the digest slots the ranks found drifted apart."""
        interceptor = self.interceptor
        if interceptor is None:
            return
        if self.between and not op_level and not drifted and interceptor.suspended:
            return  # between samples, and staying there: what the last switch set holds
        self.between = False
        if self.ranks is not None:
            self.ranks.set_checking(op_level, drifted)
        if threading.get_ident() != self.thread:
            # An optimizer stepped on another thread (one in backward, on an autograd device
            # thread): the dispatch stack is per thread, so the level stays as it is.
            if op_level is interceptor.suspended:
                self.stuck_steps += 1
            return
        if op_level:
            if interceptor.suspended:
                interceptor.resume()
                self._after_gap()
            if self.probe is not None:
                self.probe.active = False
            self._seeds.quiet = False
        elif interceptor.suspend():
            if self.probe is not None:
                self.probe.active = True
            self._seeds.quiet = True
            self.between = not drifted
        else:
            self.stuck_steps += 1  # another mode above ours: this step stays op by op

    def request_escalation(self) -> None:
        """The checkpoint probe found a mismatch: check the next step op by op."""
        self._want_escalation = True

    def _after_gap(self) -> None:
        """Back to op by op after unchecked steps: the generators moved unseen meanwhile. Their
        last known state is kept only where a user's seeding call explains the change."""
        for t in self._generators.tracked():
            calls = self._seeds.since(t.seed_mark, t.ident.device)
            if not any(not c.by_torch for c in calls):
                t.last_after = None

    def probe_generators(self, devices: tuple[str, ...]) -> tuple[Any, ...]:
        """The generators a checkpoint region can draw from: the defaults of the CPU and of the
        region's devices, and the user generators used most recently (one tuple per device set
        while the registry adds nothing)."""
        registry = self._generators
        key = (devices, registry.version)
        found = self._probe_cache.get(key)
        if found is None:
            out: list[Any] = []
            for device in ("cpu", *devices):
                t = registry.default(torch.device(device))
                if t is not None and t not in out:
                    out.append(t)
            found = tuple(out + registry.recent_users(_PROBED_USERS))
            if len(self._probe_cache) > 64:
                self._probe_cache.clear()
            self._probe_cache[(devices, registry.version)] = found  # default() may have added
        return found

    @contextlib.contextmanager
    def pass_window(self) -> Iterator[None]:
        """level="step", between samples: a DataLoader iterator asks its sampler for a pass's
        first indices (passes.py). Op by op on this thread meanwhile, so the rank checker sees
        the order the sampler draws; user generators first met here are forgotten after (a
        sampler may make one per pass, as torch's DistributedSampler does: not read at every
        step from then on)."""
        ranks, interceptor = self.ranks, self.interceptor
        if (
            self._in_pass_window
            or ranks is None
            or interceptor is None
            or not ranks.wants_passes
            or threading.get_ident() != self.thread
            or os.getpid() != self.pid
        ):
            yield
            return
        resumed = interceptor.suspended  # (else another mode above ours kept it on the stack)
        if resumed:
            interceptor.resume()
        self._in_pass_window = True
        known = self._generators.user_count
        try:
            if resumed:
                self._after_gap()
            ranks.pass_window(True)
            yield
        finally:
            ranks.pass_window(False)
            self._generators.forget_after(known)
            self._in_pass_window = False
            if resumed:
                interceptor.suspend()
