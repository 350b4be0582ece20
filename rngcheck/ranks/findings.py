"""Describing a cross-rank divergence: pure functions of the data every rank gathered after a
mismatch (each rank's window of rows, and the :class:`Detail` of its op at the divergent
position), so every rank builds the same finding and one of them draws it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ..core.comm_hooks import POWER_SGD
from ..core.events import RandomOpEvent, SeedCall
from ..core.findings import Finding, FindingKind, Side, format_ranks
from ..core.stacks import Stack
from .data_reading import SPLITS_A_DATASET
from .localise import Spot, extra_ops, in_order
from .protocol import PEERS, POLICY_CODE, Point, Row, gen_key, text_hash
from .step_digest import seeds_said

__all__ = [
    "Detail",
    "Uncompared",
    "DATA_PARALLEL_WHY",
    "DISPATCHED_WHY",
    "PIPELINE_ORDER",
    "PIPELINE_WHY",
    "STAGE_INIT_WHY",
    "GENERATE_WHY",
    "GATHERED_WHY",
    "JOIN_WHY",
    "SAMPLED_WHY",
    "OWN_ARGUMENTS_WHY",
    "OWN_COUNT_WHY",
    "SHARE_WHY",
    "build_finding",
    "count_key",
    "counts_may_apply",
    "data_parallel_drift",
    "init_finding",
    "missing_finding",
    "own_arguments",
    "own_count",
    "pass_order_finding",
    "per_rank_seeding",
    "point_text",
    "line_key",
    "reseeded_by_user",
]

_DATA_DIR = "/torch/utils/data/"


class Uncompared(NamedTuple):
    """Random ops a rank drew from a generator without comparing them, since its last checked op."""

    ops: int
    op: str  # the last of them
    site: str
    why: str  # "under expect('ignore')", "in the data-parallel forward/backward of ...", ...
    # Why the rank drew some of them alone, by design (reading every rank's batches for a
    # dispatcher, Rule 6; inside a ZeRO-3 GatheredParameters region broadcast by it), or "".
    read_alone: str = ""

    @property
    def reasons(self) -> str:
        """Why, in words: the last op's reason, and what the rank drew alone for, if other."""
        if self.read_alone and self.read_alone != self.why:
            return f"{self.why} or {self.read_alone}"
        return self.why


@dataclass(frozen=True, slots=True, kw_only=True)
class Detail:
    """What one rank tells the others about its op at the divergent position (gathered as JSON)."""

    event: RandomOpEvent | None  # None: this rank ran no random op there
    point: str  # where this rank joined the exchange, in words
    seed_calls: tuple[SeedCall, ...] = ()  # the user's seeding calls that reached the generator
    uncompared: Uncompared | None = None
    wrappers: tuple[str, ...] = ()  # the data-parallel wrappers this rank knows (labels)
    # How the ranks moved the op's generator apart ("the ranks drew different amounts from it in
    # the forward and backward of DDP over ranks 0-1 (...)"), if this rank compares that
    # generator by what runs only (Rule 2's wake, Rules 6 and 7, a resume); "" when it does not.
    drifted: str = ""
    # The sampler that splits among the ranks the order this op drew (Rule 5); "" when none.
    order: str = ""
    # Why this op was compared as the generate() call it began (Rule 8: SAMPLED_WHY and the
    # model), not as itself; "" for any other op.
    call: str = ""
    # Whether a data-parallel wrapper this rank knows has tensor-parallel peers (ranks that
    # compute on this rank's batch: what it draws for that batch must agree among them).
    peers: bool = False
    # Rule 9, counts: this rank's ops of this round that ran an op found at the divergent
    # position (on any rank), by ``count_key`` (op, generator, its seed and its line), each with
    # its positions in this rank's gathered window; and the key of this rank's op there ("").
    lines: dict[str, list[int]] = field(default_factory=dict)
    spot_line: str = ""
    spot_at: int = -1  # this rank's position at the divergence in its window (its end: no op)

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": self.event.to_dict() if self.event is not None else None,
            "point": self.point,
            "seed_calls": [c.to_dict() for c in self.seed_calls],
            "uncompared": list(self.uncompared) if self.uncompared is not None else None,
            "wrappers": list(self.wrappers),
            "drifted": self.drifted,
            "order": self.order,
            "call": self.call,
            "peers": self.peers,
            "lines": self.lines,
            "spot_line": self.spot_line,
            "spot_at": self.spot_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Detail:
        event, uncompared = data.get("event"), data.get("uncompared")
        return cls(
            event=RandomOpEvent.from_dict(event) if event else None,
            point=str(data["point"]),
            seed_calls=tuple(SeedCall.from_dict(c) for c in data.get("seed_calls", [])),
            uncompared=Uncompared(*uncompared) if uncompared else None,
            wrappers=tuple(data.get("wrappers", ())),
            drifted=str(data.get("drifted", "")),
            order=str(data.get("order", "")),
            call=str(data.get("call", "")),
            peers=bool(data.get("peers", False)),
            lines={str(k): [int(i) for i in v] for k, v in data.get("lines", {}).items()},
            spot_line=str(data.get("spot_line", "")),
            spot_at=int(data.get("spot_at", -1)),
        )


