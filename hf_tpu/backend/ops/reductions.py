"""Reductions and scans: sum, mean, prod, min/max, arg-min/max, var/std, any/all, norms, cumsum.

Dtypes follow torch: sums and products of integers and bools give int64, ``dtype=`` casts the input
first, and half-precision inputs accumulate in float32. Each overload family has one function per
schema shape, since lowerings take their arguments in schema order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .. import dtypes
from ..dispatch import kernel, lowering
from .pointwise import _float_result, _opmath, rounded_to


def _name(dtype) -> str:
    """torch's name for a dtype in messages ("Long", "Float")."""
    return dtypes.type_name(dtypes.to_torch(dtype))


def _dims(self, dim, empty_means_all=True) -> tuple[int, ...]:
    """Normalised reduction dims; ``None`` (and, for most reductions, ``[]``) mean all dims."""
    if dim is None or (empty_means_all and isinstance(dim, (tuple, list)) and not dim):
        return tuple(range(self.ndim))
    rank = max(self.ndim, 1)
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if not -rank <= d < rank:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {d})")
    normalised = tuple(d % rank for d in dims)
    if len(set(normalised)) != len(normalised):
        raise RuntimeError(f"dim {dims} appears multiple times in the list of dims")
    return tuple(sorted(normalised)) if self.ndim else ()


def _dim(self, dim: int) -> int | None:
    """One normalised dim; ``None`` for a 0-dim tensor, whose dim 0 / -1 is the whole tensor."""
    dims = _dims(self, dim)
    return dims[0] if dims else None


def _size(self, dims) -> int:
    return math.prod(self.shape[d] for d in dims)


def _accumulated(self, dtype):
    """The input cast to the result ``dtype``, then to the dtype its math runs in."""
    math_dtype = _opmath(dtype)
    if np.dtype(self.dtype) == math_dtype != np.dtype(dtype):  # float32 in, a half type out
        return rounded_to(self, dtype)
    return self.astype(dtype).astype(math_dtype)


def _integral_to_long(self, dtype):
    """The result dtype of ``sum``, ``prod``, ``cumsum``: ``dtype``, else int64 for integers and bools."""
    if dtype is not None:
        return dtypes.to_jax(dtype)
    if jnp.issubdtype(self.dtype, jnp.inexact):
        return self.dtype
    return np.dtype(jnp.int64)


def _floating(self, dtype, name):
    out = self.dtype if dtype is None else dtypes.to_jax(dtype)
    if not jnp.issubdtype(out, jnp.inexact):
        raise RuntimeError(
            f"{name}(): could not infer output dtype. Input dtype must be either a floating point or complex dtype. "
            f"Got: {_name(out)}"
        )
    return out


def _sum(self, dims, keepdim, dtype):
    out = _integral_to_long(self, dtype)
    x = _accumulated(self, out)
    return jnp.sum(x, axis=dims, keepdims=keepdim, dtype=x.dtype).astype(out)


@lowering("sum.default", "sum.out")
def sum_all(self, dtype=None):
    return _sum(self, None, False, dtype)


@lowering("sum.dim_IntList", "sum.IntList_out")
def sum_dim(self, dim, keepdim=False, dtype=None):
    return _sum(self, _dims(self, dim), keepdim, dtype)


@lowering("nansum", "nansum.out")
def nansum(self, dim=None, keepdim=False, dtype=None):
    if jnp.issubdtype(self.dtype, jnp.inexact):
        self = jnp.where(jnp.isnan(self), jnp.zeros((), self.dtype), self)
    return _sum(self, _dims(self, dim), keepdim, dtype)


def _mean(self, dims, keepdim, dtype):
    out = _floating(self, dtype, "mean")
    x = _accumulated(self, out)
    return jnp.mean(x, axis=dims, keepdims=keepdim, dtype=x.dtype).astype(out)


@lowering("mean.default", "mean.dtype_out")
def mean_all(self, dtype=None):
    return _mean(self, None, False, dtype)


@lowering("mean.dim", "mean.out")
def mean_dim(self, dim, keepdim=False, dtype=None):
    return _mean(self, _dims(self, dim), keepdim, dtype)


