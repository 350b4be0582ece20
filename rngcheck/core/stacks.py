"""Call stacks captured cheaply at a random op and summarised only when a report needs them.

A record must not keep frames (they pin every local of the training step) or tensors alive, so a
stack is captured as a ``CapturedTraceback`` (~1 us, code objects and offsets only) and turned into
plain :class:`Frame` records the first time anything reads it.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch
from torch.utils._traceback import CapturedTraceback

# What CapturedTraceback.extract() calls (torch 2.1 on), called directly once per random op.
_gather: Callable[..., Any] | None
try:
    from torch._C._profiler import gather_traceback as _gather
except ImportError:  # pragma: no cover - a torch without it: extract() as it is
    _gather = None

__all__ = [
    "CodeFlags",
    "Frame",
    "Stack",
    "is_internal_file",
    "is_own_file",
    "user_frame",
    "user_site",
]


def _dir_of(module_file: str) -> str:
    return os.path.dirname(os.path.abspath(module_file)) + os.sep


_OWN_DIR = _dir_of(os.path.dirname(os.path.abspath(__file__)))  # the rngcheck package
_INTERNAL_PREFIXES: tuple[str, ...] = tuple(
    {
        _dir_of(torch.__file__),
        _OWN_DIR,
        os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
    }
)
# Frames from the test runner and plugin machinery are not the user's line either.
_INTERNAL_PARTS = (
    f"{os.sep}torchinductor_",  # inductor's generated code (its cache directory)
    f"{os.sep}_pytest{os.sep}",
    f"{os.sep}pytest{os.sep}",
    f"{os.sep}pluggy{os.sep}",
    f"{os.sep}torch_xla{os.sep}",
    f"{os.sep}hypothesis{os.sep}",
)


# A user's own dispatch or function mode sits between their line and the op: its hook is the
# plumbing, not the line a report should point at.
_MODE_HOOKS = frozenset({"__torch_dispatch__", "__torch_function__"})


@functools.lru_cache(maxsize=4096)  # a program has few source files; abspath is not free
def is_internal_file(filename: str) -> bool:
    """Whether a frame in ``filename`` belongs to torch, rngcheck, the stdlib or a test runner."""
    if filename.startswith("<"):
        return filename != "<stdin>" and not filename.startswith("<ipython")
    path = os.path.abspath(filename)
    return path.startswith(_INTERNAL_PREFIXES) or any(p in path for p in _INTERNAL_PARTS)


@functools.lru_cache(maxsize=4096)
def is_own_file(filename: str) -> bool:
    """Whether a frame in ``filename`` is rngcheck's own (its hooks, its dispatch mode, its
    recorder): never part of a stack it records."""
    return not filename.startswith("<") and os.path.abspath(filename).startswith(_OWN_DIR)


@dataclass(frozen=True, slots=True, kw_only=True)
class Frame:
    """One call-stack frame: where, which function, the source line, and whether it is user code."""

    filename: str
    lineno: int
    name: str
    line: str = ""
    user: bool = True

    @property
    def location(self) -> str:
        return f"{self.filename}:{self.lineno}"

    @property
    def short_location(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "filename": self.filename,
            "lineno": self.lineno,
            "name": self.name,
            "line": self.line,
            "user": self.user,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Frame:
        return cls(
            filename=str(data["filename"]),
            lineno=int(data["lineno"]),
            name=str(data["name"]),
            line=str(data.get("line", "")),
            user=bool(data.get("user", True)),
        )


class CodeFlags:
    """A yes/no learned once per code object (``learn(code)``), then one dict lookup. Keyed by
    identity: hashing a code object hashes its constants (nested functions' code too) on every
    lookup. An entry refers to its code weakly and leaves with it, so the id is not reused while
    the entry lives and no code is kept alive: TorchDynamo's transformed code deletes its compiled
    graph from the module when it dies (after ``torch._dynamo.reset()``, or when a compiled
    function goes), which a strong reference here would hold back forever."""

    __slots__ = ("_learn", "_known", "_limit", "peek")

    def __init__(self, learn: Callable[[CodeType], bool], limit: int = 65536) -> None:
        self._learn = learn
        self._known: dict[int, tuple[weakref.ReferenceType[CodeType], bool]] = {}
        self._limit = limit  # generated code can make many code objects
        # peek(id(code)): (ref, flag) once learned, else None. For the hottest callers: a
        # C call where ``self(code)`` is a Python one (``self(code)`` learns it when None).
        self.peek = self._known.get

    def __call__(self, code: CodeType) -> bool:
        known = self._known.get(id(code))
        if known is not None:
            return known[1]
        flag = self._learn(code)
        known_codes = self._known
        if len(known_codes) > self._limit:
            known_codes.clear()
        key = id(code)

        def forget(_: object) -> None:
            known_codes.pop(key, None)

        try:
            ref = weakref.ref(code, forget)
        except TypeError:  # a code object that takes no weak reference: learned every time
            return flag
        known_codes[key] = (ref, flag)
        return flag

    def clear(self) -> None:
        self._known.clear()


is_user_code = CodeFlags(
    lambda code: not is_internal_file(code.co_filename) and code.co_name not in _MODE_HOOKS
)
"""Whether frames running a code object are the user's (one dict lookup once it is known)."""


def user_frame(skip: int = 0) -> tuple[str, int] | None:
    """(filename, line) of the caller's innermost user frame, found by walking the live frames
    (a microsecond or two: no stack is captured or summarised)."""
    frame: FrameType | None = sys._getframe(skip + 1)
    peek = is_user_code.peek
    while frame is not None:
        code = frame.f_code
        known = peek(id(code))
        if known[1] if known is not None else is_user_code(code):
            return code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


_SITES: dict[tuple[str, int], str] = {}  # (filename, line) -> "file.py:12"


def user_site(skip: int = 0) -> str:
    """``file.py:12`` of the caller's innermost user frame (see :func:`user_frame`)."""
    found = user_frame(skip + 1)
    if found is None:
        return "<unknown>"
    site = _SITES.get(found)
    if site is None:
        if len(_SITES) > 65536:
            _SITES.clear()
        site = _SITES[found] = f"{os.path.basename(found[0])}:{found[1]}"
    return site


class Stack:
    """A call stack, outermost frame first.

    Built from a captured traceback (summarised lazily, once) or from frames (a loaded report).
    """

    __slots__ = ("_tb", "_frames", "_innermost")

    def __init__(
        self,
        tb: CapturedTraceback | None = None,
        frames: tuple[Frame, ...] = (),
        innermost: Frame | None = None,
    ):
        self._tb = tb
        self._frames: tuple[Frame, ...] | None = None if tb is not None else tuple(frames)
        self._innermost = innermost  # added below the captured frames when they are summarised

    @classmethod
    def capture(cls, innermost: Frame | None = None) -> Stack:
        """The caller's stack (summarised only when read). ``innermost``: a frame to put below it
        (a compiled graph's source line, which no Python frame holds)."""
        # The whole stack, always: torch's frames are marked internal and rngcheck's left out
        # when it is read. Skipping a counted number of frames would cut into the user's
        # frames on torch versions with fewer wrapper frames between them and the mode.
        if _gather is not None:  # (what extract() does, without its Python call and import)
            tb = CapturedTraceback(_gather(python=True, script=False, cpp=False), 1)
            return cls(tb, innermost=innermost)
        return cls(CapturedTraceback.extract(skip=1), innermost=innermost)

    @classmethod
    def empty(cls) -> Stack:
        return cls(frames=())

    @property
    def frames(self) -> tuple[Frame, ...]:
        if self._frames is None:
            tb, self._tb = self._tb, None
            summary = tb.summary() if tb is not None else []
            self._frames = tuple(
                Frame(
                    filename=fs.filename,
                    lineno=fs.lineno or 0,
                    name=fs.name,
                    line=(fs.line or linecache.getline(fs.filename, fs.lineno or 0)).strip(),
                    user=not is_internal_file(fs.filename) and fs.name not in _MODE_HOOKS,
                )
                for fs in summary
                # The checker is no part of the user's program: its frames (the interceptor,
                # the recorder, the checkpoint shims) are left out of every stack it records,
                # the JSON report's included, as the rendering leaves out torch's.
                if not is_own_file(fs.filename)
            )
            if self._innermost is not None:
                self._frames = (*self._frames, self._innermost)
        return self._frames

    @property
    def user_frames(self) -> tuple[Frame, ...]:
        return tuple(f for f in self.frames if f.user)

    @property
    def call_site(self) -> Frame | None:
        """The innermost user frame: the line a report points at."""
        user = self.user_frames
        if user:
            return user[-1]
        return self.frames[-1] if self.frames else None

    def describe(self) -> str:
        site = self.call_site
        return site.short_location if site is not None else "<unknown>"

    def to_list(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.frames]

    @classmethod
    def from_list(cls, data: list[dict[str, Any]]) -> Stack:
        return cls(frames=tuple(Frame.from_dict(d) for d in data))

    def __repr__(self) -> str:
        return f"Stack({self.describe()})"
