"""Randomised layers: RReLU's random slopes and fractional max pooling's pseudo-random windows.

``rrelu_with_noise`` draws its slopes from the device's random stream (or ``generator``) and writes
them into ``noise``; fractional max pooling is deterministic given ``random_samples`` (one number
in [0, 1) per batch, channel and spatial dim, drawn by ``F.fractional_max_pool*d``), from which the
window starts follow as in torch's kernels.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch

from ..dispatch import kernel, lowering


def _rrelu(self, noise, lower, upper, training, generator):
    """``self`` with non-positive elements scaled by a slope: in training drawn uniformly from
    [lower, upper] per element (recorded in ``noise``, 1 elsewhere), otherwise (lower + upper) / 2."""
    if not training:
        return torch.ops.aten.leaky_relu(self, (lower + upper) / 2)
    slopes = torch.empty_like(self).uniform_(lower, upper, generator=generator)
    slopes = torch.where(self <= 0, slopes, torch.ones_like(slopes))
    noise.copy_(slopes.reshape(noise.shape))
    return self * slopes


@kernel("rrelu_with_noise")
def rrelu_with_noise(self, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    return _rrelu(self, noise, lower, upper, training, generator)


@kernel("rrelu_with_noise_")
def rrelu_with_noise_(self, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    return self.copy_(_rrelu(self, noise, lower, upper, training, generator))


@kernel("rrelu_with_noise.out")
def rrelu_with_noise_out(self, noise, lower=0.125, upper=1 / 3, training=False, generator=None, *, out):
    result = _rrelu(self, noise, lower, upper, training, generator)
    if out.shape != result.shape:
        out.resize_(result.shape)
    return out.copy_(result)


def _window_starts(sample, size, output_size, pool):
    """Start of each of ``output_size`` windows of ``pool`` over ``size``, from one sample in [0, 1)
    per plane (``sample``: (..., 1)), computed in the sample's dtype as CPU does; the last window
    ends at ``size``."""
    if output_size <= 1:
        return jnp.full(sample.shape[:-1] + (output_size,), size - pool, jnp.int64)
    alpha = jnp.asarray(size - pool, sample.dtype) / jnp.asarray(output_size - 1, sample.dtype)
    i = jnp.arange(output_size, dtype=sample.dtype)
    starts = ((i + sample) * alpha).astype(jnp.int64) - (sample * alpha).astype(jnp.int64)
    return starts.at[..., -1].set(size - pool)


def _fractional_max_pool(self, kernel_size, output_size, random_samples, name):
    """Max over windows ``kernel_size`` starting at the fractional starts; indices flat within a plane.

    ``random_samples[..., j]`` places the windows of spatial dim W, H for j = 0, 1 in 2-D pooling
    and of T, H, W for j = 0, 1, 2 in 3-D, as torch's CPU kernels read them. A NaN wins its window;
    among equal maxima the first (in row-major window order) does.
    """
    dims = len(kernel_size)
    batched = self.ndim == dims + 2
    x = self if batched else self[None]
    lead, sizes = x.shape[:2], x.shape[2:]
    for d in range(dims):
        if output_size[d] + kernel_size[d] - 1 > sizes[d]:
            raise RuntimeError(f"{name}(): pool size {kernel_size[d]} too large relative to input size {sizes[d]} "
                               f"for output size {output_size[d]} in spatial dim {d}")
    if x.size == 0 or 0 in output_size:
        shape = lead + tuple(output_size)
        empty = (jnp.zeros(shape, x.dtype), jnp.zeros(shape, jnp.int64))
        return empty if batched else (empty[0][0], empty[1][0])
    sample_of_dim = (1, 0) if dims == 2 else tuple(range(dims))
    samples = random_samples.astype(x.dtype)
    index = jnp.zeros((), jnp.int64)  # (N, C, *output_size, *kernel_size): flat positions in each plane
    for d in range(dims):
        starts = _window_starts(samples[..., sample_of_dim[d], None], sizes[d], output_size[d], kernel_size[d])
        positions = starts[..., :, None] + jnp.arange(kernel_size[d])
        shape = list(lead) + [1] * (2 * dims)
        shape[2 + d], shape[2 + dims + d] = output_size[d], kernel_size[d]
        index = index * sizes[d] + positions.reshape(shape)
    index = index.reshape(lead + tuple(output_size) + (math.prod(kernel_size),))
    values = jnp.take_along_axis(x.reshape(lead + (-1,)), index.reshape(lead + (-1,)), axis=2).reshape(index.shape)
    best = jnp.argmax(values, axis=-1)[..., None]
    output = jnp.take_along_axis(values, best, axis=-1)[..., 0]
    indices = jnp.take_along_axis(index, best, axis=-1)[..., 0]
    return (output, indices) if batched else (output[0], indices[0])


@lowering("fractional_max_pool2d", "fractional_max_pool2d.output")
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, "fractional_max_pool2d")


@lowering("fractional_max_pool3d", "fractional_max_pool3d.output")
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, "fractional_max_pool3d")
