"""Histograms: histc, histogram and histogramdd (the ops behind ``torch.histogramdd``).

Bin ``i`` of a dimension holds ``edges[i] <= x < edges[i + 1]``, the last bin also its right edge;
values outside the outer edges (and NaN) are not counted. Given bin counts, the edges are
``linspace(leftmost, rightmost, bins + 1)`` in the input's dtype over ``range`` or else the data's
range ([0, 1] without data), widened by 0.5 on each side when it is a single point, as on CPU.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from .. import dtypes
from ..dispatch import lowering
from .factories import linspace


@lowering("histc", "histc.out", static=("min", "max"))
def histc(self, bins=100, min=0, max=0):
    """Counts of ``self`` in ``bins`` equal bins over [min, max]; min == max means the data's range.

    Bin positions are computed in ``self``'s dtype, as CPU does; integers with whole-number bounds
    (MoE routers count expert ids so) in exact integer arithmetic, which equals the CPU's float64
    result and needs no float64, which TPU chips lack; other integers in float64, as on the CPU.
    """
    if self.size == 0:
        return jnp.zeros((bins,), self.dtype)
    x = self.reshape(-1)
    exact = not jnp.issubdtype(x.dtype, jnp.inexact) and float(min).is_integer() and float(max).is_integer()
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.int64 if exact else jnp.float64)
    if min == max:
        lo, hi = jnp.min(x), jnp.max(x)
        same = lo == hi
        lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    else:
        lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    inside = (x >= lo) & (x <= hi)
    if exact:
        position = (jnp.where(inside, x - lo, 0) * bins) // (hi - lo)
    else:
        position = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int64)
    slots = jnp.where(inside, jnp.minimum(position, bins - 1), bins)
    return jnp.zeros((bins,), self.dtype).at[slots].add(jnp.ones((), self.dtype), mode="drop")


def _points(self):
    """``self`` as (points, dims): histogramdd's last dim indexes the dimensions."""
    return self.reshape(-1, self.shape[-1]) if self.ndim else self.reshape(1, 1)


def _edges_from_counts(points, bins, range):
    """The bin edges of each dimension for ``bins`` equal bins (see the module docstring)."""
    edges = []
    for d, count in enumerate(bins):
        if count <= 0:
            raise RuntimeError(f"torch.histogramdd(): bins must be > 0, but got {count} for dimension {d}")
        if range is not None:
            lo, hi = (jnp.asarray(v, points.dtype) for v in range[2 * d: 2 * d + 2])
        elif points.shape[0]:
            lo, hi = jnp.min(points[:, d]), jnp.max(points[:, d])
        else:  # no data: [0, 1], as numpy
            lo, hi = jnp.zeros((), points.dtype), jnp.ones((), points.dtype)
        same = lo == hi
        lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
        edges.append(linspace(lo, hi, count + 1, dtypes.to_torch(points.dtype)))
    return edges


def _histogramdd(points, edges, weight, density):
    """Counts (or summed weights) of ``points`` in the bins the sorted ``edges`` of each dimension bound."""
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros(points.shape[:1], jnp.int64)
    inside = jnp.ones(points.shape[:1], bool)
    for d, e in enumerate(edges):
        x = points[:, d]
        position = jnp.minimum(jnp.searchsorted(e, x, side="right") - 1, shape[d] - 1)
        inside = inside & (x >= e[0]) & (x <= e[-1])
        flat = flat * shape[d] + position
    total = math.prod(shape)
    values = jnp.ones((), points.dtype) if weight is None else weight.reshape(-1)
    hist = jnp.zeros((total,), points.dtype).at[jnp.where(inside, flat, total)].add(values, mode="drop")
    hist = hist.reshape(shape)
    if density:
        hist = hist / hist.sum()
        for d, e in enumerate(edges):
            hist = hist / jnp.diff(e).reshape([-1 if i == d else 1 for i in range(len(edges))])
    return hist


def _check_dtypes(self, bins_or_edges, weight):
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise RuntimeError(f"torch.histogramdd: input tensor and bins tensors should have the same dtype, "
                           f"and be floating point, got {self.dtype}")
    if weight is not None and weight.dtype != self.dtype:
        raise RuntimeError("torch.histogramdd: if weight tensor is provided, it should have the same dtype as "
                           "the input tensor")


@lowering("histogram.bin_ct", "histogram.bin_ct_out")
def histogram(self, bins=100, range=None, weight=None, density=False):
    _check_dtypes(self, bins, weight)
    points = self.reshape(-1, 1)
    edges = _edges_from_counts(points, [bins], range)
    return _histogramdd(points, edges, weight, density), edges[0]


@lowering("histogram.bins_tensor", "histogram.bins_tensor_out")
def histogram_bins_tensor(self, bins, weight=None, density=False):
    _check_dtypes(self, bins, weight)
    return _histogramdd(self.reshape(-1, 1), [bins], weight, density), bins


@lowering("_histogramdd_bin_edges")
def histogramdd_bin_edges(self, bins, range=None, weight=None, density=False):
    _check_dtypes(self, bins, weight)
    return _edges_from_counts(_points(self), bins, range)


@lowering("_histogramdd_from_bin_cts", "_histogramdd_from_bin_cts.out")
def histogramdd_from_bin_cts(self, bins, range=None, weight=None, density=False):
    _check_dtypes(self, bins, weight)
    points = _points(self)
    return _histogramdd(points, _edges_from_counts(points, bins, range), weight, density)


@lowering("_histogramdd_from_bin_tensors", "_histogramdd_from_bin_tensors.out")
def histogramdd_from_bin_tensors(self, bins, weight=None, density=False):
    _check_dtypes(self, bins, weight)
    return _histogramdd(_points(self), list(bins), weight, density)
