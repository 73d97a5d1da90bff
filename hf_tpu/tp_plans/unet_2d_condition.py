"""diffusers' UNet2DConditionModel, which has no upstream ``_tp_plan``.

The transformer blocks of every down, mid and up block: self- and cross-attention q, k, v colwise (heads
split) and the output projection rowwise; the feed-forward's GEGLU projection (value and gate packed along
its output) ``packed_colwise`` and its output rowwise. The resnets: ``conv1`` and the time embedding added
to its output split by output channel (colwise), ``conv2`` by input channel (rowwise, one all-reduce); the
GroupNorm between them normalizes whole groups on each chip when the tp size divides the group count.
The input/output convolutions, shortcuts, samplers and embeddings stay whole.
"""

_BLOCKS = ("down_blocks.*", "mid_block", "up_blocks.*")
_TRANSFORMER = {
    "attn1.to_q": "colwise", "attn1.to_k": "colwise", "attn1.to_v": "colwise", "attn1.to_out.0": "rowwise",
    "attn2.to_q": "colwise", "attn2.to_k": "colwise", "attn2.to_v": "colwise", "attn2.to_out.0": "rowwise",
    "ff.net.0.proj": "packed_colwise", "ff.net.2": "rowwise",
}
_RESNET = {"conv1": "colwise", "time_emb_proj": "colwise", "conv2": "rowwise"}

TP_PLAN = {
    **{f"{block}.attentions.*.transformer_blocks.*.{name}": style
       for block in _BLOCKS for name, style in _TRANSFORMER.items()},
    **{f"{block}.resnets.*.{name}": style for block in _BLOCKS for name, style in _RESNET.items()},
}