POINT_TEXT = {
    Point.RANDOM_OP: "a random op",
    Point.COLLECTIVE: "a collective",
    Point.OPTIMIZER_STEP: "an optimizer step",
    Point.EVERY: "the every-N-ops exchange",
    Point.CHECK: "mode.check()",
    Point.EXIT: "the end of the checked block",
    Point.JOIN: "torch's Join",
}


def point_text(point: Point, where: str, stack: Stack) -> str:
    """``collective c10d.allreduce_.default at train.py:50``: where a rank joined an exchange."""
    what = where or POINT_TEXT[point]
    if point is Point.COLLECTIVE:
        what = f"collective {where}"
    site = stack.call_site
    return f"{what} at {site.short_location}" if site is not None and site.user else what


def _groups(keys: dict[int, Any]) -> list[tuple[int, ...]]:
    """Ranks grouped by key, the largest group first (ties: the group with the lowest rank)."""
    by: dict[Any, list[int]] = {}
    for rank, key in sorted(keys.items()):
        by.setdefault(key, []).append(rank)
    return sorted((tuple(v) for v in by.values()), key=lambda g: (-len(g), g[0]))


def _ranks_word(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"


def build_finding(
    spot: Spot, windows: dict[int, list[Row]], details: dict[int, Detail], domain: tuple
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
    finding = _state_finding(events, details)
    if spot.policy == PEERS:  # (Rule 2: peers of a data-parallel forward, by their batch)
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
    groups = _groups(at)
    events = {r: details[r].event for r in domain}
    a, b = groups[0], groups[1]
    # Which side ran extra ops? The one that, after k ops of its own, runs what the other side
    # runs now (or runs on where the other side's window ended); the fewer extra ops, the likelier.
    ka, kb = extra_ops(windows[a[0]], i, at[b[0]]), extra_ops(windows[b[0]], i, at[a[0]])
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
        call = details[extra_side[0]].call
        if call:  # (Rule 8: the op stands for the call; the rest of what it drew is not compared)
            cause = _call_cause(call, ev, extra_side, others)
        elif details[extra_side[0]].order == SPLITS_A_DATASET:
            cause += (
                f". It was {SPLITS_A_DATASET}, drawn from {ev.generator.label} on some ranks "
                "only, which shifts every later random op from it there: split on every rank, "
                "or give random_split a generator of its own (generator=torch.Generator()"
                ".manual_seed(seed))"
            )
        elif reseeded_by_user(ev) and ev.out_of_band is not None:
            # (a rank that reseeds or restores alone: its next draw is compared, also at a line
            # whose draws are each rank's own, Rule 9, where the others' are not)
            cause += (
                f". On {_ranks_word(extra_side)} it comes right after "
                f"{ev.out_of_band.describe()}: a generator reseeded or restored on some ranks "
                "only draws apart from there; seed (or restore) it alike on every rank"
            )
        elif any(_DATA_DIR in f.filename for f in ev.stack.frames):
            cause += (
                ". It was drawn by a DataLoader iterator: iter(DataLoader) draws its base seed "
                "from the global generator, so iterating a loader on some ranks only shifts every "
                "later random op there; iterate it on every rank or give the DataLoader its own "
                "generator="
            )
        elif not ev.generator.is_default:
            short = ev.generator.label.split(" (")[0]  # "Generator #1": named in full above
            cause += f"; this advanced {short} on those ranks only"
    elif _same_call_site(sides):
        lead_event = sides[0].event
        assert lead_event is not None
        cause = (
            f"the ranks ran {lead_event.op} at {lead_event.site} with different arguments ("
            + "; ".join(
                f"{', '.join(s.event.args)} on {_ranks_word(s.ranks)}" for s in sides if s.event
            )
            + f"): arguments that depend on the rank or on its data, drawn from "
            f"{lead_event.generator.label}"
            + (
                ", seeded alike on every rank, so its states part here and every later draw "
                "from it differs across ranks. Draw per-rank work from a generator seeded per rank"
                if _seeded_alike(events.values())
                else ""
            )
            + (
                _UNWRAPPED
                if _in_a_module(lead_event) and not any(d.wrappers for d in details.values())
                else ""
            )
        )
    else:
        cause = "the ranks ran different random ops here: " + "; ".join(
            f"{_ranks_word(s.ranks)} ran {s.event.op} on {s.event.generator.label} at "
            f"{s.event.site}"
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
            f"the ranks ran {lead.op} at {lead.site} with different arguments"
            if extra_side is None and _same_call_site(sides)
            else f"the ranks ran different random ops: {_describe(ref)} but {_describe(odd)}"
        )
        + f" (random op #{lead.seq} on {_ranks_word(who.ranks)})",
        op=lead.op,
        cause=cause,
        differs="op",
        ranks=tuple(domain),
        stack=lead.stack,
        other_stack=other.event.stack if other.event is not None else None,
        sides=sides,
        seq=lead.seq,
    )


def _call_cause(
    call: str, ev: RandomOpEvent, extra: tuple[int, ...], others: tuple[int, ...]
) -> str:
    """Some ranks sampled with generate() on a model no wrapper wraps where the others did not."""
    model = call.removeprefix(SAMPLED_WHY)
    what = f"generate() of {model}, sampling (its first random op {ev.op} at {ev.site})"
    if len(extra) <= len(others):
        cause = (
            f"{_ranks_word(extra)} called {what}, where {_ranks_word(others)} did not sample "
            "(no call there, or one that drew nothing: greedy decoding)"
        )
    else:  # most ranks called it: the few did not
        cause = (
            f"{_ranks_word(others)} did not sample (no call there, or one that drew nothing: "
            f"greedy decoding) where {_ranks_word(extra)} called {what}"
        )
    return (
        cause + f" (control flow that depends on the rank): it moved {ev.generator.label} "
        f"on {_ranks_word(extra)} alone ({model} is no data-parallel wrapper's module), so "
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


def _describe(side: Side) -> str:
    who = _ranks_word(side.ranks)
    if side.event is None:
        return f"{who} {side.note}"
    return f"{who} ran {side.event.op} at {side.event.site}"


def _points_finding(details: dict[int, Detail], domain: tuple) -> Finding:
    groups = _groups({r: details[r].point.split(" at ")[0] for r in domain})
    ordered, labels = _labels(groups, len(groups) - 1)
    sides = tuple(
        Side(label=label, ranks=g, note=f"reached {details[g[0]].point}")
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


def _seed_text(detail: Detail, event: RandomOpEvent) -> str:
    if event.out_of_band is not None and event.out_of_band.user_calls:
        return event.out_of_band.describe()
    return "; ".join(c.text for c in detail.seed_calls)


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
                f"{_ranks_word(ranks)} drew {ignored.ops} random op(s) {ignored.reasons} from "
                f"{gen} since its last checked op (the last: {ignored.op} at {ignored.site})"
            )
        else:
            parts.append(f"{_ranks_word(ranks)} drew none")
    return (
        "; ".join(parts) + ". Those ops are not compared, but they still advance the generator "
        "the checked ops draw from: give them their own torch.Generator"
    )


@dataclass(frozen=True)
class _StateEvidence:
    """What a state divergence shows: the two sides, their seeding calls and uncompared ops."""

    before_differs: bool
    ref: Side
    odd: Side
    gen: str
    seeds: dict[tuple[int, ...], str]
    details: dict[int, Detail]

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


@dataclass(frozen=True)
class _StateCause:
    name: str
    when: Callable[[_StateEvidence], bool]
    says: Callable[[_StateEvidence], str]


def _drew_differently(e: _StateEvidence) -> str:
    if e.ref.event is None:
        return "the op itself drew differently"
    return (
        f"the op itself drew differently: arguments {', '.join(e.ref.event.args)} on "
        f"{_ranks_word(e.ref.ranks)} versus {', '.join(e.ev.args)} on {_ranks_word(e.odd.ranks)}"
    )


def _seeded_differently(e: _StateEvidence) -> str:
    return (
        f"the ranks seeded {e.gen} differently: {_ranks_word(e.ref.ranks)} {e.ref_seeds}; "
        f"{_ranks_word(e.odd.ranks)} {e.odd_seeds}. A seed that depends on the rank (seed + rank) "
        "before building a replicated model makes replicas differ; seed every rank alike, and "
        "scope per-rank streams with rngcheck.expect('differ')"
    )


def _splits_an_order(details: Mapping[int, Detail]) -> str:
    """The sampler that splits among the ranks the order drawn at the divergent op (Rule 5),
    as any rank says; "" when none."""
    return next((d.order for _, d in sorted(details.items()) if d.order), "")


def _split_order(e: _StateEvidence) -> str:
    order = _splits_an_order(e.details)
    drifted = next((d.drifted for _, d in sorted(e.details.items()) if d.drifted), "")
    ref = e.ref.event
    seed_alike = ""
    seeded = None  # a rank's draw, when the ranks seeded the generator differently
    if drifted:
        why = f"{drifted}, and it differs across ranks from there"
    elif ref is not None and None not in (ref.seed, e.ev.seed) and ref.seed != e.ev.seed:
        seeded = ref
        if order not in _ORDER_ADVICE:
            seed_alike = ", or seed that generator alike on every rank"
        why = (
            f"it is seeded differently on each rank (initial seed {ref.seed} on "
            f"{_ranks_word(e.ref.ranks)}, {e.ev.seed} on {_ranks_word(e.odd.ranks)})"
        )
    elif (moved := _moved_apart(e.details)) is not None:
        why = f"{moved[1]}, and it differs across ranks from there"
    else:
        why = next(c.says(e) for c in STATE_CAUSES[1:] if c.when(e))
    what = _order_what(order, e.gen)
    advice = _order_advice(order, seeded)
    return f"{what} Why {e.gen} differs: {why}. {advice}{seed_alike}"


def _order_what(order: str, gen: str) -> str:
    """What the sampler named ``order`` does with the order the ranks drew from ``gen`` apart."""
    if order.endswith(PIPELINE_ORDER):
        return _PIPELINE_SHUFFLE.format(order=order.removesuffix(PIPELINE_ORDER), gen=gen)
    return _ORDER_WHAT.get(order, _SPLITS_ORDER).format(order=order, gen=gen)


def _order_advice(order: str, seeded: RandomOpEvent | None) -> str:
    """How to draw the order ``order`` splits alike on every rank; ``seeded``: a rank's draw of
    it, when the ranks seeded its generator differently (under PyTorch Lightning, which makes
    the sampler with seed_everything's seed, that is where the seed came from)."""
    advice = _ORDER_ADVICE.get(order, _DRAW_ALIKE).replace("{order}", order)
    if order in (SPLITS_A_DATASET, POWER_SGD):  # (not a sampler Lightning made)
        return advice
    if seeded is not None and any(
        d in f.filename.replace("\\", "/") for f in seeded.stack.frames for d in _LIGHTNING_DIRS
    ):
        advice += f"; {_LIGHTNING_SEED}"
    return advice


# lightning (lightning.pytorch, lightning.fabric), and the standalone packages
_LIGHTNING_DIRS = ("/lightning/", "/pytorch_lightning/", "/lightning_fabric/")
_LIGHTNING_SEED = (
    "PyTorch Lightning makes the sampler with the seed seed_everything was given (its "
    "PL_GLOBAL_SEED): give seed_everything the same seed on every rank, and draw what must "
    "differ per rank (augmentation, noise) from a generator of its own seeded with the rank"
)


_SPLITS_ORDER = (
    "{order} splits one order of the dataset among the ranks, and the ranks drew that order "
    "from {gen} in different states: each rank takes its share of a different order, so this "
    "pass over the data gives some samples to two ranks and others to none."
)
_PIPELINE_SHUFFLE = (
    "{order} samples the dataset on every stage of a pipeline, and the stages must walk one "
    "order (the first stage reads the inputs, the last the labels), but the ranks drew this "
    "pass's order from {gen} in different states: the stages read different samples, so the "
    "loss pairs the outputs of one sample with the labels of another."
)
_STREAM = (
    "{order} has every rank iterate the whole stream and keep its share of each global batch, "
    "and the ranks drew from {gen} in different states while iterating it: a draw that decides "
    "the stream's order or content (a shuffle, a shuffle buffer, a mix of sources) gives each "
    "rank its share of a different stream, so this pass over the data gives some samples to "
    "two ranks and others to none."
)
_STREAM_ADVICE = (
    "Draw the dataset's randomness from a torch.Generator kept as its generator attribute, "
    "which {order} reseeds alike on every rank each pass when the dataset has no set_epoch of "
    "its own; or read the stream on one rank and broadcast the batches (accelerate's "
    "dispatch_batches=True, with batches of one size)"
)
_SPLIT_DATASET = (
    "{order} divides a dataset into parts (training and validation sets) by a permutation, and "
    "the ranks drew it from {gen} in different states: each rank holds out different samples "
    "and keeps a different training set. In data-parallel training the samples one rank "
    "validates on are trained on by another (validation no longer measures unseen data), and a "
    "sampler that divides the training set among the ranks divides a different set on each, so "
    "an epoch trains on some samples twice and on others never; ranks that share a batch "
    "(tensor or pipeline parallelism) read different data."
)
_POWER_SGD_WHAT = (
    "{order} compresses each gradient bucket by a sketch M Q of random values Q that every "
    "replica must draw alike (torch seeds them from PowerSGDState's random_seed for that), and "
    "the ranks drew them from {gen} in different states: the all-reduced sketch mixes a "
    "different random projection of each rank's gradient, so the mean gradient is projected "
    "onto another subspace than PowerSGD computes (at every compressed step with "
    "warm_start=False, at the first one with warm_start=True); the replicas stay equal and "
    "nothing fails, and training may converge worse."
)
_ORDER_WHAT = {  # what the sampler named does, when it is not splitting a sampler's order
    "accelerate's IterableDatasetShard": _STREAM,
    "transformers' IterableDatasetShard": _STREAM,
    SPLITS_A_DATASET: _SPLIT_DATASET,
    POWER_SGD: _POWER_SGD_WHAT,
}


def pass_order_finding(
    event: RandomOpEvent | None,
    order: str,
    step: int,
    seeds: tuple[int, int],
    rank: int,
    ranks: tuple[int, ...],
) -> Finding:
    """level="step": the ranks drew the order of a pass over the data begun between samples,
    which ``order`` splits among them, apart (passes.py): digests of its draws differ across the
    ranks. ``event``: this rank's first draw of that order (None when no longer kept);
    ``step``: the step the pass began at on this rank (or, without ``event``, the step that
    compared it); ``seeds``: the smallest and the largest initial seed of the first draw's
    generator across the ranks (``step_digest.seed_value``)."""
    gen = event.generator.label if event is not None else "its generator"
    what = _order_what(order, gen)
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
    advice = _order_advice(order, event if seeded else None)
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


_DRAW_ALIKE = (
    "Draw the order from a generator seeded alike on every rank and reseeded each epoch "
    "(torch.Generator().manual_seed(seed + epoch))"
)
_ORDER_ADVICE = {  # how to get a shared order from the sampler named
    "accelerate's BatchSamplerShard": (
        f"{_DRAW_ALIKE}; under Hugging Face's Trainer, a sampler made without a generator "
        "(group_by_length's) gets one that accelerate synchronises across the ranks each epoch "
        "with accelerator_config={'use_seedable_sampler': False}, and the default sampler "
        "draws alike when every rank is seeded alike (set_seed without device_specific, the "
        "same data_seed)"
    ),
    "torch's DistributedSampler": (
        "Give DistributedSampler the same seed= on every rank (it reseeds with seed + epoch itself)"
    ),
    "accelerate's IterableDatasetShard": _STREAM_ADVICE,
    "transformers' IterableDatasetShard": _STREAM_ADVICE,
    SPLITS_A_DATASET: (
        "Give random_split a generator seeded alike on every rank "
        "(generator=torch.Generator().manual_seed(seed)); where each rank splits a shard of "
        "its own on purpose, mark the split with rngcheck.expect('differ')"
    ),
    POWER_SGD: (
        "Give PowerSGDState the same random_seed on every rank (its default, 0, is the same), "
        "and restore the same state on every rank when resuming (the seeds above are the ones "
        "the hook drew from its own generator, which random_seed seeds)"
    ),
}


# Why ranks that must hold the same state do not: the first row whose condition holds wins.
STATE_CAUSES: tuple[_StateCause, ...] = (
    _StateCause(
        "an order split among the ranks",  # Rule 5
        lambda e: e.before_differs and bool(_splits_an_order(e.details)),
        _split_order,
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
    ),
    _StateCause(
        "uncompared ops moved the generator",
        lambda e: e.uncompared(e.odd) != e.uncompared(e.ref),
        lambda e: _ignored_text(e.details, e.odd.ranks, e.ref.ranks, e.gen),
    ),
    _StateCause(
        "changed outside a random op",
        lambda e: bool(e.odd_seeds),
        lambda e: f"{_ranks_word(e.odd.ranks)} changed {e.gen} outside a random op: {e.odd_seeds}",
    ),
    _StateCause(
        "changed out of band",
        lambda e: e.ev.out_of_band is not None,
        lambda e: (
            f"{_ranks_word(e.odd.ranks)}: {e.gen} "
            f"{e.ev.out_of_band.describe() if e.ev.out_of_band else ''}"
        ),
    ),
    _StateCause(
        "a user generator out of view",
        lambda e: not e.ev.generator.is_default,
        lambda e: (
            f"{e.gen} is in a different state on {_ranks_word(e.odd.ranks)}: it was seeded "
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


def _cause_row(evidence: _StateEvidence) -> _StateCause:
    return next(c for c in STATE_CAUSES if c.when(evidence))


def _state_cause(evidence: _StateEvidence, others: Sequence[Side]) -> str:
    """The cause, told of the divergent side; a cause told as what those ranks did also says
    which other sides (ranks in a third state or more) it fits, or what fits them instead."""
    row = _cause_row(evidence)
    text = row.says(evidence)
    if not others or not text.startswith(_ranks_word(evidence.odd.ranks)):
        return text  # (a cause of every rank's: a split, seeds, the op's own arguments)
    alike: list[int] = []
    apart: list[str] = []
    for side in others:
        other = _cause_row(replace(evidence, odd=side))
        if other is row:
            alike += side.ranks
        else:
            apart.append(f"on {_ranks_word(side.ranks)}, {other.name}")
    text = text.rstrip(".")
    if alike:
        text += f". The same on {_ranks_word(sorted(alike))}"
    if apart:
        told = "; ".join(apart)
        text += f". {told[0].upper()}{told[1:]}"
    return text


def _state_finding(events: dict[int, RandomOpEvent | None], details: dict[int, Detail]) -> Finding:
    evs = {r: e for r, e in events.items() if e is not None}
    before_differs = len({e.before for e in evs.values()}) > 1
    groups = _groups({r: (e.before if before_differs else e.after) for r, e in evs.items()})
    seeds = {g: _seed_text(details[g[0]], evs[g[0]]) for g in groups}

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
    evidence = _StateEvidence(before_differs, ref, odd, gen, seeds, details)
    cause = _state_cause(evidence, sides[2:])
    what = "before" if before_differs else "after"
    if len(sides) > 2 and all(len(s.ranks) == 1 for s in sides):
        apart = f"{_ranks_word(sorted(evs))} each hold a different state"
    elif len(sides) > 2:  # every group named (in rank order after the reference), not two
        words = [_ranks_word(g) for g in (ref.ranks, *sorted(s.ranks for s in sides[1:]))]
        apart = f"{'; '.join(words[:-1])} and {words[-1]} hold {len(sides)} different states"
    else:
        apart = f"{_ranks_word(ref.ranks)} and {_ranks_word(odd.ranks)} differ"
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
    )


def _collision_finding(
    events: dict[int, RandomOpEvent | None], details: dict[int, Detail]
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


def per_rank_seeding(spot: Spot, details: dict[int, Detail]) -> tuple[RandomOpEvent, str] | None:
    """When the ranks' states differ at ``spot`` because the generator was seeded differently on
    each rank (its initial seeds differ: ``torch.manual_seed(seed + rank)``, a per-rank
    ``torch.Generator``), that generator (one rank's event of it) and why, in words; else None.
    Not when some ranks reseeded it just before (a call the others did not make): that is a
    divergence, as when one rank restores its own state at a resume.

    Also when the ranks ran different ops there, all from that generator: a per-rank stream
    serves per-rank data (a crop drawn for each rank's own image size, more draws for a longer
    batch), and its states already differ from its first op."""
    if spot.kind not in ("state", "flow") or spot.policy != POLICY_CODE["same"]:
        return None
    if _splits_an_order(details):
        return None  # Rule 5: the ranks must draw the same order, seeded alike or not
    if spot.kind == "flow" and (
        any(d.event is None for d in details.values())
        or len({gen_key(d.event) for d in details.values() if d.event is not None}) > 1
    ):
        return None
    events = {r: d.event for r, d in details.items()}
    evs = {r: e for r, e in events.items() if e is not None}
    seeds = {r: e.seed for r, e in evs.items()}
    if len(evs) < 2 or None in seeds.values() or len(set(seeds.values())) < 2:
        return None
    if 0 < len([e for e in evs.values() if reseeded_by_user(e)]) < len(evs):
        return None  # some ranks reseeded it just now, the others did not: that is the bug
    by_seed = _groups(seeds)
    # Ranks seeded alike (seed + data-parallel rank under tensor parallelism) must still agree
    # there: if they do not, seeding does not explain the divergence.
    same = (lambda e: (e.op, e.args)) if spot.kind == "flow" else (lambda e: (e.before, e.after))
    if any(len({same(evs[r]) for r in g}) > 1 for g in by_seed):
        return None
    first = evs[min(evs)]
    how = "; ".join(f"{seeds[g[0]]} on {_ranks_word(g)}" for g in by_seed[:4])
    calls = {r: _seed_text(details[r], e) for r, e in evs.items()}
    sites = "; ".join(f"{_ranks_word((r,))}: {t}" for r, t in sorted(calls.items()) if t)
    why = f"{first.generator.short_label} is seeded differently on each rank (initial seed {how}"
    return first, why + (f"; {sites})" if sites else ")")


def reseeded_by_user(event: RandomOpEvent) -> bool:
    """The user's seeding call (or a reseed of a user generator) changed the generator since
    its last random op."""
    oob = event.out_of_band
    return oob is not None and bool(oob.user_calls or (oob.new_seed is not None and not oob.calls))


DATA_PARALLEL_WHY = "in the data-parallel forward/backward of "  # an Uncompared's why (Rule 2)
PIPELINE_WHY = "in the pipeline stages run by "  # ... Rule 2's, a pipeline schedule's step
# ... and Rule 5's, a shuffle every stage of a pipeline must walk alike (after the sampler's name)
PIPELINE_ORDER = " in a pipeline"
STAGE_INIT_WHY = "initialising a parameter of "  # ... Rule 4's, a pipeline stage's own layers
DISPATCHED_WHY = "reading every rank's batches alone for "  # ... and Rule 6's
GENERATE_WHY = "in generate() of the module wrapped by "  # ... Rule 2's, sampling
SHARE_WHY = "loading a rank's own share of the data split by "  # ... and Rule 7's
SAMPLED_WHY = "in a generate() call of "  # ... and Rule 8's (a model no wrapper wraps)
# ... and Rule 9's (followed by the line)
OWN_ARGUMENTS_WHY = "drawn with each rank's own arguments at "
OWN_COUNT_WHY = "drawn a number of times of each rank's own at "  # ... Rule 9's, counts
# ... and those drawn inside torch's Join once a rank has run out of inputs (followed by the Join)
JOIN_WHY = "after a rank had run out of inputs in "
# ... and ZeRO-3's GatheredParameters(modifier_rank=r) (followed by r, on every rank)
GATHERED_WHY = "inside a deepspeed GatheredParameters region broadcast by rank "


def data_parallel_drift(spot: Spot, details: dict[int, Detail]) -> tuple[RandomOpEvent, str] | None:
    """When the ranks' states differ at ``spot`` because the generator drew in a data-parallel
    forward or backward since its last compared op (Rule 2: each rank drew for its own batch,
    so per-rank shapes, variable-length batches under dropout, moved it apart), or as each
    rank loaded its own share of the data (Rule 7: a collator's masking over its own batch
    shapes), or while one rank read every rank's batches (Rule 6), or as every rank restored a
    state of its own (a resume), that generator (one rank's event of it) and how the ranks
    moved it apart ("the ranks drew different amounts from it in the forward and backward of
    ..."); else None. Not when a rank's op follows another seeding call of the user's: that is
    the divergence to report. A generator some rank found so before (``Detail.drifted``: its
    rows sent before every rank knew still carry states) is one too. Decided from the gathered
    details only, so every rank decides alike (P5)."""
    if spot.kind != "state" or spot.policy != POLICY_CODE["same"] or _splits_an_order(details):
        return None
    return _moved_apart(details)


def _moved_apart(details: dict[int, Detail]) -> tuple[RandomOpEvent, str] | None:
    """:func:`data_parallel_drift`'s answer from the gathered details alone (also for an order
    split among the ranks, which stays a divergence: this says why its generator differs)."""
    evs = {r: d.event for r, d in details.items() if d.event is not None}
    if len(evs) < 2 or len({gen_key(e) for e in evs.values()}) > 1:
        return None
    first = evs[min(evs)]
    restored = _restored_per_rank(evs, details)
    if restored:
        return first, restored
    if any(reseeded_by_user(e) for e in evs.values()):
        return None
    known = sorted(d.drifted for d in details.values() if d.drifted)
    if known:
        return first, known[0]
    joins = sorted(
        d.uncompared.why
        for d in details.values()
        if d.uncompared is not None and d.uncompared.why.startswith(JOIN_WHY)
    )
    if joins:  # some ranks ran iterations of their own in torch's Join: the surest cause
        return first, f"{_DREW_APART} {_own_batch(joins[0])}"
    forward = {  # rank -> how it drew for its own batch there (Rules 2 and 7), in words
        r: how
        for r, d in details.items()
        if d.uncompared is not None and (how := _own_batch(d.uncompared.why))
    }
    alone = {r: d.uncompared.read_alone for r, d in details.items() if d.uncompared is not None}
    readers = sorted(r for r, why in alone.items() if why)
    # A rank that read alone is the surer cause (its draws were its own, whatever the shapes),
    # when it explains every difference: the ranks that neither read nor drew in a forward
    # still agree among themselves.
    if (
        readers
        and len({e.before for r, e in evs.items() if r not in forward and r not in readers}) <= 1
    ):
        reader = readers[0]
        return first, f"{_DREW_APART} {_alone_phrase(reader, alone[reader])}"
    if not forward:
        return None
    return first, f"{_DREW_APART} {sorted(forward.values())[0]}"


_DREW_APART = "the ranks drew different amounts from it"

_LINE_FRAMES = 4  # the user's frames that tell one line of Rule 9 from another


def line_key(event: RandomOpEvent) -> tuple[tuple[str, int], ...]:
    """Where an op was drawn, for Rule 9: its innermost user frames (file and line), so a
    helper that draws for several callers is as many lines as it has callers."""
    return tuple((f.filename, f.lineno) for f in event.stack.user_frames[-_LINE_FRAMES:])


def own_arguments(spot: Spot, details: dict[int, Detail]) -> tuple[RandomOpEvent, str] | None:
    """Rule 9: when the ranks ran the same op at the same line on a device's default generator,
    seeded alike, with arguments of their own (noise over each rank's own batch shape: a
    diffusion model's aspect-ratio buckets, dynamic padding), in a data-parallel program whose
    ranks each compute on their own batch, that op (one rank's event of it) and how the ranks
    moved its generator apart, in words; else None. Each rank drew for its own batch there, as
    in a data-parallel forward (Rule 2). Not on a torch.Generator of the user's seeded alike (a
    stream made to agree), nor where a wrapper has tensor-parallel peers (they share a batch),
    an order split among the ranks (Rule 5), a generate() call (Rule 8), or after a user's
    seeding call on some rank. Decided from the gathered details only (P5)."""
    if spot.kind != "flow" or spot.policy != POLICY_CODE["same"] or _splits_an_order(details):
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
    groups = _groups({r: e.args for r, e in evs.items()})
    drawn = "; ".join(f"{', '.join(evs[g[0]].args)} on {_ranks_word(g)}" for g in groups)
    own = f"{first.op} with arguments of each rank's own ({drawn})"
    return first, f"{_DREW_APART} at {first.site}, {own}"


def count_key(event: RandomOpEvent, structure: int) -> str:
    """Rule 9, counts: an op as the ranks compare where each ran it (its row's ``structure``:
    op, generator and arguments; the generator's seed; its line, as :func:`line_key` reads it);
    "" for an op with no user frame (no line to tell)."""
    line = line_key(event)
    if not line or event.seed is None:
        return ""
    return f"{structure}:{event.seed}:{text_hash(*(f'{f}:{n}' for f, n in line))}"


def counts_may_apply(spot: Spot) -> bool:
    """Whether Rule 9's counts can explain a divergence of this kind: ops compared as "same"
    (or none, on some rank) that part in their order."""
    return spot.kind == "flow" and spot.policy in (0, POLICY_CODE["same"])


def own_count(spot: Spot, details: dict[int, Detail]) -> tuple[int, RandomOpEvent, str] | None:
    """Rule 9, counts: when, where the ranks part, a rank runs an op on a device's default
    generator, seeded alike, at a line where every other rank ran that op too, from the same
    seed, earlier in this round, fewer times than this rank has by then (a loop over each
    rank's own data: a crop drawn until one fits the rank's own image, jitter for each of its
    own boxes), in a data-parallel program whose ranks each compute on their own batch: that
    rank, its op and how the ranks moved its generator apart, in words; else None. The ranks ran
    that line different numbers of times, as they draw different amounts in a data-parallel
    forward (Rule 2). Ops the ranks ran in another order are no such loop, nor is a rank whose
    loop ran no time in the round. Not on a torch.Generator of the user's, nor where a wrapper
    has tensor-parallel peers, an order split among the ranks (Rule 5), a generate() call
    (Rule 8), or after a user's seeding call on any rank. Decided from the gathered details only
    (P5). (The spot's policy is 0 where a rank ran no op there; every op a rank keys by its
    line is one compared as "same".)"""
    if (
        not counts_may_apply(spot)
        or _splits_an_order(details)
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
            how = (
                f"{_DREW_APART} at {e.site}, {e.op}, which {_ranks_word([rank])} had run there "
                f"more times than {_ranks_word(sorted(others))} when they parted (a loop over "
                "each rank's own data)"
            )
            return rank, e, how
    return None


def _ran_before(detail: Detail, key: str, end: int) -> int:
    """How many times a rank ran the op ``key`` names before position ``end`` of its window."""
    return sum(1 for i in detail.lines.get(key, ()) if i < end)


def _alone_phrase(rank: int, why: str) -> str:
    """How ``rank`` drew alone, in words, from its uncompared ops' ``read_alone``."""
    if why.startswith(DISPATCHED_WHY):
        return f"while rank {rank} alone read every rank's batches for " + why.removeprefix(
            DISPATCHED_WHY
        )
    if why.startswith(GATHERED_WHY):
        return (
            f"while rank {rank} drew inside a deepspeed GatheredParameters region broadcast by it "
            "(ZeRO-3: the parameters it gathered are that rank's as it exits)"
        )
    return f"while rank {rank} drew {why}"


def _own_batch(why: str) -> str:
    """Where a rank drew for its own batch, in words, from an uncompared op's ``why`` (Rule 2,
    a data-parallel forward; Rule 7, loading its own share of the data); "" for any other."""
    if why.startswith(DATA_PARALLEL_WHY):
        wrapper = why.removeprefix(DATA_PARALLEL_WHY)
        return f"in the forward and backward of {wrapper} (each rank's own batch shapes)"
    if why.startswith(PIPELINE_WHY):
        schedule = why.removeprefix(PIPELINE_WHY)
        return f"in the pipeline stages {schedule} runs (each rank's own layers)"
    if why.startswith(STAGE_INIT_WHY):
        return f"initialising the parameters of {why.removeprefix(STAGE_INIT_WHY)} (its own)"
    if why.startswith(GENERATE_WHY):
        wrapper = why.removeprefix(GENERATE_WHY)
        return f"in generate() of the module {wrapper} wraps (each rank's own inputs)"
    if why.startswith(SAMPLED_WHY):
        model = why.removeprefix(SAMPLED_WHY)
        return f"in generate() of {model} (each rank's own inputs)"
    if why.startswith(SHARE_WHY):
        split = why.removeprefix(SHARE_WHY)
        return (
            f"while each loaded its own share of the data, split by {split} (a dataset's or "
            "collator's draws over each rank's own samples)"
        )
    if why.startswith(OWN_ARGUMENTS_WHY):
        return f"at {why.removeprefix(OWN_ARGUMENTS_WHY)}, with arguments of each rank's own"
    if why.startswith(OWN_COUNT_WHY):
        return f"at {why.removeprefix(OWN_COUNT_WHY)}, a number of times of each rank's own"
    if why.startswith(JOIN_WHY):
        return (
            f"in the iterations some ranks ran after another had run out of inputs in "
            f"{why.removeprefix(JOIN_WHY)} (uneven inputs: each rank runs its own number)"
        )
    return ""


def _restored_per_rank(evs: dict[int, RandomOpEvent], details: dict[int, Detail]) -> str:
    """When, in a data-parallel program, every rank restored a state of its own into the
    generator just before (a resume: Hugging Face's Trainer and accelerate's load_state load
    each rank's saved RNG state, which a data-parallel forward may have moved apart before the
    save), how, in words; else "". The restore is the last of the user's seeding calls that
    reached the generator since its last op, or, at its first op under the mode, since the mode
    started. Not when some ranks restored and others did not (one rank resuming from its own
    stale state is the bug), nor when the ranks restored by different calls or lines, nor after
    a seed (per-rank seeds are Rule 3's)."""
    if len(evs) < len(details) or not all(d.wrappers for d in details.values()):
        return ""
    last = {}
    for r, e in evs.items():
        calls = e.out_of_band.user_calls if e.out_of_band is not None else details[r].seed_calls
        if not calls or calls[-1].argument != "<state>":
            return ""
        last[r] = calls[-1]
    if len({(c.api, c.stack.describe()) for c in last.values()}) > 1:
        return ""
    call = last[min(last)]
    return (
        f"each rank restored a state of its own into it ({call.text}; a resume loads each "
        "rank's saved state)"
    )


def init_finding(finding: Finding, details: dict[int, Detail]) -> Finding:
    """A divergence among parameter initialisations, settled at the first step (Rule 4): the
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
) -> Finding:
    """A rank did not reach exchange ``number`` within ``timeout``: which ranks arrived (the
    store's notes), why the others left where they said so, and where this rank waited."""
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
    cause += (
        ". rngcheck stopped exchanging so the program does not hang on it "
        f"({type(error).__name__}: {str(error).splitlines()[0][:160]})"
    )
    message = (
        f"rank(s) {format_ranks(missing)} did not reach RNG exchange #{number} within "
        f"{timeout:g} s; rank(s) {format_ranks(arrived)} waited at {here}"
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
