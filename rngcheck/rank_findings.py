"""Localising a cross-rank divergence and describing it: pure functions of the data every rank
gathered after a mismatch (each rank's window of random-op rows and the detail of its op at the
divergent position), so every rank builds the same finding and one of them draws it."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .events import RandomOpEvent, SeedCall
from .report import Finding, FindingKind, Side, format_ranks
from .stacks import Stack

__all__ = [
    "POLICY_CODE",
    "Point",
    "Row",
    "Spot",
    "build_finding",
    "init_finding",
    "localise",
    "per_rank_seeding",
    "point_text",
]

_DATA_DIR = "/torch/utils/data/"

# "same" by default (the mode's expectation), "differ", and "same" as declared: an expect()
# block or a DTensor's mesh. Only the default may turn out to be a per-rank stream (Rule 3).
POLICY_CODE = {"same": 1, "differ": 2, "declared": 3}


class Row(NamedTuple):
    """One random op as the ranks exchange it: six int64s, the same layout on every rank."""

    structure: int  # digest of op, generator and arguments: what must run in the same order
    stream: int  # digest of the expectation and the ranks it spans; 0: compared in order only
    before: int  # the generator's state digest before the op (0: unreadable)
    after: int
    policy: int  # POLICY_CODE of the stream's expectation
    generator: int  # digest of the generator's cross-rank name (a per-rank stream drops its rows)


class Point(enum.IntEnum):
    """Where a rank stood when it joined an exchange; all ranks must stand at the same kind."""

    RANDOM_OP = 1
    COLLECTIVE = 2
    OPTIMIZER_STEP = 3
    EVERY = 4
    CHECK = 5
    EXIT = 6


POINT_TEXT = {
    Point.RANDOM_OP: "a random op",
    Point.COLLECTIVE: "a collective",
    Point.OPTIMIZER_STEP: "an optimizer step",
    Point.EVERY: "the every-N-ops exchange",
    Point.CHECK: "mode.check()",
    Point.EXIT: "the end of the checked block",
}


def point_text(point: Point, where: str, stack: Stack) -> str:
    """``collective c10d.allreduce_.default at train.py:50``: where a rank joined an exchange."""
    what = where or POINT_TEXT[point]
    if point is Point.COLLECTIVE:
        what = f"collective {where}"
    site = stack.call_site
    return f"{what} at {site.short_location}" if site is not None and site.user else what


@dataclass(frozen=True, slots=True)
class Spot:
    """Where the gathered windows first disagree, and in what way."""

    kind: str  # "flow" (different ops), "state" (same op, states differ), "collision", "points"
    index: int  # position in the windows (flow, points) or in the stream (state, collision)
    stream: int = 0
    policy: int = 0  # the stream's POLICY_CODE (state, collision)

    def index_for(self, rank: int, window: list[tuple[int, ...]]) -> int:
        """The position in ``window`` of this rank's op at the spot (past the end: none)."""
        if self.kind in ("flow", "points"):
            return self.index
        positions = [i for i, r in enumerate(window) if r.stream == self.stream]
        return positions[self.index] if self.index < len(positions) else -1


def localise(windows: dict[int, list[Row]], points: dict[int, Point]) -> Spot | None:
    """The first place the ranks' windows disagree: different ops (control flow), then, stream by
    stream, states ("same") or shared states ("differ"), then different exchange points. None:
    they agree (two streams only shared a hashed value)."""
    length = max(len(w) for w in windows.values())
    for i in range(length):
        if len({w[i].structure if i < len(w) else None for w in windows.values()}) > 1:
            return Spot("flow", i)
    streams: dict[int, dict[int, list[Row]]] = {}
    for rank, w in windows.items():
        for r in w:
            if r.stream:
                streams.setdefault(r.stream, {}).setdefault(rank, []).append(r)
    first: Spot | None = None
    first_pos = length
    for stream, by_rank in streams.items():
        if len(by_rank) < 2:
            continue
        for j in range(min(len(v) for v in by_rank.values())):
            at = [v[j] for v in by_rank.values()]
            if at[0].policy == POLICY_CODE["differ"]:
                states = [r.before for r in at]
                bad = len(set(states)) < len(states)
                kind = "collision"
            else:
                bad = len({(r.before, r.after) for r in at}) > 1
                kind = "state"
            if bad:
                rank0 = min(by_rank)
                pos = [i for i, r in enumerate(windows[rank0]) if r.stream == stream][j]
                if pos < first_pos:
                    first, first_pos = Spot(kind, j, stream, at[0].policy), pos
                break
    if first is not None:
        return first
    if len(set(points.values())) > 1:
        return Spot("points", length)
    return None


