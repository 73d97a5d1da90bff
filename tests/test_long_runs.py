"""Threads and long runs: many threads generating on one model, and 1000-step loops whose device memory,
host memory and number of cached programs stay bounded."""

from __future__ import annotations

import concurrent.futures
import copy
import gc
import time

import psutil
import pytest
import torch

from conftest import tiny_llama
from hf_tpu.backend import dispatch
from hf_tpu.compile import graph_lowering

MiB = 1 << 20


def _settled_device_bytes() -> int:
    """``torch.tpu.memory_allocated()`` once it stops changing: autograd's device thread frees the last
    backward's buffers on its own time, after ``backward()`` has returned."""
    allocated = torch.tpu.memory_allocated()
    for _ in range(100):
        time.sleep(0.005)
        allocated, before = torch.tpu.memory_allocated(), allocated
        if allocated == before:
            break
    return allocated


def _footprint() -> dict[str, int]:
    gc.collect()
    torch.tpu.synchronize()
    return {
        "device_bytes": _settled_device_bytes(),
        "host_rss": psutil.Process().memory_info().rss,
        "eager_programs": dispatch.eager_program_count(),
        "graph_executables": len(graph_lowering._EXECUTABLES),
    }


def _assert_bounded(early: dict[str, int], late: dict[str, int], rss_slack: int) -> None:
    # No growth. Fewer bytes late is no leak: memory_allocated counts the whole process, and an object of an
    # earlier test may die meanwhile (CI saw 16 bytes go, in no size this loop allocates).
    assert late["device_bytes"] <= early["device_bytes"], (early, late)
    assert late["eager_programs"] == early["eager_programs"]  # the same shapes need no new programs
    assert late["graph_executables"] == early["graph_executables"]
    assert late["host_rss"] - early["host_rss"] < rss_slack, (early, late)


def test_threads_each_running_generate_calls_on_one_model_get_cpus_tokens():
    cpu_model = tiny_llama().eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (1, length), generator=generator) for length in (3, 5, 8, 4, 6, 7) * 4]
    expected = [cpu_model.generate(p, max_new_tokens=4, do_sample=False).tolist() for p in prompts]

    def run(thread: int) -> list:
        return [tpu_model.generate(p.to("tpu"), max_new_tokens=4, do_sample=False).cpu().tolist()
                for p in prompts[thread::6]]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # 6 threads x 4 generate calls
        results = list(pool.map(run, range(6)))
    for thread, tokens in enumerate(results):
        assert tokens == expected[thread::6], f"thread {thread}"


def test_thousand_eager_training_steps_keep_memory_and_programs_bounded():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to("tpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(16, 32, device="tpu"), torch.randn(16, 8, device="tpu")

    def step() -> float:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    first = step().item()
    for _ in range(99):
        step()
    early = _footprint()
    for _ in range(899):
        step()
    last = step().item()
    late = _footprint()
    _assert_bounded(early, late, rss_slack=64 * MiB)
    assert last < first


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_five_hundred_generate_calls_keep_memory_and_programs_bounded(cache):
    model = tiny_llama().eval().to("tpu")
    prompt = torch.tensor([[5, 9, 17, 33]], device="tpu")
    options = dict(max_new_tokens=2, do_sample=False, cache_implementation=cache)
    first = model.generate(prompt, **options).cpu().tolist()
    for _ in range(50):
        model.generate(prompt, **options)
    early = _footprint()
    for _ in range(450):
        assert model.generate(prompt, **options).cpu().tolist() == first
    late = _footprint()
    _assert_bounded(early, late, rss_slack=64 * MiB)
