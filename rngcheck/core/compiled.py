"""Random draws of compiled code: which compiled graph drew, in which pass, and the user's source
lines of its random ops.

Under rngcheck's dispatch mode ``torch.compile`` compiles and runs as it would without it (the
mode declares ``ignore_compile_internals``). What compiled code dispatches at run time still
reaches the mode: on the CPU, inductor draws the seeds of all of a graph's random kernels with one
``aten.randint.low_out`` from the default generator per call of the graph, from the graph's
generated ``call`` function. This module recognises such a draw by the frames above it: inductor's
``CompiledFxGraph`` (its post-grad graph, printed with the ``# File:`` comments of each node's
stack trace, names the user's lines of the graph's random ops) and AOT autograd's runtime
wrapper (its ``forward`` or ``backward``, and the compiled function its ``ctx`` belongs to, which
pairs a backward graph with its forward). Graph breaks and ``torch.compiler.disable`` regions run
eagerly, and their ops are checked one by one like any other.

Known limitations:
    Read from torch's private runtime (``CompiledFxGraph``, ``runtime_wrappers``) on torch 2.9 to
    2.14; on CUDA the philox seed and offset of functionalised random ops are read the same way,
    at the ops the compiled graph dispatches. A backward graph whose random nodes carry no stack
    trace (torch 2.14) is given its forward's lines; a forward graph without them points at the
    call of the compiled function instead of a source line.
"""

from __future__ import annotations

import linecache
import re
import sys
from dataclasses import dataclass
from typing import Any

from .stacks import Frame, is_user_code

__all__ = ["CompiledCall", "CompiledGraphHook", "compiled_call"]

_MAX_DEPTH = 24  # frames between the mode's hook and AOT autograd's runtime wrapper
_AOT = "torch._functorch._aot_autograd.runtime_wrappers"
_RANDOM_NODES = re.compile(
    r"inductor_random|inductor_randint|native_dropout|bernoulli|\brandn?\b|randint|randperm"
    r"|uniform|normal|exponential|multinomial|philox_rand|run_and_save_rng_state"
)
_FILE = re.compile(r"# File: (?P<file>.+?):(?P<line>\d+) in (?P<name>\S+), code: (?P<code>.*)$")


@dataclass(frozen=True, slots=True)
class CompiledCall:
    """A call of a compiled graph that a random op was dispatched from."""

    kind: str  # "forward" or "backward": the AOT autograd pass
    function: Any  # the compiled function (its backward node class): pairs backward to forward
    sources: tuple[Frame, ...]  # the user's lines of the graph's random ops, in graph order

    @property
    def label(self) -> str:
        return f"compiled {self.kind}"


_SOURCES: dict[int, tuple[Any, tuple[Frame, ...]]] = {}  # id(CompiledFxGraph) -> (it, sources)
# A compiled function's forward sources: a backward graph whose nodes carry no stack trace (torch
# 2.14 prints none for recomputed nodes) redraws the forward's random ops, at the forward's lines.
_FORWARD_SOURCES: dict[Any, tuple[Frame, ...]] = {}


def _sources(graph: Any) -> tuple[Frame, ...]:
    """The user's lines of a compiled graph's random ops, from its printed post-grad graph."""
    hit = _SOURCES.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    text = getattr(graph, "inductor_post_grad_graph_str", None) or ""
    found: list[Frame] = []
    comment = None
    for line in text.splitlines():
        stripped = line.strip()
        m = _FILE.match(stripped)
        if m is not None:
            comment = m
            continue
        if not stripped or stripped.startswith("#"):
            continue
        if comment is not None and _RANDOM_NODES.search(stripped.split("=", 1)[-1]):
            frame = _located(comment["file"], int(comment["line"]), comment["name"], comment)
            if frame is not None and frame not in found:
                found.append(frame)
    if len(_SOURCES) >= 256:
        _SOURCES.clear()
    _SOURCES[id(graph)] = (graph, tuple(found))  # the graph itself keeps its id from reuse
    return tuple(found)


def _located(filename: str, lineno: int, name: str, comment: Any) -> Frame | None:
    """The source line as the file holds it now. Inductor's graph cache is keyed by the graph, not
    by where it came from: a graph loaded from the cache carries the stack traces of the program
    that compiled it first, which may be another file, or this one before an edit. The line must
    hold the recorded code (else the nearest line that does); otherwise there is no source line."""
    code = comment["code"].strip()
    lines = linecache.getlines(filename)
    if not lines:
        return None
    if 0 < lineno <= len(lines) and lines[lineno - 1].strip() == code:
        return Frame(filename=filename, lineno=lineno, name=name, line=code)
    matches = [i for i, text in enumerate(lines, 1) if text.strip() == code]
    if not matches:
        return None
    nearest = min(matches, key=lambda i: abs(i - lineno))
    return Frame(filename=filename, lineno=nearest, name=name, line=code)


def compiled_call(skip: int = 1, graph: Any = None) -> CompiledCall | None:
    """The compiled graph whose run dispatched the current op, if any (a short frame walk).
    ``graph``: the graph being called, when the caller knows it (the graph hook)."""
    if _AOT not in sys.modules:  # nothing was ever compiled in this process: nothing to find
        return None
    frame: Any = sys._getframe(skip)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        code = frame.f_code
        if is_user_code(code):
            break  # compiled code runs no user frame between its draw and its runtime wrapper
        if graph is None and code.co_name == "__call__":
            owner = frame.f_locals.get("self")
            if type(owner).__name__ == "CompiledFxGraph":
                graph = owner
        elif code.co_name in ("forward", "backward") and code.co_filename.endswith(
            "runtime_wrappers.py"
        ):
            ctx = frame.f_locals.get("ctx")
            if ctx is not None:
                return _call(code.co_name, type(ctx), graph)
        frame = frame.f_back
    if graph is None:
        return None
    # An inference graph (no grad): no autograd function around it.
    return CompiledCall(kind="forward", function=None, sources=_sources(graph))


def _call(kind: str, function: Any, graph: Any) -> CompiledCall:
    sources = _sources(graph) if graph is not None else ()
    if kind == "forward" and sources:
        if len(_FORWARD_SOURCES) >= 256:
            _FORWARD_SOURCES.clear()
        _FORWARD_SOURCES[function] = sources
    elif kind == "backward" and not sources:
        sources = _FORWARD_SOURCES.get(function, ())
    return CompiledCall(kind=kind, function=function, sources=sources)


_OUTPUT_CODE = "torch._inductor.output_code"


class CompiledGraphHook:
    """While a mode runs, every call of an inductor graph goes through ``on_call(graph, run)``
    (``run()`` calls the graph), so the mode can set itself aside for the graph's kernels and read
    what the call drew from the generators' states before and after it.

    Installed when inductor is already loaded at the mode's start, else at the first compiled draw
    the mode intercepts (importing inductor here would cost every user seconds). Without the hook
    (another backend, a torch whose runtime moved) compiled code is still checked, op by op.
    """

    def __init__(self, on_call: Any) -> None:
        self._on_call = on_call
        self._saved: tuple[Any, Any] | None = None

    def install(self) -> None:
        if self._saved is not None:
            return
        cls = getattr(sys.modules.get(_OUTPUT_CODE), "CompiledFxGraph", None)
        original = vars(cls).get("__call__") if cls is not None else None
        if cls is None or original is None:
            return
        on_call = self._on_call

        def __call__(graph: Any, inputs: Any) -> Any:
            return on_call(graph, lambda: original(graph, inputs))

        self._saved = (cls, original)
        cls.__call__ = __call__

    def uninstall(self) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            cls, original = saved
            cls.__call__ = original
