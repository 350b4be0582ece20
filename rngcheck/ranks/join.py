"""torch's ``Join`` for one rank checker: uneven inputs (protocol rule P7).

Inside an enabled Join over every checked rank, the only exchange points are the ones Join itself
pairs across the ranks: each iteration's ``notify_join_context`` on a rank with inputs left, and
the entry of ``Join.__exit__`` on a rank that has run out of them, whose round carries the
``joined`` flag. From the first round with the flag, what any rank draws is its own (a JOIN
verdict, counted for the notes) and no rank exchanges, until ``Join.__exit__`` returns on every
rank together; then the ranks compare again. A Join over a subgroup of the checked ranks is not
followed (its iterations are compared as without one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..core.events import RandomOpEvent
from .hooks import JoinSeen
from .protocol import Point
from .verdict import Compare, Domain, Reason, Verdict

__all__ = ["Joins"]

# exchange(point, where, *, post=True, joined=False): the rank checker's exchange
Exchange = Callable[..., None]


class Joins:
    """The Joins this thread is in, and whether a rank has run out of inputs in them."""

    def __init__(
        self,
        rank: int,
        domain: tuple[int, ...],
        exchange: Exchange,
        take: Callable[[], Any],
        skip: Callable[[RandomOpEvent, Verdict], None],
        count: Callable[[Reason, str], None],
        settle_due: Callable[[], None],
        lock: Any,
    ) -> None:
        self._rank = rank
        self._domain = set(domain)
        self._exchange = exchange
        self._take = take  # the pending window's events, taken (not compared)
        self._skip = skip
        self._count = count
        self._settle_due = settle_due
        self._lock = lock
        # per Join this thread is in, innermost last: its label when its group is the checker's
        # ("" for one over a subgroup: not followed)
        self._labels: list[str] = []
        self.apart = False  # a rank has run out of inputs: each rank runs its own iterations

    @property
    def inside(self) -> bool:
        """Inside a followed Join: Join's own points are the only exchange points (P7)."""
        return any(self._labels)

    def on_join(self, what: str, join: JoinSeen) -> None:
        """What the hooks saw of a Join on this thread (see hooks.JoinEvent)."""
        if what == "enter":
            self._labels.append(join.label if set(join.ranks) >= self._domain else "")
            return
        if not self._labels or not self._labels[-1]:
            if what == "left" and self._labels:
                self._labels.pop()
            return
        label = self._labels[-1]
        if what == "round":
            self._exchange(Point.JOIN, f"{label}'s notify_join_context")
        elif what == "exit":
            if not self.apart:
                self._exchange(Point.JOIN, f"{label}.__exit__", joined=True)
                with self._lock:
                    self.go_apart(())
        elif what == "left":
            self._labels.pop()
            if self.inside:
                return
            # Every rank has run out of inputs and left Join.__exit__ together: the round this
            # rank posted as it ran out is settled, and the ranks compare again from here.
            self._exchange(Point.JOIN, f"{label}.__exit__", post=False)
            with self._lock:
                for event in self._take().events:
                    self.skip(event)
            self.apart = False
            self._settle_due()

    def go_apart(self, events: Iterable[RandomOpEvent]) -> None:
        """A rank has run out of inputs: the ranks' windows (``events``, and this rank's since)
        are not compared; nothing is until this rank's Join.__exit__ returns."""
        self.apart = True
        for event in [*events, *self._take().events]:
            self.skip(event)

    def skip(self, event: RandomOpEvent) -> None:
        """A random op drawn once a rank ran out of inputs: this rank's own."""
        label = next((j for j in self._labels if j), "Join")  # the outermost one followed
        self._count(Reason.JOIN, label)
        self._skip(event, Verdict(Domain.RANK, Compare.NONE, Reason.JOIN, label))
