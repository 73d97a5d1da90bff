"""The storage model: each tpu ``UntypedStorage`` owns one JAX array.

A tpu tensor is an ordinary ``torch.Tensor`` with a PrivateUse1 TensorImpl. Its storage is a real
torch storage with a unique fake address and the right ``nbytes``, so views, ``_base``, version
counters, ``data_ptr()`` and shared-storage detection behave exactly as on CPU. The storage's Python
object (which torch keeps alive as long as the C++ storage lives) carries a :class:`Buffer` holding the
elements as a JAX array. Views read and write that array through :mod:`strided`.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import torch

from . import allocator, dlpack_alloc, dtypes, runtime, strided, tpu_lowering

_create_empty = torch._C._acc.create_empty_tensor
_storage_at = torch._C._construct_storage_from_data_pointer
_CHIP_0 = torch.device("tpu", 0)
# UntypedStorage._swap_data_ptr_ first appeared in torch 2.12; without it every tensor is built
# through DLPack (dlpack_alloc), which the fast path below only shortcuts.
_CAN_SWAP = hasattr(torch._C.StorageBase, "_swap_data_ptr_")


# A chip runs its programs in the order they were issued, so waiting for the newest computed array waits
# for all queued compute. Host-to-device transfers run beside that queue, so the newest one is kept too.
_latest: dict[int, Any] = {}
_transfers: dict[int, Any] = {}
# Set by streams.py while some thread has a non-default stream current: records each computed array on it.
stream_tracker: Callable[[Any, int], None] | None = None


def is_latest(array: Any) -> int:
    """How many of the newest-array records (which :func:`wait_for_pending` holds) hold ``array``."""
    return sum(newest is array for newest in (*_latest.values(), *_transfers.values()))


def newest(device_index: int) -> tuple:
    """The newest computed array and the newest transferred array of a device, those that exist:
    waiting for both waits for all the work queued on it."""
    return tuple(a for a in (_latest.get(device_index), _transfers.get(device_index)) if a is not None)


def wait_for_pending(device_index: int) -> None:
    for array in newest(device_index):
        array.block_until_ready()


class Buffer:
    """The device memory behind one tpu storage.

    ``array`` holds the storage's elements in the dtype the storage was created with (``dtype``),
    in any shape whose size is ``numel``; it is ``None`` until first written (lazy ``empty``), and
    while an asynchronous copy on a stream writes it: ``pending`` is then that copy's future array.
    ``transfer``: ``array`` was just copied from the host (see ``_transfers``).
    """

    __slots__ = ("array", "pending", "dtype", "numel", "device_index", "nbytes", "address", "__weakref__")

    def __init__(self, array: Any, dtype: torch.dtype, numel: int, device_index: int, transfer: bool = False) -> None:
        self.nbytes = numel * dtype.itemsize
        self.address = allocator.new_address(self.nbytes, device_index, array is not None)  # first: it may refuse
        self.array, self.pending = array, None
        self.dtype = dtype
        self.numel = numel
        self.device_index = device_index
        if array is not None:
            if transfer:
                _transfers[device_index] = array
            else:
                _latest[device_index] = array
                if stream_tracker is not None:
                    stream_tracker(array, device_index)

    def materialize(self) -> Any:
        """The array: waits for a pending copy, allocates zeros for a storage that was never written."""
        if self.array is None:
            if self.pending is not None:
                self.set(self.pending.result(), transfer=True)
            else:
                self.set(_zeros(self.numel, dtypes.to_jax(self.dtype), self.device_index))
        return self.array

    def set(self, array: Any, transfer: bool = False) -> None:
        if self.array is None:
            if self.pending is None:
                allocator.allocated(self.device_index, self.nbytes)
            self.pending = None  # a write replaces what a pending copy would write
        self.array = array
        if transfer:  # as in __init__, inline: this runs for every op's result
            _transfers[self.device_index] = array
        else:
            _latest[self.device_index] = array
            if stream_tracker is not None:
                stream_tracker(array, self.device_index)

    def defer(self, future: Any) -> None:
        """Makes the array that ``future`` (a copy running on a stream) returns the storage's next
        contents: the first read waits for it."""
        if self.array is None and self.pending is None:
            allocator.allocated(self.device_index, self.nbytes)
        self.array, self.pending = None, future

    def __del__(self) -> None:
        if not hasattr(self, "array"):  # refused by the allocator: nothing was counted
            return
        _by_address.pop(self.address, None)
        if self.array is not None or self.pending is not None:
            allocator.freed(self.device_index, self.nbytes)


def _zeros(numel: int, dtype: Any, device_index: int) -> Any:
    return _zeros_program(numel, dtype, device_index)()


# Per-geometry programs are bounded (least recently used evicted): a long run with ever new shapes
# must not grow memory without end.
PROGRAMS_PER_CACHE = 1024


@functools.lru_cache(maxsize=PROGRAMS_PER_CACHE)
def _zeros_program(numel: int, dtype: Any, device_index: int) -> Any:
    """A jitted maker of zeros on the chip: ``jnp.zeros(..., device=)`` costs ~1 ms of Python per call."""
    sharding = jax.sharding.SingleDeviceSharding(runtime.device(device_index))
    return tpu_lowering.checked("zeros", jax.jit(functools.partial(jnp.zeros, (numel,), dtype),
                                                 out_shardings=sharding))


def _new_tensor(buffer: Buffer, shape, stride=None) -> torch.Tensor:
    """A tpu tensor on a new storage at ``buffer``'s address, carrying ``buffer``."""
    if _CAN_SWAP and buffer.device_index == 0 and stride is None:  # the fast path: contiguous on chip 0
        tensor = _create_empty(shape, buffer.dtype)
        untyped = tensor.untyped_storage()
        untyped._swap_data_ptr_(_storage_at(buffer.address, _CHIP_0, buffer.nbytes))
    else:
        if stride is None:
            stride = torch._prims_common.make_contiguous_strides_for(shape)
        tensor = dlpack_alloc.tensor_at(buffer.address, tuple(shape), tuple(stride), buffer.dtype, buffer.device_index)
        untyped = tensor.untyped_storage()
    untyped._hf_buffer = buffer
    _by_address[buffer.address] = weakref.ref(buffer)
    return tensor


