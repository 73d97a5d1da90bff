"""generate() on tpu reads its stopping flag one step late (transformers' DeferredStopCheck, enabled for tpu by
hf_tpu/integrations/generation.py): the host never waits for the device inside the decoding loop, and what
generate returns is what it returns on CPU, also when a sequence stops early (the extra step is undone)."""

from __future__ import annotations


import pytest
import torch

import transformers.generation.utils as generation_utils
from conftest import generation_pair, to_tpu
from hf_tpu.backend import checks
from tiny_models import Collector

if not hasattr(generation_utils, "DeferredStopCheck"):
    pytest.skip("transformers before 5.24 has no DeferredStopCheck: it waits for the flag", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def models():
    return generation_pair()


def _prompt(batch: int = 1) -> torch.Tensor:
    return torch.randint(1, 128, (batch, 6), generator=torch.Generator().manual_seed(batch))


def _host_syncs(monkeypatch) -> list[int]:
    """Counts the host's blocking reads of tpu values (each raises the pending checks first)."""
    calls = []
    raise_pending = checks.raise_pending
    monkeypatch.setattr(checks, "raise_pending", lambda: (calls.append(1), raise_pending())[1])
    return calls


@pytest.mark.parametrize(("cache_implementation", "stepwise"), [(None, False), ("static", False), ("static", True)],
                         ids=["dynamic", "static", "static_stepwise"])
def test_the_decoding_loop_does_not_wait_for_the_device(models, monkeypatch, cache_implementation, stepwise):
    """A static cache decodes as one program, or step by step with ``HF_TPU_STEPWISE_DECODE``."""
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1" if stepwise else "0")
    cpu_model, tpu_model = models
    prompt = _prompt()
    tpu_prompt = to_tpu(prompt)
    syncs = _host_syncs(monkeypatch)
    counts = {}
    for new_tokens in (3, NEW_TOKENS):
        syncs.clear()
        result = tpu_model.generate(tpu_prompt, max_new_tokens=new_tokens, do_sample=False,
                                    cache_implementation=cache_implementation)
        counts[new_tokens] = len(syncs)  # generate's set-up reads a few values (special tokens) once
        expected = cpu_model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        assert result.cpu().tolist() == expected.tolist()
    assert counts[NEW_TOKENS] == counts[3]  # none per token (one each when the flag is read at once)


def _stopping_early(cpu_model, prompt: torch.Tensor) -> tuple[int, int]:
    """An end-of-sequence token that stops the first sequence of ``prompt`` after 2 or more new tokens, and their
    number."""
    tokens = cpu_model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1]:].tolist()
    stop = next(index for index in range(1, NEW_TOKENS - 1) if tokens[index] not in tokens[:index])
    return tokens[stop], stop + 1


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_stop_found_one_step_late_is_undone(models, cache_implementation, batch):
    cpu_model, tpu_model = models
    prompt = _prompt(batch)
    eos, length = _stopping_early(cpu_model, prompt)
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, return_dict_in_generate=True,
                   output_scores=True, cache_implementation=cache_implementation)
    expected = cpu_model.generate(prompt, **options)
    result = tpu_model.generate(to_tpu(prompt), **options)
    assert result.sequences.cpu().tolist() == expected.sequences.tolist()
    if batch == 1:
        assert result.sequences.shape[1] == prompt.shape[1] + length  # stopped at the eos, not one step later
    assert len(result.scores) == len(expected.scores)
    for ours, theirs in zip(result.scores, expected.scores):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-4, atol=1e-4)
    cache, expected_cache = result.past_key_values, expected.past_key_values
    assert int(cache.get_seq_length()) == int(expected_cache.get_seq_length())
    length = int(expected_cache.get_seq_length())
    for ours, theirs in zip(cache.layers, expected_cache.layers):
        torch.testing.assert_close(ours.keys[:, :, :length].cpu(), theirs.keys[:, :, :length], rtol=1e-4, atol=1e-4)


def test_a_streamer_gets_the_tokens_of_cpu(models):
    cpu_model, tpu_model = models
    prompt = _prompt()
    eos, _ = _stopping_early(cpu_model, prompt)
    streamed = []
    for model, inputs in ((cpu_model, prompt), (tpu_model, to_tpu(prompt))):
        streamer = Collector()
        model.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, streamer=streamer)
        streamed.append(streamer.chunks)
    assert streamed[1] == streamed[0]
