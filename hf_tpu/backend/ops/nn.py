"""Neural-network ops: softmax, normalization, activations, embedding, losses, dropout.

scaled_dot_product_attention has its own fused lowering in :mod:`.attention`.

Half-precision inputs are computed in float32 and rounded once, like torch's accumulate types.
Backward ops asked (through ``output_mask``) not to compute a gradient return an empty tensor in its
place: the op table cannot return undefined tensors, and autograd ignores those outputs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from .. import checks, dtypes, storage
from ..dispatch import kernel, lowering
from . import random

_REDUCTIONS = ("none", "mean", "sum")  # at::Reduction: 0, 1, 2


def _compute_dtype(dtype):
    return jnp.dtype("float32") if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _upcast(x):
    return x.astype(_compute_dtype(x.dtype))


def _axis(dim, ndim):
    return dim % max(ndim, 1)


def _unrequested(dtype):
    return jnp.zeros((0,), dtype)


def _softmax_of(x, axis):
    shifted = x - jnp.max(x, axis=axis, keepdims=True)
    exps = jnp.exp(shifted)
    return exps / jnp.sum(exps, axis=axis, keepdims=True)


def _log_softmax_of(x, axis):
    shifted = x - jnp.max(x, axis=axis, keepdims=True)
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))


def _along_last_axis(fn, x, dim, dtype):
    """Applies ``fn(x, axis)`` in ``x``'s compute dtype; zero-dim inputs act as one-element vectors."""
    if x.size == 0:
        return x.astype(dtype)
    values = _upcast(x).reshape(x.shape or (1,))
    return fn(values, _axis(dim, x.ndim)).reshape(x.shape).astype(dtype)


@lowering("_softmax", "_softmax.out")
def softmax(self, dim, half_to_float):
    return _along_last_axis(_softmax_of, self, dim, jnp.float32 if half_to_float else self.dtype)


@lowering("_log_softmax", "_log_softmax.out")
def log_softmax(self, dim, half_to_float):
    return _along_last_axis(_log_softmax_of, self, dim, jnp.float32 if half_to_float else self.dtype)


@lowering("_safe_softmax")
def safe_softmax(self, dim, dtype=None):
    """Softmax whose fully masked rows (all ``-inf``) are zeros instead of NaN."""
    dtype = self.dtype if dtype is None else dtypes.to_jax(dtype)
    values = self.astype(dtype)
    result = _along_last_axis(_softmax_of, values, dim, dtype)
    masked = jnp.all(values == -jnp.inf, axis=_axis(dim, self.ndim) if self.ndim else None, keepdims=True)
    return jnp.where(masked, jnp.zeros((), dtype), result)


@lowering("_softmax_backward_data", "_softmax_backward_data.out")
def softmax_backward(grad_output, output, dim, input_dtype):
    grad, out = _upcast(grad_output), _upcast(output)
    axis = _axis(dim, output.ndim) if output.ndim else None
    grad_input = out * (grad - jnp.sum(grad * out, axis=axis, keepdims=True))
    return grad_input.astype(dtypes.to_jax(input_dtype))


@lowering("_log_softmax_backward_data", "_log_softmax_backward_data.out")
def log_softmax_backward(grad_output, output, dim, input_dtype):
    grad, out = _upcast(grad_output), _upcast(output)
    axis = _axis(dim, output.ndim) if output.ndim else None
    grad_input = grad - jnp.exp(out) * jnp.sum(grad, axis=axis, keepdims=True)
    return grad_input.astype(dtypes.to_jax(input_dtype))


def _normalized_axes(x, normalized_shape):
    return tuple(range(x.ndim - len(normalized_shape), x.ndim))


@lowering("native_layer_norm")
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    """Returns (output, mean, rstd); the statistics are float32 for half inputs, as on CUDA."""
    axes = _normalized_axes(input, normalized_shape)
    x = _upcast(input)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True) + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight.astype(x.dtype)
    if bias is not None:
        out = out + bias.astype(x.dtype)
    return out.astype(input.dtype), mean, rstd


