"""The built-in Pallas kernels wired into transformers models on tpu: :func:`enable`.

Torch ops made with :func:`~hf_tpu.kernels.jax_op` over :mod:`hf_tpu.kernels.pallas` serve transformers'
registration points:

- attention (``AttentionInterface``, with ``sdpa_mask`` in ``AttentionMaskInterface``, under the name
  :data:`NAME`): ``flash_attention`` for prefill, training and masked steps, ``decode_attention`` for
  unmasked one-token inference steps over the KV cache;
- experts (``ExpertsInterface``, under :data:`NAME`): transformers' ``grouped_mm`` experts computed with
  ``grouped_matmul``;
- RMSNorm and the activations: transformers' Hub-kernel layer mapping (``model.set_use_kernels(True)``),
  whose tpu entries are hf_tpu's kernel repositories (:mod:`hf_tpu.kernels.hub`, wired in by
  :mod:`hf_tpu.integrations.hub_kernels`): the ``rms_norm`` kernel and one elementwise op per activation.

Off TPU chips the kernels run in TPU interpret mode: correct, slow, for testing. On TPU chips
(``hf_tpu.kernels.pallas.use_by_default()``) is where they pay off; hf_tpu does not enable them itself.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import torch
import transformers
from transformers.integrations.moe import ExpertsInterface
from transformers.masking_utils import sdpa_mask

from . import pallas
from .jax_interop import jax_op

NAME = "tpu_pallas"
"""The attention and experts implementation name (transformers routes names containing "flash",
"sdpa" or "flex_attention" to its own integrations)."""


@jax_op("hf_tpu_kernels::attention")
def attention(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: Optional[jax.Array], causal: bool, scale: float
) -> jax.Array:
    """Softmax attention of ``query[B, Hq, S, D]`` over ``key``/``value[B, Hkv, Sk, D]``, as ``[B, S, Hq, D]``.

    ``mask``: bool, broadcasting to ``[B, Hq, S, Sk]``, True = attend; ``causal``: top-left aligned.
    """
    out = pallas.flash_attention(query, key, value, mask, causal=causal, scale=scale)
    return jnp.swapaxes(out, 1, 2)


@jax_op("hf_tpu_kernels::decode_attention")
def decode_attention(query: jax.Array, key: jax.Array, value: jax.Array, scale: float) -> jax.Array:
    """One query token ``query[B, Hq, 1, D]`` attending all of ``key``/``value[B, Hkv, Sk, D]``, as
    ``[B, 1, Hq, D]``. Forward only."""
    batch, _, kv_len, _ = key.shape
    out = pallas.decode_attention(query[:, :, 0], key, value, jnp.full((batch,), kv_len, jnp.int32), scale=scale)
    return out[:, None]


@jax_op("hf_tpu_kernels::grouped_matmul")
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, transpose_rhs: bool) -> jax.Array:
    """``lhs[m] @ rhs[g]`` (``rhs[g].T`` with ``transpose_rhs``) for the rows ``m`` of group ``g``; the rows of
    ``lhs[M, K]`` are sorted by group and ``group_sizes[G]`` counts them."""
    return pallas.grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function (``sdpa_attention_forward``'s semantics) on the Pallas kernels.

    ``query[B, Hq, S, D]``, ``key``/``value[B, Hkv, Sk, D]``; ``attention_mask`` is ``sdpa_mask``'s bool
    ``[B, 1, S, Sk]`` or None, which means causal (top-left aligned, as ``is_causal``) for ``S > 1`` and all
    keys for one query token. Returns ``(out[B, S, Hq, D], None)``.
    """
    unsupported = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
    if dropout or unsupported:
        raise NotImplementedError(f"{NAME} attention supports no dropout, softcap or attention sinks "
                                  f"(got dropout={dropout}, {', '.join(unsupported) or 'no others'})")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise TypeError(f"{NAME} attention takes the boolean mask of transformers' sdpa_mask, not a "
                        f"{attention_mask.dtype} one")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    one_token = query.shape[2] == 1
    if one_token and attention_mask is None and not query.requires_grad:
        return decode_attention(query, key, value, scale), None
    causal = bool(is_causal) and not one_token and attention_mask is None
    return attention(query, key, value, attention_mask, causal, scale), None


def experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts forward on ``grouped_matmul``: ``hidden_states[T, H]``, each token
    sent to the experts ``top_k_index[T, k]`` with weights ``top_k_weights[T, k]``; returns ``[T, H]``."""
    if self.has_bias or self.has_post_expert_norm or self._is_expert_parallel:
        raise NotImplementedError(f"{NAME} experts support no expert biases, post-expert norms or expert "
                                  f"parallelism ({type(self).__name__} uses one)")
    num_tokens, top_k = top_k_index.shape
    # (token, k) pairs sorted by expert; each row of the sorted pairs is its token's hidden state
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    group_sizes = torch.histc(expert_ids.int(), bins=self.num_experts, min=0, max=self.num_experts - 1).int()
    up_proj = self.gate_up_proj if self.has_gate else self.up_proj
    # transformers stores [E, out, in] weights unless is_transposed: the kernel reads those transposed
    transpose_rhs = not self.is_transposed
    projected = grouped_matmul(hidden_states[order // top_k].to(up_proj.dtype), up_proj, group_sizes, transpose_rhs)
    activated = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    out = grouped_matmul(activated, self.down_proj, group_sizes, transpose_rhs)
    weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = weighted[order.argsort()]
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Runs ``model``, a transformers model on tpu, on the Pallas kernels; returns it (changed in place).

    Sets its attention implementation (``model.set_attn_implementation``, which changes ``model.config``)
    and, for a mixture-of-experts model, its experts implementation to :data:`NAME`, and kernelizes it
    (``model.set_use_kernels(True)``: transformers' layer mapping, re-applied when ``train()``/``eval()``
    change the mode), which gives its ``@use_kernel_forward_from_hub("RMSNorm")`` modules and hub-kernel
    activations hf_tpu's kernels (registered in kernels' mapping for the rest of the process). Off TPU chips the
    kernels run in TPU interpret mode (slow: for testing).
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"hf_tpu.kernels.enable takes a transformers model or a diffusers model or pipeline, not "
                        f"{type(model).__name__}")
    elsewhere = sorted({str(p.device) for p in model.parameters() if p.device.type != "tpu"})
    if elsewhere:
        raise ValueError(f"hf_tpu.kernels.enable: the model has parameters on {', '.join(elsewhere)}; the kernels run "
                         "on tpu tensors: move the model with model.to('tpu') first")
    model.set_attn_implementation(NAME)
    model.set_experts_implementation(NAME)  # no change for a model without experts
    # transformers' default mapping has hf_tpu's layers only where the kernels run natively (see
    # integrations/hub_kernels.py); asked for here, they join kernels' mapping on every platform
    from kernels import register_kernel_mapping

    from .hub import tpu_mapping

    register_kernel_mapping(tpu_mapping())
    model.set_use_kernels(True)
    return model


transformers.AttentionInterface.register(NAME, attention_forward)
transformers.AttentionMaskInterface.register(NAME, sdpa_mask)
ExpertsInterface.register(NAME, experts_forward)

__all__ = ["NAME", "enable"]
