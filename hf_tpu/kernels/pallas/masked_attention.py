"""Attention under a boolean mask that skips the masked blocks: JAX's splash-attention kernel, forward and backward.

``masked_attention`` computes softmax attention where a boolean ``[.., Q, K]`` mask allows it, with JAX's TPU
splash-attention kernels (``jax.experimental.pallas.ops.tpu.splash_attention``) given the mask at run time: the
kernel splits the mask into 128 x 128 blocks, skips the blocks it allows nothing in, computes the blocks it allows
everything in unmasked, and masks only the others. A causal mask thus costs half a dense attention, a document mask
(packed sequences) or a sliding window less still. It is FlexAttention's lowering where Pallas kernels are used
(:mod:`hf_tpu.compile.flex_attention`: the mask is ``mask_mod`` evaluated over every query and key).

The forward returns the logsumexp of each query row; ``masked_attention_backward`` takes it back with the output,
as a training step's backward program gets them from its forward program, and runs the kernel's backward (the
``dq`` and ``dkv`` kernels) without computing the forward again. Rows that the mask allows no key give an output of
zeros and a logsumexp of ``-inf`` (FlexAttention's convention) and no gradient.

The batch is folded into the heads (``[B * H, S, D]``: the kernel maps query head ``h`` to key/value head
``h // (Hq / Hkv)``, which keeps each example's grouped heads together), so one kernel call serves the whole batch.
A mask the same for every example and head is processed once, ``[Q, K]``; otherwise per example and head. Sequences
are padded to whole blocks (padded keys masked, padded queries sliced off).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel

from ._util import pad_axis, round_up
from .platform import interpret_unless_on_tpu

_BLOCK = 128  # the kernel's key blocks are whole lane tiles; query blocks the same size
_BLOCK_SIZES = splash.BlockSizes(
    block_q=_BLOCK, block_kv=_BLOCK, block_kv_compute=_BLOCK,
    block_q_dkv=_BLOCK, block_kv_dkv=_BLOCK, block_kv_dkv_compute=_BLOCK,
    block_q_dq=_BLOCK, block_kv_dq=_BLOCK,
)


def masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention where ``mask`` allows it, and the natural-log logsumexp of each query row's logits.

    ``q``: ``[B, Hq, Q, D]``; ``k``: ``[B, Hkv, K, D]``; ``v``: ``[B, Hkv, K, Dv]``, ``Hq`` a multiple of ``Hkv``,
    float32 or bfloat16; ``mask``: bool ``[1 | B, 1 | Hq, Q, K]``, True = attend. ``scale`` defaults to
    ``1/sqrt(D)``. Returns the output ``[B, Hq, Q, Dv]`` in ``q.dtype`` and the float32 logsumexp ``[B, Hq, Q]``
    of the scaled logits (zeros and ``-inf`` in rows the mask allows no key). Not differentiable by JAX: its
    backward is :func:`masked_attention_backward`. ``interpret``: see ``interpret_unless_on_tpu``.
    """
    batch, heads, q_len, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    call = functools.partial(_forward, scale=scale)
    out, logsumexp = interpret_unless_on_tpu(call, interpret)(*_folded(q, k, v, mask))
    out = out.reshape(batch, heads, -1, v.shape[-1])[:, :, :q_len]
    logsumexp = logsumexp.reshape(batch, heads, -1)[:, :, :q_len]
    allowed = _rows_allowed(mask)
    return jnp.where(allowed[..., None], out, 0).astype(q.dtype), jnp.where(allowed, logsumexp, -jnp.inf)


