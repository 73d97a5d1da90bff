"""Joining, indexing, scattering, sorting and padding.

Boolean masks make output shapes depend on data: ops that take them (``x[mask]``, ``x[mask] = v``,
``masked_select``, ``nonzero``) read the mask to the host, turn it into integer indices there and
index on the device, as CUDA does with a device-to-host sync. ``x[mask] = scalar`` needs no sync.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .. import checks, storage
from ..dispatch import kernel, lowering
from ..dtypes import result_type
from .memory import to_device, to_host


def _device_index(tensor: torch.Tensor) -> int:
    return storage.buffer_of(tensor).device_index


@lowering("cat", "cat.out")
def cat(tensors, dim=0):
    """Concatenates with type promotion; legacy empty 1-D tensors (shape ``(0,)``) are skipped."""
    for position, tensor in enumerate(tensors):
        if tensor.ndim == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {position}) cannot be concatenated")
    dtype = result_type(*tensors)
    kept = [t.astype(dtype) for t in tensors if t.shape != (0,)]
    if not kept:
        return jnp.zeros((0,), dtype)
    return jnp.concatenate(kept, axis=dim % kept[0].ndim)


def _numpy_index(indices):
    return tuple(slice(None) if index is None else index for index in indices)


def _check_indices(self, indices) -> None:
    """As the CPU's index kernels: the dimension a message names counts only the indexed dimensions."""
    present = [(dim, index) for dim, index in enumerate(indices) if index is not None]
    for position, (dim, index) in enumerate(present):
        checks.indices_in_range(index, self.shape[dim], IndexError, checks.out_of_bounds(position, self.shape[dim]))


@lowering("_unsafe_index.Tensor")
def unsafe_index(self, indices):
    """Advanced indexing with integer index tensors (``None`` keeps a dimension whole)."""
    _check_indices(self, indices)
    return self[_numpy_index(indices)]


@lowering("_unsafe_index_put")
def unsafe_index_put(self, indices, values, accumulate=False):
    _check_indices(self, indices)
    target = self.at[_numpy_index(indices)]
    values = values.astype(self.dtype)
    return target.add(values) if accumulate else target.set(values)


def _mask_indices(mask: torch.Tensor) -> list[torch.Tensor]:
    """The integer indices of a boolean mask's True elements, one tensor per mask dimension."""
    index = _device_index(mask)
    host = to_host(mask).numpy()
    return [storage.wrap(to_device(torch.from_numpy(column), torch.int64, index), torch.int64, index, transfer=True)
            for column in np.nonzero(host)]


def _is_mask(index: torch.Tensor | None) -> bool:
    return index is not None and index.dtype in (torch.bool, torch.uint8)


def _checked_indices(self: torch.Tensor, indices: list) -> list:
    """Moves indices to ``self``'s device and checks mask shapes against the dims they index."""
    if len(indices) > self.dim():
        raise IndexError(f"too many indices for tensor of dimension {self.dim()} (got {len(indices)})")
    checked, dim = [], 0
    for index in indices:
        if index is not None and index.device != self.device:
            index = index.to(self.device)
        if _is_mask(index):
            for offset, size in enumerate(index.shape):
                if self.shape[dim + offset] != size:
                    raise IndexError(
                        f"The shape of the mask {list(index.shape)} at index {offset} does not match the shape of "
                        f"the indexed tensor {list(self.shape)} at index {dim + offset}"
                    )
            dim += index.dim()
        else:
            dim += 1
        checked.append(index)
    return checked


def _integer_indices(indices: list) -> list:
    result = []
    for index in indices:
        result.extend(_mask_indices(index) if _is_mask(index) else [index])
    return result


@kernel("index.Tensor")
def index(self, indices):
    return torch.ops.aten._unsafe_index.Tensor(self, _integer_indices(_checked_indices(self, indices)))


@kernel("_index_put_impl_")
def index_put_(self, indices, values, accumulate=False, unsafe=False):
    if values.dtype != self.dtype:
        raise RuntimeError(
            "Index put requires the source and destination dtypes match, got "
            f"{self.dtype} for the destination and {values.dtype} for the source."
        )
    indices = _checked_indices(self, indices)
    present = [i for i, index in enumerate(indices) if index is not None]
    if not accumulate and values.numel() == 1 and len(present) == 1 and _is_mask(indices[present[0]]):
        mask = indices[present[0]].bool()
        before = present[0]
        after = self.dim() - before - mask.dim()
        return self.masked_fill_(mask.reshape((1,) * before + tuple(mask.shape) + (1,) * after), values.reshape(()))
    result = torch.ops.aten._unsafe_index_put(self, _integer_indices(indices), values.to(self.device), accumulate)
    storage.write(self, storage.read(result))
    return self


