"""Which ranks an expectation spans: a group given as a ProcessGroup, a list of ranks, a DeviceMesh
or mesh dimension names, resolved to this rank's partition of it (sorted global ranks)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch.distributed as dist

__all__ = [
    "GroupResolver",
    "MeshOp",
    "Spans",
    "check_disjoint",
    "is_mesh",
    "op_mesh",
    "resolve_group",
]

_MAX_GROUPS = 256  # resolved group specs kept


class MeshOp(NamedTuple):
    """A DTensor op's DeviceMesh and the placements of its first DTensor argument over it."""

    mesh: Any
    placements: tuple[Any, ...]


def op_mesh(args: tuple, kwargs: dict) -> MeshOp | None:
    """The DeviceMesh of an op's first DTensor argument, with that argument's placements; None
    when the op has no DTensor argument."""
    for v in (*args, *kwargs.values()):
        mesh = getattr(v, "device_mesh", None)
        if mesh is not None:
            placements = getattr(v, "placements", None)
            if placements is not None:
                return MeshOp(mesh, tuple(placements))
    return None


def is_mesh(spec: Any) -> bool:
    return hasattr(spec, "mesh") and hasattr(spec, "mesh_dim_names") and hasattr(spec, "ndim")


def _mesh_slice(mesh: Any, dims: Sequence[str], rank: int) -> tuple[int, ...] | None:
    """The ranks of ``mesh`` that share this rank's coordinates outside ``dims``."""
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [d for d in dims if d not in names]
    if unknown:
        raise ValueError(
            f"mesh dimension(s) {unknown} are not in the DeviceMesh's dimensions {names}; "
            "name dimensions of the mesh the op runs on"
        )
    ranks = mesh.mesh
    where = (ranks == rank).nonzero()
    if where.numel() == 0:
        return None
    coord = where[0].tolist()
    index = tuple(slice(None) if names[i] in dims else coord[i] for i in range(len(names)))
    return tuple(sorted(int(r) for r in ranks[index].flatten().tolist()))


def resolve_group(spec: Any, rank: int, world: int, mesh: Any = None) -> tuple[int, ...] | None:
    """This rank's partition of ``spec`` (sorted ranks), or None when the rank is not a member.

    ``spec``: None (``mesh``'s ranks, or the world), a ProcessGroup, a list of ranks, a
    DeviceMesh, or mesh dimension names (resolved against ``mesh``, or ``spec`` the DeviceMesh).
    """
    if spec is None:
        ranks = mesh.mesh.flatten().tolist() if mesh is not None else range(world)
    elif isinstance(spec, dist.ProcessGroup):
        ranks = dist.get_process_group_ranks(spec)
    elif is_mesh(spec):
        ranks = spec.mesh.flatten().tolist()
    elif isinstance(spec, str) or (
        isinstance(spec, (list, tuple)) and spec and all(isinstance(d, str) for d in spec)
    ):
        dims = (spec,) if isinstance(spec, str) else tuple(spec)
        if mesh is None:
            raise ValueError(
                f"group={spec!r} names mesh dimensions, but there is no DeviceMesh to find them "
                "in: pass the DeviceMesh (mesh['tp']) instead, or use the names inside DTensor "
                "ops (they resolve against the op's own mesh)"
            )
        return _mesh_slice(mesh, dims, rank)
    elif isinstance(spec, (list, tuple, range)) and all(isinstance(r, int) for r in spec):
        ranks = spec
    elif spec == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    else:
        raise TypeError(
            "an rngcheck group must be None, a ProcessGroup, a list of ranks, a DeviceMesh or "
            f"mesh dimension names; got {type(spec).__name__} {spec!r}"
        )
    members = tuple(sorted({int(r) for r in ranks}))
    return members if rank in members else None


def check_disjoint(parts: list[tuple[int, ...]]) -> None:
    seen: dict[int, tuple[int, ...]] = {}
    for part in parts:
        for r in part:
            if r in seen:
                raise ValueError(
                    f"rngcheck: the ranks passed overlapping groups {seen[r]} and {part} as "
                    "group=; each rank's group must be a partition of the world (the same list on "
                    "every rank, or one DeviceMesh dimension)"
                )
            seen[r] = part


class GroupResolver:
    """Resolves the group specs of ``expect`` blocks and DTensor meshes for one rank, cached (a
    training loop names the same few groups at every step), each bad spec warned about once."""

    def __init__(self, rank: int, world: int, domain: tuple[int, ...]) -> None:
        self.rank = rank
        self.world = world
        self._domain = domain
        self._domain_set = frozenset(domain)
        self._groups: dict[Any, tuple[Any, tuple[int, ...] | None]] = {}
        self._warned_specs: set[str] = set()

    def members(self, spec: Any, mesh: Any) -> tuple[int, ...] | None:
        plain = isinstance(spec, (str, list, tuple, range))
        key = (
            tuple(spec) if plain and not isinstance(spec, str) else spec if plain else id(spec),
            id(mesh),
        )
        hit = self._groups.get(key)
        if hit is None:
            if len(self._groups) >= _MAX_GROUPS:  # groups made afresh in a loop: do not grow
                self._groups.clear()
            try:
                members = resolve_group(spec, self.rank, self.world, mesh)
            except (TypeError, ValueError) as e:
                text = str(e)
                if text not in self._warned_specs:
                    self._warned_specs.add(text)
                    warnings.warn(
                        f"rngcheck: {text}; checking over the mode's group instead", stacklevel=4
                    )
                members = self._domain
            if members is not None:
                members = tuple(r for r in members if r in self._domain_set)
                if len(members) < 2:
                    members = None
            hit = self._groups[key] = ((spec, mesh), members)  # refs keep the ids from reuse
        return hit[1]


class Spans:
    """Whether a collective (its op's ``args``) runs over every rank of ``domain``. One over a
    subgroup (a data-parallel group beside pipeline stages, a tensor-parallel group) runs on its
    ranks only, while the others send, receive or compute: waiting for them there would hang
    until the timeout. True when the op names no process group. Cached per group name."""

    def __init__(self, domain: tuple[int, ...]) -> None:
        self._domain = domain
        self._spans: dict[str, bool] = {}

    def __call__(self, args: tuple) -> bool:
        import torch

        for arg in args:
            if not isinstance(arg, torch.ScriptObject):
                continue
            try:
                group = dist.ProcessGroup.unbox(arg)
            except RuntimeError:  # another kind of object (a ReduceOp)
                continue
            name = group.group_name
            spans = self._spans.get(name)
            if spans is None:
                try:
                    ranks = set(dist.get_process_group_ranks(group))
                except (KeyError, ValueError, RuntimeError):  # a group c10d does not list
                    return True  # (aligned on, as every collective was)
                spans = self._spans[name] = ranks.issuperset(self._domain)
            return spans
        return True
