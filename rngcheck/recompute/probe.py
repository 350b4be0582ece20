"""The recompute check of ``level="step"`` between sampled steps: no op is intercepted, so each
checkpointed call's generators are read at the entry and exit of its forward and of its
recompute, and compared. A recompute that drew from a generator the forward drew from, starting
from another state (or, run to its end, ending in another one), drew different random numbers: a
``recompute_mismatch``, localised to the region. The step after it is checked op by op, which
names the op, its line and the likely cause.

A generator torch's checkpoint restores itself (the CPU default, under ``preserve_rng_state=True``
of ``torch.utils.checkpoint``, reentrant or not) starts the recompute in the state torch stashed as
the forward started: its two start states are equal by torch's own restore and are not read, only
its end states (a recompute run to its end must leave it where the forward did); under early
stop the recompute never reaches its end, so such a generator is not read at all (see
``left_to_torch``: nothing could show there, sampled steps check it op by op). Every other
generator (user generators, a device's, anything under ``preserve_rng_state=False`` or a custom
checkpoint) is read at all four points. Between samples that is no read per checkpointed call
in a CPU program with early stop, and one without it, instead of three.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from ..core.events import FORWARD, RECOMPUTE, Phase
from ..core.findings import Finding, FindingKind
from ..core.stacks import Stack
from .causes import compiled_checkpoint_cause, control_flow_cause
from .held import NEXT_STEP
from .region import Region

__all__ = ["StateProbe"]

_MAX_ESCALATED = 1024
_SNAPSHOT = operator.methodcaller("snapshot")  # a tracked generator's state now
_RESTORING = frozenset({"non-reentrant", "reentrant"})  # torch.utils.checkpoint's regions


class _Restored:
    """Stands for a start state that torch's restore makes equal in both passes (not read)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "RESTORED"


RESTORED = _Restored()
_ONLY_RESTORED = (RESTORED,)
# The generators a region can draw from, and a snapshot of each (Tracked.snapshot, or RESTORED)
# in that order.
Snapshot = tuple[tuple[Any, ...], tuple[Any, ...]]


