"""The device-level API: torch.accelerator, torch.tpu (torch.cuda's names), Tensor/Module helpers."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

from hf_tpu.backend import runtime


def test_current_accelerator_is_tpu():
    assert torch.accelerator.current_accelerator().type == "tpu"
    assert torch.accelerator.is_available()


def test_accelerator_device_functions():
    assert torch.accelerator.device_count() == torch.tpu.device_count() >= 1
    assert torch.accelerator.current_device_index() == torch.tpu.current_device() == 0
    torch.ones(4, device="tpu").add_(1)
    torch.accelerator.synchronize()
    torch.accelerator.synchronize(0)


@pytest.mark.parametrize("namespace", [torch.accelerator, torch.accelerator.memory], ids=["accelerator", "memory"])
def test_accelerator_memory_functions(namespace):
    namespace.empty_cache()
    before = namespace.memory_allocated()
    kept = torch.ones(1024, device="tpu")
    assert namespace.memory_allocated() == before + kept.untyped_storage().nbytes()
    assert namespace.max_memory_allocated() >= namespace.memory_allocated()
    namespace.reset_peak_memory_stats()
    assert namespace.max_memory_allocated() == namespace.memory_allocated()
    stats = namespace.memory_stats()
    assert stats["allocated_bytes.all.current"] == namespace.memory_allocated()
    free, total = namespace.get_memory_info()
    assert 0 <= free <= total and total > 0


def test_tpu_module_is_registered():
    assert torch.get_device_module("tpu") is torch.tpu
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    torch.ones(1, device="tpu")
    assert torch.tpu.is_initialized()


def test_set_device_and_device_context():
    torch.tpu.set_device(0)
    torch.tpu.set_device("tpu:0")
    torch.tpu.set_device(torch.device("tpu", 0))
    assert torch.tpu.current_device() == 0
    for spec in (0, "tpu:0", torch.device("tpu:0"), None, -1):
        with torch.tpu.device(spec):
            assert torch.tpu.current_device() == 0
    assert torch.tpu.current_device() == 0


def test_synchronize_waits_for_queued_work():
    result = torch.ones(256, device="tpu")
    for _ in range(5):
        result.mul_(2)
    torch.tpu.synchronize()
    torch.tpu.synchronize("tpu:0")
    assert result.cpu().eq(32).all()


def test_manual_seed_and_initial_seed():
    torch.tpu.manual_seed(1234)
    assert torch.tpu.initial_seed() == 1234
    torch.tpu.manual_seed_all(99)
    assert torch.tpu.initial_seed() == 99
    torch.tpu.seed()
    assert torch.tpu.initial_seed() != 99


def test_rng_state_round_trip():
    torch.tpu.manual_seed(7)
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    first = torch.rand(8, device="tpu").cpu()
    assert not torch.equal(torch.tpu.get_rng_state(), state)
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.tpu.get_rng_state(), state)
    torch.testing.assert_close(torch.rand(8, device="tpu").cpu(), first, rtol=0, atol=0)


def test_global_manual_seed_seeds_the_device():
    torch.manual_seed(21)
    assert torch.tpu.initial_seed() == 21
    first = torch.rand(4, device="tpu").cpu()
    torch.manual_seed(21)
    torch.testing.assert_close(torch.rand(4, device="tpu").cpu(), first, rtol=0, atol=0)


def test_fork_rng_restores_device_stream():
    torch.tpu.manual_seed(3)
    with torch.random.fork_rng(device_type="tpu"):
        inside = torch.rand(4, device="tpu").cpu()
    torch.testing.assert_close(torch.rand(4, device="tpu").cpu(), inside, rtol=0, atol=0)


def test_set_rng_state_rejects_foreign_state():
    with pytest.raises(RuntimeError, match="RNG state"):
        torch.tpu.set_rng_state(torch.zeros(3, dtype=torch.uint8))


def test_memory_allocated_follows_tensor_lifetime():
    gc.collect()
    before = torch.tpu.memory_allocated()
    tensor = torch.empty(1000, device="tpu")
    assert torch.tpu.memory_allocated() == before  # nothing allocated until first written
    tensor.fill_(1.0)
    assert torch.tpu.memory_allocated() == before + 4000
    assert torch.tpu.max_memory_allocated() >= before + 4000
    view = tensor[10:20]
    del tensor
    gc.collect()
    assert torch.tpu.memory_allocated() == before + 4000  # the view keeps the storage alive
    del view
    gc.collect()
    assert torch.tpu.memory_allocated() == before


def test_peak_memory_and_stats():
    torch.tpu.empty_cache()
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    transient = torch.ones(4096, device="tpu")
    del transient
    gc.collect()
    assert torch.tpu.memory_allocated() == base
    assert torch.tpu.max_memory_allocated() >= base + 4096 * 4
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == base
    assert stats["allocated_bytes.all.peak"] == torch.tpu.max_memory_allocated()
    # the keys TorchTitan's memory monitor reads
    assert stats["active_bytes.all.peak"] == stats["reserved_bytes.all.peak"] == stats["allocated_bytes.all.peak"]
    assert stats["num_alloc_retries"] == 0 and stats["num_ooms"] >= 0
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base


def test_mem_get_info():
    free, total = torch.tpu.mem_get_info()
    assert isinstance(free, int) and isinstance(total, int)
    assert 0 < free <= total


def test_device_name_says_what_backs_the_device():
    name = torch.tpu.get_device_name()
    platform = runtime.backing_platform()
    assert platform in name.lower() or platform == "tpu"
    assert torch.tpu.get_device_name(0) == torch.tpu.get_device_name("tpu:0") == name
    properties = torch.tpu.get_device_properties(0)
    assert properties.name == name
    assert properties.total_memory == torch.tpu.mem_get_info()[1]


def test_amp_supported_dtypes():
    assert torch.bfloat16 in torch.tpu.get_amp_supported_dtype()
    assert torch.tpu.is_bf16_supported()


def test_backends_flag():
    assert torch.backends.tpu.is_built()
    assert torch.backends.tpu.is_available()


def test_tensor_tpu_method_and_is_tpu():
    host = torch.arange(3.0)
    moved = host.tpu()
    assert moved.device == torch.device("tpu", 0)
    assert moved.is_tpu and not host.is_tpu
    assert host.tpu(0).device == torch.device("tpu:0")
    assert torch.equal(moved.cpu(), host)


def test_module_tpu_method():
    module = torch.nn.Linear(3, 2)
    assert module.tpu() is module
    assert module.weight.device.type == "tpu" and type(module.weight) is torch.nn.Parameter


@pytest.mark.parametrize(
    "action",
    [
        lambda: torch.tpu.set_device(99),
        lambda: torch.tpu.device(99),
        lambda: torch.tpu.memory_allocated(99),
        lambda: torch.ones(1, device="tpu:99"),
        lambda: torch.empty(2, device="tpu:99"),
        lambda: torch.zeros(2).to("tpu:99"),
    ],
    ids=["set_device", "device_context", "memory_allocated", "ones", "empty", "to"],
)
def test_invalid_device_index_raises_clearly(action):
    with pytest.raises(RuntimeError, match=r"tpu:99"):
        action()
    assert torch.tpu.current_device() == 0


_MULTI_CHIP_SCRIPT = """
import json, torch, hf_tpu
report = {"count": torch.tpu.device_count(), "accelerator_count": torch.accelerator.device_count()}
torch.tpu.set_device(2)
report["current"] = [torch.tpu.current_device(), torch.accelerator.current_device_index()]
host = torch.arange(3.0)
report["bare_tpu"] = {
    "empty": str(torch.empty(2, device="tpu").device),
    "ones": str(torch.ones(2, device="tpu").device),
    "arange": str(torch.arange(3, device="tpu").device),
    "tensor": str(torch.tensor([1.0], device="tpu").device),
    "to": str(host.to("tpu").device),
    "to_device": str(host.to(torch.device("tpu")).device),
    "tpu_method": str(host.tpu().device),
    "module": str(torch.nn.Linear(2, 2).to("tpu").weight.device),
}
with torch.tpu.device(3):
    inside = host.to("tpu")
