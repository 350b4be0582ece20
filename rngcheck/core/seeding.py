"""Call sites of the Python APIs that reseed or overwrite generators, noted while a mode is active.

An out-of-band change on its own is normal (seeding); it only matters when it explains a finding:
"rank 1 called torch.manual_seed(1) at train.py:12". So the patched APIs only append a cheap
record; nothing is compared here. Every patch is undone on exit.

``Generator.manual_seed`` and ``Generator.set_state`` are methods of a C type and cannot be
patched; for those the checker still sees the change (the state differs from the one after the
last op) and reports the new ``initial_seed()``, without a call site.
"""

from __future__ import annotations

import functools
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch

from .events import SeedCall
from .stacks import CodeFlags, Stack, is_internal_file

__all__ = ["SeedCallLog"]

# (module path, attribute, which default generators it changes, how to describe its argument)
_ALL = "*"
_CPU = "cpu"


def _seed_arg(args: tuple, kwargs: dict) -> str:
    value = args[0] if args else kwargs.get("seed", "")
    return str(value)


def _state_arg(_args: tuple, _kwargs: dict) -> str:
    return "<state>"


def _no_arg(_args: tuple, _kwargs: dict) -> str:
    return ""


@dataclass(frozen=True, slots=True)
class _Target:
    module: str
    name: str
    affects: str  # "*" (every default generator), "cpu", or a device type ("cuda")
    describe: Callable[[tuple, dict], str]
    library: bool = False  # a reset the library makes on its own schedule (an XLA sync)


_TARGETS: list[_Target] = [
    _Target("torch", "manual_seed", _ALL, _seed_arg),
    _Target("torch.random", "manual_seed", _ALL, _seed_arg),
    _Target("torch", "seed", _ALL, _no_arg),
    _Target("torch.random", "seed", _ALL, _no_arg),
    _Target("torch", "set_rng_state", _CPU, _state_arg),
    _Target("torch.random", "set_rng_state", _CPU, _state_arg),
    _Target("torch.cuda", "manual_seed", "cuda", _seed_arg),
    _Target("torch.cuda", "manual_seed_all", "cuda", _seed_arg),
    _Target("torch.cuda", "seed", "cuda", _no_arg),
    _Target("torch.cuda", "seed_all", "cuda", _no_arg),
    _Target("torch.cuda", "set_rng_state", "cuda", _state_arg),
    _Target("torch.cuda", "set_rng_state_all", "cuda", _state_arg),
    _Target("torch.cuda.random", "manual_seed", "cuda", _seed_arg),
    _Target("torch.cuda.random", "manual_seed_all", "cuda", _seed_arg),
    _Target("torch.cuda.random", "set_rng_state", "cuda", _state_arg),
    _Target("torch.cuda.random", "set_rng_state_all", "cuda", _state_arg),
]


def register_seed_api(
    module: str,
    name: str,
    affects: str,
    describe: Callable[[tuple, dict], str] = _seed_arg,
    *,
    library: bool = False,
) -> None:
    """Add a seeding API to watch (the torch_xla support adds ``xm.set_rng_state``).

    ``library=True``: the call resets the state as part of the library's normal work (an XLA
    ``mark_step``); it explains a state change but is never the user's seed to blame.
    """
    if any(t.module == module and t.name == name for t in _TARGETS):
        raise ValueError(f"{module}.{name} is already watched")
    _TARGETS.append(_Target(module, name, affects, describe, library))


def _affects(affects: str, device: str) -> bool:
    return affects == _ALL or device == affects or device.startswith(affects + ":")


class SeedCallLog:
    """Recent seeding calls, numbered so a generator can ask "what happened since my last op"."""

    def __init__(self, maxlen: int = 256) -> None:
        self._calls: deque[tuple[int, str, SeedCall]] = deque(maxlen=maxlen)
        self.counter = 0
        # Between sampled steps (level="step") nothing reads the library's own calls (a
        # checkpoint's stash and restore, twice a region): only the user's are kept then.
        self.quiet = False
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def since(self, mark: int, device: str) -> tuple[SeedCall, ...]:
        found = []
        for n, affects, call in reversed(self._calls):  # newest first: stop at the mark
            if n <= mark:
                break
            if _affects(affects, device):
                found.append(call)
        return tuple(reversed(found))

    def install(self) -> None:
        for target in _TARGETS:
            module = sys.modules.get(target.module)
            if module is None:
                continue
            original = getattr(module, target.name, None)
            if original is None or hasattr(original, "__rngcheck_original__"):
                continue  # absent, or already watched (install runs again for late additions)
            self._saved.append((module, target.name, original))
            setattr(module, target.name, self._wrap(original, target))

    def uninstall(self) -> None:
        saved, self._saved = self._saved, []
        for module, name, original in reversed(saved):
            setattr(module, name, original)

    def _wrap(self, original: Callable[..., Any], target: _Target) -> Callable[..., Any]:
        api = f"{target.module}.{target.name}"

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:  # torch.manual_seed calls torch.cuda.manual_seed_all: note one
                code = sys._getframe(1).f_code
                known = _library_peek(id(code))  # (twice a region: checkpoint's restore)
                by_torch = target.library or (
                    known[1] if known is not None else _library_code(code)
                )
                if by_torch and self.quiet:
                    return original(*args, **kwargs)  # (what it calls is the library's too)
                self.counter += 1
                # The library's own calls (checkpoint's restore, fork_rng) are only ever named by
                # their API in findings; capturing their stacks cost ~5 us twice per region.
                call = SeedCall(
                    api=api,
                    argument=target.describe(args, kwargs),
                    stack=Stack.empty() if by_torch else Stack.capture(),
                    by_torch=by_torch,
                )
                self._calls.append((self.counter, target.affects, call))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        wrapper.__rngcheck_original__ = original  # type: ignore[attr-defined]
        return wrapper


_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"
# Calls from files under these directories are the library's own (a checkpoint's restore,
# fork_rng), not a user's line to blame. The torch_xla support adds torch_xla's directory.
_LIBRARY_DIRS: tuple[str, ...] = (_TORCH_DIR,)


def _from_library(code: CodeType) -> bool:
    name = code.co_filename
    return is_internal_file(name) and name.startswith(_LIBRARY_DIRS)


# Whether a seeding call from a code object is the library's own (learned once per code: a
# checkpoint's restore makes two such calls a region).
_library_code = CodeFlags(_from_library, limit=4096)
_library_peek = _library_code.peek


def register_library_dir(path: str) -> None:
    """Count seeding calls made from files under ``path`` as the library's own (``by_torch``)."""
    global _LIBRARY_DIRS
    if path not in _LIBRARY_DIRS:
        _LIBRARY_DIRS = (*_LIBRARY_DIRS, path)
        _library_code.clear()
