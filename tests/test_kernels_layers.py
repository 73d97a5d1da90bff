"""transformers' Hub-kernel layer mapping on tpu (hf_tpu.integrations.hub_kernels): RMSNorm and the activations
of a tiny Llama are swapped for hf_tpu's kernel repositories (hf_tpu/kernels/hub, the Pallas RMSNorm in TPU
interpret mode here) and give the logits, greedy tokens and gradients of the same model without kernels, on
tpu and on cpu; a model that does not ask for kernels is left alone."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import logging
import sys
import types

import kernels
import pytest
import torch
import transformers
from kernels import Mode
from transformers import activations

from conftest import tiny_llama
from hf_tpu.integrations import hub_kernels as bridge
from hf_tpu.kernels import hub
from hf_tpu.kernels.hub import tpu_mapping
from hf_tpu.kernels.hub.ops import activation
from test_kernels_wiring import _KernelLog

CLOSE = dict(atol=1e-5, rtol=1e-5)
IDS = torch.tensor([[5, 9, 17, 33, 2, 8, 77, 100]])
ACTIVATIONS = {
    "SiLU": activations.SiLUActivation,
    "GeLU": activations.GELUActivation,
    "GeluTanh": activations.GELUTanh,
    "NewGELU": activations.NewGELUActivation,
    "FastGELU": activations.FastGELUActivation,
    "QuickGELU": activations.QuickGELUActivation,
}


def _layer_forward(name: str):
    """The forward of the layer ``name`` of hf_tpu's repositories, loaded as kernelize loads it."""
    return tpu_mapping()[name]["tpu"].load().forward


def _assert_kernelized(model: torch.nn.Module) -> None:
    norms = [m for m in model.modules() if isinstance(m, transformers.models.llama.modeling_llama.LlamaRMSNorm)]
    acts = [m for m in model.modules() if isinstance(m, activations.SiLUActivation)]
    assert len(norms) == 2 * 2 + 1 and len(acts) == 2
    assert all(m.forward.__func__ is _layer_forward("RMSNorm") for m in norms)
    assert all(m.forward.__func__ is _layer_forward("SiLU") for m in acts)


pytestmark = pytest.mark.usefixtures("tpu_kernel_mapping")


@pytest.fixture(scope="module")
def llamas():
    """The same tiny Llama (each with its own copy of the config): on cpu, on tpu, and kernelized on tpu."""
    cpu = tiny_llama().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    kernelized = copy.deepcopy(cpu).to("tpu")
    kernelized.set_use_kernels(True)
    return cpu, tpu, kernelized


def test_kernelized_logits_match_tpu_and_cpu(llamas):
    cpu, tpu, kernelized = llamas
    _assert_kernelized(kernelized)
    with torch.no_grad(), _KernelLog() as log:
        actual = kernelized(IDS.to("tpu")).logits.cpu()
    assert log.ops.count("rms_norm") == 5 and log.ops.count("activation") == 2
    with torch.no_grad():
        torch.testing.assert_close(actual, tpu(IDS.to("tpu")).logits.cpu(), **CLOSE)
        torch.testing.assert_close(actual, cpu(IDS).logits, **CLOSE)


def test_kernelized_greedy_tokens_match(llamas):
    cpu, _, kernelized = llamas
    expected = cpu.generate(IDS, max_new_tokens=4, do_sample=False)
    assert torch.equal(kernelized.generate(IDS.to("tpu"), max_new_tokens=4, do_sample=False).cpu(), expected)


def test_kernelized_gradients_match_in_training_mode():
    cpu = tiny_llama()
    kernelized = copy.deepcopy(cpu).to("tpu")
    kernelized.use_kernels = True  # kernelized for Mode.TRAINING: the model is in training mode
    _assert_kernelized(kernelized)
    grads = []
    for model, ids in ((cpu, IDS), (kernelized, IDS.to("tpu"))):
        loss = model(ids, labels=ids).loss
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for name, expected, actual in zip(dict(cpu.named_parameters()), *grads):
        torch.testing.assert_close(actual.cpu(), expected, atol=1e-5, rtol=1e-4, msg=name)


def test_a_model_that_does_not_ask_for_kernels_is_unchanged(llamas):
    cpu, tpu, _ = llamas
    for model in (cpu, tpu):
        assert not model.use_kernels
        assert not any("forward" in vars(module) for module in model.modules())
    # the classes carry the layer name (kernels is usable), and nothing else changed
    assert activations.SiLUActivation.kernel_layer_name == "SiLU"
    assert transformers.utils.import_utils.is_kernels_available()


