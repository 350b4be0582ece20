"""Generators across ranks: one state machine per generator the rank checker compares.

::

    agreeing --(a mismatch that scopes' uncompared draws, or a learnt line, explain)--> apart
    apart ----(the user reseeds or restores it: its seed changes, or a seeding call)--> agreeing
    agreeing --(learnt: seeded differently on each rank, in a data-parallel program)--> per-rank

*Agreeing*: compared by state. *Apart* (why, where: an :class:`Apart`): by what runs, since its
states differ for a reason already said; an order or a peers scope still compares it by state
(``Verdict.firm``: what they feed must agree whatever the generator's history). *Per-rank*: its
draws are not compared outside a declared scope or an order. A step-level drift rebases
generators for one sampled step (``set_rebase``).

Transitions are decided from the data every rank gathered after a mismatch (pure functions of
``Spot`` and ``Detail``; protocol rule P5), so every rank moves alike. What is learnt from a
mismatch (per-rank seeds, a line drawing with each rank's own arguments or counts) is marked as
learnt in the notes, and ``strict=True`` turns learning off: the mismatch is reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..core.events import RandomOpEvent, SeedCall
from .detail import Detail, Seeded
from .explain import OWN_REASONS, apart_text
from .localise import Spot
from .protocol import POLICY_CODE, gen_key, ident_key, text_hash
from .step_digest import slot_of
from .verdict import Apart, Compare, Domain, Reason, Verdict

__all__ = [
    "GeneratorStates",
    "count_key",
    "counts_may_apply",
    "data_parallel_drift",
    "line_key",
    "moved_apart",
    "own_arguments",
    "own_count",
    "per_rank_seeding",
    "rank_groups",
    "reseeded_by_user",
    "seed_calls_of",
    "seed_text",
]

_LINE_FRAMES = 4  # the user's frames that tell one learnt line from another


class GeneratorStates:
    """This rank's view of each generator's state across the ranks (see the module docstring)."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.per_rank: dict[int, Seeded] = {}  # generator (hashed key) -> how it is seeded
        self._per_rank_keys: set[str] = set()
        # gen_key -> (its initial seed on this rank then, how the ranks moved it apart)
        self._apart: dict[str, tuple[int | None, Apart]] = {}
        self.noted: dict[str, tuple[str, Apart]] = {}  # gen_key -> (its label, how), for notes
        # (generator, op) -> the lines that draw it with each rank's own arguments or a number
        # of times of each rank's own (as line_key gives them; True: the latter)
        self._lines: dict[tuple[str, str], dict[tuple[tuple[str, int], ...], bool]] = {}
        self._rebase: frozenset[int] = frozenset()

    # -- reading the states ---------------------------------------------------------------------

    def is_per_rank(self, event: RandomOpEvent) -> bool:
        return bool(self._per_rank_keys) and gen_key(event) in self._per_rank_keys

    def verdict(self, event: RandomOpEvent) -> Verdict | None:
        """The learnt verdict of an op outside every scope: a learnt line's (not compared), a
        per-rank stream's (not compared), or None (compared)."""
        if self._lines:
            lines = self._lines.get((gen_key(event), event.op))
            if lines is not None and not reseeded_by_user(event):
                counts = lines.get(line_key(event))
                if counts is not None:
                    reason = Reason.OWN_COUNT if counts else Reason.OWN_ARGUMENTS
                    return Verdict(Domain.RANK, Compare.NONE, reason, event.site)
        if self.is_per_rank(event):
            return Verdict(Domain.RANK, Compare.NONE, Reason.PER_RANK_SEED)
        return None

    def by_state(self, event: RandomOpEvent, verdict: Verdict) -> bool:
        """Whether ``event``'s row compares states (else what runs only): not on a generator the
        ranks moved apart (until the user reseeds or restores it: then it agrees again), nor on
        one a step-level drift rebased, unless the verdict is firm."""
        rebased = bool(self._rebase) and slot_of(event.generator) in self._rebase
        if self._apart and not verdict.fork:
            gen = gen_key(event)
            apart = self._apart.get(gen)
            if apart is not None:
                oob = event.out_of_band
                if event.seed == apart[0] and not (oob is not None and oob.user_calls):
                    rebased = True
                else:  # reseeded or restored since (by the user): its states agree again
                    del self._apart[gen]
        return not rebased or verdict.firm

    def apart_of(self, event: RandomOpEvent) -> Apart | None:
        """How the ranks moved ``event``'s generator apart, if it is compared by what runs."""
        known = self._apart.get(gen_key(event))
        return known[1] if known is not None else None

    def agreeing(self, generators: list[Any]) -> list[Any]:
        """The step level's generators whose digests must agree: not a per-rank stream nor one the
        ranks moved apart (in a slot shared with one that must agree, they would hide its
        drift). Every rank learns both at the same exchange, so every rank leaves the same out."""
        if not (self._per_rank_keys or self._apart):
            return generators
        apart = self._per_rank_keys | self._apart.keys()
        return [t for t in generators if ident_key(t.ident) not in apart]

    def set_rebase(self, slots: Iterable[int]) -> None:
        """level="step": the digest slots that drifted apart between samples are compared by what
        runs in the coming sampled step."""
        self._rebase = frozenset(slots)

    # -- transitions ----------------------------------------------------------------------------

    def go_apart(self, event: RandomOpEvent, how: Apart, seed: int | None) -> None:
        """agreeing -> apart: ``event``'s generator, moved apart as ``how`` says (``seed``: its
        initial seed on this rank there, which tells when the user reseeds it)."""
        key = gen_key(event)
        if key not in self._apart:
            self._apart[key] = (seed, how)
        self.noted.setdefault(key, (event.generator.label, how))

    def learn_line(self, event: RandomOpEvent, *, by_counts: bool) -> Reason:
        """Learnt: ``event``'s line draws its op from its generator with each rank's own
        arguments, or (``by_counts``) a number of times of each rank's own, from here (a line
        already learnt keeps how it was)."""
        lines = self._lines.setdefault((gen_key(event), event.op), {})
        counts = lines.setdefault(line_key(event), by_counts)
        return Reason.OWN_COUNT if counts else Reason.OWN_ARGUMENTS

    def learn_per_rank(self, event: RandomOpEvent, seeded: Seeded) -> None:
        """agreeing -> per-rank (learnt): its rows leave the comparison from here on."""
        key = gen_key(event)
        self.per_rank[text_hash(key)] = seeded
        self._per_rank_keys.add(key)


