"""CTC loss on tpu against CPU: reductions, padded and concatenated targets, repeats, infeasible
alignments, zero_infinity, unbatched inputs, tensor lengths, and the gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import check_against_cpu

torch.manual_seed(0)
T, N, C = 12, 3, 5
LOG_PROBS = torch.randn(T, N, C).log_softmax(-1)
TARGETS = torch.randint(1, C, (N, 4))
TARGETS[0, 1] = TARGETS[0, 0]  # a repeated label needs a blank between
TARGET_LENGTHS = [4, 2, 0]


def loss_and_grad(log_probs, targets, input_lengths, target_lengths, **kwargs):
    log_probs = log_probs.detach().requires_grad_(True)
    loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, **kwargs)
    loss.sum().backward()
    return loss.detach(), log_probs.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ctc_loss(reduction):
    check_against_cpu(lambda lp, t: loss_and_grad(lp, t, [12, 10, 7], TARGET_LENGTHS, reduction=reduction),
                      LOG_PROBS, TARGETS, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss_infeasible(zero_infinity):
    """An input shorter than its target has zero likelihood: an infinite loss, or 0 with zero_infinity."""
    check_against_cpu(lambda lp, t: loss_and_grad(lp, t, [3, 10, 7], TARGET_LENGTHS, reduction="none",
                                                  zero_infinity=zero_infinity),
                      LOG_PROBS, TARGETS, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_ctc_loss_concatenated_targets_and_tensor_lengths():
    targets = torch.cat([TARGETS[0, :4], TARGETS[1, :2]])
    check_against_cpu(lambda lp, t, il, tl: loss_and_grad(lp, t, il, tl), LOG_PROBS, targets,
                      torch.tensor([12, 10, 7]), torch.tensor(TARGET_LENGTHS), atol=1e-5, rtol=1e-5)


def test_ctc_loss_unbatched():
    check_against_cpu(lambda lp, t: loss_and_grad(lp, t, [12], [4]), LOG_PROBS[:, 0], TARGETS[0], atol=1e-5,
                      rtol=1e-5)
