"""Why a checkpoint recompute differs from its forward: the first element that differs, and the
likely cause in words.

Structure before values: the op, then its arguments, then the generator, then the generator's
state, then the output. The likely cause is the first row of :data:`CAUSES` whose condition holds
for the evidence the two events carry (their out-of-band seeding calls, the region's kind and
settings): read the table top to bottom to see which explanation wins over which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from ..core.events import RandomOpEvent, SeedCall
from ..core.findings import Culprit, CulpritKind, Likely, culprits_of
from .region import Region
from .switches import Switch, standing

__all__ = [
    "CAUSES",
    "Cause",
    "Evidence",
    "compiled_checkpoint_cause",
    "control_flow",
    "control_flow_cause",
    "first_difference",
    "likely_cause",
    "output_difference",
]


# Seeding APIs that reseed (as opposed to set_rng_state, which swaps a saved state in).
_RESEED_APIS = ("manual_seed", "manual_seed_all", "seed", "seed_all")


def first_difference(f: RandomOpEvent, r: RandomOpEvent, outputs: bool = True) -> tuple[str, str]:
    """Structure before values: op, arguments, generator, then state, then output (unless
    ``outputs`` is False: :func:`output_difference` compares them later)."""
    if f.op != r.op:
        return "op", f"the forward ran {f.op} here, the recompute ran {r.op}"
    if f.args != r.args:
        changed = _arg_changes(f.op, f.args, r.args)
        detail = f"{f.op} was called with different arguments: " + "; ".join(changed)
        if f.op.startswith("aten.bernoulli"):
            detail += " (for dropout, bernoulli's p is the keep probability, 1 - dropout p)"
        return "argument", detail
    # A Generator made inside the region is a new object in each pass; it only matters when the
    # two draw from different states.
    same_state = f.before is not None and f.before == r.before
    if f.generator.key != r.generator.key and not same_state:
        return "generator", (
            f"{f.op} drew from {f.generator.label} in the forward but from "
            f"{r.generator.label} in the recompute"
        )
    if r.cached:
        return "", ""
    if f.before is not None and r.before is not None and f.before != r.before:
        return "state", (
            f"{f.op} drew from {r.generator.label} in a different state than in the forward "
            f"(state digest {f.before & 0xFFFFFFFFFFFFFFFF:016x} vs "
            f"{r.before & 0xFFFFFFFFFFFFFFFF:016x}), so it drew different random numbers"
        )
    return output_difference(f, r) if outputs else ("", "")


def output_difference(f: RandomOpEvent, r: RandomOpEvent) -> tuple[str, str]:
    """The last of :func:`first_difference`'s questions: did the same draw make another output?"""
    fo, ro = f.output_digest, r.output_digest
    if fo is not None and ro is not None and fo != ro:
        return "output", f"{f.op} produced a different output than in the forward"
    return "", ""


def _arg_changes(op: str, fwd: tuple[str, ...], rec: tuple[str, ...]) -> list[str]:
    """``p=0.5 (forward) vs p=0.7 (recompute)``: tensors by position, scalars by name.

    The dispatcher leaves out arguments equal to their default, so a side without a named
    argument had the schema's default there.
    """
    f_pos = [a for a in fwd if "=" not in a]
    r_pos = [a for a in rec if "=" not in a]
    f_named = dict(a.split("=", 1) for a in fwd if "=" in a)
    r_named = dict(a.split("=", 1) for a in rec if "=" in a)
    changes = [
        f"argument {i}: {a} (forward) vs {b} (recompute)"
        for i, (a, b) in enumerate(zip(f_pos, r_pos, strict=False))
        if a != b
    ]
    if len(f_pos) != len(r_pos):
        changes.append(f"{len(f_pos)} tensor argument(s) (forward) vs {len(r_pos)} (recompute)")
    for name in [*f_named, *(n for n in r_named if n not in f_named)]:
        a = f_named.get(name) or _schema_default(op, name)
        b = r_named.get(name) or _schema_default(op, name)
        if a != b:
            changes.append(f"{name}={a} (forward) vs {name}={b} (recompute)")
    return changes or [f"{list(fwd)} vs {list(rec)}"]


def _schema_default(op: str, name: str) -> str:
    """The default of argument ``name`` of ``aten.bernoulli_.float``, as text ("?" if unknown)."""
    try:
        namespace, packet, overload = op.split(".")
        schema = getattr(getattr(getattr(torch.ops, namespace), packet), overload)._schema
        for arg in schema.arguments:
            if arg.name == name and arg.has_default_value():
                return str(arg.default_value)
    except (AttributeError, ValueError, RuntimeError):
        pass
    return "<default>"


def control_flow_cause() -> str:
    return (
        "the region's control flow differs between forward and recompute: a branch on a value "
        "that changed after the forward (a global flag, model.training, a step counter) or on a "
        "random number drawn outside the region. Make the region depend only on its inputs."
    )


