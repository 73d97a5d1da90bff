"""transformers' continuous batching on tpu: the paged cache sized from the chip's memory, and CPU's tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.initialization import resolve_continuous_batching_config

from conftest import tiny_llama
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


def test_continuous_batching_gives_cpus_tokens():
    torch.manual_seed(0)
    model = tiny_llama().eval()
    prompts = [torch.randint(3, 120, (length,)).tolist() for length in (5, 9, 3)]
    generation = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    settings = dict(num_blocks=16, max_batch_tokens=32)
    tokens = {}
    for device in ("cpu", "tpu"):
        outputs = model.to(device).generate_batch(inputs=prompts, generation_config=generation,
                                                  continuous_batching_config=ContinuousBatchingConfig(**settings))
        tokens[device] = {key: output.generated_tokens for key, output in outputs.items()}
    assert len(tokens["tpu"]) == len(prompts) and all(len(t) == 3 for t in tokens["tpu"].values())
    assert tokens["tpu"] == tokens["cpu"]
