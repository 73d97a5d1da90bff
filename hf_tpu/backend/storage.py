"""The storage model: each tpu ``UntypedStorage`` owns one JAX array.

A tpu tensor is an ordinary ``torch.Tensor`` with a PrivateUse1 TensorImpl. Its storage is a real
torch storage with a unique fake address and the right ``nbytes``, so views, ``_base``, version
counters, ``data_ptr()`` and shared-storage detection behave exactly as on CPU. The storage's Python
object (which torch keeps alive as long as the C++ storage lives) carries a :class:`Buffer` holding the
elements as a JAX array. Views read and write that array through :mod:`strided`. The array may be spread
over several chips (a sharded tensor, see :mod:`hf_tpu.sharding`): a storage keeps the placement of its first
contents for its life (:func:`placed`).
"""

from __future__ import annotations

import collections
import functools
import math
import sys
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import allocator, completion, devices, dlpack_alloc, dtypes, fused, runtime, strided, tpu_lowering
from .completion import _latest, _transfers

_create_empty = torch._C._acc.create_empty_tensor
_storage_at = torch._C._construct_storage_from_data_pointer
_CHIP_0 = torch.device("tpu", 0)
# UntypedStorage._swap_data_ptr_ first appeared in torch 2.12; without it every tensor is built
# through DLPack (dlpack_alloc), which the fast path below only shortcuts.
_CAN_SWAP = hasattr(torch._C.StorageBase, "_swap_data_ptr_")


