"""The graph ops of FlexAttention on the splash kernel: ``hf_tpu::masked_attention`` and its backward.

:mod:`.flex_attention` expands a FlexAttention operator the splash kernel computes into its mask and one of these
ops. Graph mode lowers them to :func:`hf_tpu.kernels.pallas.masked_attention` and its backward, with the logsumexp
in base 2 as FlexAttention's operators keep it; a graph that falls back to eager mode runs them as the dense
attention they compute.
"""

from __future__ import annotations

import math

import torch

from ..kernels import pallas
from .graph_ops import graph_lowering

_LIBRARY = torch.library.Library("hf_tpu", "FRAGMENT")  # row_updates defines ops of this namespace too
_LIBRARY.define("masked_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale, "
                "float? soft_cap=None) -> (Tensor, Tensor)")
_LIBRARY.define("masked_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, "
                "Tensor grad_out, Tensor mask, float scale, float? soft_cap=None) -> (Tensor, Tensor, Tensor)")


def _dense_scores(query, key, value, scale, soft_cap):
    """The (soft-capped) scores of every query and key, and the keys and values repeated for grouped heads."""
    group = query.size(1) // key.size(1)
    key, value = (t.repeat_interleave(group, dim=1).float() for t in (key, value))
    scores = query.float() @ key.transpose(-1, -2) * scale
    return (scores if soft_cap is None else soft_cap * torch.tanh(scores / soft_cap)), key, value


def _masked_attention_by_ops(query, key, value, mask, scale, soft_cap=None):
    scores, _, value = _dense_scores(query, key, value, scale, soft_cap)
    scores = scores.masked_fill(~mask, -math.inf)
    return (torch._safe_softmax(scores, -1) @ value).to(query.dtype), scores.logsumexp(-1) / math.log(2)


def _masked_attention_backward_by_ops(query, key, value, out, logsumexp, grad_out, mask, scale, soft_cap=None):
    scores, expanded_key, expanded_value = _dense_scores(query, key, value, scale, soft_cap)
    weights = torch.exp(scores.masked_fill(~mask, -math.inf)
                        - (logsumexp * math.log(2)).nan_to_num(neginf=0.0)[..., None])
    grad_out = grad_out.float()
    grad_scores = weights * (grad_out @ expanded_value.transpose(-1, -2) - (out.float() * grad_out).sum(-1, True))
    if soft_cap is not None:  # through soft_cap * tanh(s / soft_cap)
        grad_scores = grad_scores * (1 - (scores / soft_cap) ** 2)
    grouped = (*key.shape[:2], query.size(1) // key.size(1), *key.shape[2:])
    grad_key = (grad_scores.transpose(-1, -2) @ query.float() * scale).reshape(grouped).sum(2)
    grad_value = (weights.transpose(-1, -2) @ grad_out).reshape(grouped[:-1] + (value.size(-1),)).sum(2)
    return (grad_scores @ expanded_key * scale).to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


# torch ops, so that a graph holding them still runs op by op (a graph that falls back to eager mode) and traces
_LIBRARY.impl("masked_attention", _masked_attention_by_ops, "CompositeExplicitAutograd")
_LIBRARY.impl("masked_attention_backward", _masked_attention_backward_by_ops, "CompositeExplicitAutograd")


@graph_lowering("hf_tpu::masked_attention")
def masked_attention(query, key, value, mask, scale, soft_cap=None):
    """Attention where the boolean ``mask`` allows it (:func:`hf_tpu.kernels.pallas.masked_attention`) and the
    logsumexp of each query row in base 2, as FlexAttention's operator keeps it."""
    out, logsumexp = pallas.masked_attention(query, key, value, mask, scale=scale, soft_cap=soft_cap)
    return out, logsumexp / math.log(2)


@graph_lowering("hf_tpu::masked_attention_backward")
def masked_attention_backward(query, key, value, out, logsumexp, grad_out, mask, scale, soft_cap=None):
    """The gradients of :func:`masked_attention`'s output in its query, key and value, from its results."""
    return pallas.masked_attention_backward(query, key, value, out, logsumexp * math.log(2), grad_out, mask,
                                            scale=scale, soft_cap=soft_cap)
