"""Notes on the c10d store, outside the checker's collectives: who entered the mode (so a mode
entered on some ranks only ends in one clear error), who reached a failed exchange, and why a rank
left early. Written and read at start-up and after a failure only, never on the fast path."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Sequence
from typing import Any

from ..core.findings import format_ranks

__all__ = ["Board", "await_every_rank"]

log = logging.getLogger(__name__)


class Board:
    """Notes on the c10d store, written and read only after an exchange failed or a rank left
    early (never on the fast path): who reached the failed exchange, and why a rank left."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._prefix = f"rngcheck/{name}/"
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store: Any = _get_default_store()
        except Exception:  # noqa: BLE001 - no store: findings just say less
            log.debug("rngcheck has no c10d store to leave notes on", exc_info=True)
            self._store = None
        # Why the store could not be read, when it could not ("": it could, so a rank without a
        # note left none): its host may have ended with the rank a finding names.
        self.unreadable = "" if self._store is not None else "no c10d store"

    def arrivals(self, round_: int, rank: int, domain: tuple[int, ...], wait: float) -> tuple:
        """The ranks that reached exchange ``round_`` (each posts a key when its wait fails)."""
        if self._store is None:
            return (rank,)
        keys = [f"{self._prefix}{round_}/{r}" for r in domain]
        try:
            self._store.set(keys[domain.index(rank)], "1")
            deadline = time.monotonic() + wait
            while True:
                here = tuple(r for r, k in zip(domain, keys, strict=True) if self._store.check([k]))
                gone = self.left([r for r in domain if r not in here])  # they will not come
                if len(here) + len(gone) == len(domain) or time.monotonic() > deadline:
                    return here
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - the store's host may be gone too
            log.debug("rngcheck could not read arrivals from the store", exc_info=True)
            self.unreadable = _first_line(e)
            return (rank,)

    def post_left(self, rank: int, reason: str) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(f"{self._prefix}left/{rank}", reason)

    def left(self, ranks: Sequence[int]) -> dict[int, str]:
        """Why each of ``ranks`` left the checked block early, where it said so."""
        out: dict[int, str] = {}
        if self._store is None:
            return out
        for r in ranks:
            key = f"{self._prefix}left/{r}"
            try:
                if self._store.check([key]):
                    out[r] = self._store.get(key).decode(errors="replace")
            except Exception as e:  # noqa: BLE001 - the store's host may be gone too
                self.unreadable = _first_line(e)
        return out


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"


_ENTRIES = [0]  # the modes this process started across ranks: the same count on every rank


def await_every_rank(rank: int, world: int, timeout: float) -> None:
    """Wait until every rank has entered the mode (the start is collective), through the c10d
    store, so a mode entered on some ranks only ends in one clear error on each rank that did,
    instead of a raw store timeout inside torch.distributed.new_group."""
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        store = _get_default_store()
    except Exception:  # noqa: BLE001 - no store to meet on: new_group will tell
        return
    prefix = f"rngcheck/enter/{_ENTRIES[0] + 1}/"
    store.set(f"{prefix}{rank}", "1")
    count = store.add(f"{prefix}count", 1)
    start = time.monotonic()
    pause = 0.01
    warned = False
    while count < world:
        waited = time.monotonic() - start
        if waited > timeout:
            here = [r for r in range(world) if store.check([f"{prefix}{r}"])]
            missing = [r for r in range(world) if r not in here]
            # Leave no trace: this start did not happen, so the next one (on every rank) meets
            # under the same number, from a clean count.
            store.add(f"{prefix}count", -1)
            store.delete_key(f"{prefix}{rank}")
            raise RuntimeError(
                f"rngcheck: the RNGConsistencyMode was entered on {_ranks(here)} of {world} but "
                f"not on {_ranks(missing)} within {timeout:g} s. Checking across ranks is "
                "collective: enter the mode on every rank (the same `with` block, or RNGCHECK=1 "
                "for the whole job), or pass sync='off' where only some ranks run the checked code."
            )
        if not warned and waited > 10:
            warned = True
            warnings.warn(
                f"rngcheck: rank {rank} entered the RNGConsistencyMode and waits for the other "
                f"ranks to enter it too (up to {timeout:g} s)",
                stacklevel=4,
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
        count = store.add(f"{prefix}count", 0)
    _ENTRIES[0] += 1


def rank0s(name: str, value: str, rank: int, wait: float) -> str:
    """``value`` as rank 0 gives it (each rank passes its own), through the c10d store, after
    every rank entered the mode (await_every_rank); this rank's own when there is no store or
    rank 0's does not come within ``wait`` seconds."""
    import datetime

    from torch.distributed.distributed_c10d import _get_default_store

    key = f"rngcheck/{name}/{_ENTRIES[0]}"
    try:
        store = _get_default_store()
        if rank == 0:
            store.set(key, value)
            return value
        store.wait([key], datetime.timedelta(seconds=wait))
        return bytes(store.get(key)).decode(errors="replace")
    except Exception:  # noqa: BLE001 - no store, or rank 0 late: this rank's own
        log.debug("rngcheck could not read rank 0's %s from the store", name, exc_info=True)
        return value


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {format_ranks(ranks)}"
