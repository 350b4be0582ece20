"""torch's FSDP: ``FullyShardedDataParallel`` (FSDP1) and ``fully_shard`` (FSDP2). Each rank of
the wrapper's group (a mesh for ``fully_shard``; both groups of hybrid sharding) trains on its
own batch: what its forward and backward draw is the rank's own across the group, and compared
among its tensor-parallel peers. FSDP1 broadcasts the module's states from rank 0 only with
``sync_module_states=True``; ``fully_shard`` broadcasts nothing."""

from __future__ import annotations

from typing import Any

from . import register
from .common import group_ranks, mesh_ranks, peers, read, states
from .records import Integration, Wrapper, WrapperForward, WrapperInit

_FSDP1 = "torch.distributed.fsdp.fully_sharded_data_parallel"
_FSDP1_KIND = "FullyShardedDataParallel"
_FSDP2 = "torch.distributed.fsdp"


def _built(fsdp: Any, bound: Any) -> Wrapper:
    args = bound.arguments
    mesh = args.get("device_mesh")
    group = args.get("process_group")
    if isinstance(group, tuple):  # hybrid sharding: (intra-node, inter-node) groups
        ranks = tuple(sorted({r for g in group for r in group_ranks(g)}))
    else:
        ranks = mesh_ranks(mesh) if mesh is not None else group_ranks(group)
    broadcasts = bool(args.get("sync_module_states", False))
    held = states(args["module"], True) if broadcasts else {}
    return Wrapper(
        kind=_FSDP1_KIND,
        ranks=ranks,
        broadcasts=broadcasts,
        peers=peers(args["module"], ranks),
        **held,
    )


def _running(fsdp: Any) -> Wrapper:
    ranks = group_ranks(read(fsdp, "process_group"))
    return Wrapper(kind=_FSDP1_KIND, ranks=ranks, peers=peers(read(fsdp, "module"), ranks))


def _fully_shard(module: Any) -> Wrapper | None:
    """fully_shard's state knows the mesh of each parameter group (a list since torch 2.10, one
    optional group before); a root without parameters of its own finds it in a child."""
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)  # (only the modules it wrapped)
        if get_state is None:
            continue
        state = get_state()
        if hasattr(state, "_fsdp_param_groups"):
            groups = read(state, "_fsdp_param_groups")
        else:
            single = read(state, "_fsdp_param_group")
            groups = [single] if single is not None else []
        for group in groups:
            mesh = read(read(group, "mesh_info"), "mesh")
            if mesh is not None:
                ranks = mesh_ranks(mesh)
                return Wrapper(kind="fully_shard", ranks=ranks, peers=peers(module, ranks))
    return None


register(
    Integration(
        name="torch.distributed.fsdp",
        library="torch",
        hooks=(
            WrapperInit(
                module=_FSDP1,
                attribute=f"{_FSDP1_KIND}.__init__",
                label=_FSDP1_KIND,
                describe=_built,
            ),
            WrapperForward(
                module=_FSDP1,
                attribute=f"{_FSDP1_KIND}.forward",
                label=_FSDP1_KIND,
                describe=_running,
            ),
            # FSDPModule has no forward of its own: fully_shard makes a class over it and the
            # module's class, whose forward it inherits.
            WrapperForward(
                module=_FSDP2,
                attribute="FSDPModule.forward",
                label="fully_shard",
                describe=_fully_shard,
                inherited=True,
            ),
        ),
    )
)
