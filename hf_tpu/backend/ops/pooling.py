"""Pooling: average (fixed and adaptive windows), max (fixed and adaptive), and max-pool backward; upsampling.

Windows are static (they depend only on shapes), so averages are one ``lax.reduce_window`` sum
divided by a constant count array, and adaptive pools are products with constant averaging
matrices (average) or masked maxima along one dim at a time (max). Backward ops are the JAX VJP of
the forward, or, for max pooling, a scatter-add of the gradient at the saved indices.
Upsampling (nearest, nearest-exact, linear in 1-3 dims) is separable: per spatial dim a gather at constant
source indices (and, for linear, a blend of two gathers with constant weights), the indices and weights
computed at trace time with the float arithmetic of torch's CPU kernels.
Half-precision inputs are computed in float32 and rounded once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..dispatch import lowering
from .backward import vjp
from .linalg import _accumulator


def _expand(values, n):
    values = tuple(values)
    return values * n if len(values) == 1 else values


def _pool_geometry(size, k, s, p, ceil_mode):
    """Output length of one pooled dim, as torch's ``pooling_output_shape``."""
    span = size + 2 * p - k
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, n):
    kernel = _expand(kernel_size, n)
    stride = _expand(stride, n) if stride else kernel
    padding = _expand(padding, n)
    spatial = x.shape[-n:]
    outs = [_pool_geometry(h, k, s, p, ceil_mode) for h, k, s, p in zip(spatial, kernel, stride, padding)]
    compute = _accumulator(x.dtype)
    lead = x.ndim - n
    pads = [(0, 0)] * lead + [(p, max((o - 1) * s + k - h - p, 0)) for h, k, s, p, o in
                              zip(spatial, kernel, stride, padding, outs)]
    windows = (1,) * lead + kernel
    strides = (1,) * lead + stride
    # A NumPy zero (a constant, not a traced value) makes this JAX's differentiable window sum.
    total = lax.reduce_window(x.astype(compute), np.zeros((), compute), lax.add, windows, strides, pads)
    total = total[(Ellipsis,) + tuple(slice(0, o) for o in outs)]
    if divisor_override:
        return (total / divisor_override).astype(x.dtype)
    counts = np.ones((), np.float64)
    for h, k, s, p, o in zip(spatial, kernel, stride, padding, outs):
        start = np.arange(o) * s - p
        low, high = (-p, h + p) if count_include_pad else (0, h)
        count = np.minimum(start + k, high) - np.maximum(start, low)
        if count_include_pad:  # windows running into the ceil-mode margin count only up to h + p
            count = np.minimum(start + k, h + p) - start
        counts = np.multiply.outer(counts, count)
    return (total / jnp.asarray(counts, compute)).astype(x.dtype)


@lowering("avg_pool2d", "avg_pool2d.out")
def avg_pool2d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, kernel_size, stride, _listed(padding), ceil_mode, count_include_pad, divisor_override, 2)


@lowering("avg_pool3d", "avg_pool3d.out")
def avg_pool3d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, kernel_size, stride, _listed(padding), ceil_mode, count_include_pad, divisor_override, 3)


def _listed(value):
    return (value,) if isinstance(value, int) else value


def _avg_pool_backward(n):
    def backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
        return vjp(lambda x: _avg_pool(x, kernel_size, stride, _listed(padding), ceil_mode, count_include_pad,
                                       divisor_override, n), grad_output, self)

    return backward


lowering("avg_pool2d_backward", "avg_pool2d_backward.grad_input")(_avg_pool_backward(2))
lowering("avg_pool3d_backward", "avg_pool3d_backward.grad_input")(_avg_pool_backward(3))


