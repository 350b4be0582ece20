"""The pending window: this rank's compared random ops since its last exchange point, as the
:class:`~rngcheck.ranks.protocol.Row` s a round carries, and what describing a divergence at each
of them needs (whether it is its generator's first use, the uncompared ops drawn from that
generator before it, the order or the call it was compared as). A verdict in, a row out: the
verdict's domain picks the stream, its comparison what the row holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..core.events import RandomOpEvent
from ..core.policy import current_expectation
from .detail import OnMesh, Uncompared
from .generators import GeneratorStates
from .groups import GroupResolver, MeshOp
from .protocol import POLICY_CODE, Row, gen_key, text_hash
from .verdict import Compare, Domain, Verdict

__all__ = ["COMPARED", "Taken", "Window"]

COMPARED = ("by_state", "by_what_runs", "as_calls", "among_peers", "must_differ")


class _Unchecked(NamedTuple):
    """Random ops a rank drew from a generator without comparing them, since its last checked
    op: their count, the last of them, and its verdict (and, for the ones drawn alone by design,
    that verdict). Made into an :class:`Uncompared` (with the last op's line) only when a
    divergence is localised: finding a line summarises the op's stack, a cost every uncompared
    op (each one of a data-parallel forward) would pay otherwise."""

    ops: int
    event: RandomOpEvent
    why: Verdict
    alone: Verdict | None = None

    def public(self) -> Uncompared:
        return Uncompared(self.ops, self.event.op, self.event.site, self.why, self.alone)


def on_mesh(on: MeshOp) -> OnMesh:
    """A DTensor op's mesh, as a divergence tells it."""
    mesh = on.mesh
    grid = mesh.mesh
    return OnMesh(
        ranks=tuple(sorted(int(r) for r in grid.flatten().tolist())),
        shape=tuple(int(n) for n in grid.shape),
        dims=tuple(str(d) for d in (mesh.mesh_dim_names or ())),
        placements=tuple(repr(p) for p in on.placements),  # ("Shard(dim=0)"; str: "S(0)")
    )


@dataclass(slots=True)
class Taken:
    """One round's window, taken from the pending one (kept until the round is settled, so a
    mismatch found one exchange later still localises the first divergent op)."""

    rows: list[Row] = field(default_factory=list)
    events: list[RandomOpEvent] = field(default_factory=list)
    first_use: set[int] = field(default_factory=set)  # indices that are a generator's first op
    uncompared: dict[int, _Unchecked] = field(default_factory=dict)  # index -> ops before it
    orders: dict[int, Verdict] = field(default_factory=dict)  # index -> the order it drew
    calls: dict[int, str] = field(default_factory=dict)  # index -> the generate() call's model
    meshes: dict[int, OnMesh] = field(default_factory=dict)  # index -> a DTensor op's mesh
    in_order: int = 0  # rows in the group's order (all but peers rows)
    kinds: list[str] = field(default_factory=list)  # per row: how it compares ("": not counted)


# defer(row, event, written, mesh) -> the row to post now (a parameter's initialisation is
# compared at the settle point instead: its row leaves the stream)
Defer = Callable[[Row, RandomOpEvent, Any, Any], Row]


class Window:
    """The pending window of one rank checker."""

    def __init__(
        self,
        groups: GroupResolver,
        states: GeneratorStates,
        stream_members: dict[int, tuple[int, ...]],
        defer: Defer,
    ) -> None:
        self._groups = groups
        self._states = states
        self._stream_members = stream_members  # stream -> its members (P4), shared
        self._defer = defer
        self._seen: set[str] = set()  # generators whose first use was seen (per stream kind)
        self._uncompared: dict[str, _Unchecked] = {}  # generator -> its uncompared ops since
        self.now = Taken()
        # What the settled rounds compared, for the report (a quiet run says what it compared):
        # by state, by what runs only (a generator apart), as calls, among peers, must-differ.
        self.compared: dict[str, int] = dict.fromkeys(COMPARED, 0)

    def take(self) -> Taken:
        """The window so far, for a round; the pending one starts empty."""
        taken, self.now = self.now, Taken()
        return taken

    def skip(self, event: RandomOpEvent, why: Verdict, rank: int) -> None:
        """Not compared (across the group), but it still moves its generator: remembered so that
        a divergence it causes in a checked op later can be pinned on it."""
        alone = why if why.alone(rank) else None
        key = gen_key(event)
        last = self._uncompared.get(key)
        if last is not None:
            self._uncompared[key] = _Unchecked(last.ops + 1, event, why, alone or last.alone)
        else:
            self._uncompared[key] = _Unchecked(1, event, why, alone)

    def add(self, event: RandomOpEvent, verdict: Verdict, on: MeshOp | None, written: Any) -> None:
        """Record a compared op as its verdict says: in the group's order, by state or what runs;
        as a call (the state it starts from: what it samples, its arguments and the state after,
        are the rank's own); or among its peers alone (by state, outside the group's order).
        ``on``: a DTensor op's mesh and placements."""
        now = self.now
        mesh = on.mesh if on is not None else None
        index = len(now.events)
        peers = verdict.domain is Domain.PEERS
        call = verdict.subject if verdict.compare is Compare.CALL else ""
        order = verdict.firm and verdict.domain is Domain.GROUP  # every rank walks what it drew
        exp = current_expectation()
        if peers:
            members: tuple[int, ...] | None = verdict.peers
            policy = "peers"
        else:
            spec = exp.group if exp is not None else None
            members = self._groups.members(spec, mesh)
            policy = event.expect if event.expect in POLICY_CODE else "same"
        stream = text_hash(policy, ",".join(map(str, members))) if members else 0
        declared = exp is not None or mesh is not None
        code = POLICY_CODE["declared" if declared and policy == "same" else policy]
        if members:
            self._stream_members[stream] = members
        gen = gen_key(event)
        # (a communication hook draws in a fork of the generator, undone as it returns: like a
        # peers row, its row sees what the generator drew uncompared and leaves it, and its
        # first use, to the generator's next row of its own)
        aside = peers or verdict.fork
        seen = f"{gen} peers" if peers else f"{gen} fork" if verdict.fork else gen
        if seen not in self._seen:
            self._seen.add(seen)
            now.first_use.add(index)
        uncompared = self._uncompared.get(gen) if aside else self._uncompared.pop(gen, None)
        if uncompared is not None:
            now.uncompared[index] = uncompared
        if not peers:
            now.in_order += 1
        if order:
            now.orders[index] = verdict
        if on is not None:  # (why its ranks must agree, should they not)
            now.meshes[index] = on_mesh(on)
        if call:
            now.calls[index] = call
            # (what the call drew is the rank's own, as the rest of it)
            self._uncompared[gen] = _Unchecked(1, event, verdict)
        by_state = self._states.by_state(event, verdict)
        row = Row(
            # (a generate() call's row: the state it starts from is compared, not what it drew)
            structure=text_hash("generate()", call, gen)
            if call
            else text_hash(event.op, gen, *event.args),
            stream=stream,
            before=event.before if event.before is not None and by_state else 0,
            after=event.after if event.after is not None and by_state and not call else 0,
            policy=code,
            # (an order's rows stay when its generator's rows leave the comparison)
            generator=text_hash(gen, "order")
            if order
            else text_hash(gen, "peers")
            if peers
            else text_hash(gen),
        )
        if stream and not peers and mesh is None:
            row = self._defer(row, event, written, mesh)
            if not row.stream:  # (an initialisation: its state is compared at the settle point)
                stream = 0
        kind = (
            "among_peers"
            if peers
            else "as_calls"
            if call
            else "must_differ"
            if policy == "differ"
            else "by_state"
            if by_state
            else "by_what_runs"
        )
        now.kinds.append(kind if stream or peers else "")
        now.events.append(event)
        now.rows.append(row)

    def settled(self, taken: Taken, apart: set[int], skipped: set[int], per_rank: Any) -> list[int]:
        """A round settled without a finding: count what its rows compared. ``apart``: the
        generators (hashed) the slow path moved apart in it (their rows there compared by what
        runs); ``skipped``: the indices learnt lines took out of it (counted as theirs);
        ``per_rank``: the generators learnt to be per-rank streams (their default rows there
        were not compared). Returns the indices of the per-rank rows, for the caller to count."""
        per_rank_rows = []
        default = POLICY_CODE["same"]
        for i, (row, kind) in enumerate(zip(taken.rows, taken.kinds, strict=True)):
            if not kind or i in skipped:
                continue
            if row.generator in per_rank and row.policy == default:
                per_rank_rows.append(i)
                continue
            if kind == "by_state" and row.generator in apart:
                kind = "by_what_runs"
            self.compared[kind] += 1
        return per_rank_rows
