"""3-D grid sampling (``grid_sampler_3d``, behind ``F.grid_sample`` on 5-D inputs).

The 2-D sampler runs as torch's decomposition. Coordinates follow torch's kernels: ``grid[..., 0]``
indexes W, ``1`` H, ``2`` D; ``align_corners`` maps -1 and 1 to the centres (True) or the outer
edges (False) of the corner voxels; padding ``zeros`` reads 0 outside, ``border`` clamps and
``reflection`` mirrors the coordinates at the borders. Non-finite coordinates read as outside,
except that border and reflection padding clamp NaN to the far border, as CPU's clamp does. As in
torch's CPU kernel, the arithmetic runs in the input's dtype (bfloat16 too), weights and sums in
CPU's order.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp

from ..dispatch import lowering

_BILINEAR, _NEAREST, _BICUBIC = range(3)
_ZEROS, _BORDER, _REFLECTION = range(3)


def _reflect(coordinate, twice_low, twice_high):
    """Mirrors ``coordinate`` into [twice_low / 2, twice_high / 2] (reflections repeat)."""
    if twice_low == twice_high:
        return jnp.zeros_like(coordinate)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    distance = jnp.abs(coordinate - low)
    extra = jnp.fmod(distance, span)
    flips = jnp.floor(distance / span)
    return jnp.where(flips % 2 == 0, extra + low, span - extra + low)


def _clip(coordinate, size):
    """Clamps to [0, size - 1]; NaN becomes size - 1, as with CPU's ``std::min(size - 1, std::max(x, 0))``."""
    coordinate = jnp.where(coordinate < 0, 0, coordinate)
    return jnp.where(coordinate < size - 1, coordinate, size - 1)


def _source_coordinate(coordinate, size, padding_mode, align_corners):
    """A normalised grid coordinate in [-1, 1] as a (fractional) voxel index along a dim of ``size``."""
    if align_corners:
        coordinate = (coordinate + 1) / 2 * (size - 1)
    else:
        coordinate = ((coordinate + 1) * size - 1) / 2
    if padding_mode == _BORDER:
        coordinate = _clip(coordinate, size)
    elif padding_mode == _REFLECTION:
        twice = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        coordinate = _clip(_reflect(coordinate, *twice), size)
    return jnp.where(jnp.isfinite(coordinate), coordinate, -100.0)


def _read(flat_input, sizes, corner):
    """Values at integer voxel ``corner`` (z, y, x), each (N, P); 0 outside the volume. -> (N, C, P)."""
    inside = jnp.ones(corner[0].shape, bool)
    flat = jnp.zeros(corner[0].shape, jnp.int64)
    for index, size in zip(corner, sizes):
        inside = inside & (index >= 0) & (index < size)
        flat = flat * size + jnp.clip(index, 0, size - 1).astype(jnp.int64)
    values = jnp.take_along_axis(flat_input, flat[:, None, :], axis=2)
    return jnp.where(inside[:, None, :], values, 0)


@lowering("grid_sampler_3d", "grid_sampler_3d.out")
def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    if interpolation_mode == _BICUBIC:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    if interpolation_mode not in (_BILINEAR, _NEAREST) or padding_mode not in (_ZEROS, _BORDER, _REFLECTION):
        raise RuntimeError(f"grid_sampler(): unknown interpolation mode {interpolation_mode} or padding mode "
                           f"{padding_mode}")
    n, c = input.shape[:2]
    sizes = input.shape[2:]
    out_shape = grid.shape[1:4]
    flat_input = input.reshape(n, c, -1)
    points = grid.astype(input.dtype).reshape(n, -1, 3)
    # (z, y, x) voxel coordinates, each (N, P)
    position = [_source_coordinate(points[..., 2 - d], sizes[d], padding_mode, align_corners) for d in range(3)]
    if interpolation_mode == _NEAREST:
        result = _read(flat_input, sizes, [jnp.round(p) for p in position])
    else:
        low = [jnp.floor(p) for p in position]
        result = jnp.zeros((n, c, points.shape[1]), input.dtype)
        for upper in itertools.product((0, 1), repeat=3):
            corner = [lo + u for lo, u in zip(low, upper)]
            factors = [p - lo if u else lo + 1 - p for p, lo, u in zip(position, low, upper)]
            weight = factors[2] * factors[1] * factors[0]  # x, y, z: CPU's order
            result = result + _read(flat_input, sizes, corner) * weight[:, None, :]
    return result.reshape((n, c) + out_shape)