def _adaptive_bounds(size, out):
    starts = [(i * size) // out for i in range(out)]
    ends = [-(-((i + 1) * size) // out) for i in range(out)]
    return starts, ends


def _adaptive_avg(x, output_size):
    n = len(output_size)
    compute = _accumulator(x.dtype)
    y = x.astype(compute)
    for axis_from_end, out in zip(range(n, 0, -1), output_size):
        axis = x.ndim - axis_from_end
        size = x.shape[axis]
        starts, ends = _adaptive_bounds(size, out)
        matrix = np.zeros((out, size))
        for i, (a, b) in enumerate(zip(starts, ends)):
            matrix[i, a:b] = 1.0 / (b - a)
        y = jnp.moveaxis(jnp.tensordot(y, jnp.asarray(matrix, compute), axes=([axis], [1]),
                                       precision=lax.Precision.HIGHEST), -1, axis)
    return y.astype(x.dtype)


@lowering("_adaptive_avg_pool3d", "_adaptive_avg_pool3d.out")
def adaptive_avg_pool3d(self, output_size):
    return _adaptive_avg(self, tuple(output_size))


def _adaptive_avg_pool_backward(n):
    def backward(grad_output, self):
        return vjp(lambda x: _adaptive_avg(x, grad_output.shape[-n:]), grad_output, self)

    return backward


# The 2-d one is also behind interpolate(mode="area").
lowering("_adaptive_avg_pool2d_backward", "_adaptive_avg_pool2d_backward.out")(_adaptive_avg_pool_backward(2))
lowering("_adaptive_avg_pool3d_backward", "_adaptive_avg_pool3d_backward.out",
         "adaptive_avg_pool3d_backward.grad_input")(_adaptive_avg_pool_backward(3))


def _adaptive_max(x, output_size):
    """Separable masked maxima; indices are flat positions in each input plane (first maximum)."""
    n = len(output_size)
    spatial = x.shape[-n:]
    lead = x.ndim - n
    values = x
    index = jnp.zeros(x.shape, jnp.int64)  # flat offset accumulated so far
    low = -jnp.inf if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.iinfo(x.dtype).min
    for d, out in enumerate(output_size):
        axis = lead + d
        size = spatial[d]
        starts, ends = _adaptive_bounds(size, out)
        positions = np.arange(size)
        mask = (positions[None, :] >= np.array(starts)[:, None]) & (positions[None, :] < np.array(ends)[:, None])
        moved = jnp.moveaxis(values, axis, -1)[..., None, :]  # (..., 1, size)
        moved_index = jnp.moveaxis(index, axis, -1)[..., None, :]
        masked = jnp.where(mask, moved, jnp.asarray(low, x.dtype))
        if jnp.issubdtype(x.dtype, jnp.inexact):  # NaN is the maximum, as on CPU
            masked = jnp.where(mask & jnp.isnan(moved), jnp.asarray(jnp.inf, x.dtype), masked)
        best = jnp.argmax(masked, axis=-1)
        picked = jnp.take_along_axis(moved + jnp.zeros(masked.shape, x.dtype), best[..., None], axis=-1)[..., 0]
        stride = math.prod(spatial[d + 1:])
        offsets = jnp.take_along_axis(moved_index + jnp.zeros(masked.shape, jnp.int64), best[..., None],
                                      axis=-1)[..., 0] + best.astype(jnp.int64) * stride
        values, index = jnp.moveaxis(picked, -1, axis), jnp.moveaxis(offsets, -1, axis)
    return values, index


def _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, n):
    """Max over each window of the last ``n`` dims and its flat position in the input plane, as CPU picks it:
    the first maximum, or, where the window holds NaN, the last NaN. Windows are one gather at constant
    positions (the padding never wins)."""
    kernel = _expand(kernel_size, n)
    stride = _expand(stride, n) if stride else kernel
    padding, dilation = _expand(padding, n), _expand(dilation, n)
    spatial = x.shape[-n:]
    outs = [_pool_geometry(h, d * (k - 1) + 1, s, p, ceil_mode)
            for h, k, s, p, d in zip(spatial, kernel, stride, padding, dilation)]
    positions, inside = np.zeros((), np.int64), np.ones((), bool)  # over (out_1..out_n, window_1..window_n)
    for i, (h, k, s, p, d, o) in enumerate(zip(spatial, kernel, stride, padding, dilation, outs)):
        along = np.arange(o)[:, None] * s - p + np.arange(k)[None, :] * d  # this dim's positions (out, window)
        shape = [1] * (2 * n)
        shape[i], shape[n + i] = o, k
        along = along.reshape(shape)
        positions = positions + along * math.prod(spatial[i + 1:])
        inside = inside & (along >= 0) & (along < h)
    positions = positions.reshape(tuple(outs) + (-1,))
    inside = inside.reshape(positions.shape)
    lead = x.shape[:-n]
    windows = jnp.take(x.reshape(lead + (-1,)), np.where(inside, positions, 0), axis=-1)
    floating = jnp.issubdtype(x.dtype, jnp.inexact)
    lowest = -jnp.inf if floating else jnp.iinfo(x.dtype).min
    windows = jnp.where(inside, windows, jnp.asarray(lowest, x.dtype))
    if floating:
        nans = jnp.isnan(windows)
        first_max = jnp.argmax(jnp.where(nans, jnp.asarray(lowest, x.dtype), windows), axis=-1)
        last_nan = windows.shape[-1] - 1 - jnp.argmax(nans[..., ::-1], axis=-1)
        choice = jnp.where(nans.any(axis=-1), last_nan, first_max)
    else:
        choice = jnp.argmax(windows, axis=-1)
    values = jnp.take_along_axis(windows, choice[..., None], axis=-1)[..., 0]
    indices = jnp.take_along_axis(jnp.broadcast_to(positions, windows.shape), choice[..., None], axis=-1)[..., 0]
    return values, indices.astype(jnp.int64)


@lowering("max_pool2d_with_indices", "max_pool2d_with_indices.out")
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 2)


@lowering("max_pool3d_with_indices", "max_pool3d_with_indices.out")
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 3)


