"""One checkpointed call: its forward's random ops and, once backward runs, its recompute's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.events import RandomOpEvent
from ..core.findings import Culprit, Finding, FindingKind, Side

__all__ = ["Region", "devices_of", "mismatch_finding"]


@dataclass(eq=False, slots=True, kw_only=True)
class _RegionFields:
    """One checkpointed call: its forward's random ops and, once backward runs, its recompute's."""

    number: int = 0  # the mode's count of checkpointed calls (1 for its first)
    kind: str  # "non-reentrant", "reentrant", "custom" or "torch_xla"
    name: str = ""  # a given name ("" for torch's: "checkpoint #12")
    # "train.py:40": the user's line that entered the region ("" for a layer's region between
    # sampled steps of level="step": its layer names it)
    site: str
    module: str = ""  # the checkpointed layer: "model.layers.3 (LlamaDecoderLayer)"
    held: Any = None  # a weak reference to that layer (None: the function is no module's)
    # Module.train()/eval() calls that switched the layer's modules while the region waited
    # for its recompute (switches.Switch; switches.py keeps them)
    switches: tuple[Any, ...] = ()
    modes: dict[int, bool] | None = None  # its modules' training flags in its forward, by id
    preserve_rng_state: bool | None = True  # None: unknown (custom checkpoint functions)
    # torch.compile's checkpoint operator ran the region as captured, with the
    # preserve_rng_state=False it always passes (a backend without AOT autograd: "eager")
    by_compile: bool = False
    devices: tuple[str, ...] = ()  # device types of the tensor arguments (what torch stashes)
    # torch stops the recompute once the saved tensors are back (torch.utils.checkpoint's
    # non-reentrant early stop, by the call's argument or torch's global switch)
    early_stop: bool = False
    forward: list[RandomOpEvent] = field(default_factory=list)
    recompute: list[RandomOpEvent] = field(default_factory=list)
    failed: bool = False  # a mismatch was reported: do not report this region again
    truncated: bool = False
    selective: bool = False  # selective checkpointing: a cache may answer ops in the recompute
    probed: Any = None  # level="step": the forward's generator states at entry and exit
    # level="step": the forward was watched by its generator states (between sampled steps),
    # not op by op; a recompute watched the other way (the level changed at an optimizer step
    # between them: a second optimizer, a GAN's discriminator) has nothing to be compared with.
    by_probe: bool = False
    unpaired: bool = False
    # A recompute runs inside the region's own forward (torch.autograd.grad in the checkpointed
    # function): it may run ahead of the forward, whose length is not known yet.
    replaying: bool = False
    # The recompute's ops whose outputs are compared once the recompute ends: their digests wait
    # on the device (a CUDA or XLA output), fetched together there, not synced one op at a time.
    outputs_due: list[int] = field(default_factory=list)

    @property
    def title(self) -> str:
        name = self.name or (f"checkpoint #{self.number}" if self.number else "checkpoint")
        layer = f" of {self.module}" if self.module else ""
        at = f" at {self.site}" if self.site else ""
        return f"{name} ({self.kind}){layer}{at}"

    @property
    def where(self) -> str:
        """What tells this region's checkpointed code apart: its given name and its line, else
        its layer."""
        return f"{self.name}@{self.site or self.module}"

    @property
    def custom(self) -> bool:
        """The checkpoint is not torch.utils.checkpoint: causes name its own restore."""
        return self.kind in ("custom", "torch_xla", "inferred")


class Region(_RegionFields):
    """One checkpointed call: its forward's random ops and, once backward runs, its recompute's.
    (Slotted, and weakly referable: the tracker holds regions that wait for their recompute
    weakly; ``weakref_slot`` needs Python 3.11.)"""

    __slots__ = ("__weakref__",)


def mismatch_finding(
    region: Region,
    k: int,
    f: RandomOpEvent | None,
    r: RandomOpEvent | None,
    differs: str,
    detail: str,
    cause: str,
    culprits: tuple[Culprit, ...] = (),
) -> Finding:
    """The recompute_mismatch of ``region`` at its random op ``k``: the forward's event ``f`` and
    the recompute's ``r`` (either None when that pass ran no random op there); ``culprits``: the
    calls ``cause`` names."""
    shown = r if r is not None else f
    assert shown is not None
    return Finding(
        kind=FindingKind.RECOMPUTE_MISMATCH,
        message=f"random op #{k} of {region.title}: {detail}",
        op=shown.op,
        cause=cause,
        differs=differs,
        region=region.title,
        stack=(f or shown).stack,
        other_stack=r.stack if r is not None else None,
        sides=(
            Side(label="forward", event=f, note="" if f else "ran no random op here"),
            Side(label="recompute", event=r, note="" if r else "ran no random op here"),
        ),
        seq=shown.seq,
        context=tuple(region.forward[max(0, k - 4) : k + 2]),
        culprits=culprits,
    )


def devices_of(args: tuple) -> tuple[str, ...]:
    """The device types of the tensors among ``args``, sorted (``is_cpu`` is a tenth of the
    cost of ``device.type``)."""
    found: tuple[str, ...] = ()
    for a in args:
        if isinstance(a, torch.Tensor):
            kind = "cpu" if a.is_cpu else a.device.type
            if not found:
                found = (kind,)
            elif kind not in found:
                found = tuple(sorted((*found, kind)))
    return found
