"""torch_xla support, the generator half: the XLA seed as a generator and its seeding calls.

Loaded by :class:`~rngcheck.RNGConsistencyMode` only when the user has already imported torch_xla
(importing it here would start an XLA runtime in processes that never asked for one).

The XLA RNG is not a ``torch.Generator``: it is one 64-bit running seed per device, kept on the
host (``xm.get_rng_state(device)``). Every random op advances it without running the graph, so an
op's seed before and after is readable at once and costs no device sync; its digest is the blake2b
of those 8 bytes, the same kind of 64-bit digest as every other generator's, so it flows to the
recompute and cross-rank comparisons unchanged (generator "default xla:0").

Every ``mark_step``/``sync`` resets the seed to a value derived from the previous step's root seed,
whatever number of random ops ran. That is a state change between two ops; it is attributed to the
sync call (watched here like a seeding API) and is never a finding by itself: comparisons are per
op, forward op k against recompute op k, rank A's op k against rank B's.

torch_xla's activation checkpointing is the recompute check's business (``recompute/xla.py``).
"""

from __future__ import annotations

import os

import torch
import torch_xla
import torch_xla.core.xla_model as xm

from .digest import bytes_digest
from .generators import DeviceAdapter, register_device_adapter
from .seeding import register_library_dir, register_seed_api

__all__ = ["seed_digest"]

_MASK64 = (1 << 64) - 1


def _canonical(device: torch.device) -> str:
    """``xla`` -> ``xla:0`` (the default device), so one seed has one name in reports."""
    if device.index is not None:
        return f"{device.type}:{device.index}"
    return str(torch_xla._XLAC._xla_get_default_device())


def seed_digest(seed: int) -> int:
    """The 64-bit digest of an XLA seed (a host int, read as unsigned 64 bits)."""
    return bytes_digest((seed & _MASK64).to_bytes(8, "little"))


def _digest(handle: str) -> int:
    # The device is always passed: checkpoint recomputes run on an autograd worker thread, whose
    # "default device" is not necessarily the one the op ran on.
    return seed_digest(xm.get_rng_state(handle))


def _seed_argument(args: tuple, kwargs: dict) -> str:
    seed = args[0] if args else kwargs.get("seed", "")
    device = args[1] if len(args) > 1 else kwargs.get("device")
    return f"{seed}, device={device}" if device is not None else str(seed)


def _no_argument(_args: tuple, _kwargs: dict) -> str:
    return ""


register_device_adapter("xla", DeviceAdapter(_canonical, _digest, current=_canonical))
# Calls from torch_xla's own files (its checkpoint's restore, xm.fork_rng, the sync inside
# MpDeviceLoader or optimizer_step) are the library's, not the user's line to blame.
register_library_dir(os.path.dirname(os.path.abspath(torch_xla.__file__)) + os.sep)
register_seed_api("torch_xla.core.xla_model", "set_rng_state", "xla", _seed_argument)
# The syncs reset the seed; watching them explains a state change across a step, as the
# library's own (library=True), never a user's seed to blame. torch_xla.torch_xla.sync is what
# torch_xla.step() calls; xm.mark_step calls torch_xla.sync.
for _module, _name in (
    ("torch_xla.core.xla_model", "mark_step"),
    ("torch_xla", "sync"),
    ("torch_xla.torch_xla", "sync"),
):
    register_seed_api(_module, _name, "xla", _no_argument, library=True)
