"""Generator identity and state digests: CPU (mt19937), philox devices, XLA, user Generators.

A digest is a signed 64-bit blake2b of the generator's whole state, so it packs into an int64
tensor for the cross-rank exchange and two different states collide only by chance (2**-64), never
by construction the way an XOR or 8-bit hash does. Reading a state never changes it.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DeviceAdapter",
    "GeneratorId",
    "GeneratorRegistry",
    "bytes_digest",
    "register_device_adapter",
    "state_digest",
    "tensor_digest",
]

# Outputs larger than this are fingerprinted from an evenly strided sample: two different dropout
# masks differ in a fraction of about 2p(1-p) of their elements, and an output computed from a
# different input differs almost everywhere, so 1024 samples still tell them apart (two p=0.01
# masks look alike with probability 0.98**1024, about 1e-9), while hashing a whole activation
# costs time that grows with the model (~25 us for 32 KB here, a quarter second for 256 MB).
_FULL_DIGEST_MAX_ELEMENTS = 1 << 10


def bytes_digest(buffer: Any) -> int:
    """Signed 64-bit blake2b of a bytes-like object."""
    return int.from_bytes(hashlib.blake2b(buffer, digest_size=8).digest(), "little", signed=True)


def _cpu_tensor_digest(t: torch.Tensor) -> int:
    """Digest of a contiguous CPU tensor's bytes, read in place (no numpy, no copy)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return bytes_digest(b"")
    buf = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    return bytes_digest(buf)


def state_digest(state: torch.Tensor) -> int:
    """Digest of a generator state as returned by ``Generator.get_state()`` (a CPU byte tensor)."""
    return _cpu_tensor_digest(state.contiguous())


class LazyDigest:
    """A digest still on the accelerator, fetched to the host only when a comparison needs it.

    Holds one 0-dim device tensor, so forward ops inside a checkpoint region cost no host sync.
    """

    __slots__ = ("_value", "_pending")

    def __init__(self, pending: torch.Tensor) -> None:
        self._pending: torch.Tensor | None = pending
        self._value: int | None = None

    def resolve(self) -> int:
        if self._pending is not None:
            self._value = int(self._pending.item())
            self._pending = None
        assert self._value is not None
        return self._value

    def __repr__(self) -> str:
        return f"LazyDigest({'pending' if self._pending is not None else self._value})"


def resolve_digest(d: int | LazyDigest | None) -> int | None:
    return d.resolve() if isinstance(d, LazyDigest) else d


def _plain_data(t: Any) -> torch.Tensor | None:
    """The tensor whose bytes we may read, or None (fake, meta, functional or unknown subclass)."""
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "_local_tensor", None)  # DTensor: this rank's shard
    if local is not None:
        t = local
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return None
    if t.layout != torch.strided:
        return None
    return t


def tensor_digest(value: Any) -> int | LazyDigest | None:
    """Fingerprint of an op's output (a tensor or a tuple of them). Runs no dispatch modes."""
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    parts: list[torch.Tensor] = []
    for v in tensors:
        t = _plain_data(v)
        if t is None:
            return None
        parts.append(t)
    if not parts:
        return None
    if all(t.device.type == "cpu" for t in parts):
        h = hashlib.blake2b(digest_size=8)
        for t in parts:
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            h.update(_cpu_sample(t))
        return int.from_bytes(h.digest(), "little", signed=True)
    # The checker's own reads must not be seen by other dispatch modes (a FlopCounterMode below
    # ours would count them) nor by autograd.
    with torch._C._DisableTorchDispatch(), torch.no_grad():
        total = None
        for t in parts:
            flat = t.detach().reshape(-1)
            if flat.numel() > _FULL_DIGEST_MAX_ELEMENTS:
                step = flat.numel() // _FULL_DIGEST_MAX_ELEMENTS + 1
                flat = flat[::step]
            bits = _as_int(flat.contiguous())
            weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
            folded = (bits * (weights * 0x9E3779B1 + 0x7F4A7C15)).sum()
            total = folded if total is None else total * 1000003 + folded
        assert total is not None
        return LazyDigest(total)


