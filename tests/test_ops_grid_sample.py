"""3-D grid sampling on tpu against CPU: each interpolation and padding mode, both corner conventions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import check_against_cpu

torch.manual_seed(0)
VOLUME = torch.randn(2, 3, 4, 5, 6)
GRID = torch.rand(2, 3, 4, 2, 3) * 2.6 - 1.3  # reaches outside [-1, 1] on every side
GRID[0, 0, 0, 0] = torch.tensor([float("nan"), float("inf"), 0.0])


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [True, False])
def test_grid_sample_3d(mode, padding_mode, align_corners):
    check_against_cpu(lambda v, g: F.grid_sample(v, g, mode=mode, padding_mode=padding_mode,
                                                 align_corners=align_corners), VOLUME, GRID, atol=1e-5, rtol=1e-5)


def test_grid_sample_3d_bfloat16():
    grid = GRID.nan_to_num().bfloat16()
    check_against_cpu(lambda v, g: F.grid_sample(v, g, align_corners=False), VOLUME.bfloat16(), grid)