@lowering("native_layer_norm_backward")
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes = _normalized_axes(input, normalized_shape)
    batch_axes = tuple(range(input.ndim - len(normalized_shape)))
    x, grad = _upcast(input), _upcast(grad_out)
    normalized = (x - mean) * rstd
    grad_normalized = grad if weight is None else grad * weight.astype(x.dtype)
    if output_mask[0]:
        grad_input = rstd * (
            grad_normalized
            - jnp.mean(grad_normalized, axis=axes, keepdims=True)
            - normalized * jnp.mean(grad_normalized * normalized, axis=axes, keepdims=True)
        )
        grad_input = grad_input.astype(input.dtype)
    else:
        grad_input = _unrequested(input.dtype)
    grad_weight = grad_bias = _unrequested(input.dtype)
    if output_mask[1] and weight is not None:
        grad_weight = jnp.sum(grad * normalized, axis=batch_axes).astype(weight.dtype)
    if output_mask[2] and bias is not None:
        grad_bias = jnp.sum(grad, axis=batch_axes).astype(bias.dtype)
    return grad_input, grad_weight, grad_bias


def _group_norm(input, weight, bias, groups, eps):
    """(output in the compute dtype, mean, rstd), statistics shaped (N, groups), over each group's channels
    and all positions."""
    n, channels = input.shape[:2]
    x = _upcast(input).reshape(n, groups, -1)
    mean = jnp.mean(x, axis=-1)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x - mean[..., None]), axis=-1) + eps)
    out = ((x - mean[..., None]) * rstd[..., None]).reshape(input.shape)
    shape = (1, channels) + (1,) * (input.ndim - 2)
    if weight is not None:
        out = out * weight.astype(out.dtype).reshape(shape)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape(shape)
    return out, mean, rstd


def _group_norm_stats_dtype(input, weight):
    """As the CPU kernel: the statistics take the parameters' dtype (float32 for half inputs with float32 weights)."""
    return input.dtype if weight is None else weight.dtype


@lowering("native_group_norm", "native_group_norm.out")
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    """Returns (output, mean, rstd) with the statistics shaped (N, group), computed in float32 for half inputs."""
    out, mean, rstd = _group_norm(input, weight, bias, group, eps)
    stats = _group_norm_stats_dtype(input, weight)
    return out.astype(input.dtype), mean.astype(stats), rstd.astype(stats)


@lowering("native_group_norm_backward", "native_group_norm_backward.out")
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    """Gradients of input, weight and bias from the saved statistics, in float32 for half inputs."""
    x = _upcast(input)
    channels = input.shape[1]
    w = jnp.ones((channels,), x.dtype) if weight is None else weight.astype(x.dtype)
    flat = (x.reshape(x.shape[0], group, -1) - mean.astype(x.dtype)[..., None]) * rstd.astype(x.dtype)[..., None]
    normalized = flat.reshape(x.shape)
    grad = _upcast(grad_out)
    spatial = (0,) + tuple(range(2, x.ndim))
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        shape = (1, channels) + (1,) * (x.ndim - 2)
        grad_normalized = (grad * w.reshape(shape)).reshape(x.shape[0], group, -1)
        grad_input = rstd.astype(x.dtype)[..., None] * (
            grad_normalized - jnp.mean(grad_normalized, axis=-1, keepdims=True)
            - flat * jnp.mean(grad_normalized * flat, axis=-1, keepdims=True))
        grad_input = grad_input.reshape(x.shape).astype(input.dtype)
    param_dtype = input.dtype if weight is None else weight.dtype
    if output_mask[1]:
        grad_weight = jnp.sum(grad * normalized, axis=spatial).astype(param_dtype)
    if output_mask[2]:
        grad_bias = jnp.sum(grad, axis=spatial).astype(param_dtype)
    return grad_input, grad_weight, grad_bias


_SQRT_HALF = 1 / math.sqrt(2)
_TANH_SCALE = math.sqrt(2 / math.pi)
_TANH_CUBIC = 0.044715


def _check_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise RuntimeError("approximate argument must be either none or tanh.")


