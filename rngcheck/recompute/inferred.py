"""Recomputes no checkpoint announced: the hand-written ``autograd.Function`` checkpoints of
diffusion code bases, Megatron's, DeepSpeed's, FairScale's, copies of older torch versions.

A random op that runs during backward, outside every region rngcheck knows, is a recompute when a
checkpoint's backward drives it (an ``autograd.Function.backward`` frame, or a saved-tensor unpack
hook, in user or library code) and it re-runs a random op of this iteration's forward: the same
op, the same user call site, the same arguments. Those backward ops form an inferred region,
aligned with the forward op by op (in order from the op the region started at), and are compared
exactly like torch's checkpoint's: generator, state before and after, output digest. A mismatch is
a ``recompute_mismatch`` whose cause names the generator and the function whose backward ran it.

Which forward op a backward op replays, when the same line ran several times (one per layer): the
one drawn from the same state, if any (a restoring checkpoint replays exactly), else the latest one
not yet replayed (backward runs the layers in reverse). Randomness that belongs in backward (a
gradient-noise Function, stochastic rounding in a hook, any line the forward never ran) matches no
forward op and stays a note.

Known limitations:
    Forward ops keep no output digest until their line has been seen recomputed once, so the
    first iteration compares states only. A custom backward that calls, at the same line and with
    the same shapes, the random helper its forward called (fresh noise on purpose) is taken for a
    recompute: scope it with ``rngcheck.expect("ignore")``.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ..core.events import RandomOpEvent
from ..core.findings import Finding
from ..core.stacks import is_internal_file
from .causes import first_difference, likely_cause
from .region import Region, mismatch_finding

__all__ = ["InferredRecomputes", "driver_frame"]


# Frames that drive a recompute from backward: an autograd.Function's backward (every reentrant-
# style checkpoint), or a saved-tensor unpack hook (a hand-written non-reentrant one).
_DRIVERS = ("backward",)
_DRIVER_PARTS = ("unpack", "recompute")


def driver_frame(skip: int = 1) -> str | None:
    """``CheckpointFunction.backward (model.py:88)``: the innermost frame outside torch and rngcheck
    that drives a recompute from backward, or None (a gradient hook, plain autograd)."""
    frame: Any = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        name = code.co_name
        if (name in _DRIVERS or any(p in name for p in _DRIVER_PARTS)) and not is_internal_file(
            code.co_filename
        ):
            qualname = getattr(code, "co_qualname", name)  # Python 3.11+: "Class.backward"
            if qualname == name and name == "backward":
                ctx = frame.f_locals.get("ctx")  # <Function>Backward, autograd's node class
                owner = type(ctx).__name__.removesuffix("Backward") if ctx is not None else ""
                qualname = f"{owner}.backward" if owner else name
            where = f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
            return f"{qualname} ({where})"
        frame = frame.f_back
    return None


def _key(event: RandomOpEvent) -> tuple[Any, ...]:
    site = event.stack.call_site
    where = (site.filename, site.lineno) if site is not None else ("", 0)
    return (event.op, event.args, *where)


class _Local(threading.local):
    def __init__(self) -> None:
        self.region: Region | None = None  # the inferred region a backward is running
        self.at = 0  # its next forward op's position in the iteration's buffer


class InferredRecomputes:
    """Finds and compares recomputes that no checkpoint rngcheck knows announced."""

    def __init__(self, emit: Callable[[Finding], None], window: int) -> None:
        self._emit = emit
        # This iteration's forward random ops: the mode's window of recent events bounds it (the
        # same events: no memory of its own beyond the references).
        self._forward: deque[RandomOpEvent] = deque(maxlen=window)
        self._replayed: set[int] = set()  # seqs of forward ops an inferred region replayed
        self._local = _Local()
        self._watched: set[tuple[str, int]] = set()  # lines seen recomputed: digest their outputs
        self.stats = {"regions": 0, "compared_ops": 0}

    # -- inputs from the mode --------------------------------------------------------------------

    def watches(self, site: tuple[str, int] | None) -> bool:
        """Whether a forward op at ``site`` should keep an output digest (its line was seen
        recomputed), so its next recompute compares outputs too."""
        return site is not None and site in self._watched

    @property
    def watching(self) -> bool:
        return bool(self._watched)

    def on_forward(self, event: RandomOpEvent) -> None:
        """A forward random op outside every known region (a candidate for a later recompute)."""
        self._local.region = None
        self._forward.append(event)

    def on_step(self) -> None:
        """An optimizer step: the next forward is another iteration."""
        self._forward.clear()
        self._replayed.clear()
        self._local.region = None

    def on_backward(self, event: RandomOpEvent, driver: str | None) -> bool:
        """A backward random op outside every known region; True when it is part of an inferred
        recompute (compared here; not a backward note). ``driver``: :func:`driver_frame`."""
        if driver is None or not self._forward:
            return False
        key = _key(event)
        local = self._local
        index = None
        if local.region is not None and local.at < len(self._forward):
            following = self._forward[local.at]
            if _key(following) == key and following.seq not in self._replayed:
                index = local.at
        if index is None:
            index = self._candidate(key, event)
            if index is None:
                local.region = None
                return False
            local.region = Region(kind="inferred", name=f"recompute by {driver}", site=event.site)
            self.stats["regions"] += 1
        region = local.region
        assert region is not None
        f = self._forward[index]
        self._replayed.add(f.seq)
        local.at = index + 1
        region.forward.append(f)
        region.recompute.append(event)
        site = event.stack.call_site
        if site is not None:
            self._watched.add((site.filename, site.lineno))
        # expect("ignore") around the forward or the recompute: not compared (a backward usually
        # runs outside the block that scoped the forward).
        if not region.failed and "ignore" not in (event.expect, f.expect):
            self._compare(region, len(region.recompute) - 1)
        return True

    # -- matching and comparing ------------------------------------------------------------------

    def _candidate(self, key: tuple[Any, ...], event: RandomOpEvent) -> int | None:
        """The forward op ``event`` replays: one drawn from the same state (an exact replay),
        else the latest one not yet replayed (backward runs the layers in reverse)."""
        latest = None
        for i in range(len(self._forward) - 1, -1, -1):
            f = self._forward[i]
            # op and arguments first: the call site needs the stack summarised (slower)
            if f.op != event.op or f.args != event.args or f.seq in self._replayed:
                continue
            if _key(f) != key:
                continue
            if event.before is not None and f.before == event.before:
                return i
            if latest is None:
                latest = i
        return latest

    def _compare(self, region: Region, k: int) -> None:
        self.stats["compared_ops"] += 1
        f, r = region.forward[k], region.recompute[k]
        differs, detail = first_difference(f, r)
        if differs:
            region.failed = True
            cause = likely_cause(region, k, f, r, differs)
            self._emit(mismatch_finding(region, k, f, r, differs, detail, *cause))
