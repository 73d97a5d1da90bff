"""generate()'s prefill on tpu pads the prompt to a bucket of lengths (hf_tpu/integrations/bucketed_prefill.py):
prompts of lengths in one bucket share the prefill's programs, and generate returns what it returns on CPU (tokens,
scores, logits, and a cache holding the prompt's keys and values only, zeros where the padding was written)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation.utils import GenerationMixin

from conftest import TRACED, counting_jax_events, tiny_llama, to_tpu

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


@pytest.fixture(scope="module")
def models():
    cpu_model = tiny_llama().eval()
    cpu_model.generation_config.pad_token_id = 0
    return cpu_model, copy.deepcopy(cpu_model).to("tpu")


def _prompt(length: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(length))


def _assert_generates_as_on_cpu(models, prompt: torch.Tensor, **options) -> None:
    cpu_model, tpu_model = models
    options = {"max_new_tokens": 3, "do_sample": False, "cache_implementation": "static", **OUTPUTS, **options}
    expected = cpu_model.generate(prompt, **options)
    actual = tpu_model.generate(to_tpu(prompt), **to_tpu(options))
    assert torch.equal(actual.sequences.cpu(), expected.sequences)
    for name in ("scores", "logits"):
        assert len(actual[name]) == len(expected[name])
        for mine, theirs in zip(actual[name], expected[name]):
            torch.testing.assert_close(mine.cpu(), theirs, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(actual.cache.layers, expected.cache.layers):
        assert mine.keys.shape == theirs.keys.shape
        torch.testing.assert_close(mine.keys.cpu(), theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values.cpu(), theirs.values, atol=1e-5, rtol=1e-5)
        assert int(mine.get_seq_length()) == int(theirs.get_seq_length())


@pytest.mark.parametrize("length", [5, 9, 33])
def test_a_padded_prefill_generates_as_on_cpu(models, length):
    _assert_generates_as_on_cpu(models, _prompt(length))


def test_a_generation_that_ends_early_has_zeros_where_the_padding_was_written(models):
    """The cache is sized for 8 new tokens and the first one ends the generation: past the prompt, CPU's cache holds
    zeros, where tpu's padded prefill wrote the padding's keys and values."""
    prompt = _prompt(9)
    first = int(models[0].generate(prompt, max_new_tokens=1, do_sample=False)[0, -1])
    _assert_generates_as_on_cpu(models, prompt, max_new_tokens=8, eos_token_id=first)


def test_a_left_padded_batch_prefills_in_a_bucket_as_on_cpu(models):
    prompt = _prompt(11, batch=2)
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0
    _assert_generates_as_on_cpu(models, prompt, attention_mask=mask)


def test_a_new_prompt_length_in_a_bucket_compiles_only_the_padding(models, monkeypatch):
    """The prefill of a prompt of a new length traces one program (the padding of its tokens), not the model's ops
    again; without the padding it traces dozens."""
    _, tpu_model = models
    traced_per_prefill = []
    prefill = GenerationMixin._prefill

    def counted_prefill(*args, **kwargs):
        with counting_jax_events(TRACED) as traced:
            outputs = prefill(*args, **kwargs)
        traced_per_prefill.append(len(traced))
        return outputs

    monkeypatch.setattr(GenerationMixin, "_prefill", counted_prefill)
    for length in (6, 7):
        tpu_model.generate(_prompt(length).to("tpu"), max_new_tokens=3, do_sample=False,
                           cache_implementation="static")
    assert traced_per_prefill[-1] <= 1, traced_per_prefill

    from hf_tpu.integrations import bucketed_prefill

    monkeypatch.setattr(bucketed_prefill, "prefill_padding", lambda *args: 0)
    # a shape no other test gives this model: in a process that ran one, the eager programs are traced already
    tpu_model.generate(_prompt(11, batch=3).to("tpu"), max_new_tokens=3, do_sample=False,
                       cache_implementation="static")
    assert traced_per_prefill[-1] > 10, traced_per_prefill


def test_prompts_the_padding_cannot_serve_prefill_as_they_are(models):
    """A caller's cache, a dynamic cache and hidden states asked for keep the prompt's own length."""
    from hf_tpu.integrations.bucketed_prefill import prefill_padding

    _, tpu_model = models
    prompt = _prompt(5).to("tpu")
    config = copy.deepcopy(tpu_model.generation_config)

    def static_cache(user_defined: bool = False):
        from transformers import StaticCache

        cache = StaticCache(config=tpu_model.config, max_cache_len=64)
        cache._is_user_defined = user_defined
        return cache

    assert prefill_padding(tpu_model, prompt, config, {"cache": static_cache(), "logits_to_keep": 1}) == 59
    assert prefill_padding(tpu_model, prompt, config, {"cache": static_cache(True), "logits_to_keep": 1}) == 0
    from transformers import DynamicCache

    assert prefill_padding(tpu_model, prompt, config, {"cache": DynamicCache(), "logits_to_keep": 1}) == 0
    assert prefill_padding(tpu_model, prompt, config, {"cache": static_cache(), "logits_to_keep": 1,
                                                       "output_hidden_states": True}) == 0
    assert prefill_padding(tpu_model, prompt.cpu(), config, {"cache": static_cache(), "logits_to_keep": 1}) == 0