def _groups(keys: dict[int, Any]) -> list[tuple[int, ...]]:
    """Ranks grouped by key, the largest group first (ties: the group with the lowest rank)."""
    by: dict[Any, list[int]] = {}
    for rank, key in sorted(keys.items()):
        by.setdefault(key, []).append(rank)
    return sorted((tuple(v) for v in by.values()), key=lambda g: (-len(g), g[0]))


def _event(detail: dict[str, Any]) -> RandomOpEvent | None:
    data = detail.get("event")
    return RandomOpEvent.from_dict(data) if data else None


def _ranks_word(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"


def build_finding(
    spot: Spot, windows: dict[int, list[Row]], details: dict[int, dict], domain: tuple
) -> Finding:
    if spot.kind == "flow":
        return _flow_finding(spot, windows, details, domain)
    if spot.kind == "points":
        return _points_finding(details, domain)
    involved = {
        r: details[r]
        for r in domain
        if details[r].get("event") is not None
        and windows[r]
        and any(row.stream == spot.stream for row in windows[r])
    }
    events = {r: _event(d) for r, d in involved.items()}
    if spot.kind == "collision":
        return _collision_finding(events, details)
    return _state_finding(events, details)


def _sides(
    groups: list[tuple[int, ...]],
    events: dict[int, RandomOpEvent | None],
    details: dict[int, dict],
    labels: Sequence[str],
) -> tuple[Side, ...]:
    sides = []
    for label, ranks in zip(labels, groups, strict=False):
        ev = events.get(ranks[0])
        note = (
            "" if ev is not None else f"ran no random op here; reached {details[ranks[0]]['point']}"
        )
        sides.append(Side(label=label, ranks=ranks, event=ev, note=note))
    return tuple(sides)


def _labels(groups: list[tuple[int, ...]], culprit: int) -> tuple[list[tuple[int, ...]], list[str]]:
    """Order sides reference first, then the culprit; name them majority/outliers when there is
    a majority, reference/divergent when the split is even."""
    ordered = [
        groups[0],
        groups[culprit],
        *(g for i, g in enumerate(groups) if i not in (0, culprit)),
    ]
    majority = len(groups[0]) > max(len(g) for g in groups[1:])
    names = ("majority", "outliers") if majority else ("reference", "divergent")
    return ordered, [names[0]] + [names[1]] * (len(ordered) - 1)


def _flow_finding(
    spot: Spot, windows: dict[int, list[Row]], details: dict[int, dict], domain: tuple
) -> Finding:
    i = spot.index
    at = {r: (windows[r][i].structure if i < len(windows[r]) else None) for r in domain}
    groups = _groups(at)
    events = {r: _event(details[r]) for r in domain}
    a, b = groups[0], groups[1]
    # Which side ran extra ops? The one that, after k ops of its own, runs what the other side
    # runs now (or runs on where the other side's window ended); the fewer extra ops, the likelier.
    ka, kb = _extra(windows[a[0]], i, at[b[0]]), _extra(windows[b[0]], i, at[a[0]])
    culprit = 1
    extra_side: tuple[int, ...] | None = None
    extra = 0
    if kb and (not ka or kb <= ka):
        extra_side, extra = b, kb
    elif ka:
        extra_side, extra = a, ka
        if len(a) == len(b):
            culprit = 0
    if culprit == 0:
        groups = [b, a, *groups[2:]]
        culprit = 1
    ordered, labels = _labels(groups, culprit)
    sides = _sides(ordered, events, details, labels)
    ref, odd = sides[0], sides[1]
    if extra_side is not None:
        others = tuple(r for r in domain if r not in extra_side)
        ev = events[extra_side[0]]
        assert ev is not None
        what = "an extra random op" if extra == 1 else f"{extra} extra random ops, the first"
        cause = (
            f"{_ranks_word(extra_side)} ran {what}, {ev.op} on {ev.generator.label} "
            f"at {ev.site}, that {_ranks_word(others)} did not run there (control flow that "
            "depends on the rank)"
        )
        if len(extra_side) > len(others):  # most ranks ran it: the few skipped it
            what = "a random op" if extra == 1 else f"{extra} random ops, the first"
            cause = (
                f"{_ranks_word(others)} skipped {what}, {ev.op} on {ev.generator.label} at "
                f"{ev.site}, that {_ranks_word(extra_side)} ran (control flow that depends on "
                "the rank)"
            )
        if any(_DATA_DIR in f.filename for f in ev.stack.frames):
            cause += (
                ". It was drawn by a DataLoader iterator: iter(DataLoader) draws its base seed "
                "from the global generator, so iterating a loader on some ranks only shifts every "
                "later random op there; iterate it on every rank or give the DataLoader its own "
                "generator="
            )
        elif not ev.generator.is_default:
            short = ev.generator.label.split(" (")[0]  # "Generator #1": named in full above
            cause += f"; this advanced {short} on those ranks only"
    else:
        cause = "the ranks ran different random ops here: " + "; ".join(
            f"{_ranks_word(s.ranks)} ran {s.event.op} at {s.event.site}"
            if s.event
            else f"{_ranks_word(s.ranks)} {s.note}"
            for s in sides
        )
    # The line to point at: the op one side ran and the other did not, whichever side that is.
    who = odd if odd.event is not None else ref
    if extra_side is not None:
        who = next(s for s in sides if s.ranks == extra_side)
    lead = who.event
    assert lead is not None
    other = ref if who is odd else odd
    return Finding(
        kind=FindingKind.RANK_DIVERGENCE,
        message=(
            f"the ranks ran different random ops: {_describe(ref)} but {_describe(odd)} "
            f"(random op #{lead.seq} on {_ranks_word(who.ranks)})"
        ),
        op=lead.op,
        cause=cause,
        differs="op",
        ranks=tuple(domain),
        stack=lead.stack,
        other_stack=other.event.stack if other.event is not None else None,
        sides=sides,
        seq=lead.seq,
    )


_LOOKAHEAD = 256  # extra ops one side may have run before the sides line up again


def _extra(window: list[Row], i: int, other: int | None) -> int:
    """How many ops ``window`` runs from ``i`` before it runs ``other`` (the other side's op at
    ``i``; None: the other side's window ended there, so all of this one's are extra). 0: never
    within the lookahead."""
    if other is None:
        return max(len(window) - i, 0)
    for k in range(1, min(_LOOKAHEAD, len(window) - i)):
        if window[i + k].structure == other:
            return k
    return 0


def _describe(side: Side) -> str:
    who = _ranks_word(side.ranks)
    if side.event is None:
        return f"{who} {side.note}"
    return f"{who} ran {side.event.op} at {side.event.site}"


def _points_finding(details: dict[int, dict], domain: tuple) -> Finding:
    groups = _groups({r: details[r]["point"].split(" at ")[0] for r in domain})
    ordered, labels = _labels(groups, len(groups) - 1)
    sides = tuple(
        Side(label=label, ranks=g, note=f"reached {details[g[0]]['point']}")
        for label, g in zip(labels, ordered, strict=False)
    )
    return Finding(
        kind=FindingKind.RANK_DIVERGENCE,
        message="the ranks reached different exchange points after the same random ops: "
        + "; ".join(f"{_ranks_word(s.ranks)} {s.note}" for s in sides),
        op="",
        cause=(
            "control flow differs across ranks between random ops (a different number of "
            "optimizer steps, collectives or check() calls); rngcheck stopped exchanging"
        ),
        differs="exchange point",
        ranks=tuple(domain),
        sides=sides,
    )


def _seed_text(detail: dict[str, Any], event: RandomOpEvent) -> str:
    if event.out_of_band is not None and event.out_of_band.user_calls:
        return event.out_of_band.describe()
    calls = [SeedCall.from_dict(c) for c in detail.get("seed_calls", [])]
    return "; ".join(c.text for c in calls)


def _ignored_text(
    details: dict[int, dict], odd: tuple[int, ...], ref: tuple[int, ...], gen: str
) -> str:
    """Random ops rngcheck does not compare (under expect("ignore"), in a data-parallel forward)
    that drew from the generator on some ranks only, or a different number of times."""
    parts = []
    for ranks in (odd, ref):
        ignored = details[ranks[0]].get("ignored")
        if ignored:
            count, op, site, why = ignored
            parts.append(
                f"{_ranks_word(ranks)} drew {count} random op(s) {why} from {gen} "
                f"since its last checked op (the last: {op} at {site})"
            )
        else:
            parts.append(f"{_ranks_word(ranks)} drew none")
    return (
        "; ".join(parts) + ". Those ops are not compared, but they still advance the generator "
        "the checked ops draw from: give them their own torch.Generator"
    )


def _state_finding(events: dict[int, RandomOpEvent | None], details: dict[int, dict]) -> Finding:
    evs = {r: e for r, e in events.items() if e is not None}
    before_differs = len({e.before for e in evs.values()}) > 1
    groups = _groups({r: (e.before if before_differs else e.after) for r, e in evs.items()})
    seeds = {g: _seed_text(details[g[0]], evs[g[0]]) for g in groups}

    def suspect(g: tuple[int, ...]) -> bool:  # did something change the generator here?
        return bool(seeds[g] or details[g[0]].get("ignored"))

    culprit = len(groups) - 1 if len(groups[0]) > len(groups[-1]) else 1
    if len(groups[0]) == len(groups[1]) and suspect(groups[0]) and not suspect(groups[1]):
        culprit = 0
    groups_c = list(groups)
    if culprit == 0:
        groups_c = [groups[1], groups[0], *groups[2:]]
        culprit = 1
    ordered, labels = _labels(groups_c, culprit)
    sides = _sides(ordered, evs, details, labels)
    ref, odd = sides[0], sides[1]
    ev = odd.event
    assert ev is not None and ref.event is not None
    gen = ev.generator.label
    if not before_differs:
        cause = (
            f"the op itself drew differently: arguments {', '.join(ref.event.args)} on "
            f"{_ranks_word(ref.ranks)} versus {', '.join(ev.args)} on {_ranks_word(odd.ranks)}"
        )
    elif seeds[odd.ranks] and seeds[ref.ranks] and seeds[odd.ranks] != seeds[ref.ranks]:
        cause = (
            f"the ranks seeded {gen} differently: {_ranks_word(ref.ranks)} {seeds[ref.ranks]}; "
            f"{_ranks_word(odd.ranks)} {seeds[odd.ranks]}. A seed that depends on the rank "
            "(seed + rank) before building a replicated model makes replicas differ; seed every "
            "rank alike, and scope per-rank streams with rngcheck.expect('differ')"
        )
    elif details[odd.ranks[0]].get("ignored") != details[ref.ranks[0]].get("ignored"):
        cause = _ignored_text(details, odd.ranks, ref.ranks, gen)
    elif seeds[odd.ranks]:
        cause = f"{_ranks_word(odd.ranks)} changed {gen} outside a random op: {seeds[odd.ranks]}"
    elif ev.out_of_band is not None:
        cause = f"{_ranks_word(odd.ranks)}: {gen} {ev.out_of_band.describe()}"
    elif not ev.generator.is_default:
        cause = (
            f"{gen} is in a different state on {_ranks_word(odd.ranks)}: it was seeded differently "
            "or advanced on those ranks only, where rngcheck could not see it (before the checker "
            "started, or by Generator.manual_seed / set_state)"
        )
    else:
        cause = (
            f"{gen} already differed when the checker first compared it: the ranks were seeded "
            "differently (a seed that depends on the rank) or some drew random numbers before "
            "the checker started"
        )
    what = "before" if before_differs else "after"
    return Finding(
        kind=FindingKind.RANK_DIVERGENCE,
        message=(
            f"ranks that must hold the same {gen} state do not: {_ranks_word(ref.ranks)} and "
            f"{_ranks_word(odd.ranks)} differ {what} {ev.op} at {ev.site} (random op #{ev.seq})"
        ),
        op=ev.op,
        cause=cause,
        differs="state" if before_differs else "state after",
        ranks=tuple(sorted(evs)),
        stack=ev.stack,
        other_stack=ref.event.stack,
        sides=sides,
        seq=ev.seq,
    )


def _collision_finding(
    events: dict[int, RandomOpEvent | None], details: dict[int, dict]
) -> Finding:
    evs = {r: e for r, e in events.items() if e is not None}
    groups = _groups({r: e.before for r, e in evs.items()})
    shared = [g for g in groups if len(g) > 1]
    sides = tuple(
        Side(label="share a state" if len(g) > 1 else "distinct", ranks=g, event=evs[g[0]])
        for g in groups
    )
    ev = evs[shared[0][0]]
    seeds = _seed_text(details[shared[0][0]], ev)
    cause = (
        f"{_ranks_word(shared[0])} hold the same {ev.generator.label} state under "
        "expect('differ'): the per-rank stream was not offset by rank"
    )
    if seeds:
        cause += f" ({seeds})"
    return Finding(
        kind=FindingKind.RANK_COLLISION,
        message=(
            f"{_ranks_word(shared[0])} must draw different numbers but share the "
            f"{ev.generator.label} state before {ev.op} at {ev.site} (random op #{ev.seq})"
        ),
        op=ev.op,
        cause=cause,
        differs="state",
        ranks=tuple(sorted(evs)),
        stack=ev.stack,
        sides=sides,
        seq=ev.seq,
    )


def per_rank_seeding(spot: Spot, details: dict[int, dict]) -> tuple[RandomOpEvent, str] | None:
    """When the ranks' states differ at ``spot`` because the generator was seeded differently on
    each rank (its initial seeds differ: ``torch.manual_seed(seed + rank)``, a per-rank
    ``torch.Generator``), that generator (one rank's event of it) and why, in words; else None."""
    if spot.kind != "state" or spot.policy != POLICY_CODE["same"]:
        return None
    events = {r: _event(d) for r, d in details.items()}
    evs = {r: e for r, e in events.items() if e is not None}
    seeds = {r: e.seed for r, e in evs.items()}
    if len(evs) < 2 or None in seeds.values() or len(set(seeds.values())) < 2:
        return None
    first = evs[min(evs)]
    by_seed = _groups(seeds)
    how = "; ".join(f"{seeds[g[0]]} on {_ranks_word(g)}" for g in by_seed[:4])
    calls = {r: _seed_text(details[r], e) for r, e in evs.items()}
    sites = "; ".join(f"{_ranks_word((r,))}: {t}" for r, t in sorted(calls.items()) if t)
    why = f"{first.generator.short_label} is seeded differently on each rank (initial seed {how}"
    return first, why + (f"; {sites})" if sites else ")")


def init_finding(finding: Finding, details: dict[int, dict]) -> Finding:
    """A divergence among parameter initialisations, settled at the first step (Rule 4): the
    parameters are replicated, and nothing broadcast them."""
    from dataclasses import replace

    wrappers = details[min(details)].get("dp") or []
    without = (
        f" ({'; '.join(wrappers)} does not broadcast module states at construction)"
        if wrappers
        else ""
    )
    cause = (
        f"nothing broadcast these replicated parameters before the first step{without}, and "
        f"{finding.cause}. (DistributedDataParallel broadcasts module states from rank 0 when it "
        "is built; FSDP without sync_module_states, fully_shard and a hand-written gradient "
        "all-reduce do not: broadcast the parameters, or seed every rank alike before building "
        "the model.)"
    )
    return replace(
        finding,
        message=f"parameters initialised differently across ranks: {finding.message}",
        cause=cause,
    )