@lowering("adaptive_max_pool2d", "adaptive_max_pool2d.out")
def adaptive_max_pool2d(self, output_size):
    return _adaptive_max(self, tuple(output_size))


@lowering("adaptive_max_pool3d", "adaptive_max_pool3d.out")
def adaptive_max_pool3d(self, output_size):
    return _adaptive_max(self, tuple(output_size))


def _scatter_plane_gradient(grad_output, self, indices, n):
    """Adds each output gradient at its saved flat input index, per (batch, channel) plane."""
    plane = math.prod(self.shape[-n:])
    lead = self.shape[:-n]
    grad = grad_output.astype(_accumulator(self.dtype)).reshape(lead + (-1,))
    flat = indices.reshape(lead + (-1,))
    result = jnp.zeros(lead + (plane,), grad.dtype)
    rows = grad.reshape(-1, grad.shape[-1])
    result = jax.vmap(lambda r, i, g: r.at[i].add(g, mode="drop"))(
        result.reshape(-1, plane), flat.reshape(-1, flat.shape[-1]), rows)
    return result.reshape(self.shape).astype(self.dtype)


@lowering("max_pool2d_with_indices_backward", "max_pool2d_with_indices_backward.grad_input")
def max_pool2d_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_plane_gradient(grad_output, self, indices, 2)


@lowering("max_pool3d_with_indices_backward", "max_pool3d_with_indices_backward.grad_input")
def max_pool3d_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_plane_gradient(grad_output, self, indices, 3)


@lowering("fractional_max_pool2d_backward", "fractional_max_pool2d_backward.grad_input")
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return _scatter_plane_gradient(grad_output, self, indices, 2)


@lowering("fractional_max_pool3d_backward", "fractional_max_pool3d_backward.grad_input")
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return _scatter_plane_gradient(grad_output, self, indices, 3)


@lowering("adaptive_max_pool2d_backward", "adaptive_max_pool2d_backward.grad_input")
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _scatter_plane_gradient(grad_output, self, indices, 2)


@lowering("adaptive_max_pool3d_backward", "adaptive_max_pool3d_backward.grad_input")
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _scatter_plane_gradient(grad_output, self, indices, 3)


