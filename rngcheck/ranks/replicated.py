"""Replicated parameters: they must start equal on every rank that holds them.

A random op that initialises a parameter (an in-place op on an ``nn.Parameter``) before the
program's first step is not compared as it is drawn: its order is, its state waits for the
settle point (the first step, a wrapper's forward, ``check()`` or exit; the same exchange on
every rank, P5). There the initialisations of the parameters a data-parallel wrapper
broadcast as it was built (DDP; FSDP with ``sync_module_states``; DeepSpeed; ZeRO-3's
``zero.Init``) are dropped: the broadcast overwrote what they drew. A parameter that no longer
exists drew into nothing that trains, and is dropped too (tied weights). The rest are compared.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..core.events import RandomOpEvent
from ..core.findings import Finding
from .integrations.records import Wrapper
from .protocol import Row

__all__ = ["Init", "Initialisations"]

_MAX_INIT = 100_000  # parameter initialisations kept for the settle point


@dataclass(slots=True)
class Init:
    """A random op that initialised a parameter: its state is compared at the settle point, and
    not at all if a data-parallel wrapper broadcasts that parameter first."""

    row: Row
    event: RandomOpEvent
    parameter: weakref.ref[Any]  # dead once replaced (tied weights, or re-made)


class Initialisations:
    """The parameter initialisations waiting for the settle point, and what left them out."""

    def __init__(self) -> None:
        self.pending: list[Init] = []
        self.due = False  # the next exchange settles them
        self.settled = False
        self.broadcast: dict[str, int] = {}  # wrapper label -> initialisations it overwrote
        self.replaced = 0  # initialisations of parameters gone by the settle point
        self.compared = 0  # initialisations compared at the settle point
        self.held: list[Finding] = []  # per-rank seeding seen before the program was known DP

    def defer(self, row: Row, event: RandomOpEvent, written: Any, mesh: Any) -> Row:
        """The row to post now for a compared op: a parameter's initialisation before the settle
        point posts its order alone (its state waits for the settle point)."""
        if (
            self.settled
            or not isinstance(written, torch.nn.Parameter)
            or len(self.pending) >= _MAX_INIT
        ):
            return row
        self.pending.append(Init(row, event, weakref.ref(written)))
        return row._replace(stream=0)

    def settle_due(self) -> None:
        """The program reached its first step (or a data-parallel forward, check() or exit): the
        next exchange settles the initialisations and the held per-rank findings."""
        if not self.settled:
            self.due = True

    def take(self, wrappers: list[Wrapper]) -> tuple[list[Init], list[Finding]] | None:
        """At the exchange that settles them (the same one on every rank, P5): the
        initialisations to compare and the per-rank findings held back, or None when this is
        not that exchange."""
        if not self.due:
            return None
        inits, self.pending = self._live(self.pending, wrappers), []
        self.compared += len(inits)
        held, self.held = self.held, []
        self.due, self.settled = False, True
        return inits, held

    def put_back(self, inits: list[Init], held: list[Finding]) -> None:
        """A round that settled them met a rank that ran out of inputs in torch's Join: they are
        settled at the first exchange after it, on every rank (P7)."""
        self.pending = [*inits, *self.pending]
        self.compared -= len(inits)
        self.held = [*held, *self.held]
        self.settled = False

    def on_wrapper(self, wrapper: Wrapper) -> None:
        """A wrapper that broadcasts the module's states is being built: what it overwrites
        drew nothing that stays. (A parameter that no longer exists is left to ``_live``.)"""
        if not wrapper.broadcasts:
            return
        kept = [i for i in self.pending if not wrapper.overwrites(i.parameter())]
        covered = len(self.pending) - len(kept)
        if covered:
            self.pending = kept
            self.broadcast[wrapper.label] = self.broadcast.get(wrapper.label, 0) + covered

    def _live(self, inits: list[Init], wrappers: list[Wrapper]) -> list[Init]:
        """After a wrapper broadcast: the initialisation of a parameter that no longer exists
        (replaced by a tied one, or re-made before the wrapper was built) drew into nothing that
        trains, and is left out. Garbage is collected first, so that what is left out does not
        depend on when each rank's collector last ran (P5)."""
        if not inits or not any(w.broadcasts for w in wrappers):
            return inits
        gc.collect()
        kept = [i for i in inits if i.parameter() is not None]
        self.replaced += len(inits) - len(kept)
        return kept