class Buffer:
    """The device memory behind one tpu storage.

    ``array`` holds the storage's elements in the dtype the storage was created with (``dtype``),
    in any shape whose size is ``numel``; it is ``None`` until first written (lazy ``empty``), and
    while an asynchronous copy on a stream writes it: ``pending`` is then that copy's future array; or while a
    recorded op computes it in fused eager mode: ``pending`` is then its :class:`fused.Lazy` value.
    ``transfer``: ``array`` was just copied from the host (see ``_transfers``).
    """

    __slots__ = ("array", "pending", "dtype", "numel", "device_index", "nbytes", "address", "sharding", "shards",
                 "__weakref__")

    def __init__(self, array: Any, dtype: torch.dtype, numel: int, device_index: int, transfer: bool = False) -> None:
        self.nbytes = numel * dtype.itemsize
        self.sharding = self.shards = None
        if array.__class__ is fused.Lazy:  # a recorded op's result (on one chip): the common case, kept short
            self.address = allocator.new_address(self.nbytes, device_index, True)
            self.array, self.pending = None, array
            self.dtype, self.numel, self.device_index = dtype, numel, device_index
            return
        # first, before anything is counted: both may refuse (devices that are no chips; a size no chip holds)
        shards = _shard_bytes(array, dtype) if array is not None and is_spread(array) else None
        self.address = allocator.new_address(self.nbytes, device_index, array is not None and shards is None)
        self.array, self.pending = array, None
        self.dtype = dtype
        self.numel = numel
        self.device_index = device_index
        if shards is not None:
            device_index = self._spread_over(array, shards)
        if array is not None:
            if transfer:
                _transfers[device_index] = array
            else:
                _latest[device_index] = array
                if completion.stream_tracker is not None:
                    completion.stream_tracker(array, device_index)
            if self.shards is not None:
                _record_on_chips(array, self.shards, transfer)

    def materialize(self) -> Any:
        """The array: waits for a pending copy, runs a pending fused eager chain, allocates zeros for a storage
        that was never written."""
        if self.array is None:
            if self.pending.__class__ is fused.Lazy:
                self.set(self.pending.value())
            elif self.pending is not None:
                self.set(placed(self, self.pending.result()), transfer=True)
            else:
                self.set(_zeros(self.numel, dtypes.to_jax(self.dtype), self.device_index))
        return self.array

    def current(self) -> Any:
        """What an op reads: the array, or in fused eager mode the pending value not computed yet (for a storage
        never written, its zeros are recorded: a ``fill_`` or a write through a view of a new ``empty`` tensor
        then costs no program run of its own, and XLA drops zeros that nothing reads)."""
        array = self.array
        if array is None:
            pending = self.pending
            if fused.ON:
                if pending.__class__ is fused.Lazy and pending.array is None:
                    return pending
                if pending is None and self.numel and self.sharding is None:
                    zeros = _zeros_program(self.numel, dtypes.to_jax(self.dtype), self.device_index)
                    self.set(fused.apply(zeros, "zeros", self.device_index))
                    return self.pending
            array = self.materialize()
        return array

    def set(self, array: Any, transfer: bool = False) -> None:
        if self.array is None:
            if self.pending is None:  # the first contents: a new storage takes their placement (see placed)
                array = placed(self, array)
                if is_spread(array):
                    self._spread_over(array)
                else:
                    allocator.allocated(self.device_index, self.nbytes)
            self.pending = None  # a write replaces what a pending copy would write
        if array.__class__ is fused.Lazy:
            self.array, self.pending = None, array
            return
        self.array = array
        if transfer:  # as in __init__, inline: this runs for every op's result
            _transfers[self.device_index] = array
        else:
            _latest[self.device_index] = array
            if completion.stream_tracker is not None:
                completion.stream_tracker(array, self.device_index)
        if self.shards is not None:
            _record_on_chips(array, self.shards, transfer)

    def _spread_over(self, array: Any, shards: tuple | None = None) -> int:
        """Makes the storage one spread over the chips of ``array`` (its first contents), counting each chip's
        shard (``shards``, if computed already); returns its first chip."""
        self.sharding, self.shards = array.sharding, shards or _shard_bytes(array, self.dtype)
        self.device_index = self.shards[0][0]
        allocator.allocated_shards(self.shards)
        return self.device_index

    def defer(self, future: Any) -> None:
        """Makes the array that ``future`` (a copy running on a stream) returns the storage's next
        contents: the first read waits for it."""
        if self.array is None and self.pending is None:
            allocator.allocated(self.device_index, self.nbytes)
        self.array, self.pending = None, future

    def release(self) -> None:
        """Frees the elements but keeps the storage (FSDP's ``storage.resize_(0)`` between uses of a gathered
        parameter): it is a lazy ``empty`` again, on the same placement, until its next write."""
        if self.shards is not None:
            allocator.freed_shards(self.shards)
            self.shards = None
        elif self.array is not None or self.pending is not None:
            allocator.freed(self.device_index, self.nbytes)
        self.array = self.pending = None

    def __del__(self) -> None:
        if not hasattr(self, "array"):  # refused by the allocator: nothing was counted
            return
        _by_address.pop(self.address, None)
        if self.shards is not None:
            allocator.freed_shards(self.shards)
        elif self.array is not None or self.pending is not None:
            allocator.freed(self.device_index, self.nbytes)


# --- sharded storages: one array spread over several chips (a jax.sharding.NamedSharding over a mesh) ---------
ONE_CHIP = jax.sharding.SingleDeviceSharding


def is_spread(array: Any) -> bool:
    """Whether a device array lives on more than one chip (sharded or replicated over a mesh)."""
    sharding = array.sharding
    return type(sharding) is not ONE_CHIP and len(sharding.device_set) > 1


@functools.cache
def _chip_numbers() -> dict[Any, int]:
    return {device: index for index, device in enumerate(runtime.devices())}


def chip_index(jax_device: Any) -> int:
    """The ``k`` of ``tpu:k`` that a JAX device backs."""
    index = _chip_numbers().get(jax_device)
    if index is None:
        raise ValueError(f"{jax_device} is not one of the tpu chips (tpu:0 .. tpu:{len(_chip_numbers()) - 1}): "
                         "build meshes from hf_tpu's chips (hf_tpu.mesh)")
    return index


