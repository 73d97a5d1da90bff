"""generate() with a static cache on tpu builds each decode step's attention mask inside the compiled step
(hf_tpu/integrations/generation.py), not with eager ops before it, and returns CPU's tokens, with and without
padding in the prompt."""

from __future__ import annotations

import copy

import pytest
import torch

import transformers
from conftest import tiny_llama, to_tpu
from hf_tpu.compile import compile_stats
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

NEW_TOKENS = 6


def _eager_mask_builds(monkeypatch) -> list[int]:
    """Counts 4D masks built outside a compiled graph (each is a few dozen eager ops on tpu)."""
    builds = []
    build = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def counted(*args, **kwargs):
        if not torch.compiler.is_compiling():
            builds.append(1)
        return build(*args, **kwargs)

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", counted)
    return builds


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by three tokens."""
    prompt = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    prompt[1, :3], mask[1, :3] = 0, 0
    return prompt, mask


@pytest.mark.parametrize("stepwise", [False, True], ids=["one_program", "stepwise"])
@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padded"])
def test_decode_steps_build_their_mask_in_the_compiled_step(monkeypatch, padded, stepwise):
    """In transformers' loop, a compiled step per token (``HF_TPU_STEPWISE_DECODE``), and in the decode loop
    run as one program."""
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1" if stepwise else "0")
    cpu_model = tiny_llama(tie_word_embeddings=False).eval()
    cpu_model.generation_config.pad_token_id = 0
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    if padded:
        prompt, mask = _padded_batch()
        inputs, tpu_inputs = dict(attention_mask=mask), dict(attention_mask=to_tpu(mask))
    else:
        prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(1))
        inputs, tpu_inputs = {}, {}
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = cpu_model.generate(prompt, **inputs, **options)
    builds = _eager_mask_builds(monkeypatch)
    result = tpu_model.generate(to_tpu(prompt), **tpu_inputs, cache_implementation="static", **options)
    assert result.cpu().tolist() == expected.tolist()
    assert len(builds) == 1  # the prefill's, in its eager forward; none per decode step


def test_a_cache_with_sliding_window_layers_decodes_in_one_program(monkeypatch):
    """A sliding-window layer picks its write and its mask's offset from a Python count that changes every step;
    in the one-program loop it takes them from the step's position (hf_tpu/compile/sliding_window.py). A tiny
    Gemma 2 (sliding, full) with a window of 4, a left-padded batch whose longer prompt (7) overflows the window:
    greedy and beam search give CPU's tokens, the cache ends as CPU's, and no mask is built eagerly per step."""
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=4, pad_token_id=0,
    )
    torch.manual_seed(0)
    cpu_model = transformers.Gemma2ForCausalLM(config).eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    prompt, mask = _padded_batch()
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")
    expected = cpu_model.generate(prompt, attention_mask=mask, return_dict_in_generate=True, **options)
    builds = _eager_mask_builds(monkeypatch)
    loops = compile_stats()["decode_loops"]
    result = tpu_model.generate(to_tpu(prompt), attention_mask=to_tpu(mask), return_dict_in_generate=True, **options)
    assert result.sequences.cpu().tolist() == expected.sequences.tolist()
    assert compile_stats()["decode_loops"] == loops + 1
    assert len(builds) <= 2  # the prefill's, and the first step's inputs' (unused)
    for tpu_layer, cpu_layer in zip(result.cache.layers, expected.cache.layers):
        assert int(tpu_layer.cumulative_length) == int(cpu_layer.cumulative_length)
        if cpu_layer.is_sliding:  # a window of the last 4 positions, none of them padding
            assert tpu_layer.cumulative_length_int == cpu_layer.cumulative_length_int == 7 + NEW_TOKENS - 1
            torch.testing.assert_close(tpu_layer.keys.cpu(), cpu_layer.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(tpu_layer.values.cpu(), cpu_layer.values, rtol=1e-4, atol=1e-5)
    beams = dict(options, num_beams=3, num_return_sequences=2)
    expected = cpu_model.generate(prompt, attention_mask=mask, **beams)
    assert tpu_model.generate(to_tpu(prompt), attention_mask=to_tpu(mask), **beams).cpu().tolist() == expected.tolist()
    assert compile_stats()["decode_loops"] == loops + 2


def test_cpu_generate_with_a_static_cache_goes_through_the_wrapper_unchanged():
    """The wrapper hands every other call to transformers as it came (transformers 5.17 names the cache argument
    ``past_key_values``, 5.25 ``cache``)."""
    model = tiny_llama().eval()
    prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = model.generate(prompt, **options)
    assert model.generate(prompt, cache_implementation="static", disable_compile=True, **options).tolist() == (
        expected.tolist()
    )


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_a_static_cache_gets_the_padded_2d_mask_whichever_name_it_is_passed_by(name):
    from transformers.cache_utils import StaticCache

    config = tiny_llama().config
    cache = StaticCache(config=config, max_cache_len=16)
    mask = torch.ones(1, 5, dtype=torch.long, device="tpu")
    result = transformers.generation.utils.create_masks_for_generate(
        config=config, inputs_embeds=torch.empty((1, 5, 0), device="tpu"), attention_mask=mask, **{name: cache}
    )
    assert result.device.type == "tpu" and result.cpu().tolist() == [[1] * 5 + [0] * 11]
