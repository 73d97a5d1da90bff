"""BERT (transformers ``bert``), which has no upstream plan. Relative to the base model (``BertModel``).

Megatron's layout: the attention's q, k, v colwise (heads split) and its output dense rowwise, the
intermediate dense colwise and the output dense rowwise: one all-reduce per pair. Embeddings, LayerNorms,
the pooler and the heads stay whole (BERT's vocabulary, 30522, divides by neither 4 nor 8).
"""

TP_PLAN = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}