def _prod(self, dims, keepdim, dtype):
    out = _integral_to_long(self, dtype)
    x = _accumulated(self, out)
    return jnp.prod(x, axis=dims, keepdims=keepdim, dtype=x.dtype).astype(out)


@lowering("prod.default", "prod.out")
def prod_all(self, dtype=None):
    return _prod(self, None, False, dtype)


@lowering("prod.dim_int", "prod.int_out")
def prod_dim(self, dim, keepdim=False, dtype=None):
    return _prod(self, _dims(self, dim), keepdim, dtype)


@lowering("trace", "trace.out")
def trace(self):
    """The sum of a matrix's diagonal, with ``sum``'s dtypes (integers give int64)."""
    if self.dtype == jnp.bool_:
        raise NotImplementedError('"trace" not implemented for \'Bool\'')
    if self.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {self.ndim}")
    return _sum(jnp.diagonal(self), (0,), False, None)


@lowering("hash_tensor", "hash_tensor.out")
def hash_tensor(self, dim=(), keepdim=False, mode=0):
    """XOR of the elements' 64-bit patterns (floats widened to float64, integers to int64), as uint64."""
    if mode != 0:
        raise RuntimeError(f"hash_tensor only supports mode=0 (xor_sum), got mode={mode}")
    wide = jnp.float64 if jnp.issubdtype(self.dtype, jnp.floating) else \
        jnp.uint64 if jnp.issubdtype(self.dtype, jnp.unsignedinteger) else jnp.int64
    bits = lax.bitcast_convert_type(self.astype(wide), jnp.uint64)
    dims = _dims(self, dim)
    hashed = lax.reduce(bits, np.uint64(0), lax.bitwise_xor, dims)
    return jnp.expand_dims(hashed, dims) if keepdim else hashed


def _extreme_dims(self, dim, name):
    """amax/amin's dims: each must be non-empty (the CPU names it as given); all of an empty tensor
    needs a dim."""
    dims = _dims(self, dim)
    if self.size == 0 and self.ndim:
        if not dim:
            _check_nonempty(self, name)
        for given, d in zip((dim,) if isinstance(dim, int) else dim, dims):
            if self.shape[d] == 0:
                raise IndexError(f"{name}(): Expected reduction dim {given} to have non-zero size.")
    return dims


@lowering("amax", "amax.out")
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=_extreme_dims(self, dim, "amax"), keepdims=keepdim)


@lowering("amin", "amin.out")
def amin(self, dim=(), keepdim=False):
    return jnp.min(self, axis=_extreme_dims(self, dim, "amin"), keepdims=keepdim)


def _check_nonempty(self, name):
    if self.size == 0:
        raise RuntimeError(
            f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )


@lowering("max", "max.unary_out")
def max_all(self):
    _check_nonempty(self, "max")
    return jnp.max(self)


@lowering("min", "min.unary_out")
def min_all(self):
    _check_nonempty(self, "min")
    return jnp.min(self)


def _nonempty_dim(self, dim, name):
    """The normalised reduction dim of max/min/argmax/argmin/aminmax, which must not be empty."""
    d = _dim(self, dim)
    if d is not None and self.shape[d] == 0:
        raise IndexError(f"{name}: Expected reduction dim {d} to have non-zero size.")
    return d


def _arg(fn, self, dim, keepdim):
    """Index of the first extreme value (NaN counting as the extreme) along ``dim``, as int64."""
    if dim is None:
        return jnp.zeros(self.shape, jnp.int64)
    values = self.astype(jnp.uint8) if self.dtype == jnp.bool_ else self
    return fn(values, axis=dim, keepdims=keepdim).astype(jnp.int64)


@lowering("max.dim", "max.dim_max")
def max_dim(self, dim, keepdim=False):
    d = _nonempty_dim(self, dim, "max()")
    return (self if d is None else jnp.max(self, axis=d, keepdims=keepdim)), _arg(jnp.argmax, self, d, keepdim)


@lowering("min.dim", "min.dim_min")
def min_dim(self, dim, keepdim=False):
    d = _nonempty_dim(self, dim, "min()")
    return (self if d is None else jnp.min(self, axis=d, keepdims=keepdim)), _arg(jnp.argmin, self, d, keepdim)


