"""Describing a cross-rank divergence: pure functions of the data every rank gathered after a
mismatch (each rank's window of rows, and the :class:`Detail` of its op at the divergent
position), so every rank builds the same finding and one of them draws it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from ..core.events import RandomOpEvent
from ..core.findings import Culprit, Finding, FindingKind, Side, culprits_of, format_ranks
from ..core.stacks import Stack
from .causes import StateEvidence, dtensor_mesh, state_cause
from .detail import Detail
from .explain import mesh_text, order_advice, order_what, ranks_word
from .generators import rank_groups, reseeded_by_user, seed_calls_of, seed_text
from .localise import Spot, extra_ops, in_order
from .protocol import PEERS, Point, Row, gen_key
from .step_digest import seeds_said
from .verdict import Reason, Verdict

__all__ = [
    "build_finding",
    "init_finding",
    "missing_finding",
    "replica_finding",
    "pass_order_finding",
    "point_text",
    "point_what",
]

_DATA_DIR = "/torch/utils/data/"
_U64 = (1 << 64) - 1


POINT_TEXT = {
    Point.RANDOM_OP: "a random op",
    Point.COLLECTIVE: "a collective",
    Point.OPTIMIZER_STEP: "an optimizer step",
    Point.EVERY: "the every-N-ops exchange",
    Point.CHECK: "mode.check()",
    Point.EXIT: "the end of the checked block",
    Point.JOIN: "torch's Join",
}


def point_what(point: Point, where: str) -> str:
    """``collective c10d.allreduce_.default``: what a rank joined an exchange at."""
    if point is Point.COLLECTIVE:
        return f"collective {where}"
    return where or POINT_TEXT[point]


def point_text(point: Point, where: str, stack: Stack) -> str:
    """``collective c10d.allreduce_.default at train.py:50``: where a rank joined an exchange."""
    what = point_what(point, where)
    site = stack.call_site
    return f"{what} at {site.short_location}" if site is not None and site.user else what


def build_finding(
    spot: Spot,
    windows: dict[int, list[Row]],
    details: dict[int, Detail],
    domain: tuple,
    *,
    init: bool = False,
) -> Finding:
    """The finding at ``spot`` (``init``: the rows are parameter initialisations, settled at the
    first step); on a DTensor op, with why its mesh's ranks must agree."""
    finding = _build_finding(spot, windows, details, domain, init)
    mesh = dtensor_mesh(details)
    if mesh is not None and spot.policy != PEERS:
        finding = replace(finding, cause=f"{finding.cause.rstrip('.')}. {mesh_text(mesh)}")
    return finding


def _build_finding(
    spot: Spot, windows: dict[int, list[Row]], details: dict[int, Detail], domain: tuple, init: bool
) -> Finding:
    if spot.kind == "flow" and spot.policy == PEERS and spot.stream:
        # What the peers of a data-parallel forward run: among them, over their stream's rows.
        members = {r: w for r, w in windows.items() if any(x.stream == spot.stream for x in w)}
        rows = {
            r: [x for x in w if x.stream == spot.stream and x.structure] for r, w in members.items()
        }
        finding = _flow_finding(spot, rows, details, tuple(sorted(members)))
        return _among_peers(finding, members, details, seeding=False)
    if spot.kind == "flow":
        ordered = {r: [w[i] for i in in_order(w)] for r, w in windows.items()}
        return _flow_finding(spot, ordered, details, domain)
    if spot.kind == "points":
        return _points_finding(details, domain)
    involved = {
        r: details[r]
        for r in domain
        if details[r].event is not None
        and windows[r]
        and any(row.stream == spot.stream for row in windows[r])
    }
    events = {r: d.event for r, d in involved.items()}
    if spot.kind == "collision":
        return _collision_finding(events, details)
    finding = _state_finding(events, details, init)
    if spot.policy == PEERS:  # (peers of a data-parallel forward, by their batch)
        return _among_peers(finding, involved, details, seeding=True)
    return finding


