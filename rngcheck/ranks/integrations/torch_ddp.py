"""torch's ``DistributedDataParallel``: each rank of its group trains on its own batch, so what its
forward and backward draw (dropout, drop-path, a checkpoint's recompute) is the rank's own across
the group, and compared among its tensor-parallel peers. It broadcasts the module's states from
rank 0 as it is built (unless ``init_sync=False``): the parameters' initialisations are then
overwritten, and not compared; the parameters it holds whole on every rank of its group are
compared by digest at the first step instead. A communication hook registered in Python chains
its backward's collectives through futures: they are no exchange points (``chains``)."""

from __future__ import annotations

from typing import Any

from . import register
from .common import group_ranks, mesh_ranks, peers, read, states
from .records import Integration, Wrapper, WrapperForward, WrapperInit

_MODULE = "torch.nn.parallel.distributed"
_KIND = "DistributedDataParallel"


def _built(ddp: Any, bound: Any) -> Wrapper:
    """From the constructor's arguments: its group (a mesh, or a process group), whether it
    broadcasts the module's states (and buffers), and its peers."""
    args = bound.arguments
    mesh = args.get("device_mesh")
    ranks = mesh_ranks(mesh) if mesh is not None else group_ranks(args.get("process_group"))
    broadcasts = bool(args.get("init_sync", True))
    module = args["module"]
    buffers = args.get("broadcast_buffers") is not False
    held = states(module, buffers) if broadcasts else {}
    return Wrapper(
        kind=_KIND,
        ranks=ranks,
        broadcasts=broadcasts,
        replicates=True,
        peers=peers(module, ranks),
        **held,
    )


def _running(ddp: Any) -> Wrapper:
    """One built before the mode: its group is all that matters now."""
    ranks = group_ranks(read(ddp, "process_group"))
    return Wrapper(
        kind=_KIND, ranks=ranks, replicates=True, peers=peers(read(ddp, "module"), ranks)
    )


def _chains(ddp: Any) -> bool:
    """A communication hook registered in Python (PowerSGD's, a user's, the one DDP's
    ``mixed_precision`` registers) runs its backward's bucket all-reduces."""
    return bool(read(ddp, "_comm_hooks"))


register(
    Integration(
        name="torch.nn.parallel.DistributedDataParallel",
        library="torch",
        hooks=(
            WrapperInit(
                module=_MODULE, attribute=f"{_KIND}.__init__", label=_KIND, describe=_built
            ),
            WrapperForward(
                module=_MODULE,
                attribute=f"{_KIND}.forward",
                label=_KIND,
                describe=_running,
                chains=_chains,
            ),
        ),
    )
)
