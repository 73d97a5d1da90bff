"""Graph-mode lowerings of the ops eager mode runs as torch-level kernels (views, factories, copies).

Eager mode computes views with CPU metadata kernels over a shared storage and allocates through
``storage``; inside one traced graph there is no storage, so these become functional JAX ops.
Each function has its ATen schema's parameter list. A non-tensor argument is a Python constant, except a position
(a slice's bounds, a select's index, a view's offset) that comes from a graph input whose value no shape depends
on: that is a traced integer, an argument of the program (see :mod:`.graph_lowering`), so a graph whose only change
is a position reuses its program. Lowerings that take positions accept both; the others fail on a traced one, and
the graph is then traced again with its positions as constants.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import torch
from jax import lax

from ..backend import dtypes, storage, strided
from ..backend.positions import is_traced, normalized
from ..backend.dispatch import LOWERINGS, resolve

GRAPH_LOWERINGS: dict[torch._ops.OpOverload, Callable[..., Any]] = {}


def registrar(table: dict) -> Callable[..., Callable[[Callable], Callable]]:
    """A decorator factory that registers a function in ``table`` for ATen overloads (names as in
    :func:`..backend.dispatch.lowering`)."""

    def lowering(*names: str) -> Callable[[Callable], Callable]:
        def register(fn: Callable) -> Callable:
            for name in names:
                table[resolve(name)] = fn
            return fn

        return register

    return lowering


graph_lowering = registrar(GRAPH_LOWERINGS)


def sees_result(fn: Callable) -> Callable:
    """Marks a lowering that takes its node's result (``result=``, the traced fake tensor): a slice at a traced
    position reads its length from it."""
    fn.sees_result = True
    return fn


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# --- views ----------------------------------------------------------------------------------------


@graph_lowering("view", "_unsafe_view", "_reshape_alias", "view_copy")
def view(self, size, stride=None):
    return jnp.reshape(self, tuple(size))


@graph_lowering("alias", "detach", "clone", "lift_fresh_copy", "lift_fresh", "resolve_conj", "resolve_neg")
def alias(self, memory_format=None):
    return self


@graph_lowering("permute")
def permute(self, dims):
    return jnp.transpose(self, tuple(_dim(d, self.ndim) for d in dims))


@graph_lowering("t")
def t(self):
    return self.T if self.ndim == 2 else self


@graph_lowering("transpose.int")
def transpose(self, dim0, dim1):
    return jnp.swapaxes(self, dim0, dim1)


@graph_lowering("expand")
def expand(self, size, implicit=False):
    lead = len(size) - self.ndim
    shape = tuple(self.shape[i - lead] if n == -1 else n for i, n in enumerate(size))
    return jnp.broadcast_to(self, shape)


@graph_lowering("slice.Tensor")
@sees_result
def slice_(self, dim=0, start=None, end=None, step=1, *, result):
    dim = _dim(dim, self.ndim)
    if is_traced(start, end):
        length = int(result.shape[dim])  # a traced bound is no shape's symbol: the length is a number
        if length == 0:
            return lax.slice_in_dim(self, 0, 0, axis=dim)
        start = normalized(0 if start is None else start, self.shape[dim])
        block = lax.dynamic_slice_in_dim(self, start, (length - 1) * step + 1, dim)
        return lax.slice_in_dim(block, 0, None, step, dim)
    index = [slice(None)] * self.ndim
    index[dim] = slice(start, end, step)
    return self[tuple(index)]


@graph_lowering("slice_scatter")
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    """``self`` with ``src`` written over ``self[..., start:end:step, ...]``: an update of that block alone."""
    dim = _dim(dim, self.ndim)
    src = src.astype(self.dtype)
    if is_traced(start, end):
        if step != 1:
            raise NotImplementedError("slice_scatter with a step at a traced position")  # traced with constants
        return lax.dynamic_update_slice_in_dim(self, src, normalized(0 if start is None else start, self.shape[dim]),
                                               dim)
    index = [slice(None)] * self.ndim
    index[dim] = slice(start, end, step)
    return self.at[tuple(index)].set(src)


@graph_lowering("select.int")
def select(self, dim, index):
    dim = _dim(dim, self.ndim)
    if is_traced(index):
        return lax.dynamic_index_in_dim(self, normalized(index, self.shape[dim]), dim, keepdims=False)
    return lax.index_in_dim(self, _dim(index, self.shape[dim]), dim, keepdims=False)


@graph_lowering("select_scatter")
def select_scatter(self, src, dim, index):
    """``self`` with ``src`` written over ``self.select(dim, index)``."""
    dim = _dim(dim, self.ndim)
    index = normalized(index, self.shape[dim]) if is_traced(index) else _dim(index, self.shape[dim])
    return lax.dynamic_update_index_in_dim(self, src.astype(self.dtype), index, dim)


@graph_lowering("squeeze", "squeeze.dim", "squeeze.dims")
def squeeze(self, dim=None):
    dims = range(self.ndim) if dim is None else [dim] if isinstance(dim, int) else dim
    return jnp.squeeze(self, tuple(d for d in (_dim(d, self.ndim) for d in dims) if self.shape[d] == 1))


@graph_lowering("unsqueeze")
def unsqueeze(self, dim):
    return jnp.expand_dims(self, _dim(dim, self.ndim + 1))


@graph_lowering("as_strided")
def as_strided(self, size, stride, storage_offset=None):
    """The view of a contiguous tensor's elements (graph values have no other storage)."""
    return strided.read(self.reshape(-1), tuple(size), tuple(stride), 0 if storage_offset is None else storage_offset)


