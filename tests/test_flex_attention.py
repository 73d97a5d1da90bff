"""torch's FlexAttention on tpu (hf_tpu/integrations/flex_attention.py, hf_tpu/compile/flex_attention.py): eager and
compiled, forward and backward, as a dense attention with the same score modification and mask computes it on CPU
(torch's own FlexAttention does not run backward on CPU), and transformers' ``attn_implementation="flex_attention"``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
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


def _inputs(batch=BATCH):
    generator = torch.Generator().manual_seed(0)
    shapes = ((batch, HEADS, LENGTH, DIM), (batch, KV_HEADS, LENGTH, DIM), (batch, KV_HEADS, LENGTH, DIM))
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _gradients(attention, device, batch=BATCH):
    tensors = [t.to(device).requires_grad_() for t in _inputs(batch)]
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


SPLASH_LENGTH = 200  # not a whole number of the kernel's 128-blocks
# documents of 100 tokens in example 0 and of 60 in example 1, packed
DOCUMENTS = torch.arange(SPLASH_LENGTH)[None, :] // torch.tensor([[100], [60]])


def _causal_documents(documents):
    """Causal within the documents of example 0, for every example: reads neither the example nor the head."""
    return lambda b, h, q_index, kv_index: (q_index >= kv_index) & (documents[0, q_index] == documents[0, kv_index])


def _causal_documents_per_example(documents):
    """Causal within each example's documents (TorchTitan's document masking): reads the example."""
    return lambda b, h, q_index, kv_index: (q_index >= kv_index) & (documents[b, q_index] == documents[b, kv_index])


def _causal_per_example_and_head(documents):
    """Reads the example and the head; query 0 of example 0, head 0 attends no key."""
    return lambda b, h, q_index, kv_index: (q_index >= kv_index) & ((kv_index + h + b) % 3 != 0)


# each mask_mod, the examples and heads of the mask it makes (only those it reads), and a soft cap of the scores
SPLASH_CASES = {"causal_documents": (_causal_documents, (1, 1), None),
                "documents_per_example": (_causal_documents_per_example, (BATCH, 1), None),
                "per_example_and_head": (_causal_per_example_and_head, (BATCH, HEADS), None),
                "soft_capped": (_causal_documents, (1, 1), 0.5)}


@pytest.mark.parametrize("mask_mod, mask_examples_and_heads, soft_cap", SPLASH_CASES.values(),
                         ids=SPLASH_CASES.keys())
def test_compiled_flex_attention_runs_the_splash_kernel_where_pallas_kernels_are_used(mask_mod, mask_examples_and_heads,
                                                                                      soft_cap, monkeypatch):
    """HF_TPU_PALLAS=1 takes the TPU chips' path here: a compiled FlexAttention without a score modification, or
    soft-capping its scores as transformers' Gemma 2 does, runs JAX's splash-attention kernel (interpreted) forward
    and backward, one program each, and its output and gradients equal a dense attention's on CPU, with grouped
    key/value heads, a mask reading a captured tensor, the example or the head, and a row with no key to attend
    (zeros, as FlexAttention gives). The mask has one example or head where the mask_mod reads none."""
    from hf_tpu.kernels import pallas

    masks, kernel = [], pallas.masked_attention
    monkeypatch.setattr(pallas, "masked_attention", lambda *a, **k: masks.append(a[3].shape[:2]) or kernel(*a, **k))
    monkeypatch.setenv("HF_TPU_PALLAS", "1")
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")
    generator = torch.Generator().manual_seed(0)
    shapes = ((BATCH, HEADS, SPLASH_LENGTH, DIM), (BATCH, KV_HEADS, SPLASH_LENGTH, DIM),
              (BATCH, KV_HEADS, SPLASH_LENGTH, DIM))
    inputs = [torch.randn(shape, generator=generator) for shape in shapes]
    weights = torch.randn(BATCH, HEADS, SPLASH_LENGTH, DIM, generator=generator)
    block_mask = create_block_mask(mask_mod(DOCUMENTS.to("tpu")), BATCH, HEADS, SPLASH_LENGTH, SPLASH_LENGTH,
                                   device="tpu")
    score_mod = None if soft_cap is None else (lambda score, b, h, q, kv: soft_cap * torch.tanh(score / soft_cap))
    flex = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                        enable_gqa=True))
    indices = torch.meshgrid(*(torch.arange(n) for n in (BATCH, HEADS, SPLASH_LENGTH, SPLASH_LENGTH)), indexing="ij")
    allowed = mask_mod(DOCUMENTS)(*indices)

    def dense(query, key, value):
        key, value = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (key, value))
        scores = query @ key.transpose(-1, -2) / DIM ** 0.5
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        return torch._safe_softmax(scores.masked_fill(~allowed, -torch.inf), -1) @ value

    def outputs_and_gradients(attention, device):
        tensors = [t.to(device).requires_grad_() for t in inputs]
        out = attention(*tensors)
        (out * weights.to(device)).sum().backward()
        return [out.detach().cpu(), *(t.grad.cpu() for t in tensors)]

    for result, reference in zip(outputs_and_gradients(flex, "tpu"), outputs_and_gradients(dense, "cpu")):
        torch.testing.assert_close(result, reference, rtol=1e-4, atol=1e-4)
    assert masks == [mask_examples_and_heads], "the splash kernel was not used once, with the mask expected"
    assert compile_stats()["fallbacks"] == 0


def test_a_new_batch_size_runs_the_splash_kernel_with_symbolic_sizes(monkeypatch):
    """Dynamo's recompile with a symbolic batch size (a trainer's last, smaller batch) keeps the splash kernel: each
    batch size's program runs it, with the values of causal attention on CPU."""
    from hf_tpu.compile import flex_attention as expansion
    from hf_tpu.kernels import pallas

    batches, kernel = [], pallas.masked_attention
    monkeypatch.setattr(pallas, "masked_attention", lambda *a, **k: batches.append(a[0].shape[0]) or kernel(*a, **k))
    symbolic, serves = [], expansion._kernel_serves

    def serves_and_records(graph_module, node, forward):
        symbolic.append(isinstance(node.args[0].meta["val"].shape[0], torch.SymInt))
        return serves(graph_module, node, forward)

    monkeypatch.setattr(expansion, "_kernel_serves", serves_and_records)
    monkeypatch.setenv("HF_TPU_PALLAS", "1")
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")
    flex = torch.compile(flex_attention)
    block_mask = create_block_mask(_causal, None, None, LENGTH, LENGTH, device="tpu")

    def causal(query, key, value):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)

    for batch in (3, 2):  # 2 (at least) on a graph of a symbolic batch size
        on_tpu = _gradients(lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=True), "tpu", batch)
        for result, reference in zip(on_tpu, _gradients(causal, "cpu", batch)):
            torch.testing.assert_close(result, reference, rtol=1e-4, atol=1e-4)
    assert batches == [3, 2]
    assert any(symbolic)