@kernel("nonzero")
def nonzero(self):
    index = _device_index(self)
    return storage.wrap(to_device(torch.nonzero(to_host(self)), torch.int64, index), torch.int64, index,
                        transfer=True)


@lowering("nonzero_static", "nonzero_static.out")
def nonzero_static(self, size, fill_value=-1):
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    return jnp.stack(jnp.nonzero(self, size=size, fill_value=fill_value), axis=1).astype(jnp.int64)


@lowering("masked_scatter", "masked_scatter_", "masked_scatter.out")
def masked_scatter(self, mask, source):
    """Fills the masked positions, in order, with ``source``'s leading elements (no host sync)."""
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    self = jnp.broadcast_to(self, shape)
    if source.size == 0:
        return self
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    positions = jnp.maximum(jnp.cumsum(flat_mask, dtype=jnp.int64) - 1, 0)
    values = jnp.take(source.reshape(-1), positions, mode="clip").astype(self.dtype)
    return jnp.where(flat_mask, values, self.reshape(-1)).reshape(shape)


@lowering("masked_scatter_backward")
def masked_scatter_backward(grad_output, mask, sizes):
    """The gradient of ``masked_scatter``'s source: ``grad_output`` at the masked positions, in order, then
    zeros, shaped as the source (``sizes``). A scatter with static shapes (CPU's composite goes through
    ``masked_select``, whose length depends on the mask), so graph mode lowers it too."""
    shape = jnp.broadcast_shapes(grad_output.shape, mask.shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    numel = int(np.prod(sizes, dtype=np.int64))
    targets = jnp.where(flat_mask, jnp.cumsum(flat_mask, dtype=jnp.int64) - 1, numel)  # unmasked: dropped
    flat = jnp.zeros((numel,), grad_output.dtype)
    flat = flat.at[targets].set(jnp.broadcast_to(grad_output, shape).reshape(-1), mode="drop")
    return flat.reshape(tuple(sizes))


@kernel("masked_select")
def masked_select(self, mask):
    if mask.dtype != torch.bool:
        raise RuntimeError("masked_select: expected BoolTensor for mask")
    self, mask = torch.broadcast_tensors(self, mask)
    if self.dim() == 0:  # the result is 1-D: index a one-element vector
        self, mask = self.reshape(1), mask.reshape(1)
    return index(self, [mask])


@lowering("index_select", "index_select.out")
def index_select(self, dim, index):
    size = self.shape[dim] if self.ndim else 1
    checks.indices_in_range(index, size, IndexError, _OUT_OF_RANGE, negative=False)
    if self.ndim == 0:
        return self
    return jnp.take(self, index.reshape(-1), axis=dim % self.ndim, mode="clip")


@lowering("take", "take.out")
def take(self, index):
    """Elements of the flattened ``self``; negative indices count from the end."""
    checks.indices_in_range(index, self.size, IndexError, _flat_out_of_range(self.size))
    return jnp.take(self.reshape(-1), index)


_OUT_OF_RANGE = "index out of range in self"
_BOUNDS = "index {} is out of bounds for dimension {dim} with size {size}"


def _flat_out_of_range(size: int) -> str:
    return f"out of range: tried to access index {{}} on a tensor of {size} elements."


def _index_along(self, dim, index, message=_OUT_OF_RANGE, negative=False):
    """The ``.at`` target of ``self`` at positions ``index`` (a vector) of dimension ``dim``, checked
    against that dimension's size (``message``: the CPU's error for a bad index)."""
    axis = dim % max(self.ndim, 1)
    checks.indices_in_range(index, self.shape[axis], IndexError, message.format("{}", dim=axis, size=self.shape[axis]),
                            negative=negative)
    return self.at[(slice(None),) * axis + (index.reshape(-1),)], axis


def _source_for(self, axis, index, source):
    return source.reshape(self.shape[:axis] + (index.size,) + self.shape[axis + 1:]).astype(self.dtype)


def _as_vector(fn):
    """Runs ``fn`` on a zero-dim ``self`` as a one-element vector (its dim 0), as torch does."""

    @functools.wraps(fn)
    def lower(self, *args):
        if self.ndim:
            return fn(self, *args)
        return fn(self.reshape(1), *args).reshape(())

    return lower


@lowering("index_add", "index_add_", "index_add.out")
@_as_vector
def index_add(self, dim, index, source, alpha=1):
    target, axis = _index_along(self, dim, index)
    if not (isinstance(alpha, int) and alpha == 1):
        source = source * alpha
    return target.add(_source_for(self, axis, index, source))


@lowering("index_copy", "index_copy_", "index_copy.out")
@_as_vector
def index_copy(self, dim, index, source):
    target, axis = _index_along(self, dim, index, "index_copy_(): " + _BOUNDS)
    return target.set(_source_for(self, axis, index, source))


@lowering("index_fill.int_Scalar", "index_fill_.int_Scalar", "index_fill.int_Tensor", "index_fill_.int_Tensor",
          "index_fill.int_Scalar_out", "index_fill.int_Tensor_out")
@_as_vector
def index_fill(self, dim, index, value):
    target, _ = _index_along(self, dim, index, _BOUNDS, negative=True)
    return target.set(jnp.asarray(value).astype(self.dtype))


@lowering("index_reduce", "index_reduce_", "index_reduce.out")
@_as_vector
def index_reduce(self, dim, index, source, reduce, include_self=True):
    """Reduces slices of ``source`` into ``self`` at ``index`` along ``dim`` (prod, mean, amax or amin)."""
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise RuntimeError(f"index_reduce(): Expected reduce to be one of prod, mean, amax or amin, got {reduce}.")
    target, axis = _index_along(self, dim, index)
    values = _source_for(self, axis, index, source)
    if not include_self:
        target = target.set(_identity(reduce, self.dtype))
        target, _ = _index_along(target, dim, index)
    if reduce == "prod":
        return target.multiply(values)
    if reduce == "amax":
        return target.max(values)
    if reduce == "amin":
        return target.min(values)
    counts, _ = _index_along(jnp.full(self.shape, int(include_self), self.dtype), dim, index)
    counts = jnp.maximum(counts.add(jnp.ones((), self.dtype)), jnp.ones((), self.dtype))
    total = target.add(values)
    return total / counts if jnp.issubdtype(self.dtype, jnp.inexact) else total // counts


@lowering("put", "put_", "put.out")
def put(self, index, source, accumulate=False):
    """Writes ``source`` into the flattened ``self`` at ``index`` (negative counts from the end)."""
    flat = self.reshape(-1)
    index = index.reshape(-1)
    checks.indices_in_range(index, flat.size, IndexError, _flat_out_of_range(flat.size))
    target = flat.at[jnp.where(index < 0, index + flat.size, index)]
    values = source.reshape(-1).astype(self.dtype)
    return (target.add(values) if accumulate else target.set(values)).reshape(self.shape)


def _scatter_positions(index, dim):
    """Full coordinates for scatter/gather: ``index`` along ``dim``, the element's own position elsewhere."""
    axis = dim % index.ndim
    return tuple(index if d == axis else lax.broadcasted_iota(index.dtype, index.shape, d) for d in range(index.ndim))


def _scatter_source(src, index, dtype):
    if jnp.ndim(src) == 0:
        return jnp.broadcast_to(jnp.asarray(src).astype(dtype), index.shape)
    return jnp.atleast_1d(src)[tuple(slice(0, n) for n in index.shape)].astype(dtype)


_SCATTER_REDUCE = {None: "set", "add": "sum", "multiply": "prod"}


@lowering("scatter.src", "scatter.value", "scatter.reduce", "scatter.value_reduce",
          "scatter_.src", "scatter_.value", "scatter_.reduce", "scatter_.value_reduce",
          "scatter.src_out", "scatter.value_out", "scatter.reduce_out", "scatter.value_reduce_out")
def scatter(self, dim, index, src, reduce=None):
    if reduce not in _SCATTER_REDUCE:
        raise RuntimeError(f"reduce argument must be either add or multiply, got {reduce}")
    return _scatter_reduce(self, dim, index, src, _SCATTER_REDUCE[reduce], True)


@lowering("scatter_add", "scatter_add_", "scatter_add.out")
def scatter_add(self, dim, index, src):
    return _scatter_reduce(self, dim, index, src, "sum", True)


@lowering("scatter_reduce.two", "scatter_reduce_.two", "scatter_reduce.two_out")
def scatter_reduce(self, dim, index, src, reduce, include_self=True):
    if reduce not in ("sum", "prod", "mean", "amax", "amin"):
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")
    return _scatter_reduce(self, dim, index, src, reduce, include_self)


def _identity(reduce, dtype):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(-jnp.inf if reduce == "amax" else jnp.inf, dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(reduce == "amin", dtype)
    return jnp.asarray(jnp.iinfo(dtype).min if reduce == "amax" else jnp.iinfo(dtype).max, dtype)


def _check_along(self, index, dim) -> None:
    """scatter and gather: every index addresses ``self`` along ``dim`` (no negative indices)."""
    axis = dim % index.ndim
    checks.indices_in_range(index, self.shape[axis], RuntimeError, checks.out_of_bounds(axis, self.shape[axis]),
                            negative=False)


def _scatter_reduce(self, dim, index, src, reduce, include_self):
    shape = self.shape
    if index.size == 0:  # an empty index may have any number of dims (gather's backward passes one)
        return self
    self, index = jnp.atleast_1d(self), jnp.atleast_1d(index)
    _check_along(self, index, dim)
    positions = _scatter_positions(index, dim)
    values = _scatter_source(src, index, self.dtype)
    if reduce == "set":
        return self.at[positions].set(values).reshape(shape)
    base = self if include_self else self.at[positions].set(_identity(reduce, self.dtype))
    target = base.at[positions]
    if reduce in ("sum", "mean"):
        result = target.add(values)
    elif reduce == "prod":
        result = target.multiply(values)
    elif reduce == "amax":
        result = target.max(values)
    else:
        result = target.min(values)
    if reduce == "mean":
        counts = jnp.full(self.shape, int(include_self), self.dtype).at[positions].add(jnp.ones((), self.dtype))
        counts = jnp.maximum(counts, jnp.ones((), self.dtype))
        result = result // counts if not jnp.issubdtype(self.dtype, jnp.inexact) else result / counts
    return result.reshape(shape)


@lowering("gather", "gather.out")
def gather(self, dim, index, sparse_grad=False):
    shape = index.shape
    if index.size == 0:
        return jnp.zeros(shape, self.dtype)
    self, index = jnp.atleast_1d(self), jnp.atleast_1d(index)
    _check_along(self, index, dim)
    axis = dim % index.ndim
    window = self[tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(index.shape))]
    return jnp.take_along_axis(window, index, axis=axis, mode="clip").reshape(shape)


@lowering("tril", "tril_", "tril.out")
def tril(self, diagonal=0):
    return jnp.tril(self, k=diagonal)


@lowering("triu", "triu_", "triu.out")
def triu(self, diagonal=0):
    return jnp.triu(self, k=diagonal)


@lowering("flip", "flip.out")
def flip(self, dims):
    return jnp.flip(self, axis=tuple(d % self.ndim for d in dims)) if self.ndim else self


@lowering("roll", "roll.out", positions=("shifts",))
def roll(self, shifts, dims=()):
    """``self`` shifted by ``shifts`` along ``dims`` (flattened if none), wrapping around. The shifts are traced:
    one program serves every shift."""
    if not shifts:
        raise RuntimeError("`shifts` required")
    if len(shifts) != max(len(dims), 1):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:{len(dims)}")
    if dims and self.ndim == 0:
        raise IndexError(f"Dimension specified as {dims[0]} but tensor has no dimensions")
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, shifts, axis=tuple(d % self.ndim for d in dims))


