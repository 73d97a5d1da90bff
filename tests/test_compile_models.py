"""Graph mode on whole models: generate over many prompt lengths, and a compiled training loop."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_llama, to_tpu
from hf_tpu.compile import compile_stats

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_static_cache_generate_over_eight_prompt_lengths_compiles_at_most_three_programs():
    """Increasing lengths are the worst case for transformers' own cache reuse; tpu buckets the length."""
    cpu_model = tiny_llama(tie_word_embeddings=False, max_position_embeddings=256).eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    generator = torch.Generator().manual_seed(0)
    for length in (5, 12, 23, 37, 50, 64, 81, 100):
        prompt = torch.randint(1, 128, (1, length), generator=generator)
        expected = cpu_model.generate(prompt, max_new_tokens=6, do_sample=False)
        result = tpu_model.generate(to_tpu(prompt), max_new_tokens=6, do_sample=False, cache_implementation="static")
        assert result.cpu().tolist() == expected.tolist(), f"prompt length {length}"
    assert compile_stats()["compilations"] <= 3


def test_compiled_training_loop_matches_eager_cpu_over_twenty_steps():
    cpu_model = tiny_llama(tie_word_embeddings=False).train()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    compiled = torch.compile(tpu_model, backend="tpu")
    cpu_optimizer = torch.optim.AdamW(cpu_model.parameters(), lr=1e-3)
    tpu_optimizer = torch.optim.AdamW(tpu_model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(20):
        batch = torch.randint(0, 128, (2, 16), generator=generator)
        cpu_loss = cpu_model(batch, labels=batch).loss
        tpu_loss = compiled(to_tpu(batch), labels=to_tpu(batch)).loss
        for loss, optimizer in ((cpu_loss, cpu_optimizer), (tpu_loss, tpu_optimizer)):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(tpu_loss.detach().cpu(), cpu_loss.detach(), rtol=1e-4, atol=0, msg=f"step {step}")
    stats = compile_stats()  # one forward and one backward program for all 20 steps, nothing run eagerly
    assert (stats["compilations"], stats["cache_hits"], stats["fallbacks"]) == (2, 38, 0)
