"""transformers' continuous batching on tpu: the paged cache sized from the chip's memory, and CPU's tokens."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.initialization import resolve_continuous_batching_config

from conftest import tiny_llama
from hf_tpu.compile import compile_stats
from hf_tpu.integrations import continuous_batching

MiB = 1 << 20


def _cache_bytes(model: torch.nn.Module, device: str, **settings) -> int:
    """The bytes of the paged cache continuous batching makes for ``model`` on ``device``, resolved as
    ``generate_batch`` resolves it."""
    config = model.config.get_text_config()
    cb_config = resolve_continuous_batching_config(config=config, cb_config=ContinuousBatchingConfig(**settings),
                                                   workload_hints=None, has_logit_processors=False,
                                                   device=torch.device(device))
    cache = PagedAttentionCache(config=config, continuous_batching_config=cb_config, device=device,
                                distributed_helper=DistributedHelper(None, None), dtype=torch.float32)
    assert cache.cache_tensor.device.type == torch.device(device).type
    return cache.cache_tensor.numel() * cache.cache_tensor.element_size()


def test_a_tpu_cache_is_sized_from_the_chips_free_memory(monkeypatch):
    monkeypatch.setattr(continuous_batching, "_on_chips", lambda: True)
    sizes = {}
    for free in (256 * MiB, 512 * MiB):
        monkeypatch.setattr(torch.tpu, "mem_get_info", lambda device=None, free=free: (free, 1024 * MiB))
        sizes[free] = _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64)
        assert sizes[free] <= 0.9 * free  # transformers' share for an accelerator, of what the chip has free
    assert sizes[512 * MiB] == pytest.approx(2 * sizes[256 * MiB], rel=0.05)
    halved = _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64, max_memory_percent=0.45)  # the user's share
    assert halved == pytest.approx(sizes[512 * MiB] / 2, rel=0.05)


def test_on_the_cpu_platform_the_default_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(continuous_batching, "_on_chips", lambda: False)
    monkeypatch.setattr(continuous_batching, "HOST_CACHE_BYTES", 32 * MiB)
    monkeypatch.setattr(torch.tpu, "mem_get_info", lambda device=None: (64 << 30, 128 << 30))  # a large host
    bounded = _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64)
    assert bounded == _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64, max_memory_percent=32 * MiB / (64 << 30))
    assert bounded <= 32 * MiB
    assert _cache_bytes(tiny_llama(), "tpu", max_batch_tokens=64, num_blocks=4) < MiB  # the user's size


def test_padded_sizes_bound_the_programs_of_a_run():
    reads = [*range(0, 16385, 61), *(2 ** n + d for n in range(17) for d in (-1, 0, 1) if 2 ** n + d <= 16384)]
    sizes = {continuous_batching.padded_sizes(q, kv, 256, 16384, 256) for q in range(1, 257) for kv in reads}
    assert all(q >= 1 and (kv == 0 or kv >= 256) for q, kv in sizes)
    assert {q for q, _ in sizes} == {16, 32, 64, 128, 256}
    assert {kv for _, kv in sizes} == {0, 256, 512, 1024, 2048, 4096, 8192, 16384}
    assert len(sizes) <= (math.log2(256 / 16) + 2) * (math.log2(16384 / 256) + 2)


def _generate_batch(model, prompts, **generation):
    generation = GenerationConfig(**{"max_new_tokens": 6, "eos_token_id": -1, "pad_token_id": 0, **generation})
    outputs = model.generate_batch(inputs=prompts, generation_config=generation,
                                   continuous_batching_config=ContinuousBatchingConfig(num_blocks=8,
                                                                                       max_batch_tokens=64))
    return [outputs[key].generated_tokens for key in sorted(outputs, key=lambda key: int(key.split("_")[-1]))]


def test_continuous_batching_compiles_a_bounded_number_of_programs_and_gives_cpus_tokens():
    torch.manual_seed(0)
    model = tiny_llama(max_position_embeddings=256).eval()
    lengths = (5, 37, 3, 60, 12, 9, 41, 2, 18, 30, 7, 25)  # more query tokens than a batch takes: several batches
    prompts = [torch.randint(3, 120, (length,)).tolist() for length in lengths]
    expected = _generate_batch(model, prompts)

    before = compile_stats()
    tokens = _generate_batch(model.to("tpu"), prompts)
    compiled = compile_stats()["compilations"] - before["compilations"]

    assert tokens == expected and all(len(t) == 6 for t in tokens)
    # query tokens padded to 16, 32 or 64; tokens read to 0 or a power of two from one page (256) to the cache
    assert 0 < compiled <= 3 * 5
    assert compile_stats()["fallbacks"] == before["fallbacks"]  # every step ran as one program
    assert _generate_batch(model, prompts[::-1]) == expected[::-1]  # new lengths of batches, the same programs
    assert compile_stats()["compilations"] - before["compilations"] <= 3 * 5


def test_sampled_continuous_batching_follows_the_seed():
    model = tiny_llama().eval().to("tpu")
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2]]
    runs = []
    for _ in range(2):
        torch.manual_seed(1)
        runs.append(_generate_batch(model, prompts, do_sample=True, top_k=0, temperature=1.0))
    assert runs[0] == runs[1] and all(0 <= token < 128 for tokens in runs[0] for token in tokens)