def wrap(array: Any, dtype: torch.dtype, device_index: int = 0, transfer: bool = False) -> torch.Tensor:
    """A new tpu tensor that owns ``array`` (whose dtype must be ``dtypes.to_jax(dtype)``); ``transfer``:
    the array was just copied from the host."""
    return _new_tensor(Buffer(array, dtype, array.size, device_index, transfer), array.shape)


def wrap_strided(physical: Any, dtype: torch.dtype, device_index: int, shape: tuple, stride: tuple) -> torch.Tensor:
    """A new tpu tensor of ``shape`` and dense ``stride`` whose memory is ``physical`` (its elements
    in memory order, any shape)."""
    return _new_tensor(Buffer(physical, dtype, physical.size, device_index), shape, stride)


def empty(shape, dtype: torch.dtype, device_index: int = 0, stride=None) -> torch.Tensor:
    """A tpu tensor whose memory is not allocated until it is first written or read."""
    shape = tuple(shape)
    if stride is None or tuple(stride) == torch._prims_common.make_contiguous_strides_for(shape):
        stride, numel = None, math.prod(shape)
    else:
        numel = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    if numel * dtype.itemsize >= 1 << 63:
        raise RuntimeError(f"Storage size calculation overflowed with sizes={list(shape)}")
    return _new_tensor(Buffer(None, dtype, numel, device_index), shape, stride)


# Address -> buffer, for storages torch re-creates around an existing address (e.g. when
# unpickling or through from_blob) whose Python object does not carry the buffer yet.
_by_address: dict[int, weakref.ref] = {}


def buffer_of(tensor: torch.Tensor) -> Buffer:
    """The device buffer behind a tpu tensor's storage (AttributeError if it has none)."""
    untyped = tensor.untyped_storage()
    try:
        return untyped._hf_buffer
    except AttributeError:
        reference = _by_address.get(untyped.data_ptr())
        buffer = reference() if reference is not None else None
        if buffer is None or untyped.device.type != "tpu":
            raise
        untyped._hf_buffer = buffer
        return buffer


