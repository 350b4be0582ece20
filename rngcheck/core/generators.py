"""Generator identity and state digests: CPU (mt19937), philox devices, XLA, user Generators.

A digest is a signed 64-bit value of the generator's whole state: CRC-32 in its low half and
Adler-32 in its high half, read in place, so it packs into an int64 tensor for the cross-rank
exchange and two different states collide only by chance, never by construction the way an XOR or
8-bit hash does. It is read twice per random op: the pair costs a third of blake2b's time on the
CPU's 5,056 bytes, from the cold caches of a training step. (A digest is never a defence against
a state crafted to collide: nothing in a training run crafts states.) Reading a state never
changes it.
"""

from __future__ import annotations

import ctypes
import functools
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DeviceAdapter",
    "GeneratorId",
    "GeneratorRegistry",
    "register_device_adapter",
    "state_digest",
]


_HALF = 1 << 63


def _bytes_state_digest(buf: Any) -> int:
    """The signed 64-bit digest of a state's bytes (any buffer: read in place)."""
    value = zlib.crc32(buf) | zlib.adler32(buf) << 32
    return value - (_HALF << 1) if value >= _HALF else value


def state_digest(state: torch.Tensor) -> int:
    """Digest of a generator state as returned by ``Generator.get_state()`` (a CPU byte tensor)."""
    state = state.contiguous()
    nbytes = state.numel() * state.element_size()
    if nbytes == 0:
        return _bytes_state_digest(b"")
    return _bytes_state_digest((ctypes.c_char * nbytes).from_address(state.data_ptr()))


# ---------------------------------------------------------------------------------------------
# Device adapters: how to find a device's default generator and digest its state.


@dataclass(frozen=True, slots=True)
class DeviceAdapter:
    """How rngcheck reads the default generator of one device type.

    ``default(device)`` returns a handle (a ``torch.Generator``, or anything ``digest`` accepts);
    ``digest(handle)`` returns the 64-bit digest, or None when the state cannot be read now (for
    example during CUDA graph capture, where reading it is not allowed). ``current(device)``, if
    given, names a device given without an index (``xla`` -> ``xla:0``) for device types without a
    ``torch.<type>.current_device()``.
    """

    default: Callable[[torch.device], Any]
    digest: Callable[[Any], int | None]
    current: Callable[[torch.device], str] | None = None


_ADAPTERS: dict[str, DeviceAdapter] = {}


def register_device_adapter(device_type: str, adapter: DeviceAdapter) -> None:
    """Teach rngcheck a device type's default generator (used by the torch_xla support)."""
    if device_type in _ADAPTERS:
        raise ValueError(
            f"a generator adapter for device type {device_type!r} is already registered; "
            "register each device type once"
        )
    _ADAPTERS[device_type] = adapter


def _generator_digest(gen: torch.Generator) -> int | None:
    if gen.device.type != "cpu" and _capturing(gen.device.type):
        return None
    return state_digest(gen.get_state())


def _capturing(device_type: str) -> bool:
    # Reading a philox state during CUDA graph capture is not allowed (and would be meaningless:
    # the graph replays with offsets decided at replay time).
    if device_type == "cuda":
        return bool(torch.cuda.is_current_stream_capturing())
    return False


def _accelerator_default(device: torch.device) -> torch.Generator | None:
    module = getattr(torch, device.type, None)
    gens = getattr(module, "default_generators", None)
    if not gens:
        return None
    index = device.index if device.index is not None else module.current_device()
    return gens[index]


register_device_adapter("cpu", DeviceAdapter(lambda _d: torch.default_generator, _generator_digest))
for _type in ("cuda", "xpu", "mtia", "hpu", "privateuseone"):
    register_device_adapter(_type, DeviceAdapter(_accelerator_default, _generator_digest))


def default_handle(device: torch.device) -> tuple[Any, DeviceAdapter] | None:
    adapter = _ADAPTERS.get(device.type)
    if adapter is None:
        return None
    handle = adapter.default(device)
    if handle is None:
        return None
    return handle, adapter


_GENERATOR_ADAPTER = DeviceAdapter(lambda _d: None, _generator_digest)


# ---------------------------------------------------------------------------------------------
# Identity


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratorId:
    """A stable name for a generator in reports: "default cpu", "Generator #2 (cpu)"."""

    kind: str  # "default" or "user"
    device: str
    number: int = 0  # user generators are numbered in order of first use, from 1
    origin: str = ""  # "first used at data.py:14"

    @property
    def is_default(self) -> bool:
        return self.kind == "default"

    @property
    def label(self) -> str:
        if self.is_default:
            return f"default {self.device}"
        origin = f", first used at {self.origin}" if self.origin else ""
        return f"Generator #{self.number} ({self.device}{origin})"

    @property
    def short_label(self) -> str:
        """The label without the origin, for tables."""
        return (
            f"default {self.device}"
            if self.is_default
            else f"Generator #{self.number} ({self.device})"
        )

    @property
    def key(self) -> str:
        """The part of the identity that must match across ranks and across checkpoint passes."""
        return f"default:{self.device}" if self.is_default else f"user#{self.number}:{self.device}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "device": self.device,
            "number": self.number,
            "origin": self.origin,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratorId:
        return cls(
            kind=str(data["kind"]),
            device=str(data["device"]),
            number=int(data.get("number", 0)),
            origin=str(data.get("origin", "")),
        )


