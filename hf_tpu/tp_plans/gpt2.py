"""GPT-2 (transformers ``gpt2``), which has no upstream plan. Relative to the base model (``GPT2Model``).

GPT-2's projections are ``Conv1D``, whose weight is ``[in_features, out_features]``: the translation knows
(colwise splits its dim 1, rowwise its dim 0). ``c_attn`` packs q, k and v along its output: a contiguous
split would put whole q heads on some chips and k heads on others, so, like transformers' fused-qkv plans
(phi3), it is ``colwise_gather_output`` (its output gathered) and the attention output projection
``rowwise_split_input`` (its replicated input split on each chip). The MLP is the usual colwise -> rowwise
pair. The embeddings stay whole (GPT-2's vocabulary, 50257, is odd).
"""

TP_PLAN = {
    "h.*.attn.c_attn": "colwise_gather_output",
    "h.*.attn.c_proj": "rowwise_split_input",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}
