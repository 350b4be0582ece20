"""Readings the integrations share: a process group's or a mesh's ranks, a module's states as a
wrapper's broadcast overwrites them, and the tensor-parallel peers of a data-parallel wrapper.
torch is imported inside each function: an integration's module must import without it."""

from __future__ import annotations

import logging
import sys
from typing import Any, TypedDict

__all__ = [
    "States",
    "Unreadable",
    "group_ranks",
    "mesh_ranks",
    "peers",
    "read",
    "states",
    "tensor_parallel",
]

log = logging.getLogger(__name__)


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group (None: the default group), sorted."""
    import torch.distributed as dist

    if group is None:
        group = dist.distributed_c10d._get_default_group()
    return tuple(sorted(int(r) for r in dist.get_process_group_ranks(group)))


def mesh_ranks(mesh: Any) -> tuple[int, ...]:
    """The global ranks of a DeviceMesh, sorted."""
    return tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))


class States(TypedDict, total=False):
    tensors: frozenset[int]
    storages: frozenset[int]


def states(module: Any, buffers: bool) -> States:
    """The module's parameters (and buffers): their ids and the storages they hold now."""
    tensors: list[Any] = list(module.parameters())
    if buffers:
        tensors.extend(module.buffers())
    storages = set()
    for t in tensors:
        try:
            storages.add(t.untyped_storage().data_ptr())
        except RuntimeError:  # a tensor without storage (meta, fake): nothing was written
            continue
    storages.discard(0)
    return {"tensors": frozenset(map(id, tensors)), "storages": frozenset(storages)}


def peers(module: Any, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks that compute on this rank's batch, this one among them, for a wrapper over
    ``ranks`` (its data-parallel group) of ``module``: along the meshes of the module's DTensor
    parameters (tensor parallelism inside data parallelism: Hugging Face's ``DistributedConfig``
    with ``tp_size`` and ``fsdp_size``, ``parallelize_module`` then ``fully_shard`` or DDP), the
    ranks that differ from this one only along dims that leave the group (a dim whose ranks
    through this one meet the group here alone), the same set on each of them. () when the
    module has no such dim: its random ops are compared nowhere. Of several meshes, the one with
    the most ranks (the same choice on every rank of a program built alike)."""
    import torch.distributed as dist

    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None or not dist.is_initialized():
        return ()
    me, group = dist.get_rank(), set(ranks)
    grids: dict[int, Any] = {}
    try:
        for p in module.parameters():
            if isinstance(p, dtensor):
                mesh = p.device_mesh
                grids.setdefault(id(mesh), mesh.mesh)
    except Exception:  # noqa: BLE001 - never break the user's wrapper: no peers, as before
        log.debug("rngcheck: could not read the DTensor parameters' meshes", exc_info=True)
        return ()
    for grid in sorted(grids.values(), key=lambda g: -g.numel()):
        where = (grid == me).nonzero()
        if len(where) == 0:
            continue
        coord = where[0].tolist()
        index: list[Any] = list(coord)
        for d in range(grid.ndim):
            line = [*coord[:d], slice(None), *coord[d + 1 :]]
            through = {int(r) for r in grid[tuple(line)].flatten().tolist()}
            if len(through) > 1 and through & group == {me}:
                index[d] = slice(None)
        found = tuple(sorted(int(r) for r in grid[tuple(index)].flatten().tolist()))
        if len(found) > 1:
            return found
    return ()


def tensor_parallel(model: Any) -> bool:
    """Whether a model holds DTensor parameters (Hugging Face's ``tp_plan``, torch's
    ``parallelize_module``): its tensor-parallel peers run one computation."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return False
    try:
        return any(isinstance(p, dtensor) for p in model.parameters())
    except Exception:  # noqa: BLE001 - never break the user's call: compared, then
        return True


class Unreadable(AttributeError):
    """An attribute an integration reads on a library's object is not there: the installed
    version renamed or removed it (the hook machinery makes that a coverage warning)."""


def read(obj: Any, name: str) -> Any:
    """``obj.name``, where an integration relies on it: :class:`Unreadable` when it is not
    there (never a silent default)."""
    try:
        return getattr(obj, name)
    except AttributeError as e:
        raise Unreadable(f"{type(obj).__module__}.{type(obj).__qualname__} has no {name!r}") from e


# A stream that every rank iterates whole, keeping its share of each global batch (accelerate's
# and transformers' IterableDatasetShard): what the dataset draws as it iterates must agree.
STREAM_WHAT = (
    "{order} has every rank iterate the whole stream and keep its share of each global batch, "
    "and the ranks drew from {gen} in different states while iterating it: a draw that decides "
    "the stream's order or content (a shuffle, a shuffle buffer, a mix of sources) gives each "
    "rank its share of a different stream, so this pass over the data gives some samples to "
    "two ranks and others to none."
)
STREAM_ADVICE = (
    "Draw the dataset's randomness from a torch.Generator kept as its generator attribute, "
    "which {order} reseeds alike on every rank each pass when the dataset has no set_epoch of "
    "its own; or read the stream on one rank and broadcast the batches (accelerate's "
    "dispatch_batches=True, with batches of one size)"
)