@lowering("gelu", "gelu_", "gelu.out")
def gelu(self, approximate="none"):
    _check_approximate(approximate)
    x = _upcast(self)
    if approximate == "tanh":
        out = 0.5 * x * (1 + jnp.tanh(_TANH_SCALE * (x + _TANH_CUBIC * x * x * x)))
    else:
        out = 0.5 * x * (1 + jax.lax.erf(x * _SQRT_HALF))
    return out.astype(self.dtype)


@lowering("gelu_backward", "gelu_backward.grad_input")
def gelu_backward(grad_output, self, approximate="none"):
    _check_approximate(approximate)
    x, grad = _upcast(self), _upcast(grad_output)
    if approximate == "tanh":
        tanh = jnp.tanh(_TANH_SCALE * (x + _TANH_CUBIC * x * x * x))
        inner_derivative = _TANH_SCALE * (1 + 3 * _TANH_CUBIC * x * x)
        derivative = 0.5 * (1 + tanh) + 0.5 * x * (1 - tanh * tanh) * inner_derivative
    else:
        cdf = 0.5 * (1 + jax.lax.erf(x * _SQRT_HALF))
        pdf = jnp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        derivative = cdf + x * pdf
    return (grad * derivative).astype(grad_output.dtype)


@lowering("silu", "silu_", "silu.out")
def silu(self):
    x = _upcast(self)
    return (x * jax.nn.sigmoid(x)).astype(self.dtype)


@lowering("silu_backward.grad_input")
def silu_backward(grad_output, self):
    x, grad = _upcast(self), _upcast(grad_output)
    sigmoid = jax.nn.sigmoid(x)
    return (grad * sigmoid * (1 + x * (1 - sigmoid))).astype(grad_output.dtype)


# glu = a * sigmoid(b) with (a, b) the halves of x along dim. glu and glu_backward run as torch's
# decompositions, but their forward-AD formulas (jvp, jacfwd, hessian, forward_ad dual tensors) call
# these two ops, which have none.
@lowering("glu_jvp", "glu_jvp.out")
def glu_jvp(glu, x, dx, dim):
    """The tangent of glu: sigmoid(b) * da + glu * (1 - sigmoid(b)) * db."""
    axis = _axis(dim, x.ndim)
    (_, b), (da, db) = jnp.split(_upcast(x), 2, axis), jnp.split(_upcast(dx), 2, axis)
    sig_b = jax.nn.sigmoid(b)
    return (sig_b * da + _upcast(glu) * (1 - sig_b) * db).astype(glu.dtype)


@lowering("glu_backward_jvp", "glu_backward_jvp.out")
def glu_backward_jvp(grad_x, grad_glu, x, dgrad_glu, dx, dim):
    """The tangent of glu_backward's result (grad_x_a = grad_glu * s, grad_x_b = grad_x_a * a * (1 - s), with
    s = sigmoid(b)) given the tangents of grad_glu and x, as ATen's glu_backward_jvp computes it."""
    axis = _axis(dim, x.ndim)
    (a, b), (da, db) = jnp.split(_upcast(x), 2, axis), jnp.split(_upcast(dx), 2, axis)
    grad_x_a = jnp.split(_upcast(grad_x), 2, axis)[0]
    sig_b = jax.nn.sigmoid(b)
    glu = a * sig_b
    db_neg_sig_b = db - db * sig_b
    dgrad_x_a = _upcast(dgrad_glu) * sig_b + grad_x_a * db_neg_sig_b
    dgrad_x_b = dgrad_x_a * (a - glu) + grad_x_a * (da - da * sig_b - glu * db_neg_sig_b)
    return jnp.concatenate([dgrad_x_a, dgrad_x_b], axis).astype(grad_x.dtype)


@lowering("embedding", "embedding.out")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    checks.indices_in_range(indices, weight.shape[0], IndexError, "index out of range in self", negative=False)
    return jnp.take(weight, indices, axis=0, mode="clip")


