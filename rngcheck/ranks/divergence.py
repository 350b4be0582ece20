"""The slow path of a round that did not agree: gather every rank's rows, find the first place
they disagree (``localise.py``), gather each rank's :class:`~rngcheck.ranks.detail.Detail` of its
op there, and judge it. A divergence the scopes explain moves its generator apart
(``generators.py``) and the round is judged again without its states; one that learning explains
(a per-rank stream, a line drawing each rank's own arguments or counts) is learnt, unless strict;
anything else is the finding. Every rank runs the same loop on the same gathered data (P5), so
every rank gathers as often and builds the same finding."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..core.events import RandomOpEvent
from ..core.findings import Finding, FindingKind
from ..core.stacks import Stack
from .detail import Detail
from .findings import build_finding, init_finding, point_text, point_what
from .generators import (
    GeneratorStates,
    count_key,
    counts_may_apply,
    data_parallel_drift,
    own_arguments,
    own_count,
    per_rank_seeding,
)
from .localise import Spot, localise
from .protocol import PEERS, POLICY_CODE, Row, gen_key, text_hash
from .replicated import Initialisations
from .scopes import Judge
from .verdict import Reason
from .window import Taken

__all__ = ["Divergences"]

log = logging.getLogger(__name__)

_DEFAULT = POLICY_CODE["same"]  # a row outside every declared scope
_COUNT_LINES_READ = 512  # learnt lines by counts: ops whose lines a rank reads (each a stack)


class Divergences:
    """Judges this rank's side of a round that did not agree (see the module docstring)."""

    def __init__(
        self,
        side: Any,
        rank: int,
        domain: tuple[int, ...],
        states: GeneratorStates,
        judge: Judge,
        inits: Initialisations,
        peer_streams: dict[int, tuple[int, ...]],
        seed_calls: Callable[[RandomOpEvent], tuple[Any, ...]],
    ) -> None:
        self._side = side
        self.rank = rank
        self._domain = domain
        self._states = states
        self._judge = judge
        self._inits = inits
        self._peer_streams = peer_streams
        self._seed_calls = seed_calls
        # What the last round's slow path changed of this rank's rows: the generators it moved
        # apart (hashed), and the indices learnt lines took out (counted as theirs).
        self.apart: set[int] = set()
        self.skipped: set[int] = set()

    @property
    def per_rank(self) -> dict[int, Any]:
        """The generators (hashed) learnt to be per-rank streams."""
        return self._states.per_rank

    def count_per_rank(self, event: RandomOpEvent) -> None:
        """A row of a learnt per-rank stream, in the round that learnt it: not compared."""
        self._judge.count(Reason.PER_RANK_SEED, event.generator.short_label)

    def judge_round(
        self,
        sent: Any,
        rows: list[Row],
        events: list[RandomOpEvent],
        taken: Taken,
        *,
        init: bool,
    ) -> Finding | None:
        """The finding of round ``sent`` (its rows, or with ``init`` the parameter
        initialisations it settles), or None once learning and the scopes explain it all."""
        if not init:  # a mark per peers stream: its members with no rows in it are still seen
            rows = rows + [
                Row(0, stream, 0, 0, PEERS, 0)
                for stream in sent.parts
                if stream in self._peer_streams
            ]
        windows, points = self._side.gather_rows(rows, sent.point)
        if init:
            points = dict.fromkeys(points, sent.point)
        stack = sent.stack if sent.stack is not None else Stack.capture()
        where = point_text(points[self.rank], sent.where, stack)
        reached = point_what(points[self.rank], sent.where)
        dropped: dict[int, set[int]] = {}  # rows at a line learnt by counts, per rank
        states, rank = self._states, self.rank
        self.apart, self.skipped = set(), set()
        wrappers = tuple(w.label for w in self._judge.program.wrappers)
        while True:
            # Per-rank streams leave the comparison outside every scope, but not parameter
            # initialisations (a replicated parameter drawn from one is still wrong), nor a draw
            # under expect(...), an order or a peers stream (their rows keep their own policy
            # or generator key): a declaration wins over what was learnt.
            skip = () if init else states.per_rank
            kept = {
                r: [
                    i
                    for i, row in enumerate(w)
                    if not (row.generator in skip and row.policy == _DEFAULT)
                    and i not in dropped.get(r, ())
                ]
                for r, w in windows.items()
            }
            view = {r: [windows[r][i] for i in kept[r]] for r in windows}
            spot = localise(view, points)
            if spot is None:  # no divergence left (or two streams shared a hashed slot)
                return None
            at = spot.index_for(rank, view[rank])
            index = kept[rank][at] if 0 <= at < len(kept[rank]) else -1
            event = events[index] if 0 <= index < len(events) else None  # (not a mark)
            unchecked = taken.uncompared.get(index)
            counting = not init and bool(wrappers) and counts_may_apply(spot)
            lines, spot_line = (
                _count_lines(spot, view, windows[rank], events, index) if counting else ({}, "")
            )
            order = taken.orders.get(index) if not init else None
            mine = Detail(
                event=event,
                point=where,
                reached=reached,
                seed_calls=self._seed_calls(event)
                if event is not None and (init or index in taken.first_use)
                else (),
                uncompared=None if init or unchecked is None else unchecked.public(),
                wrappers=wrappers,
                # (a hook's fork of the generator starts where the hook seeded it)
                apart=states.apart_of(event)
                if event is not None and not (order is not None and order.fork)
                else None,
                order=order,
                call=taken.calls.get(index, "") if not init else "",
                peers=self._judge.peers,
                lines=lines,
                spot_line=spot_line,
                spot_at=index if 0 <= index < len(events) else len(windows[rank]),
                mesh=taken.meshes.get(index),
            )
            details = {
                r: Detail.from_dict(d) for r, d in self._side.gather_json(mine.to_dict()).items()
            }
            try:
                finding = build_finding(spot, view, details, self._domain, init=init)
            except Exception as e:  # noqa: BLE001 - never let a describing bug escape into training
                log.exception("rngcheck could not describe a cross-rank divergence")
                return Finding(
                    kind=FindingKind.RANK_DIVERGENCE,
                    message=(
                        f"the ranks disagree at random op {spot.index} of exchange "
                        f"#{sent.number} ({spot.kind}); rngcheck could not describe it "
                        f"({type(e).__name__}: {e})"
                    ),
                    op=event.op if event is not None else "",
                    differs=spot.kind,
                    ranks=self._domain,
                    stack=stack,
                )
            if init:
                return init_finding(finding, details)
            strict = states.strict
            seeded = None if strict else per_rank_seeding(spot, details)
            if seeded is not None:
                # A per-rank stream (learnt): its rows leave the comparison from here on; the
                # finding is held until the settle point while the program is not known to be
                # data-parallel yet.
                states.learn_per_rank(*seeded)
                if not details[min(details)].wrappers:
                    if self._inits.settled:
                        return finding  # past the settle point and not data-parallel: a finding
                    self._inits.held.append(finding)
                continue
            drift = data_parallel_drift(spot, details)
            seed: int | None = None  # the apart generator's seed on this rank
            own = None if drift is not None or strict else own_arguments(spot, details)
            if own is not None:
                # Learnt: this line's draws from the generator are each rank's own from here, and
                # the generator is apart (below); this round's op there leaves the comparison on
                # every rank.
                mine_o = details[rank].event  # (own_arguments: every rank has one)
                assert mine_o is not None
                reason = states.learn_line(mine_o, by_counts=False)
                self._judge.count(reason, mine_o.site)
                common = text_hash(gen_key(mine_o), mine_o.op, "own arguments")
                for r, w in windows.items():
                    pos = spot.index_for(r, view[r])
                    if pos < len(kept[r]):
                        i = kept[r][pos]
                        w[i] = w[i]._replace(structure=common, before=0, after=0)
                        if r == rank:
                            self.skipped.add(i)
                drift = own
            counted = own_count(spot, details) if drift is None and not strict else None
            if counted is not None:
                # Learnt, counts: that line's draws from the generator are each rank's own from
                # here, however many, and the generator is apart (from the seed every rank drew
                # there with); this round's ops there leave the comparison on every rank.
                extra, event_c, how_c = counted
                there = details[extra].spot_line
                for r, d in details.items():
                    dropped.setdefault(r, set()).update(d.lines.get(there, ()))
                self.skipped.update(dropped.get(rank, ()))
                drawn = len(details[rank].lines.get(there, ()))
                reason = states.learn_line(event_c, by_counts=True)
                self._judge.count(reason, event_c.site, n=drawn)
                seed, drift = event_c.seed, (event_c, how_c)
            if drift is None:
                return finding
            # The scopes' (or a learnt line's) draws moved the generator apart: from here it is
            # compared by what runs, not by state (until it is reseeded); this round is judged
            # again without its states.
            event_d, how = drift
            if counted is None:
                mine_d = details[rank].event
                seed = mine_d.seed if mine_d is not None else None
            states.go_apart(event_d, how, seed)
            gen = text_hash(gen_key(event_d))
            self.apart.add(gen)
            windows = {
                r: [row._replace(before=0, after=0) if row.generator == gen else row for row in w]
                for r, w in windows.items()
            }