def _among_peers(
    finding: Finding, ranks: Iterable[int], details: dict[int, Detail], seeding: bool
) -> Finding:
    """``finding`` with why its ranks, tensor-parallel peers, must agree (and, for states, how
    to seed them)."""
    ranks = sorted(ranks)
    wrappers = sorted({w for r in ranks for w in details[r].wrappers})
    groups = f" ({'; '.join(wrappers)})" if wrappers else ""
    why = (
        f"Ranks {format_ranks(ranks)} compute on one batch, as tensor-parallel peers (their "
        f"parameters are DTensors over them) inside data-parallel groups{groups}: the ranks of "
        "a data-parallel group may draw apart, but peers must draw alike"
    )
    if seeding:
        why += "; a seed that depends on the rank may depend on the data-parallel rank only"
    return replace(finding, cause=f"{finding.cause}. {why}")


def _sides(
    groups: list[tuple[int, ...]],
    events: Mapping[int, RandomOpEvent | None],
    details: dict[int, Detail],
    labels: Sequence[str],
) -> tuple[Side, ...]:
    sides = []
    for label, ranks in zip(labels, groups, strict=False):
        ev = events.get(ranks[0])
        note = "" if ev is not None else f"ran no random op here; reached {details[ranks[0]].point}"
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
    spot: Spot, windows: dict[int, list[Row]], details: dict[int, Detail], domain: tuple
) -> Finding:
    i = spot.index
    at = {r: (windows[r][i].structure if i < len(windows[r]) else None) for r in domain}
    groups = rank_groups(at)
    events = {r: details[r].event for r in domain}
    a, b = groups[0], groups[1]
    # Which side ran extra ops? The one that, after k ops of its own, runs what the other side
    # runs now (or runs on where the other side's window ended); the fewer extra ops, the likelier.
    ka, kb = extra_ops(windows[a[0]], i, at[b[0]]), extra_ops(windows[b[0]], i, at[a[0]])
    culprit = 1
    extra_side: tuple[int, ...] | None = None
    extra = 0
    culprits: tuple[Culprit, ...] = ()  # the calls the cause names
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
            f"{ranks_word(extra_side)} ran {what}, {ev.op} on {ev.generator.label} "
            f"at {ev.site}, that {ranks_word(others)} did not run there (control flow that "
            "depends on the rank)"
        )
        if len(extra_side) > len(others):  # most ranks ran it: the few skipped it
            what = "a random op" if extra == 1 else f"{extra} random ops, the first"
            cause = (
                f"{ranks_word(others)} skipped {what}, {ev.op} on {ev.generator.label} at "
                f"{ev.site}, that {ranks_word(extra_side)} ran (control flow that depends on "
                "the rank)"
            )
        call = details[extra_side[0]].call
        order = details[extra_side[0]].order
        if call:  # (the op stands for the call; the rest of what it drew is not compared)
            cause = _call_cause(call, ev, extra_side, others)
        elif order is not None and order.reason is Reason.SPLIT:
            cause += (
                f". It was {order.subject}, drawn from {ev.generator.label} on some ranks "
                "only, which shifts every later random op from it there: split on every rank, "
                "or give random_split a generator of its own (generator=torch.Generator()"
                ".manual_seed(seed))"
            )
        elif reseeded_by_user(ev) and ev.out_of_band is not None:
            # (a rank that reseeds or restores alone: its next draw is compared, also at a
            # learnt line whose draws are each rank's own, where the others' are not)
            cause += (
                f". On {ranks_word(extra_side)} it comes right after "
                f"{ev.out_of_band.describe()}: a generator reseeded or restored on some ranks "
                "only draws apart from there; seed (or restore) it alike on every rank"
            )
            culprits = culprits_of(ev.out_of_band.user_calls, extra_side)
        elif any(_DATA_DIR in f.filename for f in ev.stack.frames):
            cause += (
                ". It was drawn by a DataLoader iterator: iter(DataLoader) draws its base seed "
                "from the global generator, so iterating a loader on some ranks only shifts every "
                "later random op there; iterate it on every rank or give the DataLoader its own "
                "generator="
            )
        elif not ev.generator.is_default:
            # ("Generator #1": named in full above)
            cause += f"; this advanced Generator #{ev.generator.number} on those ranks only"
    elif _same_call_site(sides):
        lead_event = sides[0].event
        assert lead_event is not None
        cause = (
            f"the ranks ran {lead_event.op} at {lead_event.site} with different arguments ("
            + "; ".join(
                f"{', '.join(s.event.args)} on {ranks_word(s.ranks)}" for s in sides if s.event
            )
            + f"): arguments that depend on the rank or on its data, drawn from "
            f"{lead_event.generator.label}"
            + (
                ", seeded alike on every rank, so its states part here and every later draw "
                "from it differs across ranks. Draw per-rank work from a generator seeded per rank"
                if _seeded_alike(events.values())
                else _seeded_apart(sides)
            )
            + (
                _UNWRAPPED
                if _in_a_module(lead_event) and not any(d.wrappers for d in details.values())
                else ""
            )
        )
    else:
        cause = "the ranks ran different random ops here: " + "; ".join(
            f"{ranks_word(s.ranks)} ran {s.event.op} on {s.event.generator.label} at {s.event.site}"
            if s.event
            else f"{ranks_word(s.ranks)} {s.note}"
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
            f"the ranks ran {lead.op} at {lead.site} with different arguments"
            if extra_side is None and _same_call_site(sides)
            else f"the ranks ran different random ops: {_describe(ref)} but {_describe(odd)}"
        )
        + f" (random op #{lead.seq} on {ranks_word(who.ranks)})",
        op=lead.op,
        cause=cause,
        differs="op",
        ranks=tuple(domain),
        stack=lead.stack,
        other_stack=other.event.stack if other.event is not None else None,
        sides=sides,
        seq=lead.seq,
        culprits=culprits,
    )