def chips(sharding: Any) -> tuple[int, ...]:
    """The chips of a multi-chip sharding, in its device order (the first one is the tensor's ``device``)."""
    return tuple(chip_index(device) for device in sharding._device_assignment)


def placement(buffer: Buffer) -> tuple[int, ...]:
    """The chips a storage's elements live on."""
    return (buffer.device_index,) if buffer.shards is None else tuple(chip for chip, _ in buffer.shards)


def _shard_bytes(array: Any, dtype: torch.dtype) -> tuple[tuple[int, int], ...]:
    """(chip, bytes) for each chip of a spread array: each holds one shard (a replica counts in full)."""
    sharding = array.sharding
    nbytes = math.prod(sharding.shard_shape(array.shape)) * dtype.itemsize
    return tuple((chip, nbytes) for chip in chips(sharding))


def _record_on_chips(array: Any, shards: tuple, transfer: bool) -> None:
    """A spread array is the newest work of each of its chips (``synchronize(k)`` waits for it)."""
    record = _transfers if transfer else _latest
    for chip, _ in shards:
        record[chip] = array


@functools.lru_cache(maxsize=256)
def replicated(sharding: Any) -> Any:
    """A sharding with ``sharding``'s devices, in the same order, holding a whole copy on each."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    mesh = jax.sharding.Mesh(np.array(sharding._device_assignment), ("chips",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def placed(buffer: Buffer, value: Any) -> Any:
    """``value`` (of the storage array's shape) on the storage's placement. A storage takes the placement of its
    first contents (a new tensor written whole with a sharded value, as ``clone`` does, is sharded alike, if its
    ``device`` is the mesh's first chip) and keeps it for its life: its one chip (a spread value is gathered
    there), or the sharding its first array had (a value spread otherwise is resharded to it)."""
    if buffer.sharding is None:
        sharding = getattr(value, "sharding", None)
        if type(sharding) is ONE_CHIP or sharding is None or not is_spread(value):
            return value
        if buffer.array is None and buffer.pending is None and chips(sharding)[0] == buffer.device_index:
            return value
        return jax.device_put(value, runtime.device(buffer.device_index))
    if value.sharding == buffer.sharding:
        return value
    return jax.device_put(value, buffer.sharding)


def beside(buffer: Buffer, value: Any) -> Any:
    """``value`` (of any shape) on devices a program may combine with the storage's array."""
    if buffer.sharding is None:
        return placed(buffer, value)
    if value.sharding._device_assignment == buffer.sharding._device_assignment:
        return value
    return jax.device_put(value, replicated(buffer.sharding))


def _zeros(numel: int, dtype: Any, device_index: int) -> Any:
    if numel == 0:  # no elements to compute nor to write: one empty array serves every empty storage of a chip
        return _empty_array(dtype, device_index)
    return _zeros_program(numel, dtype, device_index)()


@functools.cache
def _empty_array(dtype: Any, device_index: int) -> Any:
    """The empty array of ``dtype`` on a chip (``torch.tensor([])`` as DynamicCache starts each layer with)."""
    return _zeros_program(0, dtype, device_index)()


PROGRAMS_PER_CACHE = runtime.PROGRAMS_PER_CACHE


@functools.lru_cache(maxsize=PROGRAMS_PER_CACHE)
def _zeros_program(numel: int, dtype: Any, device_index: int) -> Any:
    """A jitted maker of zeros on the chip: ``jnp.zeros(..., device=)`` costs ~1 ms of Python per call."""
    sharding = runtime.one_chip(device_index)
    return tpu_lowering.checked("zeros", jax.jit(functools.partial(jnp.zeros, (numel,), dtype),
                                                 out_shardings=sharding))


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (torch's ``make_contiguous_strides_for``, cached: it is
    microseconds a call, and ops ask it for a few shapes again and again)."""
    return tuple(torch._prims_common.make_contiguous_strides_for(shape))


def _new_tensor(buffer: Buffer, shape, stride=None) -> torch.Tensor:
    """A tpu tensor on a new storage at ``buffer``'s address, carrying ``buffer``."""
    if _CAN_SWAP and buffer.device_index == 0:  # the fast path, on chip 0
        tensor = _create_empty(shape, buffer.dtype)
        untyped = tensor.untyped_storage()
        untyped._swap_data_ptr_(_storage_at(buffer.address, _CHIP_0, buffer.nbytes))
        if stride is not None:
            tensor.as_strided_(shape, stride)
    else:
        if stride is None:
            stride = contiguous_strides(tuple(shape))
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
    if stride is None or tuple(stride) == contiguous_strides(shape):
        stride, numel = None, math.prod(shape)
    else:
        numel = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    _check_bytes(numel * dtype.itemsize, shape)
    return _new_tensor(Buffer(None, dtype, numel, device_index), shape, stride)


def _check_bytes(nbytes: int, shape: tuple) -> None:
    if nbytes >= 1 << 63:
        raise RuntimeError(f"Storage size calculation overflowed with sizes={list(shape)}")


def check_result_sizes(result: Any) -> None:
    """Refuses, while an op is traced, results no chip could hold, before XLA compiles the op (it aborts the
    process on a size whose bytes overflow int64): the CPU's error for those, and for more than any chip holds, or
    on JAX's CPU platform more than the host has available, :class:`~.allocator.TooLarge`, which the kernel raises
    as ``torch.OutOfMemoryError``."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(result):
        if hasattr(leaf, "shape"):
            nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
            _check_bytes(nbytes, leaf.shape)
            if nbytes > allocator.LARGEST_ALLOCATION:
                raise allocator.TooLarge(nbytes)
            total += nbytes
    if total >= _HOST_CHECKED_BYTES and runtime.backing_platform() == "cpu" and total > devices.host_memory()[0]:
        raise allocator.TooLarge(total)  # the host would grant it, then the OS would kill the process


# Results from this size on are checked against the host's available memory on JAX's CPU platform, when their
# program is traced (per shape: a new batch size is traced, and checked, again).
_HOST_CHECKED_BYTES = 16 << 20


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
    return tensor.numel() == buffer.numel and _in_order(tensor, buffer)


def holds_whole(tensor: torch.Tensor, buffer: Buffer, array: Any) -> bool:
    """Whether ``array`` (the storage's, or its pending value) is the tensor's values as they are: of its shape,
    and the tensor all of its storage (:func:`is_whole`; an array's size is its storage's)."""
    return array.shape == tensor.shape and _in_order(tensor, buffer)


def _in_order(tensor: torch.Tensor, buffer: Buffer) -> bool:
    return (tensor.dtype is buffer.dtype and tensor.storage_offset() == 0 and tensor.is_contiguous()
            and not tensor.is_neg() and not tensor.is_conj())


MOVING = None
"""The offset of a view geometry whose storage offset is an argument of the program, not part of it."""


def occurrences(arrays: Iterable[Any]) -> collections.Counter:
    """How many times each array (by identity) is among a program's inputs: what :func:`donatable` is given."""
    return collections.Counter(map(id, arrays))


def donatable(tensor: torch.Tensor, inputs: Sequence[Any], position: int, passed: Mapping[int, int],
              records: int = 0) -> bool:
    """Whether ``inputs[position]``, read from ``tensor`` into a program's inputs, can be donated to it (XLA then
    writes the result into its memory): the storage's whole array, held by nothing but its storage, ``inputs``,
    the newest-array records and ``records`` records of the caller's (of what it read), passed once (``passed``:
    :func:`occurrences` of the inputs).

    The array is looked up here, not passed: after a failed ``torch.compile``, torch 2.13's frame evaluation holds
    one more reference to each argument of every Python call for the rest of the process."""
    if tensor.device.type != "tpu" or buffer_of(tensor).array is not inputs[position]:
        return False
    references = sys.getrefcount(inputs[position]) - completion.is_latest(inputs[position])
    return references <= _OWNED_REFERENCES + records and passed[id(inputs[position])] == 1


# References to a storage's array while donatable counts them: the storage, the inputs and getrefcount's argument.
# More means someone else holds it.
_OWNED_REFERENCES = 3


def view_geometry(tensor: torch.Tensor, buffer: Buffer) -> tuple:
    """What :func:`view_of` needs to take ``tensor``'s view of its storage array (hashable), but its storage
    offset: a view at a nonzero offset of a storage of its own dtype has the offset :data:`MOVING` (if
    :func:`strided.takes_moving_offset`), and the program taking the view is given ``tensor.storage_offset()`` as
    an argument, so that one program serves the view at every offset (a slice at a moving position compiles
    nothing new)."""
    offset, size, stride = tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())
    moving = offset and tensor.dtype is buffer.dtype and strided.takes_moving_offset(size, stride, offset, buffer.numel)
    return buffer.dtype, tensor.dtype, size, stride, MOVING if moving else offset, tensor.is_conj(), tensor.is_neg()


def view_of(array: Any, geometry: tuple, offset: Any = None) -> Any:
    """Traceable: the view ``geometry`` of a storage array (at ``offset`` if the geometry's is :data:`MOVING`)."""
    _, dtype, size, stride, fixed_offset, conjugated, negated = geometry
    offset = offset if fixed_offset is MOVING else fixed_offset
    values = strided.read(reinterpret(array.reshape(-1), dtypes.to_jax(dtype)), size, stride, offset)
    return _apply_bits(values, conjugated, negated)


def _apply_bits(values: Any, conjugated: bool, negated: bool) -> Any:
    """Applies a tensor's lazy conjugate and negative bits (each is its own inverse)."""
    if conjugated:
        values = jnp.conj(values)
    return -values if negated else values


def read(tensor: torch.Tensor, pending: bool = False) -> Any:
    """The tensor's values as a JAX array of its shape and dtype; with ``pending``, in fused eager mode, a value
    not computed yet stays a :class:`fused.Lazy` one (and a view of it is recorded), for a kernel that only hands
    it on to recorded programs and writes."""
    buffer = buffer_of(tensor)
    array = buffer.array
    if array is None:
        array = buffer.current() if pending else buffer.materialize()
    if holds_whole(tensor, buffer, array):
        return array
    geometry = view_geometry(tensor, buffer)
    arguments = (array,) if geometry[4] is not MOVING else (array, tensor.storage_offset())
    reader = _view_reader(geometry)
    return fused.apply(reader, "view read", buffer.device_index, *arguments) if pending else reader(*arguments)


def read_for_program(tensor: torch.Tensor) -> tuple[Any, tuple | None]:
    """What a compiled program takes for ``tensor``: the storage's array and the view geometry the program applies
    to it (:func:`view_of`), or the tensor's values and ``None``. A view of all of a one-chip storage in another
    order or dtype (a transposed weight saved for the backward) is taken inside the program, where XLA fuses it
    into its reader, instead of by a program of its own first. Any other view is read as :func:`read` reads it:
    a part of a storage (an element at a step's index, say) as a program input would make a program per offset,
    and a storage seen in another shape as it is (a step's element of a one-element storage) would make a program
    apart from the one for the same element of a longer storage."""
    buffer = buffer_of(tensor)
    array = buffer.array
    if array is None:
        array = buffer.materialize()
    if holds_whole(tensor, buffer, array):
        return array, None
    if tensor.storage_offset() or tensor.numel() * tensor.dtype.itemsize != buffer.nbytes \
            or type(array.sharding) is not ONE_CHIP or _in_order(tensor, buffer):  # the last: a reshape, as before
        return read(tensor), None
    return array, view_geometry(tensor, buffer)


def adopt_dtype(tensor: torch.Tensor) -> None:
    """A storage that ``tensor`` covers whole, in order, in another dtype than the storage was made with (a byte
    buffer that a paged cache reads and writes as its model's dtype) keeps its elements in ``tensor``'s dtype from
    now on, so that a program updating ``tensor`` can be given the storage's own array to update in place (see
    :func:`donatable`). Views in the old dtype read it through a bitcast, as views in any other dtype do."""
    buffer = buffer_of(tensor)
    if (tensor.dtype is buffer.dtype or buffer.sharding is not None or tensor.storage_offset()
            or not tensor.is_contiguous() or tensor.numel() * tensor.dtype.itemsize != buffer.nbytes
            or tensor.is_conj() or tensor.is_neg()):
        return
    written = buffer.array is not None or buffer.pending is not None
    value = fused.concrete(read(tensor)) if written else None  # a storage never written stays lazy
    buffer.dtype, buffer.numel = tensor.dtype, tensor.numel()
    if written:
        buffer.set(value)


def write_input(tensor: torch.Tensor, value: Any, device_index: int) -> None:
    """Sets a program's input to its new ``value`` (an array on chip ``device_index``): a tpu tensor through
    :func:`write`, a CPU tensor the program updated in place (a compiled optimizer step's step count, which torch's
    optimizers keep on the CPU) by a copy to the host."""
    if tensor.device.type == "tpu":
        write(tensor, value)
    else:
        tensor.copy_(wrap(value, dtypes.to_torch(value.dtype), device_index))


def write(tensor: torch.Tensor, value: Any, transfer: bool = False) -> None:
    """Sets the tensor's elements (through its view onto the storage) to ``value``, cast to its dtype;
    ``transfer``: ``value`` was just copied from the host."""
    buffer = buffer_of(tensor)
    if buffer.sharding is not None:
        value = fused.concrete(value)
    if is_whole(tensor, buffer):
        target = dtypes.to_jax(tensor.dtype)
        if value.dtype != target or value.shape != tensor.shape:
            value, transfer = fused.apply(_cast_to(tuple(tensor.shape), target), "cast", buffer.device_index, value), \
                False
        if buffer.sharding is not None and buffer.array is not None and value.shape != buffer.array.shape:
            # written through a whole view of another shape (a flat view)
            value = value.reshape(buffer.array.shape)
        buffer.set(placed(buffer, value), transfer)
        return
    geometry = view_geometry(tensor, buffer)
    offset = (tensor.storage_offset(),) if geometry[4] is MOVING else ()
    inputs = (buffer.current(),)  # the program's inputs, held nowhere else while donatable counts their references
    donate = not fused.ON and donatable(tensor, inputs, 0, occurrences(inputs))
    if not donate and not fused.ON:
        allocator.copied_in_place(buffer.device_index)
    writer = _view_writer(geometry, donate)
    buffer.set(placed(buffer, fused.apply(writer, "view write", buffer.device_index, inputs[0], beside(buffer, value),
                                          *offset)))


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


def reinterpret(flat: Any, dtype: Any) -> Any:
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
    return tpu_lowering.checked("view read", jax.jit(lambda array, *offset: view_of(array, geometry, *offset)))


@functools.lru_cache(maxsize=PROGRAMS_PER_CACHE)
def _view_writer(geometry: tuple, donate: bool):
    """The program writing a view of a storage array; with ``donate``, XLA writes into the array's memory (the
    caller holds the array nowhere else: see :func:`donatable`)."""
    storage_dtype, dtype, size, stride, fixed_offset, conjugated, negated = geometry
    target, storage_target = dtypes.to_jax(dtype), dtypes.to_jax(storage_dtype)

    def write_view(array, value, offset=fixed_offset):
        flat = reinterpret(array.reshape(-1), target)
        value = _apply_bits(value.astype(target), conjugated, negated)
        flat = strided.write(flat, value, size, stride, offset)
        return reinterpret(flat, storage_target).reshape(array.shape)

    return tpu_lowering.checked("view write", jax.jit(write_view, donate_argnums=(0,) if donate else ()))
