"""Allocation and data movement: empty, copies between host and device and between chips, scalars."""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src import core
from jax._src.interpreters import pxla

from .. import checks, devices, dtypes, fused, pinned, runtime, storage, streams
from ..dispatch import check_no_internal_overlap, device_mismatch, kernel, lowering


def _index(device: Any) -> int:
    if device is None:
        return devices.current_device()
    index = torch.device(device).index
    return devices.current_device() if index is None else devices.index_of(index)


_CHANNELS_LAST_STRIDES = {
    torch.channels_last: torch._prims_common.make_channels_last_strides_for,
    torch.channels_last_3d: torch._prims_common.make_channels_last_3d_strides_for,
}


@kernel("empty.memory_format")
def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    strides = _CHANNELS_LAST_STRIDES.get(memory_format)
    stride = None if strides is None else strides(size)
    return storage.empty(size, dtype or torch.get_default_dtype(), _index(device), stride)


@kernel("empty_strided")
def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return storage.empty(size, dtype or torch.get_default_dtype(), _index(device), stride)


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


@kernel("empty_like")
def empty_like(self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``empty_like``, with the strides ``_to_copy`` gives (as CPU's). A contiguous result on the chip of a sharded
    tensor is sharded alike, and so are the ``zeros_like``, ``ones_like``, ``randn_like`` ... that fill it (the
    optimizer states of sharded parameters, for one)."""
    target = self.device if device is None else torch.device(device)
    if target.type != "tpu" or layout not in (None, torch.strided) or pin_memory:
        return torch.ops.aten.empty_like.default.redispatch(  # torch's own, for another device
            _CPU_KEYS, self, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
            memory_format=memory_format)
    stride = _layout_for(self, memory_format)
    result = storage.empty(self.shape, dtype or self.dtype, _index(target), stride)
    sharding = storage.buffer_of(self).sharding
    if sharding is not None and stride is None and result.device == self.device and result.numel():
        like = storage.read(self).sharding  # its first contents give a new storage its placement (storage.placed)
        storage.write(result, jnp.zeros(result.shape, dtypes.to_jax(result.dtype), device=like))
    return result


_handed_over: set[int] = set()


def hand_over(host: torch.Tensor) -> torch.Tensor:
    """Marks a freshly read host tensor as having no other user, so that its first copy to a device on
    JAX's CPU platform may keep its memory instead of copying it (see :func:`to_device`). For loaders
    that read weights into new buffers (one trip from file to device); returns ``host``."""
    pointer = host.untyped_storage().data_ptr()
    _handed_over.add(pointer)
    weakref.finalize(host, _handed_over.discard, pointer)
    return host


def to_device(host: torch.Tensor, dtype: torch.dtype, device_index: int | jax.sharding.Sharding) -> Any:
    """Copies a host tensor to a device, converting dtype on the host first (fewer bytes to move).
    ``device_index`` may be a sharding instead: then each of its chips receives only its shard of the host
    array (no whole copy on any chip)."""
    target = dtypes.to_jax(dtype)  # raises TypeError for a dtype the device cannot hold
    source = host
    host = host.detach().resolve_conj().resolve_neg()
    if host.dtype != dtype:
        host = host.to(dtype)
    host = host.contiguous()
    if isinstance(device_index, jax.sharding.Sharding):
        destination, platform = device_index, next(iter(device_index.device_set)).platform
    else:
        destination = runtime.device(device_index)
        platform = destination.platform
    pointer = host.untyped_storage().data_ptr()
    if pointer in _handed_over:
        _handed_over.discard(pointer)
    elif platform == "cpu" and pointer == source.untyped_storage().data_ptr():
        # JAX's CPU platform aliases suitably aligned host memory even with may_alias=False (jax 0.10),
        # so a later in-place write to the host tensor would change the device tensor: copy first.
        host = host.clone()
    if host.dtype == torch.bfloat16:
        array = host.view(torch.int16).numpy().view(dtypes.host_numpy_dtype(torch.bfloat16))
    elif host.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        array = host.view(torch.uint8).numpy().view(dtypes.host_numpy_dtype(host.dtype))
    else:
        array = host.numpy()
    if array.dtype != target:
        array = array.astype(target)
    if array.nbytes <= SMALL_TRANSFER and not isinstance(device_index, jax.sharding.Sharding):
        return pxla.batched_device_put(core.ShapedArray(array.shape, array.dtype), runtime.one_chip(device_index),
                                       [array], [destination])
    return jax.device_put(array, destination, may_alias=False)


SMALL_TRANSFER = 1 << 16
"""Host arrays up to this many bytes (a token, a position, a mask: a loop's per-step inputs) reach their chip by
the transfer ``jax.device_put`` ends in (``pxla.batched_device_put``, JAX's C++ copy), without ``device_put``'s
Python around it: that is most of a small copy's time (a 3-element array: 24 against 5 µs here). Larger ones take
``device_put``, whose time is the copy's. The array given is the host's own (``to_device`` copied it first where
the host tensor could be written later), so the device may keep its memory."""


def _transferred(host: torch.Tensor, dtype: torch.dtype, device_index: int) -> Any:
    """:func:`to_device` for a stream's worker: returns once the copy is complete."""
    array = to_device(host, dtype, device_index)
    array.block_until_ready()
    return array


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A new CPU tensor with a tpu tensor's values (a host sync: raises the checks pending)."""
    checks.raise_pending()
    return _host_tensor(storage.read(tensor), tensor.dtype)


def _host_tensor(array: Any, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor of ``dtype`` with a device array's values (waits for the array)."""
    array = np.asarray(array)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, order="C")
    if dtype in (torch.float64, torch.complex128) and array.dtype != dtypes.host_numpy_dtype(dtype):
        array = array.astype(dtypes.host_numpy_dtype(dtype))
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.from_numpy(array.view(np.uint8)).view(dtype)
    return torch.from_numpy(array)


def _fill_host(host: torch.Tensor, dtype: torch.dtype, array: Any) -> None:
    """For a queued copy: copies a device array (of ``dtype``) into a host tensor."""
    host.copy_(_host_tensor(array, dtype))


def _device_index_of(tensor: torch.Tensor) -> int:
    return storage.buffer_of(tensor).device_index


@kernel("copy_")
def copy_(self, src, non_blocking=False):
    if self.device.type != "tpu":
        if self.device.type == "meta":
            raise device_mismatch(src.device, self.device)
        if self.device.type != "cpu":  # into another accelerator's tensor (cuda), through the host
            return self.copy_(to_host(src), non_blocking)
        queued = non_blocking and self.is_pinned()
        stream = streams.copy_stream(_device_index_of(src), into_pinned_host=queued)
        if stream is None:
            return self.copy_(to_host(src), non_blocking)
        if queued:  # on the default stream without running the recorded ops
            streams.queue_host_copy(stream, functools.partial(_fill_host, self, src.dtype),
                                    storage.read(src, pending=True))
            return self
        return self.copy_(streams.run_copy(stream, to_host, src))
    check_no_internal_overlap(self)
    index = _device_index_of(self)
    transfer = True
    if src.device.type == "tpu":
        transfer = _device_index_of(src) != index
        value = storage.read(src, pending=not transfer)  # a copy on one chip is recorded in fused eager mode
        if transfer:
            value = jax.device_put(value, runtime.device(index))
    elif src.device.type in ("cpu", "meta"):
        if src.device.type == "meta":
            raise NotImplementedError(
                "Cannot copy out of meta tensor; no data! Use 'to_empty()' to move a module off meta."
            )
        stream = streams.copy_stream(index)
        if stream is None:
            value = to_device(src, self.dtype, index)
        elif non_blocking and src.is_pinned() and src.shape == self.shape and storage.is_whole(
            self, storage.buffer_of(self)
        ):
            storage.buffer_of(self).defer(streams.queue_copy(stream, _transferred, src, self.dtype, index))
            return self
        else:
            value = streams.run_copy(stream, _transferred, src, self.dtype, index)
    else:  # another accelerator's tensor (cuda) comes through the host
        return copy_(self, src.cpu(), non_blocking)
    if self.is_complex() is False and jnp.issubdtype(value.dtype, jnp.complexfloating):
        _warn_if_discarding_imaginary(src.dtype, self.dtype)
        value, transfer = fused.apply(_astype(dtypes.to_jax(self.dtype)), "cast", index, value), False
    storage.write(self, value, transfer)
    return self


@kernel("_copy_from")
def _copy_from(self, dst, non_blocking=False):
    return copy_(dst, self, non_blocking)


@kernel("_copy_from_and_resize")
def _copy_from_and_resize(self, dst):
    if tuple(dst.shape) != tuple(self.shape):
        dst.resize_(self.shape)
    return copy_(dst, self)


def _warn_if_discarding_imaginary(source: torch.dtype, destination: torch.dtype) -> None:
    if source.is_complex and not destination.is_complex:
        warnings.warn("Casting complex values to real discards the imaginary part", UserWarning, stacklevel=3)


def _layout_for(tensor: torch.Tensor, memory_format: Any) -> tuple | None:
    """The strides of ``tensor.to(..., memory_format=...)``'s result, as on CPU (``empty_like``'s rule); None for
    contiguous."""
    if memory_format in (None, torch.preserve_format):
        stride, contiguous = tuple(tensor.stride()), storage.contiguous_strides(tuple(tensor.shape))
        if stride == contiguous:
            return None
        if not torch._prims_common.is_non_overlapping_and_dense_or_false(tensor):
            # dense strides in the order of the tensor's own (a slice of a transposed or channels-last tensor)
            order, _ = torch._prims_common.compute_elementwise_output_logical_to_physical_perm(tensor)
            dense, step = [0] * tensor.dim(), 1
            for dim in reversed(order):
                dense[dim], step = step, step * max(tensor.shape[dim], 1)
            stride = tuple(dense)
        return None if stride == contiguous else stride
    strides = _CHANNELS_LAST_STRIDES.get(memory_format)
    return None if strides is None else strides(tensor.shape)


def _device_result(value: Any, dtype: torch.dtype, index: int, stride: tuple | None, transfer: bool) -> torch.Tensor:
    if stride is None:
        return storage.wrap(value, dtype, index, transfer)
    result = storage.empty(value.shape, dtype, index, stride)
    storage.write(result, value, transfer)
    return result


@kernel("_to_copy")
def _to_copy(self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    dtype = dtype or self.dtype
    target = torch.device(device) if device is not None else self.device
    stride = _layout_for(self, memory_format)
    if self.device.type != "tpu":  # host -> device, converting on the host
        if self.device.type not in ("cpu", "meta"):  # another accelerator's tensor (cuda) comes through the host
            return _to_copy(self.cpu(), dtype, layout, device, pin_memory, non_blocking, memory_format)
        index = _index(target)
        if self.numel() == 0:  # nothing to move (transformers' caches start as torch.tensor([], device=...))
            dtypes.to_jax(dtype)  # a dtype the device cannot hold raises TypeError, as for a copy
            return storage.empty(self.shape, dtype, index, stride)
        stream = streams.copy_stream(index)
        if stream is None:
            value = to_device(self, dtype, index)
        elif non_blocking and stride is None and self.is_pinned():
            result = storage.empty(self.shape, dtype, index)
            storage.buffer_of(result).defer(streams.queue_copy(stream, _transferred, self, dtype, index))
            return result
        else:
            value = streams.run_copy(stream, _transferred, self, dtype, index)
        return _device_result(value, dtype, index, stride, transfer=True)
    if target.type == "tpu":
        _warn_if_discarding_imaginary(self.dtype, dtype)
        index = _index(target)
        transfer = _device_index_of(self) != index
        value = storage.read(self, pending=not transfer)
        if transfer:
            value = jax.device_put(value, runtime.device(index))
        if value.dtype != dtypes.to_jax(dtype):
            value, transfer = fused.apply(_astype(dtypes.to_jax(dtype)), "cast", index, value), False
        return _device_result(value, dtype, index, stride, transfer)
    stream = streams.copy_stream(_device_index_of(self))
    if stream is not None and non_blocking and target.type == "cpu":  # into pinned memory, as CUDA does
        host = torch.empty_strided(self.shape, stride or storage.contiguous_strides(tuple(self.shape)),
                                   dtype=dtype)
        streams.queue_host_copy(stream, functools.partial(_fill_host, pinned.mark(host), self.dtype),
                                storage.read(self, pending=True))
        return host
    host = to_host(self) if stream is None else streams.run_copy(stream, to_host, self)
    if host.dtype != dtype:
        host = host.to(dtype)
    if stride is not None:
        host = torch.empty_strided(host.shape, stride, dtype=dtype).copy_(host)
    if target.type != "cpu":
        return host.to(target)
    return host.pin_memory() if pin_memory else host


@kernel("clone")
def clone(self, memory_format=None):
    """``_to_copy`` to the same device and dtype: a new storage holding the source's values, with the strides CPU's
    ``clone`` gives (torch's composite, ``empty_like`` then ``copy_``, makes the storage first and writes it after)."""
    return _to_copy(self, memory_format=memory_format)


_astype_cache: dict[Any, Any] = {}


def _astype(dtype: Any):
    fn = _astype_cache.get(dtype)
    if fn is None:
        to_real = not jnp.issubdtype(dtype, jnp.complexfloating)
        fn = _astype_cache[dtype] = jax.jit(
            lambda x: (x.real if to_real and jnp.iscomplexobj(x) else x).astype(dtype)
        )
    return fn


@kernel("record_stream")
def record_stream(self, s):
    streams.record_stream(self, s)


@kernel("_local_scalar_dense")
def _local_scalar_dense(self):
    checks.raise_pending()
    streams.finish_host_copies(_device_index_of(self))
    return np.asarray(storage.read(self)).item()


@kernel("resize_")
def resize_(self, size, memory_format=None):
    size = tuple(size)
    buffer = storage.buffer_of(self)
    needed = self.storage_offset() + math.prod(size)
    if needed > buffer.numel:
        grown = storage.empty((needed,), buffer.dtype, buffer.device_index)
        if buffer.array is not None or buffer.pending is not None:
            old = buffer.materialize().reshape(-1)
            storage.buffer_of(grown).set(jnp.concatenate([old, jnp.zeros(needed - buffer.numel, old.dtype)]))
        new_storage = grown.untyped_storage()
    else:
        new_storage = self.untyped_storage()
    stride = storage.contiguous_strides(tuple(size))
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), self, new_storage, self.storage_offset(), size, stride
    )
    return self


@lowering("fill_.Scalar", "fill.Scalar", writes_overlapping=True)
def fill(self, value):
    return jnp.full(self.shape, value, self.dtype)


@lowering("fill_.Tensor", "fill.Tensor", writes_overlapping=True)
def fill_tensor(self, value):
    if value.ndim:
        raise RuntimeError(f"fill_ only supports 0-dimension value tensor but got tensor with {value.ndim} dimensions.")
    return jnp.broadcast_to(value.astype(self.dtype), self.shape)


@lowering("zero_", "zero", writes_overlapping=True)
def zero(self):
    return jnp.zeros(self.shape, self.dtype)