def _call_cause(
    model: str, ev: RandomOpEvent, extra: tuple[int, ...], others: tuple[int, ...]
) -> str:
    """Some ranks sampled with generate() on a model no wrapper wraps where the others did not."""
    what = f"generate() of {model}, sampling (its first random op {ev.op} at {ev.site})"
    if len(extra) <= len(others):
        cause = (
            f"{ranks_word(extra)} called {what}, where {ranks_word(others)} did not sample "
            "(no call there, or one that drew nothing: greedy decoding)"
        )
    else:  # most ranks called it: the few did not
        cause = (
            f"{ranks_word(others)} did not sample (no call there, or one that drew nothing: "
            f"greedy decoding) where {ranks_word(extra)} called {what}"
        )
    return (
        cause + f" (control flow that depends on the rank): it moved {ev.generator.label} "
        f"on {ranks_word(extra)} alone ({model} is no data-parallel wrapper's module), so "
        "later draws from it that must agree across the ranks (a shuffle, an initialisation) "
        "differ. Sample on every rank, or "
        "put the generator back after sampling alone: with torch.random.fork_rng(), "
        'rngcheck.expect("ignore"): model.generate(...)'
    )


# (a divergence in arguments where no rank knows a data-parallel wrapper: per-rank batches
# through a model nothing wraps)
_UNWRAPPED = (
    ". No rank knows a data-parallel wrapper (torch's DDP, FSDP, fully_shard, DeepSpeed's "
    "engine): if this is a model meant to train data-parallel on each rank's own batch, nothing "
    "averages its gradients and each rank trains a model of its own (Hugging Face's Trainer "
    "leaves the model so when evaluate() or predict() ran before train(): see rngcheck's docs "
    "on data parallelism)"
)


def _in_a_module(event: RandomOpEvent) -> bool:
    """Whether the op ran inside a torch.nn.Module's call (a model's forward)."""
    return any(f.filename.replace("\\", "/").endswith(_MODULE_FILE) for f in event.stack.frames)


_MODULE_FILE = "/torch/nn/modules/module.py"


def _same_call_site(sides: Sequence[Side]) -> bool:
    """Every side drew from the same generator by the same op from the same line, with other
    arguments."""
    events = [s.event for s in sides]
    if any(e is None for e in events):
        return False
    calls = {(e.op, e.site, gen_key(e)) for e in events if e is not None}
    return len(calls) == 1 and len({e.args for e in events if e is not None}) > 1


def _seeded_alike(events: Iterable[RandomOpEvent | None]) -> bool:
    seeds = {e.seed if e is not None else None for e in events}
    return len(seeds) == 1 and None not in seeds


