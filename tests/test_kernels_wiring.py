"""hf_tpu.kernels.enable: transformers models on tpu running the built-in Pallas kernels (in TPU interpret
mode here) give the logits, greedy tokens and gradients of the same models on hf_tpu's XLA lowerings."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_tpu.kernels
from conftest import tiny_llama
from hf_tpu.kernels.hub import tpu_mapping
from test_transformers_moe import INPUT_IDS, tiny_qwen3_moe

# Left-padded batch: the second sequence starts with two padding tokens.
PADDED_IDS = torch.tensor([[5, 9, 17, 33, 2, 8, 77, 100], [0, 0, 3, 4, 5, 6, 7, 8]])
PADDED_MASK = torch.tensor([[1] * 8, [0, 0] + [1] * 6])
CLOSE = dict(atol=1e-5, rtol=1e-5)


class _KernelLog(TorchDispatchMode):
    """The hf_tpu_kernels ops dispatched, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "hf_tpu_kernels":
            self.ops.append(func.name().split("::")[1])
        return func(*args, **(kwargs or {}))


def _with_kernels(model: torch.nn.Module) -> torch.nn.Module:
    return hf_tpu.kernels.enable(copy.deepcopy(model))  # a copy of the config too: enable changes it


pytestmark = pytest.mark.usefixtures("tpu_kernel_mapping")


@pytest.fixture(scope="module")
def llamas():
    plain = tiny_llama().to("tpu").eval()
    return plain, _with_kernels(plain)


@pytest.fixture(scope="module")
def qwen3_moes():
    plain = tiny_qwen3_moe(torch.float32).to("tpu")
    return plain, _with_kernels(plain)


def test_llama_logits_match_on_a_left_padded_batch(llamas):
    plain, kernels = llamas
    ids, mask = PADDED_IDS.to("tpu"), PADDED_MASK.to("tpu")
    with torch.no_grad(), _KernelLog() as log:
        actual = kernels(ids, attention_mask=mask).logits
    expected = plain(ids, attention_mask=mask).logits.detach()
    assert log.ops.count("attention") == 2 and log.ops.count("rms_norm") == 2 * 2 + 1
    assert log.ops.count("activation") == 2  # the MLPs' SiLU
    assert plain.config._attn_implementation == "sdpa" and kernels.config._attn_implementation == "tpu_pallas"
    # padding positions attend no key: their values are unspecified
    real = PADDED_MASK.bool()
    torch.testing.assert_close(actual.cpu()[real], expected.cpu()[real], **CLOSE)


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded batch", "one sequence"])
def test_llama_greedy_tokens_match(llamas, padded):
    plain, kernels = llamas
    inputs = dict(input_ids=PADDED_IDS, attention_mask=PADDED_MASK) if padded else dict(input_ids=PADDED_IDS[:1])
    inputs = {name: value.to("tpu") for name, value in inputs.items()}
    expected = plain.generate(**inputs, max_new_tokens=3, do_sample=False)
    with _KernelLog() as log:
        actual = kernels.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(actual.cpu(), expected.cpu())
    # an unmasked one-token step runs the decode kernel over the cache; a masked one, the flash kernel
    assert ("decode_attention" in log.ops) != padded


def test_llama_loss_gradients_match(llamas):
    plain, kernels = llamas
    ids, mask = PADDED_IDS.to("tpu"), PADDED_MASK.to("tpu")
    # no loss on logits at padding positions (unspecified, see above): those predict the labels at padding
    # and at each sequence's first token (the label after the padding, hence the roll)
    labels = ids.masked_fill((mask == 0) | (mask.roll(1, dims=1) == 0), -100)
    grads = []
    for model in (plain, kernels):
        loss = model(ids, attention_mask=mask, labels=labels).loss
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for name, expected, actual in zip(dict(plain.named_parameters()), *grads):
        torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=1e-4, rtol=1e-4, msg=name)


def test_qwen3_moe_logits_and_greedy_tokens_match(qwen3_moes):
    plain, kernels = qwen3_moes
    ids = INPUT_IDS.to("tpu")
    with torch.no_grad(), _KernelLog() as log:
        actual = kernels(ids).logits
    expected = plain(ids).logits.detach()
    assert log.ops.count("grouped_matmul") == 2 * 2  # gate_up and down projections of 2 layers
    assert kernels.config._experts_implementation == "tpu_pallas"
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **CLOSE)
    expected_tokens = plain.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(kernels.generate(ids, max_new_tokens=3, do_sample=False).cpu(), expected_tokens.cpu())


def test_rms_norms_and_activations_are_kernelized_through_the_layer_mapping(llamas):
    plain, kernels = llamas
    layer = kernels.model.layers[0]
    assert kernels.use_kernels and not plain.use_kernels
    for module, name in ((kernels.model.norm, "RMSNorm"), (layer.mlp.act_fn, "SiLU")):
        assert module.forward.__func__ is tpu_mapping()[name]["tpu"].load().forward
    assert "forward" not in vars(plain.model.norm) and "forward" not in vars(plain.model.layers[0].mlp.act_fn)


def test_a_model_not_on_tpu_is_refused():
    with pytest.raises(ValueError, match=r"parameters on cpu.*model.to\('tpu'\)"):
        hf_tpu.kernels.enable(tiny_llama(num_hidden_layers=1))
    with pytest.raises(TypeError, match="takes a transformers model"):
        hf_tpu.kernels.enable(torch.nn.Linear(2, 2).to("tpu"))


def test_compiled_models_keep_the_kernels_in_one_graph(llamas, qwen3_moes):
    """Under torch.compile(fullgraph=True) the kernels are ops of the one graph: same logits as eager."""
    for plain, kernels in (llamas, qwen3_moes):
        ids = INPUT_IDS.to("tpu")
        compiled = torch.compile(kernels, backend="tpu", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids).logits.cpu(), plain(ids).logits.cpu(), **CLOSE)
