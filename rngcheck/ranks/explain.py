"""The words of the cross-rank check, written from typed evidence: what a reason means for a draw,
how the ranks moved a generator apart, what was left uncompared (the report's notes), what an
order's sampler does with the order and how to draw it alike, and what a coverage gap costs.
Tables keyed by :class:`~rngcheck.ranks.verdict.Reason`; an integration's own words (its
``what`` and ``advice``) are filled in from its hook. Nothing is parsed back from text."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..core.events import RandomOpEvent
from ..core.findings import Note, format_ranks
from .detail import OnMesh, Seeded, Uncompared
from .integrations import hook_of, registered
from .integrations.records import Hook, Integration
from .verdict import LEARNT, Apart, Compare, Domain, Reason, Verdict

__all__ = [
    "DRAW_ALIKE",
    "DREW_APART",
    "alone_phrase",
    "apart_note",
    "apart_text",
    "coverage_text",
    "exempted_note",
    "learnt_marker",
    "mesh_text",
    "order_advice",
    "order_what",
    "own_draws",
    "per_rank_note",
    "rank_notes",
    "ranks_word",
    "reason_phrase",
    "seeded_text",
    "sketch_note",
    "uncompared_reasons",
]

DREW_APART = "the ranks drew different amounts from it"
DRAW_ALIKE = (
    "Draw the order from a generator seeded alike on every rank and reseeded each epoch "
    "(torch.Generator().manual_seed(seed + epoch))"
)


def ranks_word(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"


# -- a reason, as the words of an uncompared op's ``why`` ----------------------------------------

_WHY: dict[Reason, Callable[[Verdict], str]] = {
    Reason.IGNORED: lambda v: "under expect('ignore')",
    Reason.OWN_BATCH: lambda v: f"in the data-parallel forward/backward of {v.subject}",
    Reason.OWN_LAYERS: lambda v: f"in the pipeline stages run by {v.subject}",
    Reason.STAGE_INIT: lambda v: f"initialising a parameter of {v.subject}",
    Reason.READ_ALONE: lambda v: f"reading every rank's batches alone for {v.subject}",
    Reason.OWN_SAMPLES: lambda v: f"in generate() of the module wrapped by {v.subject}",
    Reason.OWN_SHARE: lambda v: f"loading a rank's own share of the data split by {v.subject}",
    Reason.SAMPLING: lambda v: f"in a generate() call of {v.subject}",
    Reason.OWN_ARGUMENTS: lambda v: f"drawn with each rank's own arguments at {v.subject}",
    Reason.OWN_COUNT: lambda v: f"drawn a number of times of each rank's own at {v.subject}",
    Reason.JOIN: lambda v: f"after a rank had run out of inputs in {v.subject}",
    Reason.BROADCAST: lambda v: f"inside a {v.subject} region broadcast by rank {v.rank}",
    Reason.PER_RANK_SEED: lambda v: "on a per-rank stream",
}


def reason_phrase(verdict: Verdict) -> str:
    """Why an op was not compared, in words ("in the data-parallel forward/backward of ...")."""
    say = _WHY.get(verdict.reason)
    return say(verdict) if say is not None else verdict.reason.value


def uncompared_reasons(uncompared: Uncompared) -> str:
    """Why, in words: the last op's reason, and what the rank drew alone for, if other."""
    why = reason_phrase(uncompared.why)
    if uncompared.alone is not None:
        alone = reason_phrase(uncompared.alone)
        if alone != why:
            return f"{why} or {alone}"
    return why


def mesh_text(mesh: OnMesh) -> str:
    """Why the ranks of a DTensor op's mesh must agree: the mesh and the op's placements."""
    ranks = ranks_word(mesh.ranks)
    shape = "x".join(map(str, mesh.shape)) + " " if len(mesh.shape) > 1 else ""
    dims = ""
    if mesh.dims:
        word = "dimensions" if len(mesh.dims) > 1 else "dimension"
        dims = f" ({word} {', '.join(repr(d) for d in mesh.dims)})"
    return (
        f"The op ran on a DTensor placed [{', '.join(mesh.placements)}] over a {shape}DeviceMesh"
        f"{dims} of {ranks}: DTensor's contract is that every rank of the mesh holds the same "
        "generator state before and after each random op (with its RNG tracker, DTensor gives "
        f"each shard its own numbers from that one state), so {ranks} must agree here"
    )


