"""diffusers' PixArtTransformer2DModel, which has no upstream ``_tp_plan``.

Each block's self-attention (``attn1``) and cross-attention to the caption (``attn2``): q, k, v colwise
(heads split) and the output projection rowwise; the feed-forward (GELU) colwise -> rowwise. The AdaLN-single
modulation, the caption projection, the patch embedding and the output projection stay whole.
"""

_ATTENTION = {"to_q": "colwise", "to_k": "colwise", "to_v": "colwise", "to_out.0": "rowwise"}

TP_PLAN = {
    **{f"transformer_blocks.*.{attention}.{name}": style
       for attention in ("attn1", "attn2") for name, style in _ATTENTION.items()},
    "transformer_blocks.*.ff.net.0.proj": "colwise",
    "transformer_blocks.*.ff.net.2": "rowwise",
}