def is_whole(tensor: torch.Tensor, buffer: Buffer) -> bool:
    """Whether the tensor is its storage's array as is: same dtype, all of it, in order, no lazy
    conjugation or negation (``Tensor.conj()``/``_neg_view`` set bits instead of computing)."""
    return (
        tensor.dtype == buffer.dtype
        and tensor.storage_offset() == 0
        and tensor.numel() == buffer.numel
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def view_geometry(tensor: torch.Tensor, buffer: Buffer) -> tuple:
    """What :func:`view_of` needs to take ``tensor``'s view of its storage array (hashable)."""
    return (
        buffer.dtype, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
        tensor.is_conj(), tensor.is_neg(),
    )


def view_of(array: Any, geometry: tuple) -> Any:
    """Traceable: the view ``geometry`` of a storage array."""
    _, dtype, size, stride, offset, conjugated, negated = geometry
    values = strided.read(_reinterpret(array.reshape(-1), dtypes.to_jax(dtype)), size, stride, offset)
    return _apply_bits(values, conjugated, negated)


def _apply_bits(values: Any, conjugated: bool, negated: bool) -> Any:
    """Applies a tensor's lazy conjugate and negative bits (each is its own inverse)."""
    if conjugated:
        values = jnp.conj(values)
    return -values if negated else values


def read(tensor: torch.Tensor) -> Any:
    """The tensor's values as a JAX array of its shape and dtype."""
    buffer = buffer_of(tensor)
    array = buffer.array
    if array is None:
        array = buffer.materialize()
    if array.shape == tensor.shape and is_whole(tensor, buffer):
        return array
    return _view_reader(view_geometry(tensor, buffer))(array)


def write(tensor: torch.Tensor, value: Any, transfer: bool = False) -> None:
    """Sets the tensor's elements (through its view onto the storage) to ``value``, cast to its dtype;
    ``transfer``: ``value`` was just copied from the host."""
    buffer = buffer_of(tensor)
    if is_whole(tensor, buffer):
        target = dtypes.to_jax(tensor.dtype)
        if value.dtype != target or value.shape != tensor.shape:
            value, transfer = _cast_to(tuple(tensor.shape), target)(value), False
        buffer.set(value, transfer)
        return
    buffer.set(_view_writer(view_geometry(tensor, buffer))(buffer.materialize(), value))


@functools.lru_cache(maxsize=PROGRAMS_PER_CACHE)
def _cast_to(shape: tuple, dtype: Any):
    return tpu_lowering.checked("cast", jax.jit(lambda value: jnp.broadcast_to(value.astype(dtype), shape)))


def _as_bits(flat: Any) -> Any:
    """Bool and complex arrays as the plain numbers with the same bytes (uint8; float pairs)."""
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint8)
    if jnp.iscomplexobj(flat):
        return jnp.stack([flat.real, flat.imag], axis=-1).reshape(-1)
    return flat


def _bits_dtype(dtype: Any) -> Any:
    if dtype == jnp.bool_:
        return jnp.dtype(jnp.uint8)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.dtype(jnp.float32 if dtype == jnp.complex64 else jnp.float64)
    return dtype


def _reinterpret(flat: Any, dtype: Any) -> Any:
    """The bytes of a 1-D array seen as ``dtype`` (``Tensor.view(dtype)``, ``storage`` byte access)."""
    if flat.dtype == dtype:
        return flat
    bits, target = _as_bits(flat), _bits_dtype(dtype)
    if bits.dtype != target:
        ratio = bits.dtype.itemsize / target.itemsize
        if ratio < 1:  # narrow -> wide: groups of 1/ratio elements become one
            bits = bits.reshape(-1, round(1 / ratio))
        bits = jax.lax.bitcast_convert_type(bits, target).reshape(-1)
    if dtype == jnp.bool_:
        return bits != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        pairs = bits.reshape(-1, 2)
        return jax.lax.complex(pairs[:, 0], pairs[:, 1])
    return bits


@functools.lru_cache(maxsize=PROGRAMS_PER_CACHE)
def _view_reader(geometry: tuple):
    return tpu_lowering.checked("view read", jax.jit(lambda array: view_of(array, geometry)))


@functools.lru_cache(maxsize=PROGRAMS_PER_CACHE)
def _view_writer(geometry: tuple):
    storage_dtype, dtype, size, stride, offset, conjugated, negated = geometry
    target, storage_target = dtypes.to_jax(dtype), dtypes.to_jax(storage_dtype)

    def write_view(array, value):
        flat = _reinterpret(array.reshape(-1), target)
        value = _apply_bits(value.astype(target), conjugated, negated)
        flat = strided.write(flat, value, size, stride, offset)
        return _reinterpret(flat, storage_target).reshape(array.shape)

    return tpu_lowering.checked("view write", jax.jit(write_view))