# -- the decisions, from the gathered data (the same on every rank) -------------------------------


def reseeded_by_user(event: RandomOpEvent) -> bool:
    """The user's seeding call (or a reseed of a user generator) changed the generator since
    its last random op."""
    oob = event.out_of_band
    return oob is not None and bool(oob.user_calls or (oob.new_seed is not None and not oob.calls))


def rank_groups(keys: Mapping[int, Any]) -> list[tuple[int, ...]]:
    """Ranks grouped by key, the largest group first (ties: the group with the lowest rank)."""
    by: dict[Any, list[int]] = {}
    for rank, key in sorted(keys.items()):
        by.setdefault(key, []).append(rank)
    return sorted((tuple(v) for v in by.values()), key=lambda g: (-len(g), g[0]))


def _seeded_alike(events: Iterable[RandomOpEvent | None]) -> bool:
    seeds = {e.seed if e is not None else None for e in events}
    return len(seeds) == 1 and None not in seeds


def seed_calls_of(detail: Detail, event: RandomOpEvent) -> tuple[SeedCall, ...]:
    """The user's seeding calls that reached ``event``'s generator on a rank: those since its
    last op, else (its first op) those since the mode started."""
    if event.out_of_band is not None and event.out_of_band.user_calls:
        return event.out_of_band.user_calls
    return detail.seed_calls


def seed_text(detail: Detail, event: RandomOpEvent) -> str:
    """The seeding calls that reached ``event``'s generator on a rank, in words."""
    return "; ".join(c.text for c in seed_calls_of(detail, event))


def _ordered(details: Mapping[int, Detail]) -> bool:
    """Whether a scope says every rank walks the order drawn at the divergent op."""
    return any(d.order is not None for d in details.values())


def per_rank_seeding(spot: Spot, details: dict[int, Detail]) -> tuple[RandomOpEvent, Seeded] | None:
    """When the ranks' states differ at ``spot`` because the generator was seeded differently on
    each rank (its initial seeds differ: ``torch.manual_seed(seed + rank)``, a per-rank
    ``torch.Generator``), that generator (one rank's event of it) and how it is seeded; else
    None. Not when some ranks reseeded it just before (a call the others did not make): that is a
    divergence, as when one rank restores its own state at a resume.

    Also when the ranks ran different ops there, all from that generator: a per-rank stream
    serves per-rank data (a crop drawn for each rank's own image size, more draws for a longer
    batch), and its states already differ from its first op."""
    if spot.kind not in ("state", "flow") or spot.policy != POLICY_CODE["same"]:
        return None
    if _ordered(details):
        return None  # an order: the ranks must draw it alike, seeded alike or not
    if spot.kind == "flow" and (
        any(d.event is None for d in details.values())
        or len({gen_key(d.event) for d in details.values() if d.event is not None}) > 1
    ):
        return None
    evs = {r: d.event for r, d in details.items() if d.event is not None}
    seeds = {r: e.seed for r, e in evs.items()}
    if len(evs) < 2 or None in seeds.values() or len(set(seeds.values())) < 2:
        return None
    if 0 < len([e for e in evs.values() if reseeded_by_user(e)]) < len(evs):
        return None  # some ranks reseeded it just now, the others did not: that is the bug
    by_seed = rank_groups(seeds)
    # Ranks seeded alike (seed + data-parallel rank under tensor parallelism) must still agree
    # there: if they do not, seeding does not explain the divergence.
    same = (lambda e: (e.op, e.args)) if spot.kind == "flow" else (lambda e: (e.before, e.after))
    if any(len({same(evs[r]) for r in g}) > 1 for g in by_seed):
        return None
    first = evs[min(evs)]
    calls = {r: seed_text(details[r], e) for r, e in evs.items()}
    return first, Seeded(
        label=first.generator.short_label,
        seeds=tuple((int(evs[g[0]].seed or 0), g) for g in by_seed[:4]),
        calls=tuple((r, t) for r, t in sorted(calls.items()) if t),
    )