def _arg_all(fn, self, dim, keepdim):
    if self.dtype == jnp.bool_:
        raise RuntimeError(f"{fn.__name__}(): does not support bool input")
    if dim is not None:
        return _arg(fn, self, _nonempty_dim(self, dim, f"{fn.__name__}()"), keepdim)
    if self.size == 0:  # the CPU's argmax/argmin word this differently from max/min, as an IndexError
        raise IndexError(f"{fn.__name__}(): Expected reduction dim to be specified for input.numel() == 0.")
    index = _arg(fn, self.reshape(-1), 0, False)
    return index.reshape((1,) * self.ndim) if keepdim else index


@lowering("argmax", "argmax.out")
def argmax(self, dim=None, keepdim=False):
    return _arg_all(jnp.argmax, self, dim, keepdim)


@lowering("argmin", "argmin.out")
def argmin(self, dim=None, keepdim=False):
    return _arg_all(jnp.argmin, self, dim, keepdim)


@lowering("aminmax", "aminmax.out")
def aminmax(self, dim=None, keepdim=False):
    if dim is None:
        _check_nonempty(self, "aminmax")
        shape = (1,) * self.ndim if keepdim else ()
        return jnp.min(self).reshape(shape), jnp.max(self).reshape(shape)
    d = _nonempty_dim(self, dim, "aminmax")
    if d is None:
        return self, self
    return jnp.min(self, axis=d, keepdims=keepdim), jnp.max(self, axis=d, keepdims=keepdim)


def _var_mean(self, dim, correction, keepdim):
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        raise RuntimeError(f"std and var only support floating point and complex dtypes, got {_name(self.dtype)}")
    dims = _dims(self, dim)
    x = self.astype(_opmath(self.dtype))
    mean = jnp.mean(x, axis=dims, keepdims=True)
    squares = jnp.sum(jnp.square(jnp.abs(x - mean)), axis=dims, keepdims=keepdim)
    correction = 1 if correction is None else correction
    divisor = jnp.maximum(jnp.asarray(_size(self, dims), squares.dtype) - jnp.asarray(correction, squares.dtype), 0)
    mean = mean if keepdim else jnp.squeeze(mean, dims)
    return squares / divisor, mean


@lowering("var.correction", "var.correction_out")
def var(self, dim=None, correction=None, keepdim=False):
    return _var_mean(self, dim, correction, keepdim)[0].astype(self.dtype)


@lowering("std.correction", "std.correction_out")
def std(self, dim=None, correction=None, keepdim=False):
    return jnp.sqrt(_var_mean(self, dim, correction, keepdim)[0]).astype(self.dtype)


@lowering("var_mean.correction")
def var_mean(self, dim=None, correction=None, keepdim=False):
    variance, mean = _var_mean(self, dim, correction, keepdim)
    return variance.astype(self.dtype), mean.astype(self.dtype)


@lowering("std_mean.correction")
def std_mean(self, dim=None, correction=None, keepdim=False):
    variance, mean = _var_mean(self, dim, correction, keepdim)
    return jnp.sqrt(variance).astype(self.dtype), mean.astype(self.dtype)


def _truth(fn, self, dims, keepdim):
    """``any``/``all``: bool results, except uint8 in, uint8 out (as torch)."""
    result = fn(self != 0, axis=dims, keepdims=keepdim)
    return result.astype(jnp.uint8) if self.dtype == jnp.uint8 else result


@lowering("any", "any.all_out")
def any_all(self):
    return _truth(jnp.any, self, None, False)


@lowering("any.dim", "any.out", "any.dims", "any.dims_out")
def any_dim(self, dim=None, keepdim=False):
    return _truth(jnp.any, self, _dims(self, dim, empty_means_all=False), keepdim)


@lowering("all", "all.all_out")
def all_all(self):
    return _truth(jnp.all, self, None, False)


@lowering("all.dim", "all.out", "all.dims", "all.dims_out")
def all_dim(self, dim=None, keepdim=False):
    return _truth(jnp.all, self, _dims(self, dim, empty_means_all=False), keepdim)