def _seeded_apart(sides: Sequence[Side]) -> str:
    """ ", seeded differently on each rank (...)" when the sides' generators were, else ""."""
    seeds = [(s.event.seed, s.ranks) for s in sides if s.event is not None]
    if len({seed for seed, _ in seeds}) < 2 or any(seed is None for seed, _ in seeds):
        return ""
    told = "; ".join(f"{seed} on {ranks_word(ranks)}" for seed, ranks in seeds)
    return f", seeded differently on each rank (initial seed {told})"


def _describe(side: Side) -> str:
    who = ranks_word(side.ranks)
    if side.event is None:
        return f"{who} {side.note}"
    return f"{who} ran {side.event.op} at {side.event.site}"


def _points_finding(details: dict[int, Detail], domain: tuple) -> Finding:
    groups = rank_groups({r: details[r].reached for r in domain})
    ordered, labels = _labels(groups, len(groups) - 1)
    sides = tuple(
        Side(label=label, ranks=g, note=f"reached {details[g[0]].point}")
        for label, g in zip(labels, ordered, strict=False)
    )
    return Finding(
        kind=FindingKind.RANK_DIVERGENCE,
        message="the ranks reached different exchange points after the same random ops: "
        + "; ".join(f"{ranks_word(s.ranks)} {s.note}" for s in sides),
        op="",
        cause=(
            "control flow differs across ranks between random ops (a different number of "
            "optimizer steps, collectives or check() calls); rngcheck stopped exchanging"
        ),
        differs="exchange point",
        ranks=tuple(domain),
        sides=sides,
    )


def _state_finding(
    events: dict[int, RandomOpEvent | None], details: dict[int, Detail], init: bool = False
) -> Finding:
    evs = {r: e for r, e in events.items() if e is not None}
    before_differs = len({e.before for e in evs.values()}) > 1
    groups = rank_groups({r: (e.before if before_differs else e.after) for r, e in evs.items()})
    calls = {g: seed_calls_of(details[g[0]], evs[g[0]]) for g in groups}
    seeds = {g: seed_text(details[g[0]], evs[g[0]]) for g in groups}

    def suspect(g: tuple[int, ...]) -> bool:  # did something change the generator here?
        return bool(seeds[g] or details[g[0]].uncompared)

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
    evidence = StateEvidence(before_differs, ref, odd, gen, seeds, details, calls, init)
    cause, culprits = state_cause(evidence, sides[2:])
    what = "before" if before_differs else "after"
    if len(sides) > 2 and all(len(s.ranks) == 1 for s in sides):
        apart = f"{ranks_word(sorted(evs))} each hold a different state"
    elif len(sides) > 2:  # every group named (in rank order after the reference), not two
        words = [ranks_word(g) for g in (ref.ranks, *sorted(s.ranks for s in sides[1:]))]
        apart = f"{'; '.join(words[:-1])} and {words[-1]} hold {len(sides)} different states"
    else:
        apart = f"{ranks_word(ref.ranks)} and {ranks_word(odd.ranks)} differ"
    return Finding(
        kind=FindingKind.RANK_DIVERGENCE,
        message=(
            f"ranks that must hold the same {gen} state do not: {apart} {what} {ev.op} at "
            f"{ev.site} (random op #{ev.seq})"
        ),
        op=ev.op,
        cause=cause,
        differs="state" if before_differs else "state after",
        ranks=tuple(sorted(evs)),
        stack=ev.stack,
        other_stack=ref.event.stack,
        sides=sides,
        seq=ev.seq,
        culprits=culprits,
    )


def _collision_finding(
    events: dict[int, RandomOpEvent | None], details: dict[int, Detail]
) -> Finding:
    evs = {r: e for r, e in events.items() if e is not None}
    groups = rank_groups({r: e.before for r, e in evs.items()})
    shared = [g for g in groups if len(g) > 1]
    sides = tuple(
        Side(label="share a state" if len(g) > 1 else "distinct", ranks=g, event=evs[g[0]])
        for g in groups
    )
    ev = evs[shared[0][0]]
    seeds = seed_text(details[shared[0][0]], ev)
    culprits = culprits_of(seed_calls_of(details[shared[0][0]], ev), shared[0]) if seeds else ()
    cause = (
        f"{ranks_word(shared[0])} hold the same {ev.generator.label} state under "
        "expect('differ'): the per-rank stream was not offset by rank"
    )
    if seeds:
        cause += f" ({seeds})"
    return Finding(
        kind=FindingKind.RANK_COLLISION,
        message=(
            f"{ranks_word(shared[0])} must draw different numbers but share the "
            f"{ev.generator.label} state before {ev.op} at {ev.site} (random op #{ev.seq})"
        ),
        op=ev.op,
        cause=cause,
        differs="state",
        ranks=tuple(sorted(evs)),
        stack=ev.stack,
        sides=sides,
        seq=ev.seq,
        culprits=culprits,
    )


