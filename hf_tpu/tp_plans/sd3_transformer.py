"""diffusers' SD3Transformer2DModel (MMDiT), which has no upstream ``_tp_plan``: laid out as diffusers' own
Flux plan lays out its double-stream blocks.

Image and context streams: q, k, v colwise (heads split), their output projections rowwise; both
feed-forwards (GELU) colwise -> rowwise. The second self-attention of SD3.5's dual-attention blocks
(``attn2``) likewise. AdaLN modulation, QK norms, patch embedding and the output projection stay whole:
modulation indexes the full hidden dim. The last block's context stream is absent (``context_pre_only``):
its entries match nothing there, which is allowed for shipped plans.
"""

_ATTENTION = {"to_q": "colwise", "to_k": "colwise", "to_v": "colwise", "to_out.0": "rowwise"}
_CONTEXT = {"add_q_proj": "colwise", "add_k_proj": "colwise", "add_v_proj": "colwise", "to_add_out": "rowwise"}
_FEED_FORWARD = {"net.0.proj": "colwise", "net.2": "rowwise"}

TP_PLAN = {
    **{f"transformer_blocks.*.{attention}.{name}": style
       for attention in ("attn", "attn2") for name, style in _ATTENTION.items()},
    **{f"transformer_blocks.*.attn.{name}": style for name, style in _CONTEXT.items()},
    **{f"transformer_blocks.*.{ff}.{name}": style
       for ff in ("ff", "ff_context") for name, style in _FEED_FORWARD.items()},
}