@lowering("count_nonzero", "count_nonzero.out", "count_nonzero.dim_IntList", "count_nonzero.dim_IntList_out")
def count_nonzero(self, dim=None):
    return jnp.sum(self != 0, axis=_dims(self, dim), dtype=jnp.int64)


@lowering("linalg_vector_norm", "linalg_vector_norm.out", static=("ord",))
def vector_norm(self, ord=2, dim=None, keepdim=False, dtype=None):
    out = self.dtype if dtype is None else dtypes.to_jax(dtype)
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        raise RuntimeError(
            f"linalg.vector_norm: Expected a floating point or complex tensor as input. Got {_name(self.dtype)}"
        )
    dims = _dims(self, dim)
    x = jnp.abs(_accumulated(self, out))
    if ord == math.inf:
        result = jnp.max(x, axis=dims, keepdims=keepdim)
    elif ord == -math.inf:
        result = jnp.min(x, axis=dims, keepdims=keepdim)
    elif ord == 0:
        result = jnp.sum(x != 0, axis=dims, keepdims=keepdim, dtype=x.dtype)
    elif ord == 1:
        result = jnp.sum(x, axis=dims, keepdims=keepdim)
    elif ord == 2:
        result = jnp.sqrt(jnp.sum(x * x, axis=dims, keepdims=keepdim))
    else:
        result = jnp.sum(x**ord, axis=dims, keepdims=keepdim) ** (1.0 / ord)
    return result.astype(jnp.finfo(out).dtype)


@lowering("norm.Scalar", "norm.Scalar_out", static=("p",))
def norm(self, p=2):
    return vector_norm(self, p)


@lowering("norm.ScalarOpt_dtype", "norm.ScalarOpt_dtype_out", static=("p",))
def norm_dtype(self, p, dtype):
    return vector_norm(self, 2 if p is None else p, None, False, dtype)


@lowering("norm.ScalarOpt_dim", "norm.out", "norm.ScalarOpt_dim_dtype", "norm.dtype_out", static=("p",))
def norm_dim(self, p, dim, keepdim=False, dtype=None):
    return vector_norm(self, 2 if p is None else p, dim, keepdim, dtype)


@lowering("logsumexp", "logsumexp.out")
def logsumexp(self, dim, keepdim=False):
    """``max + log(sum(exp(x - max)))``, with infinite maxima left out of the shift, as torch."""
    out = _float_result(self)
    dims = _dims(self, dim)
    x = self.astype(_opmath(out))
    if self.size == 0:
        return jnp.log(jnp.sum(jnp.exp(x), axis=dims, keepdims=keepdim)).astype(out)
    peak = jnp.max(x, axis=dims, keepdims=True)
    peak = jnp.where(jnp.isinf(peak), jnp.zeros((), x.dtype), peak)
    result = jnp.log(jnp.sum(jnp.exp(x - peak), axis=dims, keepdims=True)) + peak
    return (result if keepdim else jnp.squeeze(result, dims)).astype(out)


def _scan(fn, self, dim, dtype):
    out = _integral_to_long(self, dtype)
    x = _accumulated(self, out)
    d = _dim(self, dim)
    return (x if d is None else fn(x, axis=d, dtype=x.dtype)).astype(out)


@lowering("cumsum", "cumsum.out", "cumsum_")
def cumsum(self, dim, dtype=None):
    return _scan(jnp.cumsum, self, dim, dtype)


@lowering("cumprod", "cumprod.out", "cumprod_")
def cumprod(self, dim, dtype=None):
    return _scan(jnp.cumprod, self, dim, dtype)


@kernel("equal")
def equal(self, other):
    """Same shape and equal elements (NaN unequal to itself); one host sync for the answer."""
    if self.shape != other.shape:
        return False
    return bool(torch.ops.aten.eq.Tensor(self, other).all().item())


# --- order statistics ---------------------------------------------------------------------------


def _nan_last_order(x, axis):
    """A stable ascending order along ``axis`` with NaN after every number (``jnp.argsort``'s order)."""
    return jnp.argsort(x, axis=axis, stable=True)


