"""Data parallelism: which random ops act on each rank's own batch, and which module states a
wrapper overwrites from one rank.

Under ``DistributedDataParallel``, ``FullyShardedDataParallel`` and ``fully_shard`` the ranks of
the wrapper's group see different data on purpose, so the random ops of the wrapped module's
forward and backward (dropout masks, drop-path) need not agree across that group. While a mode is
active, this tracker wraps the wrappers' ``forward`` (at the class: existing instances are covered)
and, for the ones that broadcast module states at construction (DDP unless ``init_sync=False``;
FSDP with ``sync_module_states=True``), their ``__init__``, so the rank checker learns *before* the
broadcast which parameters it will overwrite. ``fully_shard`` broadcasts nothing: its group is
learnt from the first forward. DeepSpeed's engine is learnt when it broadcasts the model (its group
is made inside its construction), and ``deepspeed.zero.Init`` from each parameter's broadcast.

Where the wrapped module's DTensor parameters span ranks outside the wrapper's group (tensor
parallelism inside data parallelism: Hugging Face's ``DistributedConfig`` with ``tp_size`` and
``fsdp_size``, ``parallelize_module`` then ``fully_shard``), the ranks that differ from this one
only along those dimensions compute on its batch: a :class:`Wrapper` keeps them as its
``peers``, among whom the rank checker compares the forward's random ops.

Hugging Face's ``generate()`` called on the module a wrapper wraps (``model.module.generate``,
accelerate's ``unwrap_model``: reinforcement-learning rollouts) samples for this rank's own
inputs, as the wrapper's forward computes on its own batch: the tracker keeps, per thread, the
wrapper whose module is generating. ``generate()`` on a model no wrapper wraps (evaluation with
``predict_with_generate`` before or without training, a frozen reference model) samples for the
inputs it is given as well, but whether every rank samples, and from what state, is still a
claim about the program: the tracker keeps the outermost such call (:class:`Sampling`), whose
first random op the rank checker compares as the call itself (by the state it starts from), and
the rest as that rank's own. A model with DTensor parameters (tensor parallelism) is not one:
its peers must sample alike.

ZeRO-3's ``deepspeed.zero.GatheredParameters(params, modifier_rank=r)`` gathers partitioned
parameters, lets rank ``r`` modify them, and broadcasts them from it as it exits: Hugging Face
initialises a model made from a config so, on rank 0 alone. The tracker keeps, per thread, the
rank such a region broadcasts from, so the rank checker leaves what is drawn inside it
uncompared.

Pipeline parallelism (``torch.distributed.pipelining``) puts different layers on different ranks:
a schedule's ``step()`` runs in the scope of a :class:`Wrapper` over its stages' group
(``pipeline``), so what its stages draw is each rank's own, and every ``PipelineStage`` built is
kept (``stages``), so that the initialisation of its parameters is known as the rank's own.

torch's ``Join`` (``torch.distributed.algorithms.join``; accelerate's ``join_uneven_inputs``)
lets the ranks run different numbers of iterations: a rank that runs out of inputs shadows the
others' collectives until every rank has. The tracker tells the rank checker (``on_join``) when a
Join is entered, at each iteration's ``notify_join_context`` on a rank with inputs left, when a
rank runs out of them (``Join.__exit__`` begins) and when ``Join.__exit__`` returns.

A wrapper is known by its group's global ranks. The scope of a random op is the innermost wrapper
whose forward is running on this thread, or, during backward, the wrapper whose forward ran last
(until the next optimizer step): checkpoint recomputes and gradient-time randomness of a
data-parallel model belong to it too.

A wrapper's module imported while the mode is active is patched as its import ends (a post-import
hook), so a wrapper is always built and run patched.

Known limitations:
    A wrapper constructed before the mode started is recognised at its first forward, but a
    broadcast it made is not known. The DDP-based composable ``replicate`` calls DDP's internals
    directly and is not recognised.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from ..core.findings import RNGCheckError
from ..core.imports import watch_imports

__all__ = ["DataParallelTracker", "Sampling", "Wrapper", "optimizer_parameters"]

log = logging.getLogger(__name__)

_DDP_MODULE = "torch.nn.parallel.distributed"
_FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"
_FSDP2_MODULE = "torch.distributed.fsdp"
_DEEPSPEED_MODULE = "deepspeed.runtime.engine"
_ZERO_INIT_MODULE = "deepspeed.runtime.zero.partition_parameters"
_GENERATION_MODULE = "transformers.generation.utils"
_PIPELINE_MODULE = "torch.distributed.pipelining.schedules"
_STAGE_MODULE = "torch.distributed.pipelining.stage"
_JOIN_MODULE = "torch.distributed.algorithms.join"
_WATCHED = (
    _DDP_MODULE,
    _FSDP1_MODULE,
    _FSDP2_MODULE,
    _DEEPSPEED_MODULE,
    _ZERO_INIT_MODULE,
    _GENERATION_MODULE,
    _PIPELINE_MODULE,
    _STAGE_MODULE,
    _JOIN_MODULE,
)

# What a Join tells the rank checker: ("enter", the Join), ("round", the Join) at an iteration's
# notify_join_context, ("exit", the Join) as a rank that ran out of inputs begins to shadow the
# others, ("left", the Join) once its __exit__ returned (or raised).
JoinEvent = Callable[[str, Any], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Wrapper:
    """One data-parallel wrapper: its kind, its group, and what it broadcast at construction."""

    # "DistributedDataParallel", "FullyShardedDataParallel", "fully_shard", "DeepSpeedEngine",
    # "deepspeed.zero.Init"; a pipeline schedule's class ("ScheduleGPipe"), with ``pipeline``
    kind: str
    ranks: tuple[int, ...]  # global ranks of its process group (or mesh)
    broadcasts: bool = False  # overwrote the module's states from one rank when it was built
    # The ranks outside its group that compute on this rank's batch, this rank among them: its
    # tensor-parallel peers (() when none), along the meshes of the module's DTensor parameters.
    peers: tuple[int, ...] = ()
    # What it overwrote, as it was built: the states' ids and the storages they held then.
    tensors: frozenset[int] = field(default=frozenset(), repr=False)
    storages: frozenset[int] = field(default=frozenset(), repr=False)
    # A pipeline schedule (torch.distributed.pipelining) over its stages' group: each rank runs
    # the stages it holds, its own layers, not its own batch.
    pipeline: bool = False

    @property
    def label(self) -> str:
        from ..core.findings import format_ranks

        return f"{self.kind} over ranks {format_ranks(self.ranks)}"

    def overwrites(self, tensor: torch.Tensor | None) -> bool:
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


def _group_ranks(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    if group is None:
        group = dist.distributed_c10d._get_default_group()
    return tuple(sorted(int(r) for r in dist.get_process_group_ranks(group)))


def _mesh_ranks(mesh: Any) -> tuple[int, ...]:
    return tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))


class _States(TypedDict, total=False):
    tensors: frozenset[int]
    storages: frozenset[int]


def _states(module: torch.nn.Module, buffers: bool) -> _States:
    """The module's parameters (and buffers): their ids and the storages they hold now."""
    tensors: list[torch.Tensor] = list(module.parameters())
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


