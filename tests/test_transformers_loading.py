"""Where from_pretrained puts a model (device_map 0, "auto", "tpu:1", dicts over chips), accelerate's view
of the device, save_pretrained from tpu and the round trip through safetensors, and transformers' own
test tooling with TRANSFORMERS_TEST_DEVICE=tpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
import transformers

from conftest import tiny_llama

TOLERANCE = dict(atol=1e-4, rtol=1e-4)
INPUT_IDS = torch.tensor([[5, 9, 17, 33, 2, 8]])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    tiny_llama(tie_word_embeddings=False).save_pretrained(path)
    return str(path)


@pytest.fixture
def fresh_accelerate_state(monkeypatch):
    """accelerate keeps its device in a process-wide singleton: start and leave it unset."""
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE", raising=False)
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.mark.parametrize("device_map", [0, "auto", {"": "tpu:0"}], ids=["index", "auto", "dict"])
def test_device_map_places_the_model_on_tpu(llama_dir, device_map):
    expected = transformers.LlamaForCausalLM.from_pretrained(llama_dir)(INPUT_IDS).logits
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir, device_map=device_map)
    assert {p.device for p in model.parameters()} == {torch.device("tpu:0")}
    with torch.no_grad():
        actual = model(INPUT_IDS.to("tpu")).logits
    torch.testing.assert_close(actual.cpu(), expected.detach(), **TOLERANCE)


def test_tpu_loads_read_each_weight_once_into_a_buffer_the_device_keeps(llama_dir, monkeypatch):
    from hf_tpu.backend.ops import memory
    from hf_tpu.integrations import transformers as integration

    reads = []
    read = integration.SafetensorsReader.read
    monkeypatch.setattr(
        integration.SafetensorsReader, "read", lambda self, entry: reads.append(entry) or read(self, entry)
    )
    transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    assert reads == []  # cpu loads keep transformers' mapped reader
    transformers.LlamaForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    with safetensors.safe_open(os.path.join(llama_dir, "model.safetensors"), "pt") as checkpoint:
        assert len(reads) == len(checkpoint.keys())
    assert not memory._handed_over  # every buffer went to the device


def test_grouped_mm_is_chosen_for_tpu_experts():
    from transformers.integrations.moe import _can_use_grouped_mm

    tokens, weights = torch.ones(4, 8, device="tpu"), torch.ones(2, 8, 4, device="tpu")
    assert _can_use_grouped_mm(tokens, weights, torch.tensor([2, 4], dtype=torch.int32, device="tpu"))


def test_accelerate_plans_with_tpu_memory():
    from accelerate.utils import get_max_memory

    planned = get_max_memory()
    assert [key for key in planned if isinstance(key, int)] == list(range(torch.tpu.device_count()))
    assert planned[0] == pytest.approx(torch.tpu.mem_get_info(0)[0], rel=0.2)
    assert get_max_memory({0: "1GB", "cpu": 1000}) == {0: 10**9, "cpu": 1000}
    with pytest.raises(ValueError, match="max_memory names tpu:7"):
        get_max_memory({7: 1000})


def test_accelerate_plans_tpu_memory_where_cuda_is_there_too(monkeypatch):
    """accelerate's own plan lists CUDA's memory by index where CUDA is there (simulated); while tpu is the
    accelerator (``torch.device(0)`` is ``tpu:0``), the indices are tpu chips, with the chips' memory."""
    from hf_tpu.integrations import accelerate as integration

    cuda_plan = {0: 7 * 10**12, "cpu": 1000}
    planned = integration._get_max_memory(lambda max_memory=None: dict(cuda_plan))()
    assert planned == {**{index: pytest.approx(torch.tpu.mem_get_info(index)[0], rel=0.2)
                          for index in range(torch.tpu.device_count())}, "cpu": 1000}
    assert torch.device(0).type == "tpu"


