"""histc, histogram and histogramdd on tpu against CPU: edges, weights, density, empty and degenerate data."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import check_against_cpu

torch.manual_seed(0)
X = torch.cat([torch.randn(40) * 3, torch.tensor([math.nan, math.inf, -5.0, 5.0, 0.0])])
W = torch.rand(45)


@pytest.mark.parametrize("kwargs", [{}, {"range": (-5.0, 5.0)}, {"range": (-1.0, 2.0), "density": True}])
def test_histogram_bin_count(kwargs):
    data = X if "range" in kwargs else X[:40]  # without a range, infinities make CPU raise
    check_against_cpu(lambda x: torch.histogram(x, 7, **kwargs), data)
    check_against_cpu(lambda x, w: torch.histogram(x, 7, weight=w, **kwargs), data, W[:len(data)])


def test_histogram_bin_edges_and_degenerate_data():
    edges = torch.tensor([-3.0, -1.0, 0.0, 0.5, 4.0])
    check_against_cpu(lambda x, e, w: torch.histogram(x, e, weight=w, density=True), X, edges, W)
    check_against_cpu(lambda x: torch.histogram(x, 3), torch.full((4,), 2.0))  # one point: widened by 0.5
    check_against_cpu(lambda x: torch.histogram(x, 3), torch.zeros(0))  # no data: [0, 1]


def test_histogramdd():
    points = torch.randn(30, 2)
    check_against_cpu(lambda p: torch.histogramdd(p, [3, 4]), points)
    check_against_cpu(lambda p: torch.histogramdd(p, [3, 2], range=[-1.0, 1.0, 0.0, 2.0], density=True), points)
    check_against_cpu(lambda p, e0, e1: torch.histogramdd(p, [e0, e1]), points, torch.tensor([-2.0, 0.0, 2.0]),
                      torch.tensor([-1.0, 1.0]))
