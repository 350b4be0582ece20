"""``level="step"`` across ranks, for the rank checker: every step's generator digests
(``step_digest.py``), less the generators whose states differ by design (``generators.py``), and
the orders drawn as passes over the data begin between samples (``passes.py``): a sampler that
splits one order among the ranks draws it once a pass, at a step the schedule rarely samples, so
its draws join a digest of the pass, which the step rounds compare."""

from __future__ import annotations

from typing import Any

from ..core.events import RandomOpEvent
from ..core.findings import Finding
from ..core.policy import current_expectation
from .findings import pass_order_finding
from .generators import GeneratorStates
from .protocol import text_hash
from .scopes import Judge
from .step_digest import NO_PASS, StepDigests, StepVerdict, generator_name, seed_value, slot_values
from .verdict import Compare, Domain, Reason, Verdict

__all__ = ["StepLevel"]

_PASSES_KEPT = 64  # passes over the data whose first order draw is kept, for a finding


class StepLevel:
    """The step level's share of one rank checker."""

    def __init__(
        self,
        side: Any,
        own_group: bool,
        judge: Judge,
        states: GeneratorStates,
        rank: int,
        domain: tuple[int, ...],
    ) -> None:
        self.digests = StepDigests(side, own_group=own_group)
        self._judge = judge
        self._states = states
        self._rank = rank
        self._domain = domain
        self.in_pass = False  # the mode's window over a pass's first batch is open
        self._pass_begun = False  # ... and an order was drawn in it
        self._pass = NO_PASS  # passes so far, the latest one's digest, its first draw's seed
        # pass -> its first draw, the order's verdict, the step it was drawn at (on this rank)
        self._pass_draws: dict[int, tuple[RandomOpEvent | None, Verdict, int]] = {}

    def pass_window(self, open_: bool) -> None:
        """The mode's window over the first batch of a pass over the data opens (its random ops
        now reach :meth:`pass_draw`) or closes."""
        self.in_pass = open_
        self._pass_begun = False

    def pass_draw(self, event: RandomOpEvent, step: int) -> None:
        """A random op of a pass's first batch, between samples: an order every rank walks (a
        sampler splitting it, a pipeline's shuffle) joins the digest of this pass, which the
        step round compares (every rank must draw it alike, whatever the generator); anything
        else is not looked at."""
        program = self._judge.program
        if (
            event.expect == "ignore"
            or not (program.wrappers or program.stages)
            or current_expectation() is not None
        ):
            return
        order = self._judge.pass_order()
        if order is None:
            return
        passes, digest, seed = self._pass
        if not self._pass_begun:
            self._pass_begun = True
            passes, digest, seed = passes + 1, 0, seed_value(event.seed)
            self._pass_draws[passes] = (event, order, step)
            if len(self._pass_draws) > _PASSES_KEPT:
                del self._pass_draws[min(self._pass_draws)]
        name = generator_name(event.generator)  # (a user generator's number may differ)
        digest = text_hash(str(digest), str(name), event.op, str(event.before))
        self._pass = (passes, digest, seed)

    def exchange(
        self, step: int, generators: Any, escalate: bool, sampled: bool, post: bool
    ) -> tuple[StepVerdict | None, list[Finding]]:
        """Post this step's digests (or, without ``post``, the last ones) and return the verdict
        of the previous round with the findings of the orders it found drawn apart. Raises
        PeerLost when a rank does not arrive in time."""
        digests = self.digests
        if post:  # (the digests' own tensor work is hidden from the mode)
            slots = slot_values(self._states.agreeing(generators))
            verdict = digests.exchange(step, slots, escalate, sampled, self._pass)
        else:
            verdict = digests.finish()
        if verdict is None:
            return None, []
        return verdict, [self._order_finding(split) for split in verdict.orders]

    def _order_finding(self, split: Any) -> Finding:
        event, order, step = self._pass_draws.get(split.number, (None, _UNKNOWN, split.step))
        return pass_order_finding(event, order, step, split.seeds, self._rank, self._domain)


# (a pass whose first draw is no longer kept)
_UNKNOWN = Verdict(Domain.GROUP, Compare.STATE, Reason.ORDER, "the sampler", firm=True)