@dataclass(slots=True)
class Sampling:
    """A ``generate()`` call on a model no known wrapper wraps, running on this thread."""

    label: str  # the model's class ("LlamaForCausalLM")
    drew: bool = False  # its first random op was seen (compared as the call)


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[Wrapper] = []
        # the rank each GatheredParameters region entered broadcasts from (None: no modifier)
        self.modifiers: list[int | None] = []
        self.generating: list[Wrapper] = []  # the wrappers whose modules are in generate()
        self.sampling: list[Sampling] = []  # generate() calls on models no wrapper wraps
        self.joins: list[Any] = []  # the enabled torch Joins entered on this thread


class DataParallelTracker:
    """The data-parallel wrappers of this process while one mode is active.

    ``on_wrapper(wrapper)`` is called when a wrapper is being constructed (before its own
    collectives run) and when one is first seen in a forward.
    """

    def __init__(
        self,
        on_wrapper: Callable[[Wrapper], None],
        on_forward: Callable[[], None],
        on_join: JoinEvent | None = None,
    ):
        self._on_wrapper = on_wrapper
        self._on_forward = on_forward
        self._on_join = on_join
        self._local = _Local()
        self._known: weakref.WeakKeyDictionary[Any, Wrapper] = weakref.WeakKeyDictionary()
        self._saved: list[tuple[Any, str, Any, bool]] = []  # owner, name, original, had_own
        self._patched: set[str] = set()
        self._modules_seen = 0  # len(sys.modules) at the last refresh
        self._unwatch: Callable[[], None] | None = None
        self._patching = threading.RLock()  # refresh() and uninstall(), one at a time
        self._closed = True  # until install()
        self.backward: Wrapper | None = None  # the wrapper whose forward ran last
        self.hooked = False  # a DDP that holds a Python communication hook ran forward
        self.wrappers: list[Wrapper] = []  # every wrapper seen, in order
        self.ops: dict[str, int] = {}  # random ops not compared, per wrapper label
        self.staged: dict[str, int] = {}  # ... of which in a pipeline schedule's stages
        self.peer_ops: dict[str, int] = {}  # ... compared among the wrapper's peers only
        self.generated: dict[str, int] = {}  # ... of which in generate() of its module
        self.stages: weakref.WeakSet[Any] = weakref.WeakSet()  # pipeline stages built or run

    # -- the scope of a random op ----------------------------------------------------------------

    def current(self, in_backward: bool) -> Wrapper | None:
        stack = self._local.stack
        if stack:
            return stack[-1]
        return self.backward if in_backward else None

    def in_hooked_backward(self) -> bool:
        """Whether this thread runs backward after the forward, since the last step, of a
        ``DistributedDataParallel`` that holds a communication hook registered in Python
        (``register_comm_hook``: PowerSGD's, a user's, the one DDP's ``mixed_precision``
        registers). Its bucket all-reduces are then the hook's, and a hook may chain collectives
        through futures whose callbacks run on this thread or on gloo's, as the collective
        before happens to be done or not: how many of them a rank's thread sees differs by
        timing. (Every rank decides it from the order its program ran in.)"""
        return self.hooked and torch._C._current_graph_task_id() != -1

    def generating(self) -> Wrapper | None:
        """The wrapper whose module is generating on this thread (Hugging Face's
        ``generate()``), or None."""
        generating = self._local.generating
        return generating[-1] if generating else None

    def sampling(self) -> Sampling | None:
        """The outermost ``generate()`` call on a model no known wrapper wraps running on this
        thread (a model's own generate() calls inside it, assisted decoding's, are part of it),
        or None."""
        calls = self._local.sampling
        return calls[0] if calls else None

    def modifier(self) -> int | None:
        """The global rank whose modifications the innermost ZeRO-3 ``GatheredParameters``
        region entered on this thread broadcasts as it exits, or None (none, or one without a
        modifier rank: what it draws is compared, as outside)."""
        modifiers = self._local.modifiers
        return modifiers[-1] if modifiers else None

    def count(self, wrapper: Wrapper, generated: bool = False, peers: bool = False) -> None:
        if peers:
            self.peer_ops[wrapper.label] = self.peer_ops.get(wrapper.label, 0) + 1
        elif generated:
            self.generated[wrapper.label] = self.generated.get(wrapper.label, 0) + 1
        elif wrapper.pipeline:
            self.staged[wrapper.label] = self.staged.get(wrapper.label, 0) + 1
        else:
            self.ops[wrapper.label] = self.ops.get(wrapper.label, 0) + 1

    def on_step(self) -> None:
        self.backward = None
        self.hooked = False

    @property
    def active(self) -> bool:
        """Whether this process runs data-parallel training (a wrapper was built or ran)."""
        return bool(self.wrappers)

    # -- patches ---------------------------------------------------------------------------------

    def install(self) -> None:
        self._closed = False
        self.refresh()
        # A wrapper's module imported later (accelerate imports FSDP inside prepare()) is
        # patched as its import ends, before the program can build or run a wrapper.
        self._unwatch = watch_imports(_WATCHED, lambda _: self.refresh())

    def refresh(self, *, if_imported: bool = False) -> None:
        """Patch the wrapper classes of modules imported since the last call (cheap when none).
        Called from the program's thread and from an import on any thread: one at a time, and
        never after uninstall(). ``if_imported`` (at every optimizer step): only when the number
        of modules in ``sys.modules`` changed since the last call, or a watched one was still
        being executed then (imported on another thread). The import hook patches a module that
        comes in through rngcheck's finder as its import ends; this catches, at the next step,
        one that came in another way (a finder ahead of rngcheck's, a loader without
        ``exec_module``, a module put into ``sys.modules`` by hand), unless another module left
        ``sys.modules`` as it came."""
        if if_imported and len(sys.modules) == self._modules_seen:
            return
        with self._patching:
            if not self._closed:
                seen = len(sys.modules)  # (read first: one added meanwhile is patched now or
                self._refresh()  # counted at the next call)
                self._modules_seen = -1 if _executing(_WATCHED) else seen

    def _refresh(self) -> None:
        if _DDP_MODULE not in self._patched and _DDP_MODULE in sys.modules:
            self._patched.add(_DDP_MODULE)
            cls = sys.modules[_DDP_MODULE].DistributedDataParallel
            self._wrap_init(cls, self._ddp_wrapper)
            self._wrap_forward(cls, lambda m: self._known.get(m) or self._ddp_wrapper(m, None))
        if _FSDP1_MODULE not in self._patched and _FSDP1_MODULE in sys.modules:
            self._patched.add(_FSDP1_MODULE)
            cls = sys.modules[_FSDP1_MODULE].FullyShardedDataParallel
            self._wrap_init(cls, self._fsdp1_wrapper)
            self._wrap_forward(cls, lambda m: self._known.get(m) or self._fsdp1_wrapper(m, None))
        fsdp2 = getattr(sys.modules.get(_FSDP2_MODULE), "FSDPModule", None)
        if _FSDP2_MODULE not in self._patched and fsdp2 is not None:
            self._patched.add(_FSDP2_MODULE)
            self._wrap_forward(fsdp2, self._fsdp2_wrapper)
        engine = getattr(sys.modules.get(_DEEPSPEED_MODULE), "DeepSpeedEngine", None)
        if _DEEPSPEED_MODULE not in self._patched and engine is not None:
            self._patched.add(_DEEPSPEED_MODULE)
            self._wrap_broadcast(engine, "_broadcast_model", self._deepspeed_wrapper)
            self._wrap_forward(
                engine, lambda m: self._known.get(m) or self._deepspeed_wrapper(m, False)
            )
        zero_init = getattr(sys.modules.get(_ZERO_INIT_MODULE), "Init", None)
        if _ZERO_INIT_MODULE not in self._patched and zero_init is not None:
            self._patched.add(_ZERO_INIT_MODULE)
            self._wrap_zero_init(zero_init)
            gathered = getattr(sys.modules[_ZERO_INIT_MODULE], "GatheredParameters", None)
            if gathered is not None:
                self._wrap_gathered(gathered)
        mixin = getattr(sys.modules.get(_GENERATION_MODULE), "GenerationMixin", None)
        if _GENERATION_MODULE not in self._patched and mixin is not None:
            self._patched.add(_GENERATION_MODULE)
            self._wrap_generate(mixin)
        stage = getattr(sys.modules.get(_STAGE_MODULE), "_PipelineStageBase", None)
        if _STAGE_MODULE not in self._patched and stage is not None:
            self._patched.add(_STAGE_MODULE)
            self._wrap_stage_init(stage)
        schedules = sys.modules.get(_PIPELINE_MODULE)
        if _PIPELINE_MODULE not in self._patched and schedules is not None:
            self._patched.add(_PIPELINE_MODULE)
            for name in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
                cls = getattr(schedules, name, None)
                if cls is not None and "step" in vars(cls):
                    self._wrap_forward(cls, self._pipeline_wrapper, method="step")
        join = getattr(sys.modules.get(_JOIN_MODULE), "Join", None)
        if _JOIN_MODULE not in self._patched and join is not None and self._on_join is not None:
            self._patched.add(_JOIN_MODULE)
            self._wrap_join(join, self._on_join)

    def uninstall(self) -> None:
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()
        with self._patching:
            self._closed = True
            saved, self._saved = self._saved, []
            for owner, name, original, had_own in reversed(saved):
                if had_own:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)
            self._patched.clear()
        self._local.stack.clear()
        self._local.modifiers.clear()
        self._local.generating.clear()
        self._local.sampling.clear()
        self._local.joins.clear()
        self.backward = None
        self.hooked = False

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        had_own = name in vars(owner)
        self._saved.append((owner, name, vars(owner).get(name), had_own))
        setattr(owner, name, replacement)

    def _wrap_init(self, cls: Any, describe: Callable[[Any, inspect.BoundArguments], Wrapper]):
        original = cls.__init__
        signature = inspect.signature(original)
        tracker = self

        @functools.wraps(original)
        def __init__(module: Any, /, *args: Any, **kwargs: Any) -> None:
            try:
                bound = signature.bind(module, *args, **kwargs)
                bound.apply_defaults()
                wrapper = describe(module, bound)
            except Exception:  # noqa: BLE001 - never break the user's construction
                log.debug("rngcheck could not describe a %s", cls.__name__, exc_info=True)
                wrapper = None
            if wrapper is not None:
                tracker._register(module, wrapper)  # before the wrapper's own collectives
            original(module, *args, **kwargs)

        self._patch(cls, "__init__", __init__)

    def _wrap_broadcast(self, cls: Any, name: str, describe: Callable[[Any, bool], Wrapper]):
        """A wrapper whose group is known only inside its construction (DeepSpeed's engine): it
        is registered when it starts broadcasting the module's states, before the collectives."""
        original = getattr(cls, name)
        tracker = self

        @functools.wraps(original)
        def broadcast(module: Any, /, *args: Any, **kwargs: Any) -> Any:
            try:
                tracker._register(module, describe(module, True))
            except Exception:  # noqa: BLE001 - never break the user's construction
                log.debug("rngcheck could not describe a %s", cls.__name__, exc_info=True)
            return original(module, *args, **kwargs)

        self._patch(cls, name, broadcast)

    def _wrap_zero_init(self, cls: Any) -> None:
        """``deepspeed.zero.Init`` (ZeRO-3): each parameter is broadcast from one rank of its
        group as it is made, then partitioned; the engine built later broadcasts nothing."""
        original = cls._zero_init_param
        tracker = self

        @functools.wraps(original)
        def _zero_init_param(init: Any, param: Any, /, *args: Any, **kwargs: Any) -> Any:
            out = original(init, param, *args, **kwargs)
            try:
                ranks = _group_ranks(init.get_partition_dp_group(param))
                program = Wrapper(kind="deepspeed.zero.Init", ranks=ranks, broadcasts=True)
                if program not in tracker.wrappers:
                    tracker.wrappers.append(program)
                tracker._on_wrapper(dataclasses.replace(program, tensors=frozenset({id(param)})))
            except Exception:  # noqa: BLE001 - never break the user's construction
                log.debug("rngcheck could not read a zero.Init broadcast", exc_info=True)
            return out

        self._patch(cls, "_zero_init_param", _zero_init_param)

    def _wrap_stage_init(self, cls: Any) -> None:
        """A pipeline stage (``PipelineStage``, or one ``pipeline()`` split): its module is this
        rank's own layers, known from here (torchtitan and torch's own example build the stages
        on the meta device and initialise their weights after)."""
        original = cls.__init__
        stages = self.stages

        @functools.wraps(original)
        def __init__(stage: Any, /, *args: Any, **kwargs: Any) -> None:
            original(stage, *args, **kwargs)
            stages.add(stage)

        self._patch(cls, "__init__", __init__)

    def trains(self, optimizer: Any, known: Collection[Any] = ()) -> bool:
        """Whether ``optimizer`` steps a parameter of a known wrapper's module or of a pipeline
        stage this rank holds (by identity: DeepSpeed's engine steps flat copies, never these),
        or one of ``known`` (parameters read so before)."""
        params = optimizer_parameters(optimizer)
        if known and any(p in known for p in params):
            return True
        try:
            mine = {id(p) for p in params}
            modules = [*self._known.keys(), *(s.submod for s in list(self.stages))]
            return any(
                id(p) in mine
                for module in modules
                if hasattr(module, "parameters")
                for p in module.parameters()
            )
        except Exception:  # noqa: BLE001 - an optimizer or wrapper of another shape: not known
            log.debug("rngcheck could not read a wrapper's parameters", exc_info=True)
            return False

    def stage_holding(self, parameter: Any) -> str:
        """The pipeline stage whose module holds ``parameter`` ("pipeline stage 1 of 4"), or
        ""."""
        for stage in list(self.stages):
            try:
                if any(p is parameter for p in stage.submod.parameters()):
                    return f"pipeline stage {stage.stage_index} of {stage.num_stages}"
            except Exception:  # noqa: BLE001 - a stage torch changed: compared, as before
                log.debug("rngcheck could not read a pipeline stage's module", exc_info=True)
        return ""

    def _wrap_join(self, cls: Any, on_join: JoinEvent) -> None:
        """torch's ``Join``: its entry, each iteration's ``notify_join_context`` (from the first
        joinable, the one whose all-reduce Join pairs with the shadowing ranks' own), a rank
        running out of inputs, and the return of ``__exit__``; only for an enabled Join, and
        never breaking the user's (a failure to tell is logged)."""
        enter, exit_ = cls.__enter__, cls.__exit__
        notify = cls.notify_join_context
        threads = self._local

        def tell(what: str, join: Any) -> None:
            try:
                on_join(what, join)
            except RNGCheckError:
                # A finding the round settled here, with on_finding="raise": every rank settles
                # that round here and raises it (swallowed, this rank would train on and wait in
                # Join's own all-reduce for ranks that left).
                raise
            except Exception:  # noqa: BLE001 - never break the user's Join
                log.debug("rngcheck could not follow a Join (%s)", what, exc_info=True)

        @functools.wraps(enter)
        def __enter__(join: Any) -> Any:
            out = enter(join)
            if getattr(join, "_enable", False):
                threads.joins.append(join)
                tell("enter", join)
            return out

        @functools.wraps(exit_)
        def __exit__(join: Any, type_: Any, value: Any, traceback: Any) -> Any:
            tracked = bool(threads.joins) and threads.joins[-1] is join
            try:
                if tracked and type_ is None:
                    tell("exit", join)  # (a finding raised here leaves as Join's own would)
                return exit_(join, type_, value, traceback)
            finally:
                if tracked:
                    threads.joins.pop()
                    tell("left", join)

        @functools.wraps(notify)
        def notify_join_context(joinable: Any) -> Any:
            config = getattr(joinable, "_join_config", None)
            if threads.joins and config is not None and config.enable and config.is_first_joinable:
                tell("round", threads.joins[-1])
            return notify(joinable)

        self._patch(cls, "__enter__", __enter__)
        self._patch(cls, "__exit__", __exit__)
        self._patch(cls, "notify_join_context", staticmethod(notify_join_context))

    def _wrap_generate(self, cls: Any) -> None:
        """Hugging Face's ``GenerationMixin.generate``: on the module a known wrapper wraps (or on
        a ``fully_shard`` module, its own wrapper), that wrapper is generating until it returns;
        on any other model, a :class:`Sampling` call is running."""
        original = cls.generate
        tracker = self

        @functools.wraps(original)
        def generate(model: Any, /, *args: Any, **kwargs: Any) -> Any:
            wrapper = tracker._wrapping(model)
            calls: list[Any] = tracker._local.generating
            entry: Wrapper | Sampling | None = wrapper
            if wrapper is None:
                if _tensor_parallel(model):  # its peers must sample alike: compared (Rule 1)
                    return original(model, *args, **kwargs)
                calls, entry = tracker._local.sampling, Sampling(type(model).__name__)
            calls.append(entry)
            try:
                return original(model, *args, **kwargs)
            finally:
                calls.pop()

        self._patch(cls, "generate", generate)

    def _wrapping(self, model: Any) -> Wrapper | None:
        """The known wrapper whose module ``model`` is (or that ``model`` is: ``fully_shard``),
        also through ``torch.compile`` (accelerate's ``unwrap_model`` returns the original)."""
        try:
            own = self._known.get(model)
            if own is not None:
                return own
            for module, wrapper in list(self._known.items()):
                inner = getattr(module, "module", None)
                if inner is model or getattr(inner, "_orig_mod", None) is model:
                    return wrapper
        except Exception:  # noqa: BLE001 - never break the user's generate(): compared, then
            log.debug("rngcheck could not tell which wrapper is generating", exc_info=True)
        return None

    def _wrap_gathered(self, cls: Any) -> None:
        """``deepspeed.zero.GatheredParameters``: the rank an entered region broadcasts from
        (``src_rank``, a global rank; None without ``modifier_rank`` or when the region is a no-op
        on parameters that are not partitioned), until it exits."""
        enter, exit_ = cls.__enter__, cls.__exit__
        local = self._local

        @functools.wraps(enter)
        def __enter__(region: Any) -> Any:
            out = enter(region)
            src = getattr(region, "src_rank", None) if getattr(region, "enabled", False) else None
            local.modifiers.append(src if type(src) is int else None)
            return out

        @functools.wraps(exit_)
        def __exit__(region: Any, *exc: Any) -> Any:
            try:
                return exit_(region, *exc)  # (the broadcast)
            finally:
                if local.modifiers:
                    local.modifiers.pop()

        self._patch(cls, "__enter__", __enter__)
        self._patch(cls, "__exit__", __exit__)

    def _wrap_forward(
        self, cls: Any, describe: Callable[[Any], Wrapper | None], method: str = "forward"
    ) -> None:
        """The wrapper's ``forward`` (a pipeline schedule's ``step``, which runs its stages'
        forwards and backwards) runs in the wrapper's scope."""
        # FSDPModule has no forward of its own: the original is the next class's in the MRO.
        own = vars(cls).get(method)
        tracker = self

        def forward(module: Any, /, *args: Any, **kwargs: Any) -> Any:
            wrapper = tracker._known.get(module)
            if wrapper is None:
                try:
                    wrapper = describe(module)
                except Exception:  # noqa: BLE001 - an unknown layout: check it as replicated
                    log.debug("rngcheck could not find the group of %r", type(module))
                    wrapper = None
                if wrapper is not None:
                    tracker._register(module, wrapper)
            if wrapper is None:
                return _call(own, cls, module, args, kwargs)
            stack = tracker._local.stack
            if not stack:
                tracker._on_forward()
            stack.append(wrapper)
            try:
                return _call(own, cls, module, args, kwargs)
            finally:
                stack.pop()
                tracker.backward = wrapper
                # (DDP: communication hooks registered in Python, which run in its backward;
                # kept to the step, whatever other wrappers' forwards run before backward)
                tracker.hooked = tracker.hooked or bool(getattr(module, "_comm_hooks", None))

        if own is not None:
            forward = functools.wraps(own)(forward)
        self._patch(cls, method, forward)

    def _register(self, module: Any, wrapper: Wrapper) -> None:
        self._known[module] = wrapper
        if wrapper not in self.wrappers:
            self.wrappers.append(wrapper)
        self._on_wrapper(wrapper)

    # -- describing each kind of wrapper ----------------------------------------------------------

    @staticmethod
    def _ddp_wrapper(ddp: Any, bound: inspect.BoundArguments | None) -> Wrapper:
        kind = "DistributedDataParallel"
        if bound is None:  # built before the mode: its group is all that matters now
            ranks = _group_ranks(ddp.process_group)
            return Wrapper(kind=kind, ranks=ranks, peers=_peers(ddp.module, ranks))
        args = bound.arguments
        mesh = args.get("device_mesh")
        ranks = _mesh_ranks(mesh) if mesh is not None else _group_ranks(args.get("process_group"))
        broadcasts = bool(args.get("init_sync", True))
        module = args["module"]
        buffers = args.get("broadcast_buffers") is not False
        states = _states(module, buffers) if broadcasts else _States()
        peers = _peers(module, ranks)
        return Wrapper(kind=kind, ranks=ranks, broadcasts=broadcasts, peers=peers, **states)

    @staticmethod
    def _fsdp1_wrapper(fsdp: Any, bound: inspect.BoundArguments | None) -> Wrapper:
        kind = "FullyShardedDataParallel"
        if bound is None:
            ranks = _group_ranks(fsdp.process_group)
            return Wrapper(kind=kind, ranks=ranks, peers=_peers(fsdp.module, ranks))
        args = bound.arguments
        mesh = args.get("device_mesh")
        group = args.get("process_group")
        if isinstance(group, tuple):  # hybrid sharding: (intra-node, inter-node) groups
            ranks = tuple(sorted({r for g in group for r in _group_ranks(g)}))
        else:
            ranks = _mesh_ranks(mesh) if mesh is not None else _group_ranks(group)
        broadcasts = bool(args.get("sync_module_states", False))
        states = _states(args["module"], True) if broadcasts else _States()
        peers = _peers(args["module"], ranks)
        return Wrapper(kind=kind, ranks=ranks, broadcasts=broadcasts, peers=peers, **states)

    @staticmethod
    def _deepspeed_wrapper(engine: Any, broadcasting: bool) -> Wrapper:
        # The ranks that see different data: data parallel, and sequence parallel (Ulysses)
        # inside it; the engine broadcasts the module's parameters over that group unless
        # ZeRO-3 made them partitioned at creation (zero.Init), when it never calls this.
        ranks = _group_ranks(getattr(engine, "seq_data_parallel_group", None))
        broadcasts = broadcasting and getattr(engine, "dist_backend", None) is not None
        states = _states(engine.module, False) if broadcasts else _States()
        # (DeepSpeed's own tensor parallelism holds no DTensors: no peers)
        kind = "DeepSpeedEngine"
        return Wrapper(kind=kind, ranks=ranks, broadcasts=broadcasts, peers=(), **states)

    @staticmethod
    def _fsdp2_wrapper(module: Any) -> Wrapper | None:
        # fully_shard's state knows the mesh of each parameter group (a list since torch 2.10, one
        # optional group before); a root without parameters of its own finds it in a child.
        for sub in module.modules():
            get_state = getattr(sub, "_get_fsdp_state", None)
            if get_state is None:
                continue
            state = get_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                single = getattr(state, "_fsdp_param_group", None)
                groups = [single] if single is not None else []
            for group in groups:
                mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
                if mesh is not None:
                    ranks = _mesh_ranks(mesh)
                    return Wrapper(kind="fully_shard", ranks=ranks, peers=_peers(module, ranks))
        return None

    def _pipeline_wrapper(self, schedule: Any) -> Wrapper | None:
        # A schedule runs one stage (PipelineScheduleSingle) or several (Multi: interleaved,
        # zero bubble) of one pipeline, all over one group. No peers: the DTensor meshes of a
        # stage's module do not tell the ranks that share its microbatches (tensor parallel)
        # from those that train on other batches (fully_shard over a data-parallel dimension).
        single = getattr(schedule, "_stage", None)
        stages = [single] if single is not None else list(getattr(schedule, "_stages", ()))
        if not stages:
            return None
        for stage in stages:  # (one built before the mode is known from its schedule's step)
            self.stages.add(stage)
        ranks = _group_ranks(getattr(stages[0], "group", None))
        return Wrapper(kind=type(schedule).__name__, ranks=ranks, pipeline=True)


