"""Attention kernels: flash attention (prefill and training) and decode attention over a KV cache.

``flash_attention`` wraps JAX's public TPU flash-attention kernel
(``jax.experimental.pallas.ops.tpu.flash_attention``, with its own backward kernels). That kernel
needs as many key/value heads as query heads, key lengths in whole 128-blocks and a top-left causal
mask; the wrapper expands grouped KV heads, pads the sequences and slices back, turns padding and
key lengths into segment ids and a boolean mask or a shifted causal mask into an additive bias.

``decode_attention`` is a small kernel of our own: one query token per sequence against a
contiguous ``[B, Hkv, S_max, D]`` cache with per-sequence lengths. JAX's ``paged_attention`` would
need the cache transposed into head-major pages at every step and casts K/V to bfloat16; this
kernel reads the cache in place, serves all query heads of a KV head in one block (GQA without
copies) and skips the blocks past each sequence's length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

from ._util import pad_axis, round_up
from .platform import interpret_unless_on_tpu

_KEY_BLOCK = 128  # the flash kernel's minimum key block (its lane width)
_MAX_QUERY_BLOCK = 128


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    key_lengths: jax.Array | None = None,
    *,
    causal: bool = False,
    query_offset: int = 0,
    scale: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Softmax attention as ``torch.nn.functional.scaled_dot_product_attention``, differentiable.

    ``q``: ``[B, Hq, Sq, D]``; ``k``, ``v``: ``[B, Hkv, Sk, D]`` with ``Hq`` a multiple of ``Hkv``
    (grouped-query attention); same float dtype. Optional masks, combined:

    - ``mask``: bool ``[B, 1 | Hq, Sq, Sk]`` (or anything broadcasting to it), True = attend;
    - ``key_lengths``: int ``[B]``, keys ``>= key_lengths[b]`` are padding (cheaper than ``mask``);
    - ``causal``: query ``i`` attends keys ``j <= i + query_offset``. ``query_offset=0`` is torch's
      ``is_causal`` (top-left aligned); ``Sk - Sq`` aligns it bottom-right (chunked prefill).
      A non-zero offset costs a ``[B, Hq, Sq, Sk]`` bias, as ``mask`` does.

    ``scale`` defaults to ``1/sqrt(D)``. Returns ``[B, Hq, Sq, D]`` in ``q.dtype``. A query row with
    no key to attend gets an unspecified finite value (torch gives NaN there).
    ``interpret``: see ``interpret_unless_on_tpu``.
    """
    return _flash(q, k, v, mask, key_lengths, causal, query_offset, scale, interpret, residuals=False)


