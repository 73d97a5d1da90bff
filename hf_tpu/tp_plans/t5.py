"""T5 (transformers ``t5``: T5Model, T5ForConditionalGeneration, T5EncoderModel), which has no upstream plan.

Relative to the model (T5's heads are its own base model). Self- and cross-attention q, k, v colwise (heads
split) and o rowwise; the relative position bias (an embedding of ``[buckets, heads]``, in the first block
of each stack) split by head like the attention it biases; the feed-forward ``wi`` (or the gated pair
``wi_0``/``wi_1``, by ``feed_forward_proj``) colwise and ``wo`` rowwise. Entries for the variant a model
does not have match nothing, which is allowed for shipped plans.
"""

_ATTENTION = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
_FEED_FORWARD = {"wi": "colwise", "wi_0": "colwise", "wi_1": "colwise", "wo": "rowwise"}


def _stack(stack: str, feed_forward_layer: int, cross_attention: bool) -> dict[str, str]:
    plan = {f"{stack}.block.*.layer.0.SelfAttention.{name}": style for name, style in _ATTENTION.items()}
    plan[f"{stack}.block.*.layer.0.SelfAttention.relative_attention_bias"] = "embedding_colwise"
    if cross_attention:
        plan.update({f"{stack}.block.*.layer.1.EncDecAttention.{name}": style for name, style in _ATTENTION.items()})
    plan.update({f"{stack}.block.*.layer.{feed_forward_layer}.DenseReluDense.{name}": style
                 for name, style in _FEED_FORWARD.items()})
    return plan


TP_PLAN = {**_stack("encoder", 1, cross_attention=False), **_stack("decoder", 2, cross_attention=True)}