def _sorted(self, dim, descending):
    values = jnp.atleast_1d(self)
    axis = dim % values.ndim
    order = jnp.argsort(values, axis=axis, stable=True, descending=descending)
    picked = jnp.take_along_axis(values, order, axis=axis)
    return picked.reshape(self.shape), order.astype(jnp.int64).reshape(self.shape)


@lowering("sort", "sort.values")
def sort(self, dim=-1, descending=False):
    """Sorts stably (a valid unstable sort too); NaN sorts as the largest value, as in torch."""
    return _sorted(self, dim, descending)


@lowering("sort.stable", "sort.values_stable")
def sort_stable(self, stable, dim=-1, descending=False):
    return _sorted(self, dim, descending)


@lowering("topk", "topk.values")
def topk(self, k, dim=-1, largest=True, sorted=True):
    """The k largest (smallest) elements, in order; NaN counts as larger than any number."""
    values = jnp.moveaxis(jnp.atleast_1d(self), dim % max(self.ndim, 1), -1)
    if largest:
        keys = values
    elif jnp.issubdtype(values.dtype, jnp.inexact):
        keys = jnp.where(jnp.isnan(values), -jnp.inf, -values)
    else:
        keys = ~values
    order = lax.top_k(keys, k)[1]
    picked = jnp.take_along_axis(values, order, axis=-1)
    if self.ndim == 0:
        return picked.reshape(()), order.astype(jnp.int64).reshape(())
    axis = dim % self.ndim
    return jnp.moveaxis(picked, -1, axis), jnp.moveaxis(order, -1, axis).astype(jnp.int64)


