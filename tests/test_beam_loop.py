"""Beam search from a static cache on tpu runs as one program (hf_tpu/compile/beam_loop.py): the beams, their beam
indices and the cache are CPU's and transformers' loop's, sampled beams draw what transformers' loop draws, one
program serves every prompt length, and what the program does not keep goes to transformers' loop."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from conftest import generation_pair, to_tpu
from hf_tpu.compile import compile_stats, decode_loop

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def models():
    return generation_pair()


def _padded_batch(length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by three tokens."""
    prompt = torch.randint(1, 128, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    prompt[1, :3], mask[1, :3] = 0, 0
    return prompt, mask


def _search(model, prompt, mask, **options):
    options = dict(dict(max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=3), **options)
    if prompt.device.type == "tpu":
        options.setdefault("cache_implementation", "static")
    return model.generate(prompt, attention_mask=mask.to(prompt.device), **options)


@pytest.mark.parametrize("options", [
    dict(num_return_sequences=2),
    dict(num_beams=2, length_penalty=0.7, eos="met"),
    dict(early_stopping=True, num_return_sequences=3, eos="met"),
    dict(num_beams=2, early_stopping="never", length_penalty=1.5, eos="met"),
    dict(no_repeat_ngram_size=2, repetition_penalty=1.3, min_new_tokens=4, eos="met"),
], ids=["return_two", "length_penalty", "early_stopping", "never_stop_early", "processors_reading_tokens"])
def test_beams_are_cpus_in_one_program_run(models, options):
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    ending = options.pop("eos", None)
    if ending:
        without = _search(cpu_model, prompt, mask, **options)
        options["eos_token_id"] = int(without[0, prompt.shape[1] + 2])  # the best beam's third new token
    expected = _search(cpu_model, prompt, mask, **options)
    before = compile_stats()["decode_loops"]
    assert _search(tpu_model, to_tpu(prompt), mask, **options).cpu().tolist() == expected.tolist()
    assert compile_stats()["decode_loops"] == before + 1
    if ending:  # beams that meet it finish: the search differs
        assert expected.tolist() != without.tolist()


def test_one_program_serves_every_prompt_length_and_number_of_new_tokens(models):
    cpu_model, tpu_model = models
    decode_loop._programs.pop(tpu_model, None)
    for length, new_tokens in ((7, NEW_TOKENS), (12, 5)):
        prompt, mask = _padded_batch(length)
        expected = _search(cpu_model, prompt, mask, max_new_tokens=new_tokens)
        assert _search(tpu_model, to_tpu(prompt), mask, max_new_tokens=new_tokens).cpu().tolist() == expected.tolist()
    assert len(decode_loop._programs[tpu_model]) == 1


def test_beam_indices_and_the_cache_are_transformers_loops(models, monkeypatch):
    """The cache is reordered as transformers' loop reorders it: its rows follow the beams they hold."""
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    options = dict(return_dict_in_generate=True, num_return_sequences=2)
    expected = _search(cpu_model, prompt, mask, **options)
    ours = _search(tpu_model, to_tpu(prompt), mask, **options)
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")
    stepwise = _search(tpu_model, to_tpu(prompt), mask, **options)
    assert ours.sequences.cpu().tolist() == stepwise.sequences.cpu().tolist() == expected.sequences.tolist()
    assert ours.beam_indices.cpu().tolist() == stepwise.beam_indices.cpu().tolist() == expected.beam_indices.tolist()
    length = int(stepwise.cache.get_seq_length())
    assert int(ours.cache.get_seq_length()) == length
    for mine, theirs in zip(ours.cache.layers, stepwise.cache.layers):
        assert mine.keys.shape == theirs.keys.shape
        torch.testing.assert_close(mine.keys[:, :, :length].cpu(), theirs.keys[:, :, :length].cpu())
        torch.testing.assert_close(mine.values[:, :, :length].cpu(), theirs.values[:, :, :length].cpu())


def _sampled(model, prompt, mask, seed=3):
    """Sampled beams from ``seed``, and the device's random state after them."""
    torch.manual_seed(seed)
    beams = _search(model, prompt, mask, do_sample=True, top_k=20, temperature=1.5).cpu().tolist()
    return beams, torch.tpu.get_rng_state().tolist()


def test_sampled_beams_draw_what_transformers_loop_draws(models, monkeypatch):
    _, tpu_model = models
    prompt, mask = _padded_batch()
    ours = _sampled(tpu_model, to_tpu(prompt), mask)
    assert compile_stats()["decode_loops"] == 1
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")
    assert ours == _sampled(tpu_model, to_tpu(prompt), mask)
    assert ours != _sampled(tpu_model, to_tpu(prompt), mask, seed=4)  # it does draw


def test_an_encoder_decoders_beams_are_cpus():
    config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    cpu_model = transformers.T5ForConditionalGeneration(config).eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    prompt = torch.randint(2, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[1, -2:] = 0
    expected = _search(cpu_model, prompt, mask, num_return_sequences=2)
    assert _search(tpu_model, to_tpu(prompt), mask, num_return_sequences=2).cpu().tolist() == expected.tolist()
    assert compile_stats()["decode_loops"] == 1


@pytest.mark.parametrize("eos", [False, True], ids=["to_max_length", "beams_meet_eos"])
def test_per_step_scores_and_logits_are_cpus_in_one_program_run(models, eos):
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    options = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, num_return_sequences=2)
    if eos:  # the search ends before the maximum length: fewer steps than the program kept room for
        without = _search(cpu_model, prompt, mask, **options).sequences
        ending = without[:, prompt.shape[1] + 1:prompt.shape[1] + 3]  # the returned beams' second and third tokens
        options.update(eos_token_id=sorted(set(ending.flatten().tolist())), early_stopping=True)
    expected = _search(cpu_model, prompt, mask, **options)
    before = compile_stats()["decode_loops"]
    result = _search(tpu_model, to_tpu(prompt), mask, **options)
    assert compile_stats()["decode_loops"] == before + 1
    assert result.sequences.cpu().tolist() == expected.sequences.tolist()
    assert result.beam_indices.cpu().tolist() == expected.beam_indices.tolist()
    torch.testing.assert_close(result.sequences_scores.cpu(), expected.sequences_scores)
    for name in ("scores", "logits"):
        assert len(getattr(result, name)) == len(getattr(expected, name)) <= NEW_TOKENS
        torch.testing.assert_close(torch.stack(getattr(result, name)).cpu(), torch.stack(getattr(expected, name)))
    if eos:
        assert len(expected.scores) < NEW_TOKENS
