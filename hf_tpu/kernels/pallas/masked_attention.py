"""Attention under a boolean mask that skips the masked blocks: JAX's splash-attention kernel, forward and backward.

``masked_attention`` computes softmax attention where a boolean ``[.., Q, K]`` mask allows it, with JAX's TPU
splash-attention kernels (``jax.experimental.pallas.ops.tpu.splash_attention``) given the mask at run time: the
kernel splits the mask into 128 x 128 blocks, skips the blocks it allows nothing in, computes the blocks it allows
everything in unmasked, and masks only the others. A causal mask thus costs half a dense attention, a document mask
(packed sequences) or a sliding window less still. Where Pallas kernels are used it computes FlexAttention
(:mod:`hf_tpu.compile.flex_attention`: the mask is ``mask_mod`` evaluated over every query and key) and
``scaled_dot_product_attention`` with a long boolean mask (:mod:`hf_tpu.backend.ops.attention`).

The forward returns the logsumexp of each query row; ``masked_attention_backward`` takes it back with the output,
as a training step's backward program gets them from its forward program, and runs the kernel's backward (the
``dq`` and ``dkv`` kernels) without computing the forward again. Rows that the mask allows no key give an output of
zeros and a logsumexp of ``-inf`` (FlexAttention's convention) and no gradient.

The kernel computes ``[H, S, D]`` with a mask ``[1 | H, Q, K]`` (one for all heads, processed once, or one per
head). A mask the same for every example is computed with the batch folded into the heads (``[B * H, S, D]``: the
kernel maps query head ``h`` to key/value head ``h // (Hq / Hkv)``, which keeps each example's grouped heads
together); a mask per example (packed documents) with the kernel mapped over the batch (``jax.vmap``). So a causal
or sliding-window mask costs ``Q x K`` booleans, a document mask ``B x Q x K``. Sequences are padded to whole
blocks (padded keys masked, padded queries sliced off).
"""

from __future__ import annotations

import functools
from typing import Any

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
    soft_cap: float | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention where ``mask`` allows it, and the natural-log logsumexp of each query row's logits.

    ``q``: ``[B, Hq, Q, D]``; ``k``: ``[B, Hkv, K, D]``; ``v``: ``[B, Hkv, K, Dv]``, ``Hq`` a multiple of ``Hkv``,
    float32 or bfloat16; ``mask``: bool ``[1 | B, 1 | Hq, Q, K]``, True = attend. ``scale`` defaults to
    ``1/sqrt(D)``; ``soft_cap`` makes the logits ``soft_cap * tanh(logits / soft_cap)`` (Gemma 2's soft-capping).
    Returns the output ``[B, Hq, Q, Dv]`` in ``q.dtype`` and the float32 logsumexp ``[B, Hq, Q]``
    of the scaled logits (zeros and ``-inf`` in rows the mask allows no key). Not differentiable by JAX: its
    backward is :func:`masked_attention_backward`. ``interpret``: see ``interpret_unless_on_tpu``.
    """
    q_len = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    padded_q, padded_k, padded_v, padded_mask = _padded(q, k, v, mask)
    call = _over_the_batch(functools.partial(_forward, scale=scale, soft_cap=soft_cap), mask)
    out, logsumexp = interpret_unless_on_tpu(call, interpret)(padded_q, padded_k, padded_v, padded_mask)
    allowed = _rows_allowed(mask)
    out = jnp.where(allowed[..., None], out[:, :, :q_len], 0).astype(q.dtype)
    return out, jnp.where(allowed, logsumexp[:, :, :q_len], -jnp.inf)


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
    soft_cap: float | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients of :func:`masked_attention`'s output in ``q``, ``k`` and ``v``, given its output and logsumexp
    (the forward is not computed again) and the output's gradient ``grad_out``. Same shapes and dtypes as the
    inputs."""
    q_len, kv_len = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logsumexp = jnp.where(_rows_allowed(mask), logsumexp, 0.0)  # finite: the masked logits' weights are exp(-huge)
    padded_q, padded_k, padded_v, padded_mask = _padded(q, k, v, mask)
    rows = padded_q.shape[2]
    out, grad_out, logsumexp = (pad_axis(x, 2, rows) for x in (out, grad_out, logsumexp.astype(jnp.float32)))
    call = _over_the_batch(functools.partial(_backward, scale=scale, soft_cap=soft_cap), mask)
    dq, dk, dv = interpret_unless_on_tpu(call, interpret)(
        padded_q, padded_k, padded_v, out, logsumexp, grad_out, padded_mask)
    return (dq[:, :, :q_len].astype(q.dtype), dk[:, :, :kv_len].astype(k.dtype), dv[:, :, :kv_len].astype(v.dtype))


def _rows_allowed(mask: jax.Array) -> jax.Array:
    return jnp.any(mask, axis=-1)


def _padded(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple[jax.Array, ...]:
    """Sequences padded to whole blocks, the padding masked."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"masked_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} "
                         "key/value heads")
    q_padded, kv_padded = round_up(q.shape[2], _BLOCK), round_up(k.shape[2], _BLOCK)
    mask = pad_axis(pad_axis(mask, 2, q_padded, False), 3, kv_padded, False)
    return pad_axis(q, 2, q_padded), pad_axis(k, 2, kv_padded), pad_axis(v, 2, kv_padded), mask


def _over_the_batch(fn, mask: jax.Array):
    """``fn`` of one example (``[H, S, D]`` tensors, its mask ``[1 | H, Q, K]`` last) over the batch: mapped over it
    for a mask per example, else on the batch folded into the heads (the mask repeated per example only if it is
    one per head)."""
    if mask.shape[0] != 1:
        return jax.vmap(fn)

    def folded(*args: jax.Array) -> Any:
        *tensors, mask = args
        batch, heads = tensors[0].shape[:2]
        mask = mask[0] if mask.shape[1] == 1 else jnp.tile(mask[0], (batch, 1, 1))
        results = fn(*(x.reshape((-1,) + x.shape[2:]) for x in tensors), mask)
        return jax.tree.map(lambda x: x.reshape((batch, -1) + x.shape[1:]), results)

    return folded


def _kernel(mask: jax.Array, save_residuals: bool, soft_cap: float | None) -> splash_kernel.SplashAttentionKernel:
    """The splash kernel for a run-time mask. ``make_splash_mha`` turns every field of its mask information into
    an array, the flag that marks it dynamic included, which it then reads as a Python bool; set back here."""
    kernel = splash.make_splash_mha(mask, block_sizes=_BLOCK_SIZES, head_shards=1, q_seq_shards=1,
                                    save_residuals=save_residuals, attn_logits_soft_cap=soft_cap)

    def dynamic(info: splash_kernel.mask_info_lib.MaskInfo) -> splash_kernel.mask_info_lib.MaskInfo:
        return info._replace(is_dynamic_mask=True)

    return splash_kernel.SplashAttentionKernel(
        dynamic(kernel.fwd_mask_info), dynamic(kernel.dq_mask_info), dynamic(kernel.dkv_mask_info), **kernel.kwargs)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float,
             soft_cap: float | None) -> tuple:
    out, (logsumexp,) = _kernel(mask, True, soft_cap)((q * scale).astype(q.dtype), k, v)
    return out, logsumexp


def _backward(q, k, v, out, logsumexp, grad_out, mask, *, scale: float, soft_cap: float | None) -> tuple:
    """The kernel's own backward (``_splash_attention_bwd``, what its ``custom_vjp`` runs) on the forward's
    residuals: ``q`` is scaled as the forward scaled it, so its gradient is scaled once more."""
    kernel = _kernel(mask, False, soft_cap)
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