def _count_lines(
    spot: Spot, view: dict[int, list[Row]], window: list[Row], events: list[Any], at: int
) -> tuple[dict[str, list[int]], str]:
    """Learnt lines by counts: this rank's ops of the round that ran an op found at a
    control-flow divergence on any rank (same op, generator and arguments), by ``count_key``,
    with their positions in ``window`` (before and after the divergence: a line learnt leaves
    the round whole); and the key of this rank's op at the divergence (``at``), "". Each one's
    line is read from its stack (about a millisecond): past ``_COUNT_LINES_READ`` of them, none
    are (the clause does not apply)."""
    structures = set()
    for r, w in view.items():
        p = spot.index_for(r, w)
        if p < len(w):
            structures.add(w[p].structure)
    same = POLICY_CODE["same"]  # (a row under expect("differ") or "ignore" is no such op)
    hits = [
        i
        for i, row in enumerate(window)
        if row.structure in structures and row.policy == same and i < len(events)
    ]
    if len(hits) > _COUNT_LINES_READ:
        return {}, ""
    lines: dict[str, list[int]] = {}
    for i in hits:
        key = count_key(events[i], window[i].structure)
        if key:
            lines.setdefault(key, []).append(i)
    found = next((k for k, positions in lines.items() if at in positions), "")
    return lines, found
