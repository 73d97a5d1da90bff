"""scaled_dot_product_attention on tpu: the fused override against CPU, and proof that it is what runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from conftest import assert_same, tiny_llama, to_tpu
from hf_tpu.backend import dispatch

FUSED = "aten::_scaled_dot_product_fused_attention_overrideable"
FUSED_BACKWARD = "aten::_scaled_dot_product_fused_attention_overrideable_backward"
UNFUSED = ("aten::_scaled_dot_product_attention_math", "aten::_safe_softmax", "aten::bmm", "aten::_softmax")

torch.manual_seed(0)
Q, K, V = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
BOOL_MASK = torch.rand(5, 6) > 0.3
BOOL_MASK[:, 0] = True  # no fully masked row: CPU's flash kernel and math path disagree there


def sdpa_with_grads(q, k, v, mask=None, **kwargs):
    """Output and gradients of q, k, v (and of a floating-point mask) under a fixed non-uniform cotangent."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None
              for t in (q, k, v, mask)]
    out = F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], **kwargs)
    cotangent = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape).to(out.device)
    (out * cotangent).sum().backward()
    return out, [t.grad for t in leaves if t is not None and t.requires_grad]


def ops_run(fn, *args, **kwargs):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn(*args, **kwargs)
    return {event.name for event in profile.events()}


CASES = {
    "plain": dict(),
    "scale": dict(scale=0.3),
    "causal": dict(is_causal=True),
    "bool_mask": dict(mask=BOOL_MASK),
    "float_mask": dict(mask=torch.randn(2, 1, 5, 6)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_cpu_with_gradients(case):
    kwargs = dict(CASES[case])
    mask = kwargs.pop("mask", None)
    expected = sdpa_with_grads(Q, K, V, mask, **kwargs)
    actual = sdpa_with_grads(*to_tpu((Q, K, V, mask)), **kwargs)
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)


def test_grouped_query_attention():
    k, v = K[:, :2], V[:, :2]
    expected = sdpa_with_grads(Q, k, v, enable_gqa=True, is_causal=True)
    actual = sdpa_with_grads(*to_tpu((Q, k, v)), enable_gqa=True, is_causal=True)
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)


def test_three_dimensional_inputs_and_transposed_views():
    q, k, v = (t[0].transpose(-2, -1).contiguous().transpose(-2, -1) for t in (Q, K, V))
    expected = sdpa_with_grads(q, k, v)
    actual = sdpa_with_grads(*to_tpu((q, k, v)))
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)


