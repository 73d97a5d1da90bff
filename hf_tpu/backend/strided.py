"""Reading and writing a strided view of a flat device buffer, in JAX.

A tpu storage holds its elements in one JAX array; a tensor is (size, stride, storage_offset)
over it, exactly as on CPU. These functions run at trace time inside ``jax.jit``. Views that are
a permutation of a strided slice (transpose, permute, select, narrow, step slicing, expand) become
reshape/slice/transpose; anything else (overlapping windows, odd as_strided) becomes a gather.

The offset is a Python int (part of the program) or a traced integer (an argument of the program: one program
serves a view at every offset, e.g. a cache written at a moving position), for a view that
:func:`takes_moving_offset`: a strided slice is then a ``dynamic_slice`` of the array seen as rows of its strides
(nothing padded or copied: a write into a donated array updates it in place), a gather indices plus the offset.
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
    sorted_strides: tuple[int, ...]  # the active dims' strides, outermost first


@functools.lru_cache(maxsize=4096)
def _plan(size: tuple[int, ...], stride: tuple[int, ...]) -> _SlicePlan | None:
    active = tuple(d for d in range(len(size)) if size[d] > 1 and stride[d] != 0)
    order = sorted(active, key=lambda d: -stride[d])
    for outer, inner in zip(order, order[1:]):
        if stride[outer] % stride[inner] or size[inner] * stride[inner] > stride[outer]:
            return None  # overlapping or not a slice of a row-major reshape
    if not order:
        return _SlicePlan(1, (1,), (slice(None),), (1,), (0,), (), ())
    strides = [stride[d] for d in order]
    region = [size[order[0]]] + [a // b for a, b in zip(strides, strides[1:])] + [strides[-1]]
    take = (slice(None),) + tuple(slice(0, size[d]) for d in order[1:]) + (0,)
    sorted_shape = tuple(size[d] for d in order)
    to_dim_order = tuple(order.index(d) for d in active)
    return _SlicePlan(size[order[0]] * strides[0], tuple(region), take, sorted_shape, to_dim_order, active,
                      tuple(strides))


def _gather_indices(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> np.ndarray:
    index = np.full(size, offset, dtype=np.int64)
    for dim, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[dim] = n
        index = index + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return index


def _padded(flat: Any, end: int) -> Any:
    return jnp.pad(flat, (0, end - flat.shape[0])) if end > flat.shape[0] else flat


def _rows(numel: int, plan: _SlicePlan) -> tuple[int, ...]:
    """The shape that makes an array of ``numel`` elements rows of the plan's strides (the last axis the innermost
    stride's run, of which the view takes the first element)."""
    strides = plan.sorted_strides
    return (numel // strides[0], *(outer // inner for outer, inner in zip(strides, strides[1:])), strides[-1])


def _start(offset: Any, numel: int, plan: _SlicePlan) -> list:
    """The offset as an index into :func:`_rows` (Python ints, or traced ones)."""
    strides = plan.sorted_strides
    bounds = (numel, *strides)
    return [offset % outer // inner for outer, inner in zip(bounds, strides)] + [offset % strides[-1]]


def takes_moving_offset(size: tuple[int, ...], stride: tuple[int, ...], offset: int, numel: int) -> bool:
    """Whether the view (size, stride, offset) of an array of ``numel`` elements can be taken with its offset as an
    argument (:func:`read` and :func:`write` with a traced offset): a gather always; a strided slice when the
    array reshapes to rows of its strides and the view, at this offset, does not wrap from one row to the next
    (it never does for a slice of a tensor; an ``as_strided`` view may)."""
    if not numel or 0 in size:  # nothing to read or write: the offset may stay in the program
        return False
    plan = _plan(size, stride)
    if plan is None or not plan.sorted_strides:
        return True
    if numel % plan.sorted_strides[0]:
        return False
    rows = _rows(numel, plan)
    block = (*plan.sorted_shape, 1)
    return all(0 <= start + length <= row for start, length, row in zip(_start(offset, numel, plan), block, rows))


def _moving_slice(flat: Any, plan: _SlicePlan, offset: Any) -> tuple:
    """For a traced offset: ``flat`` as rows of the plan's strides, the view's start in them and its block shape."""
    if not plan.sorted_strides:  # one element
        return flat, [offset], (1,)
    return flat.reshape(_rows(flat.shape[0], plan)), _start(offset, flat.shape[0], plan), (*plan.sorted_shape, 1)


def read(flat: Any, size: tuple[int, ...], stride: tuple[int, ...], offset: Any) -> Any:
    """The values of the view (size, stride, offset) of a 1-D array, shaped ``size``."""
    if 0 in size:
        return jnp.zeros(size, flat.dtype)
    plan = _plan(size, stride)
    if plan is None:
        return flat[_gather_indices(size, stride, 0) + offset]
    if isinstance(offset, int):
        region = lax.slice(_padded(flat, offset + plan.length), (offset,), (offset + plan.length,))
        values = region.reshape(plan.region_shape)[plan.take]
    else:
        rows, start, block = _moving_slice(flat, plan, offset)
        values = lax.dynamic_slice(rows, start, block).reshape(plan.sorted_shape)
    values = jnp.transpose(values, plan.to_dim_order) if plan.active_dims else values.reshape(())
    return lax.broadcast_in_dim(values, size, plan.active_dims)


def write(flat: Any, value: Any, size: tuple[int, ...], stride: tuple[int, ...], offset: Any) -> Any:
    """``flat`` with the view (size, stride, offset) set to ``value`` (broadcast to ``size``)."""
    if 0 in size:
        return flat
    value = jnp.broadcast_to(value.astype(flat.dtype), size)
    plan = _plan(size, stride)
    if plan is None:
        return flat.at[_gather_indices(size, stride, 0) + offset].set(value)
    # Elements that alias one memory location (stride-0 dims) take one of the written values.
    picks = tuple(slice(None) if d in plan.active_dims else 0 for d in range(len(size)))
    values = jnp.transpose(value[picks], np.argsort(plan.to_dim_order)) if plan.active_dims else value[picks]
    values = values.reshape(plan.sorted_shape)
    if not isinstance(offset, int):
        rows, start, block = _moving_slice(flat, plan, offset)
        return lax.dynamic_update_slice(rows, values.reshape(block), start).reshape(-1)
    end = offset + plan.length
    padded = _padded(flat, end)
    region = lax.slice(padded, (offset,), (end,)).reshape(plan.region_shape)
    region = region.at[plan.take].set(values)
    padded = lax.dynamic_update_slice(padded, region.reshape(-1), (offset,))
    return padded[: flat.shape[0]] if end > flat.shape[0] else padded
