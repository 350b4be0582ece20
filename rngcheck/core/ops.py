"""Which ops are random, which generator and device an op draws from, and how to summarise its
arguments for a report.

An op is random when it carries ``torch.Tag.nondeterministic_seeded`` (114 aten overloads on torch
2.13: dropout, bernoulli, rand*, randn*, randperm, normal, uniform_, SDPA kernels, ...) or when it
was registered with :func:`register_random_op` (custom ops that draw from a torch generator without
the tag). Every op is classified once, into :data:`KINDS`, the one table the dispatch mode's hot
path reads (one dict lookup); registering an op updates that same table, also while a mode runs.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Iterable
from typing import Any

import torch
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

__all__ = ["KINDS", "OpKind", "classify", "op_name", "register_random_op", "summarize_args"]


class OpKind(enum.IntEnum):
    PASS = 0  # not random: straight through
    RANDOM = 1  # draws from a generator
    COLLECTIVE = 2  # a torch.distributed collective: an alignment point for the rank exchange


_EXTRA_RANDOM: set[OpOverload] = set()


class _KindTable(dict[Any, OpKind]):
    """op -> OpKind, classifying an op the first time it is looked up."""

    def __missing__(self, func: Any) -> OpKind:
        kind = self[func] = _classify(func)
        return kind


KINDS: dict[Any, OpKind] = _KindTable()


def register_random_op(*ops: OpOverload | OpOverloadPacket) -> None:
    """Treat ops without the ``nondeterministic_seeded`` tag as random.

    Accepts overloads (``torch.ops.mylib.noise.default``) or packets (every overload of
    ``torch.ops.mylib.noise``). Registering an op twice, or one that already carries the tag, is an
    error: it usually means two libraries disagree about an op.
    """
    overloads: list[OpOverload] = []
    for op in ops:
        if isinstance(op, OpOverloadPacket):
            overloads.extend(getattr(op, name) for name in op.overloads())
        elif isinstance(op, OpOverload):
            overloads.append(op)
        else:
            raise TypeError(
                f"register_random_op expects torch ops such as torch.ops.aten.bernoulli_.float or "
                f"torch.ops.mylib.noise, got {type(op).__name__} {op!r}"
            )
    for op in overloads:
        if op in _EXTRA_RANDOM or torch.Tag.nondeterministic_seeded in op.tags:
            raise ValueError(
                f"{op} is already treated as random (registered before, or tagged "
                "nondeterministic_seeded); register each op once"
            )
    from .selective import add_random_op

    for op in overloads:
        _EXTRA_RANDOM.add(op)
        KINDS[op] = OpKind.RANDOM  # the table a running mode reads: it checks the op from now on
        add_random_op(op)  # and on the selective route, its kernel


# Point-to-point ops: two ranks meet there, not the group (a pipeline's stages send and receive
# in orders and numbers of their own), so they are no alignment point.
_POINT_TO_POINT = ("send", "recv_", "recv_any_source_")


def _is_collective(func: Any) -> bool:
    if getattr(func, "namespace", None) != "c10d":
        return False
    name = func.__name__.split(".")[0]
    return not (name.startswith("wait") or name in _POINT_TO_POINT)


def classify(func: Any) -> OpKind:
    """The kind of an op (from :data:`KINDS`)."""
    return KINDS[func]


# Higher-order operators that run a random op and save or restore its generator's state: what
# compiled graphs run for random ops that autograd recomputes (functionalised RNG).
_RANDOM_HOPS = ("run_and_save_rng_state", "run_with_rng_state")


def _classify(func: Any) -> OpKind:
    """Called on the first sight of every op, so it may be slowish."""
    if func in _EXTRA_RANDOM or torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return OpKind.RANDOM
    if isinstance(func, HigherOrderOperator) and func.name() in _RANDOM_HOPS:
        return OpKind.RANDOM
    if _is_collective(func):
        return OpKind.COLLECTIVE
    return OpKind.PASS


_WRITES: dict[Any, bool] = {}


def writes_first_argument(func: Any) -> bool:
    """Whether the op writes its first argument in place (``uniform_``, ``normal_``: how
    ``nn.init`` fills a parameter)."""
    hit = _WRITES.get(func)
    if hit is None:
        arguments = getattr(getattr(func, "_schema", None), "arguments", ())
        alias = arguments[0].alias_info if arguments else None
        hit = _WRITES[func] = bool(alias is not None and alias.is_write)
    return hit


_DETERMINED: dict[Any, bool] = {}

# torch's in-place fills: each overwrites its tensor with draws from the generator, whatever the
# tensor held (unlike dropout_ or alpha_dropout_, which scale the values they find).
_FILLS = frozenset(
    {"bernoulli_", "uniform_", "normal_", "cauchy_", "exponential_", "geometric_", "log_normal_"}
)


def state_determines_output(func: Any) -> bool:
    """Whether an aten op's output follows from the generator's state and its summarised
    arguments alone: one of torch's in-place fills with no tensor argument but the one it fills
    (``bernoulli_.float``, ``normal_``, ``uniform_``), or an op with no tensor argument at all
    (``randn``, ``randperm``). Two such draws with the same op, arguments and state before made
    the same output, so the recompute comparison needs no digest of it. An op that reads a
    tensor's values (``bernoulli(probs)``, ``native_dropout``, ``dropout_``, the ``out=`` and
    ``_like`` overloads) and every op outside aten (a custom op) is not one: its output is
    digested."""
    hit = _DETERMINED.get(func)
    if hit is None:
        schema = getattr(func, "_schema", None)
        hit = False
        if schema is not None and getattr(func, "namespace", "") == "aten":
            arguments = schema.arguments
            tensors = [a for a in arguments if "Tensor" in str(a.type)]
            first = arguments[0] if arguments else None
            hit = not tensors or (
                tensors == [first]
                and first is not None
                and first.alias_info is not None
                and first.alias_info.is_write
                and schema.name.removeprefix("aten::") in _FILLS
            )
        _DETERMINED[func] = hit
    return hit


def op_name(func: Any) -> str:
    """``aten.bernoulli_.float``: namespace, name and overload, as torch prints them (kept per
    op: torch formats an OpOverload's name in Python at every ``str``, once per random op)."""
    name = _OP_NAMES.get(func)
    if name is None:
        name = func.name() if isinstance(func, HigherOrderOperator) else str(func)
        if len(_OP_NAMES) < 4096:  # (ops made at run time: the table stops growing)
            _OP_NAMES[func] = name
    return name


_OP_NAMES: dict[Any, str] = {}


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_ARG_NAMES: dict[Any, tuple[str, ...]] = {}


def format_float(value: float) -> str:
    """A float as a person wrote it: the shortest decimal that gives back the same float32 for a
    value that is one (``0.1`` for float32's 0.10000000149011612, what a tensor's ``item()``
    returns), else 15 significant digits (``-0.25`` for -0.24999999999999997: digits past the
    15th are arithmetic noise, not intent). Inf and nan as Python writes them."""
    if not math.isfinite(value) or value == int(value) and abs(value) < 1e15:
        return repr(value)
    if struct.unpack("f", struct.pack("f", value))[0] == value:  # a float32 value
        for digits in range(1, 10):
            text = f"{value:.{digits}g}"
            if struct.unpack("f", struct.pack("f", float(text)))[0] == value:
                return text
    return f"{value:.15g}"


def _describe_value(value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        dtype = _DTYPE_NAMES.get(value.dtype)
        if dtype is None:
            dtype = _DTYPE_NAMES[value.dtype] = str(value.dtype).removeprefix("torch.")
        return f"{dtype}{list(value.shape)}"
    if isinstance(value, float):
        return format_float(value)
    if isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout)):
        return str(value).removeprefix("torch.") if not isinstance(value, str) else repr(value)
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, (int, torch.SymInt)) for v in value):
            return str(list(value))
        inner = [_describe_value(v) for v in value]
        return "[" + ", ".join(i for i in inner if i is not None) + "]"
    if value is None or isinstance(value, torch.Generator):
        return None
    return type(value).__name__