# -- where a rank drew for its own batch, and how the ranks moved a generator apart ---------------

_OWN: dict[Reason, Callable[[Verdict], str]] = {
    Reason.OWN_BATCH: lambda v: (
        f"in the forward and backward of {v.subject} (each rank's own batch shapes)"
    ),
    Reason.OWN_LAYERS: lambda v: (
        f"in the pipeline stages {v.subject} runs (each rank's own layers)"
    ),
    Reason.STAGE_INIT: lambda v: f"initialising the parameters of {v.subject} (its own)",
    Reason.OWN_SAMPLES: lambda v: (
        f"in generate() of the module {v.subject} wraps (each rank's own inputs)"
    ),
    Reason.SAMPLING: lambda v: f"in generate() of {v.subject} (each rank's own inputs)",
    Reason.OWN_SHARE: lambda v: (
        f"while each loaded its own share of the data, split by {v.subject} (a dataset's or "
        "collator's draws over each rank's own samples)"
    ),
    Reason.OWN_ARGUMENTS: lambda v: f"at {v.subject}, with arguments of each rank's own",
    Reason.OWN_COUNT: lambda v: f"at {v.subject}, a number of times of each rank's own",
    Reason.JOIN: lambda v: (
        f"in the iterations some ranks ran after another had run out of inputs in {v.subject} "
        "(uneven inputs: each rank runs its own number)"
    ),
}
# The reasons whose uncompared draws are each rank's own, over its own batch, layers or inputs.
OWN_REASONS = frozenset(_OWN)


def own_draws(verdict: Verdict) -> str:
    """Where a rank drew for its own batch, in words; "" for a reason that is not such a place."""
    say = _OWN.get(verdict.reason)
    return say(verdict) if say is not None else ""


def alone_phrase(rank: int, verdict: Verdict) -> str:
    """How ``rank`` drew alone, in words."""
    if verdict.reason is Reason.READ_ALONE:
        return f"while rank {rank} alone read every rank's batches for {verdict.subject}"
    if verdict.reason is Reason.BROADCAST:
        alone = _hook_text(verdict.source, "alone")
        return f"while rank {rank} drew inside a {verdict.subject} region broadcast by it {alone}"
    return f"while rank {rank} drew {reason_phrase(verdict)}"


def apart_text(apart: Apart) -> str:
    """How the ranks moved a generator apart ("the ranks drew different amounts from it in the
    forward and backward of ...")."""
    if apart.reason is None:
        return (
            f"each rank restored a state of its own into it ({apart.call}; a resume loads each "
            "rank's saved state)"
        )
    verdict = Verdict(
        Domain.RANK, Compare.NONE, apart.reason, apart.subject, apart.source, rank=apart.rank
    )
    if apart.reason in (Reason.READ_ALONE, Reason.BROADCAST):
        return f"{DREW_APART} {alone_phrase(apart.rank, verdict)}"
    if apart.reason is Reason.OWN_ARGUMENTS:
        drawn = "; ".join(f"{args} on {ranks_word(ranks)}" for args, ranks in apart.args)
        return (
            f"{DREW_APART} at {apart.site}, {apart.op} with arguments of each rank's own ({drawn})"
        )
    if apart.reason is Reason.OWN_COUNT:
        return (
            f"{DREW_APART} at {apart.site}, {apart.op}, which {ranks_word([apart.rank])} had run "
            f"there more times than {ranks_word(sorted(apart.others))} when they parted (a loop "
            "over each rank's own data)"
        )
    return f"{DREW_APART} {own_draws(verdict)}"


