"""Margin losses: ``multilabel_margin_loss`` (forward and backward) and ``multi_margin_loss``'s backward.

``multi_margin_loss`` runs forward as torch's decomposition; torch's decomposition of
``multilabel_margin_loss_forward`` counts the classes after a row's first ``-1`` as targets (CPU stops
there), so that forward is lowered here. The backward ops are the JAX VJP of the CPU kernels' sums,
whose hinge has gradient 0 at its kink as on CPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..dispatch import lowering
from .backward import vjp


def _as_rows(x):
    """``x`` as (rows, classes); a 0-d input is one row of one class."""
    return x.reshape((-1, x.shape[-1] if x.ndim else 1))


def _reduced(losses, reduction):
    return jnp.mean(losses) if reduction == 1 else jnp.sum(losses) if reduction == 2 else losses


def _multi_margin(x, target, p, margin, weight, reduction):
    """``sum_{j != y} max(0, margin - x[y] + x[j])^p (* weight[y]) / C`` per row (CPU's kernel)."""
    rows = _as_rows(x)
    target = target.reshape(-1)
    picked = jnp.take_along_axis(rows, target[:, None], axis=1)
    z = margin - picked + rows
    hinge = jnp.where(z > 0, z if p == 1 else z * z, 0)
    if weight is not None:
        hinge = hinge * weight[target][:, None]
    hinge = jnp.where(jnp.arange(rows.shape[1]) == target[:, None], 0, hinge)
    losses = jnp.sum(hinge, axis=1) / rows.shape[1]
    return _reduced(losses.reshape(x.shape[:-1]), reduction)


@lowering("multi_margin_loss_backward", "multi_margin_loss_backward.grad_input", static=("p", "margin"))
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=1):
    return vjp(lambda x: _multi_margin(x, target, p, margin, weight, reduction), grad_output, self)


def _multilabel_targets(rows, target):
    """Which entries of each row of ``target`` are listed (before its first ``-1``), and which classes they name."""
    listed = jnp.cumprod(target >= 0, axis=1).astype(bool)
    named = jnp.zeros(rows.shape, bool).at[jnp.arange(rows.shape[0])[:, None], jnp.where(listed, target, 0)].max(
        listed)
    return listed, named


def _multilabel_margin(x, target, reduction):
    """``sum_{j in targets, k not in targets} max(0, 1 - x[j] + x[k]) / C``; a row's targets are its
    leading entries up to the first ``-1``."""
    rows = _as_rows(x)
    target = target.reshape(rows.shape)
    listed, named = _multilabel_targets(rows, target)
    picked = jnp.take_along_axis(rows, jnp.where(listed, target, 0), axis=1)
    z = 1 - picked[:, :, None] + rows[:, None, :]
    hinge = jnp.where((z > 0) & listed[:, :, None] & ~named[:, None, :], z, 0)
    losses = jnp.sum(hinge, axis=(1, 2)) / rows.shape[1]
    return _reduced(losses.reshape(x.shape[:-1]), reduction)


@lowering("multilabel_margin_loss_forward", "multilabel_margin_loss_forward.output")
def multilabel_margin_loss_forward(self, target, reduction):
    rows = _as_rows(self)
    _, named = _multilabel_targets(rows, target.reshape(rows.shape))
    return _multilabel_margin(self, target, reduction), named.reshape(target.shape).astype(self.dtype)


@lowering("multilabel_margin_loss_backward", "multilabel_margin_loss_backward.grad_input")
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    return vjp(lambda x: _multilabel_margin(x, target, reduction), grad_output, self)
