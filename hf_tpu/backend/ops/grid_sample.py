"""Grid sampling (``grid_sampler_2d``/``grid_sampler_3d``, behind ``F.grid_sample``) and its backward.

Coordinates follow torch's kernels: ``grid[..., 0]`` indexes W, ``1`` H, ``2`` D; ``align_corners``
maps -1 and 1 to the centres (True) or the outer edges (False) of the corner pixels; padding ``zeros``
reads 0 outside, ``border`` clamps and ``reflection`` mirrors the coordinates at the borders.
Non-finite coordinates read as outside, except that border and reflection padding clamp NaN to the far
border, as CPU's clamp does. As in torch's CPU kernel, the arithmetic runs in the input's dtype
(bfloat16 too), weights and sums in CPU's order; bicubic (2-D only) reads 4 x 4 taps, padding each
tap, as CPU does. The backward ops are the VJP of these samplers.
"""

from __future__ import annotations

import functools
import itertools
import operator

import jax.numpy as jnp

from ..dispatch import lowering
from .backward import vjp

_BILINEAR, _NEAREST, _BICUBIC = range(3)
_ZEROS, _BORDER, _REFLECTION = range(3)


def _reflect(coordinate, twice_low, twice_high):
    """Mirrors ``coordinate`` into [twice_low / 2, twice_high / 2] (reflections repeat)."""
    if twice_low == twice_high:
        return jnp.zeros_like(coordinate)
    low, span = (jnp.asarray(v, coordinate.dtype) for v in (twice_low / 2, (twice_high - twice_low) / 2))
    distance = jnp.abs(coordinate - low)
    extra = jnp.fmod(distance, span)
    flips = jnp.floor(distance / span)
    return jnp.where(flips % 2 == 0, extra + low, span - extra + low)


def _clip(coordinate, size):
    """Clamps to [0, size - 1]; NaN becomes size - 1, as with CPU's ``std::min(size - 1, std::max(x, 0))``."""
    coordinate = jnp.where(coordinate < 0, 0, coordinate)
    return jnp.where(coordinate < size - 1, coordinate, size - 1)


def _unnormalize(coordinate, size, align_corners):
    """A normalised grid coordinate in [-1, 1] as a (fractional) voxel index along a dim of ``size``."""
    if align_corners:
        return (coordinate + 1) / 2 * (size - 1)
    return ((coordinate + 1) * size - 1) / 2


def _source_coordinate(coordinate, size, padding_mode, align_corners):
    """A grid coordinate as a voxel index with the padding mode applied."""
    return _padded(_unnormalize(coordinate, size, align_corners), size, padding_mode, align_corners)


def _padded(coordinate, size, padding_mode, align_corners):
    """A voxel index with ``border`` or ``reflection`` padding applied; non-finite ones read as outside."""
    if padding_mode == _BORDER:
        coordinate = _clip(coordinate, size)
    elif padding_mode == _REFLECTION:
        twice = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        coordinate = _clip(_reflect(coordinate, *twice), size)
    return jnp.where(jnp.isfinite(coordinate), coordinate, jnp.asarray(-100.0, coordinate.dtype))


def _read(flat_input, sizes, corner):
    """Values at integer voxel ``corner`` (z, y, x), each (N, P); 0 outside the volume. -> (N, C, P)."""
    inside = jnp.ones(corner[0].shape, bool)
    flat = jnp.zeros(corner[0].shape, jnp.int64)
    for index, size in zip(corner, sizes):
        inside = inside & (index >= 0) & (index < size)
        flat = flat * size + jnp.clip(index, 0, size - 1).astype(jnp.int64)
    values = jnp.take_along_axis(flat_input, flat[:, None, :], axis=2)
    return jnp.where(inside[:, None, :], values, 0)