_SUMMARIES: dict[tuple, tuple[str, ...]] = {}


def _summary_key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.shape)
    return (type(v), v)  # the type too: True, 1 and 1.0 are equal keys but print differently


def summarize_args(func: Any, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """A readable, comparable summary: tensor dtypes and shapes, scalars by name (``p=0.1``).

    Memoised: a training loop calls the same ops with the same shapes at every step."""
    try:
        key = (
            func,
            *[_summary_key(v) for v in args],
            *[(k, _summary_key(v)) for k, v in kwargs.items() if k != "generator"],
        )
        hit = _SUMMARIES.get(key)
    except TypeError:  # an unhashable argument (a list of tensors): summarise every time
        return _summarize_args(func, args, kwargs)
    if hit is None:
        if len(_SUMMARIES) >= 4096:
            _SUMMARIES.clear()
        hit = _SUMMARIES[key] = _summarize_args(func, args, kwargs)
    return hit


def _summarize_args(func: Any, args: tuple, kwargs: dict) -> tuple[str, ...]:
    names = _ARG_NAMES.get(func)
    if names is None:
        schema_args = getattr(getattr(func, "_schema", None), "arguments", ())
        names = _ARG_NAMES[func] = tuple(a.name for a in schema_args)
    out: list[str] = []
    for i, value in enumerate(args):
        text = _describe_value(value)
        if text is None:
            continue
        name = names[i] if i < len(names) else f"arg{i}"
        out.append(text if isinstance(value, torch.Tensor) else f"{name}={text}")
    for name, value in kwargs.items():
        if name in ("generator", "pin_memory", "memory_format"):
            continue
        text = _describe_value(value)
        if text is not None:
            out.append(f"{name}={text}")
    return tuple(out)


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


def op_device(args: tuple, kwargs: dict) -> torch.device:
    """The device an op runs on: its first tensor's, else a factory op's ``device=``, else CPU.
    (``run_with_rng_state(state, op, *args)``: the state is a CPU tensor; its op's args decide.)"""
    if len(args) > 1 and isinstance(args[1], (OpOverload, HigherOrderOperator)):
        args = args[2:]
    for t in _tensors(args):
        return t.device
    for t in _tensors(kwargs.values()):
        return t.device
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    return torch.device("cpu")


def op_generator(args: tuple, kwargs: dict) -> torch.Generator | None:
    """The ``generator=`` an op was given, if any."""
    gen = kwargs.get("generator")
    if gen is not None:
        return gen
    for v in args:
        if isinstance(v, torch.Generator):
            return v
    return None
