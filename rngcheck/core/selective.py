"""The selective route: only the random ops and the collectives reach Python.

A ``TorchDispatchMode`` (``core/dispatch.py``, the fallback route) sends every aten op through
Python; about one op in fifty is random, and the matmuls pay for them. Here a Python kernel is
registered, with ``torch.library``, for each op that :data:`~rngcheck.core.ops.KINDS` calls random
or a collective, at the ``PreDispatch`` dispatch key; the checker puts that key into the thread's
include set while it checks. Every other op then meets only torch's own ``PreDispatch`` fallback,
a C++ redispatch past the key (0.04 us an op here), and nothing of rngcheck.

Why ``PreDispatch``:

- it sits above autograd and every other functionality key but the Python dispatcher, so an op is
  seen once, as the program called it (a DTensor op as the DTensor op, before DTensor's own
  dispatch runs the local op; a checkpoint's recompute as it runs), and the check's own work in the
  kernel runs with the key excluded, as a dispatch mode's runs with the mode popped;
- every op falls through it in C++ unless a kernel is registered for it (torch's backend fallback
  for the key only redispatches); the other keys that do so for all ops are not free to take:
  ``Autocast*`` would turn autocast on, ``BackendSelect`` and ``ADInplaceOrView`` hold kernels of
  their own, ``PythonTLSSnapshot`` and ``PythonDispatcher`` carry the Python modes' state;
- torch uses it too, for export's pre-dispatch tracing (``torch.export`` and
  ``_export_for_training``): there torch's pre-dispatch modes run before any kernel of the key, so
  the kernels here pass every op through while such a mode is active, and pass through whenever
  the checker is not the one running. When that tracing ends torch takes the key out of the
  include set; :meth:`SelectiveInterceptor.heal` puts it back (the mode calls it at every
  optimizer step) and counts it.

What the key costs elsewhere: a higher-order operator (``torch.cond``, ``flex_attention`` run
eagerly, an ``aot_eager`` graph's ``run_and_save_rng_state``) dispatches in Python and fails
without a kernel at the key, and some take the key for export's tracing in their own
``__call__``. While the checker runs, the two that run a random op get a kernel and are checked
like one; every other one falls through the key (``HigherOrderOperator.fallthrough``), as though
it were not included, and the ops its body runs are seen. Both are undone at exit.

Ops that torch decomposes before autograd (``CompositeImplicitAutograd``: ``dropout``,
``scaled_dot_product_attention``) get no kernel: like a dispatch mode, the checker sees what they
decompose into (``native_dropout``, the attention kernel), so both routes record the same ops.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

from .dispatch import _SKIP_DYNAMO
from .ops import _EXTRA_RANDOM, _RANDOM_HOPS, KINDS, OpKind

__all__ = ["SelectiveInterceptor", "add_random_op", "selective_ops", "unavailable", "wanted"]

OnSpecial = Callable[[OpKind, Any, tuple, dict], Any]

_KEY = DispatchKey.PreDispatch
_KEYSET = DispatchKeySet(_KEY)
_included = torch._C._dispatch_tls_is_dispatch_key_included
_set_included = torch._C._dispatch_tls_set_dispatch_key_included
_Excluded = torch._C._ExcludeDispatchKeyGuard
_infra_mode = torch._C._get_dispatch_mode
# The modes of tracing (torch.compile's fake tensors, make_fx and export's proxies,
# functionalization): ops that run under them draw nothing; they pass through, as they pass a
# dispatch mode that ignores compile internals.
_TRACING = tuple(
    getattr(torch._C._TorchDispatchModeKey, name)
    for name in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, name)
)


def unavailable() -> str:
    """Why this torch cannot serve the selective route, or "" when it can."""
    from torch._ops import HigherOrderOperator

    needs = (
        (torch._C, "_dispatch_get_all_op_names"),
        (torch._C, "_dispatch_has_kernel_for_dispatch_key"),
        (torch._ops, "_higher_order_ops"),
        (torch._ops, "_set_mode_pre_dispatch"),
        (torch._ops, "_len_torch_dispatch_stack_pre_dispatch"),
        (torch.library, "fallthrough_kernel"),
        (HigherOrderOperator, "py_impl"),
    )
    missing = [f"{getattr(o, '__name__', o)}.{name}" for o, name in needs if not hasattr(o, name)]
    if missing:
        return f"torch {torch.__version__} lacks {', '.join(missing)}"
    return ""


def _overload(full_name: str) -> Any:
    """``ns::name.overload`` as an OpOverload, or None when torch cannot resolve it."""
    namespace, _, rest = full_name.partition("::")
    name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def wanted(op: Any) -> bool:
    """Whether the route needs a kernel for ``op``: random or a collective (by :data:`KINDS`:
    the ``nondeterministic_seeded`` tag, :func:`~rngcheck.core.ops.register_random_op`, the c10d
    namespace), and not decomposed by torch before autograd. (An op whose library was destroyed
    since it was registered as random is gone from the dispatcher: none.)"""
    if not KINDS[op]:
        return False
    try:
        return not torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CompositeImplicitAutograd"
        )
    except RuntimeError:  # "operator ... does not exist"
        return False


_SCANNED: dict[str, Any] = {"key": None, "ops": (), "plain": ()}


def _scan() -> dict[str, Any]:
    """The dispatcher's ops, split: those the route needs a kernel for (:func:`wanted`) and the
    names of the others. Scanned again when the dispatcher's ops changed since the last scan (a
    library defined or destroyed some) or others were registered as random."""
    names = torch._C._dispatch_get_all_op_names()
    key = (hash(tuple(names)), frozenset(_EXTRA_RANDOM))  # (a library may go and another come)
    if key != _SCANNED["key"]:
        ops, plain = set(), []
        for full_name in sorted(names):
            op = _overload(full_name)
            if op is not None and wanted(op):
                ops.add(op)
            else:
                plain.append(full_name)
        ops.update(op for op in _EXTRA_RANDOM if wanted(op))
        _SCANNED.update(key=key, ops=tuple(sorted(ops, key=str)), plain=tuple(plain))
    return _SCANNED


def selective_ops() -> tuple[Any, ...]:
    """Every registered op the route needs a kernel for (:func:`wanted`)."""
    return _scan()["ops"]


class _Kernels:
    """The kernels, registered while a :class:`SelectiveInterceptor` is entered (one at a time:
    one mode per process). Each reads the interceptor that owns them now."""

    def __init__(self) -> None:
        self.owner: SelectiveInterceptor | None = None
        self._libraries: dict[str, torch.library.Library] = {}
        self._ops: set[Any] = set()
        self._plain: set[str] = set()  # the other ops' names, given a fallthrough
        self._through: dict[str, torch.library.Library] = {}  # (their libraries)
        self._hops: list[Any] = []  # random higher-order operators given a kernel
        self._fallen: list[Any] = []  # the others, made to fall through the key
        self._lock = threading.Lock()
        self._unwatch: Callable[[], None] | None = None
        self.parked = False  # between sampled steps (park)
        self._through_key: Any = None  # the scan the fallthroughs were given for

    def install(self, owner: SelectiveInterceptor) -> None:
        with self._lock:
            if self.owner is not None:
                raise RuntimeError("the selective route is already in use by another checker")
            self.owner = owner
        try:
            self._watch_exports()
            self.refresh()
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        with self._lock:
            self._remove()

    def _watch_exports(self) -> None:
        """torch pushes every pre-dispatch mode through ``torch._ops._set_mode_pre_dispatch``
        (looked up there at each call): wrapped while the route runs, to hear an export start."""
        import torch._ops as ops

        original = ops._set_mode_pre_dispatch

        def _set_mode_pre_dispatch(mode: Any) -> Any:
            if not ops._len_torch_dispatch_stack_pre_dispatch() and self._plain:
                self.export_started()
            return original(mode)

        ops._set_mode_pre_dispatch = _set_mode_pre_dispatch
        self._unwatch = lambda: setattr(ops, "_set_mode_pre_dispatch", original)

    def refresh(self) -> None:
        """Kernels for ops and higher-order operators defined since the last look (the random
        ops' and collectives' only while not parked): one scan of the dispatcher, 1 to 2 ms."""
        with self._lock:
            if self.owner is not None:
                scan = _scan()
                if not self.parked:
                    for op in scan["ops"]:
                        if op not in self._ops:
                            self._add(op)
                self._fall_through(scan)
                self._add_hops()

    def park(self) -> None:
        """Between sampled steps: the random ops' and collectives' kernels go (they are put back
        by :meth:`refresh`), so that those ops cost what they cost without the checker (a Python
        call each that passes the op on cost 7 to 16 us, 2% to 3% of the smallest benchmark
        model's step). The key and the other ops' fallthroughs stay."""
        with self._lock:
            self.parked = True
            self._drop_kernels()

    def unpark(self) -> None:
        self.parked = False
        self.refresh()

    def falling_through(self) -> bool:
        return bool(self._plain)

    def add(self, op: Any) -> None:
        """A kernel for an op registered as random while the checker runs."""
        with self._lock:
            if self.owner is not None and not self.parked and op not in self._ops and wanted(op):
                self._add(op)
                self._fall_through(_scan())

    def _add(self, op: Any) -> None:
        name = op._schema.name.split("::", 1)[1]
        if op._overloadname != "default":
            name = f"{name}.{op._overloadname}"
        if op.name() in self._plain:
            # Registered as random while the checker runs, it has a fallthrough, which no kernel
            # may override from another library (torch 2.9 refuses; later ones warn): its
            # namespace's fallthroughs go, and the next _fall_through gives back the others'.
            _destroy(self._through, op.namespace)
            self._plain = {n for n in self._plain if not n.startswith(op.namespace + "::")}
            self._through_key = None
        kernel = _kernel(op, self)
        _library(self._libraries, op.namespace).impl(name, kernel, "PreDispatch", with_keyset=True)
        self._ops.add(op)

    def _fall_through(self, scan: dict[str, Any]) -> None:
        """Every other op falls through the key (at no cost: the dispatcher leaves the key out
        of the op's keys). Without this it would meet torch's fallback for the key, a boxed
        redispatch, about 1 us an op: 6% to 10% of the benchmark's d=32 step. Not while an
        export traces (:meth:`export_started`)."""
        from torch._ops import _len_torch_dispatch_stack_pre_dispatch
        from torch.library import fallthrough_kernel

        if scan["key"] == self._through_key or _len_torch_dispatch_stack_pre_dispatch():
            return  # (all given already, for this scan)
        mine = {op.name() for op in scan["ops"]}  # (never over a kernel of the route's)
        for full_name in scan["plain"]:
            if full_name in self._plain or full_name in mine:
                continue
            namespace, _, name = full_name.partition("::")
            _library(self._through, namespace).impl(name, fallthrough_kernel, "PreDispatch")
            self._plain.add(full_name)
        self._through_key = scan["key"]

    def export_started(self) -> None:
        """An export's pre-dispatch tracing pushes its first mode: its tracing runs at this
        key, which the fallthroughs would skip (the export fails). They go until the next
        optimizer step after it ended (:meth:`SelectiveInterceptor.heal`)."""
        with self._lock:
            self._drop_fallthroughs()

    def _drop_kernels(self) -> None:
        _destroy(self._libraries)
        self._ops.clear()

    def _drop_fallthroughs(self) -> None:
        _destroy(self._through)
        self._plain.clear()
        self._through_key = None

    def _add_hops(self) -> None:
        from torch._ops import _higher_order_ops

        for hop in list(_higher_order_ops.values()):
            if hop in self._hops or hop in self._fallen or _KEY in hop.py_kernels:
                continue
            if hop.name() in _RANDOM_HOPS:
                hop.py_impl(_KEY)(_hop_kernel(hop, self))
                self._hops.append(hop)
            elif hop.non_fallthrough_keys.has(_KEY):
                # Every other one falls through the key, as though it were not included: its
                # body's ops are seen (a compiled checkpoint's body run by backend="eager"), as
                # they reach a dispatch mode below the operator's own kernels.
                hop.non_fallthrough_keys = hop.non_fallthrough_keys.remove(_KEY)
                hop._dispatch_cache.clear()
                self._fallen.append(hop)

    def _remove(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        self._drop_kernels()
        self._drop_fallthroughs()
        for hop in self._hops:
            hop.py_kernels.pop(_KEY, None)
            hop._dispatch_cache.clear()
        self._hops.clear()
        for hop in self._fallen:
            hop.non_fallthrough_keys = hop.non_fallthrough_keys.add(_KEY)
            hop._dispatch_cache.clear()
        self._fallen.clear()
        self.owner = None
        self.parked = False


def _library(libraries: dict[str, torch.library.Library], namespace: str) -> Any:
    """``namespace``'s library among ``libraries`` (one per namespace), made the first time."""
    library = libraries.get(namespace)
    if library is None:
        library = libraries[namespace] = torch.library.Library(namespace, "IMPL")
    return library


def _destroy(libraries: dict[str, torch.library.Library], namespace: str | None = None) -> None:
    """Destroy ``libraries`` (or only ``namespace``'s): every registration they made goes."""
    for name in list(libraries) if namespace is None else [namespace]:
        library = libraries.pop(name, None)
        if library is not None:
            library._destroy()


def _never_compiled(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """A kernel runs eagerly inside a compiled frame's graph break, with Dynamo's frame callback
    still set: marked (once per code object) so that Dynamo never compiles it nor what it calls,
    the check's own code, as the dispatch mode's ``__torch_dispatch__`` is."""
    if _SKIP_DYNAMO is not None:
        _SKIP_DYNAMO(kernel.__code__)
    return kernel


def _kernel(op: Any, kernels: _Kernels) -> Callable[..., Any]:
    kind = KINDS[op]

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        owner = kernels.owner
        if owner is None or owner.suspended or any(_infra_mode(k) for k in _TRACING):
            return op.redispatch(keyset.remove(_KEY), *args, **kwargs)
        with _Excluded(_KEYSET):
            return owner._on_special(kind, op, args, kwargs)

    return _never_compiled(kernel)


def _hop_kernel(hop: Any, kernels: _Kernels) -> Callable[..., Any]:
    """A random higher-order operator's kernel: checked like one random op."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        owner = kernels.owner
        with _Excluded(_KEYSET):
            if owner is None or owner.suspended or any(_infra_mode(k) for k in _TRACING):
                return hop(*args, **kwargs)
            return owner._on_special(OpKind.RANDOM, hop, args, kwargs)

    return _never_compiled(kernel)


_KERNELS = _Kernels()


def add_random_op(op: Any) -> None:
    """Called by :func:`~rngcheck.core.ops.register_random_op`: a running checker sees the op
    from now on, on this route too."""
    _KERNELS.add(op)


class SelectiveInterceptor:
    """Hands random ops and collectives to ``on_special(kind, func, args, kwargs)``, which runs
    them; every other op never reaches Python. The same surface as the dispatch mode's
    :class:`~rngcheck.core.dispatch.Interceptor`: entered on one thread (the include set is per
    thread, and torch carries it to the threads it runs a backward on, as it carries the mode
    stack), suspended between sampled steps, set aside for a compiled graph's call."""

    def __init__(self, on_special: OnSpecial) -> None:
        self._on_special = on_special
        self.suspended = False
        self._entered = False
        self._was_included = False

    def __enter__(self) -> SelectiveInterceptor:
        _KERNELS.install(self)
        self._was_included = _included(_KEY)
        _set_included(_KEY, True)
        self._entered = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._entered:
            return
        self._entered = False
        self.suspended = False
        _set_included(_KEY, self._was_included)
        _KERNELS.uninstall()

    def suspend(self) -> bool:
        """Stop checking ops until :meth:`resume`: the random ops' kernels go (``park``), and
        the key stays in the include set: Dynamo guards on it, and a compiled function would
        compile again at every switch of the step level."""
        if not self.suspended:
            self.suspended = True
            _KERNELS.park()
        return True

    def resume(self) -> None:
        if self.suspended:
            self.suspended = False
            _KERNELS.unpark()

    def heal(self) -> bool:
        """Put the key back when something took it out of this thread's include set (torch does,
        when an export's pre-dispatch tracing inside the checked block ends), and the other
        ops' fallthroughs once no export traces. True when the key was gone (the mode calls it at
        every optimizer step, and notes the steps)."""
        if not self._entered:
            return False
        if not _KERNELS.falling_through():
            _KERNELS.refresh()
        if not _included(_KEY):
            _set_included(_KEY, True)
            return True
        return False

    def leave_forked_child(self) -> None:
        """In a forked child (a DataLoader worker), which inherited the include set: off."""
        self._entered = False
        self.suspended = True
        _set_included(_KEY, self._was_included)

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[bool]:
        """Nothing is seen in the block (a compiled graph's call): yields True."""
        with _Excluded(_KEYSET):
            yield True