def test_from_pretrained_with_use_kernels_on_tpu(llamas, tmp_path):
    cpu, _, _ = llamas
    cpu.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True, device_map="tpu")
    assert loaded.device.type == "tpu" and not loaded.training
    _assert_kernelized(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS.to("tpu")).logits.cpu(), cpu(IDS).logits, **CLOSE)


def test_transformers_kernelize_function_on_tpu(llamas):
    """transformers has no ``model.kernelize()`` method; its function ``hub_kernels.kernelize(model, mode)`` (what
    ``set_use_kernels`` calls) picks the tpu mapping from the model's device."""
    from transformers.integrations import hub_kernels

    cpu, _, _ = llamas
    model = copy.deepcopy(cpu).to("tpu")
    hub_kernels.kernelize(model, mode=Mode.INFERENCE)
    _assert_kernelized(model)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS.to("tpu")).logits.cpu(), cpu(IDS).logits, **CLOSE)


def test_kernel_config_with_a_local_repository(llamas, tmp_path):
    cpu, _, _ = llamas
    cpu.save_pretrained(tmp_path)
    path = hub.REPOSITORIES / hub.LAYERS["RMSNorm"]
    config = transformers.KernelConfig({"RMSNorm": f"{path}:RMSNorm"}, use_local_kernel=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, kernel_config=config, device_map="tpu")
    assert loaded.model.norm.forward.__func__ is _layer_forward("RMSNorm")
    # the config maps RMSNorm only: kernelize re-binds the activation's own forward
    assert loaded.model.layers[0].mlp.act_fn.forward.__func__ is activations.SiLUActivation.forward
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS.to("tpu")).logits.cpu(), cpu(IDS).logits, **CLOSE)


def _kernelized_copy(model: torch.nn.Module, mode: Mode) -> torch.nn.Module:
    """A copy of ``model`` on tpu kernelized by ``kernels`` itself, with hf_tpu's tpu mapping only."""
    copied = copy.deepcopy(model).to("tpu")
    with kernels.use_kernel_mapping(tpu_mapping()):
        kernels.kernelize(copied, mode=mode, device="tpu")
    _assert_kernelized(copied)  # not kept on the original forward: the layers support compile and backward
    return copied


def test_kernelized_model_under_torch_compile_for_inference(llamas):
    cpu, _, _ = llamas
    compiled = torch.compile(_kernelized_copy(cpu, Mode.INFERENCE | Mode.TORCH_COMPILE), backend="tpu",
                             fullgraph=True)
    with torch.no_grad():
        actual = compiled(IDS.to("tpu"), use_cache=False).logits.cpu()
        torch.testing.assert_close(actual, cpu(IDS, use_cache=False).logits, **CLOSE)


def test_kernelized_model_under_torch_compile_for_training():
    cpu = tiny_llama()
    model = _kernelized_copy(cpu, Mode.TRAINING | Mode.TORCH_COMPILE)
    compiled = torch.compile(model, backend="tpu", fullgraph=True)
    loss = compiled(IDS.to("tpu"), labels=IDS.to("tpu"), use_cache=False).loss
    expected_loss = cpu(IDS, labels=IDS, use_cache=False).loss
    torch.testing.assert_close(loss.cpu(), expected_loss.detach(), **CLOSE)
    actual = torch.autograd.grad(loss, list(model.parameters()))
    expected = torch.autograd.grad(expected_loss, list(cpu.parameters()))
    for name, want, got in zip(dict(cpu.named_parameters()), expected, actual):
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_layers_match_torch_on_cpu(name):
    module = ACTIVATIONS[name]()
    with kernels.use_kernel_mapping(tpu_mapping()):
        kernels.kernelize(module, mode=Mode.TRAINING, device="tpu", use_fallback=False)
    assert module.forward.__func__ is _layer_forward(name)
    x = torch.linspace(-6, 6, 97, dtype=torch.float32).reshape(1, 97)
    x_tpu = x.to("tpu").requires_grad_()
    actual = module(x_tpu)
    (grad,) = torch.autograd.grad(actual.sum(), x_tpu)
    x.requires_grad_()
    expected = ACTIVATIONS[name]()(x)
    torch.testing.assert_close(actual.cpu(), expected.detach(), **CLOSE)
    torch.testing.assert_close(grad.cpu(), torch.autograd.grad(expected.sum(), x)[0], **CLOSE)


