"""RReLU and fractional max pooling on tpu against CPU (fractional pooling given its random samples)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import check_against_cpu

torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fractional_max_pool2d(dtype):
    x, samples = torch.randn(2, 3, 11, 9).to(dtype), torch.rand(2, 3, 2, dtype=dtype)
    x[0, 0, 4, 4] = float("nan")
    check_against_cpu(lambda t, s: F.fractional_max_pool2d(t, (3, 2), output_size=(5, 4), return_indices=True,
                                                           _random_samples=s), x, samples, equal_nan=True)
    check_against_cpu(lambda t, s: F.fractional_max_pool2d(t, 2, output_size=(6, 1), _random_samples=s),
                      x[0], samples[:1], equal_nan=True)  # unbatched; one window along W


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fractional_max_pool3d(dtype):
    x, samples = torch.randn(2, 3, 7, 11, 9).to(dtype), torch.rand(2, 3, 3, dtype=dtype)
    check_against_cpu(lambda t, s: F.fractional_max_pool3d(t, (2, 3, 2), output_size=(4, 5, 4), return_indices=True,
                                                           _random_samples=s), x, samples)


def test_fractional_max_pool_draws_its_samples_on_tpu():
    out, indices = F.fractional_max_pool2d(torch.randn(1, 2, 8, 8, device="tpu"), 2, output_ratio=(0.5, 0.5),
                                           return_indices=True)
    assert out.shape == indices.shape == (1, 2, 4, 4) and out.device.type == "tpu"


def test_rrelu_eval_is_leaky_relu_at_the_mean_slope():
    check_against_cpu(lambda t: F.rrelu(t, 0.1, 0.3, training=False), torch.randn(4, 5))


def test_rrelu_training_draws_slopes_into_noise():
    x = torch.randn(64, 32, device="tpu")
    noise = torch.zeros(64, 32, device="tpu")
    out = torch.ops.aten.rrelu_with_noise(x, noise, 0.1, 0.3, True)
    x, noise, out = x.cpu(), noise.cpu(), out.cpu()
    negative = x <= 0
    assert torch.equal(noise[~negative], torch.ones_like(noise[~negative]))
    assert ((noise[negative] >= 0.1) & (noise[negative] <= 0.3)).all() and noise[negative].std() > 0.03
    torch.testing.assert_close(out, x * noise)


def test_log_normal_cauchy_geometric_samplers():
    """Distribution checks on 20000 draws (the medians and means are many standard errors apart
    from what a wrong parameterisation would give); integer tensors take geometric draws."""
    t = torch.empty(20000, device="tpu")
    assert abs(t.log_normal_(1.0, 0.5).cpu().log().mean() - 1.0) < 0.02
    assert abs(t.cauchy_(2.0, 1.0).cpu().median() - 2.0) < 0.05
    draws = t.geometric_(0.25).cpu()
    assert draws.min() >= 1 and torch.equal(draws, draws.round()) and abs(draws.mean() - 4.0) < 0.1
    assert torch.empty(5, dtype=torch.int64, device="tpu").geometric_(0.5).dtype == torch.int64
    with pytest.raises(RuntimeError, match="geometric_ expects p"):
        t.geometric_(0.0)
