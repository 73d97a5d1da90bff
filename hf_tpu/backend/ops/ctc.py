"""Connectionist temporal classification loss: ``_ctc_loss`` and its backward.

The forward pass is the alpha recursion over the blank-extended targets ``[blank, t1, blank, t2,
..., blank]`` in log space, one ``lax.scan`` step per time step for the whole batch. Lengths are
static (the ``int[]`` overloads; the ``Tensor`` overloads read them to the host first, as CPU and
CUDA do). ``log_alpha`` is ``-inf`` where CPU leaves it unwritten (past a sample's input length or
its extended target). The backward pass is the gradient of the negative log-likelihood plus
``exp(log_probs)``, as CPU returns it: the gradient with respect to the logits when ``log_probs``
come from ``log_softmax``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..dispatch import kernel, lowering


def _log_add(*terms):
    """``log(sum(exp(terms)))`` as CPU sums it; ``-inf`` when every term is, with finite gradients."""
    top = terms[0]
    for term in terms[1:]:
        top = jnp.maximum(top, term)
    shift = jnp.where(jnp.isneginf(top), 0, top)
    total = sum(jnp.exp(term - shift) for term in terms)
    return jnp.where(total == 0, -jnp.inf, jnp.log(jnp.where(total == 0, 1, total)) + shift)


def _extended_targets(targets, target_lengths, blank, width):
    """(N, width) class per extended position: blanks at even positions, the targets at odd ones."""
    if targets.ndim == 1:  # concatenated targets
        offsets = np.concatenate([[0], np.cumsum(target_lengths)[:-1]]).astype(np.int64)
    else:
        offsets = np.arange(len(target_lengths), dtype=np.int64) * targets.shape[1]
    flat = targets.reshape(-1)
    label = np.arange(width) // 2
    index = np.minimum(offsets[:, None] + label, max(flat.shape[0] - 1, 0))
    labels = flat[index] if flat.shape[0] else jnp.zeros(index.shape, flat.dtype)
    return jnp.where(np.arange(width) % 2 == 0, blank, labels).astype(jnp.int64)


def _forward(log_probs, targets, input_lengths, target_lengths, blank):
    """(negative log-likelihood (N,), log_alpha (N, T, 2 * max_target_length + 1)) for (T, N, C) log_probs."""
    steps, batch = log_probs.shape[:2]
    input_lengths = np.asarray(input_lengths, np.int64)
    target_lengths = np.asarray(target_lengths, np.int64)
    width = 2 * (int(target_lengths.max()) if batch else 0) + 1
    extended = _extended_targets(targets, target_lengths, blank, width)
    emissions = jnp.take_along_axis(log_probs, jnp.broadcast_to(extended, (steps,) + extended.shape), axis=2)
    position = np.arange(width)
    valid = position < 2 * target_lengths[:, None] + 1
    skip = (position >= 2) & jnp.concatenate([jnp.zeros((batch, 2), bool), extended[:, 2:] != extended[:, :-2]], 1)
    neg_inf = jnp.full((batch, width), -jnp.inf, log_probs.dtype)
    first = jnp.where((position <= 1) & valid, emissions[0], -jnp.inf)

    def step(previous, inputs):
        emission, t = inputs
        one_back = jnp.concatenate([neg_inf[:, :1], previous[:, :-1]], axis=1)
        two_back = jnp.where(skip, jnp.concatenate([neg_inf[:, :2], previous[:, :-2]], axis=1), -jnp.inf)
        current = _log_add(previous, one_back, two_back) + emission
        current = jnp.where(valid & (t < input_lengths[:, None]), current, -jnp.inf)
        return current, current

    if steps > 1:
        _, rest = lax.scan(step, first, (emissions[1:], jnp.arange(1, steps)))
        alphas = jnp.concatenate([first[None], rest])
    else:
        alphas = first[None]
    alphas = jnp.where(np.arange(steps)[:, None, None] < input_lengths[None, :, None], alphas, -jnp.inf)
    last = alphas[np.maximum(input_lengths - 1, 0), np.arange(batch)]  # (N, width)
    end = 2 * target_lengths
    final = last[np.arange(batch), end]
    before = jnp.where(target_lengths > 0, last[np.arange(batch), np.maximum(end - 1, 0)], -jnp.inf)
    return -_log_add(final, before), jnp.swapaxes(alphas, 0, 1)


def _batched(log_probs, targets):
    """Unbatched (T, C) inputs as a batch of one."""
    if log_probs.ndim == 2:
        return log_probs[:, None], targets[None] if targets.ndim == 1 else targets
    return log_probs, targets


@lowering("_ctc_loss", "_ctc_loss.out")
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    unbatched = log_probs.ndim == 2
    log_probs, targets = _batched(log_probs, targets)
    loss, log_alpha = _forward(log_probs, targets, input_lengths, target_lengths, blank)
    return (loss[0], log_alpha[0]) if unbatched else (loss, log_alpha)


@lowering("_ctc_loss_backward", "_ctc_loss_backward.out")
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                      blank, zero_infinity=False):
    unbatched = log_probs.ndim == 2
    batched, targets = _batched(log_probs, targets)
    losses, vjp = jax.vjp(lambda lp: _forward(lp, targets, input_lengths, target_lengths, blank)[0], batched)
    scale = jnp.broadcast_to(jnp.reshape(grad, (-1,)), losses.shape)
    (d_loss,) = vjp(jnp.ones_like(losses))
    result = (jnp.exp(batched) + d_loss) * scale[None, :, None]
    # An impossible alignment (infinite loss) has gradient 0 with zero_infinity, else NaN as on CPU.
    result = jnp.where(jnp.isinf(losses)[None, :, None], 0 if zero_infinity else jnp.nan, result)
    active = np.arange(batched.shape[0])[:, None] < np.asarray(input_lengths)[None, :]  # (T, N)
    result = jnp.where(active[..., None], result, 0)
    return result[:, 0] if unbatched else result


def _lengths(lengths) -> list[int]:
    """Length tensors as the host lists the kernels take (one sync, as on CPU and CUDA)."""
    return [int(n) for n in lengths.cpu().tolist()]


@kernel("_ctc_loss.Tensor")
def ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    return torch.ops.aten._ctc_loss(log_probs, targets, _lengths(input_lengths), _lengths(target_lengths), blank,
                                    zero_infinity)


@kernel("_ctc_loss_backward.Tensor")
def ctc_loss_backward_tensor(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                             blank, zero_infinity=False):
    return torch.ops.aten._ctc_loss_backward(grad, log_probs, targets, _lengths(input_lengths),
                                             _lengths(target_lengths), neg_log_likelihood, log_alpha, blank,
                                             zero_infinity)
