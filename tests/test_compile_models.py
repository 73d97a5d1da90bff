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


def _tiny_mistral_with_sliding_window():
    import transformers

    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=12,
    )
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).eval()


@pytest.mark.parametrize("make_model", [lambda: tiny_llama(max_position_embeddings=256).eval(),
                                        _tiny_mistral_with_sliding_window], ids=["llama", "mistral_sliding"])
def test_static_cache_handed_back_has_the_length_it_has_on_cpu(make_model):
    """Bucketing is invisible: the returned cache is trimmed to CPU's length (views of the buckets), across
    calls (transformers keeps the longest length seen) and with an explicit max_cache_len."""
    cpu_model = make_model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    generator = torch.Generator().manual_seed(0)
    for length, new_tokens, max_cache_len in ((5, 4, None), (3, 2, None), (12, 6, None), (7, 3, 40)):
        prompt = torch.randint(1, 128, (1, length), generator=generator)
        options = dict(max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                       return_dict_in_generate=True)
        if max_cache_len is not None:
            options["max_cache_len"] = max_cache_len
        expected = cpu_model.generate(prompt, **options)
        result = tpu_model.generate(to_tpu(prompt), **options)
        assert result.sequences.cpu().tolist() == expected.sequences.tolist()
        assert int(result.cache.get_seq_length()) == int(expected.cache.get_seq_length())
        assert result.cache.get_max_length() == expected.cache.get_max_length()
        for tpu_layer, cpu_layer in zip(result.cache.layers, expected.cache.layers):
            assert tpu_layer.keys.shape == cpu_layer.keys.shape, (length, new_tokens)
            assert tpu_layer.is_croppable == cpu_layer.is_croppable
            torch.testing.assert_close(tpu_layer.keys.cpu(), cpu_layer.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(tpu_layer.values.cpu(), cpu_layer.values, rtol=1e-4, atol=1e-5)
    assert compile_stats()["compilations"] <= 3  # 64 and the explicit 40 (and prefill shapes)