def data_parallel_drift(
    spot: Spot, details: dict[int, Detail]
) -> tuple[RandomOpEvent, Apart] | None:
    """When the ranks' states differ at ``spot`` because the generator drew in a scope whose
    draws are each rank's own since its last compared op (a data-parallel forward over per-rank
    shapes, a rank's own share of the data, one rank reading every rank's batches), or as every
    rank restored a state of its own (a resume), that generator (one rank's event of it) and
    how the ranks moved it apart; else None. Not when a rank's op follows another seeding call
    of the user's: that is the divergence to report. A generator some rank found so before
    (``Detail.apart``: its rows sent before every rank knew still carry states) is one too."""
    if spot.kind != "state" or spot.policy != POLICY_CODE["same"] or _ordered(details):
        return None
    return moved_apart(details)


def moved_apart(details: dict[int, Detail]) -> tuple[RandomOpEvent, Apart] | None:
    """:func:`data_parallel_drift`'s answer from the gathered details alone (also for an order,
    which stays a divergence: this says why its generator differs)."""
    evs = {r: d.event for r, d in details.items() if d.event is not None}
    if len(evs) < 2 or len({gen_key(e) for e in evs.values()}) > 1:
        return None
    first = evs[min(evs)]
    restored = _restored_per_rank(evs, details)
    if restored is not None:
        return first, restored
    if any(reseeded_by_user(e) for e in evs.values()):
        return None
    known = sorted((d.apart for d in details.values() if d.apart), key=apart_text)
    if known:
        return first, known[0]
    joins = sorted(
        (
            d.uncompared.why
            for d in details.values()
            if d.uncompared is not None and d.uncompared.why.reason is Reason.JOIN
        ),
        key=lambda v: v.subject,
    )
    if joins:  # some ranks ran iterations of their own in torch's Join: the surest cause
        return first, _apart_by(joins[0])
    forward = {  # rank -> the scope it drew its own batch's draws in there
        r: d.uncompared.why
        for r, d in details.items()
        if d.uncompared is not None and d.uncompared.why.reason in OWN_REASONS
    }
    alone = {r: d.uncompared.alone for r, d in details.items() if d.uncompared is not None}
    readers = sorted(r for r, why in alone.items() if why is not None)
    # A rank that read alone is the surer cause (its draws were its own, whatever the shapes),
    # when it explains every difference: the ranks that neither read nor drew in a forward
    # still agree among themselves.
    if (
        readers
        and len({e.before for r, e in evs.items() if r not in forward and r not in readers}) <= 1
    ):
        reader = readers[0]
        why = alone[reader]
        assert why is not None
        return first, Apart(why.reason, why.subject, why.source, rank=reader)
    if not forward:
        return None
    return first, min((_apart_by(v) for v in forward.values()), key=apart_text)


def _apart_by(verdict: Verdict) -> Apart:
    return Apart(verdict.reason, verdict.subject, verdict.source, rank=verdict.rank)


def _restored_per_rank(evs: dict[int, RandomOpEvent], details: dict[int, Detail]) -> Apart | None:
    """When, in a data-parallel program, every rank restored a state of its own into the
    generator just before (a resume: Hugging Face's Trainer and accelerate's load_state load
    each rank's saved RNG state, which a data-parallel forward may have moved apart before the
    save), how; else None. The restore is the last of the user's seeding calls that reached
    the generator since its last op, or, at its first op under the mode, since the mode
    started. Not when some ranks restored and others did not (one rank resuming from its own
    stale state is the bug), nor when the ranks restored by different calls or lines, nor after
    a seed (per-rank seeds are learnt as per-rank streams)."""
    if len(evs) < len(details) or not all(d.wrappers for d in details.values()):
        return None
    last = {}
    for r, e in evs.items():
        calls = e.out_of_band.user_calls if e.out_of_band is not None else details[r].seed_calls
        if not calls or calls[-1].argument != "<state>":
            return None
        last[r] = calls[-1]
    if len({(c.api, c.stack.describe()) for c in last.values()}) > 1:
        return None
    return Apart(None, call=last[min(last)].text)