@lowering("_embedding_bag", "_embedding_bag.out", "_embedding_bag_forward_only", "_embedding_bag_forward_only.out")
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False, per_sample_weights=None,
                  include_last_offset=False, padding_idx=-1):
    """Sums (mode 0), means (1) or maxes (2) of ``weight`` rows per bag; bag ``b`` starts at ``offsets[b]``
    (with ``include_last_offset`` the last bag still runs to the end of ``indices``, as on CPU).

    Returns the bags, each index's bag, each bag's size (``padding_idx`` rows left out) and, for max,
    the weight row each maximum came from (the bag sizes otherwise).
    """
    bags = offsets.shape[0] - int(include_last_offset)
    positions = jnp.arange(indices.shape[0])
    offset2bag = jnp.searchsorted(offsets[:bags], positions, side="right").astype(jnp.int64) - 1
    keep = indices != padding_idx
    segment = jnp.where(keep, offset2bag, bags)
    rows = jnp.take(weight, indices, axis=0, mode="clip")
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    bag_size = jax.ops.segment_sum(keep.astype(jnp.int64), segment, bags)
    if mode == 2:
        maxima = jax.ops.segment_max(rows, segment, bags)
        output = jnp.where(bag_size[:, None] > 0, maxima, jnp.zeros((), weight.dtype))
        found = rows == output[jnp.minimum(segment, bags - 1)]
        first = jax.ops.segment_min(jnp.where(found, positions[:, None], indices.shape[0]), segment, bags)
        max_indices = jnp.where(bag_size[:, None] > 0, indices[jnp.minimum(first, indices.shape[0] - 1)], 0)
        return output, offset2bag, bag_size, max_indices.astype(jnp.int64)
    output = jax.ops.segment_sum(_upcast(rows), segment, bags)
    if mode == 1:
        output = output / jnp.maximum(bag_size, 1)[:, None].astype(output.dtype)
    return output.astype(weight.dtype), offset2bag, bag_size, bag_size


@lowering("embedding_dense_backward", "embedding_dense_backward.out")
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat = indices.reshape(-1)
    rows = _upcast(grad_output).reshape(flat.shape[0], -1)
    if padding_idx >= 0:
        rows = jnp.where((flat == padding_idx)[:, None], jnp.zeros((), rows.dtype), rows)
    grad = jnp.zeros((num_weights, rows.shape[1]), rows.dtype).at[flat].add(rows, mode="drop")
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), rows.dtype).at[flat].add(jnp.ones((), rows.dtype), mode="drop")
        grad = grad / jnp.maximum(counts, 1)[:, None]
    return grad.astype(grad_output.dtype)


@lowering("embedding_renorm_", "embedding_renorm", "embedding_renorm.out")
def embedding_renorm(self, indices, max_norm, norm_type):
    """Rescales the looked-up rows whose ``norm_type``-norm exceeds ``max_norm`` (``F.embedding(max_norm=)``)."""
    rows = indices.reshape(-1)
    selected = _upcast(self[rows])
    norms = jnp.sum(jnp.abs(selected) ** norm_type, axis=1) ** (1 / norm_type)
    scale = jnp.where(norms > max_norm, max_norm / (norms + 1e-7), jnp.ones((), selected.dtype))
    return self.at[rows].set((selected * scale[:, None]).astype(self.dtype))


def _nll_parts(self, target, weight, ignore_index):
    """Per-element losses and weights, class dimension 1 (0 for an unbatched input)."""
    class_axis = 0 if self.ndim == 1 else 1
    kept = target != ignore_index
    if target.size:
        bad = kept & ((target < 0) | (target >= self.shape[class_axis]))
        checks.require(~jnp.any(bad), IndexError, "Target {} is out of bounds.", target.reshape(-1)[jnp.argmax(bad)])
    safe_target = jnp.where(kept, target, 0)
    picked = jnp.take_along_axis(self, jnp.expand_dims(safe_target, class_axis), axis=class_axis)
    picked = jnp.squeeze(picked, class_axis)
    if weight is None:
        weights = jnp.ones(target.shape, self.dtype)
    else:
        weights = jnp.take(weight.astype(self.dtype), safe_target, mode="clip")
    weights = jnp.where(kept, weights, jnp.zeros((), self.dtype))
    return -picked * weights, weights, safe_target, class_axis