_ITEM_FORMATS = {1: "B", 2: "H", 4: "I", 8: "Q"}


def _cpu_sample(t: torch.Tensor) -> bytes | memoryview:
    """A CPU tensor's bytes, or an evenly strided sample of its elements, read in place.

    A contiguous tensor is read through a memoryview (no tensor op, no dispatch); others are
    made contiguous first, with our own ops hidden from every dispatch mode and from autograd.
    """
    numel = t.numel()
    if numel == 0:
        return b""
    if not t.is_contiguous() or t.element_size() not in _ITEM_FORMATS:
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            flat = t.detach().reshape(-1)
            if numel > _FULL_DIGEST_MAX_ELEMENTS:
                flat = flat[:: numel // _FULL_DIGEST_MAX_ELEMENTS + 1]
            t = flat.contiguous()
        numel = t.numel()
    size = t.element_size()
    view = memoryview((ctypes.c_char * (numel * size)).from_address(t.data_ptr())).cast("B")
    if numel <= _FULL_DIGEST_MAX_ELEMENTS:
        return view
    return view.cast(_ITEM_FORMATS[size])[:: numel // _FULL_DIGEST_MAX_ELEMENTS + 1].tobytes()


def _as_int(flat: torch.Tensor) -> torch.Tensor:
    """Reinterpret a tensor's bits as int64 values, on its own device."""
    if flat.device.type == "xla":
        # Inside a dispatch mode torch_xla hands over tensors below functionalization, where a
        # dtype view (a bit cast) raises or segfaults: fold the values instead of the bits. A
        # different dropout mask still changes the weighted sum by far more than 1.
        return torch.nan_to_num(flat.to(torch.float64), nan=0.5, posinf=1e30, neginf=-1e30)
    size = flat.element_size()
    if flat.dtype == torch.bool:
        return flat.to(torch.int64)
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
        int_dtype = {4: torch.int16, 8: torch.int32, 16: torch.int64}[size]
    return flat.view(int_dtype).to(torch.int64)


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


class _Tracked:
    """What the registry knows about one generator: its name, its last digest, its seed."""

    __slots__ = (
        "ident",
        "handle",
        "adapter",
        "last_after",
        "initial_seed",
        "seed_mark",
        "_raw",
        "_raw_digest",
    )

    def __init__(self, ident: GeneratorId, handle: Any, adapter: DeviceAdapter) -> None:
        self.ident = ident
        self.handle = handle
        self.adapter = adapter
        self.last_after: int | None = None
        self.initial_seed: int | None = None
        self.seed_mark = 0  # the seeding-call counter at this generator's last op
        self._raw = b""  # the CPU state bytes last read, and their digest
        self._raw_digest: int | None = None

    def read(self) -> int | None:
        """The digest of the generator's state now (None: unreadable at the moment).

        A CPU state is 5,056 bytes; the state before an op is nearly always the bytes read after
        the previous one, so comparing the bytes (well under a microsecond) spares hashing them
        a second time.
        """
        handle = self.handle
        if isinstance(handle, torch.Generator) and handle.device.type == "cpu":
            state = handle.get_state()
            raw = bytes((ctypes.c_char * state.numel()).from_address(state.data_ptr()))
            if raw != self._raw:
                self._raw, self._raw_digest = raw, bytes_digest(raw)
            return self._raw_digest
        return self.adapter.digest(handle)


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
        return tracked

    def user(self, gen: torch.Generator, origin: Callable[[], str]) -> _Tracked:
        key = _cdata(gen)
        tracked = self._users.get(key) if key is not None else None
        if tracked is not None:
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

    def tracked(self) -> list[_Tracked]:
        return [*self._defaults.values(), *self._users.values()]