def pass_order_finding(
    event: RandomOpEvent | None,
    order: Verdict,
    step: int,
    seeds: tuple[int, int],
    rank: int,
    ranks: tuple[int, ...],
) -> Finding:
    """level="step": the ranks drew the order of a pass over the data begun between samples,
    which the scope ``order`` says every rank walks, apart (passes.py): digests of its draws
    differ across the ranks. ``event``: this rank's first draw of that order (None when no
    longer kept); ``step``: the step the pass began at on this rank (or, without ``event``,
    the step that compared it); ``seeds``: the smallest and the largest initial seed of the
    first draw's generator across the ranks (``step_digest.seed_value``)."""
    gen = event.generator.label if event is not None else "its generator"
    what = order_what(order, gen)
    seeded = seeds_said(*seeds)
    if seeded:
        why = f"it is seeded differently on each rank ({seeded})"
    else:
        why = (
            "it differs across the ranks as the pass begins; the step level does not follow "
            "the random ops that moved it apart (a data-parallel forward's dropout over each "
            "rank's own batch shapes is the usual cause; the op level, RNGCHECK_LEVEL=op, names "
            "them)"
        )
    advice = order_advice(order, event if seeded else None)
    where = f" with {event.op} at {event.site}" if event is not None else ""
    return Finding(
        kind=FindingKind.RANK_DIVERGENCE,
        message=(
            f"the ranks drew the order of a pass over the data{where} from {gen} in different "
            f"states (the first batch of a pass begun by step {step}, checked op by op at the "
            "step level)"
        ),
        op=event.op if event is not None else "",
        cause=f"{what} Why {gen} differs: {why}. {advice}",
        differs="state",
        ranks=ranks,
        stack=event.stack if event is not None else Stack.empty(),
        sides=(Side(label="its first draw", ranks=(rank,), event=event),)
        if event is not None
        else (),
        seq=event.seq if event is not None else -1,
        first_step=step,
        last_step=step,
    )


def init_finding(finding: Finding, details: dict[int, Detail]) -> Finding:
    """A divergence among parameter initialisations, settled at the first step: the
    parameters are replicated, and nothing broadcast them."""
    wrappers = details[min(details)].wrappers
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


def replica_finding(
    members: tuple[int, ...],
    name: str,
    owner: str,
    digests: dict[int, int | None],
    details: dict[int, Detail],
) -> Finding:
    """A parameter said replicated over ``members`` (by ``owner``) holds different values on
    them at the settle point. The initialisations rngcheck recorded for it explain it when they
    drew from different states (the finding is then theirs, as an initialisation's); else the
    values came from somewhere no random op shows."""
    events = {r: details[r].event for r in members if r in details}
    drawn = {r: e for r, e in events.items() if e is not None}
    if len(drawn) == len(members) and len({e.before for e in drawn.values()}) > 1:
        found = _state_finding(dict(drawn), details, init=True)
        return init_finding(replace(found, ranks=members), details)
    groups = rank_groups({r: d if d is not None else -1 for r, d in digests.items()})
    ordered, labels = _labels(groups, len(groups) - 1)

    def said(digest: int | None) -> str:
        return "holds no such parameter" if digest is None else f"digest {digest & _U64:016x}"

    sides = tuple(
        Side(label=label, ranks=g, note=said(digests[g[0]]))
        for label, g in zip(labels, ordered, strict=False)
    )
    apart = " and ".join(ranks_word(s.ranks) for s in sides)
    return Finding(
        kind=FindingKind.RANK_DIVERGENCE,
        message=(
            f"replicated parameters differ across ranks: {name} holds different values on "
            f"{apart}, where {owner} says it is replicated over ranks {format_ranks(members)}"
        ),
        op="",
        cause=(
            "no random op rngcheck saw explains it (its initialisations drew alike, or none "
            "was drawn under the checker): it was loaded or changed on some ranks only (a "
            "checkpoint loaded on one rank, an in-place edit under a test of the rank), or "
            "initialised differently before the checker started. Load or change it alike on "
            "every rank, or broadcast it from one rank afterwards (DistributedDataParallel "
            "broadcasts its module's states when it is built, unless init_sync=False)"
        ),
        differs="parameter",
        ranks=members,
        sides=sides,
    )