def _select(self, dim, keepdim, position):
    """Values and int64 indices of the ``position(sorted, nan_count, n)``-th order statistic along ``dim``."""
    d = _dim(self, dim)
    x = jnp.atleast_1d(self)
    axis = 0 if d is None else d
    order = _nan_last_order(x, axis)
    ordered = jnp.take_along_axis(x, order, axis=axis)
    nans = jnp.sum(jnp.isnan(x), axis=axis, keepdims=True) if jnp.issubdtype(x.dtype, jnp.inexact) else \
        jnp.zeros([1 if i == axis else n for i, n in enumerate(x.shape)], jnp.int64)
    k = position(nans.astype(jnp.int64), x.shape[axis])
    values = jnp.take_along_axis(ordered, k, axis=axis)
    indices = jnp.take_along_axis(order, k, axis=axis).astype(jnp.int64)
    if d is None:
        return values.reshape(self.shape), indices.reshape(self.shape)
    if not keepdim:
        values, indices = jnp.squeeze(values, axis), jnp.squeeze(indices, axis)
    return values, indices


def _median_position(nans, n):
    """The lower median; a row with NaN gives its first NaN (sorted after the n - nans numbers)."""
    return jnp.where(nans > 0, n - nans, (n - 1) // 2)


def _nanmedian_position(nans, n):
    return jnp.maximum((n - nans - 1) // 2, 0)


def _check_dim_nonempty(self, dim, name):
    d = _dim(self, dim)
    if d is not None and self.shape[d] == 0:
        raise IndexError(f"{name}(): Expected reduction dim {dim} to have non-zero size.")


def _select_all(self, position):
    """The element at ``position`` of all of ``self`` in order (NaN for an empty float tensor, 0 otherwise)."""
    if self.size == 0:
        return jnp.full((), jnp.nan, self.dtype) if jnp.issubdtype(self.dtype, jnp.inexact) else \
            jnp.zeros((), self.dtype)
    return _select(self.reshape(-1), 0, False, position)[0]


@lowering("median", "median.out")
def median_all(self):
    return _select_all(self, _median_position)


@lowering("median.dim", "median.dim_values")
def median_dim(self, dim, keepdim=False):
    _check_dim_nonempty(self, dim, "median")
    return _select(self, dim, keepdim, _median_position)


@lowering("nanmedian", "nanmedian.out")
def nanmedian_all(self):
    return _select_all(self, _nanmedian_position)


@lowering("nanmedian.dim", "nanmedian.dim_values")
def nanmedian_dim(self, dim, keepdim=False):
    _check_dim_nonempty(self, dim, "nanmedian")
    return _select(self, dim, keepdim, _nanmedian_position)


@lowering("kthvalue", "kthvalue.values")
def kthvalue(self, k, dim=-1, keepdim=False):
    """The k-th smallest element (1-based; NaN is larger than every number) and its index."""
    d = _dim(self, dim)
    size = self.shape[d] if d is not None else 1
    if not 1 <= k <= size:
        raise IndexError(f"kthvalue(): selected number k out of range for dimension {dim}")
    return _select(self, dim, keepdim, lambda nans, n: jnp.full_like(nans, k - 1))


@lowering("mode", "mode.values")
def mode(self, dim=-1, keepdim=False):
    """The most frequent value along ``dim`` (the smallest among equally frequent ones), and the
    last index where it occurs, as torch's CPU kernel."""
    d = _dim(self, dim)
    x = jnp.atleast_1d(self)
    axis = 0 if d is None else d
    moved = jnp.moveaxis(x, axis, -1)
    ordered = jnp.sort(moved, axis=-1)
    counts = jnp.sum(ordered[..., :, None] == ordered[..., None, :], axis=-1)
    best = jnp.argmax(counts, axis=-1)  # first in sorted order: the smallest of the most frequent
    values = jnp.take_along_axis(ordered, best[..., None], axis=-1)
    n = moved.shape[-1]
    positions = jnp.where(moved == values, jnp.arange(n, dtype=jnp.int64), -1)
    indices = jnp.max(positions, axis=-1, keepdims=True)
    values, indices = jnp.moveaxis(values, -1, axis), jnp.moveaxis(indices, -1, axis)
    if d is None:
        return values.reshape(self.shape), indices.reshape(self.shape)
    if not keepdim:
        values, indices = jnp.squeeze(values, axis), jnp.squeeze(indices, axis)
    return values, indices


# --- scans with indices -------------------------------------------------------------------------


def _cumulative_extreme(self, dim, better):
    """Running extreme and the index where it was reached; later ties and NaN win, as torch's CPU."""
    d = _dim(self, dim)
    if d is None or self.size == 0:
        return self, jnp.zeros(self.shape, jnp.int64)
    positions = lax.broadcasted_iota(jnp.int64, self.shape, d)

    def combine(left, right):
        take = better(right[0], left[0])
        if jnp.issubdtype(self.dtype, jnp.inexact):
            take = take | jnp.isnan(right[0])
        return jnp.where(take, right[0], left[0]), jnp.where(take, right[1], left[1])

    values = self.astype(jnp.uint8) if self.dtype == jnp.bool_ else self
    values, indices = lax.associative_scan(combine, (values, positions), axis=d)
    return values.astype(self.dtype), indices


@lowering("cummax", "cummax.out")
def cummax(self, dim):
    return _cumulative_extreme(self, dim, lambda a, b: a >= b)


@lowering("cummin", "cummin.out")
def cummin(self, dim):
    return _cumulative_extreme(self, dim, lambda a, b: a <= b)


@lowering("_logcumsumexp", "_logcumsumexp.out")
def logcumsumexp(self, dim):
    d = _dim(self, dim)
    out = _float_result(self)
    x = self.astype(_opmath(out))
    if d is None or self.size == 0:
        return x.astype(out)
    high, low = lax.associative_scan(_log_add_exp_pairs, (x, jnp.zeros_like(x)), axis=d)
    return (high + low).astype(out)


def _two_sum(a, b):
    """``a + b`` rounded, and its rounding error exactly (Knuth's TwoSum)."""
    total = a + b
    b_part = total - a
    return total, (a - (total - b_part)) + (b - b_part)


def _log_add_exp_pairs(a, b):
    """``log(exp(a) + exp(b))`` of values held as unevaluated sums ``high + low``.

    CPU accumulates float32 ``logcumsumexp`` in float64; carrying each running total's rounding error
    keeps the scan as accurate without 64-bit floats (which TPUs lack), so results round as CPU's do.
    """
    (a_high, a_low), (b_high, b_low) = a, b
    a_larger = a_high >= b_high
    top_high, top_low = jnp.where(a_larger, a_high, b_high), jnp.where(a_larger, a_low, b_low)
    other_high, other_low = jnp.where(a_larger, b_high, a_high), jnp.where(a_larger, b_low, a_low)
    finite = jnp.isfinite(top_high)
    gap = jnp.where(finite, (other_high - top_high) + (other_low - top_low), jnp.full((), -jnp.inf, top_high.dtype))
    total, error = _two_sum(top_high, jnp.log1p(jnp.exp(gap)))
    high, low = _two_sum(total, error + top_low)
    nan = jnp.isnan(a_high) | jnp.isnan(b_high)
    high = jnp.where(nan, jnp.full((), jnp.nan, high.dtype), jnp.where(finite, high, top_high))
    return high, jnp.where(finite & ~nan, low, jnp.zeros((), low.dtype))


_SEGMENT_REDUCERS = {"sum": jax.ops.segment_sum, "mean": jax.ops.segment_sum, "prod": jax.ops.segment_prod,
                     "max": jax.ops.segment_max, "min": jax.ops.segment_min}


@lowering("segment_reduce", "segment_reduce.out")
def segment_reduce(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """Reduces consecutive segments of ``data`` along ``axis`` given by ``lengths`` or ``offsets``.

    ``lengths``/``offsets`` may carry the leading dims of ``data`` (one segmentation per leading
    index). Empty segments give ``initial`` or the reduction's identity (NaN for mean); ``initial``
    also joins every non-empty segment.
    """
    if reduce not in _SEGMENT_REDUCERS:
        raise RuntimeError(f"reduce argument must be either sum, mean, max, min or prod, got {reduce}")
    axis %= data.ndim
    lead, rest = data.shape[:axis], data.shape[axis + 1:]
    ids, segments, total = _segment_ids(data, lengths, offsets, axis)
    flat = data.reshape((ids.shape[0],) + rest).astype(_opmath(data.dtype))
    result = _SEGMENT_REDUCERS[reduce](flat, ids, total)
    counts = _segment_counts(ids, total, len(rest))
    if initial is not None:
        start = jnp.asarray(initial, flat.dtype)
        result = {"sum": result + start, "mean": result + start, "prod": result * start,
                  "max": jnp.maximum(result, start), "min": jnp.minimum(result, start)}[reduce]
    if reduce == "mean":
        result = result / jnp.maximum(counts, 1).astype(flat.dtype)
        result = jnp.where(counts > 0, result, jnp.asarray(jnp.nan if initial is None else initial, flat.dtype))
    result = result.reshape(lead + (segments + 1,) + rest)
    return lax.slice_in_dim(result, 0, segments, axis=axis).astype(data.dtype)


def _segment_ids(data, lengths, offsets, axis):
    """Each element's segment along ``axis``, numbered across the leading dims (``segments + 1`` per
    leading index, the last for elements past the final offset); the segment count; the id count."""
    if offsets is None:
        ends = jnp.cumsum(lengths, axis=-1)
        offsets = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends], axis=-1)
    lead, size = math.prod(data.shape[:axis]), data.shape[axis]
    segments = offsets.shape[-1] - 1
    starts = offsets.reshape(-1, segments + 1)[:, 1:]
    # Element j of leading index b lies in the segment counted by the ends at or before it.
    ids = jnp.sum(starts[:, None, :] <= jnp.arange(size)[None, :, None], axis=-1)
    ids = jnp.broadcast_to(ids, (lead, size)) + jnp.arange(lead)[:, None] * (segments + 1)
    return ids.reshape(-1), segments, lead * (segments + 1)


def _segment_counts(ids, total, trailing):
    counts = jax.ops.segment_sum(jnp.ones(ids.shape, jnp.int64), ids, total)
    return counts.reshape((-1,) + (1,) * trailing)


@lowering("_segment_reduce_backward", "_segment_reduce_backward.out")
def segment_reduce_backward(grad, output, data, reduce, lengths=None, offsets=None, axis=0, initial=None):
    """CPU's gradient of ``segment_reduce``: a mean's is shared by its segment, a max's or min's by
    the elements equal to it, a product's is ``output / x`` (the others' product where ``x`` is 0)."""
    axis %= data.ndim
    rest = data.shape[axis + 1:]
    ids, segments, total = _segment_ids(data, lengths, offsets, axis)
    compute = _opmath(data.dtype)
    flat = data.reshape((ids.shape[0],) + rest).astype(compute)

    def per_element(values):  # (lead, segments, *rest) -> each element's segment's value, 0 past the end
        values = values.astype(compute).reshape((-1, segments) + rest)
        padded = jnp.concatenate([values, jnp.zeros_like(values[:, :1])], axis=1)
        return padded.reshape((total,) + rest)[ids]

    grad_each, output_each = per_element(grad), per_element(output)
    if reduce == "mean":
        result = grad_each / jnp.maximum(_segment_counts(ids, total, len(rest)), 1)[ids]
    elif reduce in ("max", "min"):
        hit = flat == output_each
        ties = jax.ops.segment_sum(hit.astype(compute), ids, total)[ids]
        result = jnp.where(hit, grad_each / jnp.where(hit, ties, 1), 0)
    elif reduce == "prod":
        zero = flat == 0
        zeros = jax.ops.segment_sum(zero.astype(jnp.int64), ids, total)[ids]
        others = jax.ops.segment_prod(jnp.where(zero, 1, flat), ids, total)[ids]
        if initial is not None:
            others = others * initial
        result = grad_each * jnp.where(zero, jnp.where(zeros == 1, others, 0), output_each / jnp.where(zero, 1, flat))
    else:
        result = grad_each
    return result.reshape(data.shape).astype(data.dtype)