def _check_modes(interpolation_mode, padding_mode, spatial_dims):
    if interpolation_mode == _BICUBIC and spatial_dims == 3:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    if interpolation_mode not in (_BILINEAR, _NEAREST, _BICUBIC) or padding_mode not in (_ZEROS, _BORDER, _REFLECTION):
        raise RuntimeError(f"grid_sampler(): unknown interpolation mode {interpolation_mode} or padding mode "
                           f"{padding_mode}")


_CUBIC_A = -0.75  # the cubic convolution constant of torch's bicubic kernels


def _cubic_weights(t):
    """The four cubic convolution weights of taps at distances 1 + t, t, 1 - t, 2 - t."""
    a = _CUBIC_A

    def near(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _bicubic(flat_input, sizes, points, padding_mode, align_corners):
    """CPU's 2-D bicubic sampling: 4 x 4 taps around the unpadded coordinate, padding applied per tap."""
    height, width = sizes
    x = _unnormalize(points[..., 0], width, align_corners)
    y = _unnormalize(points[..., 1], height, align_corners)
    x0, y0 = jnp.floor(x), jnp.floor(y)
    wx, wy = _cubic_weights(x - x0), _cubic_weights(y - y0)

    def tap(row, column):
        coordinates = [_padded(c, size, padding_mode, align_corners) for c, size in ((row, height), (column, width))]
        return _read(flat_input, sizes, coordinates)

    rows = []
    for i in range(4):
        taps = [tap(y0 - 1 + i, x0 - 1 + j) for j in range(4)]
        rows.append(sum((t * w[:, None, :] for t, w in zip(taps[1:], wx[1:])), taps[0] * wx[0][:, None, :]))
    return sum((r * w[:, None, :] for r, w in zip(rows[1:], wy[1:])), rows[0] * wy[0][:, None, :])


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    """Samples ``input`` (N, C, *spatial) at ``grid`` (N, *out, len(spatial))."""
    n, c = input.shape[:2]
    sizes = input.shape[2:]
    dims = len(sizes)
    out_shape = grid.shape[1:1 + dims]
    flat_input = input.reshape(n, c, -1)
    points = grid.astype(input.dtype).reshape(n, -1, dims)
    if interpolation_mode == _BICUBIC:
        return _bicubic(flat_input, sizes, points, padding_mode, align_corners).reshape((n, c) + out_shape)
    # (z,) y, x pixel coordinates, each (N, P)
    position = [_source_coordinate(points[..., dims - 1 - d], sizes[d], padding_mode, align_corners)
                for d in range(dims)]
    if interpolation_mode == _NEAREST:
        result = _read(flat_input, sizes, [jnp.round(p) for p in position])
    else:
        low = [jnp.floor(p) for p in position]
        result = jnp.zeros((n, c, points.shape[1]), input.dtype)
        for upper in itertools.product((0, 1), repeat=dims):
            corner = [lo + u for lo, u in zip(low, upper)]
            factors = [p - lo if u else lo + 1 - p for p, lo, u in zip(position, low, upper)]
            weight = functools.reduce(operator.mul, factors[::-1])  # x, y(, z): CPU's order
            result = result + _read(flat_input, sizes, corner) * weight[:, None, :]
    return result.reshape((n, c) + out_shape)


@lowering("grid_sampler_2d", "grid_sampler_2d.out", "grid_sampler_3d", "grid_sampler_3d.out")
def grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners):
    _check_modes(interpolation_mode, padding_mode, input.ndim - 2)
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


def grid_sampler_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    """Gradients of the sampled values with respect to ``input`` and ``grid`` (float32 for half precision)."""
    _check_modes(interpolation_mode, padding_mode, input.ndim - 2)
    return vjp(lambda x, g: _grid_sample(x, g, interpolation_mode, padding_mode, align_corners), grad_output,
               input, grid)


lowering("grid_sampler_2d_backward", "grid_sampler_2d_backward.out",
         "grid_sampler_3d_backward", "grid_sampler_3d_backward.out")(grid_sampler_backward)
