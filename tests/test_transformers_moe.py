"""Mixture of experts: aten::_grouped_mm (XLA's ragged dot) against the CPU, and Qwen3-MoE through
transformers' default grouped_mm experts path in eager and compiled mode."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_same, to_tpu
from hf_tpu.compile import compile_stats, reset_compile_stats

# float32 products run at full precision on both; bfloat16 ones accumulate in float32 and round once,
# but the CPU kernel may sum in another order.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


def offsets(*ends: int) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def column_major(matrix: torch.Tensor) -> torch.Tensor:
    """The same values with transposed strides, as the CPU kernel wants its second operand."""
    return matrix.transpose(-2, -1).contiguous().transpose(-2, -1)


@DTYPES
def test_rows_grouped_against_a_stack_of_matrices(dtype):
    """2-D x 3-D: the MoE forward. Group 1 is empty; rows past offs[-1] belong to no group."""
    torch.manual_seed(0)
    tokens, weights, offs = torch.randn(12, 16, dtype=dtype), torch.randn(3, 16, 8, dtype=dtype), offsets(4, 4, 10)
    expected = torch._grouped_mm(tokens, column_major(weights), offs=offs)[:10]
    actual = torch._grouped_mm(*to_tpu((tokens, column_major(weights))), offs=offs.to("tpu"))
    assert actual.shape == (12, 8)
    assert_same(actual[:10], expected, **TOLERANCES[dtype])
    assert not actual[10:].cpu().any()  # uninitialized on CPU and CUDA, zero here


@DTYPES
def test_contraction_grouped(dtype):
    """2-D x 2-D: K split into groups, one product each (the weight gradient of the MoE forward)."""
    torch.manual_seed(0)
    left, right, offs = torch.randn(8, 32, dtype=dtype), torch.randn(32, 8, dtype=dtype), offsets(8, 16, 32)
    expected = torch._grouped_mm(left, column_major(right), offs=offs)
    assert_same(torch._grouped_mm(*to_tpu((left, column_major(right), offs))), expected, **TOLERANCES[dtype])


@DTYPES
def test_columns_grouped_and_batched(dtype):
    """3-D x 2-D (columns of the second operand grouped) and 3-D x 3-D (a batched product, no offs)."""
    torch.manual_seed(0)
    stack, right, offs = torch.randn(3, 8, 16, dtype=dtype), torch.randn(16, 24, dtype=dtype), offsets(8, 16, 24)
    expected = torch._grouped_mm(stack, column_major(right), offs=offs)
    assert_same(torch._grouped_mm(*to_tpu((stack, column_major(right), offs))), expected, **TOLERANCES[dtype])
    other = column_major(torch.randn(3, 16, 8, dtype=dtype))
    assert_same(torch._grouped_mm(*to_tpu((stack, other))), torch._grouped_mm(stack, other), **TOLERANCES[dtype])


def test_gradients_match_a_loop_of_products():
    torch.manual_seed(0)
    tokens, weights, ends = torch.randn(10, 16), torch.randn(3, 16, 8), (3, 3, 10)
    tpu_tokens, tpu_weights = (t.to("tpu").requires_grad_() for t in (tokens, weights))
    tokens.requires_grad_(), weights.requires_grad_()
    starts = (0,) + ends[:-1]
    expected = torch.cat([tokens[s:e] @ weights[g] for g, (s, e) in enumerate(zip(starts, ends))])
    actual = torch._grouped_mm(tpu_tokens, tpu_weights, offs=offsets(*ends).to("tpu"))
    grad = torch.randn_like(expected)
    expected.backward(grad)
    actual.backward(grad.to("tpu"))
    assert_same(tpu_tokens.grad, tokens.grad, atol=1e-5, rtol=1e-5)
    assert_same(tpu_weights.grad, weights.grad, atol=1e-5, rtol=1e-5)


@DTYPES
def test_pallas_grouped_matmul_where_pallas_kernels_are_used(monkeypatch, dtype):
    """HF_TPU_PALLAS=1 takes the TPU chips' path here (the megablox kernel, interpreted): values and gradients
    match the CPU's loop of products. The shapes are this test's own, so no cached program without it is reused."""
    from hf_tpu.kernels import pallas

    calls, kernel = [], pallas.grouped_matmul
    monkeypatch.setattr(pallas, "grouped_matmul", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setenv("HF_TPU_PALLAS", "1")
    torch.manual_seed(0)
    tokens, weights, ends = torch.randn(14, 24, dtype=dtype), torch.randn(5, 24, 40, dtype=dtype), (2, 9, 9, 11, 13)
    tpu_tokens, tpu_weights = (t.to("tpu").requires_grad_() for t in (tokens, weights))
    tokens.requires_grad_(), weights.requires_grad_()
    starts = (0,) + ends[:-1]
    expected = torch.cat([tokens[s:e] @ weights[g] for g, (s, e) in enumerate(zip(starts, ends))])
    actual = torch._grouped_mm(tpu_tokens, tpu_weights, offs=offsets(*ends).to("tpu"))
    assert calls, "the Pallas grouped matmul was not used"
    assert_same(actual[:13], expected, **TOLERANCES[dtype])
    assert not actual[13:].cpu().any()
    grad = torch.randn_like(expected)
    expected.backward(grad)
    actual[:13].backward(grad.to("tpu"))
    assert_same(tpu_tokens.grad, tokens.grad, **TOLERANCES[dtype])
    assert_same(tpu_weights.grad, weights.grad, **TOLERANCES[dtype])


def test_bad_arguments_raise_like_cpu():
    tokens, weights, offs = to_tpu((torch.randn(4, 16), torch.randn(2, 16, 8), offsets(2, 4)))
    with pytest.raises(RuntimeError, match="same dtype"):
        torch._grouped_mm(tokens, weights.bfloat16(), offs=offs)
    with pytest.raises(RuntimeError, match="Bias not supported"):
        torch._grouped_mm(tokens, weights, offs=offs, bias=torch.zeros(2, 8, device="tpu"))
    with pytest.raises(RuntimeError, match="needs offs"):
        torch._grouped_mm(tokens, weights)


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        self.calls.append((func.name(), [t.dtype for t in tensors]))
        return func(*args, **kwargs)


def tiny_qwen3_moe(dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to(dtype).eval()


INPUT_IDS = torch.tensor([[5, 9, 17, 33, 2, 8, 77, 100], [1, 2, 3, 4, 5, 6, 7, 8]])


@DTYPES
def test_qwen3_moe_runs_the_grouped_mm_experts_path(dtype):
    cpu_model = tiny_qwen3_moe(dtype)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    with torch.no_grad():
        expected = cpu_model(INPUT_IDS).logits
        with _OpLog() as log:
            actual = tpu_model(INPUT_IDS.to("tpu")).logits
    grouped = [dtypes for name, dtypes in log.calls if name == "aten::_grouped_mm"]
    assert len(grouped) == 2 * 2  # the gate_up and down projections of 2 layers
    assert all(dtypes == [dtype, dtype, torch.int32] for dtypes in grouped)
    assert ("aten::histc", [torch.int32]) in log.calls  # transformers casts to float only on cpu and mps
    assert_same(actual, expected, **({"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {}))


def test_compiled_qwen3_moe_is_one_lowered_graph_matching_cpu():
    torch._dynamo.reset()  # earlier compiles of these modules must not push Dynamo into running them eagerly
    cpu_model = tiny_qwen3_moe(torch.bfloat16)
    compiled = torch.compile(copy.deepcopy(cpu_model).to("tpu"), backend="tpu")
    reset_compile_stats()
    with torch.no_grad():
        expected = cpu_model(INPUT_IDS).logits
        actual = compiled(INPUT_IDS.to("tpu")).logits
    stats = compile_stats()
    assert stats["graphs"] == 1 and stats["fallbacks"] == 0, stats  # no break at the experts
    assert_same(actual, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("experts", ["eager", "batched_mm"])
def test_compiled_qwen3_moe_with_the_other_experts_implementations_matches_cpu(experts):
    """transformers' loop over the hit experts (with its device-side asserts) and its gathered bmm, compiled."""
    cpu_model = tiny_qwen3_moe(torch.float32)
    cpu_model.set_experts_implementation(experts)
    compiled = torch.compile(copy.deepcopy(cpu_model).to("tpu"), backend="tpu")
    reset_compile_stats()
    with torch.no_grad():
        expected = cpu_model(INPUT_IDS).logits
        actual = compiled(INPUT_IDS.to("tpu")).logits
    assert compile_stats()["fallbacks"] == 0, compile_stats()
    assert_same(actual, expected, **TOLERANCES[torch.float32])


def test_grouped_mm_choice_is_patched_only_where_transformers_lacks_the_tpu_branch():
    from transformers.integrations import moe

    from hf_tpu.integrations import transformers as integration

    assert moe._can_use_grouped_mm.__module__ == "transformers.integrations.moe"  # 5.24 has the branch
    older = types.SimpleNamespace(_can_use_grouped_mm=lambda input, weight, offs: weight.device.type == "cuda")
    integration._install_grouped_mm(older)
    weight = torch.zeros(2, 2, 2, device="tpu")
    assert older._can_use_grouped_mm(weight[0], weight, None) is True
    assert older._can_use_grouped_mm(weight.cpu()[0], weight.cpu(), None) is False
