"""Where the gathered windows of the ranks first disagree, and in what way: a pure function of the
rows every rank gathered, so every rank finds the same place."""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import POLICY_CODE, Point, Row

__all__ = ["Spot", "extra_ops", "localise"]


@dataclass(frozen=True, slots=True)
class Spot:
    """Where the gathered windows first disagree, and in what way."""

    kind: str  # "flow" (different ops), "state" (same op, states differ), "collision", "points"
    index: int  # position in the windows (flow, points) or in the stream (state, collision)
    stream: int = 0
    policy: int = 0  # the stream's POLICY_CODE (state, collision; flow: the ops' if they share one)

    def index_for(self, rank: int, window: list[Row]) -> int:
        """The position in ``window`` of this rank's op at the spot (past the end: none)."""
        if self.kind in ("flow", "points"):
            return self.index
        positions = [i for i, r in enumerate(window) if r.stream == self.stream]
        return positions[self.index] if self.index < len(positions) else -1


def localise(windows: dict[int, list[Row]], points: dict[int, Point]) -> Spot | None:
    """The first place the ranks' windows disagree, in the order the program ran: different ops
    (control flow), or, stream by stream, states ("same") or shared states ("differ"), whichever
    comes first (a state that differs before the ops part, as a generator seeded per rank does, is
    the earlier difference); then different exchange points. None: they agree (two streams only
    shared a hashed value)."""
    length = max(len(w) for w in windows.values())
    flow = next(
        (
            i
            for i in range(length)
            if len({w[i].structure if i < len(w) else None for w in windows.values()}) > 1
        ),
        None,
    )
    streams: dict[int, dict[int, list[Row]]] = {}
    for rank, w in windows.items():
        for r in w:
            if r.stream:
                streams.setdefault(r.stream, {}).setdefault(rank, []).append(r)
    first: Spot | None = None
    first_pos = length if flow is None else flow  # (the windows line up before the ops part)
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
    if flow is not None:
        policies = {w[flow].policy if flow < len(w) else 0 for w in windows.values()}
        return Spot("flow", flow, policy=policies.pop() if len(policies) == 1 else 0)
    if len(set(points.values())) > 1:
        return Spot("points", length)
    return None


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