def control_flow(region: Region) -> Likely:
    """Why the region's passes ran different random ops: a ``train()``/``eval()`` call that
    switched its modules between them (``switches.py``), else control flow in general."""
    switch = standing(region)
    if switch is not None:
        return _switched(switch)
    return Likely(control_flow_cause())


def _switched(switch: Switch) -> Likely:
    mode = "training" if switch.training else "evaluation"
    passes = ("in the recompute but not in the forward", "in the forward but not in the recompute")
    text = (
        f"{switch.call} at {switch.stack.describe()} switched the checkpointed modules to {mode} "
        "mode after the forward and before the recompute: a checkpoint recomputes with the "
        "modules as they are when backward runs, so the random ops that run only in training "
        f"mode (dropout) ran {passes[0] if switch.training else passes[1]}, and the gradients "
        "were computed through another forward than the one the loss came from. Switch modes "
        "after loss.backward() (or before the forward), not between them."
    )
    return Likely(text, (Culprit(kind=CulpritKind.MODE, call=switch.call, stack=switch.stack),))


@dataclass(frozen=True)
class Evidence:
    """What a mismatch shows: the region, the position, both events, what differs first."""

    region: Region
    k: int
    f: RandomOpEvent
    r: RandomOpEvent
    differs: str

    @property
    def gen(self) -> str:
        return self.r.generator.label

    @cached_property
    def cached_before(self) -> list[RandomOpEvent]:
        """Earlier recompute ops on the same generator that a selective-checkpoint cache served."""
        key = self.r.generator.key
        return [e for e in self.region.recompute[: self.k] if e.cached and e.generator.key == key]

    @cached_property
    def reseeds(self) -> list[SeedCall]:
        return [c for c in _user_calls(self.r) if _is_reseed(c)]

    @cached_property
    def swaps_forward(self) -> list[SeedCall]:
        return [c for c in _user_calls(self.f) if not _is_reseed(c)]

    @cached_property
    def swaps_recompute(self) -> list[SeedCall]:
        return [c for c in _user_calls(self.r) if not _is_reseed(c)]

    @property
    def device_type(self) -> str:
        return self.r.generator.device.split(":")[0]

    @property
    def not_preserved(self) -> bool:
        return self.region.preserve_rng_state is False and self.r.generator.is_default


def _nobody(_e: Evidence) -> tuple[Culprit, ...]:
    return ()


@dataclass(frozen=True)
class Cause:
    """One row of the table: when it applies, what it says, and the calls it blames (the ones
    its words name with their line)."""

    name: str
    when: Callable[[Evidence], bool]
    says: Callable[[Evidence], str]
    blames: Callable[[Evidence], tuple[Culprit, ...]] = _nobody


def _sac(e: Evidence) -> str:
    first = e.cached_before[0]
    return (
        f"selective activation checkpointing saved the output of {first.op} (random op "
        f"#{e.region.recompute.index(first)}, at {first.site}) instead of recomputing it, so in "
        f"the recompute it did not draw from {e.gen} and every later random op draws from a "
        "shifted state. Make the policy return PREFER_RECOMPUTE/MUST_RECOMPUTE for random ops, "
        "or save all of them."
    )


def _reseeded(e: Evidence) -> str:
    forward = [c for c in _user_calls(e.f) if _is_reseed(c)]
    return _reseed_cause(e.gen, e.reseeds, forward)


def _unknown_checkpoint(e: Evidence) -> str:
    driver = e.region.name.removeprefix("recompute by ")
    return (
        f"a checkpoint rngcheck does not know re-ran the forward's random ops in backward "
        f"({driver}) without restoring {e.gen} to its forward state, so the recompute drew the "
        f"next numbers instead of the same ones. Stash {e.gen}'s state in the forward "
        "(torch.get_rng_state(), or get_state() of the generator) and restore it before "
        "re-running the block, or use torch.utils.checkpoint."
    )


def _swapped_alike(e: Evidence) -> bool:
    """A state was swapped in at the same line in both passes: a named stream's fork()."""
    fwd = {_where(c) for c in e.swaps_forward}
    return bool(e.swaps_recompute) and bool(fwd & {_where(c) for c in e.swaps_recompute})