def _device_str(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.index is None:
        adapter = _ADAPTERS.get(device.type)
        if adapter is not None and adapter.current is not None:
            return adapter.current(device)
        module = getattr(torch, device.type, None)
        current = getattr(module, "current_device", None)
        if current is not None:
            try:
                return f"{device.type}:{current()}"
            except Exception:  # noqa: BLE001 - a device module without a usable current device
                return device.type
    return str(device)


@functools.cache
def _state_bytes_type(size: int) -> Any:
    """The ctypes array type that reads ``size`` bytes of a generator state in place."""
    return ctypes.c_char * size


class _Tracked:
    """What the registry knows about one generator: its name, its last digest, its seed."""

    __slots__ = (
        "ident",
        "handle",
        "adapter",
        "last_after",
        "initial_seed",
        "seed_mark",
        "_bytes",
    )

    def __init__(self, ident: GeneratorId, handle: Any, adapter: DeviceAdapter) -> None:
        self.ident = ident
        self.handle = handle
        self.adapter = adapter
        self.last_after: int | None = None
        self.initial_seed: int | None = None
        self.seed_mark = 0  # the seeding-call counter at this generator's last op
        # A CPU torch.Generator is read as its raw state bytes, through a ctypes array type of
        # the state's size (asking its device on every read cost more than the read, and
        # ``ctypes.string_at`` twice as much as the array's ``raw``).
        self._bytes: Any = None
        if isinstance(handle, torch.Generator) and handle.device.type == "cpu":
            self._bytes = _state_bytes_type(handle.get_state().numel())

    def read(self) -> int | None:
        """The digest of the generator's state now (None: unreadable at the moment). A CPU
        state's 5,056 bytes are hashed where ``get_state()`` wrote them, never copied out."""
        handle = self.handle
        if self._bytes is not None:
            state = handle.get_state()  # kept alive while its bytes are read
            return _bytes_state_digest(self._bytes.from_address(state.data_ptr()))
        return self.adapter.digest(handle)

    def snapshot(self) -> bytes | int | None:
        """The state now, only to compare with another snapshot of this generator: a CPU
        generator's raw bytes (a copy, no hashing: about a microsecond), else its digest."""
        handle = self.handle
        if self._bytes is not None:
            state = handle.get_state()  # kept alive while its bytes are read
            return self._bytes.from_address(state.data_ptr()).raw
        return self.adapter.digest(handle)

    @staticmethod
    def digest_of(snapshot: bytes | int | None) -> int | None:
        """The digest a :meth:`snapshot` stands for (as :meth:`read` gives it)."""
        return _bytes_state_digest(snapshot) if isinstance(snapshot, bytes) else snapshot


def _cdata(gen: Any) -> int | None:
    return getattr(gen, "_cdata", None)


class GeneratorRegistry:
    """Names the generators a mode sees and remembers each one's state after its last op.

    The ``torch.Generator`` an op receives at dispatch is a fresh Python wrapper of the C++
    generator each time, so user generators are keyed by the C++ object (``Generator._cdata``).
    The registry keeps the first wrapper it saw of the ``max_users`` most recently used ones: that
    keeps the address from being reused by a new generator while it is named here, and bounds
    memory for programs that make a generator per batch.
    """

    def __init__(self, max_users: int = 1024) -> None:
        self._defaults: dict[str, _Tracked] = {}
        self._users: OrderedDict[int, _Tracked] = OrderedDict()
        self._user_count = 0
        self._max_users = max_users
        self.version = 0  # changes whenever a generator is added (caches of the list key on it)

    def default(self, device: torch.device) -> _Tracked | None:
        name = _device_str(device)
        tracked = self._defaults.get(name)
        if tracked is None:
            found = default_handle(device)
            if found is None:
                return None
            handle, adapter = found
            tracked = _Tracked(GeneratorId(kind="default", device=name), handle, adapter)
            self._defaults[name] = tracked
            self.version += 1
        return tracked

    def user(self, gen: torch.Generator, origin: Callable[[], str]) -> _Tracked:
        key = _cdata(gen)
        tracked = self._users.get(key) if key is not None else None
        if tracked is not None and key is not None:
            self._users.move_to_end(key)
            return tracked
        default = self._default_for(gen, key)
        if default is not None:  # a device's default generator passed explicitly
            return default
        self._user_count += 1
        ident = GeneratorId(
            kind="user", device=_device_str(gen.device), number=self._user_count, origin=origin()
        )
        tracked = _Tracked(ident, gen, _GENERATOR_ADAPTER)
        self.version += 1
        if key is not None:
            self._users[key] = tracked
            if len(self._users) > self._max_users:
                self._users.popitem(last=False)
        return tracked

    def _default_for(self, gen: torch.Generator, key: int | None) -> _Tracked | None:
        found = default_handle(gen.device)
        if found is not None and key is not None and _cdata(found[0]) == key:
            return self.default(gen.device)
        return None

    @property
    def user_count(self) -> int:
        """User generators named so far (the latest one's number)."""
        return self._user_count

    def forget_after(self, count: int) -> None:
        """Forget the user generators named after the first ``count``."""
        gone = [key for key, t in self._users.items() if t.ident.number > count]
        for key in gone:
            del self._users[key]
        if gone:
            self.version += 1

    def tracked(self) -> list[_Tracked]:
        return [*self._defaults.values(), *self._users.values()]

    def recent_users(self, n: int) -> list[_Tracked]:
        """The ``n`` user generators used most recently."""
        users = self._users
        if len(users) <= n:
            return list(users.values())
        return list(users.values())[-n:]
