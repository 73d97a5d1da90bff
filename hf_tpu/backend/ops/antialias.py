"""Anti-aliased bilinear and bicubic resizing (``interpolate(..., antialias=True)``) and their backward.

As in torch's CPU kernel (and PIL), each output pixel of a dim is a normalised weighted sum of
the input pixels within ``support`` of its centre, the filter stretched by the scale when
shrinking: a triangle for bilinear, Keys' cubic (a = -0.5) for bicubic. The weights depend only
on the sizes and scales, so they are built on the host as one (out, in) matrix per dim; the
resize is then two matrix products, width first, each pass rounded to the input's dtype as CPU's
intermediate buffer is. A dim whose size does not change is left alone.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..dispatch import lowering
from .pointwise import _opmath


def _triangle(x):
    return np.where(x < 1, 1 - x, 0)


def _keys_cubic(x, a=-0.5):
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0))


_FILTERS = {"bilinear": (_triangle, 2), "bicubic": (_keys_cubic, 4)}


def _weights(mode, in_size, out_size, align_corners, scale):
    """The (out_size, in_size) float32 resampling matrix of one dim, as CPU computes it in float32."""
    fn, taps = _FILTERS[mode]
    if align_corners:
        step = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    else:
        step = 1.0 / scale if scale is not None and scale > 0 else in_size / out_size
    step = np.float32(step)
    support = np.float32(taps / 2 * step if step >= 1 else taps / 2)
    inverse = np.float32(1 / step) if step >= 1 else np.float32(1)
    matrix = np.zeros((out_size, in_size), np.float32)
    for i in range(out_size):
        center = np.float32(step * np.float32(i + 0.5))
        start = max(int(center - support + np.float32(0.5)), 0)
        stop = min(int(center + support + np.float32(0.5)), in_size)
        offsets = np.arange(start, stop, dtype=np.float32)
        w = fn(np.abs((offsets - center + np.float32(0.5)) * inverse)).astype(np.float32)
        total = np.float32(w.sum(dtype=np.float32))
        matrix[i, start:stop] = w / total if total != 0 else w
    return matrix


def _resize(x, mode, sizes, align_corners, scales):
    """Resamples the last two dims of ``x`` to ``sizes``, width first."""
    compute = _opmath(x.dtype)
    for axis, size, scale in ((3, sizes[1], scales[1]), (2, sizes[0], scales[0])):
        if x.shape[axis] == size:
            continue
        matrix = jnp.asarray(_weights(mode, x.shape[axis], size, align_corners, scale), compute)
        x = jnp.moveaxis(jnp.tensordot(x.astype(compute), matrix, axes=([axis], [1]),
                                       precision=lax.Precision.HIGHEST), -1, axis).astype(x.dtype)
    return x


def _resize_backward(grad, mode, input_size, align_corners, scales):
    """The adjoint of :func:`_resize`: the transposed matrices, height first."""
    compute = _opmath(grad.dtype)
    for axis, size, scale in ((2, input_size[2], scales[0]), (3, input_size[3], scales[1])):
        if grad.shape[axis] == size:
            continue
        matrix = jnp.asarray(_weights(mode, size, grad.shape[axis], align_corners, scale), compute)
        grad = jnp.moveaxis(jnp.tensordot(grad.astype(compute), matrix, axes=([axis], [0]),
                                          precision=lax.Precision.HIGHEST), -1, axis).astype(grad.dtype)
    return grad


def _register(mode):
    def forward(self, output_size, align_corners, scales_h=None, scales_w=None):
        return _resize(self, mode, output_size, align_corners, (scales_h, scales_w))

    def backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
        return _resize_backward(grad_output, mode, input_size, align_corners, (scales_h, scales_w))

    name = f"_upsample_{mode}2d_aa"
    lowering(name, f"{name}.out")(forward)
    lowering(f"{name}_backward", f"{name}_backward.grad_input")(backward)


_register("bilinear")
_register("bicubic")