CAUSES: tuple[Cause, ...] = (
    Cause(
        "argument changed",
        lambda e: e.differs == "argument",
        lambda e: (
            "an argument of the random op changed between forward and backward: a value "
            "read from outside the region (a dropout probability from a schedule, a global) was "
            "updated before backward. Pass it into the checkpointed function as an input, or "
            "change it only after backward."
        ),
    ),
    Cause(
        "train()/eval() between the passes",
        lambda e: e.differs == "op" and standing(e.region) is not None,
        lambda e: control_flow(e.region).text,
        lambda e: control_flow(e.region).culprits,
    ),
    Cause("control flow", lambda e: e.differs == "op", lambda e: control_flow_cause()),
    Cause(
        "generator chosen at run time",
        lambda e: e.differs == "generator",
        lambda e: (
            "the region picks its generator at run time (by device, by a global, by a "
            "tracker's current stream, or makes a new torch.Generator with a different seed in "
            "each pass), and the choice changed before the recompute. Pick the generator from the "
            "region's inputs, or pass it in as an argument."
        ),
    ),
    Cause(
        "input changed",
        lambda e: e.differs == "output",
        lambda e: (
            "same op, arguments and generator state, but a different output, so the op's "
            "input tensor differed: a tensor the region reads from outside its arguments (a "
            "global, a buffer) was changed in place between forward and backward, or a "
            "nondeterministic op earlier in the region fed it, or the kernel does not draw "
            "deterministically from its state. Pass such tensors in as arguments, and change "
            "them only after backward."
        ),
    ),
    # From here on the generator's state differed.
    Cause("selective checkpointing saved a random op", lambda e: bool(e.cached_before), _sac),
    Cause(
        "torch_xla seed not restored",
        lambda e: e.region.kind == "torch_xla" and e.r.generator.device.startswith("xla"),
        lambda e: _xla_cause(e.region, e.gen),
    ),
    Cause(
        "reseeded inside the region",
        lambda e: bool(e.reseeds),
        _reseeded,
        lambda e: culprits_of(e.reseeds[-1:]),
    ),
    Cause(
        "named stream swapped in",
        _swapped_alike,
        lambda e: _stream_cause(e.gen, e.swaps_recompute[-1]),
        lambda e: culprits_of(e.swaps_recompute[-1:]),
    ),
    Cause(
        "a checkpoint rngcheck does not know",
        lambda e: e.region.kind == "inferred",
        _unknown_checkpoint,
    ),
    Cause(
        "custom checkpoint marked restores_rng=False",
        lambda e: e.not_preserved and e.region.custom,
        lambda e: (
            f"the custom checkpoint region was marked restores_rng=False, so {e.gen} was "
            "not restored before the recompute: the recompute continues the stream instead of "
            "replaying it. Stash the generator's state before the forward and restore it before "
            "recomputing."
        ),
    ),
    Cause(
        "torch.compile's checkpoint run without AOT autograd",
        lambda e: e.not_preserved and e.region.by_compile,
        lambda e: f"{compiled_checkpoint_cause(e.gen)}.",
    ),
    Cause(
        "preserve_rng_state=False",
        lambda e: e.not_preserved,
        lambda e: (
            f"the region was checkpointed with preserve_rng_state=False, so {e.gen} was "
            "not stashed and restored: the recompute continues the stream instead of replaying it. "
            "Use preserve_rng_state=True (the default) for regions with random ops."
        ),
    ),
    Cause(
        "user generator in a custom checkpoint",
        lambda e: not e.r.generator.is_default and e.region.custom,
        lambda e: (
            f"{e.gen} was passed as generator= and the custom checkpoint did not restore "
            "its state before the recompute. Save it with get_state() in the forward and "
            "set_state() it before recomputing."
        ),
    ),
    Cause(
        "user generator",
        lambda e: not e.r.generator.is_default,
        lambda e: (
            f"{e.gen} was passed as generator=; torch.utils.checkpoint stashes and "
            "restores only the default CPU generator and the default generator of the tensor "
            "arguments' device, so the recompute draws the next numbers from it instead of the "
            "same ones. Save its state with get_state() before the region and set_state() it at "
            "the start of the checkpointed function, or draw this randomness outside the region."
        ),
    ),
    Cause(
        "device generator not stashed",
        lambda e: (
            not e.region.custom and e.device_type != "cpu" and e.device_type not in e.region.devices
        ),
        lambda e: (
            f"{e.gen} is used only inside the checkpointed function: torch.utils.checkpoint "
            "stashes the CPU generator and the default generator of its tensor arguments' device "
            f"({', '.join(e.region.devices) or 'none'}) only. Pass a {e.device_type} tensor as an "
            "argument, or seed that generator inside the function."
        ),
    ),
    # The recompute drew from a state the forward left this generator in, although the
    # checkpoint restored the generator at the region's start: something inside the region
    # swapped a saved state in, and that saved state was not rewound. (A custom checkpoint that
    # restores nothing continues the stream too; without a swap seen, blame it.)
    Cause(
        "stream continued",
        lambda e: (
            _continues_forward(e.region, e.r) and (not e.region.custom or bool(e.swaps_forward))
        ),
        lambda e: _stream_cause(e.gen, e.swaps_forward[-1] if e.swaps_forward else None),
        lambda e: culprits_of(e.swaps_forward[-1:]),
    ),
    Cause(
        "custom checkpoint did not restore",
        lambda e: e.region.custom,
        lambda e: (
            f"the custom checkpoint did not restore {e.gen} to its forward state before the "
            "recompute. Stash it with get_state() before the forward and restore it with "
            "set_state() before recomputing."
        ),
    ),
    Cause(
        "state changed out of view",
        lambda e: True,
        lambda e: (
            f"{e.gen} was in a different state at this op than in the forward although the "
            "region's start was restored: something inside the region drew from it in one pass "
            "only (an op outside the checker's view, another thread), or it was set with "
            "Generator.set_state."
        ),
    ),
)


