"""Discrete Fourier transforms: the three primitives torch.fft decomposes into.

``normalization`` is torch's ``fft_norm_mode`` for this call's direction: 0 leaves the transform
unscaled, 1 divides by ``sqrt(n)``, 2 by ``n`` (``n`` the product of the signal sizes over ``dim``).
The JAX transforms are asked for their unscaled direction and scaled here.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..dispatch import lowering


def _complex(dtype):
    return jnp.dtype("complex128") if dtype in (jnp.float64, jnp.complex128) else jnp.dtype("complex64")


def _real(dtype):
    return jnp.dtype("float64") if dtype in (jnp.float64, jnp.complex128) else jnp.dtype("float32")


def _scaled(value, normalization, n):
    if normalization == 1:
        return value / jnp.asarray(math.sqrt(n), value.real.dtype)
    if normalization == 2:
        return value / jnp.asarray(n, value.real.dtype)
    return value


def _axes(x, dim):
    return tuple(d % x.ndim for d in dim)


@lowering("_fft_c2c", "_fft_c2c.out")
def fft_c2c(self, dim, normalization, forward):
    axes = _axes(self, dim)
    x = self.astype(_complex(self.dtype))
    if not axes:
        return x
    n = math.prod(self.shape[a] for a in axes)
    result = jnp.fft.fftn(x, axes=axes) if forward else jnp.fft.ifftn(x, axes=axes, norm="forward")
    return _scaled(result, normalization, n).astype(x.dtype)


@lowering("_fft_r2c", "_fft_r2c.out")
def fft_r2c(self, dim, normalization, onesided):
    axes = _axes(self, dim)
    x = self.astype(_real(self.dtype))
    n = math.prod(self.shape[a] for a in axes)
    result = jnp.fft.rfftn(x, axes=axes) if onesided else jnp.fft.fftn(x.astype(_complex(x.dtype)), axes=axes)
    return _scaled(result, normalization, n).astype(_complex(x.dtype))


@lowering("_fft_c2r", "_fft_c2r.out")
def fft_c2r(self, dim, normalization, last_dim_size):
    axes = _axes(self, dim)
    x = self.astype(_complex(self.dtype))
    sizes = [x.shape[a] for a in axes[:-1]] + [last_dim_size]
    result = jnp.fft.irfftn(x, s=sizes, axes=axes, norm="forward")
    return _scaled(result, normalization, math.prod(sizes)).astype(_real(x.dtype))