report["context"] = [str(inside.device), torch.tpu.current_device()]
moved = inside.to("tpu:1")
report["cross_chip"] = [str(moved.device), moved.cpu().tolist(),
                        torch.empty(3, device="tpu:0").copy_(moved).cpu().tolist()]
param = torch.nn.Parameter(torch.arange(3.0, device="tpu:0"))
param.data = param.data.to("tpu:1")
report["data_between_chips"] = [str(param.device), type(param).__name__, (param * 2).cpu().tolist()]
param.data = param.data.cpu()
param.data = param.data.to("tpu:3")
report["data_through_host"] = str(param.device)
from hf_tpu.backend import runtime, storage
on_chip_3 = {
    "to": host.to("tpu:3"),
    "empty_then_fill_": torch.empty(2, device="tpu:3").fill_(1.0),
    "zeros": torch.zeros(2, device="tpu:3"),
    "arange": torch.arange(3, device="tpu:3"),
    "eye": torch.eye(2, device="tpu:3"),
    "add": host.to("tpu:3") + 1,
}
report["data_on_chip"] = {
    name: str(tensor.device) == "tpu:3" and storage.buffer_of(tensor).materialize().devices() == {runtime.device(3)}
    for name, tensor in on_chip_3.items()
}
try:
    torch.ones(2, device="tpu:0") + torch.ones(2, device="tpu:1")
