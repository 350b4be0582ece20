"""The saved report kept current while the run goes (``report_path=``, ``RNGCHECK_REPORT``).

rngcheck installs no signal handler: a Python handler runs only once the main thread is back in
the interpreter (a rank that waits in a collective for a slow peer would outlive its SIGTERM by
as long as the wait lasts), and the ``SystemExit`` it raises is one a script's ``except
BaseException`` or ``finally`` can swallow. A checked process dies of a signal as an unchecked one
does, at once; so what its report needs is on disk before the signal comes. The keeper saves the
report (atomically, ``Report.save``; ``completed`` False until the run ends normally):

1. when the mode starts (where its path is this process's own), and again when ``RNGCHECK=1``
   binds it to the process group (its rank, its file and its run are known then): a killed
   process leaves a report, however early;
2. at once, when the sink records a new distinct finding (at most ``MAX_FINDINGS`` of them, so a
   broken loop cannot make it save without end);
3. at its progress points (an exchange of the rank checker, an optimizer step, a finding that
   recurred) when what the report counts changed: the first at once, the next ones once the last
   of them is ``KEEP_EVERY_S`` seconds old and ``COST_SHARE`` times as old as its save took, so
   saving never takes more than 1% of the run and the counters on disk are a few seconds behind
   at most.

Measured on ext4 (2 CPU cores): a save of a report without findings takes 0.5 to 16 ms (median
0.6 to 8 ms from one run to the next, most of it the fsync), one with a finding (21 KB) about
5 ms; a progress point between saves costs 110 ns. At one save in 5 s, that is under 0.3% of the
run at worst.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

from ..core.findings import RNGCheckWarning

__all__ = ["COST_SHARE", "KEEP_EVERY_S", "ReportKeeper"]

log = logging.getLogger(__name__)

KEEP_EVERY_S = 5.0  # the least time between two saves at progress points
COST_SHARE = 100  # ... and at least this many times what the last save took


class ReportKeeper:
    """Saves one mode's report while it runs (see the module docstring).

    ``save(path)`` brings the report up to date and writes it there (raises OSError);
    ``path()`` is where the report goes now (None: nowhere); ``version()`` is a cheap value that
    changes whenever what the report counts changes (random ops, finding occurrences).

    Known limitations: the counters a killed process leaves are those of its last save (a few
    seconds old at most while it progressed; the findings are all there); nothing is saved from
    a process forked from the one that started the mode.
    """

    def __init__(
        self,
        save: Callable[[str], None],
        path: Callable[[], str | None],
        version: Callable[[], Hashable],
    ) -> None:
        self._save = save
        self._path = path
        self._version = version
        # Whether the path is this process's own to write now (RNGCHECK=1: not before a rank
        # knows its rank, nor in the process that started the ranks; env/activation.py).
        self.allowed: Callable[[], bool] = lambda: True
        self.active = False
        self.saves = 0  # how many saves, and the time they took (the report's meta)
        self.seconds = 0.0
        self._pid = os.getpid()
        self._due = 0.0  # the monotonic time before which a progress point does not save
        self._saved: Hashable = None  # version() at the last save
        self._saving = False
        self._failed = False

    def start(self) -> None:
        self.active = True
        self._pid = os.getpid()

    def stop(self) -> None:
        """The run ended: the mode writes the final report itself."""
        self.active = False

    def finding(self, new: bool) -> None:
        """The sink recorded a finding: ``new``, a distinct one (saved now), else a recurrence."""
        if new:
            self.save()
        else:
            self.progress()

    def progress(self, *_: Any) -> None:
        """An exchange or an optimizer step ended (also an optimizer step post-hook). The first
        one saves at once (the report on disk shows the run under way), later ones when due."""
        if self.active and time.monotonic() >= self._due:
            took = self.save()
            if took is not None:
                self._due = time.monotonic() + max(KEEP_EVERY_S, COST_SHARE * took)

    def save(self, *, force: bool = False) -> float | None:
        """Save now, if there is a path, it is this process's, and something changed (or
        ``force``: the report's place in the run did); how long it took (None: not saved)."""
        if not self.active or self._saving or os.getpid() != self._pid:
            return None  # (a forked child, a DataLoader worker: the report is its parent's)
        path = self._path()
        if not path or not self.allowed():
            return None
        version = self._version()
        if version == self._saved and not force:
            return None
        self._saving = True
        start = time.monotonic()
        try:
            self._save(path)
        except OSError as e:
            if not self._failed:  # once: a full disk must not stop the training, nor flood it
                self._failed = True
                warnings.warn(
                    f"rngcheck could not save its report to {path} while the run goes: {e}; it "
                    "tries again as the run goes, and at the end",
                    RNGCheckWarning,
                    stacklevel=2,
                )
            log.debug("rngcheck could not save its report to %s", path, exc_info=True)
        finally:
            self._saving = False
        took = time.monotonic() - start
        self.saves += 1
        self.seconds += took
        self._saved = version
        return took
