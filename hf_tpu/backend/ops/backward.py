"""Backward ops whose forward torch decomposes (padding, bicubic upsampling) or that CPU computes by
its own formula (shrinkage, logit, distances, embedding bags), and :func:`vjp`, which the backward
ops written as the VJP of a forward lowering share.

Linear backward ops are the JAX VJP (:func:`vjp`) of a forward written here as gathers or constant
matrices: JAX transposes those exactly, and nothing in them needs linearizing. Pointwise backward
ops follow CPU's formula, including its values at the kinks (``|x| == lambd``) and at zero distance.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..dispatch import lowering
from ..positions import is_traced, normalized
from .linalg import _accumulator


def vjp(forward, cotangent, *primals):
    """The gradient of ``forward`` at ``primals`` along ``cotangent``, computed in float32 for half
    precision (as CPU's kernels accumulate) and returned in each primal's dtype: one array for one
    primal, a tuple for several."""
    compute = _accumulator(primals[0].dtype)
    _, pullback = jax.vjp(forward, *(p.astype(compute) for p in primals))
    grads = tuple(g.astype(p.dtype) for g, p in zip(pullback(cotangent.astype(compute)), primals))
    return grads[0] if len(primals) == 1 else grads


# --- padding -------------------------------------------------------------------------------------


def _source_index(size: int, before: int, after: int, mode: str) -> np.ndarray:
    """For each position of a padded dim, the input position it copies (negative pads crop)."""
    position = np.arange(size + before + after) - before
    if mode == "replicate":
        return np.clip(position, 0, size - 1)
    period = 2 * (size - 1)
    position = np.abs(position) % period if period else np.zeros_like(position)
    return np.where(position > size - 1, period - position, position)


def _pad(x, padding, mode):
    """``reflection_padNd`` / ``replication_padNd``: ``padding`` pairs start from the last dim."""
    n = len(padding) // 2
    for i in range(n):
        axis = x.ndim - 1 - i
        x = jnp.take(x, _source_index(x.shape[axis], padding[2 * i], padding[2 * i + 1], mode), axis=axis)
    return x


def _pad_backward(mode):
    def backward(grad_output, self, padding):
        return vjp(lambda x: _pad(x, tuple(padding), mode), grad_output, self)

    return backward


for _n in (1, 2, 3):
    for _op, _mode in (("reflection", "reflect"), ("replication", "replicate")):
        lowering(f"{_op}_pad{_n}d_backward", f"{_op}_pad{_n}d_backward.grad_input")(_pad_backward(_mode))


@lowering("slice_backward", "slice_backward.out")
def slice_backward(grad_output, input_sizes, dim, start, end, step):
    """The gradient of ``input[start:end:step]`` along ``dim`` (``input`` of ``input_sizes``): ``grad_output`` at the
    positions the slice took, zeros between and around them: one padding, where torch's composite makes zeros and
    copies into a view of them (two ops; the copy a scatter here)."""
    dim %= len(input_sizes)
    if is_traced(start, end) and step == 1:  # graph mode, at a position the program takes as an argument
        zeros = jnp.zeros(input_sizes, grad_output.dtype)
        return lax.dynamic_update_slice_in_dim(zeros, grad_output, normalized(start, input_sizes[dim]), dim)
    first, stop, step = slice(start, end, step).indices(input_sizes[dim])
    taken = len(range(first, stop, step))
    if taken == 0:
        return jnp.zeros(input_sizes, grad_output.dtype)
    config = [(0, 0, 0)] * len(input_sizes)
    config[dim] = (first, input_sizes[dim] - first - (taken - 1) * step - 1, step - 1)
    return lax.pad(grad_output, jnp.zeros((), grad_output.dtype), config)


# --- upsampling ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _bicubic_matrix(size: int, out: int, align_corners: bool, scale) -> np.ndarray:
    """The (out, size) matrix of CPU's bicubic interpolation along one dim, read off CPU's own kernel
    applied to the unit vectors (the interpolation is separable and its weights sum to one)."""
    basis = torch.eye(size, dtype=torch.float64).reshape(size, 1, size, 1)
    resized = torch.ops.aten.upsample_bicubic2d(basis, [out, 1], align_corners, scale, None)
    return resized[:, 0, :, 0].T.numpy()


@lowering("upsample_bicubic2d_backward", "upsample_bicubic2d_backward.grad_input")
def upsample_bicubic2d_backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    compute = _accumulator(grad_output.dtype)
    rows = _bicubic_matrix(input_size[2], output_size[0], align_corners, scales_h).astype(compute)
    columns = _bicubic_matrix(input_size[3], output_size[1], align_corners, scales_w).astype(compute)
    grad = jnp.einsum("ncij,ia,jb->ncab", grad_output.astype(compute), rows, columns,
                      precision=lax.Precision.HIGHEST)
    return grad.astype(grad_output.dtype)


# --- pointwise -----------------------------------------------------------------------------------


@lowering("softshrink_backward", "softshrink_backward.grad_input", "hardshrink_backward",
          "hardshrink_backward.grad_input")
def shrink_backward(grad_output, self, lambd):
    """Both shrinkages pass the gradient where ``|x| > lambd`` and stop it elsewhere (the kink included)."""
    return jnp.where(jnp.abs(self) <= lambd, jnp.zeros((), grad_output.dtype), grad_output)


@lowering("logit_backward", "logit_backward.grad_input")
def logit_backward(grad_output, self, eps=None):
    """``grad / (x (1 - x))``; outside ``[eps, 1 - eps]`` zero, or without ``eps`` NaN outside [0, 1]."""
    compute = _accumulator(self.dtype)
    x, grad = self.astype(compute), grad_output.astype(compute)
    result = grad / (x * (1 - x))
    if eps is None:
        nan, inf = (jnp.full((), v, compute) for v in (jnp.nan, jnp.inf))
        result = jnp.where((x < 0) | (x > 1), nan, jnp.where((x == 0) | (x == 1), grad * inf, result))
    else:
        low, high = (jnp.asarray(v, compute) for v in (eps, 1 - eps))
        result = jnp.where((x < low) | (x > high), 0, result)
    return result.astype(self.dtype)


# --- distances -----------------------------------------------------------------------------------


def _p_norm_grad(diff, dist, p):
    """d dist / d diff for ``dist = ||diff||_p`` along the last dim, zero where ``dist`` is zero (CPU's rule)."""
    dist = dist[..., None]
    safe = jnp.where(dist == 0, 1, dist)
    if p == 0:
        grad = jnp.zeros_like(diff)
    elif p == 1:
        grad = jnp.sign(diff)
    elif p == math.inf:
        grad = jnp.sign(diff) * (jnp.abs(diff) == dist)
    elif p == 2:
        grad = diff / safe
    else:
        grad = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1)
    return jnp.where(dist == 0, 0, grad)


@lowering("_cdist_backward", "_cdist_backward.out")
def cdist_backward(grad, x1, x2, p, cdist):
    """The gradient of ``cdist(x1, x2, p)`` with respect to ``x1`` (autograd swaps the operands for ``x2``)."""
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    return jnp.sum(grad[..., None] * _p_norm_grad(diff, cdist, p), axis=-2).astype(x1.dtype)


@lowering("_pdist_backward", "_pdist_backward.out")
def pdist_backward(grad, self, p, pdist):
    first, second = np.triu_indices(self.shape[0], 1)
    pair = grad[:, None] * _p_norm_grad(self[first] - self[second], pdist, p)
    return jnp.zeros_like(self).at[first].add(pair).at[second].add(-pair)


# --- embedding bags ------------------------------------------------------------------------------


@lowering("_embedding_bag_dense_backward", "_embedding_bag_dense_backward.out")
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights=None, padding_idx=-1):
    """The weight gradient of ``_embedding_bag`` (sum 0, mean 1, max 2), from its forward's outputs."""
    result = jnp.zeros((num_weights, grad.shape[1]), _accumulator(grad.dtype))
    if mode == 2:
        columns = jnp.broadcast_to(jnp.arange(grad.shape[1]), grad.shape)
        contribution = jnp.where(bag_size[:, None] > 0, grad, 0).astype(result.dtype)
        return result.at[maximum_indices, columns].add(contribution).astype(grad.dtype)
    contribution = grad[offset2bag].astype(result.dtype)
    if per_sample_weights is not None:
        contribution = contribution * per_sample_weights[:, None].astype(result.dtype)
    if mode == 1:
        contribution = contribution / jnp.maximum(bag_size[offset2bag], 1)[:, None].astype(result.dtype)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), result.dtype).at[indices].add(1)
        contribution = contribution / counts[indices][:, None]
    contribution = jnp.where((indices != padding_idx)[:, None], contribution, 0)
    return result.at[indices].add(contribution).astype(grad.dtype)


@lowering("_embedding_bag_backward")
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights=None, padding_idx=-1):
    if sparse:
        raise NotImplementedError("embedding_bag(sparse=True): sparse gradients are not supported on tpu; "
                                  "use sparse=False")
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                        scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@lowering("_embedding_bag_per_sample_weights_backward", "_embedding_bag_per_sample_weights_backward.out")
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    """``grad[bag] . weight[index]`` per index (sum mode only, as on CPU); zero for ``padding_idx``."""
    if mode != 0:
        raise RuntimeError("embedding_bag_backward: per_sample_weights only supported for mode='sum'")
    compute = _accumulator(grad.dtype)
    products = jnp.sum(grad[offset2bag].astype(compute) * weight[indices].astype(compute), axis=1)
    return jnp.where(indices != padding_idx, products, 0).astype(grad.dtype)
