"""torch.nn's inference fast path: ``_native_multi_head_attention`` and ``_transformer_encoder_layer_fwd``.

``nn.MultiheadAttention`` (self-attention, ``batch_first``) and ``nn.TransformerEncoderLayer`` in eval mode without
gradients call these ops on every device torch counts as supported: cpu, cuda and the PrivateUse1 backend, so tpu.
They have CPU and CUDA kernels only; here they are lowered with CPU's semantics, for eager and graph mode:

- the projections are ``qkv_weight`` (the three stacked) and ``proj_weight``, with their biases;
- ``mask`` (the float mask ``F._canonical_mask`` makes of a boolean one, or a boolean mask) masks the positions
  where it is nonzero; ``mask_type`` 0 is an ``(L, S)`` mask, 1 a key padding mask ``(B, S)``, 2 a ``(B, H, L, S)``
  mask; a query row with every key masked gives NaN, as CPU's masked softmax does;
- the weights come back averaged over the heads (``average_attn_weights``) or per head, or not at all
  (``need_weights=False``: ``None``);
- the encoder layer is attention, residual and layer norm, then a two-layer feed-forward (exact GELU or ReLU),
  residual and layer norm, each norm before its block instead with ``norm_first``.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from ..dispatch import Lowering, build_kernel, kernel, lowering, resolve
from .attention import _precision
from .linalg import _accumulator
from .nn import gelu, native_layer_norm

_MHA = "_native_multi_head_attention"
_SETTINGS = ("embed_dim", "num_head", "need_weights", "average_attn_weights", "mask_type")


def _linear(x, weight, bias):
    out = jnp.einsum("...i,oi->...o", x, weight, precision=_precision(x.dtype),
                     preferred_element_type=_accumulator(x.dtype))
    return (out + bias.astype(out.dtype)).astype(x.dtype)


def _heads(x, heads):
    """(B, L, H * E) -> (B, H, L, E)."""
    return x.reshape(x.shape[:2] + (heads, -1)).transpose(0, 2, 1, 3)


def _masked_positions(mask, mask_type, shape):
    """Where ``mask`` masks, broadcast to the logits' ``(B, H, L, S)``."""
    masked = mask if mask.dtype == jnp.bool_ else mask != 0
    if mask_type == 1:  # a key padding mask
        masked = masked.reshape(masked.shape[0], 1, 1, masked.shape[-1])
    return jnp.broadcast_to(masked, shape)


def _attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type):
    """The projected output ``(B, L, D)`` and each head's weights ``(B, H, L, S)``."""
    weights_q, weights_k, weights_v = jnp.split(qkv_weight, 3)
    bias_q, bias_k, bias_v = jnp.split(qkv_bias, 3)
    q = _heads(_linear(query, weights_q, bias_q), num_head) / math.sqrt(embed_dim // num_head)
    k, v = _heads(_linear(key, weights_k, bias_k), num_head), _heads(_linear(value, weights_v, bias_v), num_head)
    accumulator = jnp.promote_types(_accumulator(query.dtype), jnp.float32)
    logits = jnp.einsum("bhle,bhse->bhls", q, k, precision=_precision(q.dtype), preferred_element_type=accumulator)
    if mask is not None:
        logits = jnp.where(_masked_positions(mask, mask_type, logits.shape), -jnp.inf, logits)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    exps = jnp.exp(logits - peak)  # NaN for a row with every key masked, as on CPU
    weights = (exps / jnp.sum(exps, axis=-1, keepdims=True)).astype(query.dtype)
    out = jnp.einsum("bhls,bhse->blhe", weights, v, precision=_precision(v.dtype),
                     preferred_element_type=accumulator).astype(query.dtype)
    return _linear(out.reshape(out.shape[:2] + (embed_dim,)), proj_weight, proj_bias), weights


@lowering(_MHA, static=_SETTINGS)
def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    out, weights = _attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                              mask, mask_type)
    if not need_weights:
        return out, None
    return out, jnp.mean(weights, axis=1) if average_attn_weights else weights


def _with_weights(*args, **settings):
    """The lowering with the weights always an array (empty when not asked for): eager kernels return arrays."""
    out, weights = native_multi_head_attention(*args, **settings)
    return out, jnp.zeros((0,), out.dtype) if weights is None else weights


@functools.cache
def _eager_attention():
    return build_kernel(resolve(_MHA), Lowering(_with_weights, frozenset(_SETTINGS)))


@kernel(_MHA)
def native_multi_head_attention_kernel(*args, **kwargs):
    """Eager form of :func:`native_multi_head_attention`: ``(output, None)`` without ``need_weights``, as on CPU."""
    out, weights = _eager_attention()(*args, **kwargs)
    need_weights = args[10] if len(args) > 10 else kwargs.get("need_weights", True)
    return out, weights if need_weights else None


@lowering("_transformer_encoder_layer_fwd", static=("embed_dim", "num_heads", "use_gelu", "norm_first", "eps",
                                                    "mask_type"))
def transformer_encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                              norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1,
                              ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    def norm(x, weight, bias):
        return native_layer_norm(x, (embed_dim,), weight, bias, eps)[0]

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = src + _attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                         mask_type)[0]
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    hidden = _linear(norm(x, norm_weight_2, norm_bias_2) if norm_first else x, ffn_weight_1, ffn_bias_1)
    hidden = gelu(hidden) if use_gelu else jnp.maximum(hidden, jnp.zeros((), hidden.dtype))
    x = x + _linear(hidden, ffn_weight_2, ffn_bias_2)
    return x if norm_first else norm(x, norm_weight_2, norm_bias_2)


@kernel("_nested_tensor_from_mask_left_aligned")
def nested_tensor_from_mask_left_aligned(*args, **kwargs):
    """``nn.TransformerEncoder``'s check before its nested-tensor fast path, which tpu does not have."""
    raise NotImplementedError(
        "nn.TransformerEncoder's nested-tensor fast path (eval mode with a src_key_padding_mask) needs nested "
        "tensors, which the tpu device does not have: build the encoder with enable_nested_tensor=False (each "
        "layer still takes its fast path; padded positions are then computed rather than left zero)")