@pytest.mark.parametrize("repository", sorted(set(hub.LAYERS.values())))
def test_repositories_record_the_digest_of_their_files(repository, caplog):
    """kernels 0.19 checks a build's files against the digest its metadata.json records (files that differ fail
    the load; without a digest it warns); 0.17 and 0.18 ignore it. After editing a repository's package, write
    the new sha256 (base64) of each file there."""
    variant = hub.REPOSITORIES / repository / "build" / "torch-tpu"
    files = {path.relative_to(variant).as_posix(): base64.b64encode(hashlib.sha256(path.read_bytes()).digest()).decode()
             for path in variant.rglob("*") if path.is_file() and path.name != "metadata.json"
             and "__pycache__" not in path.parts}
    assert json.loads((variant / "metadata.json").read_text())["digest"] == {"algorithm": "sha256", "files": files}
    with caplog.at_level(logging.WARNING):
        kernels.get_local_kernel(hub.REPOSITORIES / repository)
    assert "digest" not in caplog.text


def test_bad_inputs_are_refused_with_what_to_do():
    module = activations.SiLUActivation()
    with kernels.use_kernel_mapping(tpu_mapping()):
        kernels.kernelize(module, mode=Mode.INFERENCE, device="tpu")
    with pytest.raises(RuntimeError, match=r"on cpu; .*move it with .to\('tpu'\)"):
        module(torch.ones(3))  # a module kernelized for tpu, run on cpu tensors
    with pytest.raises(ValueError, match="unknown activation 'relu': use one of silu, gelu"):
        activation(torch.ones(3, device="tpu"), "relu")


def test_each_patch_is_a_no_op_where_upstream_does_it_right():
    # a kernels release transformers accepts (or none at all): the gate stays as it is
    for answer in (True, False):
        import_utils = types.SimpleNamespace(is_kernels_available=lambda *args, answer=answer: answer,
                                             KERNELS_MAX_VERSION="0.19.0")
        original = import_utils.is_kernels_available
        bridge._bridge_version_gate(import_utils)
        assert import_utils.is_kernels_available is original
    # a layer name with a tpu entry of its own keeps it; the others get hf_tpu's
    own = object()
    hub_kernels = types.SimpleNamespace(_build_kernel_mapping=lambda: {"RMSNorm": {"tpu": own}})
    bridge._add_tpu_mapping(hub_kernels)
    mapping = hub_kernels._build_kernel_mapping()
    assert mapping["RMSNorm"]["tpu"] is own and mapping["SiLU"]["tpu"].layer_name == "SiLU"


def test_registering_after_transformers_imported_its_hub_kernels_warns_and_changes_nothing():
    assert "transformers.integrations.hub_kernels" in sys.modules  # imported by the tests above
    import_utils = types.SimpleNamespace(KERNELS_MAX_VERSION="0.19.0",
                                         is_kernels_available=lambda MIN_VERSION="0.18.2", MAX_VERSION="": (
                                             MIN_VERSION == bridge.OLDEST_CHECKED_KERNELS))
    original = import_utils.is_kernels_available
    with pytest.warns(UserWarning, match=r"use_kernels and kernelize stay unavailable.*register hf_tpu .*before"):
        bridge._bridge_version_gate(import_utils)
    assert import_utils.is_kernels_available is original


def test_rms_norms_with_another_formula_keep_their_forward_on_tpu():
    """Olmo2's RMSNorm scales before the final cast: marked "RMSNorm" (as transformers 5.24 marks it; 5.25 no
    longer does), on tpu it keeps its own forward, Llama's takes the kernel; on cpu the condition decides as
    upstream (True)."""
    from transformers.integrations import hub_kernels
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    marked = hub_kernels.use_kernel_forward_from_hub("RMSNorm")(type("MarkedOlmo2RMSNorm", (Olmo2RMSNorm,), {}))
    model = torch.nn.ModuleDict({"llama": LlamaRMSNorm(8), "olmo2": marked(8)}).to("tpu")
    with kernels.use_kernel_mapping(tpu_mapping()):
        kernels.kernelize(model, device="tpu", mode=Mode.INFERENCE)
    assert model["llama"].forward.__func__ is _layer_forward("RMSNorm")
    assert model["olmo2"].forward.__func__ is Olmo2RMSNorm.forward
    assert marked.kernel_condition(marked(8))