def seeded_text(seeded: Seeded) -> str:
    """A generator seeded differently on each rank, with its seeds and seeding calls."""
    how = "; ".join(f"{seed} on {ranks_word(ranks)}" for seed, ranks in seeded.seeds)
    sites = "; ".join(f"{ranks_word((rank,))}: {text}" for rank, text in seeded.calls)
    why = f"{seeded.label} is seeded differently on each rank (initial seed {how}"
    return why + (f"; {sites})" if sites else ")")


# -- notes: what was left uncompared, and why ------------------------------------------------------

_NOTE: dict[Reason, Callable[[Any], str]] = {
    Reason.OWN_BATCH: lambda e: (
        f"random op(s) in the forward and backward of {e.subject} (data-parallel: each rank "
        "draws for its own batch)."
    ),
    Reason.OWN_LAYERS: lambda e: (
        f"random op(s) in the pipeline stages {e.subject} runs (its stages' forwards and "
        "backwards: each rank runs its own layers)."
    ),
    Reason.OWN_SAMPLES: lambda e: (
        f"random op(s) in generate() of the module {e.subject} wraps (data-parallel: each rank "
        "samples for its own inputs)."
    ),
    Reason.SAMPLING: lambda e: (
        f"random op(s) in generate() of {e.subject}, which no data-parallel wrapper wraps: each "
        "rank samples for its own inputs (its calls are compared across the ranks, one for one, "
        "with the state each starts from)."
    ),
    Reason.STAGE_INIT: lambda e: (
        f"parameter initialisation(s) of {e.subject}, this rank's own layers (each rank "
        "initialises the stages it holds)."
    ),
    Reason.READ_ALONE: lambda e: (
        f"random op(s) rank {e.rank} drew alone, reading every rank's batches for {e.subject} "
        "(the other ranks receive the batches by broadcast)."
    ),
    Reason.BROADCAST: lambda e: (
        f"random op(s) drawn inside a {e.subject} region broadcast by rank {e.rank}: "
        f"{_hook_text(e.source, 'what').format(rank=e.rank)}."
    ),
    Reason.OWN_SHARE: lambda e: (
        f"random op(s) drawn while loading rank {e.rank}'s own share of the data, split among "
        f"the ranks by {e.subject} (a dataset's or collator's draws for the rank's own samples: "
        "each rank draws for its own batch)."
    ),
    Reason.JOIN: lambda e: (
        f"random op(s) drawn in {e.subject} from the last iteration every rank ran together, as "
        "a rank ran out of inputs (uneven inputs: from there each rank runs its own number of "
        "iterations, until every rank has)."
    ),
    Reason.OWN_COUNT: lambda e: (
        f"random op(s) drawn at {e.subject} from a default generator a number of times of each "
        "rank's own (the ranks looped there over their own data, in a data-parallel program: "
        "each rank draws for its own batch)."
    ),
    Reason.OWN_ARGUMENTS: lambda e: (
        f"random op(s) drawn at {e.subject} from a default generator with arguments of each "
        "rank's own (the ranks drew there for their own batch shapes, in a data-parallel "
        "program: each rank draws for its own batch)."
    ),
}
_AMONG_PEERS = (
    "random op(s) of the module {subject} wraps (its forward, backward and generate()) across "
    "its ranks, each drawing for its own batch; compared only among the ranks that share this "
    "rank's batch (its tensor-parallel peers)."
)
# The order the notes come in (the reasons' own order, peers after their wrapper's batch).
_NOTE_ORDER = (
    Reason.OWN_BATCH,
    Reason.OWN_LAYERS,
    "among",
    Reason.OWN_SAMPLES,
    Reason.SAMPLING,
    Reason.STAGE_INIT,
    "broadcast_inits",
    Reason.READ_ALONE,
    Reason.BROADCAST,
    Reason.OWN_SHARE,
    Reason.JOIN,
    Reason.OWN_COUNT,
    Reason.OWN_ARGUMENTS,
)
_LEARNT = (
    " Learnt from the ranks' draws, not declared: with strict=True (RNGCHECK_STRICT=1) such a "
    "difference is reported instead."
)