def test_accelerator_device_is_tpu_without_environment_variables(fresh_accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator()
    assert accelerator.device == torch.device("tpu")
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    assert model.weight.device.type == "tpu"


def test_accelerator_picks_tpu_over_cuda_as_transformers_does(fresh_accelerate_state, monkeypatch):
    """On a machine with CUDA (simulated: accelerate's own choice is cuda), accelerate picks tpu, as
    ``TrainingArguments.device`` does, so that a Trainer's model and batches meet; ``ACCELERATE_TORCH_DEVICE``
    keeps its choice."""
    from accelerate.state import PartialState

    from hf_tpu.integrations import accelerate as integration

    chosen = integration._default_device(lambda state: torch.device("cuda", 0))
    assert chosen(None) == torch.device("tpu")
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cuda")
    assert chosen(None) == torch.device("cuda", 0)
    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert PartialState().device == torch.device("tpu")
    assert transformers.TrainingArguments(output_dir="unused", report_to=[]).device.type == "tpu"


def test_accelerator_on_cpu_when_asked(fresh_accelerate_state):
    from accelerate import Accelerator

    assert Accelerator(cpu=True).device == torch.device("cpu")


_MULTI_CHIP_SCRIPT = r"""
import json, sys
import torch, transformers
from transformers import testing_utils

directory = sys.argv[1]
cpu = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
ids = torch.tensor([[5, 9, 17, 33, 2, 8]])
expected = cpu(ids).logits
greedy = cpu.generate(ids, max_new_tokens=3, do_sample=False).tolist()
size = sum(p.numel() * p.element_size() for p in cpu.parameters())
report = {}
for name, options in (
    ("tpu:1", {"device_map": "tpu:1"}),
    ("two chips", {"device_map": {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
                                  "model.layers.1": 1, "model.norm": 1, "lm_head": 1}}),
    ("auto over two chips", {"device_map": "auto", "max_memory": {0: size // 2, 1: 2 * size}}),
):
    model = transformers.LlamaForCausalLM.from_pretrained(directory, **options).eval()
    first = model.model.embed_tokens.weight.device
    with torch.no_grad():
        logits = model(ids.to(first)).logits
    report[name] = {
        "devices": {n: str(p.device) for n, p in model.named_parameters()},
        "logits": (logits.cpu() - expected).abs().max().item(),
        "greedy": model.generate(ids.to(first), max_new_tokens=3, do_sample=False).cpu().tolist() == greedy,
    }

tools = {"torch_device": testing_utils.torch_device, "device_count": testing_utils.backend_device_count("tpu")}
x = torch.ones(1024, device="tpu")
testing_utils.backend_manual_seed("tpu", 3)
first = torch.rand(4, device="tpu").cpu()
testing_utils.backend_manual_seed("tpu", 3)
tools["seeded"] = torch.equal(first, torch.rand(4, device="tpu").cpu())
testing_utils.backend_synchronize("tpu")
testing_utils.backend_empty_cache("tpu")
testing_utils.backend_reset_peak_memory_stats("tpu")
tools["allocated"] = testing_utils.backend_memory_allocated("tpu") >= x.nbytes
tools["peak"] = testing_utils.backend_max_memory_allocated("tpu") >= x.nbytes
tools["module"] = testing_utils.backend_torch_accelerator_module("tpu") is torch.tpu
report["testing_utils"] = tools
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def two_chip_report(llama_dir) -> dict:
    """Runs the script above once with two virtual chips and TRANSFORMERS_TEST_DEVICE=tpu (both must be
    set before the device and transformers.testing_utils start)."""
    environment = dict(
        os.environ, HF_TPU_NUM_DEVICES="2", HF_TPU_PLATFORM="cpu", TRANSFORMERS_TEST_DEVICE="tpu",
        HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
    )
    result = subprocess.run(
        [sys.executable, "-c", _MULTI_CHIP_SCRIPT, llama_dir], env=environment, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_device_map_names_a_second_chip(two_chip_report):
    report = two_chip_report["tpu:1"]
    assert set(report["devices"].values()) == {"tpu:1"}
    assert report["logits"] < 1e-4 and report["greedy"]


def test_device_map_dict_splits_layers_over_two_chips(two_chip_report):
    report = two_chip_report["two chips"]
    devices = report["devices"]
    assert devices["model.layers.0.self_attn.q_proj.weight"] == "tpu:0"
    assert devices["model.layers.1.self_attn.q_proj.weight"] == devices["lm_head.weight"] == "tpu:1"
    assert report["logits"] < 1e-4 and report["greedy"]


def test_device_map_auto_spreads_over_chips_by_their_memory(two_chip_report):
    report = two_chip_report["auto over two chips"]
    assert report["devices"]["model.embed_tokens.weight"] == "tpu:0"
    assert report["devices"]["lm_head.weight"] == "tpu:1"
    assert report["logits"] < 1e-4 and report["greedy"]


def test_transformers_testing_utils_run_on_tpu(two_chip_report):
    assert two_chip_report["testing_utils"] == {
        "torch_device": "tpu", "device_count": 2, "seeded": True, "allocated": True, "peak": True, "module": True,
    }


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on the host, for bit-exact comparison (NaN payloads and -0.0 included)."""
    return tensor.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_save_pretrained_round_trip_is_bit_exact(tmp_path, dtype):
    model = tiny_llama().to("tpu", dtype)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in saved  # the tied copy is saved once
    state = model.state_dict()
    for name, tensor in saved.items():
        assert tensor.dtype == dtype and torch.equal(tensor.view(torch.uint8), _bits(state[name])), name

    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map="tpu", dtype=dtype)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, tensor in loaded.state_dict().items():
        assert tensor.device.type == "tpu" and torch.equal(_bits(tensor), _bits(state[name])), name


