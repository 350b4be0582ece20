"""The checker's collectives: one side gloo group per checked partition of ranks, never the
training's own communicator, every call bounded by the timeout. A peer that times out or goes
away surfaces as :class:`PeerLost`, never as a hang (gloo honours the group timeout)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.dispatch import unseen
from .protocol import POLICY_CODE, ExchangeStats, Point, Row, fold

__all__ = ["PeerLost", "SideGroup", "connection_closed"]


# How gloo says that a peer's connection closed (its process ended: a crash, a kill, os._exit),
# as against a wait that ran out of time ("Operation timed out!", "Timed out waiting ...").
_CLOSED = re.compile(r"connection (closed|reset) by peer|broken pipe|ECONNRESET|EPIPE", re.I)


class PeerLost(Exception):
    """A side-group collective failed: a rank timed out or went away (gloo's RuntimeError)."""


def connection_closed(error: BaseException) -> bool:
    """Whether gloo's ``error`` says that a peer's connection closed (its process ended), not
    that the wait timed out."""
    return _CLOSED.search(str(error)) is not None


def _max_options() -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
    return opts


def _run(post: Callable[..., Any], *args: Any) -> None:
    """Post a collective and wait for it; gloo's failure (a timeout, a peer gone) is PeerLost."""
    try:
        with unseen():
            post(*args).wait()
    except RuntimeError as e:
        raise PeerLost(e) from e


class SideGroup:
    """The checker's gloo group over ``domain``, the subgroups its partial streams need, and the
    count of what every call sent."""

    def __init__(
        self, group: Any, domain: tuple[int, ...], rank: int, timeout: float, stats: ExchangeStats
    ) -> None:
        self.group = group
        self.domain = domain
        self.rank = rank
        self.timeout = timedelta(seconds=timeout)
        self.stats = stats
        self.name = getattr(group, "group_name", "side")
        self._subgroups: dict[tuple[int, ...], Any] = {}

    def all_reduce_max(self, t: torch.Tensor, *, fast: bool, async_op: bool = False) -> Any:
        self._count(t, fast)
        try:
            with unseen():
                return dist.all_reduce(t, dist.ReduceOp.MAX, group=self.group, async_op=async_op)
        except RuntimeError as e:
            raise PeerLost(e) from e

    def wait(self, work: Any) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise PeerLost(e) from e

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in self.domain]
        self._count(t, fast=False)
        try:
            with unseen():
                dist.all_gather(out, t, group=self.group)
        except RuntimeError as e:
            raise PeerLost(e) from e
        return out

    def gather_rows(
        self, rows: list[Row], point: Point
    ) -> tuple[dict[int, list[Row]], dict[int, Point]]:
        """Every rank's rows, and the point each stood at (windows differ in length)."""
        head = torch.tensor([len(rows), int(point)], dtype=torch.int64)
        heads = [h.tolist() for h in self.all_gather(head)]
        mine = torch.zeros((max(max(h[0] for h in heads), 1), len(Row._fields)), dtype=torch.int64)
        if rows:
            mine[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
        gathered = self.all_gather(mine)
        windows = {
            rank: [Row(*r) for r in t[: h[0]].tolist()]
            for rank, t, h in zip(self.domain, gathered, heads, strict=True)
        }
        return windows, {rank: Point(h[1]) for rank, h in zip(self.domain, heads, strict=True)}

    def gather_json(self, data: Any) -> dict[int, Any]:
        """Every rank's JSON-able ``data``, as UTF-8 bytes in a uint8 tensor (never pickle)."""
        raw = json.dumps(data).encode()
        sizes = self.all_gather(torch.tensor([len(raw)], dtype=torch.int64))
        buf = torch.zeros(max(max(int(s) for s in sizes), 1), dtype=torch.uint8)
        if raw:
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = self.all_gather(buf)
        return {
            rank: json.loads(bytes(t[: int(s)].tolist()).decode())
            for rank, t, s in zip(self.domain, out, sizes, strict=True)
        }

    def check_partial_streams(
        self, parts: dict[int, list[Row]], members_of: dict[int, tuple[int, ...]]
    ) -> bool:
        """Check this rank's streams over parts of the group, in the same (sorted) order on every
        rank so that no two ranks wait for each other in opposite orders (P4). True: one
        disagrees ("same": states differ; "differ": two members share a state)."""
        bad = False
        for stream in sorted(parts, key=lambda s: (members_of[s], s)):
            members = members_of[stream]
            rows = parts[stream]  # (none: a peers stream with no rows this round)
            pg = self._subgroup(members)
            if rows and rows[0].policy == POLICY_CODE["differ"]:
                mine = torch.tensor([fold(v for r in rows for v in (r.structure, r.before))])
                out = [torch.empty_like(mine) for _ in members]
                self._count(mine, fast=True)
                _run(pg.allgather, [out], [mine])
                values = [int(o) for o in out]
                bad = bad or len(set(values)) < len(values)
            else:
                x = fold([stream, *(v for r in rows for v in (r.structure, r.before, r.after))])
                t = torch.tensor([x, -x], dtype=torch.int64)
                self._count(t, fast=True)
                _run(pg.allreduce, [t], _max_options())
                bad = bad or int(t[0]) != -int(t[1])
        return bad

    def _subgroup(self, members: tuple[int, ...]) -> Any:
        """A gloo group over ``members`` made by them alone (rendezvous on the c10d store under
        this checker's name), created the first time one of their streams is checked."""
        pg = self._subgroups.get(members)
        if pg is None:
            from torch.distributed.distributed_c10d import _get_default_store

            name = f"rngcheck/{self.name}/group/{'_'.join(map(str, members))}"
            store = dist.PrefixStore(name, _get_default_store())
            try:
                pg = dist.ProcessGroupGloo(
                    store, members.index(self.rank), len(members), self.timeout
                )
            except RuntimeError as e:
                raise PeerLost(e) from e
            self._subgroups[members] = pg
            self.stats.setup_calls += 1
        return pg

    def _count(self, t: torch.Tensor, fast: bool) -> None:
        nbytes = t.numel() * t.element_size()
        if fast:
            self.stats.fast_calls += 1
            self.stats.fast_bytes += nbytes
        else:
            self.stats.slow_calls += 1
            self.stats.slow_bytes += nbytes

    def close(self) -> None:
        self._subgroups.clear()  # gloo closes their connections when they are freed
        group, self.group = self.group, None
        if group is not None:
            # A group broken by a timeout cannot always be torn down.
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
