"""Installing the registered integrations (``integrations/``) while a rank checker runs: each kind
of hook is one handler here (a table keyed by the record's type), every hooked name is resolved
as its module is imported, and a name the installed version lacks, or a library object a hook
cannot read, is a loud coverage gap (``RNGCheckCoverageWarning`` and a report note), never a
silent change of verdict.

Patches go on the classes (existing instances are covered) and come off at ``uninstall``. A
hooked module imported while the checker runs is patched as its import ends (a post-import
hook), so a wrapper is always built and run patched; one imported some other way is patched at
the next optimizer step (``refresh``). Functions known by their frames are not patched: their
code objects are looked up in the walks of ``scopes.py`` (:func:`frame_codes`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from types import CodeType
from typing import Any, NamedTuple

from ..core.findings import RNGCheckError
from ..core.imports import watch_imports
from .integrations import changes, registered
from .integrations.common import Unreadable, group_ranks, tensor_parallel
from .integrations.records import (
    BroadcastRegion,
    Frames,
    Generate,
    Hook,
    Integration,
    JoinContext,
    ParameterBroadcast,
    StageInit,
    Wrapper,
    WrapperBroadcast,
    WrapperForward,
    WrapperInit,
)
from .program import Program, Sampling

__all__ = ["Gap", "Hooks", "JoinEvent", "JoinSeen", "frame_codes", "library_version", "resolve"]

log = logging.getLogger(__name__)


class JoinSeen(NamedTuple):
    """An enabled torch Join entered on this thread: its label and its group's ranks."""

    join: Any
    label: str  # "Join([DistributedDataParallel])"
    ranks: tuple[int, ...]


# What a Join tells the rank checker: ("enter", the Join), ("round", the Join) at an iteration's
# notify_join_context, ("exit", the Join) as a rank that ran out of inputs begins to shadow the
# others, ("left", the Join) once its __exit__ returned (or raised).
JoinEvent = Callable[[str, JoinSeen], None]
# A coverage gap: (the integration, the hook, what went wrong)
Gap = Callable[[Integration, Hook, str], None]

# The methods a context-manager hook patches (and needs its class to define).
_METHODS: dict[type[Hook], tuple[str, ...]] = {
    BroadcastRegion: ("__enter__", "__exit__"),
    JoinContext: ("__enter__", "__exit__", "notify_join_context"),
}


def resolve(hook: Hook) -> tuple[Any, Any]:
    """``(owner, target)`` of ``hook`` in its imported module: the class (or module) that holds
    the hooked attribute and the attribute itself (the class, for a context manager). Raises
    LookupError, saying what is missing, when the installed version lacks it."""
    module = sys.modules[hook.module]
    path = hook.attribute.split(".")
    owner: Any = module
    for i, name in enumerate(path):
        last = i == len(path) - 1
        if isinstance(owner, type) and last:
            found = vars(owner).get(name)
            if found is None and not (isinstance(hook, WrapperForward) and hook.inherited):
                raise LookupError(f"{hook.module}.{hook.attribute} is not defined")
        else:
            found = getattr(owner, name, None)
            if found is None:
                raise LookupError(f"{hook.module}.{'.'.join(path[: i + 1])} does not exist")
        if last:
            for method in _METHODS.get(type(hook), ()):
                if method not in vars(found):
                    raise LookupError(f"{hook.module}.{hook.attribute}.{method} is not defined")
            return owner, found
        owner = found
    raise LookupError(f"{hook.module}: no attribute named")  # (an empty attribute)


