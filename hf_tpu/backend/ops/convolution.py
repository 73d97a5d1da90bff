"""Convolutions (1-3 spatial dims, grouped, dilated, transposed) and their backward.

torch routes convolutions of backends other than CPU/CUDA to ``convolution_overrideable`` and
``convolution_backward_overrideable``; graph mode sees ``convolution`` and ``convolution_backward``, which the
same lowerings serve. The forward is one ``lax.conv_general_dilated``; a transposed
convolution is the input gradient of a regular one: the input dilated by the stride, the kernel
flipped and its in/out channels swapped per group. The backward is the JAX VJP of the forward.
float32 runs at full precision, half types accumulate in float32, as the matrix products do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..dispatch import kernel, lowering
from .linalg import _accumulator


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.issubdtype(dtype, jnp.inexact) else None


def _transposed_kernel(weight, groups):
    """(C_in, C_out/g, *k) -> (C_out, C_in/g, *k), spatially flipped: the kernel of the equivalent conv."""
    c_in, c_out_per_group = weight.shape[:2]
    spatial = weight.shape[2:]
    w = weight.reshape((groups, c_in // groups, c_out_per_group) + spatial)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * c_out_per_group, c_in // groups) + spatial)
    return jnp.flip(w, axis=tuple(range(2, w.ndim)))


def _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups):
    """The convolution without bias, in the accumulator dtype."""
    n = input.ndim - 2
    stride, padding, dilation = (tuple(v) * (n if len(v) == 1 else 1) for v in (stride, padding, dilation))
    output_padding = tuple(output_padding) * (n if len(output_padding) == 1 else 1) if output_padding else (0,) * n
    accumulator = _accumulator(input.dtype)
    if not transposed:
        return lax.conv_general_dilated(
            input, weight, window_strides=stride, padding=[(p, p) for p in padding], rhs_dilation=dilation,
            feature_group_count=groups, precision=_precision(input.dtype), preferred_element_type=accumulator,
        )
    kernel = _transposed_kernel(weight, groups)
    edges = [d * (k - 1) - p for d, k, p in zip(dilation, weight.shape[2:], padding)]
    return lax.conv_general_dilated(
        input, kernel, window_strides=(1,) * n, padding=[(e, e + o) for e, o in zip(edges, output_padding)],
        lhs_dilation=stride, rhs_dilation=dilation, feature_group_count=groups,
        precision=_precision(input.dtype), preferred_element_type=accumulator,
    )


@lowering("convolution_overrideable", "convolution_overrideable.out", "convolution")
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out.astype(input.dtype)


@kernel("convolution")
def checked_convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """Eager ``convolution`` goes through ``_convolution``, whose shape checks raise CPU's errors, to the lowering
    above; graph mode lowers ``convolution`` nodes with that lowering directly."""
    return torch.ops.aten._convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
                                       groups, False, False, True, True)


@lowering("convolution_backward_overrideable", "convolution_backward_overrideable.out")
def convolution_backward(grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups,
                         output_mask):
    accumulator = _accumulator(input.dtype)

    def forward(x, w):  # half inputs are exact in float32, so the float32 conv is the reference one
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(forward, input.astype(accumulator), weight.astype(accumulator))
    grad_input, grad_weight = vjp(grad_output.astype(accumulator))
    grad_bias = None
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_output.ndim))
        grad_bias = jnp.sum(grad_output.astype(accumulator), axis=axes).astype(grad_output.dtype)
    # Gradients in grad_output's dtype, the forward's (input and weight share it): a weight that diffusers' layerwise
    # casting re-stored in float8 with `.data` after its forward gets a float32 gradient, not one rounded to float8.
    return (
        grad_input.astype(grad_output.dtype) if output_mask[0] else None,
        grad_weight.astype(grad_output.dtype) if output_mask[1] else None,
        grad_bias,
    )


@lowering("convolution_backward", "convolution_backward.out")
def convolution_backward_of_graphs(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                                   output_padding, groups, output_mask):
    """The backward AOTAutograd graphs hold (the bias shape is the output channels, which grad_output gives)."""
    return convolution_backward(grad_output, input, weight, stride, padding, dilation, transposed, output_padding,
                                groups, output_mask)
