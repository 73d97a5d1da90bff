"""RMSNorm as a row-block Pallas kernel, forward and backward.

Each grid step normalises a block of rows held whole in VMEM (the hidden size is one block), in
float32. The backward is a second kernel; ``jax.custom_vjp`` ties the two together, since a bare
``pallas_call`` cannot be differentiated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._util import pad_axis, round_up
from .platform import interpret_unless_on_tpu

# Rows per block: about 1 MiB of float32 per block, so that the double-buffered inputs and outputs
# of both kernels stay well inside the default scoped VMEM.
_BLOCK_BYTES = 1 << 20
_MAX_BLOCK_ROWS = 256


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6, *, interpret: bool | None = None) -> jax.Array:
    """transformers' ``LlamaRMSNorm``: ``weight * (x * rsqrt(mean(x**2, -1) + eps)).to(x.dtype)``.

    ``x``: ``[..., H]``, any float dtype; ``weight``: ``[H]``. The statistics are computed in
    float32 and the normalised values cast back to ``x.dtype`` before the weight multiplies them;
    the result has dtype ``result_type(x, weight)``. Differentiable in ``x`` and ``weight``.
    ``interpret``: see ``interpret_unless_on_tpu``.
    """
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    block_rows = min(_MAX_BLOCK_ROWS, max(8, _BLOCK_BYTES // (4 * hidden) // 8 * 8), round_up(rows.shape[0], 8))
    padded = pad_axis(rows, 0, round_up(rows.shape[0], block_rows))
    norm = functools.partial(_rms_norm, eps=eps, block_rows=block_rows)
    out = interpret_unless_on_tpu(norm, interpret)(padded, weight.reshape(1, hidden))
    return out[: rows.shape[0]].reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(rows: jax.Array, weight: jax.Array, eps: float, block_rows: int) -> jax.Array:
    num_rows, hidden = rows.shape
    row_block = pl.BlockSpec((block_rows, hidden), lambda i: (i, 0))
    weight_block = pl.BlockSpec((1, hidden), lambda i: (0, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, eps=eps),
        grid=(num_rows // block_rows,),
        in_specs=[row_block, weight_block],
        out_specs=row_block,
        out_shape=jax.ShapeDtypeStruct(rows.shape, jnp.result_type(rows.dtype, weight.dtype)),
    )(rows, weight)


def _normalised(x_ref: jax.Ref, eps: float) -> tuple[jax.Array, jax.Array]:
    """The rows in float32 times their ``rsqrt(mean(x**2) + eps)``, and that factor."""
    x = x_ref[...].astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inv_rms, inv_rms


def _forward_kernel(x_ref: jax.Ref, w_ref: jax.Ref, o_ref: jax.Ref, *, eps: float) -> None:
    normed, _ = _normalised(x_ref, eps)
    normed = normed.astype(x_ref.dtype).astype(jnp.float32)
    o_ref[...] = (w_ref[...].astype(jnp.float32) * normed).astype(o_ref.dtype)


def _backward_kernel(
    x_ref: jax.Ref, w_ref: jax.Ref, dy_ref: jax.Ref, dx_ref: jax.Ref, dw_ref: jax.Ref, *, eps: float
) -> None:
    normed, inv_rms = _normalised(x_ref, eps)
    dy = dy_ref[...].astype(jnp.float32)
    d_normed = dy * w_ref[...].astype(jnp.float32)
    # d/dx of x * rsqrt(mean(x^2) + eps): project out the component along the normalised row.
    dx = inv_rms * (d_normed - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dw_ref[...] = jnp.sum(dy * normed, axis=0, keepdims=True)


def _rms_norm_fwd(rows: jax.Array, weight: jax.Array, eps: float, block_rows: int) -> tuple[jax.Array, tuple]:
    return _rms_norm(rows, weight, eps, block_rows), (rows, weight)


def _rms_norm_bwd(eps: float, block_rows: int, residuals: tuple, d_out: jax.Array) -> tuple[jax.Array, jax.Array]:
    rows, weight = residuals
    num_rows, hidden = rows.shape
    num_blocks = num_rows // block_rows
    row_block = pl.BlockSpec((block_rows, hidden), lambda i: (i, 0))
    weight_block = pl.BlockSpec((1, hidden), lambda i: (0, 0))
    dx, dw_per_block = pl.pallas_call(
        functools.partial(_backward_kernel, eps=eps),
        grid=(num_blocks,),
        in_specs=[row_block, weight_block, row_block],
        out_specs=[row_block, pl.BlockSpec((None, 1, hidden), lambda i: (i, 0, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(rows.shape, rows.dtype),
            jax.ShapeDtypeStruct((num_blocks, 1, hidden), jnp.float32),
        ],
    )(rows, weight, d_out)
    return dx, dw_per_block.sum(axis=0).astype(weight.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