except RuntimeError as error:
    report["mixed_chips"] = str(error)
leaf = torch.ones(2, device="tpu:1", requires_grad=True)
try:
    (leaf * leaf).sum().backward()
except RuntimeError as error:
    report["backward_on_chip_1"] = str(error)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def four_chip_report() -> dict:
    """Runs the multi-chip script once in a subprocess with HF_TPU_NUM_DEVICES=4 (virtual chips)."""
    environment = dict(os.environ, HF_TPU_NUM_DEVICES="4", HF_TPU_PLATFORM="cpu")
    result = subprocess.run(
        [sys.executable, "-c", _MULTI_CHIP_SCRIPT], env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_virtual_chip_count_from_environment(four_chip_report):
    assert four_chip_report["count"] == four_chip_report["accelerator_count"] == 4
    assert four_chip_report["current"] == [2, 2]


def test_bare_tpu_means_the_current_chip(four_chip_report):
    assert four_chip_report["bare_tpu"] == {name: "tpu:2" for name in four_chip_report["bare_tpu"]}
    assert four_chip_report["context"] == ["tpu:3", 2]


def test_copies_between_chips(four_chip_report):
    assert four_chip_report["cross_chip"] == ["tpu:1", [0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]


def test_data_moves_parameters_between_chips(four_chip_report):
    assert four_chip_report["data_between_chips"] == ["tpu:1", "Parameter", [0.0, 2.0, 4.0]]
    assert four_chip_report["data_through_host"] == "tpu:3"


def test_device_data_lives_on_the_tensors_chip(four_chip_report):
    assert four_chip_report["data_on_chip"] == {name: True for name in four_chip_report["data_on_chip"]}


def test_mixing_chips_raises_like_cuda(four_chip_report):
    assert four_chip_report["mixed_chips"] == (
        "Expected all tensors to be on the same device, but found at least two devices, tpu:0 and tpu:1!"
    )


def test_backward_on_other_chips_says_why_it_is_unsupported(four_chip_report):
    assert four_chip_report["backward_on_chip_1"].startswith("backward through tensors on tpu:1 is not supported")