@lowering("isin.Tensor_Tensor", "isin.Tensor_Scalar", "isin.Scalar_Tensor",
          "isin.Tensor_Tensor_out", "isin.Tensor_Scalar_out", "isin.Scalar_Tensor_out")
def isin(elements, test_elements, assume_unique=False, invert=False):
    dtype = result_type(elements, test_elements)
    elements = jnp.asarray(elements).astype(dtype)
    tests = jnp.sort(jnp.asarray(test_elements).astype(dtype).reshape(-1))
    if tests.size == 0:
        found = jnp.zeros(elements.shape, jnp.bool_)
    else:
        position = jnp.minimum(jnp.searchsorted(tests, elements), tests.size - 1)
        found = tests[position] == elements
    return ~found if invert else found


@lowering("searchsorted.Tensor", "searchsorted.Scalar", "searchsorted.Tensor_out", "searchsorted.Scalar_out")
def searchsorted(sorted_sequence, self, out_int32=False, right=False, side=None, sorter=None):
    """Insertion points in the last dim of ``sorted_sequence`` (batched over its leading dims)."""
    side = side or ("right" if right else "left")
    dtype = result_type(sorted_sequence, self)
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    boundaries, values = sorted_sequence.astype(dtype), jnp.asarray(self).astype(dtype)
    if boundaries.ndim == 1:
        positions = jnp.searchsorted(boundaries, values, side=side)
    else:
        rows = boundaries.reshape(-1, boundaries.shape[-1])
        search = jax.vmap(lambda row, v: jnp.searchsorted(row, v, side=side))
        positions = search(rows, values.reshape(rows.shape[0], -1)).reshape(values.shape)
    return positions.astype(jnp.int32 if out_int32 else jnp.int64)


