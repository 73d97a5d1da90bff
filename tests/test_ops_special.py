"""Bessel and Airy functions on tpu against CPU over their whole real range, edges included."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import check_against_cpu

EDGES = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30]
# Oscillating and decaying ranges, both expansions of every function and the seams between them (2, 8).
X = torch.cat([torch.linspace(-40, 40, 801), torch.logspace(-8, 4, 61), -torch.logspace(-8, 2, 51),
               torch.tensor([2.0, 8.0, 25.7, 25.8, 30.0] + EDGES)])

BESSEL = ["bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_k0", "modified_bessel_k1",
          "scaled_modified_bessel_k0", "scaled_modified_bessel_k1", "airy_ai"]


@pytest.mark.parametrize("name", BESSEL)
def test_bessel_float32(name):
    fn = getattr(torch.special, name)
    x = X[X.abs() < 1e3] if name == "airy_ai" else X  # CPU's float32 Ai loses its phase for large -x
    check_against_cpu(fn, x, atol=1e-5, rtol=1.3e-5, equal_nan=True)


@pytest.mark.parametrize("name", BESSEL)
def test_bessel_float64(name):
    """CPU's own float64 kernels are only accurate to about 1e-6 near x = 5 (J, Y) and x = -2 (Ai)."""
    check_against_cpu(getattr(torch.special, name), X[X.abs() < 1e3].double(), atol=1e-5, rtol=1e-6,
                      equal_nan=True)


def test_bessel_of_integers_is_float():
    check_against_cpu(torch.special.bessel_j0, torch.arange(-3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_trigamma_near_poles(dtype):
    """polygamma(1, x) near the poles at non-positive integers, where the reflection's rounding shows."""
    x = torch.cat([torch.linspace(-10, 10, 2001), torch.tensor([-3.973021984100342, 1e-30, 1e30] + EDGES[:3])])
    check_against_cpu(lambda t: torch.polygamma(1, t), x.to(dtype), atol=1e-5, rtol=1.3e-5, equal_nan=True)
