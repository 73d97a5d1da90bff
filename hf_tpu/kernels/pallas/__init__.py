"""Pallas TPU kernels as plain JAX functions (JAX arrays in, JAX arrays out), with pure-JAX references.

- ``rms_norm``: transformers' ``LlamaRMSNorm`` (own row-block kernel, forward and backward);
- ``flash_attention``: ``scaled_dot_product_attention`` with causal, GQA, boolean and key-length
  masks (JAX's TPU flash-attention kernel, forward and backward);
- ``decode_attention``: one query token per sequence over a ``[B, Hkv, S_max, D]`` KV cache with
  per-sequence lengths (own kernel, forward only);
- ``masked_attention`` (and ``masked_attention_backward``): attention under a boolean mask that skips the blocks
  it masks whole (JAX's splash-attention kernels), FlexAttention's lowering;
- ``grouped_matmul``: the MoE experts' grouped matmul (JAX's megablox ``gmm``, forward and backward).

On TPU chips they compile with Mosaic; elsewhere they run in TPU interpret mode
(``interpret_unless_on_tpu``), which is slow. ``use_by_default()`` says whether hf_tpu prefers them
to its XLA-native lowerings (on TPU chips, or everywhere with ``HF_TPU_PALLAS=1``): then the op table
computes long unmasked ``scaled_dot_product_attention`` with ``flash_attention`` and the experts'
``_grouped_mm`` with ``grouped_matmul``, and graph mode a ``flex_attention`` without a score modification
with ``masked_attention``. ``references`` holds the formulas they are tested against.
"""

from .attention import decode_attention, flash_attention, flash_attention_with_logsumexp
from .grouped_matmul import grouped_matmul
from .masked_attention import masked_attention, masked_attention_backward
from .platform import interpret_unless_on_tpu, use_by_default
from .rms_norm import rms_norm

__all__ = [
    "decode_attention",
    "flash_attention",
    "flash_attention_with_logsumexp",
    "grouped_matmul",
    "interpret_unless_on_tpu",
    "masked_attention",
    "masked_attention_backward",
    "rms_norm",
    "use_by_default",
]