def line_key(event: RandomOpEvent) -> tuple[tuple[str, int], ...]:
    """Where an op was drawn, for a learnt line: its innermost user frames (file and line), so a
    helper that draws for several callers is as many lines as it has callers."""
    return tuple((f.filename, f.lineno) for f in event.stack.user_frames[-_LINE_FRAMES:])


def own_arguments(spot: Spot, details: dict[int, Detail]) -> tuple[RandomOpEvent, Apart] | None:
    """Learnt: when the ranks ran the same op at the same line on a device's default generator,
    seeded alike, with arguments of their own (noise over each rank's own batch shape: a
    diffusion model's aspect-ratio buckets, dynamic padding), in a data-parallel program whose
    ranks each compute on their own batch, that op (one rank's event of it) and how the ranks
    moved its generator apart; else None. Each rank drew for its own batch there, as in a
    data-parallel forward. Not on a torch.Generator of the user's seeded alike (a stream made to
    agree), nor where a wrapper has tensor-parallel peers (they share a batch), an order, a
    generate() call, or after a user's seeding call on some rank."""
    if spot.kind != "flow" or spot.policy != POLICY_CODE["same"] or _ordered(details):
        return None
    if any(d.event is None or d.call or d.peers or not d.wrappers for d in details.values()):
        return None
    evs = {r: d.event for r, d in details.items() if d.event is not None}
    calls = {(e.op, e.site, gen_key(e)) for e in evs.values()}
    args = {e.args for e in evs.values()}
    first = evs[min(evs)]
    if len(evs) < 2 or len(calls) > 1 or len(args) < 2 or not first.generator.is_default:
        return None
    if not _seeded_alike(evs.values()) or any(reseeded_by_user(e) for e in evs.values()):
        return None
    groups = rank_groups({r: e.args for r, e in evs.items()})
    drawn = tuple((", ".join(evs[g[0]].args), g) for g in groups)
    return first, Apart(Reason.OWN_ARGUMENTS, site=first.site, op=first.op, args=drawn)


def count_key(event: RandomOpEvent, structure: int) -> str:
    """A learnt line by counts: an op as the ranks compare where each ran it (its row's
    ``structure``: op, generator and arguments; the generator's seed; its line, as
    :func:`line_key` reads it); "" for an op with no user frame (no line to tell)."""
    line = line_key(event)
    if not line or event.seed is None:
        return ""
    return f"{structure}:{event.seed}:{text_hash(*(f'{f}:{n}' for f, n in line))}"


def counts_may_apply(spot: Spot) -> bool:
    """Whether a learnt line by counts can explain a divergence of this kind: ops compared as
    "same" (or none, on some rank) that part in their order."""
    return spot.kind == "flow" and spot.policy in (0, POLICY_CODE["same"])


def own_count(spot: Spot, details: dict[int, Detail]) -> tuple[int, RandomOpEvent, Apart] | None:
    """Learnt, counts: when, where the ranks part, a rank runs an op on a device's default
    generator, seeded alike, at a line where every other rank ran that op too, from the same
    seed, earlier in this round, fewer times than this rank has by then (a loop over each
    rank's own data: a crop drawn until one fits the rank's own image, jitter for each of its
    own boxes), in a data-parallel program whose ranks each compute on their own batch: that
    rank, its op and how the ranks moved its generator apart; else None. Ops the ranks ran in
    another order are no such loop, nor is a rank whose loop ran no time in the round. Not on a
    torch.Generator of the user's, nor where a wrapper has tensor-parallel peers, an order, a
    generate() call, or after a user's seeding call on any rank. (The spot's policy is 0 where
    a rank ran no op there; every op a rank keys by its line is one compared as "same".)"""
    if (
        not counts_may_apply(spot)
        or _ordered(details)
        or len(details) < 2
        or any(d.call or d.peers or not d.wrappers for d in details.values())
        or any(d.event is not None and reseeded_by_user(d.event) for d in details.values())
    ):
        return None
    for rank, d in sorted(details.items()):
        e, key = d.event, d.spot_line
        if e is None or not key or not e.generator.is_default:
            continue
        ran = _ran_before(d, key, d.spot_at + 1)  # (its op there too)
        others = {r: _ran_before(o, key, o.spot_at) for r, o in details.items() if r != rank}
        if all(0 < n < ran for n in others.values()):
            how = Apart(
                Reason.OWN_COUNT, site=e.site, op=e.op, rank=rank, others=tuple(sorted(others))
            )
            return rank, e, how
    return None


def _ran_before(detail: Detail, key: str, end: int) -> int:
    """How many times a rank ran the op ``key`` names before position ``end`` of its window."""
    return sum(1 for i in detail.lines.get(key, ()) if i < end)
