"""Pure-JAX references for the Pallas kernels: the plain formulas, the ground truth of the tests.

Each reference has the signature and semantics of its kernel (see the kernel's docstring) and
computes in float32, casting the result to the kernel's output dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """transformers' ``LlamaRMSNorm``: ``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    out_dtype = jnp.result_type(x.dtype, weight.dtype)
    return (weight.astype(jnp.float32) * normed.astype(x.dtype).astype(jnp.float32)).astype(out_dtype)


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    key_lengths: jax.Array | None = None,
    *,
    causal: bool = False,
    query_offset: int = 0,
    scale: float | None = None,
) -> jax.Array:
    """Dense softmax attention, as ``torch.nn.functional.scaled_dot_product_attention``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    q_len, kv_len, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = head_dim**-0.5 if scale is None else scale
    k = jnp.repeat(k, heads // kv_heads, axis=1).astype(jnp.float32)
    v = jnp.repeat(v, heads // kv_heads, axis=1).astype(jnp.float32)
    logits = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k) * scale
    allowed = jnp.ones((1, 1, q_len, kv_len), dtype=bool)
    if mask is not None:
        allowed = allowed & mask
    if key_lengths is not None:
        allowed = allowed & (jnp.arange(kv_len)[None, None, None, :] < key_lengths[:, None, None, None])
    if causal:
        allowed = allowed & (jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + query_offset)
    weights = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, v).astype(q.dtype)


def masked_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dense attention under a boolean mask (logits soft-capped by ``soft_cap``) and the logsumexp of each row's
    logits; rows the mask allows no key give zeros and ``-inf``."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[3]
    scale = head_dim**-0.5 if scale is None else scale
    k = jnp.repeat(k, heads // kv_heads, axis=1).astype(jnp.float32)
    v = jnp.repeat(v, heads // kv_heads, axis=1).astype(jnp.float32)
    logits = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(mask, logits, -jnp.inf)
    logsumexp = jax.nn.logsumexp(logits, axis=-1)
    allowed = jnp.any(mask, axis=-1)
    weights = jnp.exp(logits - jnp.where(allowed, logsumexp, 0.0)[..., None])
    out = jnp.einsum("bhqk,bhkd->bhqd", weights, v)
    return jnp.where(allowed[..., None], out, 0.0).astype(q.dtype), jnp.broadcast_to(logsumexp, out.shape[:3])


def decode_attention_reference(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """One query token per sequence over the first ``lengths[b]`` entries of its KV cache."""
    out = attention_reference(q[:, :, None, :], k_cache, v_cache, key_lengths=lengths, scale=scale)
    return out[:, :, 0, :]


def grouped_matmul_reference(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False
) -> jax.Array:
    """Row ``m`` of ``lhs`` times the weight of its group; rows past ``sum(group_sizes)`` are zero."""
    if transpose_rhs:
        rhs = rhs.swapaxes(1, 2)
    group_ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])
    group_of_row = jnp.searchsorted(group_ends, rows, side="right")
    in_a_group = rows < group_ends[-1]
    weights = rhs[jnp.minimum(group_of_row, rhs.shape[0] - 1)].astype(jnp.float32)
    out = jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), weights)
    return jnp.where(in_a_group[:, None], out, 0.0).astype(lhs.dtype)