def flash_attention_with_logsumexp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`flash_attention` (no masks but ``causal``) and the float32 ``[B, Hq, Sq]`` logsumexp of each
    query row's scaled logits, as torch's fused attention ops return it. Not differentiable: differentiate
    :func:`flash_attention`, whose backward kernels recompute what they need."""
    return _flash(q, k, v, None, None, causal, 0, scale, interpret, residuals=True)


def _flash(q, k, v, mask, key_lengths, causal, query_offset, scale, interpret, residuals):
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"flash_attention: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    scale = head_dim**-0.5 if scale is None else scale
    k = jnp.repeat(k, heads // kv_heads, axis=1)
    v = jnp.repeat(v, heads // kv_heads, axis=1)

    block_q = min(_MAX_QUERY_BLOCK, round_up(q_len, 8))
    q_padded, kv_padded = round_up(q_len, block_q), round_up(kv_len, _KEY_BLOCK)
    q = pad_axis(q, 2, q_padded)
    k = pad_axis(k, 2, kv_padded)
    v = pad_axis(v, 2, kv_padded)

    segment_ids = None
    if key_lengths is not None or kv_padded != kv_len:
        valid_keys = jnp.arange(kv_padded) < (kv_len if key_lengths is None else key_lengths[:, None])
        segment_ids = tpu_flash.SegmentIds(
            q=jnp.ones((batch, q_padded), jnp.int32),
            kv=jnp.broadcast_to(valid_keys, (batch, kv_padded)).astype(jnp.int32),
        )

    allowed = mask
    shifted_causal = causal and query_offset != 0
    if shifted_causal:
        causal_allowed = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + query_offset
        allowed = causal_allowed if allowed is None else allowed & causal_allowed
    bias = None
    if allowed is not None:
        allowed = jnp.broadcast_to(allowed, (batch, heads, q_len, kv_len))
        allowed = pad_axis(pad_axis(allowed, 2, q_padded, True), 3, kv_padded, True)
        bias = jnp.where(allowed, 0.0, tpu_flash.DEFAULT_MASK_VALUE).astype(jnp.float32)

    block_sizes = tpu_flash.BlockSizes(
        block_q=block_q, block_k_major=_KEY_BLOCK, block_k=_KEY_BLOCK, block_b=1,
        block_q_major_dkv=block_q, block_k_major_dkv=_KEY_BLOCK, block_k_dkv=_KEY_BLOCK, block_q_dkv=block_q,
        block_k_major_dq=_KEY_BLOCK, block_k_dq=_KEY_BLOCK, block_q_dq=block_q,
    )
    if residuals:
        # The kernel's forward with its saved row sums and maxima; JAX's public entry point keeps them for its
        # own backward. lse = max + log(sum).
        def kernel(q, k, v, bias, segment_ids):
            out, row_sum, row_max = tpu_flash._flash_attention(
                q, k, v, bias, segment_ids, True, causal, scale, block_sizes, False)
            return out, row_max + jnp.log(row_sum)

        out, logsumexp = interpret_unless_on_tpu(kernel, interpret)(q, k, v, bias, segment_ids)
        return out[:, :, :q_len, :], logsumexp[:, :, :q_len]
    kernel = functools.partial(
        tpu_flash.flash_attention,
        causal=causal and not shifted_causal,
        sm_scale=scale,
        block_sizes=block_sizes,
    )
    out = interpret_unless_on_tpu(kernel, interpret)(q, k, v, jax.lax.stop_gradient(bias), segment_ids)
    return out[:, :, :q_len, :]


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """One decode step: each sequence's query token attends the first ``lengths[b]`` cache entries.

    ``q``: ``[B, Hq, D]``; ``k_cache``, ``v_cache``: ``[B, Hkv, S_max, D]`` with ``Hq`` a multiple
    of ``Hkv``; ``lengths``: int ``[B]``, each in ``1..S_max``. ``scale`` defaults to ``1/sqrt(D)``.
    Returns ``[B, Hq, D]`` in ``q.dtype``. Forward only (inference). The cache is read in place when
    ``S_max`` is a multiple of 128; otherwise it is padded (copied) up to one.
    ``interpret``: see ``interpret_unless_on_tpu``.
    """
    batch, heads, head_dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"decode_attention: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    scale = head_dim**-0.5 if scale is None else scale
    group = heads // kv_heads
    block_k = next((size for size in (512, 256, 128) if max_len % size == 0), _KEY_BLOCK)
    padded_len = round_up(max_len, block_k)
    k_cache = pad_axis(k_cache, 2, padded_len)
    v_cache = pad_axis(v_cache, 2, padded_len)

    call = functools.partial(_decode_call, scale=scale, block_k=block_k)
    grouped_q = q.reshape(batch, kv_heads, group, head_dim)
    out = interpret_unless_on_tpu(call, interpret)(lengths.astype(jnp.int32), grouped_q, k_cache, v_cache)
    return out.reshape(batch, heads, head_dim)


def _decode_call(
    lengths: jax.Array, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, scale: float, block_k: int
) -> jax.Array:
    """The decode ``pallas_call`` on ``q: [B, Hkv, G, D]``; grid (sequence, KV head, key block)."""
    batch, kv_heads, group, head_dim = q.shape

    def kv_index(b: jax.Array, h: jax.Array, j: jax.Array, lengths_ref: jax.Ref) -> tuple:
        # Blocks past the sequence's end map to its last block: an unchanged block index is not fetched
        # again. (lax.div: jnp's floor division lowers through `sign`, which needs a real TPU to lower.)
        last_block = jax.lax.div(jnp.maximum(lengths_ref[b] - 1, 0), block_k)
        return (b, h, jnp.minimum(j, last_block), 0)

    head_group_block = pl.BlockSpec((None, None, group, head_dim), lambda b, h, j, lengths_ref: (b, h, 0, 0))
    kv_block = pl.BlockSpec((None, None, block_k, head_dim), kv_index)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, kv_heads, k_cache.shape[2] // block_k),
        in_specs=[head_group_block, kv_block, kv_block],
        out_specs=head_group_block,
        scratch_shapes=[
            pltpu.VMEM((group, 1), jnp.float32),  # running max of the logits
            pltpu.VMEM((group, 1), jnp.float32),  # running softmax denominator
            pltpu.VMEM((group, head_dim), jnp.float32),  # running weighted sum of values
        ],
    )
    return pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, block_k=block_k),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(lengths, q, k_cache, v_cache)


def _decode_kernel(
    lengths_ref: jax.Ref,
    q_ref: jax.Ref,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    o_ref: jax.Ref,
    max_ref: jax.Ref,
    denominator_ref: jax.Ref,
    accumulator_ref: jax.Ref,
    *,
    scale: float,
    block_k: int,
) -> None:
    """Online softmax over the key blocks of one (sequence, KV head), all its query heads at once."""
    kv_block = pl.program_id(2)
    length = lengths_ref[pl.program_id(0)]

    @pl.when(kv_block == 0)
    def _start() -> None:
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        denominator_ref[...] = jnp.zeros(denominator_ref.shape, jnp.float32)
        accumulator_ref[...] = jnp.zeros(accumulator_ref.shape, jnp.float32)

    @pl.when(kv_block * block_k < length)
    def _accumulate() -> None:
        logits = jax.lax.dot_general(
            q_ref[...], k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ) * scale
        positions = kv_block * block_k + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        logits = jnp.where(positions < length, logits, -jnp.inf)
        previous_max = max_ref[...]
        new_max = jnp.maximum(previous_max, jnp.max(logits, axis=1, keepdims=True))
        rescale = jnp.exp(previous_max - new_max)
        weights = jnp.exp(logits - new_max)
        denominator_ref[...] = rescale * denominator_ref[...] + jnp.sum(weights, axis=1, keepdims=True)
        accumulator_ref[...] = rescale * accumulator_ref[...] + jnp.dot(
            weights.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32
        )
        max_ref[...] = new_max

    @pl.when(kv_block == pl.num_programs(2) - 1)
    def _finish() -> None:
        o_ref[...] = (accumulator_ref[...] / denominator_ref[...]).astype(o_ref.dtype)
