"""Connectionist temporal classification loss: ``_ctc_loss`` and its backward.

The forward pass is the alpha recursion over the blank-extended targets ``[blank, t1, blank, t2,
..., blank]`` in log space, one ``lax.scan`` step per time step for the whole batch. Lengths are
static (the ``int[]`` overloads; the ``Tensor`` overloads read them to the host first, as CPU and
CUDA do). ``log_alpha`` is ``-inf`` where CPU leaves it unwritten (past a sample's input length or
its extended target). The backward pass is CPU's: the beta recursion backwards in time, the
``alpha + beta`` of the extended positions summed (in log space, in position order) per class, and
``exp(log_probs) - exp(collected + nll - log_probs)``: the gradient with respect to the logits
when ``log_probs`` come from ``log_softmax``. Summing in CPU's order matters: the result is a
difference of nearly equal terms.
"""

from __future__ import annotations

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
    return jnp.where(total == 0, _minus_infinity(top), jnp.log(jnp.where(total == 0, 1, total)) + shift)


def _minus_infinity(like):
    """-inf in ``like``'s dtype (a bare Python float would put a float64 constant in a TPU program)."""
    return jnp.full((), -jnp.inf, like.dtype)


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


def _lattice(log_probs, targets, input_lengths, target_lengths, blank):
    """The extended targets (N, W), their log-probabilities (T, N, W), which positions exist (N, W)
    and which may be reached from two positions back (a new, non-blank class), and the lengths."""
    steps, batch = log_probs.shape[:2]
    input_lengths = np.asarray(input_lengths, np.int64)
    target_lengths = np.asarray(target_lengths, np.int64)
    width = 2 * (int(target_lengths.max()) if batch else 0) + 1
    extended = _extended_targets(targets, target_lengths, blank, width)
    emissions = jnp.take_along_axis(log_probs, jnp.broadcast_to(extended, (steps,) + extended.shape), axis=2)
    position = np.arange(width)
    valid = position < 2 * target_lengths[:, None] + 1
    skip = (position >= 2) & jnp.concatenate([jnp.zeros((batch, 2), bool), extended[:, 2:] != extended[:, :-2]], 1)
    return extended, emissions, valid, skip, input_lengths, target_lengths


def _forward(log_probs, targets, input_lengths, target_lengths, blank):
    """(negative log-likelihood (N,), log_alpha (N, T, 2 * max_target_length + 1)) for (T, N, C) log_probs."""
    steps, batch = log_probs.shape[:2]
    extended, emissions, valid, skip, input_lengths, target_lengths = _lattice(
        log_probs, targets, input_lengths, target_lengths, blank)
    width = extended.shape[1]
    position = np.arange(width)
    neg_inf = jnp.full((batch, width), -jnp.inf, log_probs.dtype)
    first = jnp.where((position <= 1) & valid, emissions[0], _minus_infinity(emissions))

    def step(previous, inputs):
        emission, t = inputs
        one_back = jnp.concatenate([neg_inf[:, :1], previous[:, :-1]], axis=1)
        two_back = jnp.where(skip, jnp.concatenate([neg_inf[:, :2], previous[:, :-2]], axis=1), neg_inf)
        current = _log_add(previous, one_back, two_back) + emission
        current = jnp.where(valid & (t < input_lengths[:, None]), current, neg_inf)
        return current, current

    if steps > 1:
        _, rest = lax.scan(step, first, (emissions[1:], jnp.arange(1, steps)))
        alphas = jnp.concatenate([first[None], rest])
    else:
        alphas = first[None]
    alphas = jnp.where(np.arange(steps)[:, None, None] < input_lengths[None, :, None], alphas, _minus_infinity(alphas))
    last = alphas[np.maximum(input_lengths - 1, 0), np.arange(batch)]  # (N, width)
    end = 2 * target_lengths
    final = last[np.arange(batch), end]
    before = jnp.where(target_lengths > 0, last[np.arange(batch), np.maximum(end - 1, 0)], _minus_infinity(last))
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


def _log_beta(emissions, valid, skip, input_lengths, target_lengths):
    """(T, N, W) beta recursion backwards from each sample's last time step, ``-inf`` elsewhere."""
    steps, batch, width = emissions.shape
    last = input_lengths - 1
    end = 2 * target_lengths
    position = np.arange(width)
    start = (position == end[:, None]) | ((position == end[:, None] - 1) & (target_lengths[:, None] > 0))
    neg_inf = jnp.full((batch, 2), -jnp.inf, emissions.dtype)
    skip_ahead = jnp.concatenate([skip[:, 2:], jnp.zeros((batch, 2), bool)], axis=1)  # s may reach s + 2

    def step(following, inputs):
        emission, t = inputs
        one_ahead = jnp.concatenate([following[:, 1:], neg_inf[:, :1]], axis=1)
        ahead = jnp.concatenate([following[:, 2:], neg_inf], axis=1)
        two_ahead = jnp.where(skip_ahead, ahead, _minus_infinity(following))
        current = _log_add(following, one_ahead, two_ahead) + emission
        current = jnp.where((t == last)[:, None], jnp.where(start, emission, _minus_infinity(emission)), current)
        current = jnp.where(valid & (t <= last)[:, None], current, _minus_infinity(current))
        return current, current

    initial = jnp.full((batch, width), -jnp.inf, emissions.dtype)
    _, betas = lax.scan(step, initial, (emissions, jnp.arange(steps)), reverse=True)
    return betas


def _collect(log_alpha_beta, extended, classes):
    """(T, N, C): per class, the log-sum of ``alpha + beta`` over the positions holding it, added one
    position at a time in increasing order as CPU does."""
    steps, batch, width = log_alpha_beta.shape
    collected = jnp.full((steps, batch, classes), -jnp.inf, log_alpha_beta.dtype)
    rows = np.arange(batch)
    for s in range(width):
        classes_at_s = extended[:, s]
        collected = collected.at[:, rows, classes_at_s].set(
            _log_add(collected[:, rows, classes_at_s], log_alpha_beta[:, :, s]))
    return collected


@lowering("_ctc_loss_backward", "_ctc_loss_backward.out")
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                      blank, zero_infinity=False):
    unbatched = log_probs.ndim == 2
    batched, targets = _batched(log_probs, targets)
    extended, emissions, valid, skip, lengths, target_lengths = _lattice(
        batched, targets, input_lengths, target_lengths, blank)
    betas = _log_beta(emissions, valid, skip, lengths, target_lengths)
    alphas = jnp.swapaxes(log_alpha[None] if unbatched else log_alpha, 0, 1)
    collected = _collect(alphas + betas, extended, batched.shape[2])
    nll = jnp.reshape(neg_log_likelihood, (1, -1, 1))
    scale = jnp.reshape(grad, (1, -1, 1))
    result = (jnp.exp(batched) - jnp.exp(collected + nll - batched)) * scale
    if zero_infinity:
        result = jnp.where(jnp.isinf(nll), 0, result)
    active = np.arange(batched.shape[0])[:, None] < lengths[None, :]  # (T, N)
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
