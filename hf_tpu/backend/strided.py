"""Reading and writing a strided view of a flat device buffer, in JAX.

A tpu storage holds its elements in one JAX array; a tensor is (size, stride, storage_offset)
over it, exactly as on CPU. These functions run at trace time inside ``jax.jit``. Views that are
a permutation of a strided slice (transpose, permute, select, narrow, step slicing, expand) become
reshape/slice/transpose; anything else (overlapping windows, odd as_strided) becomes a gather.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax


class _SlicePlan(NamedTuple):
    length: int  # elements of the flat buffer covered, starting at the offset
    region_shape: tuple[int, ...]  # reshape of that range; the view is region[:, :n1, ..., :nm, 0]
    take: tuple[slice, ...]
    sorted_shape: tuple[int, ...]  # active dims, outermost stride first
    to_dim_order: tuple[int, ...]  # transpose from sorted order to dim order
    active_dims: tuple[int, ...]  # dims of the view with size > 1 and stride != 0, in dim order


@functools.lru_cache(maxsize=4096)
def _plan(size: tuple[int, ...], stride: tuple[int, ...]) -> _SlicePlan | None:
    active = tuple(d for d in range(len(size)) if size[d] > 1 and stride[d] != 0)
    order = sorted(active, key=lambda d: -stride[d])
    for outer, inner in zip(order, order[1:]):
        if stride[outer] % stride[inner] or size[inner] * stride[inner] > stride[outer]:
            return None  # overlapping or not a slice of a row-major reshape
    if not order:
        return _SlicePlan(1, (1,), (slice(None),), (1,), (0,), ())
    strides = [stride[d] for d in order]
    region = [size[order[0]]] + [a // b for a, b in zip(strides, strides[1:])] + [strides[-1]]
    take = (slice(None),) + tuple(slice(0, size[d]) for d in order[1:]) + (0,)
    sorted_shape = tuple(size[d] for d in order)
    to_dim_order = tuple(order.index(d) for d in active)
    return _SlicePlan(size[order[0]] * strides[0], tuple(region), take, sorted_shape, to_dim_order, active)


def _gather_indices(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> np.ndarray:
    index = np.full(size, offset, dtype=np.int64)
    for dim, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[dim] = n
        index = index + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return index


def _padded(flat: Any, end: int) -> Any:
    return jnp.pad(flat, (0, end - flat.shape[0])) if end > flat.shape[0] else flat


def read(flat: Any, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Any:
    """The values of the view (size, stride, offset) of a 1-D array, shaped ``size``."""
    if 0 in size:
        return jnp.zeros(size, flat.dtype)
    plan = _plan(size, stride)
    if plan is None:
        return flat[_gather_indices(size, stride, offset)]
    region = lax.slice(_padded(flat, offset + plan.length), (offset,), (offset + plan.length,))
    values = region.reshape(plan.region_shape)[plan.take]
    values = jnp.transpose(values, plan.to_dim_order) if plan.active_dims else values.reshape(())
    return lax.broadcast_in_dim(values, size, plan.active_dims)


def write(flat: Any, value: Any, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Any:
    """``flat`` with the view (size, stride, offset) set to ``value`` (broadcast to ``size``)."""
    if 0 in size:
        return flat
    value = jnp.broadcast_to(value.astype(flat.dtype), size)
    plan = _plan(size, stride)
    if plan is None:
        return flat.at[_gather_indices(size, stride, offset)].set(value)
    # Elements that alias one memory location (stride-0 dims) take one of the written values.
    picks = tuple(slice(None) if d in plan.active_dims else 0 for d in range(len(size)))
    values = jnp.transpose(value[picks], np.argsort(plan.to_dim_order)) if plan.active_dims else value[picks]
    values = values.reshape(plan.sorted_shape)
    end = offset + plan.length
    padded = _padded(flat, end)
    region = lax.slice(padded, (offset,), (end,)).reshape(plan.region_shape)
    region = region.at[plan.take].set(values)
    padded = lax.dynamic_update_slice(padded, region.reshape(-1), (offset,))
    return padded[: flat.shape[0]] if end > flat.shape[0] else padded