@lowering("nll_loss_forward", "nll_loss_forward.output", "nll_loss2d_forward", "nll_loss2d_forward.output")
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    """Returns (loss, total_weight); ``total_weight`` is the sum of the weights of counted targets."""
    losses, weights, _, _ = _nll_parts(self, target, weight, ignore_index)
    total_weight = jnp.sum(_upcast(weights)).astype(self.dtype)
    if _REDUCTIONS[reduction] == "none":
        return losses, jnp.zeros((), self.dtype)
    total = jnp.sum(_upcast(losses))
    if _REDUCTIONS[reduction] == "mean":
        total = total / total_weight.astype(total.dtype)
    return total.astype(self.dtype), total_weight


@lowering("nll_loss_backward", "nll_loss_backward.grad_input", "nll_loss2d_backward", "nll_loss2d_backward.grad_input")
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    _, weights, safe_target, class_axis = _nll_parts(self, target, weight, ignore_index)
    scale = grad_output if _REDUCTIONS[reduction] == "none" else grad_output.reshape(())
    if _REDUCTIONS[reduction] == "mean":
        scale = scale / total_weight
    values = -weights * scale.astype(self.dtype)
    classes = jax.lax.broadcasted_iota(target.dtype, self.shape, class_axis)
    hit = classes == jnp.expand_dims(safe_target, class_axis)
    return jnp.where(hit, jnp.expand_dims(values, class_axis), jnp.zeros((), self.dtype))


def _reduce_loss(losses, reduction, dtype):
    if _REDUCTIONS[reduction] == "none":
        return losses.astype(dtype)
    total = jnp.sum(losses)
    return (total / losses.size if _REDUCTIONS[reduction] == "mean" else total).astype(dtype)


@lowering("mse_loss", "mse_loss.out")
def mse_loss(self, target, reduction=1):
    dtype = dtypes.result_type(self, target)
    difference = _upcast(self.astype(dtype)) - _upcast(target.astype(dtype))
    return _reduce_loss(difference * difference, reduction, dtype)


@lowering("mse_loss_backward", "mse_loss_backward.grad_input")
def mse_loss_backward(grad_output, self, target, reduction):
    dtype = dtypes.result_type(self, target)
    scale = 2 / self.size if _REDUCTIONS[reduction] == "mean" else 2
    difference = _upcast(self.astype(dtype)) - _upcast(target.astype(dtype))
    grad = jnp.broadcast_to(scale * difference * _upcast(grad_output), jnp.broadcast_shapes(self.shape, target.shape))
    return grad.astype(dtype)


@lowering("native_dropout_backward", "native_dropout_backward.out")
def native_dropout_backward(grad_output, mask, scale):
    return (grad_output * mask.astype(grad_output.dtype) * scale).astype(grad_output.dtype)


@jax.jit
def _dropout(parts, input, keep):
    x = _upcast(input)
    keep = jnp.asarray(keep, x.dtype)
    mask = jax.random.bernoulli(random.key(parts), keep, input.shape)
    scale = jnp.where(keep == 0, jnp.zeros((), x.dtype), 1 / keep)
    return (x * mask.astype(x.dtype) * scale).astype(input.dtype), mask


@kernel("native_dropout")
def native_dropout(input, p, train):
    """Returns (output, keep mask); ``train=False`` passes the input through."""
    if train is False:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    index, parts = random.key_parts_beside(input)
    out, mask = _dropout(parts, storage.read(input), 1.0 - p)
    return storage.wrap(out, input.dtype, index), storage.wrap(mask, torch.bool, index)


# --- batch normalization ------------------------------------------------------------------------
# Kernels rather than lowerings: the CPU kernels update running_mean/running_var in place even where
# the schema does not mark them as written (native_batch_norm).


import functools  # noqa: E402