class _FrameCodes:
    """The code objects of the registered :class:`Frames` hooks whose modules are imported, by
    ``id()`` (a code object hashes by its contents; a frame runs this very object), resolved as
    the walks ask; the ones a version lacks are kept for the checker to report. Built again
    when the registry changes."""

    def __init__(self) -> None:
        self._codes: dict[int, Frames] = {}
        self._held: list[CodeType] = []
        self._waiting: set[str] = set()
        self._changes = -1
        self.missing: list[tuple[Integration, Hook, str]] = []
        self._lock = threading.Lock()

    def table(self) -> dict[int, Frames]:
        if changes() != self._changes:  # (rngcheck's own, on first use; a test's, since)
            integrations = registered()
            with self._lock:
                self._changes = changes()
                self._codes, self._held, self.missing = {}, [], []
                self._waiting = {
                    h.module for i in integrations for h in i.hooks if isinstance(h, Frames)
                }
        if not self._waiting:
            return self._codes
        for module in tuple(self._waiting):
            mod = sys.modules.get(module)
            if mod is None or getattr(getattr(mod, "__spec__", None), "_initializing", False):
                continue
            with self._lock:
                self._waiting.discard(module)
                for integration in registered():
                    for hook in integration.hooks:
                        if isinstance(hook, Frames) and hook.module == module:
                            self._resolve(integration, hook)
        return self._codes

    def _resolve(self, integration: Integration, hook: Frames) -> None:
        try:
            _, func = resolve(hook)
        except LookupError as e:
            self.missing.append((integration, hook, str(e)))
            return
        # (the function itself, should a version wrap it: a wrapper's code is shared)
        code = getattr(inspect.unwrap(func), "__code__", None)
        if isinstance(code, CodeType):
            self._held.append(code)
            self._codes[id(code)] = hook


_FRAMES = _FrameCodes()


def frame_codes() -> dict[int, Frames]:
    """The registered functions known by their frames, by the id of their code objects."""
    return _FRAMES.table()


class Hooks:
    """The registered integrations' patches for one rank checker, and what they learn into
    ``program``. ``on_wrapper(wrapper)``: a wrapper is being built (before its own collectives)
    or first ran; ``on_forward()``: a wrapper's outermost forward begins; ``on_join``: torch's
    Join (see JoinEvent); ``on_gap``: a hook the installed version does not allow."""

    def __init__(
        self,
        program: Program,
        on_wrapper: Callable[[Wrapper], None],
        on_forward: Callable[[], None],
        on_join: JoinEvent,
        on_gap: Gap,
    ) -> None:
        self.program = program
        self._on_wrapper = on_wrapper
        self._on_forward = on_forward
        self._on_join = on_join
        self._on_gap = on_gap
        self._saved: list[tuple[Any, str, Any, bool]] = []  # owner, name, original, had_own
        self._patched: set[str] = set()  # hook keys done (patched, or reported missing)
        self._gaps: set[str] = set()  # hook keys reported
        self._modules_seen = 0  # len(sys.modules) at the last refresh
        self._unwatch: Callable[[], None] | None = None
        self._patching = threading.RLock()  # refresh() and uninstall(), one at a time
        self._closed = True  # until install()
        self._watched: tuple[str, ...] = ()

    # -- installing ------------------------------------------------------------------------------

    def install(self) -> None:
        self._closed = False
        self._watched = tuple({h.module for i in registered() for h in i.hooks})
        self.refresh()
        # A hooked module imported later (accelerate imports FSDP inside prepare()) is patched
        # as its import ends, before the program can build or run a wrapper.
        self._unwatch = watch_imports(self._watched, lambda _: self.refresh())

    def refresh(self, *, if_imported: bool = False) -> None:
        """Patch (and resolve) the hooks of modules imported since the last call (cheap when
        none). Called from the program's thread and from an import on any thread: one at a
        time, and never after uninstall(). ``if_imported`` (at every optimizer step): only when
        the number of modules in ``sys.modules`` changed since the last call, or a watched one
        was still being executed then (imported on another thread); this catches, at the next
        step, a module that came in without the import hook (a finder ahead of rngcheck's, a
        module put into ``sys.modules`` by hand), unless another left ``sys.modules`` as it
        came."""
        if if_imported and len(sys.modules) == self._modules_seen:
            return
        with self._patching:
            if self._closed:
                return
            seen = len(sys.modules)  # (read first: one added meanwhile is patched now or
            self._refresh()  # counted at the next call)
            self._modules_seen = -1 if _executing(self._watched) else seen

    def _refresh(self) -> None:
        for integration in registered():
            for hook in integration.hooks:
                if hook.key in self._patched or hook.module not in sys.modules:
                    continue
                module = sys.modules[hook.module]
                if getattr(getattr(module, "__spec__", None), "_initializing", False):
                    continue  # (being imported on another thread: next time)
                self._patched.add(hook.key)
                try:
                    owner, target = resolve(hook)
                except LookupError as e:
                    self.gap(integration, hook, str(e))
                    continue
                install = _INSTALL.get(type(hook))
                if install is not None:
                    install(self, integration, hook, owner, target)
        frame_codes()  # (resolves the known functions of the modules imported by now)
        for integration, hook, why in _FRAMES.missing:
            self.gap(integration, hook, why)

    def gap(self, integration: Integration, hook: Hook, why: str) -> None:
        """Report, once per hook, that ``hook`` does not hold on the installed version."""
        if hook.key in self._gaps:
            return
        self._gaps.add(hook.key)
        self._on_gap(integration, hook, why)

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
        self.program.clear()

    def patch(self, owner: Any, name: str, replacement: Any) -> None:
        had_own = name in vars(owner)
        self._saved.append((owner, name, vars(owner).get(name), had_own))
        setattr(owner, name, replacement)

    def describe(self, integration: Integration, hook: Hook, read: Callable[[], Any]) -> Any:
        """``read()``, a hook's reading of a library object; None when it fails, after a
        coverage gap that says so (a renamed attribute must not silently change a verdict)."""
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - never break the user's program
            log.debug("rngcheck could not read through %s", hook.key, exc_info=True)
            what = str(e) if isinstance(e, Unreadable) else f"{type(e).__name__}: {e}"
            self.gap(integration, hook, f"reading it failed ({what})")
            return None

    def register(self, module: Any, wrapper: Wrapper) -> None:
        self.program.add(module, wrapper)
        self._on_wrapper(wrapper)


