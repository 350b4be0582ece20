"""64-bit digests of bytes and of tensors' values, memory-safe for every layout rngcheck can meet.

A tensor digest is a claim about the tensor's *values*: the same values (same shape, dtype and
elements in logical order) give the same digest whatever the memory layout (contiguous, permuted,
expanded, channels_last, at a storage offset), and a different element at a position the digest
reads gives a different one. Tensors of up to :data:`SAMPLE` elements are read whole; larger ones
are read at :data:`SAMPLE` evenly spaced logical positions, because hashing every activation
would cost time that grows with the model (a quarter second for 256 MB here). Two different
dropout masks differ in a fraction of about 2p(1-p) of their elements and an output computed from
a different input differs almost everywhere, so the sample still tells them apart (two p=0.01
masks look alike with probability 0.98**1024, about 1e-9).

What is read, per kind of tensor:

- strided CPU tensors: their bytes, in logical order (a non-contiguous one through a copy of its
  sample that lives until it is hashed);
- tensors on an accelerator: folded to one int64 on the device (:class:`LazyDigest`), fetched to
  the host only when a comparison needs it, so the hot path does not sync;
- sparse (COO after coalescing, CSR/CSC/BSR/BSC), nested (strided: each component; jagged: its
  values and offsets), quantized (the integer representation and the quantization parameters),
  DTensor (this rank's local tensor) and other tensor subclasses that describe their inner
  tensors (``__tensor_flatten__``): their parts;
- FakeTensor, meta and other subclasses whose data cannot be read: no digest (None), and the
  comparison skips the output.

Every read runs below all dispatch modes and with autograd off: the checker's own reads must not
be seen by another mode (a FlopCounterMode would count them) nor recorded in a graph.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from .dispatch import unseen

__all__ = [
    "SAMPLE",
    "LazyDigest",
    "bytes_digest",
    "resolve_all",
    "resolve_digest",
    "tensor_digest",
]

SAMPLE = 1 << 10  # elements read from a tensor; larger tensors are sampled at this many positions

_ITEM_FORMATS = {1: "B", 2: "H", 4: "I", 8: "Q"}
_SPARSE_PARTS = {
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def bytes_digest(buffer: Any) -> int:
    """Signed 64-bit blake2b of a bytes-like object."""
    return int.from_bytes(hashlib.blake2b(buffer, digest_size=8).digest(), "little", signed=True)


class LazyDigest:
    """A digest partly still on an accelerator, fetched to the host only when a comparison needs
    it: one 0-dim device tensor per device plus what was already hashed on the host."""

    __slots__ = ("_host", "_pending", "_value")

    def __init__(self, pending: list[torch.Tensor], host: bytes) -> None:
        self._pending: list[torch.Tensor] | None = pending
        self._host = host
        self._value: int | None = None

    @property
    def pending(self) -> bool:
        """Whether the value still waits on the device."""
        return self._pending is not None

    def resolve(self) -> int:
        if self._pending is not None:
            with unseen():
                self._finish([int(t.item()) for t in self._pending])
        assert self._value is not None
        return self._value

    def _finish(self, folded: list[int]) -> None:
        h = hashlib.blake2b(self._host, digest_size=8)
        for value in folded:
            h.update(value.to_bytes(8, "little", signed=True))
        self._value = int.from_bytes(h.digest(), "little", signed=True)
        self._pending = None

    def __repr__(self) -> str:
        return f"LazyDigest({'pending' if self._pending is not None else self._value})"


def resolve_digest(d: int | LazyDigest | None) -> int | None:
    return d.resolve() if isinstance(d, LazyDigest) else d


def resolve_all(digests: Iterable[Any]) -> None:
    """Fetch every pending digest among ``digests`` with one transfer per device (one sync for a
    whole recompute's outputs, where resolving them one by one syncs at each)."""
    waiting = [d for d in digests if isinstance(d, LazyDigest) and d.pending]
    if not waiting:
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for d in waiting:
        for t in d._pending or ():
            by_device.setdefault(t.device, []).append(t)
    fetched: dict[int, int] = {}
    with unseen():
        for tensors in by_device.values():
            for t, value in zip(tensors, torch.stack(tensors).cpu().tolist(), strict=True):
                fetched[id(t)] = int(value)
        for d in waiting:
            d._finish([fetched[id(t)] for t in d._pending or ()])


_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


def tensor_digest(value: Any) -> int | LazyDigest | None:
    """Digest of an op's output: a tensor, or a tuple/list of tensors and plain values.

    None when some tensor's values cannot be read (fake, meta, an opaque subclass)."""
    try:
        if type(value) is torch.Tensor:
            plain = _plain_cpu_digest(value)
            if plain is not None:
                return plain
        return _digest(value)
    except RuntimeError:  # a tensor without readable storage (an opaque wrapper): no digest
        return None


_LABELS: dict[tuple[Any, ...], bytes] = {}


def _plain_cpu_digest(t: torch.Tensor) -> int | None:
    """The digest of the common output, a plain contiguous CPU tensor: what :func:`_digest`
    hashes (its label, then its values read in place), without its dispatch guards (no tensor
    op runs) and with the label made once per shape and dtype. None: not such a tensor."""
    if (
        t.layout is not torch.strided
        or t.is_quantized
        or t.is_nested
        or torch._is_functional_tensor(t)
        or not t.is_contiguous()
        or t.device.type != "cpu"
        or t.element_size() not in _ITEM_FORMATS
    ):
        return None
    key = (t.shape, t.dtype)
    label = _LABELS.get(key)
    if label is None:
        if len(_LABELS) >= 256:  # shapes change (variable sequence lengths): stay bounded
            _LABELS.clear()
        label = _LABELS[key] = f"{tuple(t.shape)}{t.dtype}{torch.strided}".encode()
    host = hashlib.blake2b(label, digest_size=8)
    _hash_cpu(host, t)
    return int.from_bytes(host.digest(), "little", signed=True)


def _digest(value: Any) -> int | LazyDigest | None:
    items = value if isinstance(value, (tuple, list)) else (value,)
    host = hashlib.blake2b(digest_size=8)
    pending: list[torch.Tensor] = []
    # Below every dispatch mode and torch-function subclass, with autograd off, entered with C
    # calls only (this runs once per random op: a generator-based context and torch.no_grad()'s
    # Python objects were a tenth of the op level's own time on the benchmark's step).
    grad = _grad_enabled()
    with unseen(), torch._C.DisableTorchFunctionSubclass():
        _set_grad_enabled(False)
        try:
            for item in items:
                if item is None or isinstance(item, (bool, int, float, torch.SymInt)):
                    host.update(repr(item).encode())
                    continue
                parts = _parts(item, "")
                if parts is None:
                    return None
                for label, t in parts:
                    host.update(label.encode())
                    if t.device.type == "cpu":
                        _hash_cpu(host, t)
                    else:
                        pending.append(_fold_on_device(t))
        finally:
            _set_grad_enabled(grad)
    if pending:
        return LazyDigest(pending, host.digest())
    return int.from_bytes(host.digest(), "little", signed=True)


def _parts(t: Any, label: str) -> list[tuple[str, torch.Tensor]] | None:
    """The plain strided tensors whose values make up ``t``, each with a label of its metadata;
    None when ``t``'s values cannot be read."""
    if not isinstance(t, torch.Tensor):
        return None
    kind = type(t)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        return _subclass_parts(t, label)
    if t.device.type == "meta":
        return None  # no data
    if torch._is_functional_tensor(t):
        # A functionalization wrapper (torch_xla's tensors above functionalization, where the
        # selective route sees ops): its current value's parts, if they can be read (under
        # torch.compile the value is a FakeTensor: none).
        torch._sync(t)
        return _parts(torch._from_functional_tensor(t), label)
    if t.is_nested:  # a strided nested tensor: its components (it has no sizes of its own)
        label = f"{label}nested{t.dtype}"
        return _join(_parts(c, f"{label}/{i}") for i, c in enumerate(t.unbind()))
    label = f"{label}{tuple(t.shape)}{t.dtype}{t.layout}"
    if t.is_quantized:
        return _quantized_parts(t, label)
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        return _join([_parts(t._indices(), label + "/i"), _parts(t._values(), label + "/v")])
    if t.layout in _SPARSE_PARTS:
        return _join(
            _parts(getattr(t, name)(), f"{label}/{name}") for name in _SPARSE_PARTS[t.layout]
        )
    if t.layout != torch.strided:  # mkldnn and whatever comes next: read its dense values
        return _parts(t.to_dense(), label)
    return [(label, t)]


def _subclass_parts(t: torch.Tensor, label: str) -> list[tuple[str, torch.Tensor]] | None:
    kind = type(t)
    if kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        # A subclass that only overrides Python methods (__torch_function__): its data is a
        # plain tensor's. as_subclass gives that tensor without copying.
        return _parts(t.as_subclass(torch.Tensor), label)
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or _is_fake(t):
        return None  # FakeTensor, FunctionalTensor, an opaque subclass: no values to read
    names, _ctx = flatten()
    label = f"{label}{kind.__name__}{_shape(t)}{t.dtype}"
    inner = [(name, getattr(t, name)) for name in names]
    # Inner tensors carry the values; other attributes (DTensor's mesh) are metadata.
    return _join(_parts(v, f"{label}/{name}") for name, v in inner if isinstance(v, torch.Tensor))


def _shape(t: torch.Tensor) -> tuple[int | str, ...]:
    """The shape with a symbolic size (a jagged tensor's ragged dimension) as "?": its name
    differs between two tensors of the same values; the offsets carry the sizes."""
    return tuple(s if isinstance(s, int) else "?" for s in t.shape)


def _is_fake(t: torch.Tensor) -> bool:
    fake = getattr(torch._subclasses, "FakeTensor", None)
    return fake is not None and isinstance(t, fake)


def _quantized_parts(t: torch.Tensor, label: str) -> list[tuple[str, torch.Tensor]] | None:
    scheme = t.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        label += f"/{scheme}/{t.q_scale()!r}/{t.q_zero_point()}"
        return _parts(t.int_repr(), label)
    return _join(
        [
            _parts(t.int_repr(), f"{label}/{scheme}/{t.q_per_channel_axis()}"),
            _parts(t.q_per_channel_scales(), label + "/scales"),
            _parts(t.q_per_channel_zero_points(), label + "/zero_points"),
        ]
    )


def _join(
    groups: Iterable[list[tuple[str, torch.Tensor]] | None],
) -> list[tuple[str, torch.Tensor]] | None:
    out: list[tuple[str, torch.Tensor]] = []
    for group in groups:
        if group is None:
            return None
        out.extend(group)
    return out


# -- reading values ----------------------------------------------------------------------------


def _step(numel: int) -> int:
    return numel // SAMPLE + 1


_POSITIONS: dict[tuple[tuple[int, ...], str], tuple[torch.Tensor, ...]] = {}


def _sample(t: torch.Tensor) -> torch.Tensor:
    """At most SAMPLE elements of ``t`` at evenly spaced logical positions, as a new contiguous
    tensor (the caller keeps it alive while reading it). Reads through the strides: a permuted or
    expanded tensor is never copied whole."""
    numel = t.numel()
    if numel <= SAMPLE:
        return t.contiguous()
    if t.is_contiguous():
        return t.reshape(-1)[:: _step(numel)].contiguous()
    key = (tuple(t.shape), str(t.device))
    index = _POSITIONS.get(key)
    if index is None:
        if len(_POSITIONS) >= 256:  # shapes change (variable sequence lengths): stay bounded
            _POSITIONS.clear()
        flat = torch.arange(0, numel, _step(numel), device=t.device)
        index = _POSITIONS[key] = tuple(torch.unravel_index(flat, t.shape))
    return t[index]


def _hash_cpu(h: Any, t: torch.Tensor) -> None:
    numel = t.numel()
    if numel == 0:
        return
    size = t.element_size()
    if t.is_contiguous() and size in _ITEM_FORMATS:
        # The common case: read in place (a large activation's sample), no tensor op at all.
        view = memoryview((ctypes.c_char * (numel * size)).from_address(t.data_ptr()))
        if numel > SAMPLE:
            view = view.cast("B").cast(_ITEM_FORMATS[size])[:: _step(numel)].tobytes()  # type: ignore[call-overload]
        h.update(view)
        return
    sample = _sample(t)  # alive until the end of this function, while its bytes are read
    nbytes = sample.numel() * size
    h.update(bytes((ctypes.c_char * nbytes).from_address(sample.data_ptr())))


def _fold_on_device(t: torch.Tensor) -> torch.Tensor:
    """An int64 0-dim tensor on ``t``'s device that depends on every sampled element and its
    position (no host sync)."""
    flat = _sample(t).reshape(-1)
    bits = _as_int(flat)
    weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
    return (bits * (weights * 0x9E3779B1 + 0x7F4A7C15)).sum()


def _as_int(flat: torch.Tensor) -> torch.Tensor:
    """Reinterpret a tensor's bits as int64 values, on its own device."""
    if flat.device.type == "xla":
        # Inside a dispatch mode torch_xla hands over tensors below functionalization, where a
        # dtype view (a bit cast) raises or segfaults: fold the values instead of the bits. A
        # different dropout mask still changes the weighted sum by far more than 1.
        return torch.nan_to_num(flat.to(torch.float64), nan=0.5, posinf=1e30, neginf=-1e30)
    if flat.dtype == torch.bool:
        return flat.to(torch.int64)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        flat.element_size()
    ]
    return flat.view(int_dtype).to(torch.int64)