@lowering("bucketize.Tensor", "bucketize.Scalar", "bucketize.Tensor_out", "bucketize.Scalar_out")
def bucketize(self, boundaries, out_int32=False, right=False):
    return searchsorted(boundaries, self, out_int32, right)


@kernel("repeat_interleave.Tensor")
def repeat_interleave(repeats, output_size=None):
    """``i`` repeated ``repeats[i]`` times; without ``output_size`` the total is read to the host."""
    if repeats.dim() != 1:
        raise RuntimeError("repeat_interleave only accept 1D vector as repeat")
    if output_size is None:
        output_size = int(to_host(repeats).sum())
    index = _device_index(repeats)
    return storage.wrap(_repeated_positions(storage.read(repeats), output_size), repeats.dtype, index)


@functools.partial(jax.jit, static_argnums=1)
def _repeated_positions(repeats, total):
    return jnp.repeat(jnp.arange(repeats.shape[0], dtype=repeats.dtype), repeats, total_repeat_length=total)


@lowering("constant_pad_nd", "constant_pad_nd.out")
def constant_pad_nd(self, pad, value=0):
    """Pads (or, with negative amounts, crops) the last ``len(pad) // 2`` dims, last dim first."""
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        config[self.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, jnp.asarray(value).astype(self.dtype), config)


def _unique_on_host(op):
    """A unique-values kernel computed on the host: its output size depends on the data."""

    def run(self, *args, **kwargs):
        index = _device_index(self)
        results = op(to_host(self), *args, **kwargs)
        return tuple(storage.wrap(to_device(r, r.dtype, index), r.dtype, index, transfer=True) for r in results)

    return run


for _name in ("_unique", "_unique2", "unique_dim", "unique_consecutive"):
    kernel(_name)(_unique_on_host(getattr(torch.ops.aten, _name).default))