class StateProbe:
    """Reads and compares the generator states of checkpoint regions while ``active``.

    ``generators(devices)`` lists the tracked generators a region can draw from (the CPU default
    first, then the defaults of its devices and the user generators the op level has seen; the
    same tuple while nothing new is tracked); ``emit`` takes a finding and the label of the
    generator it is about (the mode holds it until a step checked op by op names it: held.py),
    ``escalate()`` asks for the next step to be checked op by op.
    """

    def __init__(
        self,
        generators: Callable[[tuple[str, ...]], tuple[Any, ...]],
        emit: Callable[[Finding, str], None],
        escalate: Callable[[], None],
    ) -> None:
        self._generators = generators
        self._emit = emit
        self._escalate = escalate
        self.active = False
        # regions: calls watched by their generators' states; compared: their recomputes
        # compared; restored_and_stopped_early: calls whose CPU default generator is left to
        # torch's restore with early stop (see left_to_torch; some of them watched for other
        # generators too), whose draws from it sampled steps check op by op.
        self.stats = {"regions": 0, "compared": 0, "mismatches": 0, "restored_and_stopped_early": 0}
        # (region line, generator) pairs already escalated: once the op level has looked at a
        # recurring mismatch, later occurrences are counted on the finding, not checked again.
        self._escalated: set[tuple[str, str]] = set()
        self._cpu_first: tuple[tuple[Any, ...], bool] = ((), False)  # gens -> CPU default first

    def enter(self, region: Region, phase: Phase) -> Snapshot | None:
        """The start states of the generators a pass of ``region`` can draw from: all of them
        for the forward, the ones the forward drew from for the recompute (None: none to
        watch); RESTORED for those torch restores."""
        if phase is FORWARD:
            gens = self._generators(region.devices)
            if not gens:
                return None
            if (
                region.preserve_rng_state is True
                and region.kind in _RESTORING
                and self._cpu_default_first(gens)
            ):
                if region.early_stop:  # restored, and its recompute's end is never reached
                    self.stats["restored_and_stopped_early"] += 1
                    if len(gens) == 1:
                        return None
                    gens = gens[1:]
                elif len(gens) == 1:
                    return gens, _ONLY_RESTORED
                else:
                    return gens, (RESTORED, *map(_SNAPSHOT, gens[1:]))
            return gens, tuple(map(_SNAPSHOT, gens))
        forward = region.probed
        if forward is None or region.failed:
            return None
        gens, f_in = forward[0], forward[1]
        if f_in is _ONLY_RESTORED:
            return gens, _ONLY_RESTORED
        return gens, tuple(
            RESTORED if b is RESTORED else t.snapshot() for t, b in zip(gens, f_in, strict=True)
        )

    def exit(self, region: Region, phase: Phase, entry: Snapshot, completed: bool) -> None:
        gens, before = entry
        if phase is RECOMPUTE:
            self._recompute_exit(region, gens, before, completed)
            return
        self.stats["regions"] += 1
        if len(gens) == 1:
            b, a = before[0], gens[0].snapshot()
            # Drew nothing (nothing for the recompute to match), or unreadable: not watched.
            # (A restored generator's start was not read: it is watched to the recompute's end.)
            region.probed = None if a is None or b is None or b == a else (gens, before, (a,))
            return
        after = tuple(map(_SNAPSHOT, gens))
        drew = [
            i
            for i, (b, a) in enumerate(zip(before, after, strict=True))
            if b is not None and a is not None and b != a
        ]
        # Only the generators the forward drew from matter to the recompute.
        region.probed = (
            (
                tuple(gens[i] for i in drew),
                tuple(before[i] for i in drew),
                tuple(after[i] for i in drew),
            )
            if drew
            else None
        )

    def left_to_torch(self, devices: tuple[str, ...]) -> bool:
        """Whether a region on ``devices`` whose generators torch.utils.checkpoint restores and
        whose recompute it stops early has nothing for generator states to show: the CPU
        default is the one generator it can draw from (counted when so)."""
        gens = self._generators(devices)
        if len(gens) == 1 and self._cpu_default_first(gens):
            self.stats["restored_and_stopped_early"] += 1
            return True
        return False

    def _cpu_default_first(self, gens: tuple[Any, ...]) -> bool:
        known, first = self._cpu_first
        if known is not gens:
            ident = gens[0].ident
            first = ident.is_default and ident.device == "cpu"
            self._cpu_first = (gens, first)
        return first

    def _recompute_exit(
        self, region: Region, gens: tuple[Any, ...], before: tuple[Any, ...], completed: bool
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
        after = (gens[0].snapshot(),) if len(gens) == 1 else tuple(map(_SNAPSHOT, gens))
        problem = _compare(gens, forward[1], forward[2], before, after, whole)
        if problem is None:
            return
        region.failed = True
        self.stats["mismatches"] += 1
        tracked, what, control_flow = problem
        label = tracked.ident.label
        key = (region.where, label)
        if key not in self._escalated and len(self._escalated) < _MAX_ESCALATED:
            self._escalated.add(key)
            self._escalate()
        self._emit(
            Finding(
                kind=FindingKind.RECOMPUTE_MISMATCH,
                message=f"{region.title}: {what.format(gen=label)} (checked at the step level)",
                op=f"{region.kind} checkpoint",
                cause=(
                    f"{control_flow_cause()}{NEXT_STEP}"
                    if control_flow
                    else _cause(region, label, tracked.ident.is_default)
                ),
                differs="state",
                region=region.title,
                stack=Stack.capture(),
            ),
            label,
        )


def _compare(
    gens: tuple[Any, ...],
    f_in: tuple[Any, ...],
    f_out: tuple[Any, ...],
    r_in: tuple[Any, ...],
    r_out: tuple[Any, ...],
    whole: bool,
) -> tuple[Any, str, bool] | None:
    """(the generator, what differed, with ``{gen}`` for its name, whether the passes drew
    different amounts from one start) for the first generator both passes drew from whose
    states disagree; ``whole``: the recompute ran to its end."""
    for i, tracked in enumerate(gens):
        before, after, r_before, r_after = f_in[i], f_out[i], r_in[i], r_out[i]
        if r_before is None or r_after is None:
            continue  # unreadable now (CUDA graph capture)
        if r_before is RESTORED:
            if whole and r_after != after:
                return tracked, _RESTORED_ENDS_ELSEWHERE, True
            continue
        if r_before == r_after:
            if whole:
                return tracked, _DREW_NOTHING, True
            continue  # stopped early, before its draws: nothing was drawn differently
        if r_before != before:
            digest = tracked.digest_of
            return (
                tracked,
                "the recompute drew from {gen} starting from another state than the forward "
                f"({_hex(digest(before))} vs {_hex(digest(r_before))}), so it drew different "
                "random numbers",
                False,
            )
        if whole and r_after != after:
            return tracked, _ENDS_ELSEWHERE, True
    return None


_RESTORED_ENDS_ELSEWHERE = (
    "torch restored {gen} to the forward's start state for the recompute, which, run to its "
    "end, left it in another state than the forward: it drew a different amount of random numbers"
)
_DREW_NOTHING = "the forward drew from {gen}; the recompute, run to its end, drew nothing from it"
_ENDS_ELSEWHERE = (
    "the recompute started {gen} where the forward did but left it in another state: it drew a "
    "different amount of random numbers"
)


def _hex(digest: int | None) -> str:
    return "-" if digest is None else f"{digest & 0xFFFFFFFFFFFFFFFF:016x}"


def _cause(region: Region, label: str, is_default: bool) -> str:
    if region.preserve_rng_state is False and is_default:
        why = (
            compiled_checkpoint_cause(label)
            if region.by_compile
            else f"the region was checkpointed with preserve_rng_state=False, so {label} was not "
            "stashed and restored"
        )
    elif not is_default and not region.custom:
        why = (
            f"{label} is a user generator: torch.utils.checkpoint stashes and restores only the "
            "default generators"
        )
    else:
        why = f"{label} was not restored to the forward's state before the recompute"
    return f"{why}.{NEXT_STEP}"