def test_output_is_laid_out_like_the_query():
    """As on CPU: heads split off a (B, L, H*E) projection give an output that views back to (B, L, H*E)."""
    x = torch.randn(2, 5, 32)
    q = x.view(2, 5, 4, 8).transpose(1, 2)
    expected = F.scaled_dot_product_attention(q, q, q)
    q_tpu = x.to("tpu").view(2, 5, 4, 8).transpose(1, 2)
    actual = F.scaled_dot_product_attention(q_tpu, q_tpu, q_tpu)
    assert actual.stride() == expected.stride()
    assert_same(actual.transpose(1, 2).view(2, 5, 32), expected.transpose(1, 2).view(2, 5, 32), atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_give_zeros_like_the_math_path():
    mask = BOOL_MASK.clone()
    mask[1] = False
    with torch.nn.attention.sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    actual = F.scaled_dot_product_attention(*to_tpu((Q, K, V, mask)))
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(actual.cpu()[:, :, 1] == 0)


def test_bfloat16():
    """bf16 inputs, float32 softmax and accumulation: within bf16 rounding of the CPU result."""
    q, k, v = (t.bfloat16() for t in (Q, K, V))
    expected = sdpa_with_grads(q, k, v, is_causal=True)
    actual = sdpa_with_grads(*to_tpu((q, k, v)), is_causal=True)
    assert_same(actual, expected, atol=2e-2, rtol=2e-2)


def test_dropout_takes_the_math_path_and_respects_p():
    q, k, v = to_tpu((Q, K, V))
    assert torch._fused_sdp_choice(q, k, v, dropout_p=0.5) == int(SDPBackend.MATH)
    names = ops_run(F.scaled_dot_product_attention, q, k, v, dropout_p=1.0)
    assert "aten::_scaled_dot_product_attention_math" in names and FUSED not in names
    assert torch.all(F.scaled_dot_product_attention(q, k, v, dropout_p=1.0).cpu() == 0)


def test_choice_is_the_overrideable_backend():
    assert torch._fused_sdp_choice(*to_tpu((Q, K, V))) == int(SDPBackend.OVERRIDEABLE)


def test_eager_runs_the_fused_op_forward_and_backward():
    q, k, v = (t.requires_grad_() for t in to_tpu((Q, K, V)))
    forward = ops_run(F.scaled_dot_product_attention, q, k, v, is_causal=True)
    assert FUSED in forward and not forward & set(UNFUSED), sorted(forward)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    backward = ops_run(out.sum().backward)
    assert FUSED_BACKWARD in backward and not backward & set(UNFUSED), sorted(backward)


def test_inference_mode_runs_the_fused_op():
    with torch.inference_mode():
        names = ops_run(F.scaled_dot_product_attention, *to_tpu((Q, K, V)))
    assert FUSED in names and not names & set(UNFUSED)


@pytest.fixture
def traced_lowerings(monkeypatch):
    """Counts, per op, how often graph mode traced its lowering (the graph's ops, not eager dispatches)."""
    counts: dict[str, int] = {}
    for name in (FUSED, FUSED_BACKWARD, "aten::_safe_softmax", "aten::_softmax", "aten::bmm"):
        entry = dispatch.LOWERINGS[name.removeprefix("aten::")]

        def counting(*args, _fn=entry.fn, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(entry, "fn", counting)
    return counts


def test_compiled_graphs_hold_the_fused_ops(traced_lowerings):
    torch._dynamo.reset()
    k, v = K[:, :2], V[:, :2]
    mask = torch.randn(5, 6)

    def attention(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    expected = sdpa_with_grads(Q, k, v, mask, enable_gqa=True)
    compiled = torch.compile(attention, backend="tpu")
    leaves = [t.requires_grad_() for t in to_tpu((Q, k, v, mask))]
    out = compiled(*leaves)
    cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to("tpu")
    (out * cotangent).sum().backward()
    assert_same((out, [t.grad for t in leaves]), expected, atol=1e-5, rtol=1e-5)
    assert traced_lowerings.get(FUSED) == 1 and traced_lowerings.get(FUSED_BACKWARD) == 1, traced_lowerings
    assert not any(traced_lowerings.get(name) for name in UNFUSED), traced_lowerings


def test_transformers_sdpa_attention_uses_the_fused_op():
    model = tiny_llama(num_hidden_layers=1, attn_implementation="sdpa").eval()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        expected = model(ids).logits
        model.to("tpu")
        names = ops_run(model, ids.to("tpu"))
        actual = model(ids.to("tpu")).logits
    # the model's other ops may include a bmm (transformers 5.17's rotary embedding computes its angles with one)
    assert FUSED in names and not names & (set(UNFUSED) - {"aten::bmm"}), sorted(names)
    assert_same(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k, message", [
    (K[:, :3], "Number of heads in key and value must divide"),
    (K.half(), "Expected query, key, and value to have the same dtype"),
])
def test_bad_inputs_raise_as_on_cpu(k, message):
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match=message):
            F.scaled_dot_product_attention(Q.to(device), k.to(device), V[:, :k.size(1)].to(k.dtype).to(device),
                                           enable_gqa=True)


def test_long_attention_runs_on_the_flash_kernel_where_pallas_kernels_are_used(monkeypatch):
    """HF_TPU_PALLAS=1 takes the TPU chips' path here (JAX's flash kernel, interpreted) for long unmasked attention:
    output and gradients (causal), output and logsumexp (not causal) match the CPU, with grouped key/value heads.
    A shorter sequence keeps XLA's lowering."""
    from hf_tpu.kernels import pallas

    calls, kernel = [], pallas.flash_attention_with_logsumexp
    monkeypatch.setattr(pallas, "flash_attention_with_logsumexp", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setenv("HF_TPU_PALLAS", "1")
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 1024, 16), torch.randn(1, 1, 1040, 16), torch.randn(1, 1, 1040, 16)
    expected, expected_grads = sdpa_with_grads(q, k, v, is_causal=True, enable_gqa=True)
    actual, actual_grads = sdpa_with_grads(*to_tpu((q, k, v)), is_causal=True, enable_gqa=True)
    assert calls, "the flash kernel was not used"
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(actual_grads, expected_grads):
        assert_same(got, want, atol=1e-4, rtol=1e-4)

    k, v = torch.repeat_interleave(k, 2, dim=1), torch.repeat_interleave(v, 2, dim=1)
    out, logsumexp = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(*to_tpu((q, k, v)))[:2]
    assert_same(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    assert_same(logsumexp, torch.logsumexp(q @ k.transpose(-1, -2) / 4, dim=-1), atol=1e-5, rtol=1e-5)

    calls.clear()
    short = q[..., :512, :]
    assert_same(F.scaled_dot_product_attention(*to_tpu((short, k, v))), F.scaled_dot_product_attention(short, k, v),
                atol=1e-5, rtol=1e-5)
    assert not calls


def test_long_attention_with_a_boolean_mask_runs_on_the_splash_kernel_where_pallas_kernels_are_used(monkeypatch):
    """HF_TPU_PALLAS=1 takes the TPU chips' path here (JAX's splash kernel, interpreted) for long attention under a
    boolean mask: two packed sequences (block-diagonal, causal, as continuous batching's steps and packed training
    batches have them) with grouped key/value heads and a query row that attends no key (zeros, as on CPU): output
    and gradients match the CPU. An additive float mask keeps XLA's lowering."""
    from hf_tpu.kernels import pallas

    calls, kernel = [], pallas.masked_attention
    monkeypatch.setattr(pallas, "masked_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setenv("HF_TPU_PALLAS", "1")
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 200, 16), torch.randn(2, 1, 1040, 16), torch.randn(2, 1, 1040, 16)
    query, key = torch.arange(200)[:, None] * 5, torch.arange(1040)[None, :]
    mask = (key <= query) & ((key < 600) == (query < 600))  # [200, 1040]: queries of each sequence, its own keys
    mask[7] = False
    expected, expected_grads = sdpa_with_grads(q, k, v, mask, enable_gqa=True)
    actual, actual_grads = sdpa_with_grads(*to_tpu((q, k, v, mask)), enable_gqa=True)
    assert calls, "the splash kernel was not used"
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)
    assert actual[:, :, 7].eq(0).all()
    for got, want in zip(actual_grads, expected_grads):
        assert_same(got, want, atol=1e-4, rtol=1e-4)

    calls.clear()
    additive = torch.zeros(mask.shape).masked_fill(~mask, -1e9)
    assert_same(F.scaled_dot_product_attention(*to_tpu((q, k, v, additive)), enable_gqa=True),
                F.scaled_dot_product_attention(q, k, v, additive, enable_gqa=True), atol=1e-5, rtol=1e-5)
    assert not calls


def test_a_padding_mask_on_tpu_is_not_read_by_the_host(monkeypatch):
    """transformers asks whether a padding mask holds any padding (a host read) to pass SDPA ``is_causal``
    instead; on tpu the mask is kept, with the same logits, and nothing waits for the device."""
    from hf_tpu.backend import checks

    model = tiny_llama(num_hidden_layers=1, attn_implementation="sdpa").eval()
    ids, mask = torch.tensor([[1, 5, 9, 3, 7]]), torch.ones(1, 5, dtype=torch.long)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        model.to("tpu")
        model(ids.to("tpu"), attention_mask=mask.to("tpu"))  # compiles its ops first
        reads = []
        raise_pending = checks.raise_pending
        monkeypatch.setattr(checks, "raise_pending", lambda: (reads.append(1), raise_pending())[1])
        actual = model(ids.to("tpu"), attention_mask=mask.to("tpu")).logits
        assert not reads
        explained = torch._dynamo.explain(model)(ids.to("tpu"), attention_mask=mask.to("tpu"))
    assert_same(actual, expected, atol=1e-4, rtol=1e-4)
    assert explained.graph_break_count == 0, explained.break_reasons  # the patched check is traced