@graph_lowering("as_strided_scatter", "prims::as_strided_scatter")
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    """``self`` with ``src`` written over ``self.as_strided(size, stride, storage_offset)``: how a graph writes
    through a view of an input (functionalized ``index_copy_`` into a paged cache's layer, for one)."""
    offset = 0 if storage_offset is None else storage_offset
    return strided.write(self.reshape(-1), src, tuple(size), tuple(stride), offset).reshape(self.shape)


@graph_lowering("view.dtype")
def view_dtype(self, dtype):
    """The same bytes as ``dtype``: the last dim grows or shrinks by the ratio of the item sizes."""
    values = storage.reinterpret(self.reshape(-1), dtypes.to_jax(dtype))
    return values.reshape(*self.shape[:-1], -1) if self.ndim else values.reshape(())


@graph_lowering("view_as_complex")
def view_as_complex(self):
    """Pairs of the last dim as (real, imaginary) parts: a graph value's storage is not shared, so the view is the
    complex values themselves."""
    return lax.complex(self[..., 0], self[..., 1])


@graph_lowering("view_as_real")
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@graph_lowering("_conj", "conj_physical")
def conj(self):
    """A graph value holds its elements, not a lazy conjugate bit: the conjugate itself."""
    return jnp.conj(self) if jnp.iscomplexobj(self) else self


@graph_lowering("_neg_view")
def neg_view(self):
    return -self


@graph_lowering("split.Tensor")
def split(self, split_size, dim=0):
    length = self.shape[_dim(dim, self.ndim)]
    sizes = [min(split_size, length - start) for start in range(0, length, split_size)] or [0]
    return split_with_sizes(self, sizes, dim)


@graph_lowering("split_with_sizes")
def split_with_sizes(self, split_sizes, dim=0):
    dim, start, pieces = _dim(dim, self.ndim), 0, []
    for size in split_sizes:
        pieces.append(lax.slice_in_dim(self, start, start + size, axis=dim))
        start += size
    return tuple(pieces)


@graph_lowering("unbind.int")
def unbind(self, dim=0):
    dim = _dim(dim, self.ndim)
    return tuple(lax.index_in_dim(self, i, dim, keepdims=False) for i in range(self.shape[dim]))


@graph_lowering("sym_size.int")
def sym_size(self, dim):
    return self.shape[dim]


# --- dtype conversion and copies ------------------------------------------------------------------


def _cast(value, dtype):
    value = jnp.asarray(value)  # a number make_fx left in a graph (a wrapped scalar a score_mod multiplies by)
    if jnp.iscomplexobj(value) and not jnp.issubdtype(dtype, jnp.complexfloating):
        value = value.real
    return value.astype(dtype)