DTYPES = [
    torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
]


def test_safetensors_round_trip_of_every_dtype(tmp_path):
    generator = torch.Generator().manual_seed(0)
    host = {}
    for dtype in DTYPES:
        values = torch.randn(3, 5, generator=generator, dtype=torch.float64) * 100
        values[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.float64)
        host[str(dtype)] = values.to(dtype)
    on_tpu = {name: tensor.to("tpu") for name, tensor in host.items()}
    path = tmp_path / "tensors.safetensors"
    safetensors.torch.save_file(on_tpu, path)
    back = safetensors.torch.load_file(path, device=0)  # safetensors takes an index, not "tpu"
    for name, tensor in host.items():
        assert back[name].device == torch.device("tpu:0") and back[name].dtype == tensor.dtype, name
        assert torch.equal(_bits(back[name]), _bits(tensor)), name


def test_releases_without_a_tpu_compile_default_get_the_tpu_backend():
    """The hook for 5.x releases whose get_compiled_call builds ``CompileConfig()`` (inductor) itself."""
    from types import SimpleNamespace

    from hf_tpu.integrations.transformers import _install_compile_default

    class OlderModel:
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

        def get_compiled_call(self, compile_config):
            return compile_config

    _install_compile_default(SimpleNamespace(PreTrainedModel=OlderModel))
    config = OlderModel("tpu").get_compiled_call(None)
    assert (config.backend, config.dynamic, config.mode) == ("tpu", False, "default")
    assert OlderModel("cpu").get_compiled_call(None) is None
    user_config = transformers.CompileConfig(backend="eager")
    assert OlderModel("tpu").get_compiled_call(user_config) is user_config


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_checkpoint_with_a_wrong_parameter_behaves_as_on_cpu(change, tmp_path):
    """A wrong shape fails with transformers' mismatch error; a wrong dtype is cast, as on the CPU."""
    tiny_llama(tie_word_embeddings=False).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = torch.zeros(3, 5) if change == "shape" else tensors[key].to(torch.int32)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    outcomes = {}
    for device in ("cpu", "tpu"):
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device)
            outcomes[device] = dict(model.named_parameters())[key].detach().cpu()
        except RuntimeError as error:
            outcomes[device] = str(error)
    if change == "shape":
        assert "ignore_mismatched_sizes" in outcomes["cpu"]
        assert outcomes["tpu"] == outcomes["cpu"]
    else:
        assert outcomes["tpu"].dtype == outcomes["cpu"].dtype == torch.float32
        assert torch.equal(outcomes["tpu"], outcomes["cpu"])
