"""Starting the rank checker: collectively, on every rank, once torch.distributed is up. Every
rank meets first (a mode entered on some ranks only is one clear error), then agrees on its group
and settings (one O(world) gather), and the ranks create the checker's gloo groups in one order."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.dispatch import unseen
from ..core.handle import CheckerHandle
from .board import await_every_rank
from .checker import RankChecker
from .groups import check_disjoint, is_mesh, resolve_group
from .protocol import text_hash

__all__ = ["group_timeout", "start"]

log = logging.getLogger(__name__)


def start(handle: CheckerHandle) -> RankChecker | None:
    """The rank checker for the mode behind ``handle``, or None in a single process (or outside
    ``group``).

    Collective: every rank must call it (at ``__enter__``, or ``bind_distributed()``), because it
    creates the checker's gloo groups and agrees on the configuration.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    cfg = handle.config
    rank, world = dist.get_rank(), dist.get_world_size()
    seconds, source = (cfg.timeout, "timeout=") if cfg.timeout is not None else group_timeout()
    timeout = timedelta(seconds=seconds)
    # A bad group= fails here, the same way on every rank, before any group exists.
    domain = resolve_group(cfg.group, rank, world, cfg.group if is_mesh(cfg.group) else None)
    with unseen():
        await_every_rank(rank, world, seconds)
        world_side = dist.new_group(backend="gloo", timeout=timeout)
        try:
            parts, t = _agree(world_side, cfg, domain, world)
        except BaseException:
            dist.destroy_process_group(world_side)
            raise
        side = world_side
        # level="step": the step digests' rounds go through a group of their own, so ranks that
        # count other steps than each other (their rounds then fall at other points) never pair
        # one with an exchange of another size, which gloo answers by aborting the job.
        steps = cfg.level == "step"
        whole = parts == [tuple(range(world))]  # (the same on every rank)
        step_side = dist.new_group(backend="gloo", timeout=timeout) if steps and whole else None
        if not whole:
            side = None
            for part in parts:  # every rank creates every group, in the same order
                g = dist.new_group(ranks=list(part), backend="gloo", timeout=timeout)
                s = (
                    dist.new_group(ranks=list(part), backend="gloo", timeout=timeout)
                    if steps
                    else None
                )
                if domain is not None and part == domain:
                    side, step_side = g, s
            dist.destroy_process_group(world_side)
    if domain is None or side is None:
        log.info(
            "rngcheck: rank %d is outside group=%r; it is not checked across ranks", rank, cfg.group
        )
        return None
    handle.meta["rank_timeout"] = {"seconds": seconds, "from": source}
    checker = RankChecker(handle, side, domain, rank, world, seconds, step_side)
    checker.stats.setup_calls, checker.stats.setup_bytes = 1, t.numel() * t.element_size()
    handle.meta["rank_exchange"] = checker.stats.to_dict()
    return checker


def _agree(
    world_side: Any, cfg: Any, domain: tuple[int, ...] | None, world: int
) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """One start-up gather (O(world), once): every rank's group and settings, so that all ranks
    create the same side groups in the same order and refuse mismatched settings."""
    mine = [-1] * world
    for r in domain or ():
        mine[r] = 1
    settings = text_hash(
        cfg.sync,
        cfg.expect,
        str(cfg.every_ops),
        str(cfg.every_steps),
        cfg.level,
        str(cfg.sample_every),
        str(cfg.sample_first),
        str(cfg.strict),
    )
    t = torch.tensor([settings, *mine], dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=world_side)
    rows = [o.tolist() for o in out]
    if len({r[0] for r in rows}) > 1:
        raise ValueError(
            "rngcheck needs the same sync, expect, every_ops, every_steps, level, sample_every, "
            "sample_first and strict on every rank; the ranks were started with different ones "
            "(check the RNGCHECK_* environment of each rank)"
        )
    parts = sorted({tuple(i for i, v in enumerate(r[1:]) if v == 1) for r in rows} - {()})
    check_disjoint(parts)
    return parts, t


def group_timeout() -> tuple[float, str]:
    """The default process group's own timeout: the one torch.distributed's collectives would
    give up at anyway, so a rank that is slow but within it (saving a checkpoint, evaluating)
    is never reported missing. (``Backend.options._timeout``, the same on torch 2.9 to 2.14.)"""
    group = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            seconds = group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - no backend for that device, or another layout
            continue
        if seconds > 0:
            return seconds, "the process group"
    try:
        default = dist.distributed_c10d._get_default_timeout(dist.get_backend())
        return default.total_seconds(), "torch.distributed's default"
    except Exception:  # noqa: BLE001 - a torch without the helper
        return 1800.0, "torch.distributed's default"
