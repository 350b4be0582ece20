"""The recompute check of ``level="step"`` between sampled steps: no op is intercepted, so each
checkpointed call's generators are read at the entry and exit of its forward and of its
recompute, and compared. A recompute that drew from a generator the forward drew from, starting
from another state (or, run to its end, ending in another one), drew different random numbers: a
``recompute_mismatch``, localised to the region. The step after it is checked op by op, which
names the op, its line and the likely cause."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.events import Phase
from ..core.findings import Finding, FindingKind
from ..core.stacks import Stack
from .region import Region

__all__ = ["StateProbe"]

_MAX_ESCALATED = 1024
# The generators a region can draw from, and a snapshot of each (Tracked.snapshot) in that order.
Snapshot = tuple[tuple[Any, ...], list[Any]]


class StateProbe:
    """Reads and compares the generator states of checkpoint regions while ``active``.

    ``generators(devices)`` lists the tracked generators a region can draw from (the defaults of
    the CPU and of its devices, and the user generators the op level has seen; the same tuple
    while nothing new is tracked); ``emit`` takes a finding, ``escalate()`` asks for the next step
    to be checked op by op.
    """

    def __init__(
        self,
        generators: Callable[[tuple[str, ...]], tuple[Any, ...]],
        emit: Callable[[Finding], None],
        escalate: Callable[[], None],
    ) -> None:
        self._generators = generators
        self._emit = emit
        self._escalate = escalate
        self.active = False
        self.stats = {"regions": 0, "compared": 0, "mismatches": 0}
        # (region line, generator) pairs already escalated: once the op level has looked at a
        # recurring mismatch, later occurrences are counted on the finding, not checked again.
        self._escalated: set[tuple[str, str]] = set()

    def enter(self, region: Region, phase: Phase) -> Snapshot | None:
        """The states of the generators a pass of ``region`` can draw from, as it starts: all
        of them for the forward, the ones the forward drew from for the recompute (None: none
        to watch)."""
        if phase is Phase.FORWARD:
            gens = self._generators(region.devices)
        else:
            forward = region.probed
            if forward is None or region.failed:
                return None
            gens = forward[0]
        return gens, [t.snapshot() for t in gens]

    def exit(self, region: Region, phase: Phase, entry: Snapshot, completed: bool) -> None:
        gens, before = entry
        if phase is Phase.RECOMPUTE:
            self._recompute_exit(region, gens, before, completed)
            return
        after = [t.snapshot() for t in gens]
        drew = [
            i
            for i, (b, a) in enumerate(zip(before, after, strict=True))
            if b is not None and a is not None and b != a
        ]
        self.stats["regions"] += 1
        # Only the generators the forward drew from matter to the recompute.
        region.probed = (
            (tuple(gens[i] for i in drew), [before[i] for i in drew], [after[i] for i in drew])
            if drew
            else None
        )

    def _recompute_exit(
        self, region: Region, gens: tuple[Any, ...], before: list[Any], completed: bool
    ) -> None:
        forward = region.probed
        if forward is None or forward[0] is not gens:
            return
        self.stats["compared"] += 1
        whole = completed and not region.selective
        if not whole and before == forward[1]:
            # Stopped early (torch's early stop) from the forward's states: whatever it drew,
            # it drew the forward's numbers, and the states it ends in are not compared.
            return
        after = [t.snapshot() for t in gens]
        problem = _compare(gens, forward[1], forward[2], before, after, whole)
        if problem is None:
            return
        region.failed = True
        self.stats["mismatches"] += 1
        tracked, what = problem
        label = tracked.ident.label
        key = (region.site, label)
        if key not in self._escalated and len(self._escalated) < _MAX_ESCALATED:
            self._escalated.add(key)
            self._escalate()
        self._emit(
            Finding(
                kind=FindingKind.RECOMPUTE_MISMATCH,
                message=f"{region.title}: {what.format(gen=label)} (checked at the step level)",
                op=f"{region.kind} checkpoint",
                cause=_cause(region, label, tracked.ident.is_default),
                differs="state",
                region=region.title,
                stack=Stack.capture(),
            )
        )


def _compare(
    gens: tuple[Any, ...],
    f_in: list[Any],
    f_out: list[Any],
    r_in: list[Any],
    r_out: list[Any],
    whole: bool,
) -> tuple[Any, str] | None:
    """(the generator, what differed, with ``{gen}`` for its name) for the first generator both
    passes drew from whose states disagree; ``whole``: the recompute ran to its end."""
    for i, tracked in enumerate(gens):
        before, after, r_before, r_after = f_in[i], f_out[i], r_in[i], r_out[i]
        if r_before is None or r_after is None:
            continue  # unreadable now (CUDA graph capture)
        if r_before == r_after:
            if whole:
                return tracked, (
                    "the forward drew from {gen}; the recompute, run to its end, drew nothing "
                    "from it"
                )
            continue  # stopped early, before its draws: nothing was drawn differently
        if r_before != before:
            digest = tracked.digest_of
            return tracked, (
                "the recompute drew from {gen} starting from another state than the forward "
                f"({_hex(digest(before))} vs {_hex(digest(r_before))}), so it drew different "
                "random numbers"
            )
        if whole and r_after != after:
            return tracked, (
                "the recompute started {gen} where the forward did but left it in another "
                "state: it drew a different amount of random numbers"
            )
    return None


def _hex(digest: int | None) -> str:
    return "-" if digest is None else f"{digest & 0xFFFFFFFFFFFFFFFF:016x}"


def _cause(region: Region, label: str, is_default: bool) -> str:
    if region.preserve_rng_state is False and is_default:
        why = (
            f"the region was checkpointed with preserve_rng_state=False, so {label} was not "
            "stashed and restored"
        )
    elif not is_default and not region.custom:
        why = (
            f"{label} is a user generator: torch.utils.checkpoint stashes and restores only the "
            "default generators"
        )
    else:
        why = f"{label} was not restored to the forward's state before the recompute"
    return (
        f"{why}. The step after this one is checked op by op: its finding names the random op, "
        "its line and the likely cause."
    )
