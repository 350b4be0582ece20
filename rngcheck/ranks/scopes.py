"""The judge: one random op in, its :class:`~rngcheck.ranks.verdict.Verdict` out.

**A random draw must agree across exactly the ranks over which the state it feeds is
replicated.** Every verdict is a scope: a domain (which ranks must agree) and a comparison. Where
scopes come from, and which wins:

1. *Declared*: the user's ``rngcheck.expect(...)`` (``"ignore"`` first), and torch's contract
   for a DTensor op (every rank of its mesh holds one state). A declaration wins over every
   scope below; a DTensor op inside a data-parallel forward whose tensor-parallel peers hold
   its mesh is compared among those peers (they share the batch).
2. *Integrations* (``integrations/``): what a library's code says the draw feeds. Scopes nest
   and the innermost wins, with one rule that follows from the principle: a scope that ends in
   a broadcast from one rank (accelerate's dispatcher reading every rank's batches, ZeRO-3's
   ``GatheredParameters``) covers everything nested in it, since what is drawn there reaches the
   other ranks only through that broadcast. Call scopes (a wrapper's forward, ``generate()``)
   are known on this thread's stack without a walk; frame scopes (a sampler's iteration, a
   fetch, a communication hook) by a walk of the live frames, made only where one could apply
   (none of the registered ones runs inside a wrapper's forward). A wrapper's scope carries
   into its backward, until the optimizer step, where only a frame scope inside it (a
   communication hook's sketch) is looked for.
3. *Learnt* from a mismatch (``generators.py``): a generator seeded per rank in a data-parallel
   program, a line that draws with each rank's own arguments or counts. Marked as learnt in the
   notes; ``strict=True`` turns learning off.
4. *Default*: the mode's group (or the expectation's), by state.

What a scope leaves uncompared across the group is counted, by reason and subject, for the
report's notes (``exempted``); the generators it moved apart are the business of
``generators.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import torch

from ..core.events import BACKWARD, FORWARD, RandomOpEvent
from ..core.policy import current_expectation
from .generators import GeneratorStates
from .groups import GroupResolver
from .hooks import frame_codes
from .integrations import registered
from .integrations.common import Unreadable
from .integrations.records import Frames, Role, ShareSplit, Wrapper
from .program import Program
from .protocol import text_hash
from .replicated import Initialisations
from .verdict import Compare, Domain, Reason, Verdict

__all__ = ["NOT_READING", "Exempt", "Judge", "Reading", "reading", "sketch"]

_MAX_DEPTH = 256  # frames walked at most (a sampler iterates a few frames above the op)
_SKETCH_DEPTH = 64  # ... for a communication hook, a few frames above the op's dispatch
_SAMPLER_DEPTH = 6  # samplers followed at most from a loader (batch sampler, skip, shard, ...)

IGNORED = Verdict(Domain.RANK, Compare.NONE, Reason.IGNORED)


class Exempt(NamedTuple):
    """What left random ops uncompared across the group (a key of ``Judge.exempted``): the
    reason, its subject and hook, the rank that drew them alone (or whose share it read), and
    whether they were compared among tensor-parallel peers instead."""

    reason: Reason
    subject: str
    source: str = ""
    rank: int = -1
    among: bool = False


class Reading(NamedTuple):
    """What reads the data a random op draws for (a walk of the live frames)."""

    order: Frames | None = None  # the code iterating an order split among the ranks
    reader: Frames | None = None  # the code reading on this rank every rank's batches
    share: str = ""  # what splits among the ranks the data fetched here for this rank
    shuffle: Frames | None = None  # the sampler drawing this rank's order of the whole dataset


NOT_READING = Reading()

# A read of a library object failed (an attribute a version renamed): the hook, and why.
ReadGap = Callable[[Frames, str], None]


def reading(skip: int = 0, on_gap: ReadGap | None = None) -> Reading:
    """What reads the data the caller is drawing for on this thread: the sampler that splits
    among the ranks the order being drawn (not one drawing with replacement below it), the
    reader this rank reads every rank's batches for (it covers what runs below it), and what
    splits among the ranks the data a DataLoader is fetching for this rank. A walk of the live
    frames, about 0.2 us a frame."""
    known = frame_codes()
    frame: FrameType | None = sys._getframe(skip + 1)
    depth = 0
    inner: list[FrameType] = []  # the samplers' __iter__ frames below the order's
    order: Frames | None = None
    ordered = False  # the innermost order was met (None above: one with replacement below)
    fetching = False  # a fetcher's frame is below: the op draws for a batch being read
    share = ""
    shuffle: Frames | None = None
    below: FrameType | None = None  # the frame the current one called
    try:
        while frame is not None and depth < _MAX_DEPTH:
            code = frame.f_code
            hook = known.get(id(code))
            if hook is not None:
                role = hook.role
                if role is Role.READER:  # one rank reads for all, whatever splits below it
                    return Reading(reader=hook)
                if role is Role.ORDER:
                    if not ordered:
                        ordered = True
                        order = None if any(_with_replacement(f) for f in inner) else hook
                elif role is Role.SAMPLER:
                    if not ordered:
                        inner.append(frame)  # (under an order: with replacement or not)
                        shuffle = shuffle or hook
                elif role is Role.FETCH:
                    # (an order drawn in the stream under it is an order; a stream's draw is
                    # not this rank's own: a stream may shuffle before it splits itself)
                    fetching = not ordered and not _iterating(hook, frame, below)
                elif role is Role.LOADER and fetching and not share:
                    share = _split_of(hook, frame.f_locals.get("self"))
            elif not ordered and code.co_name == "__iter__":
                inner.append(frame)
            below, frame = frame, frame.f_back
            depth += 1
    except Unreadable as e:
        if on_gap is not None and hook is not None:
            on_gap(hook, str(e))
        return NOT_READING
    if order is not None or share or shuffle is not None:
        return Reading(order=order, share=share, shuffle=shuffle)
    return NOT_READING


def sketch(skip: int = 0) -> Frames | None:
    """The communication hook whose randomness the caller draws on this thread, or None."""
    known = frame_codes()
    if not known:
        return None
    frame: FrameType | None = sys._getframe(skip + 1)
    depth = 0
    while frame is not None and depth < _SKETCH_DEPTH:
        hook = known.get(id(frame.f_code))
        if hook is not None and hook.role is Role.SKETCH:
            return hook
        frame = frame.f_back
        depth += 1
    return None


def _with_replacement(frame: FrameType) -> bool:
    return getattr(frame.f_locals.get("self"), "replacement", False) is True


def _iterating(hook: Frames, fetch: FrameType, callee: FrameType | None) -> bool:
    """Whether an iterable-style fetcher's frame is running its dataset's iterator (``callee``,
    the frame it called, is that iterator's: a generator's frame, or a method of the iterator
    object), not its ``collate_fn``."""
    if hook.reads is None or callee is None:
        return False
    it = hook.reads(fetch.f_locals.get("self"))
    if it is None:
        return False
    return callee is getattr(it, "gi_frame", None) or callee.f_locals.get("self") is it


def _split_of(hook: Frames, loader_iter: object) -> str:
    """What splits among the ranks the data of a single-process DataLoader iterator, in words
    ("torch's DistributedSampler"): its dataset (a shard of a stream, a streaming dataset split
    by node) or a sampler in the chain from its index sampler (a batch sampler, a skip, a
    shard) that holds a rank and a number of ranks above one, as the registered
    :class:`ShareSplit` name them; "" when none does (every rank may read the same data, and
    what is drawn for it must agree)."""
    if hook.reads is None:
        return ""
    dataset, sampler = hook.reads(loader_iter)
    shares = [s for i in registered() for s in i.shares]
    plain = [s for s in shares if not s.holder]
    candidates: list[tuple[Any, list[ShareSplit]]] = [(dataset, plain)]
    for holder in dict.fromkeys(s.holder for s in shares if s.holder):
        held = [s for s in shares if s.holder == holder]
        candidates.append((_attribute(dataset, holder), held))
    for _ in range(_SAMPLER_DEPTH):
        if sampler is None:
            break
        candidates.append((sampler, plain))
        inner = _attribute(sampler, "batch_sampler")
        sampler = inner if inner is not None else _attribute(sampler, "sampler")
    for obj, splits in candidates:
        for split in splits:
            n = _attribute(obj, split.size)
            if type(n) is int and n > 1 and type(_attribute(obj, split.index)) is int:
                if split.label:
                    return split.label
                cls = type(obj)
                top = cls.__module__.partition(".")[0]
                return cls.__name__ if top == "__main__" else f"{top}'s {cls.__name__}"
    return ""


def _attribute(obj: object, name: str) -> Any:
    """``obj.name``, or None when it has none or reading it raises (the user's samplers and
    datasets: a property that raises must not reach training; unknown means compared)."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001
        return None


