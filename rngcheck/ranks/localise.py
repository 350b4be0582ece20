"""Where the gathered windows of the ranks first disagree, and in what way: a pure function of the
rows every rank gathered, so every rank finds the same place."""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import PEERS, POLICY_CODE, Point, Row

__all__ = ["Spot", "extra_ops", "in_order", "localise"]


def in_order(window: list[Row]) -> list[int]:
    """The positions in ``window`` of the rows every rank of the group runs in one order: all but
    a data-parallel forward's rows compared among tensor-parallel peers only (the other
    data-parallel ranks may run other ops there)."""
    return [i for i, r in enumerate(window) if r.policy != PEERS]


@dataclass(frozen=True, slots=True)
class Spot:
    """Where the gathered windows first disagree, and in what way."""

    kind: str  # "flow" (different ops), "state" (same op, states differ), "collision", "points"
    # position among the rows in the group's order (flow, points: ``in_order``) or in the stream
    # (state, collision)
    index: int
    stream: int = 0
    policy: int = 0  # the stream's POLICY_CODE (state, collision; flow: the ops' if they share one)

    def index_for(self, rank: int, window: list[Row]) -> int:
        """The position in ``window`` of this rank's op at the spot (past the end: none)."""
        if self.kind in ("flow", "points") and not (self.policy == PEERS and self.stream):
            positions = in_order(window)
        else:  # a stream's rows (a peers stream's mark, which is no op, left out)
            positions = [i for i, r in enumerate(window) if r.stream == self.stream and r.structure]
        return positions[self.index] if self.index < len(positions) else len(window)


def localise(windows: dict[int, list[Row]], points: dict[int, Point]) -> Spot | None:
    """The first place the ranks' windows disagree, in the order the program ran: different ops
    (control flow), or, stream by stream, states ("same") or shared states ("differ"), whichever
    comes first (a state that differs before the ops part, as a generator seeded per rank does, is
    the earlier difference); then different exchange points. None: they agree (two streams only
    shared a hashed value)."""
    length = max(len(w) for w in windows.values())
    ordered = {r: [w[i] for i in in_order(w)] for r, w in windows.items()}
    flow = next(
        (
            i
            for i in range(max(len(w) for w in ordered.values()))
            if len({w[i].structure if i < len(w) else None for w in ordered.values()}) > 1
        ),
        None,
    )
    streams: dict[int, dict[int, list[Row]]] = {}
    peers: set[int] = set()
    for rank, w in windows.items():
        for r in w:
            if r.stream:
                rows = streams.setdefault(r.stream, {}).setdefault(rank, [])
                if r.policy == PEERS:
                    peers.add(r.stream)
                if r.structure:  # (a peers stream's mark: a member, with or without rows)
                    rows.append(r)
    first: Spot | None = None
    first_pos = length
    for stream, by_rank in streams.items():
        if len(by_rank) < 2:
            continue
        if stream in peers:  # outside the group's order: what the peers run is compared here
            spot = _peers_spot(stream, by_rank)
            if spot is not None:
                # (where the first member that ran an op there ran it)
                low = next(
                    (r for r in sorted(by_rank) if spot.index_for(r, windows[r]) < len(windows[r])),
                    min(by_rank),
                )
                pos = spot.index_for(low, windows[low])
                if pos < min(first_pos, _position(windows[low], flow)) or (
                    first is None and flow is None
                ):
                    first, first_pos = spot, pos
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
                low = min(by_rank)
                pos = [i for i, r in enumerate(windows[low]) if r.stream == stream][j]
                # (the windows line up before the ops part; in the lowest member's window)
                if pos < min(first_pos, _position(windows[low], flow)):
                    first, first_pos = Spot(kind, j, stream, at[0].policy), pos
                break
    if first is not None:
        return first
    if flow is not None:
        policies = {w[flow].policy if flow < len(w) else 0 for w in ordered.values()}
        return Spot("flow", flow, policy=policies.pop() if len(policies) == 1 else 0)
    if len(set(points.values())) > 1:
        return Spot("points", max(len(w) for w in ordered.values()))
    return None


def _peers_spot(stream: int, by_rank: dict[int, list[Row]]) -> Spot | None:
    """Where the members of a peers stream first disagree: in what they run (one ran an op the
    others did not, or another op) or, running the same op, in its states."""
    for j in range(max(len(v) for v in by_rank.values())):
        at = [v[j] if j < len(v) else None for v in by_rank.values()]
        if len({r.structure if r is not None else None for r in at}) > 1:
            return Spot("flow", j, stream, PEERS)
        if len({(r.before, r.after) for r in at if r is not None}) > 1:
            return Spot("state", j, stream, PEERS)
    return None


def _position(window: list[Row], flow: int | None) -> int:
    """Where in ``window`` the ops part (``flow``: a position among the rows in order), or its
    end."""
    positions = in_order(window)
    return positions[flow] if flow is not None and flow < len(positions) else len(window)


_LOOKAHEAD = 256  # extra ops one side may have run before the sides line up again


def extra_ops(window: list[Row], i: int, other: int | None) -> int:
    """How many ops ``window`` runs from ``i`` before it runs ``other`` (the other side's op at
    ``i``; None: the other side's window ended there, so all of this one's are extra). 0: never
    within the lookahead."""
    if other is None:
        return max(len(window) - i, 0)
    for k in range(1, min(_LOOKAHEAD, len(window) - i)):
        if window[i + k].structure == other:
            return k
    return 0
