"""The vocabulary integrations are written in: one record type per kind of hook, each meaning one
thing under the principle (a random draw must agree across exactly the ranks over which the
state it feeds is replicated). ``ranks/hooks.py`` installs each kind; ``ranks/scopes.py`` turns
what they saw into verdicts. No torch here."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..verdict import Reason

__all__ = [
    "BroadcastRegion",
    "Frames",
    "Generate",
    "Hook",
    "Integration",
    "JoinContext",
    "ParameterBroadcast",
    "Role",
    "SeedHint",
    "ShareSplit",
    "StageInit",
    "Wrapper",
    "WrapperBroadcast",
    "WrapperForward",
    "WrapperInit",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Hook:
    """One name of another library's that rngcheck hooks: ``attribute`` of module ``module``
    (``"Class.method"`` for what is patched or known by its code, ``"Class"`` for a context
    manager whose methods are patched)."""

    module: str
    attribute: str
    label: str = ""  # how the report names the code ("torch's DistributedSampler")
    # What the scope is, in words, for the documentation's table (each kind has its own).
    says: ClassVar[str] = ""
    reason: ClassVar[Reason | None] = None

    @property
    def key(self) -> str:
        return f"{self.module}:{self.attribute}"

    @property
    def doc(self) -> str:
        """The scope it opens, in words (the documentation's table)."""
        return self.says

    @property
    def opens(self) -> Reason | None:
        """The reason of the scope it opens (None: it opens none, it only learns)."""
        return self.reason


class Role(str, enum.Enum):
    """What a function's frame on the stack says of the random ops drawn below it."""

    ORDER = "order"  # it iterates an order (a stream) that is split among the ranks
    SAMPLER = "sampler"  # it draws this rank's order of the whole dataset
    READER = "reader"  # one rank reads every rank's batches there
    FETCH = "fetch"  # a DataLoader reads a batch there, in this process
    LOADER = "loader"  # the DataLoader iterator whose fetcher is below (holds its sampler)
    SKETCH = "sketch"  # a communication hook sketches the gradients there


@dataclass(frozen=True, slots=True, kw_only=True)
class Frames(Hook):
    """A function whose frames on the stack put the random ops drawn below them in a scope
    (known by its code object: a subclass overriding it runs its own, and is not it)."""

    role: Role
    scope: Reason | None = None  # the reason given (ORDER, SPLIT, READ_ALONE, SKETCH, ...)
    what: str = ""  # what the library does with the draw ("{order}" and "{gen}" filled in)
    advice: str = ""  # how to draw it alike
    # ORDER: also where no data-parallel wrapper is known (a split is drawn before the model is
    # wrapped); else only in a data-parallel program, where the rest of the rules may leave
    # the generator uncompared by state.
    anywhere: bool = False
    # ORDER: also on a generator the ranks are known to seed apart on purpose (a per-rank
    # stream); False where a rank may draw alone from one (a split for its logs).
    on_per_rank: bool = True
    forks: bool = False  # SKETCH: it draws in a fork of the generator, undone as it returns
    # FETCH: the dataset iterator a fetcher's ``self`` runs (None: a map-style fetcher); LOADER:
    # (its dataset, its index sampler) of the DataLoader iterator that is the frame's ``self``.
    reads: Callable[[Any], Any] | None = None

    @property
    def doc(self) -> str:
        return _FRAME_SAYS[self.role]


_FRAME_SAYS = {
    Role.ORDER: "agree by state over the group, whatever moved the generator",
    Role.SAMPLER: "in a program that built pipeline stages: agree by state over the group (every "
    "stage walks this order)",
    Role.READER: "this rank's alone, with everything below it (it reads for every rank, then "
    "broadcasts)",
    Role.FETCH: "reading a batch in this process (an iterable dataset's: its collation only): "
    "this rank's own when the loader's dataset or sampler splits the data among the ranks",
    Role.LOADER: "none; names the dataset and sampler of the batch being fetched",
    Role.SKETCH: "in the backward of a wrapper that spans the group, with no tensor-parallel "
    "peers: agree by state over the group",
}


_LABELS: dict[tuple[str, tuple[int, ...]], str] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Wrapper:
    """One data-parallel wrapper (or pipeline schedule) as a hook describes it: its kind, its
    group, and what it broadcast as it was built."""

    # "DistributedDataParallel", "FullyShardedDataParallel", "fully_shard", "DeepSpeedEngine",
    # "deepspeed.zero.Init"; a pipeline schedule's class ("ScheduleGPipe"), with ``pipeline``
    kind: str
    ranks: tuple[int, ...]  # global ranks of its process group (or mesh)
    broadcasts: bool = False  # overwrote the module's states from one rank when it was built
    # Its module's parameters are whole on every rank of its group and must be equal there (DDP;
    # DeepSpeed below ZeRO-3), compared by digest at the first step; not a sharding wrapper's.
    replicates: bool = False
    # The ranks outside its group that compute on this rank's batch, this rank among them: its
    # tensor-parallel peers (() when none), along the meshes of the module's DTensor parameters.
    peers: tuple[int, ...] = ()
    # What it overwrote, as it was built: the states' ids and the storages they held then.
    tensors: frozenset[int] = field(default=frozenset(), repr=False)
    storages: frozenset[int] = field(default=frozenset(), repr=False)
    # A pipeline schedule over its stages' group: each rank runs its own layers (its stages).
    pipeline: bool = False
    stages: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    @property
    def label(self) -> str:
        """What findings call it, "DistributedDataParallel over ranks 0-3" (read at every random
        op its forward or backward draws: made once per kind and group)."""
        key = (self.kind, self.ranks)
        label = _LABELS.get(key)
        if label is None:
            from ...core.findings import format_ranks

            if len(_LABELS) >= 256:
                _LABELS.clear()
            label = _LABELS[key] = f"{self.kind} over ranks {format_ranks(self.ranks)}"
        return label

    def overwrites(self, tensor: Any) -> bool:
        """Whether this wrapper's broadcast overwrote ``tensor``, a live parameter, asked while
        the wrapper is being built: one of the module's states, or one sharing storage with
        them. By identity first, not by the address its initialisation wrote to: a parameter
        moved since (``model.to(device)`` before wrapping) holds new storage, and the address
        it left may be reused by another tensor on one rank and not on another (P5)."""
        if tensor is None:
            return False
        if id(tensor) in self.tensors:
            return True
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except RuntimeError:  # no storage (meta, fake): nothing was written
            return False
        return ptr != 0 and ptr in self.storages


# describe(module, bound arguments or None) -> the wrapper, or None (not one)
DescribeInit = Callable[[Any, Any], "Wrapper | None"]
DescribeForward = Callable[[Any], "Wrapper | None"]


@dataclass(frozen=True, slots=True, kw_only=True)
class WrapperInit(Hook):
    """A data-parallel wrapper's constructor: the wrapper is known before its own collectives
    (its broadcast of the module's states), from its arguments."""

    describe: DescribeInit
    says: ClassVar[str] = (
        "none; learns the wrapper's group as it is built, and the parameters it broadcasts "
        "(their initialisations are not compared)"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class WrapperForward(Hook):
    """A method that runs a data-parallel wrapper's forward (or a pipeline schedule's step):
    what it draws, and its backward until the next optimizer step, is this rank's own across the
    wrapper's group, and compared among its tensor-parallel peers, who share its batch.
    ``describe`` reads the wrapper of an instance (once, at its first call when it was not
    known from its constructor); ``inherited``: the class may lack the method of its own (a
    mixin whose subclasses inherit it from the module's class: it is patched all the same)."""

    describe: DescribeForward
    inherited: bool = False
    # A pipeline schedule's step: each rank runs its own layers (its stages), not its own batch.
    layers: bool = False
    # Whether a communication hook chains its backward's collectives through futures (DDP's
    # register_comm_hook): each rank's thread then sees as many of them as their timing allows,
    # so they are no exchange points until the next optimizer step.
    chains: Callable[[Any], bool] | None = None
    says: ClassVar[str] = (
        "this rank's own across the wrapper's group (its batch; a pipeline schedule's stages: "
        "its layers, own_layers), in its backward too until the optimizer step; agree by state "
        "among its tensor-parallel peers"
    )
    reason: ClassVar[Reason | None] = Reason.OWN_BATCH

    @property
    def opens(self) -> Reason | None:
        return Reason.OWN_LAYERS if self.layers else Reason.OWN_BATCH


@dataclass(frozen=True, slots=True, kw_only=True)
class WrapperBroadcast(Hook):
    """A method that broadcasts a wrapper's module from one rank, where the wrapper's group is
    known only inside its construction (DeepSpeed's engine)."""

    describe: Callable[[Any, bool], Wrapper]
    says: ClassVar[str] = (
        "none; learns the wrapper's group and the parameters it broadcasts, before the "
        "broadcast (their initialisations are not compared)"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ParameterBroadcast(Hook):
    """A method that broadcasts one parameter from one rank as it is made (ZeRO-3's
    ``zero.Init``): ``group(owner, parameter)`` is its process group."""

    group: Callable[[Any, Any], Any]
    kind: str = ""
    says: ClassVar[str] = (
        "none; the parameter it broadcasts as it is made: its initialisation is not compared"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInit(Hook):
    """A pipeline stage's constructor: its module is this rank's own layers."""

    says: ClassVar[str] = (
        "initialising the stage's parameters, before the first step: this rank's own"
    )
    reason: ClassVar[Reason | None] = Reason.STAGE_INIT


@dataclass(frozen=True, slots=True, kw_only=True)
class Generate(Hook):
    """Sampling from a model: on the module a known wrapper wraps, this rank's own (its own
    inputs); on a model no wrapper wraps, compared as the call (its first random op, by the
    state it starts from); on a model with DTensor parameters, op by op (its peers sample
    alike)."""

    says: ClassVar[str] = (
        "on the module a known wrapper wraps: this rank's own (own_samples); on another model: "
        "compared as the call, by its first draw's state, the rest this rank's own; on a model "
        "with DTensor parameters: op by op, by state"
    )
    reason: ClassVar[Reason | None] = Reason.SAMPLING


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastRegion(Hook):
    """A context manager (``attribute``: its class) that broadcasts from one rank as it exits:
    what is drawn inside it reaches the other ranks only through that broadcast, so it is the
    drawing rank's alone, whatever scope opens inside it (but a declared one).
    ``rank(region)``: the rank it broadcasts from, or None (it broadcasts nothing)."""

    rank: Callable[[Any], int | None]
    what: str = ""  # what the broadcast means for what is drawn inside ("{rank}" filled in)
    alone: str = ""  # ... said of the rank that drew there alone (after "broadcast by it")
    says: ClassVar[str] = (
        "the broadcasting rank's alone, with everything nested in it but a declared scope; as "
        "outside when it broadcasts from no rank"
    )
    reason: ClassVar[Reason | None] = Reason.BROADCAST


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinContext(Hook):
    """torch's ``Join`` (``attribute``: its class): uneven inputs. Its own points are the only
    exchange points inside it (protocol rule P7); once a rank has run out of inputs, what any
    rank draws is its own until every rank has."""

    enabled: Callable[[Any], bool]  # whether a Join is enabled
    joinables: Callable[[Any], Any]  # the objects a Join holds (named in its label)
    group: Callable[[Any], Any]  # its process group
    first: Callable[[Any], bool]  # whether a joinable is the first enabled one of its Join
    says: ClassVar[str] = (
        "over every checked rank: exchanges only at Join's own points; from a rank's running out "
        "of inputs until every rank has left it: each rank's own"
    )
    reason: ClassVar[Reason | None] = Reason.JOIN


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareSplit:
    """How a sampler or dataset that splits the data among the ranks names the split: two
    attributes, the number of ranks and this rank's index (read on ``holder`` of the object when
    given, else on the object). What a DataLoader fetches through one is this rank's own share."""

    size: str
    index: str
    holder: str = ""
    label: str = ""  # how the report names the split ("" : the object's class)


@dataclass(frozen=True, slots=True, kw_only=True)
class SeedHint:
    """Advice added to a cause about a generator the ranks seeded differently, when the draw's
    stack passes through one of ``paths`` (a library that seeds a sampler itself)."""

    paths: tuple[str, ...]
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Integration:
    """What rngcheck knows of one library: ``hooks`` (named code), ``shares`` (how its samplers
    and datasets name a split of the data) and ``hints`` (advice for causes)."""

    name: str  # unique: "torch.nn.parallel.DistributedDataParallel", "accelerate"
    library: str  # the import name of the library ("torch", "accelerate")
    distribution: str = ""  # its package, for its version ("" : the same as ``library``)
    hooks: tuple[Hook, ...] = ()
    shares: tuple[ShareSplit, ...] = ()
    hints: tuple[SeedHint, ...] = ()

    @property
    def package(self) -> str:
        return self.distribution or self.library
