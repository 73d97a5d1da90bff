"""torch's FlexAttention on tpu (hf_tpu/integrations/flex_attention.py, hf_tpu/compile/flex_attention.py): eager and
compiled, forward and backward, as a dense attention with the same score modification and mask computes it on CPU
(torch's own FlexAttention does not run backward on CPU), and transformers' ``attn_implementation="flex_attention"``.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from conftest import tiny_llama
from hf_tpu.compile import compile_stats

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

BATCH, HEADS, KV_HEADS, LENGTH, DIM = 2, 4, 2, 48, 16


def _causal(b, h, q_index, kv_index):
    return q_index >= kv_index


def _distance_bias(score, b, h, q_index, kv_index):
    return score - (q_index - kv_index).abs() * 0.05 + h


def _dense(query, key, value):
    """The same attention, written out: scores, the bias, the causal mask, softmax (grouped key/value heads)."""
    key, value = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (key, value))
    position = torch.arange(LENGTH)
    scores = query @ key.transpose(-1, -2) / DIM ** 0.5
    scores = scores - (position[:, None] - position[None, :]).abs() * 0.05 + torch.arange(HEADS)[:, None, None]
    scores = scores.masked_fill(position[:, None] < position[None, :], float("-inf"))
    return scores.softmax(-1) @ value


def _inputs():
    generator = torch.Generator().manual_seed(0)
    shapes = ((BATCH, HEADS, LENGTH, DIM), (BATCH, KV_HEADS, LENGTH, DIM), (BATCH, KV_HEADS, LENGTH, DIM))
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _gradients(attention, device, batch=BATCH):
    tensors = [t[:batch].to(device).requires_grad_() for t in _inputs()]
    out = attention(*tensors)
    (out * torch.linspace(-1, 1, DIM, device=device)).sum().backward()
    return [out.detach().cpu(), *(t.grad.cpu() for t in tensors)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_forward_and_backward_match_a_dense_attention(compiled, monkeypatch):
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")  # compiled: every graph one program, none op by op
    flex = torch.compile(flex_attention) if compiled else flex_attention
    mask = create_block_mask(_causal, BATCH, HEADS, LENGTH, LENGTH, device="tpu")

    def on_tpu(query, key, value):
        return flex(query, key, value, score_mod=_distance_bias, block_mask=mask, enable_gqa=True)

    expected = _gradients(_dense, "cpu")
    for result, reference in zip(_gradients(on_tpu, "tpu"), expected):
        torch.testing.assert_close(result, reference, rtol=1e-4, atol=1e-4)
    if compiled:
        stats = compile_stats()
        assert stats["fallbacks"] == 0 and stats["calls"] >= 2  # a forward program and a backward one


def test_a_new_batch_size_compiles_flex_attention_with_symbolic_sizes(monkeypatch):
    """A call with another batch size makes Dynamo recompile with symbolic sizes (automatic dynamic shapes, as a
    trainer's last, smaller batch does): the expansion takes them, still one program per graph, the same values."""
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")
    flex = torch.compile(flex_attention)

    def on_tpu(query, key, value):
        mask = create_block_mask(_causal, None, None, LENGTH, LENGTH, device="tpu")
        return flex(query, key, value, score_mod=_distance_bias, block_mask=mask, enable_gqa=True)

    for batch in (BATCH, 1, 3):
        for result, reference in zip(_gradients(on_tpu, "tpu", batch), _gradients(_dense, "cpu", batch)):
            torch.testing.assert_close(result, reference, rtol=1e-4, atol=1e-4)
    assert compile_stats()["fallbacks"] == 0


def test_transformers_flex_attention_on_tpu_gives_cpus_logits():
    cpu_model = tiny_llama(attn_implementation="flex_attention").eval()
    tpu_model = tiny_llama(attn_implementation="flex_attention").eval().to("tpu")
    reference = tiny_llama(attn_implementation="eager").eval()
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
        torch.testing.assert_close(cpu_model(tokens).logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(tpu_model(tokens.to("tpu")).logits.cpu(), expected, rtol=1e-4, atol=1e-4)