def missing_finding(
    *,
    rank: int,
    domain: tuple[int, ...],
    arrived: tuple[int, ...],
    left: dict[int, str],
    number: int,
    here: str,
    sent_at: str,
    timeout: float,
    last: RandomOpEvent | None,
    stack: Stack,
    error: BaseException,
    closed: bool = False,
    waited: float | None = None,
    store: str = "",
) -> Finding:
    """A rank did not reach exchange ``number``: which ranks arrived (the store's notes), why the
    others left where they said so, and where this rank waited. ``closed``: a peer's connection
    closed (its process ended) after ``waited`` seconds, rather than the ``timeout`` running out;
    ``store``: why the store could not be read, if it could not."""
    missing = tuple(r for r in domain if r not in arrived)
    late = not missing  # everyone else also gave up here: this rank is the one that came late
    if late:
        missing = (rank,)
        arrived = tuple(r for r in domain if r != rank)
    cause = (
        "the missing rank(s) stopped running the code the others run: an early return "
        "or exception on that rank, a hang, a crash, or a different number of optimizer "
        "steps or collectives"
    )
    gone = {r: why for r, why in left.items() if r in missing}
    if gone:
        cause = "; ".join(
            f"rank {r} left the checked block early ({why})" for r, why in sorted(gone.items())
        )
    silent = tuple(r for r in missing if r not in gone)
    if closed and silent:  # its process ended, and said nothing of why where it could have
        cause = f"{cause}; " if gone else ""
        if store:
            cause += (
                f"the c10d store, where rank(s) {format_ranks(silent)} would have said why they "
                f"left, could not be read ({store}): its host, rank 0 or the launcher, may "
                "have ended too"
            )
        else:
            cause += (
                f"rank(s) {format_ranks(silent)} left no note on the c10d store, where a rank "
                "that ends by a Python exception leaves one: its process was killed (a signal "
                "such as SIGTERM or SIGKILL from a launcher or a scheduler, the kernel's OOM "
                "killer), left by os._exit, or crashed in native code; its own log says which"
            )
    cause += (
        ". rngcheck stopped exchanging so the program does not hang on it "
        f"({type(error).__name__}: {str(error).splitlines()[0][:160]})"
    )
    if closed:  # not a timeout: say what happened, and when
        after = f" {waited:.1f} s into the wait" if waited is not None and waited >= 0.1 else ""
        reached = (
            f"did not reach RNG exchange #{number}: the connection to a peer closed{after}, its "
            f"process ended (the timeout is {timeout:g} s)"
        )
    else:
        reached = f"did not reach RNG exchange #{number} within {timeout:g} s"
    message = (
        f"rank(s) {format_ranks(missing)} {reached}; rank(s) {format_ranks(arrived)} waited at "
        f"{here}"
    )
    if sent_at != here:
        message += f" (exchange #{number} was sent at {sent_at})"
    if late:
        message = (
            f"this rank ({rank}) reached RNG exchange #{number} at {sent_at} after "
            f"rank(s) {format_ranks(arrived)} had given up waiting ({timeout:g} s)"
        )
    return Finding(
        kind=FindingKind.RANK_MISSING,
        message=message,
        op=last.op if last is not None else "",
        cause=cause,
        differs="arrival",
        ranks=missing,
        stack=stack,
        sides=(
            Side(label="arrived", ranks=arrived, note=f"waited at {here}"),
            Side(label="missing", ranks=missing, note="did not reach the exchange"),
        ),
        seq=last.seq if last is not None else -1,
    )