@functools.partial(jax.jit, static_argnums=(5, 6, 7, 8))
def _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, stats_dtype):
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    values = _upcast(x)
    compute = values.dtype
    if training:
        mean = jnp.mean(values, axis=axes)
        variance = jnp.mean(jnp.square(values - mean.reshape(shape)), axis=axes)
        invstd = jax.lax.rsqrt(variance + eps)
        count = x.size // x.shape[1]
        new_mean = new_var = None
        if running_mean is not None:
            new_mean = ((1 - momentum) * running_mean.astype(compute) + momentum * mean).astype(running_mean.dtype)
        if running_var is not None:
            unbiased = variance * count / max(count - 1, 1)
            new_var = ((1 - momentum) * running_var.astype(compute) + momentum * unbiased).astype(running_var.dtype)
    else:
        mean, invstd = running_mean.astype(compute), jax.lax.rsqrt(running_var.astype(compute) + eps)
        new_mean = new_var = None
    out = (values - mean.reshape(shape)) * invstd.reshape(shape)
    if weight is not None:
        out = out * weight.astype(compute).reshape(shape)
    if bias is not None:
        out = out + bias.astype(compute).reshape(shape)
    if training:
        saved = mean.astype(stats_dtype), invstd.astype(stats_dtype)
    else:
        saved = jnp.zeros((0,), stats_dtype), jnp.zeros((0,), stats_dtype)
    return out.astype(x.dtype), saved[0], saved[1], new_mean, new_var


def _read(tensor):
    return None if tensor is None else storage.read(tensor)


def _run_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, stats_dtype):
    index = storage.buffer_of(input).device_index
    out, mean, invstd, new_mean, new_var = _batch_norm(
        storage.read(input), _read(weight), _read(bias), _read(running_mean), _read(running_var), bool(training),
        float(momentum), float(eps), dtypes.to_jax(stats_dtype))
    if new_mean is not None:
        storage.write(running_mean, new_mean)
    if new_var is not None:
        storage.write(running_var, new_var)
    return (storage.wrap(out, input.dtype, index), storage.wrap(mean, stats_dtype, index),
            storage.wrap(invstd, stats_dtype, index))


def _stats_dtype(input, weight, running_mean):
    """As the CPU kernels: the parameters' dtype (float32 statistics for half inputs with float32 parameters)."""
    for tensor in (weight, running_mean):
        if tensor is not None:
            return tensor.dtype
    return input.dtype


@kernel("native_batch_norm")
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _run_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps,
                           _stats_dtype(input, weight, running_mean))


@kernel("_native_batch_norm_legit")
def native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _run_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps,
                           _stats_dtype(input, weight, running_mean))


@kernel("_native_batch_norm_legit.no_stats")
def native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    return _run_batch_norm(input, weight, bias, None, None, True, momentum, eps, _stats_dtype(input, weight, None))


@kernel("_native_batch_norm_legit_no_training")
def native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return _run_batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps,
                           _stats_dtype(input, None, running_mean))


@lowering("native_batch_norm_backward", "native_batch_norm_backward.out")
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                               output_mask):
    axes = (0,) + tuple(range(2, input.ndim))
    shape = (1, -1) + (1,) * (input.ndim - 2)
    x, grad = _upcast(input), _upcast(grad_out)
    compute = x.dtype
    if train:
        mean, invstd = save_mean.astype(compute), save_invstd.astype(compute)
    else:
        mean, invstd = running_mean.astype(compute), jax.lax.rsqrt(running_var.astype(compute) + eps)
    w = jnp.ones(input.shape[1], compute) if weight is None else weight.astype(compute)
    normalized = (x - mean.reshape(shape)) * invstd.reshape(shape)
    grad_sum = jnp.sum(grad, axis=axes)
    dot = jnp.sum(grad * normalized, axis=axes)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if train:
            count = input.size // input.shape[1]
            grad_input = (grad - (grad_sum / count).reshape(shape) - normalized * (dot / count).reshape(shape)) * \
                (invstd * w).reshape(shape)
        else:
            grad_input = grad * (invstd * w).reshape(shape)
        grad_input = grad_input.astype(input.dtype)
    param_dtype = input.dtype if weight is None else weight.dtype
    if output_mask[1]:
        grad_weight = dot.astype(param_dtype)
    if output_mask[2]:
        grad_bias = grad_sum.astype(param_dtype)
    return grad_input, grad_weight, grad_bias


@kernel("_batch_norm_with_update")
def batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    """Training-mode batch norm that updates the running statistics; the reserve is empty (no cuDNN)."""
    out, mean, invstd = _run_batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps,
                                        _stats_dtype(input, weight, running_mean))
    return out, mean, invstd, torch.empty((0,), dtype=torch.uint8, device=input.device)