def _executing(names: tuple[str, ...]) -> bool:
    """Whether one of the modules ``names`` is in ``sys.modules`` but still being executed (its
    import runs on another thread: its classes may not exist yet)."""
    for name in names:
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if getattr(spec, "_initializing", False):  # (importlib's mark while it runs the module)
            return True
    return False


def library_version(integration: Integration) -> str:
    """The installed version of the integration's library, or "unknown"."""
    try:
        return importlib.metadata.version(integration.package)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sys.modules.get(integration.library), "__version__", None)
        return str(version) if version else "unknown"


# -- one handler per kind of hook ----------------------------------------------------------------

Install = Callable[[Hooks, Integration, Any, Any, Any], None]
_INSTALL: dict[type[Hook], Install] = {}


def _handles(kind: type[Hook]) -> Callable[[Install], Install]:
    def add(install: Install) -> Install:
        if kind in _INSTALL:
            raise ValueError(f"a handler for {kind.__name__} is already registered")
        _INSTALL[kind] = install
        return install

    return add


def _method_name(hook: Hook) -> str:
    return hook.attribute.rpartition(".")[2]


@_handles(WrapperInit)
def _wrapper_init(hooks: Hooks, integration: Integration, hook: Any, cls: Any, init: Any) -> None:
    """The wrapper is described from its constructor's arguments and known before the
    original constructor runs its own collectives (its broadcast)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(module: Any, /, *args: Any, **kwargs: Any) -> None:
        def read() -> Any:
            bound = signature.bind(module, *args, **kwargs)
            bound.apply_defaults()
            return hook.describe(module, bound)

        wrapper = hooks.describe(integration, hook, read)
        if wrapper is not None:
            hooks.register(module, wrapper)  # before the wrapper's own collectives
        init(module, *args, **kwargs)

    hooks.patch(cls, "__init__", __init__)


@_handles(WrapperBroadcast)
def _wrapper_broadcast(
    hooks: Hooks, integration: Integration, hook: Any, cls: Any, original: Any
) -> None:
    """A wrapper whose group is known only inside its construction (DeepSpeed's engine) is
    known as it starts broadcasting the module's states, before the collectives."""

    @functools.wraps(original)
    def broadcast(module: Any, /, *args: Any, **kwargs: Any) -> Any:
        wrapper = hooks.describe(integration, hook, lambda: hook.describe(module, True))
        if wrapper is not None:
            hooks.register(module, wrapper)
        return original(module, *args, **kwargs)

    hooks.patch(cls, _method_name(hook), broadcast)


@_handles(WrapperForward)
def _wrapper_forward(hooks: Hooks, integration: Integration, hook: Any, cls: Any, own: Any) -> None:
    """The wrapper's method (a forward; a pipeline schedule's step, which runs its stages'
    forwards and backwards) runs in the wrapper's scope; its backward does too, until the next
    optimizer step. A class without the method of its own (a mixin) runs the next class's."""
    program = hooks.program
    method = _method_name(hook)

    def forward(module: Any, /, *args: Any, **kwargs: Any) -> Any:
        wrapper = program.known.get(module)
        if wrapper is None:
            wrapper = hooks.describe(integration, hook, lambda: hook.describe(module))
            if wrapper is not None:
                if hook.layers:  # (a pipeline schedule: each rank runs its own layers)
                    wrapper = dataclasses.replace(wrapper, pipeline=True)
                hooks.register(module, wrapper)
        if wrapper is None:
            return _call(own, cls, method, module, args, kwargs)
        stack = program.local.stack
        if not stack:
            hooks._on_forward()
        stack.append(wrapper)
        try:
            return _call(own, cls, method, module, args, kwargs)
        finally:
            stack.pop()
            program.backward = wrapper
            if hook.chains is not None and not program.chained:
                # (kept to the step, whatever other wrappers' forwards run before backward)
                program.chained = bool(
                    hooks.describe(integration, hook, lambda: hook.chains(module))
                )

    if own is not None:
        forward = functools.wraps(own)(forward)
    hooks.patch(cls, method, forward)


def _call(own: Any, cls: Any, method: str, module: Any, args: tuple, kwargs: dict) -> Any:
    if own is not None:
        return own(module, *args, **kwargs)
    return getattr(super(cls, module), method)(*args, **kwargs)  # (an inherited one)


@_handles(ParameterBroadcast)
def _parameter_broadcast(
    hooks: Hooks, integration: Integration, hook: Any, cls: Any, original: Any
) -> None:
    """Each parameter is broadcast from one rank of its group as it is made, then partitioned
    (ZeRO-3's ``zero.Init``): the wrapper built later broadcasts nothing."""

    @functools.wraps(original)
    def made(owner: Any, param: Any, /, *args: Any, **kwargs: Any) -> Any:
        out = original(owner, param, *args, **kwargs)
        ranks = hooks.describe(integration, hook, lambda: group_ranks(hook.group(owner, param)))
        if ranks is not None:
            made_by = Wrapper(kind=hook.kind or hook.label, ranks=ranks, broadcasts=True)
            if made_by not in hooks.program.wrappers:
                hooks.program.wrappers.append(made_by)
            hooks._on_wrapper(dataclasses.replace(made_by, tensors=frozenset({id(param)})))
        return out

    hooks.patch(cls, _method_name(hook), made)


@_handles(StageInit)
def _stage_init(hooks: Hooks, integration: Integration, hook: Any, cls: Any, init: Any) -> None:
    """A pipeline stage: its module is this rank's own layers, known from here (torchtitan and
    torch's own example build the stages on the meta device and initialise their weights after)."""
    stages = hooks.program.stages

    @functools.wraps(init)
    def __init__(stage: Any, /, *args: Any, **kwargs: Any) -> None:
        init(stage, *args, **kwargs)
        stages.add(stage)

    hooks.patch(cls, "__init__", __init__)


@_handles(Generate)
def _generate(hooks: Hooks, integration: Integration, hook: Any, cls: Any, original: Any) -> None:
    """On the module a known wrapper wraps (or on a ``fully_shard`` module, its own wrapper),
    that wrapper is generating until it returns; on a model with DTensor parameters nothing
    changes (its peers must sample alike); on any other model, a :class:`Sampling` runs."""
    program = hooks.program

    @functools.wraps(original)
    def generate(model: Any, /, *args: Any, **kwargs: Any) -> Any:
        wrapper = program.wrapping(model)
        calls: list[Any] = program.local.generating
        entry: Wrapper | Sampling | None = wrapper
        if wrapper is None:
            if tensor_parallel(model):
                return original(model, *args, **kwargs)
            calls, entry = program.local.sampling, Sampling(type(model).__name__)
        calls.append(entry)
        try:
            return original(model, *args, **kwargs)
        finally:
            calls.pop()

    hooks.patch(cls, _method_name(hook), generate)


@_handles(BroadcastRegion)
def _broadcast_region(
    hooks: Hooks, integration: Integration, hook: Any, owner: Any, cls: Any
) -> None:
    """The rank an entered region broadcasts from, until it exits."""
    enter, exit_ = cls.__enter__, cls.__exit__
    local = hooks.program.local

    @functools.wraps(enter)
    def __enter__(region: Any) -> Any:
        out = enter(region)
        local.modifiers.append((hooks.describe(integration, hook, lambda: hook.rank(region)), hook))
        return out

    @functools.wraps(exit_)
    def __exit__(region: Any, *exc: Any) -> Any:
        try:
            return exit_(region, *exc)  # (the broadcast)
        finally:
            if local.modifiers:
                local.modifiers.pop()

    hooks.patch(cls, "__enter__", __enter__)
    hooks.patch(cls, "__exit__", __exit__)


@_handles(JoinContext)
def _join(hooks: Hooks, integration: Integration, hook: Any, owner: Any, cls: Any) -> None:
    """torch's ``Join``: its entry, each iteration's ``notify_join_context`` (from the first
    joinable, the one whose all-reduce Join pairs with the shadowing ranks' own), a rank
    running out of inputs, and the return of ``__exit__``; only for an enabled Join, and
    never breaking the user's (a failure to tell is logged). The rank checker is told the
    Join's label and the ranks of its group (None: unreadable)."""
    enter, exit_ = cls.__enter__, cls.__exit__
    notify = cls.notify_join_context
    threads = hooks.program.local
    on_join = hooks._on_join

    def tell(what: str, join: JoinSeen) -> None:
        try:
            on_join(what, join)
        except RNGCheckError:
            # A finding the round settled here, with on_finding="raise": every rank settles
            # that round here and raises it (swallowed, this rank would train on and wait in
            # Join's own all-reduce for ranks that left).
            raise
        except Exception:  # noqa: BLE001 - never break the user's Join
            log.debug("rngcheck could not follow a Join (%s)", what, exc_info=True)

    def seen(join: Any) -> JoinSeen | None:
        def read() -> JoinSeen | None:
            if not hook.enabled(join):
                return None
            kinds = ", ".join(type(j).__name__ for j in hook.joinables(join))
            return JoinSeen(join, f"Join([{kinds}])", group_ranks(hook.group(join)))

        return hooks.describe(integration, hook, read)

    @functools.wraps(enter)
    def __enter__(join: Any) -> Any:
        out = enter(join)
        entry = seen(join)
        if entry is not None:
            threads.joins.append(entry)
            tell("enter", entry)
        return out

    @functools.wraps(exit_)
    def __exit__(join: Any, type_: Any, value: Any, traceback: Any) -> Any:
        entry = threads.joins[-1] if threads.joins and threads.joins[-1].join is join else None
        try:
            if entry is not None and type_ is None:
                tell("exit", entry)  # (a finding raised here leaves as Join's own would)
            return exit_(join, type_, value, traceback)
        finally:
            if entry is not None:
                threads.joins.pop()
                tell("left", entry)

    @functools.wraps(notify)
    def notify_join_context(joinable: Any) -> Any:
        if threads.joins and hooks.describe(integration, hook, lambda: hook.first(joinable)):
            tell("round", threads.joins[-1])
        return notify(joinable)

    hooks.patch(cls, "__enter__", __enter__)
    hooks.patch(cls, "__exit__", __exit__)
    hooks.patch(cls, "notify_join_context", staticmethod(notify_join_context))