def test_flex_attention_with_a_score_modification_keeps_the_dense_expansion_where_pallas_kernels_are_used(monkeypatch):
    """The splash kernel has no score modification: such a FlexAttention is expanded as everywhere else, correctly."""
    from hf_tpu.kernels import pallas

    monkeypatch.setattr(pallas, "masked_attention", lambda *a, **k: pytest.fail("the splash kernel was used"))
    monkeypatch.setenv("HF_TPU_PALLAS", "1")
    test_flex_attention_forward_and_backward_match_a_dense_attention(True, monkeypatch)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_the_splash_kernels_ops_run_op_by_op_as_a_graph_falling_back_runs_them(device):
    """The graph ops the splash path puts in a graph (``hf_tpu::masked_attention`` and its backward) also run op by
    op, on any device: output, base-2 logsumexp and gradients as autograd gives for a dense attention with
    soft-capped scores, a row with no key to attend included (zeros, ``-inf``)."""
    import hf_tpu.compile.masked_attention  # noqa: F401  (defines the ops)

    generator = torch.Generator().manual_seed(1)
    query = torch.randn(BATCH, HEADS, 20, DIM, generator=generator)
    key, value = (torch.randn(BATCH, KV_HEADS, 30, DIM, generator=generator) for _ in range(2))
    mask = torch.rand(BATCH, HEADS, 20, 30, generator=generator) > 0.5
    mask[0, 1, 3] = False
    grad_out = torch.randn(BATCH, HEADS, 20, DIM, generator=generator)

    def dense(query, key, value):
        key, value = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (key, value))
        scores = (0.5 * torch.tanh(query @ key.transpose(-1, -2) * 0.3 / 0.5)).masked_fill(~mask, -torch.inf)
        return torch._safe_softmax(scores, -1) @ value, scores.logsumexp(-1)

    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    expected_out, expected_logsumexp = dense(*leaves)
    expected_out.backward(grad_out)
    on_device = [t.to(device) for t in (query, key, value, mask)]
    out, logsumexp = torch.ops.hf_tpu.masked_attention(*on_device, 0.3, 0.5)
    torch.testing.assert_close(out.cpu(), expected_out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logsumexp.cpu() * math.log(2), expected_logsumexp.detach(), rtol=1e-5, atol=1e-5)
    assert out[0, 1, 3].eq(0).all() and logsumexp[0, 1, 3].isneginf()
    gradients = torch.ops.hf_tpu.masked_attention_backward(*on_device[:3], out, logsumexp, grad_out.to(device),
                                                           on_device[3], 0.3, 0.5)
    for gradient, leaf in zip(gradients, leaves):
        torch.testing.assert_close(gradient.cpu(), leaf.grad, rtol=1e-5, atol=1e-5)
