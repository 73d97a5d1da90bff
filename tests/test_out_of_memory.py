"""Device allocation failures raise torch.OutOfMemoryError (CUDA's wording), and the device stays usable."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from hf_tpu.backend.out_of_memory import requested_bytes

TOO_BIG = 1 << 42  # 4 TiB: refused at once by any host or chip here


def test_eager_allocation_failure_is_torch_out_of_memory():
    gc.collect()  # earlier tests' garbage would be freed in the middle of this one
    allocated, failures = torch.tpu.memory_allocated(), torch.tpu.memory_stats()["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError, match=r"tpu out of memory\. Tried to allocate 4\.00 TiB\.") as info:
        torch.empty(TOO_BIG, device="tpu", dtype=torch.uint8).fill_(1)
    assert torch.tpu.memory_stats()["num_ooms"] == failures + 1
    message = str(info.value)
    assert "tpu:0" in message and "total capacity" in message and "is free" in message
    assert "smaller batch" in message  # what to try
    assert "RESOURCE_EXHAUSTED" in str(info.value.__cause__)  # the JAX error is chained
    assert torch.tpu.memory_allocated() == allocated
    torch.tpu.empty_cache()
    x = torch.arange(4.0, device="tpu")
    assert (x * 2).tolist() == [0.0, 2.0, 4.0, 6.0]


def test_compiled_program_allocation_failure_is_torch_out_of_memory():
    """The program's own buffer fails at run time (asynchronously): the next use says so."""

    def huge(x):
        return x.expand(1 << 21, 1 << 21) + 1

    compiled = torch.compile(huge, backend="tpu")
    with pytest.raises(torch.OutOfMemoryError, match=r"tpu out of memory\. Tried to allocate 16\.00 TiB"):
        result = compiled(torch.ones(1 << 21, device="tpu"))
        torch.tpu.synchronize()
        result[0, :2].cpu()
    del result
    assert torch.compile(lambda x: x + 1, backend="tpu")(torch.ones(2, device="tpu")).tolist() == [2.0, 2.0]


def test_accelerate_find_executable_batch_size_recovers():
    from accelerate.utils import find_executable_batch_size

    tried = []

    @find_executable_batch_size(starting_batch_size=12)
    def step(batch_size):
        tried.append(batch_size)
        rows = TOO_BIG if batch_size > 8 else batch_size  # fits from 8 down
        return torch.ones(rows, 16, device="tpu").sum().item()

    assert step() == tried[-1] * 16
    assert tried[0] == 12 and tried[-1] <= 8 < tried[-2]  # accelerate shrinks by its own factor


@pytest.mark.parametrize(
    "message, expected",
    [
        ("RESOURCE_EXHAUSTED: Out of memory allocating 4398046511104 bytes.", 1 << 42),
        ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.50G. That was not "
         "possible. There are 500.0M free.", 3 << 29),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2048 bytes.", 2048),
        ("RESOURCE_EXHAUSTED: something else", None),
    ],
)
def test_requested_size_is_read_from_each_platforms_message(message, expected):
    assert requested_bytes(message) == expected


def test_importing_accelerate_first_registers_the_device():
    """accelerate's __init__ imports torch (and so hf_tpu) before the modules hf_tpu patches exist."""
    code = (
        "import accelerate, torch\n"
        "from accelerate.utils import modeling\n"
        "assert torch.ones(1, device='tpu').device.type == 'tpu'\n"
        "assert modeling.get_max_memory.__wrapped__ is not None\n"
        "print(accelerate.Accelerator().device)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "not registered" not in done.stderr
    assert done.stdout.strip() == "tpu"


def test_sizes_overflowing_int64_raise_cpus_error():
    message = r"Storage size calculation overflowed with sizes=\[9223372036854775807\]"
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match=message):
            torch.zeros(2**63 - 1, device=device)


def test_factories_too_large_for_any_chip_raise_before_xla_compiles_them():
    with pytest.raises(RuntimeError, match=r"Storage size calculation overflowed with sizes=\[4611686018427387904\]"):
        torch.arange(2**62, device="tpu")  # XLA aborts the process on a size whose bytes overflow int64
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 16\.00 PiB"):
        torch.zeros(2**52, device="tpu")
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 1\.00 EiB"):
        torch.ones(4, device="tpu").expand(2**56, 4).contiguous()
    assert torch.full((2,), 3.0, device="tpu").sum().item() == 6.0


def test_requests_larger_than_any_device_are_refused_without_using_up_the_address_space():
    for _ in range(100):  # each would take 2^62 bytes of the fake address space if it were granted
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 4\.00 EiB"):
            torch.empty(2**62, device="tpu", dtype=torch.uint8)
    assert (torch.ones(2, 2, device="tpu") + 1).sum().item() == 8.0


def test_the_cpu_platforms_device_reports_what_the_host_can_give():
    from hf_tpu.backend import devices, runtime

    if runtime.backing_platform() != "cpu":
        pytest.skip("only on JAX's CPU platform is the device's memory the host's (docs/guide/troubleshooting.md)")
    free, total = torch.tpu.mem_get_info()
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")
               if line.rstrip().endswith("kB")}
    assert (free, total) == devices.host_memory()
    assert free <= meminfo["MemAvailable"] + (64 << 20) and total <= meminfo["MemTotal"]
    assert torch.tpu.get_device_properties().total_memory == total


def test_a_result_larger_than_the_host_can_give_is_refused_before_the_os_steps_in():
    from hf_tpu.backend import runtime

    if runtime.backing_platform() != "cpu":
        pytest.skip("the host-memory check is the CPU platform's (docs/guide/troubleshooting.md); a chip's own "
                    "memory fails with XLA's RESOURCE_EXHAUSTED, tested above")
    free = torch.tpu.mem_get_info()[0]
    with pytest.raises(torch.OutOfMemoryError, match="tpu out of memory"):
        torch.ones(free // 2 + 7, 3, device="tpu")  # 1.5x what the host has available, never allocated
    assert torch.ones(3, device="tpu").sum().item() == 3.0


def test_find_executable_batch_size_settles_on_what_the_host_can_give(monkeypatch):
    """accelerate halves the batch on torch.OutOfMemoryError until a step fits in the host's available memory (here
    said to be 200 MiB): on JAX's CPU platform the process is no longer killed instead."""
    from accelerate.utils import find_executable_batch_size

    from hf_tpu.backend import devices, runtime

    if runtime.backing_platform() != "cpu":
        pytest.skip("only on JAX's CPU platform is the device's memory the host's (docs/guide/troubleshooting.md)")
    monkeypatch.setattr(devices, "host_memory", lambda: (200 << 20, 1 << 30))
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def step(batch_size):
        tried.append(batch_size)
        return torch.ones(batch_size, (16 << 20) // 4 + 13, device="tpu")[:, 0].sum().item()  # 16 MiB a sample

    assert step() == tried[-1]
    assert tried[0] == 64 and tried[-1] * 16 <= 200 < tried[-2] * 16