def masked_attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    logsumexp: jax.Array,
    grad_out: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients of :func:`masked_attention`'s output in ``q``, ``k`` and ``v``, given its output and logsumexp
    (the forward is not computed again) and the output's gradient ``grad_out``. Same shapes and dtypes as the
    inputs."""
    batch, heads, q_len, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    logsumexp = jnp.where(_rows_allowed(mask), logsumexp, 0.0)  # finite: the masked logits' weights are exp(-huge)
    folded_q, folded_k, folded_v, folded_mask = _folded(q, k, v, mask)
    padded = folded_q.shape[1]
    out, grad_out = (_fold(pad_axis(x, 2, padded)) for x in (out, grad_out))
    logsumexp = pad_axis(logsumexp, 2, padded).reshape(batch * heads, padded).astype(jnp.float32)
    call = functools.partial(_backward, scale=scale)
    dq, dk, dv = interpret_unless_on_tpu(call, interpret)(
        folded_q, folded_k, folded_v, out, logsumexp, grad_out, folded_mask)
    kv_len = k.shape[2]
    return (
        dq.reshape(batch, heads, -1, head_dim)[:, :, :q_len].astype(q.dtype),
        dk.reshape(k.shape[:2] + (-1, head_dim))[:, :, :kv_len].astype(k.dtype),
        dv.reshape(v.shape[:2] + (-1, v.shape[-1]))[:, :, :kv_len].astype(v.dtype),
    )


def _rows_allowed(mask: jax.Array) -> jax.Array:
    return jnp.any(mask, axis=-1)


def _fold(x: jax.Array) -> jax.Array:
    return x.reshape((-1,) + x.shape[2:])


def _folded(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple[jax.Array, ...]:
    """Batch folded into heads, sequences padded to whole blocks; the mask ``[1 | B * Hq, Q, K]`` to match."""
    batch, heads, q_len = q.shape[:3]
    kv_len = k.shape[2]
    if heads % k.shape[1]:
        raise ValueError(f"masked_attention: {heads} query heads are not a multiple of {k.shape[1]} key/value heads")
    q_padded, kv_padded = round_up(q_len, _BLOCK), round_up(kv_len, _BLOCK)
    if mask.shape[:2] == (1, 1):
        mask = mask[0]
    else:
        mask = _fold(jnp.broadcast_to(mask, (batch, heads, q_len, kv_len)))
    mask = pad_axis(pad_axis(mask, 1, q_padded, False), 2, kv_padded, False)
    return (_fold(pad_axis(q, 2, q_padded)), _fold(pad_axis(k, 2, kv_padded)), _fold(pad_axis(v, 2, kv_padded)),
            mask)


def _kernel(mask: jax.Array, save_residuals: bool) -> splash_kernel.SplashAttentionKernel:
    """The splash kernel for a run-time mask. ``make_splash_mha`` turns every field of its mask information into
    an array, the flag that marks it dynamic included, which it then reads as a Python bool; set back here."""
    kernel = splash.make_splash_mha(mask, block_sizes=_BLOCK_SIZES, head_shards=1, q_seq_shards=1,
                                    save_residuals=save_residuals)

    def dynamic(info: splash_kernel.mask_info_lib.MaskInfo) -> splash_kernel.mask_info_lib.MaskInfo:
        return info._replace(is_dynamic_mask=True)

    return splash_kernel.SplashAttentionKernel(
        dynamic(kernel.fwd_mask_info), dynamic(kernel.dq_mask_info), dynamic(kernel.dkv_mask_info), **kernel.kwargs)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float) -> tuple:
    out, (logsumexp,) = _kernel(mask, save_residuals=True)((q * scale).astype(q.dtype), k, v)
    return out, logsumexp


def _backward(q, k, v, out, logsumexp, grad_out, mask, *, scale: float) -> tuple:
    """The kernel's own backward (``_splash_attention_bwd``, what its ``custom_vjp`` runs) on the forward's
    residuals: ``q`` is scaled as the forward scaled it, so its gradient is scaled once more."""
    kernel = _kernel(mask, save_residuals=False)
    options = kernel.kwargs

    def collapsed(info: splash_kernel.mask_info_lib.MaskInfo) -> splash_kernel.mask_info_lib.MaskInfo:
        blocks = info.partial_mask_blocks  # [heads, q blocks, kv blocks, block, block], as the kernel's entry does
        return info._replace(partial_mask_blocks=blocks.reshape((-1,) + blocks.shape[-2:]))

    residuals = ((q * scale).astype(q.dtype), k, v, None, None, out, logsumexp,
                 collapsed(kernel.dq_mask_info), collapsed(kernel.dkv_mask_info))
    gradients = splash_kernel._splash_attention_bwd(
        False, options["mask_value"], options["is_mqa"], options["block_sizes"], None, options["mask_function"],
        options["attn_logits_soft_cap"], options["interpret"], residuals, grad_out)
    dq, dk, dv = gradients[3:6]
    return dq * scale, dk, dv
