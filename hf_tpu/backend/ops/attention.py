"""Fused scaled dot-product attention through torch's PrivateUse1 SDPA override.

``F.scaled_dot_product_attention`` is CompositeImplicitAutograd: torch picks a backend with a C++
dispatch stub that a Python backend cannot fill, and without it PrivateUse1 takes the unfused math
decomposition (``_safe_softmax``, ``bmm``, one op each). So on tpu ``scaled_dot_product_attention``
itself gets a kernel (at the autograd key, and at the backend key for inference mode) that makes the
choice tpu's ``_fused_sdp_choice`` reports and, for the overrideable backend, calls
``_scaled_dot_product_fused_attention_overrideable``. torch differentiates that op with
``_scaled_dot_product_fused_attention_overrideable_backward`` (derivatives.yaml); both are lowered
from :func:`_attend`, the backward as its VJP. Graph mode sees the same two ops in its ATen graphs
(FakeTensors on tpu reach the same kernel) and lowers them from the op table.

Where Pallas kernels are used (TPU chips, see :func:`~hf_tpu.backend.runtime.pallas_kernels`), long
attention with no mask but ``is_causal`` runs on the Pallas flash-attention kernel, and long attention with a
boolean mask on the splash kernel, which skips the blocks the mask allows nothing in (a padding mask's padding, the
other sequences of a batch of packed or continuously batched sequences), forward and backward
(:func:`_pallas_kernel`); XLA's own lowering materializes the ``[L, S]`` logits.

Dropout takes the math path: the fused op's schema has no input for a random key, so its lowering
could not draw fresh randomness inside a jitted program. So do ``torch.func`` transforms and forward-mode
AD (the fused op has no batching rule, forward-AD formula or double backward) and ``sdpa_kernel`` choices
without OVERRIDEABLE; see :func:`_fused_unsupported`.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import torch
from jax import lax
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend

from .. import runtime
from ..dispatch import Lowering, build_kernel, kernel, lowering, resolve
from .linalg import _accumulator


def _precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _grouped(x, kv_heads):
    """(*batch, H, L, D) -> (*batch, kv_heads, H // kv_heads, L, D): query heads grouped per key head (GQA)."""
    return x.reshape(x.shape[:-3] + (kv_heads, x.shape[-3] // kv_heads) + x.shape[-2:])


def _attend(query, key, value, bias, is_causal, scale):
    """softmax(q @ k^T * scale + bias) @ v, with the softmax in float32 (at least) and a row with every
    key masked giving zeros (as ``_safe_softmax`` does); returns the output and the float32 logsumexp.

    Shapes: query (*batch, Hq, L, E), key (*batch, Hk, S, E), value (*batch, Hk, S, Ev) with Hq a
    multiple of Hk (grouped-query attention); ``bias`` broadcasts to (*batch, Hq, L, S) and is
    additive, or boolean (True = attend).
    """
    accumulator = jnp.promote_types(_accumulator(query.dtype), jnp.float32)
    length, source, kv_heads = query.shape[-2], key.shape[-2], key.shape[-3]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    q = _grouped(query, kv_heads)
    k, v = key[..., None, :, :], value[..., None, :, :]
    logits = jnp.einsum("...le,...se->...ls", q, k, precision=_precision(query.dtype),
                        preferred_element_type=accumulator) * scale
    allowed = None
    if bias is not None:
        bias = _grouped(jnp.broadcast_to(bias, query.shape[:-1] + (source,)), kv_heads)
        if bias.dtype == jnp.bool_:
            allowed = bias
        else:
            logits = logits + bias.astype(accumulator)
    if is_causal:
        causal = jnp.tril(jnp.ones((length, source), jnp.bool_))
        allowed = causal if allowed is None else allowed & causal
    if allowed is not None:
        logits = jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))  # no float64 constant
    peak = jnp.max(logits, axis=-1, keepdims=True)
    safe_peak = jnp.where(jnp.isneginf(peak), jnp.zeros((), accumulator), lax.stop_gradient(peak))
    weights = jnp.exp(logits - safe_peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probabilities = weights / jnp.where(total == 0, jnp.ones((), accumulator), total)
    out = jnp.einsum("...ls,...se->...le", probabilities.astype(value.dtype), v, precision=_precision(value.dtype),
                     preferred_element_type=accumulator)
    logsumexp = (jnp.log(total) + safe_peak)[..., 0]
    ungroup = query.shape[:-1]
    return out.reshape(ungroup + (value.shape[-1],)).astype(query.dtype), logsumexp.reshape(ungroup)


def _logsumexp_shape(logsumexp):
    """(B, H, L) as the meta function reports it: a 3-d query (H, L, E) counts as batch 1."""
    return logsumexp if logsumexp.ndim == 3 else logsumexp[None]


_FLASH_MIN_LENGTH = 1024  # a choice, not yet measured on chips: from here on the logits no longer fit the caches
_MASKED_MIN_QUERIES = 128  # one query block of the masked kernel


def _pallas_kernel(query, key, value, attn_bias) -> str | None:
    """The Pallas kernel that computes this attention, if any: where Pallas kernels are used, for 4-d float32 or
    bfloat16 inputs, ``"flash"`` (the flash kernel) with no mask but ``is_causal`` and query and key lengths of at
    least ``_FLASH_MIN_LENGTH``; ``"masked"`` (the splash kernel, which skips the blocks the mask allows nothing in)
    with a boolean mask, ``_MASKED_MIN_QUERIES`` queries and ``_FLASH_MIN_LENGTH`` keys or more. (A boolean mask's
    fully masked rows come out zero from :func:`_attend` and the masked kernel, unspecified from the flash kernel.)"""
    if not (query.ndim == 4 and query.dtype in (jnp.float32, jnp.bfloat16) and value.shape[-1] == query.shape[-1]
            and key.shape[-2] >= _FLASH_MIN_LENGTH and runtime.pallas_kernels()):
        return None
    if attn_bias is None:
        return "flash" if query.shape[-2] >= _FLASH_MIN_LENGTH else None
    return "masked" if attn_bias.dtype == jnp.bool_ and query.shape[-2] >= _MASKED_MIN_QUERIES else None


def _four_dims(mask, query, key):
    """A mask that broadcasts to ``[B, Hq, L, S]`` as ``[1 | B, 1 | Hq, L, S]``, as the masked kernel takes it."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    return jnp.broadcast_to(mask, mask.shape[:2] + (query.shape[-2], key.shape[-2]))


_FUSED = "_scaled_dot_product_fused_attention_overrideable"


@lowering(_FUSED, calls_kernels=True)
def fused_attention(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                    scale=None):
    """Returns (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask);
    the sequence-length outputs are for nested tensors (undefined here), the seeds are zeros (no dropout)."""
    if dropout_p != 0:
        raise NotImplementedError(
            f"aten::{_FUSED}: dropout_p > 0 is not lowered on tpu (scaled_dot_product_attention routes it to the "
            "math path)")
    kernel = _pallas_kernel(query, key, value, attn_bias)
    if kernel is not None:
        from ...kernels import pallas
    if kernel == "flash":
        out, logsumexp = pallas.flash_attention_with_logsumexp(query, key, value, causal=is_causal, scale=scale)
    elif kernel == "masked":
        out, logsumexp = pallas.masked_attention(query, key, value, _four_dims(attn_bias, query, key), scale=scale)
    else:
        out, logsumexp = _attend(query, key, value, attn_bias, is_causal, scale)
    zero = jnp.zeros((), jnp.int64)
    return out, _logsumexp_shape(logsumexp), None, None, query.shape[-2], key.shape[-2], zero, zero, None


_eager_kernels: dict[tuple[int, ...], Callable] = {}


def _eager_kernel(order: tuple[int, ...]) -> Callable:
    """The op-table kernel of the forward's arrays, with the output's dims transposed into memory ``order``."""
    built = _eager_kernels.get(order)
    if built is None:
        def arrays(*args):
            out, logsumexp, _, _, _, _, seed, offset, _ = fused_attention(*args)
            return out.transpose(order), logsumexp, seed, offset

        built = _eager_kernels[order] = build_kernel(resolve(_FUSED), Lowering(arrays, calls_kernels=True))
    return built


@kernel(_FUSED)
def fused_attention_kernel(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
                           return_debug_mask=False, *, scale=None):
    """Eager form of :func:`fused_attention`. The output's dims lie in memory in the order of the query's, as CPU
    and the meta function have it (a query transposed from (B, L, H, E) gives an output whose ``transpose(1, 2)``
    views back to (B, L, H*E)); the lengths are Python ints, not device scalars torch would read back (a sync)."""
    order = tuple(sorted(range(query.dim()), key=query.stride, reverse=True))
    physical, logsumexp, seed, offset = _eager_kernel(order)(
        query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask, scale=scale)
    out = physical.permute([order.index(d) for d in range(query.dim())])
    return out, logsumexp, None, None, query.size(-2), key.size(-2), seed, offset, None


@lowering("_scaled_dot_product_fused_attention_overrideable_backward", calls_kernels=True)
def fused_attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                             cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, scale=None):
    """Gradients of query, key, value and (if it is floating point) the additive bias, as the VJP of the forward
    (with the Pallas kernels' own backward kernels where :func:`_pallas_kernel` picks one: the masked kernel's from
    the forward's output and logsumexp)."""
    differentiable_bias = attn_bias is not None and jnp.issubdtype(attn_bias.dtype, jnp.floating)
    kernel = _pallas_kernel(query, key, value, attn_bias)
    if kernel is not None:
        from ...kernels import pallas
    if kernel == "masked":
        wanted = (*pallas.masked_attention_backward(query, key, value, out, logsumexp, grad_out.astype(query.dtype),
                                                    _four_dims(attn_bias, query, key), scale=scale), None)
        return tuple(g if keep else None for g, keep in zip(wanted, grad_input_mask))

    def forward(q, k, v, b):
        if kernel == "flash":
            return pallas.flash_attention(q, k, v, causal=is_causal, scale=scale)
        return _attend(q, k, v, b if differentiable_bias else attn_bias, is_causal, scale)[0]

    _, vjp = jax.vjp(forward, query, key, value, attn_bias if differentiable_bias else None)
    grad_query, grad_key, grad_value, grad_bias = vjp(grad_out.astype(query.dtype))
    wanted = (grad_query, grad_key, grad_value, grad_bias if differentiable_bias else None)
    return tuple(g if keep else None for g, keep in zip(wanted, grad_input_mask))


def _backward_shapes(grad_out, query, key, value, attn_bias, *rest, **options):
    """The fused backward's meta function: gradients shaped as its inputs."""
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            None if attn_bias is None else torch.empty_like(attn_bias))


# torch 2.11 has no meta function for the fused backward (2.13 has): tracing a graph through it (a compiled
# backward) would make FakeTensor run the real kernel on fake tensors
_backward_meta = None
if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_FUSED}_backward", "Meta"):
    _backward_meta = torch.library.Library("aten", "IMPL")
    _backward_meta.impl(f"{_FUSED}_backward", _backward_shapes, "Meta")


def _fused_unsupported() -> bool:
    """Whether a transform the fused op does not support is in effect, so the math path (whose ops have batching
    rules, forward-AD formulas and derivatives of their backward ops) must be taken:

    - any ``torch.func`` transform: functorch has no batching rule for the fused op or its backward (the loop
      fallback it builds cannot return the fused op's non-tensor outputs, as in ``vmap(grad(f))``, and runs one
      program per sample for the backward, as in ``jacrev``, which vmaps a VJP), and torch defines no derivative
      for the fused backward (``grad(grad(f))``);
    - forward-mode AD (``jvp``, ``jacfwd``, ``forward_ad.dual_level``): the fused op has no forward-AD formula.
    """
    return torch._C._functorch.maybe_current_level() is not None or forward_ad._current_level >= 0


def _choose(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> int:
    """The overrideable (fused) backend, or the math path for dropout, under torch.func and forward-mode AD, where
    ``sdpa_kernel`` leaves OVERRIDEABLE out, and for inputs the fused op does not take (not 3-d or 4-d, or heads
    that do not group), where torch's own checks then raise CPU's errors."""
    if dropout_p != 0 or query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        return int(SDPBackend.MATH)
    if _fused_unsupported():
        return int(SDPBackend.MATH)
    # sdpa_kernel() without OVERRIDEABLE, e.g. for double backward, which the fused backward op does not support
    if not torch._C._get_overrideable_sdp_enabled():
        return int(SDPBackend.MATH)
    heads, kv_heads = query.size(-3), key.size(-3)
    if value.size(-3) != kv_heads or (heads != kv_heads and not (enable_gqa and heads % kv_heads == 0)):
        return int(SDPBackend.MATH)
    return int(SDPBackend.OVERRIDEABLE)


@kernel("_fused_sdp_choice")
def fused_sdp_choice(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                     enable_gqa=False):
    return _choose(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _additive(attn_mask, dtype):
    """A boolean mask (True = attend) as the additive mask of ``dtype`` the math path takes: 0 where allowed, -inf
    where masked, as torch's own SDPA converts it before its math path (which adds whatever mask it is given, so a
    boolean one would add 1 and 0 and mask nothing)."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros((), dtype=dtype, device=attn_mask.device).masked_fill(attn_mask.logical_not(), -math.inf)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    """``F.scaled_dot_product_attention`` on tpu: the fused op when :func:`_choose` picks it, else torch's math path."""
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(
            "Expected query, key, and value to have the same dtype, but got query.dtype: "
            f"{query.dtype} key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if _choose(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) == int(SDPBackend.MATH):
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, _additive(attn_mask, query.dtype), dropout_p, is_causal, None, scale=scale,
            enable_gqa=enable_gqa)[0]
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    return torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        query, key, value, attn_mask, 0.0, is_causal, False, scale=scale)[0]


# Registered beside the op table: it refuses kernels for CompositeImplicitAutograd ops, and this one replaces
# the decomposition on purpose (autograd flows through the fused op's own derivative).
_LIBRARY = torch.library.Library("aten", "IMPL")
for _key in ("AutogradPrivateUse1", "PrivateUse1"):
    _LIBRARY.impl("scaled_dot_product_attention", scaled_dot_product_attention, _key)