def _peers(module: Any, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks that compute on this rank's batch, this one among them, for a wrapper over
    ``ranks`` (its data-parallel group) of ``module``: along the meshes of the module's DTensor
    parameters (tensor parallelism inside data parallelism: Hugging Face's ``DistributedConfig``
    with ``tp_size`` and ``fsdp_size``, ``parallelize_module`` then ``fully_shard`` or DDP), the
    ranks that differ from this one only along dims that leave the group (a dim whose ranks
    through this one meet the group here alone), the same set on each of them. () when the
    module has no such dim: its random ops are compared nowhere (Rule 2). Of several meshes,
    the one with the most ranks (the same choice on every rank of a program built alike)."""
    import torch.distributed as dist

    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None or not dist.is_initialized():
        return ()
    me, group = dist.get_rank(), set(ranks)
    grids: dict[int, torch.Tensor] = {}
    try:
        for p in module.parameters():
            if isinstance(p, dtensor):
                mesh = p.device_mesh
                grids.setdefault(id(mesh), mesh.mesh)
    except Exception:  # noqa: BLE001 - never break the user's wrapper: no peers, as before
        log.debug("rngcheck: could not read the DTensor parameters' meshes", exc_info=True)
        return ()
    best: tuple[int, ...] = ()
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
        peers = tuple(sorted(int(r) for r in grid[tuple(index)].flatten().tolist()))
        if len(peers) > 1:
            best = peers
            break
    return best


def optimizer_parameters(optimizer: Any) -> list[Any]:
    """An optimizer's parameters (none when it holds them in another shape)."""
    try:
        return [p for group in optimizer.param_groups for p in group["params"]]
    except Exception:  # noqa: BLE001 - an optimizer of another shape: not known
        log.debug("rngcheck could not read an optimizer's parameters", exc_info=True)
        return []


def _tensor_parallel(model: Any) -> bool:
    """Whether a model holds DTensor parameters (Hugging Face's ``tp_plan``, torch's
    ``parallelize_module``): its tensor-parallel peers run one computation, and must sample
    alike."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return False
    try:
        return any(isinstance(p, dtensor) for p in model.parameters())
    except Exception:  # noqa: BLE001 - never break the user's generate(): compared, then
        return True


def _executing(names: tuple[str, ...]) -> bool:
    """Whether one of the modules ``names`` is in ``sys.modules`` but still being executed (its
    import runs on another thread: its classes may not exist yet)."""
    for name in names:
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if getattr(spec, "_initializing", False):  # (importlib's mark while it runs the module)
            return True
    return False


def _call(own: Any, cls: Any, module: Any, args: tuple, kwargs: dict) -> Any:
    if own is not None:
        return own(module, *args, **kwargs)
    return super(cls, module).forward(*args, **kwargs)  # (only forward is ever inherited)