@graph_lowering("_to_copy")
def _to_copy(self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    """A dtype conversion (the compiler rejects graphs whose values leave the device)."""
    return self if dtype is None else _cast(self, dtypes.to_jax(dtype))


@graph_lowering("prims::convert_element_type")
def convert_element_type(a, dtype):
    return _cast(a, dtypes.to_jax(dtype))


@graph_lowering("copy", "copy_")
def copy(self, src, non_blocking=False):
    return jnp.broadcast_to(_cast(src, self.dtype), self.shape)


# --- factories ------------------------------------------------------------------------------------


def _factory_dtype(dtype):
    return dtypes.to_jax(dtype or torch.get_default_dtype())


@graph_lowering("empty.memory_format")
def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """Graph values have no strides (nor physical layouts): an empty tensor is zeros of its size."""
    return jnp.zeros(tuple(size), _factory_dtype(dtype))


@graph_lowering("empty_strided", "empty_permuted")
def empty_strided(size, stride_or_layout, dtype=None, layout=None, device=None, pin_memory=None):
    return empty(size, dtype)


@graph_lowering("new_empty", "new_zeros")
def new_empty(self, size, dtype=None, layout=None, device=None, pin_memory=None):
    """``self``'s dtype unless ``dtype`` is given: zeros, as :func:`empty`."""
    return jnp.zeros(tuple(size), self.dtype if dtype is None else dtypes.to_jax(dtype))


@graph_lowering("zeros_like", "empty_like")
def zeros_like(self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return new_empty(self, self.shape, dtype)


@graph_lowering("new_empty_strided")
def new_empty_strided(self, size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return new_empty(self, size, dtype)


@graph_lowering("scalar_tensor")
def scalar_tensor(s, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s, _factory_dtype(dtype))


@graph_lowering("full_like")
def full_like(self, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(self.shape, fill_value, self.dtype if dtype is None else dtypes.to_jax(dtype))


# --- indexing -------------------------------------------------------------------------------------


@graph_lowering("index.Tensor")
def index(self, indices):
    """Advanced indexing with integer index tensors (eager mode's kernel turns masks into them first; a
    boolean mask's result shape depends on its values, which a static graph cannot hold)."""
    if any(i is not None and i.dtype in (jnp.bool_, jnp.uint8) for i in indices):
        raise NotImplementedError("tpu graph mode: aten::index.Tensor with a boolean mask (data-dependent shape)")
    return LOWERINGS["_unsafe_index.Tensor"].fn(self, indices)


@graph_lowering("index_put", "_index_put_impl")
def index_put(self, indices, values, accumulate=False, unsafe=False):
    """``self`` with ``values`` written (or added) at integer indices, or where a boolean mask that
    indexes the leading dimensions is true (a fixed-shape select: the mask's count never matters)."""
    present = [index for index in indices if index is not None]
    if len(present) == 1 and len(indices) == 1 and present[0].dtype in (jnp.bool_, jnp.uint8):
        mask = present[0].astype(jnp.bool_)
        mask = jnp.reshape(mask, mask.shape + (1,) * (self.ndim - mask.ndim))
        if values.size == 1:
            values = jnp.reshape(values, ())
            return jnp.where(mask, self + values if accumulate else values.astype(self.dtype), self)
    if any(index.dtype in (jnp.bool_, jnp.uint8) for index in present):
        raise NotImplementedError("tpu graph mode: aten::index_put with a boolean mask and several values")
    return LOWERINGS["_unsafe_index_put"].fn(self, indices, values, accumulate)


# --- ops of torch.export's graphs -----------------------------------------------------------------
# torch.export traces below autograd, where the device's own kernel of scaled_dot_product_attention is
# not reached, and records metadata checks: both survive its decompositions (see hf_tpu.export).


@graph_lowering("_assert_tensor_metadata")
def assert_tensor_metadata(a, size=None, stride=None, dtype=None, device=None, layout=None):
    """Nothing to run: the traced value has the static shape and dtype the check states."""
    return None


@graph_lowering("scaled_dot_product_attention")
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """The fused attention the device's eager kernel runs."""
    if dropout_p != 0:
        raise NotImplementedError("tpu graph mode: aten::scaled_dot_product_attention with dropout_p > 0 (random)")
    fused = LOWERINGS["_scaled_dot_product_fused_attention_overrideable"].fn
    return fused(query, key, value, attn_mask, 0.0, is_causal, False, scale)[0]
