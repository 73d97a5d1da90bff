"""Fused optimizer steps: ``_fused_adam_`` and ``_fused_adamw_``.

torch.optim's ``Adam``/``AdamW(fused=True)`` call these (the fused path accepts every PrivateUse1
device), and so does transformers' Trainer, whose default optimizer is ``adamw_torch_fused``. Each
step is composed of the ``_foreach_*`` lowerings, so every update runs as a few multi-tensor XLA
programs; bias corrections and learning rates are ScalarList arguments, so a schedule that changes
them does not recompile.
"""

from __future__ import annotations

import math

import torch

from ..dispatch import kernel


def _adam_step(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2, weight_decay, eps,
    amsgrad, maximize, grad_scale, found_inf, decoupled: bool,
) -> None:
    """One Adam(W) step in place, with the semantics of torch's fused CPU/CUDA kernels: skipped entirely
    when ``found_inf`` is set; ``grads`` are divided by ``grad_scale`` in place; ``state_steps`` were
    already incremented by the caller."""
    if not params or (found_inf is not None and found_inf.item() == 1):
        return
    lr = float(lr)
    if grad_scale is not None:
        torch._foreach_div_(grads, grad_scale)
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
    steps = torch.stack([step.reshape(()) for step in state_steps]).tolist()  # one transfer for all steps
    denominators = torch._foreach_sqrt(max_exp_avg_sqs if amsgrad else exp_avg_sqs)
    torch._foreach_div_(denominators, [math.sqrt(1 - beta2**step) for step in steps])
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denominators, [-lr / (1 - beta1**step) for step in steps])


@kernel("_fused_adam_", "_fused_adam_.tensor_lr")
def fused_adam_(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None) -> None:
    """Adam: weight decay adds ``weight_decay * param`` to the gradient."""
    _adam_step(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2, weight_decay,
               eps, amsgrad, maximize, grad_scale, found_inf, decoupled=False)


@kernel("_fused_adamw_", "_fused_adamw_.tensor_lr")
def fused_adamw_(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None) -> None:
    """AdamW: weight decay scales the parameters by ``1 - lr * weight_decay`` (decoupled)."""
    _adam_step(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2, weight_decay,
               eps, amsgrad, maximize, grad_scale, found_inf, decoupled=True)
