"""Grouped (ragged) matrix multiplication for mixture-of-experts layers.

Wraps JAX's public megablox kernel (``jax.experimental.pallas.ops.tpu.megablox.gmm``, a
``custom_vjp`` whose backward is a ``gmm`` for the input gradient and a transposed ``tgmm`` for the
weight gradient). It visits only the row tiles each group occupies, reading every expert's weight
once. The wrapper picks tile sizes the shapes allow and pads the rows to a whole tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox

from ._util import pad_axis, round_up
from .platform import interpret_unless_on_tpu

_TILE = 128


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    interpret: bool | None = None,
) -> jax.Array:
    """``out[m] = lhs[m] @ rhs[g]`` for the rows ``m`` of group ``g``, differentiable in ``lhs`` and ``rhs``.

    ``lhs``: ``[M, K]``, rows sorted by group; ``rhs``: ``[G, K, N]``, or ``[G, N, K]`` with
    ``transpose_rhs=True`` (transformers' expert weights ``gate_up_proj``/``down_proj``, used without
    a copy); ``group_sizes``: int ``[G]``, the rows of each group in order, summing to at most ``M``
    (rows past the sum come out zero, with zero gradient). Returns ``[M, N]`` in ``lhs.dtype``, accumulated in float32.
    ``interpret``: see ``interpret_unless_on_tpu``.
    """
    rows, depth = lhs.shape
    width = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    # K and N tiles must divide their dimension: 128 where it does, else the whole dimension.
    tiling = (
        min(_TILE, round_up(rows, 8)),
        _TILE if depth % _TILE == 0 else depth,
        _TILE if width % _TILE == 0 else width,
    )
    padded = pad_axis(lhs, 0, round_up(rows, tiling[0]))
    # gmm leaves the rows past the last group (and their input gradient) uninitialised: give them
    # to the last group as zero rows, whose products are zero and add nothing to its weight gradient.
    group_sizes = group_sizes.astype(jnp.int32)
    grouped_rows = jnp.sum(group_sizes, dtype=jnp.int32)
    padded = jnp.where(jnp.arange(padded.shape[0])[:, None] < grouped_rows, padded, 0)
    group_sizes = group_sizes.at[-1].add(padded.shape[0] - grouped_rows)
    kernel = functools.partial(
        _gmm, preferred_element_type=lhs.dtype, tiling=tiling, transpose_rhs=transpose_rhs
    )
    out = interpret_unless_on_tpu(kernel, interpret)(padded, rhs, group_sizes)
    return out[:rows]


def _gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: jnp.dtype,
    tiling: tuple[int, int, int],
    transpose_rhs: bool,
) -> jax.Array:
    return megablox.gmm(
        lhs, rhs, group_sizes, preferred_element_type, tiling, transpose_rhs=transpose_rhs
    )