def learnt_marker(reason: Reason | None) -> str:
    return _LEARNT if reason in LEARNT else ""


def note_rank(key: Any) -> int:
    """Where a note of ``exempted``'s key goes among the others (_NOTE_ORDER)."""
    if key.among:
        return _NOTE_ORDER.index("among")
    return _NOTE_ORDER.index(key.reason) if key.reason in _NOTE_ORDER else len(_NOTE_ORDER)


def exempted_note(key: Any, count: int) -> Note | None:
    """The note for ``count`` random ops a scope left uncompared (a ``scopes.Exempt`` key); None
    for what has a note of its own (a per-rank stream's) or needs none (``expect("ignore")``)."""
    say = _NOTE.get(key.reason)
    if key.among:
        text = _AMONG_PEERS.format(subject=key.subject)
    elif say is not None:
        text = say(key)
    else:
        return None
    kind = "learnt" if key.reason in LEARNT else "not_compared"
    return Note(
        kind=kind,
        message=f"not compared: {count} {text}{learnt_marker(key.reason)}",
        count=count,
    )


def counted(kind: str, count: int, text: str) -> Note:
    """A note "not compared: N " followed by ``text``."""
    return Note(kind=kind, message=f"not compared: {count} {text}", count=count)


def apart_note(generator: str, apart: Apart) -> Note:
    """A generator compared by what runs from where the ranks moved it apart."""
    return Note(
        kind="learnt" if apart.reason in LEARNT else "not_compared",
        message=f"not compared by state: {generator} after {apart_text(apart)}; its later random "
        "ops are compared by what runs, until it is reseeded. It differs across ranks from "
        "there: draw replicated decisions (a shuffle, a sampled task) from a generator of their "
        f"own.{learnt_marker(apart.reason)}",
    )


def per_rank_note(seeded: Seeded, programs: Iterable[str]) -> Note:
    """A generator learnt to be a per-rank stream."""
    return Note(
        kind="learnt",
        message=f"not compared: {seeded_text(seeded)}, in a data-parallel program "
        f"({'; '.join(programs)}): a per-rank stream (seed + rank, per-rank data "
        f"generators).{_LEARNT}",
    )


# -- an order every rank must walk alike -----------------------------------------------------------

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


def order_what(order: Verdict, gen: str) -> str:
    """What the code named by ``order`` does with the order the ranks drew from ``gen`` apart."""
    if order.reason is Reason.STAGE_ORDER:
        return _PIPELINE_SHUFFLE.format(order=order.subject, gen=gen)
    template = _hook_text(order.source, "what") or _SPLITS_ORDER
    return template.format(order=order.subject, gen=gen)


def has_advice(order: Verdict) -> bool:
    """Whether the order's own hook says how to draw it alike."""
    return order.reason is not Reason.STAGE_ORDER and bool(_hook_text(order.source, "advice"))


def order_advice(order: Verdict, seeded: RandomOpEvent | None) -> str:
    """How to draw the order alike on every rank; ``seeded``: a rank's draw of it, when the ranks
    seeded its generator differently (a library that seeds its sampler itself adds a hint,
    when the draw's stack passes through it)."""
    own = "" if order.reason is Reason.STAGE_ORDER else _hook_text(order.source, "advice")
    advice = (own or DRAW_ALIKE).replace("{alike}", DRAW_ALIKE).replace("{order}", order.subject)
    if seeded is None or order.reason not in (Reason.ORDER, Reason.STAGE_ORDER):
        return advice
    files = [f.filename.replace("\\", "/") for f in seeded.stack.frames]
    for integration in registered():
        for hint in integration.hints:
            if any(p in f for f in files for p in hint.paths):
                advice += f"; {hint.text}"
    return advice


def _hook_text(source: str, field: str) -> str:
    hook = hook_of(source) if source else None
    return str(getattr(hook, field, "") or "")


# -- coverage -------------------------------------------------------------------------------------