class Judge:
    """Verdicts for this rank's random ops (see the module docstring), and the count of what
    they left uncompared across the group, by (reason, subject, among peers)."""

    def __init__(
        self,
        program: Program,
        rank: int,
        domain: tuple[int, ...],
        groups: GroupResolver,
        learnt: GeneratorStates,
        inits: Initialisations,
        on_peers: Callable[[tuple[int, ...]], None],
        on_gap: ReadGap,
    ) -> None:
        self.program = program
        self.rank = rank
        self._domain = domain
        self._groups = groups
        self._learnt = learnt  # per-rank streams, learnt lines
        self._on_peers = on_peers
        self._on_gap = on_gap
        self._peer_sets: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.exempted: dict[Exempt, int] = {}
        self._inits = inits  # (settled: the parameter initialisations were, at the first step)
        self.shares_seen = False  # a rank's own share of the data was read
        self._dispatchers = tuple(
            h.module
            for i in registered()
            for h in i.hooks
            if isinstance(h, Frames) and h.role is Role.READER
        )

    def count(
        self,
        reason: Reason,
        subject: str,
        source: str = "",
        rank: int = -1,
        among: bool = False,
        n: int = 1,
    ) -> None:
        """``n`` random ops left uncompared across the group for ``reason``."""
        key = Exempt(reason, subject, source, rank, among)
        self.exempted[key] = self.exempted.get(key, 0) + n

    def judge(self, event: RandomOpEvent, mesh: Any, written: Any) -> Verdict:
        """The verdict for ``event`` (``mesh``: a DTensor op's; ``written``: the tensor an
        in-place op wrote)."""
        verdict = self._judge(event, mesh)
        if (
            verdict.compared
            and written is not None
            and self.program.stages
            and not self._inits.settled
            and current_expectation() is None
        ):
            stage = self._stage_init(written)
            if stage:
                self.count(Reason.STAGE_INIT, stage)
                return Verdict(Domain.RANK, Compare.NONE, Reason.STAGE_INIT, stage)
        return verdict

    def _judge(self, event: RandomOpEvent, mesh: Any) -> Verdict:
        if event.expect == "ignore":
            self.count(Reason.IGNORED, "")
            return IGNORED
        if mesh is not None:
            return self._dtensor(event, mesh)
        program = self.program
        declared = current_expectation() is not None
        if not declared:
            region = program.modifier()
            if region is not None:  # a region broadcast from rank src: its draws are src's
                src, hook = region
                self.count(Reason.BROADCAST, hook.label, hook.key, rank=src)
                return Verdict(
                    Domain.RANK, Compare.NONE, Reason.BROADCAST, hook.label, hook.key, rank=src
                )
            wrapper = program.current(event.phase is not FORWARD)
            if wrapper is not None and self.rank in wrapper.ranks:
                if event.phase is BACKWARD and self._spans_group(wrapper):
                    hook = sketch()
                    if hook is not None:  # what it feeds is all-reduced over the group
                        return self._firm(hook, Reason.SKETCH)
                return self._own_batch(wrapper, generate=False)
            wrapper = program.generating()
            if wrapper is not None and self.rank in wrapper.ranks:
                return self._own_batch(wrapper, generate=True)
            call = program.sampling()
            if call is not None:  # compared as the call; what it samples is the rank's own
                if call.drew:
                    self.count(Reason.SAMPLING, call.label)
                    return Verdict(Domain.RANK, Compare.NONE, Reason.SAMPLING, call.label)
                call.drew = True
                return Verdict(Domain.GROUP, Compare.CALL, Reason.SAMPLING, call.label)
        read = self._reading()
        if read.reader is not None and not declared:
            hook = read.reader
            self.count(Reason.READ_ALONE, hook.label, hook.key, rank=self.rank)
            return Verdict(Domain.RANK, Compare.NONE, Reason.READ_ALONE, hook.label, hook.key)
        order = self._order(read, event)
        if read.share and not (declared or order):
            self.shares_seen = True
            self.count(Reason.OWN_SHARE, read.share, rank=self.rank)
            return Verdict(Domain.RANK, Compare.NONE, Reason.OWN_SHARE, read.share)
        if order is not None:
            return order
        if not declared:
            learnt = self._learnt.verdict(event)
            if learnt is not None:
                subject = (
                    event.generator.short_label
                    if learnt.reason is Reason.PER_RANK_SEED
                    else learnt.subject
                )
                self.count(learnt.reason, subject)
                return learnt
        compare = Compare.DIFFER if event.expect == "differ" else Compare.STATE
        return Verdict(Domain.GROUP, compare, Reason.DECLARED if declared else Reason.DEFAULT)

    def _reading(self) -> Reading:
        """The walk, where one of its scopes could apply: in a data-parallel or pipelined
        program, before the first step (a split, a rank's own share), once a rank's own share
        was read, or with a reader's module imported."""
        program = self.program
        if (
            program.wrappers
            or program.stages
            or self.shares_seen
            or not self._inits.settled
            or any(m in sys.modules for m in self._dispatchers)
        ):
            return reading(0, self._on_gap)
        return NOT_READING

    def _order(self, read: Reading, event: RandomOpEvent) -> Verdict | None:
        """An order every rank (every stage) must walk alike: compared by state, firm."""
        hook = read.order
        if hook is not None and hook.anywhere:
            if not hook.on_per_rank and self._learnt.is_per_rank(event):
                return None  # (a rank may draw alone from a per-rank stream: its logs' split)
            return self._firm(hook, hook.scope)
        if hook is not None and self.program.wrappers:
            return self._firm(hook, hook.scope)
        if read.shuffle is not None and self.program.stages:
            return self._firm(read.shuffle, Reason.STAGE_ORDER)
        return None

    def recorded_order(self, event: RandomOpEvent) -> Verdict | None:
        """An order every rank must draw alike, drawn before this checker started (under
        RNGCHECK=1 it starts as the script initialises torch.distributed, and a script may split
        its data before that), known from the op's captured stack: a frame of a registered
        order's function that applies anywhere (torch's random_split)."""
        for integration in registered():
            for hook in integration.hooks:
                if not (isinstance(hook, Frames) and hook.role is Role.ORDER and hook.anywhere):
                    continue
                name = hook.attribute.rpartition(".")[2]
                path = hook.module.replace(".", "/") + ".py"
                if any(
                    f.name == name and f.filename.replace("\\", "/").endswith(path)
                    for f in event.stack.frames
                ):
                    return self._firm(hook, hook.scope)
        return None

    def pass_order(self) -> Verdict | None:
        """The order being drawn as a pass over the data begins (the step level, between
        samples): one a sampler splits among the ranks, or a pipeline's shuffle; not a split of
        the dataset (no pass's order)."""
        read = reading(0, self._on_gap)
        hook = read.order
        if hook is not None:
            return None if hook.anywhere else self._firm(hook, hook.scope)
        if read.shuffle is not None and self.program.stages:
            return self._firm(read.shuffle, Reason.STAGE_ORDER)
        return None

    @staticmethod
    def _firm(hook: Frames, reason: Reason | None) -> Verdict:
        assert reason is not None
        return Verdict(
            Domain.GROUP, Compare.STATE, reason, hook.label, hook.key, firm=True, fork=hook.forks
        )

    def _stage_init(self, written: Any) -> str:
        """The initialisation of a parameter of a pipeline stage this rank holds is the stage's
        own (each rank initialises its own layers, in amounts of its own), a DTensor's too."""
        if not isinstance(written, torch.nn.Parameter):
            return ""
        return self.program.stage_holding(written)

    def _dtensor(self, event: RandomOpEvent, mesh: Any) -> Verdict:
        """A DTensor random op: compared over its mesh, in the group's order; but inside a
        data-parallel forward whose tensor-parallel peers hold that mesh (dropout on
        sequence-parallel or replicated DTensor activations), among the peers, outside the
        group's order: the other data-parallel groups draw for their own batches' shapes."""
        compared = Verdict(Domain.MESH, Compare.STATE, Reason.DTENSOR)
        if not self.program.wrappers or current_expectation() is not None:
            return compared
        wrapper = self.program.current(event.phase is not FORWARD)
        if wrapper is None or self.rank not in wrapper.ranks:
            return compared
        peers = self.peers_of(wrapper)
        members = self._groups.members(None, mesh)
        if not peers or members is None or not set(members) <= set(peers):
            return compared
        return self._own_batch(wrapper, generate=False)

    def _spans_group(self, wrapper: Wrapper) -> bool:
        """Whether ``wrapper``'s ranks hold every rank of the mode's group and it has no
        tensor-parallel peers, so that its communication hook runs alike on every rank compared
        (a DDP over a subgroup, a pipeline stage's, reduces buckets of its own)."""
        return set(wrapper.ranks) >= set(self._domain) and not self.peers_of(wrapper)

    def _own_batch(self, wrapper: Wrapper, generate: bool) -> Verdict:
        """An op of the wrapper's forward/backward (or a pipeline schedule's step), or of
        generate() on its module: this rank's own across the wrapper's group; compared among
        its tensor-parallel peers, if it has any."""
        if generate:
            reason = Reason.OWN_SAMPLES
        else:
            reason = Reason.OWN_LAYERS if wrapper.pipeline else Reason.OWN_BATCH
        peers = self.peers_of(wrapper)
        label = wrapper.label
        self.count(Reason.OWN_BATCH if peers else reason, label, among=bool(peers))
        if peers:  # ... compared among the ranks that share this rank's batch
            return Verdict(Domain.PEERS, Compare.STATE, reason, label, peers=peers, firm=True)
        return Verdict(Domain.RANK, Compare.NONE, reason, label)

    def peers_of(self, wrapper: Wrapper) -> tuple[int, ...]:
        """The wrapper's tensor-parallel peers in the mode's group (() when fewer than two);
        a new set is announced (``on_peers``: checked at every round from now on, P4)."""
        if not wrapper.peers:
            return ()
        hit = self._peer_sets.get(wrapper.peers)
        if hit is None:
            kept = tuple(r for r in wrapper.peers if r in self._domain)
            hit = self._peer_sets[wrapper.peers] = kept if len(kept) > 1 else ()
            if hit:
                self._on_peers(hit)
        return hit

    @property
    def peers(self) -> bool:
        """Whether a known wrapper has tensor-parallel peers (ranks sharing this rank's batch)."""
        return any(self.peers_of(w) for w in self.program.wrappers)


def peers_stream(peers: tuple[int, ...]) -> int:
    """The stream a set of tensor-parallel peers is compared in."""
    return text_hash("peers", ",".join(map(str, peers)))
