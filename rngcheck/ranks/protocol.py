"""The cross-rank exchange protocol: what a random op becomes on the wire, what a round carries,
and the ordering rules that keep every rank's collectives on the checker's group in step.

Every random op this rank checks becomes a :class:`Row` of six int64s. Rows wait in the rank's
pending window until an exchange point (:class:`Point`). There each rank folds its window into a
fixed vector (:func:`fast_vector`) and the ranks run one all-reduce MAX over the checker's own gloo
group; every value is sent as ``(x, -x)``, so equal max and min mean every rank agrees. That costs
88 bytes whatever the world size (streams over part of the group add one small all-reduce each, and
a flag: tensor-parallel peers' streams at every round). Only on a mismatch do the ranks gather their
rows (ints only) and then the detail of the one divergent op (JSON text; never pickle), so every
rank builds the same finding from the same data.

The rules the code relies on, cited as "P1" to "P7" where it does:

- **P1** Every rank runs the checker's collectives in the same order: each exchange point posts
  exactly one round, and round numbers travel in the vector, so two ranks at different rounds
  mismatch instead of pairing the wrong collectives.
- **P2** A round is settled (waited for, bounded by the timeout, and judged) before the next round
  is posted: with ``sync="step"`` an optimizer step's or every-N round stays in flight and is
  settled at the next exchange point, so round r is settled at the same place in every rank's
  sequence of side-group collectives.
- **P3** Collectives, ``check()`` and exit settle their own round before returning: no rank walks
  into the program's own collective while a mismatch the others will report is unknown. Only
  collectives over every rank of the checker's group are exchange points: one over a subgroup
  runs on its members alone, a send or receive on two ranks.
- **P4** Streams over part of the group are checked after the whole-group vector agreed, in one
  order every rank shares (sorted by members, then stream), followed by one flag all-reduce so the
  whole group agrees on whether to gather.
- **P5** What decides whether rows are compared is the same on every rank: the data-parallel
  wrappers (built collectively), the settle point (the first step, a wrapper's forward, ``check()``
  or exit, SPMD points) and the per-rank streams (decided from the gathered data, identically on
  every rank).
- **P6** After a finding, or a peer lost, the checker stops exchanging: every later op would
  differ too, and a checker must never be the reason a job hangs.
- **P7** Inside torch's ``Join`` (uneven inputs: each rank runs its own number of iterations),
  the only exchange points are the ones Join itself pairs across the ranks: each iteration's
  ``notify_join_context`` on a rank with inputs left, and the entry of ``Join.__exit__`` on a rank
  that has run out of them, whose round carries the ``joined`` flag. Once a round with the flag is
  settled, no rank exchanges (nor counts a step) until its ``Join.__exit__`` returns, which it
  does on every rank together.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import torch

from ..core.events import RandomOpEvent

__all__ = [
    "HEADER",
    "INIT_SLOT",
    "PEERS",
    "PIPELINED",
    "POLICY_CODE",
    "ExchangeStats",
    "Point",
    "Row",
    "fast_vector",
    "fold",
    "gen_key",
    "ident_key",
    "joined",
    "text_hash",
]

_MASK62 = (1 << 62) - 1

# "same" by default (the mode's expectation), "differ", and "same" as declared: an expect()
# block or a DTensor's mesh. Only the default may be learnt to be a per-rank stream.
# "peers": an op of a data-parallel forward compared among the ranks outside the wrapper's group
# that compute on this rank's batch (its tensor-parallel peers): the other data-parallel
# ranks may run other ops there (their own batches' shapes), so its rows stay out of the
# group-wide order (the structure, and the control flow a divergence is localised by).
POLICY_CODE = {"same": 1, "differ": 2, "declared": 3, "peers": 4}
PEERS = POLICY_CODE["peers"]

# The vector: (x, -x) for the round, the point, the structure, the group-wide stream and the
# parameter initialisations (replicated.py; 0 until settled), then a flag: 1, streams over
# parts of the group follow (P4); 2, this rank has run out of inputs inside torch's Join (P7:
# the round is not judged, so its streams are not either). The ranks' largest flag is read.
HEADER = 11
INIT_SLOT = 8
_JOINED = 2


class Row(NamedTuple):
    """One random op as the ranks exchange it: six int64s, the same layout on every rank."""

    structure: int  # digest of op, generator and arguments: what must run in the same order
    stream: int  # digest of the expectation and the ranks it spans; 0: compared in order only
    before: int  # the generator's state digest before the op (0: unreadable)
    after: int
    policy: int  # POLICY_CODE of the stream's expectation
    generator: int  # digest of the generator's cross-rank name (a per-rank stream drops its rows)


class Point(enum.IntEnum):
    """Where a rank stood when it joined an exchange; all ranks must stand at the same kind."""

    RANDOM_OP = 1
    COLLECTIVE = 2
    OPTIMIZER_STEP = 3
    EVERY = 4
    CHECK = 5
    EXIT = 6
    JOIN = 7  # inside torch's Join: an iteration's notify_join_context, or Join.__exit__ (P7)


# With sync="step", the rounds of these points stay in flight until the next exchange point (P2).
PIPELINED = frozenset({Point.OPTIMIZER_STEP, Point.EVERY})


@dataclass(slots=True)
class ExchangeStats:
    """What the exchanges cost this rank: collective calls and bytes sent, fast path and slow."""

    exchanges: int = 0
    fast_calls: int = 0
    fast_bytes: int = 0
    slow_calls: int = 0
    slow_bytes: int = 0
    setup_calls: int = 0
    setup_bytes: int = 0
    mismatches: int = 0

    def to_dict(self) -> dict[str, int]:
        # Published at every exchange: dataclasses.asdict (a deepcopy per field) cost ~150 us.
        return {name: getattr(self, name) for name in self.__slots__}


def _h62(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK62


@lru_cache(maxsize=4096)
def text_hash(*parts: str) -> int:
    """A 62-bit digest of some strings (never 0)."""
    return _h62("\x1f".join(parts).encode()) or 1


def fold(values: Iterable[int]) -> int:
    """A 62-bit digest of a sequence of signed 64-bit ints (never 0)."""
    ints = list(values)
    return _h62(struct.pack(f"<{len(ints)}q", *ints)) or 1


def gen_key(event: RandomOpEvent) -> str:
    """A generator's name across ranks. Each rank drives its own device (cuda:0 on rank 0,
    cuda:1 on rank 1), so devices compare by type."""
    return ident_key(event.generator)


def ident_key(ident: Any) -> str:
    """:func:`gen_key` of a generator named ``ident`` (a GeneratorId)."""
    return f"{ident.kind}#{ident.number}:{ident.device.split(':')[0]}"


def fast_vector(
    round_: int,
    point: Point,
    rows: list[Row],
    whole_stream: int,
    init: list[Row] | None,
    peer_streams: Iterable[int] = (),
    joined: bool = False,
    extra: dict[int, list[Row]] | None = None,
) -> tuple[torch.Tensor, dict[int, list[Row]]]:
    """The group-wide vector of one round, and this rank's streams over parts of the group;
    ``peer_streams``: the peers streams this rank knows, each checked at every round, with its
    rows or none (peers may differ in having rows: P4 must not wait for a check one skips);
    ``joined``: this rank has run out of inputs inside torch's Join (P7); ``extra``: more
    streams over parts of the group, checked with them (a settling round's replicated
    parameters, whose rows are no random ops)."""
    structure = fold(r.structure for r in rows if r.policy != PEERS)
    whole: list[Row] = []
    parts: dict[int, list[Row]] = {stream: [] for stream in peer_streams}
    for r in rows:
        if r.stream == whole_stream:
            whole.append(r)
        elif r.stream:
            parts.setdefault(r.stream, []).append(r)
    for stream, extra_rows in (extra or {}).items():
        parts.setdefault(stream, []).extend(extra_rows)
    x = fold(v for r in whole for v in (r.structure, r.before, r.after))
    # The parameter initialisations, at the one round that settles them (replicated.py).
    y = 0
    if init is not None:
        y = fold([len(init), *(v for r in init for v in (r.structure, r.before))])
    values = [round_, int(point), structure, x, y]
    vec = [v for value in values for v in (value, -value)]
    flag = _JOINED if joined else 1 if parts else 0
    return torch.tensor([*vec, flag], dtype=torch.int64), parts


def disagreement(vec: torch.Tensor) -> tuple[bool, bool]:
    """(the round, point, structure or whole stream differ; the initialisations differ)."""
    v: list[Any] = vec.tolist()
    main = any(v[i] != -v[i + 1] for i in range(0, INIT_SLOT, 2))
    return main, v[INIT_SLOT] != -v[INIT_SLOT + 1]


def joined(vec: torch.Tensor) -> bool:
    """Whether some rank of a settled round had run out of inputs inside torch's Join (P7)."""
    return int(vec[-1]) >= _JOINED