def _source_scale(in_size, out_size, align_corners, scale, dtype):
    """Source pixels per output pixel (torch's ``area_pixel_compute_scale``), in the kernels' float type."""
    if align_corners:
        return dtype((in_size - 1) / (out_size - 1)) if out_size > 1 else dtype(0)
    return dtype(1.0 / scale) if scale is not None and scale > 0 else dtype(in_size / out_size)


def _nearest_indices(in_size, out_size, scale, exact):
    ratio = _source_scale(in_size, out_size, False, scale, np.float32)
    destination = np.arange(out_size, dtype=np.float32)
    source = np.floor((destination + np.float32(0.5)) * ratio if exact else destination * ratio)
    return np.minimum(source.astype(np.int64), in_size - 1)


def _linear_taps(in_size, out_size, align_corners, scale, dtype):
    """(first index, second index, weight of the second) per output position along one dim."""
    if in_size == out_size:
        identity = np.arange(out_size)
        return identity, identity, np.zeros(out_size, dtype)
    ratio = _source_scale(in_size, out_size, align_corners, scale, dtype)
    destination = np.arange(out_size, dtype=dtype)
    if align_corners:
        source = destination * ratio
    else:
        source = np.maximum((destination + dtype(0.5)) * ratio - dtype(0.5), dtype(0))
    first = np.minimum(source.astype(np.int64), in_size - 1)
    weight = np.clip(source - first.astype(dtype), 0, 1).astype(dtype)
    return first, np.minimum(first + 1, in_size - 1), weight


def _upsample_nearest(x, output_size, scales, exact):
    for i, (size, scale) in enumerate(zip(output_size, scales)):
        x = jnp.take(x, _nearest_indices(x.shape[2 + i], size, scale, exact), axis=2 + i)
    return x


def _upsample_linear(x, output_size, align_corners, scales):
    values = x.astype(_accumulator(x.dtype))
    weights_dtype = np.float64 if values.dtype == jnp.float64 else np.float32
    for i, (size, scale) in enumerate(zip(output_size, scales)):
        axis = 2 + i
        first, second, weight = _linear_taps(values.shape[axis], size, align_corners, scale, weights_dtype)
        weight = jnp.asarray(weight, values.dtype).reshape((-1,) + (1,) * (values.ndim - axis - 1))
        values = jnp.take(values, first, axis=axis) * (1 - weight) + jnp.take(values, second, axis=axis) * weight
    return values.astype(x.dtype)


def _backward_of(forward, grad_output, input_size):
    _, pullback = jax.vjp(forward, jnp.zeros(tuple(input_size), grad_output.dtype))
    return pullback(grad_output)[0]


def _nearest(exact):
    def upsample(self, output_size, *scales):
        return _upsample_nearest(self, output_size, scales, exact)

    def backward(grad_output, output_size, input_size, *scales):
        return _backward_of(lambda x: _upsample_nearest(x, output_size, scales, exact), grad_output, input_size)

    return upsample, backward


def _linear():
    def upsample(self, output_size, align_corners, *scales):
        return _upsample_linear(self, output_size, align_corners, scales)

    def backward(grad_output, output_size, input_size, align_corners, *scales):
        return _backward_of(lambda x: _upsample_linear(x, output_size, align_corners, scales), grad_output, input_size)

    return upsample, backward


for _name, (_forward, _backward) in {
    "upsample_nearest{}d": _nearest(False), "_upsample_nearest_exact{}d": _nearest(True),
}.items():
    for _n in (1, 2, 3):
        lowering(_name.format(_n), _name.format(_n) + ".out")(_forward)
        lowering(_name.format(_n) + "_backward", _name.format(_n) + "_backward.grad_input")(_backward)

for _name in ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d"):
    _forward, _backward = _linear()
    lowering(_name, _name + ".out")(_forward)
    lowering(_name + "_backward", _name + "_backward.grad_input")(_backward)
