"""Anti-aliased bilinear and bicubic interpolation on tpu against CPU, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import check_against_cpu

torch.manual_seed(0)


def resize_and_grad(x, mode, align_corners, **size):
    x = x.detach().requires_grad_(True)
    y = F.interpolate(x, mode=mode, align_corners=align_corners, antialias=True, **size)
    weights = torch.arange(y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape).sin()
    (y * weights).sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("size", [{"size": (4, 5)}, {"size": (11, 3)}, {"scale_factor": 0.4}],
                         ids=["shrink", "mixed", "scale"])
def test_antialiased_interpolation(mode, align_corners, size):
    check_against_cpu(lambda x: resize_and_grad(x, mode, align_corners, **size), torch.randn(2, 3, 10, 12),
                      atol=1e-5, rtol=1e-5)