_LOST: Mapping[str, str] = {
    "WrapperInit": "what the wrapper broadcasts as it is built is not known: its parameters' "
    "initialisations are compared as if nothing broadcast them",
    "WrapperForward": "its forward's and backward's draws are compared as replicated, not as each "
    "rank's own (a false finding where the ranks' batches differ)",
    "WrapperBroadcast": "what it broadcasts is not known: the parameters' initialisations are "
    "compared as if nothing broadcast them",
    "ParameterBroadcast": "the broadcast of each parameter is not known: their initialisations are "
    "compared",
    "StageInit": "a pipeline stage's parameters are not known as its rank's own",
    "Generate": "generate()'s draws are compared op by op, not as each rank's own sampling",
    "BroadcastRegion": "what one rank draws inside it is compared across the ranks",
    "JoinContext": "uneven inputs are not followed: its iterations are compared as any others",
    "Frames": "what is drawn while it runs is compared as any draw, without its scope",
}


def coverage_text(integration: Integration, hook: Hook, version: str, why: str) -> str:
    """What a hook the installed library does not allow costs, in words (a report note)."""
    label = f" ({hook.label})" if hook.label else ""
    return (
        f"rngcheck's {integration.name} integration hooks {hook.module}.{hook.attribute}{label}, "
        f"which {integration.package} {version} does not allow: {why}. So "
        f"{_LOST[type(hook).__name__]}"
    )


def sketch_note(hook: Any, count: int) -> Note:
    """Random ops a communication hook drew in backward (a ``Frames`` hook of the SKETCH role):
    randomness that belongs there, not a recompute."""
    fork = ", in a fork of the generator that the hook restores" if hook.forks else ""
    return Note(
        kind="comm_hook_random_ops",
        message=f"{count} random op(s) in backward were drawn by {hook.label}: its random "
        f"sketches of the gradients{fork} (randomness that belongs in backward; across the "
        "ranks, where the wrapper spans them, every replica must draw it alike).",
        count=count,
    )


def rank_notes(
    *,
    exempted: Mapping[Any, int],
    broadcast: Mapping[str, int],
    replaced: int,
    noted: Iterable[tuple[str, Apart]],
    per_rank: Iterable[Seeded],
    wrappers: Sequence[str],
    passes_apart: int,
    steps_apart: tuple[int, int] | None,
    steps_per_round: int,
) -> list[Note]:
    """The rank checker's notes for the report: what was left uncompared, and why."""
    out: list[Note] = []
    if passes_apart:
        out.append(
            counted(
                "not_compared",
                passes_apart,
                f"round(s) of {steps_per_round} steps through whose second half the ranks had "
                "begun different numbers of passes over the data (a DataLoader over a sampler "
                "that splits its order among the ranks, iterated on some ranks only): the "
                "orders of the passes begun then are not compared, those after each such "
                "round again.",
            )
        )
    notes = [
        (note_rank(key), note)
        for key, count in exempted.items()
        if (note := exempted_note(key, count)) is not None
    ]
    at = _NOTE_ORDER.index("broadcast_inits")
    notes += [
        (
            at,
            counted(
                "not_compared",
                count,
                f"parameter initialisation(s); {label} broadcast the module's states from one "
                "rank when it was built.",
            ),
        )
        for label, count in broadcast.items()
    ]
    out += [note for _, note in sorted(notes, key=lambda n: n[0])]
    out += [apart_note(label, how) for label, how in noted]
    if steps_apart is not None:
        out.append(
            Note(
                kind="not_compared",
                message=f"not compared: the generators' digests at the step level, from the "
                f"round of {steps_per_round} steps that found the ranks counting different "
                f"numbers of training steps ({steps_apart[0]} to {steps_apart[1]} exchanged: "
                "some rank stepped its optimizer more often than another) to the end of "
                "the block, where their steps no longer pair.",
            )
        )
    if replaced:
        out.append(
            counted(
                "not_compared",
                replaced,
                "parameter initialisation(s) of parameters that no longer existed at the first "
                "step (replaced before training, as weight tying does).",
            )
        )
    if wrappers:
        out += [per_rank_note(seeded, wrappers) for seeded in per_rank]
    return out
