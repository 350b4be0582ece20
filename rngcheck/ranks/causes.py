"""Why ranks that must hold the same generator state do not: a table of likely causes, read top
to bottom (the first whose condition holds wins), each a short function of the evidence the
ranks gathered (:class:`StateEvidence`). A cause told as what the divergent side's ranks did
also says which other sides it fits, or what fits them instead."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ..core.events import RandomOpEvent, SeedCall
from ..core.findings import Culprit, Likely, Side, culprits_of
from .detail import Detail, OnMesh, Uncompared
from .explain import (
    apart_text,
    has_advice,
    order_advice,
    order_what,
    ranks_word,
    uncompared_reasons,
)
from .generators import moved_apart
from .verdict import Apart, Verdict

__all__ = ["STATE_CAUSES", "StateEvidence", "dtensor_mesh", "order_of", "state_cause"]


def _ignored_text(
    details: dict[int, Detail], odd: tuple[int, ...], ref: tuple[int, ...], gen: str
) -> str:
    """Random ops rngcheck does not compare (under expect("ignore"), in a data-parallel forward,
    reading every rank's batches alone) that drew from the generator on some ranks only, or a
    different number of times."""
    parts = []
    for ranks in (odd, ref):
        ignored = details[ranks[0]].uncompared
        if ignored:
            parts.append(
                f"{ranks_word(ranks)} drew {ignored.ops} random op(s) "
                f"{uncompared_reasons(ignored)} from "
                f"{gen} since its last checked op (the last: {ignored.op} at {ignored.site})"
            )
        else:
            parts.append(f"{ranks_word(ranks)} drew none")
    return (
        "; ".join(parts) + ". Those ops are not compared, but they still advance the generator "
        "the checked ops draw from: give them their own torch.Generator"
    )


@dataclass(frozen=True)
class StateEvidence:
    """What a state divergence shows: the two sides, their seeding calls (in words, ``seeds``,
    and as records, ``calls``) and uncompared ops; whether the ops were parameter
    initialisations (``init``), and the mesh of a DTensor op (``mesh``)."""

    before_differs: bool
    ref: Side
    odd: Side
    gen: str
    seeds: dict[tuple[int, ...], str]
    details: dict[int, Detail]
    calls: dict[tuple[int, ...], tuple[SeedCall, ...]]
    init: bool = False

    @property
    def mesh(self) -> OnMesh | None:
        return dtensor_mesh(self.details)

    @property
    def ev(self) -> RandomOpEvent:
        assert self.odd.event is not None
        return self.odd.event

    @property
    def odd_seeds(self) -> str:
        return self.seeds[self.odd.ranks]

    @property
    def ref_seeds(self) -> str:
        return self.seeds[self.ref.ranks]

    def uncompared(self, side: Side) -> Uncompared | None:
        return self.details[side.ranks[0]].uncompared

    def blamed(self, *sides: Side) -> tuple[Culprit, ...]:
        """The seeding calls of ``sides`` (each on its ranks), as culprits."""
        return tuple(c for side in sides for c in culprits_of(self.calls[side.ranks], side.ranks))


def dtensor_mesh(details: Mapping[int, Detail]) -> OnMesh | None:
    """The mesh of the DTensor op at the divergent position, as any rank says; None when the op
    is no DTensor's."""
    return next((d.mesh for _, d in sorted(details.items()) if d.mesh is not None), None)


def _nobody(_e: StateEvidence) -> tuple[Culprit, ...]:
    return ()


@dataclass(frozen=True)
class _StateCause:
    name: str
    when: Callable[[StateEvidence], bool]
    says: Callable[[StateEvidence], str]
    # Told as what the divergent side's ranks did (not a cause of every rank's: a split, seeds,
    # the op's own arguments): it also says which other sides it fits, or what fits them.
    of_side: bool = False
    # The calls its words name with their line (Finding.culprits).
    blames: Callable[[StateEvidence], tuple[Culprit, ...]] = _nobody


def _drew_differently(e: StateEvidence) -> str:
    if e.ref.event is None:
        return "the op itself drew differently"
    return (
        f"the op itself drew differently: arguments {', '.join(e.ref.event.args)} on "
        f"{ranks_word(e.ref.ranks)} versus {', '.join(e.ev.args)} on {ranks_word(e.odd.ranks)}"
    )


def _seeded_differently(e: StateEvidence) -> str:
    seeded = (
        f"the ranks seeded {e.gen} differently: {ranks_word(e.ref.ranks)} {e.ref_seeds}; "
        f"{ranks_word(e.odd.ranks)} {e.odd_seeds}. "
    )
    if e.mesh is not None:  # (told why the mesh must agree below: build_finding)
        return seeded + (
            "A seed that depends on the rank gives the ranks of a DTensor's mesh different "
            "states, where its random ops need one: seed every rank of the mesh alike"
        )
    if e.init:
        return seeded + (
            "A seed that depends on the rank (seed + rank) before building a replicated model "
            "makes replicas differ; seed every rank alike, and scope per-rank streams with "
            "rngcheck.expect('differ')"
        )
    return seeded + (
        "A seed that depends on the rank (seed + rank) makes ranks that must draw alike draw "
        "apart; seed every rank alike, and scope per-rank streams with rngcheck.expect('differ')"
    )


def order_of(details: Mapping[int, Detail]) -> Verdict | None:
    """The scope that says every rank walks the order drawn at the divergent op, as any rank
    says; None when none."""
    return next((d.order for _, d in sorted(details.items()) if d.order is not None), None)


def _why_apart(e: StateEvidence) -> tuple[str, Apart | None, RandomOpEvent | None]:
    """Why the generator of an order differs across the ranks: the words, how the ranks moved
    it apart (if they did) and a rank's draw of it when they seeded it differently."""
    apart = next((d.apart for _, d in sorted(e.details.items()) if d.apart), None)
    ref = e.ref.event
    if apart is not None:
        return f"{apart_text(apart)}, and it differs across ranks from there", apart, None
    if ref is not None and None not in (ref.seed, e.ev.seed) and ref.seed != e.ev.seed:
        why = (
            f"it is seeded differently on each rank (initial seed {ref.seed} on "
            f"{ranks_word(e.ref.ranks)}, {e.ev.seed} on {ranks_word(e.odd.ranks)})"
        )
        return why, None, ref
    if (moved := moved_apart(e.details)) is not None:
        return f"{apart_text(moved[1])}, and it differs across ranks from there", moved[1], None
    return next(c.says(e) for c in STATE_CAUSES[1:] if c.when(e)), None, None


def _split_order(e: StateEvidence) -> str:
    order = order_of(e.details)
    assert order is not None
    why, _, seeded = _why_apart(e)
    seed_alike = ""
    if seeded is not None and not has_advice(order):
        seed_alike = ", or seed that generator alike on every rank"
    what = order_what(order, e.gen)
    advice = order_advice(order, seeded)
    return f"{what} Why {e.gen} differs: {why}. {advice}{seed_alike}"


def _split_order_blames(e: StateEvidence) -> tuple[Culprit, ...]:
    """The restores an order's cause names (each rank restored a state of its own), or the
    calls of the row it falls back on."""
    _, apart, seeded = _why_apart(e)
    if apart is not None:
        if apart.reason is None:  # (apart_text names the restore)
            return tuple(
                c
                for side in (e.ref, e.odd)
                for c in culprits_of(e.calls[side.ranks][-1:], side.ranks)
            )
        return ()
    if seeded is not None:
        return ()
    return next(c.blames(e) for c in STATE_CAUSES[1:] if c.when(e))


# Why ranks that must hold the same state do not: the first row whose condition holds wins.
STATE_CAUSES: tuple[_StateCause, ...] = (
    _StateCause(
        "an order every rank walks",
        lambda e: e.before_differs and order_of(e.details) is not None,
        _split_order,
        blames=_split_order_blames,
    ),
    _StateCause(
        "the op drew differently",
        lambda e: not e.before_differs,
        _drew_differently,
    ),
    _StateCause(
        "seeded differently",
        lambda e: bool(e.odd_seeds and e.ref_seeds and e.odd_seeds != e.ref_seeds),
        _seeded_differently,
        blames=lambda e: e.blamed(e.ref, e.odd),
    ),
    _StateCause(
        "uncompared ops moved the generator",
        lambda e: e.uncompared(e.odd) != e.uncompared(e.ref),
        lambda e: _ignored_text(e.details, e.odd.ranks, e.ref.ranks, e.gen),
        of_side=True,
    ),
    _StateCause(
        "changed outside a random op",
        lambda e: bool(e.odd_seeds),
        lambda e: f"{ranks_word(e.odd.ranks)} changed {e.gen} outside a random op: {e.odd_seeds}",
        of_side=True,
        blames=lambda e: e.blamed(e.odd),
    ),
    _StateCause(
        "changed out of band",
        lambda e: e.ev.out_of_band is not None,
        lambda e: (
            f"{ranks_word(e.odd.ranks)}: {e.gen} "
            f"{e.ev.out_of_band.describe() if e.ev.out_of_band else ''}"
        ),
        of_side=True,
        blames=lambda e: e.blamed(e.odd),
    ),
    _StateCause(
        "a user generator out of view",
        lambda e: not e.ev.generator.is_default,
        lambda e: (
            f"{e.gen} is in a different state on {ranks_word(e.odd.ranks)}: it was seeded "
            "differently or advanced on those ranks only, where rngcheck could not see it (before "
            "the checker started, or by Generator.manual_seed / set_state)"
        ),
    ),
    _StateCause(
        "already differed",
        lambda e: True,
        lambda e: (
            f"{e.gen} already differed when the checker first compared it: the ranks were "
            "seeded differently (a seed that depends on the rank) or some drew random numbers "
            "before the checker started"
        ),
    ),
)


def _cause_row(evidence: StateEvidence) -> _StateCause:
    return next(c for c in STATE_CAUSES if c.when(evidence))


def state_cause(evidence: StateEvidence, others: Sequence[Side]) -> Likely:
    """The cause, told of the divergent side, with the calls it blames; a cause told as what
    those ranks did also says which other sides (ranks in a third state or more) it fits, and
    blames their calls too, or what fits them instead."""
    row = _cause_row(evidence)
    text = row.says(evidence)
    culprits = row.blames(evidence)
    if not others or not row.of_side:
        return Likely(text, culprits)
    alike: list[int] = []
    apart: list[str] = []
    for side in others:
        told_of = replace(evidence, odd=side)
        other = _cause_row(told_of)
        if other is row:
            alike += side.ranks
            culprits += row.blames(told_of)
        else:
            apart.append(f"on {ranks_word(side.ranks)}, {other.name}")
    text = text.rstrip(".")
    if alike:
        text += f". The same on {ranks_word(sorted(alike))}"
    if apart:
        told = "; ".join(apart)
        text += f". {told[0].upper()}{told[1:]}"
    return Likely(text, culprits)
