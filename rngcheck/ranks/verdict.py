"""Verdicts: what the cross-rank check says of one random op, as a value.

The principle (docs/data-parallel.md): **a random draw must agree across exactly the ranks over
which the state it feeds is replicated.** A verdict applies it to one op: a *domain* (which ranks
must agree), a *comparison* (how), and the *reason* the domain is what it is, with its evidence
(``subject``: the wrapper, sampler, model or line the reason is about; ``source``: the
integration hook that opened the scope, for its own words). Verdicts travel as values, into the
rows, the gathered details and the notes; text is written from them at the output edge only
(``explain.py``).

Nothing here imports torch: the documentation's scope table is built from these names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Apart", "Compare", "Domain", "LEARNT", "Reason", "Verdict"]


class Domain(str, enum.Enum):
    """Which ranks must agree on a draw."""

    GROUP = "group"  # the mode's group, or the group an expect() block names
    MESH = "mesh"  # a DTensor op's mesh (torch's contract)
    PEERS = "peers"  # the ranks that compute on this rank's batch (tensor-parallel peers)
    RANK = "rank"  # this rank alone: nothing to compare


class Compare(str, enum.Enum):
    """How the ranks of the domain are compared."""

    STATE = "by state"  # what runs, with which arguments, and the generator's states
    RUNS = "by what runs"  # what runs and with which arguments, not the states
    CALL = "as a call"  # that the call happens, in order, from the same state
    DIFFER = "apart"  # no two ranks may share a state (expect("differ"))
    NONE = "not compared"


class Reason(str, enum.Enum):
    """Why a draw's domain is what it is: one value per source of a scope. The value is what the
    report and the gathered details carry."""

    # outside every scope
    DEFAULT = "default"  # the mode's group, by state
    # declared: the user's and torch's contracts
    DECLARED = "declared"  # rngcheck.expect("same"/"differ", group=...)
    IGNORED = "ignored"  # rngcheck.expect("ignore")
    DTENSOR = "dtensor"  # a DTensor op: every rank of its mesh holds one state
    # integrations: what a library's code says the draw feeds
    OWN_BATCH = "own_batch"  # a data-parallel wrapper's forward and backward
    OWN_LAYERS = "own_layers"  # a pipeline schedule's stages
    OWN_SAMPLES = "own_samples"  # generate() on the module a data-parallel wrapper wraps
    SAMPLING = "sampling"  # generate() on a model no wrapper wraps: compared as the call
    OWN_SHARE = "own_share"  # loading this rank's own share of the data
    STAGE_INIT = "stage_init"  # initialising a parameter of a pipeline stage this rank holds
    ORDER = "order"  # an order (or a stream) that a sampler splits among the ranks
    SPLIT = "split"  # the permutation that splits a dataset (torch's random_split)
    STAGE_ORDER = "stage_order"  # an order every stage of a pipeline walks
    SKETCH = "sketch"  # a communication hook's random sketch of the gradients (PowerSGD)
    READ_ALONE = "read_alone"  # one rank reads every rank's batches, then broadcasts them
    BROADCAST = "broadcast"  # drawn inside a region that broadcasts from one rank (ZeRO-3)
    JOIN = "join"  # after a rank ran out of inputs inside torch's Join
    # learnt from a mismatch (marked in the notes; off with strict=True)
    PER_RANK_SEED = "per_rank_seed"  # a generator seeded per rank in a data-parallel program
    OWN_ARGUMENTS = "own_arguments"  # a line drawing with each rank's own arguments
    OWN_COUNT = "own_count"  # a line drawing a number of times of each rank's own


# The reasons learnt from a mismatch rather than declared or read from a library's code.
LEARNT = frozenset({Reason.PER_RANK_SEED, Reason.OWN_ARGUMENTS, Reason.OWN_COUNT})


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the cross-rank check says of one random op (see the module docstring)."""

    domain: Domain
    compare: Compare
    reason: Reason
    subject: str = ""  # what the reason is about, as the report names it
    source: str = ""  # the integration hook that opened the scope ("" for none)
    rank: int = -1  # the rank that draws for every rank (a region broadcast from it)
    peers: tuple[int, ...] = ()  # Domain.PEERS: the ranks compared among
    # By state even on a generator the ranks moved apart: what it feeds must agree, whatever
    # the generator's history (an order every rank walks, tensor-parallel peers).
    firm: bool = False
    # Drawn in a fork of the generator, undone as the scope ends (a communication hook's): the
    # generator's own history is left as it was.
    fork: bool = False

    @property
    def compared(self) -> bool:
        return self.compare is not Compare.NONE

    @property
    def learnt(self) -> bool:
        return self.reason in LEARNT

    def alone(self, rank: int) -> bool:
        """Whether ``rank`` drew this by design alone, for every rank (reading their batches, or
        modifying what a region broadcasts from it)."""
        return self.reason is Reason.READ_ALONE or (
            self.reason is Reason.BROADCAST and self.rank == rank
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields another rank needs to explain it (gathered as JSON)."""
        return {
            "reason": self.reason.value,
            "subject": self.subject,
            "source": self.source,
            "rank": self.rank,
            "compare": self.compare.value,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(
            domain=Domain.GROUP,
            compare=Compare(data.get("compare", Compare.NONE.value)),
            reason=Reason(data["reason"]),
            subject=str(data.get("subject", "")),
            source=str(data.get("source", "")),
            rank=int(data.get("rank", -1)),
        )


@dataclass(frozen=True, slots=True)
class Apart:
    """How the ranks moved a generator apart, so that it is compared by what runs from there
    (until reseeded): a reason and its evidence. ``reason``: the scope whose uncompared draws
    moved it (its ``subject``, and ``rank`` for one that drew alone), a learnt line
    (OWN_ARGUMENTS: ``args``, each argument summary with its ranks; OWN_COUNT: ``rank`` ran
    ``op`` at ``site`` more times than ``others``), or RESTORED (``call``: the restore)."""

    reason: Reason | None  # None: every rank restored a state of its own (a resume)
    subject: str = ""
    source: str = ""  # the hook of the scope whose draws moved it (for its own words)
    rank: int = -1
    site: str = ""
    op: str = ""
    others: tuple[int, ...] = ()
    args: tuple[tuple[str, tuple[int, ...]], ...] = ()
    call: str = ""  # the restoring call, as its SeedCall reads

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason.value if self.reason is not None else None,
            "subject": self.subject,
            "source": self.source,
            "rank": self.rank,
            "site": self.site,
            "op": self.op,
            "others": list(self.others),
            "args": [[a, list(r)] for a, r in self.args],
            "call": self.call,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Apart:
        reason = data.get("reason")
        return cls(
            reason=Reason(reason) if reason is not None else None,
            subject=str(data.get("subject", "")),
            source=str(data.get("source", "")),
            rank=int(data.get("rank", -1)),
            site=str(data.get("site", "")),
            op=str(data.get("op", "")),
            others=tuple(int(r) for r in data.get("others", ())),
            args=tuple((str(a), tuple(int(x) for x in r)) for a, r in data.get("args", ())),
            call=str(data.get("call", "")),
        )