def likely_cause(
    region: Region, k: int, f: RandomOpEvent, r: RandomOpEvent, differs: str
) -> Likely:
    """The first row of :data:`CAUSES` that applies: its words and the calls it blames."""
    evidence = Evidence(region, k, f, r, differs)
    row = next(c for c in CAUSES if c.when(evidence))
    return Likely(row.says(evidence), row.blames(evidence))


def compiled_checkpoint_cause(label: str) -> str:
    """Why a region that torch.compile's checkpoint operator ran as captured did not replay
    ``label`` (no final full stop)."""
    return (
        "torch.compile captured this torch.utils.checkpoint call as its checkpoint operator "
        "(tag_activation_checkpoint), which always runs the region with preserve_rng_state=False "
        "and leaves replaying the forward's random numbers to AOT autograd and inductor; the "
        'backend ran the captured graph as it is (backend="eager" does, and so does a custom '
        f"backend that calls the GraphModule), so nothing stashed and restored {label}: the "
        "recompute continues the stream instead of replaying it, and the gradients belong to "
        'masks the forward never applied (this operator under backend="eager": pytorch '
        'issue 160773). Compile with backend="aot_eager" or "inductor", or checkpoint outside '
        "the compiled function (a compiled function inside torch.utils.checkpoint is restored "
        "like any other)"
    )


def _xla_cause(region: Region, label: str) -> str:
    if region.preserve_rng_state is False:
        return (
            f"the torch_xla checkpoint ran with preserve_rng_state=False, so the XLA seed of "
            f"{label} (xm.get_rng_state) was not saved and restored: the recompute continues "
            "the seed instead of replaying it. Use preserve_rng_state=True for regions with "
            "random ops."
        )
    return (
        f"the XLA seed of {label} was not restored before the recompute. The XLA RNG is one "
        "running seed per device that torch.random.fork_rng does not cover: the checkpoint "
        "must save xm.get_rng_state(device) in the forward and xm.set_rng_state(seed, device) "
        "before recomputing (the bug fixed by pytorch/xla PR 4690). Upgrade torch_xla, or "
        "restore the seed in your checkpoint function."
    )


def _user_calls(e: RandomOpEvent) -> tuple[SeedCall, ...]:
    return e.out_of_band.user_calls if e.out_of_band is not None else ()


def _where(call: SeedCall) -> str:
    return call.stack.describe()


def _is_reseed(call: SeedCall) -> bool:
    return call.api.rsplit(".", 1)[-1] in _RESEED_APIS


def _continues_forward(region: Region, r: RandomOpEvent) -> bool:
    key = r.generator.key
    return r.before is not None and any(
        e.after == r.before for e in region.forward if e.generator.key == key and not e.cached
    )


def _reseed_cause(label: str, in_recompute: list[SeedCall], in_forward: list[SeedCall]) -> str:
    call = in_recompute[-1]
    before = [c for c in in_forward if _where(c) == _where(call)] or in_forward
    forward = (
        f"; in the forward it was {before[-1].api}({before[-1].argument})"
        if before
        else "; the forward ran no such call"
    )
    return (
        f"{label} was reseeded inside the checkpointed region: {call.text} in the "
        f"recompute{forward}. A seed computed from something that changed after the forward "
        "(a step counter, the clock, a global) makes the two passes draw different numbers. "
        "Seed outside the checkpointed function, or pass the seed in as an argument."
    )


def _stream_cause(label: str, swap: SeedCall | None) -> str:
    how = f" by {swap.text}" if swap is not None else ""
    return (
        f"{label} drew in the recompute from the state the forward left it in: a state swapped "
        f"in{how} from a named RNG stream (a Megatron-style tracker's fork()) that the "
        "checkpoint did not rewind. torch.utils.checkpoint restores the default generator at "
        "the region's start, not the tracker's saved stream states, so the recompute continues "
        "the stream instead of replaying it. Save the tracker's states before the region and "
        "restore them before the recompute (as Megatron's CheckpointFunction does with "
        "get_states()/set_states()), or use the tracker's own checkpoint function."
    )
