"""Compiled generation on tpu returns what it returns on CPU: every per-step output generate can hand back (scores,
logits, attentions, hidden states) with CPU's shapes and values, for decoder-only and encoder-decoder models, which
decode in one program where generate's settings allow.

tpu rounds a static cache's length up to a bucket (hf_tpu/integrations/generation.py); the self-attention weights
of each step (over the cache's length) are cut back to CPU's length as the cache is."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers

from conftest import tiny_llama, to_tpu

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ALL_OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_attentions=True,
                   output_hidden_states=True)


def tiny_t5() -> torch.nn.Module:
    config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()


def _assert_outputs_match(actual, expected, path=""):
    """Equal structure, shapes, dtypes and (within float tolerance) values, field by field."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.device.type == "tpu", path
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, (path, actual.shape, expected.shape)
        torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4, msg=path)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected)):
            _assert_outputs_match(a, e, f"{path}[{index}]")
    else:
        assert actual == expected, path


def _compare_generate(cpu_model, prompt, **options):
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    expected = cpu_model.generate(prompt, **options)
    actual = tpu_model.generate(to_tpu(prompt), **to_tpu(options))
    fields = [name for name in expected.keys() if name not in ("cache", "past_key_values")]
    assert fields == [name for name in actual.keys() if name not in ("cache", "past_key_values")]
    for name in fields:
        _assert_outputs_match(actual[name], expected[name], name)
    return actual, expected


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_decoder_only_static_cache_outputs_match_cpu(attention):
    """The attentions are over CPU's cache length (8 = 6 + 3 - 1: the last token is never cached), not the
    bucket's (64)."""
    model = tiny_llama(attn_implementation=attention).eval()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    actual, _ = _compare_generate(model, prompt, max_new_tokens=3, do_sample=False, cache_implementation="static",
                                  **ALL_OUTPUTS)
    if attention == "eager":
        assert actual.attentions[0][0].shape[-1] == 8


def test_encoder_decoder_static_cache_generates_as_on_cpu():
    """A static encoder-decoder cache cannot be cropped, so generate does not defer its stop check for it (which
    crops the cache each step); its outputs, self- and cross-attentions included, are CPU's."""
    model = tiny_t5()
    model.set_attn_implementation("eager")
    prompt = torch.randint(2, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    actual, expected = _compare_generate(model, prompt, max_new_tokens=4, do_sample=False,
                                         cache_implementation="static", **ALL_OUTPUTS)
    assert actual.decoder_attentions[0][0].shape == expected.decoder_attentions[0][0].shape


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded_prompt"])
def test_encoder_decoder_decodes_in_one_program_as_on_cpu(padded):
    """T5 with a static cache decodes every step after the first in one program (the encoder's outputs and mask and
    the cross-attention cache the prefill wrote are its inputs); rows that reach the end-of-sequence token stop
    and are padded as on CPU; tokens and scores are CPU's."""
    from hf_tpu.compile import compile_stats

    model = tiny_t5()
    prompt = torch.randint(2, 99, (3, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, 3:] = 0
    first = model.generate(prompt, attention_mask=mask, max_new_tokens=2, do_sample=False)[:, 1]
    model.generation_config.eos_token_id = int(first[0])  # the first row stops after one token
    actual, _ = _compare_generate(model, prompt, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                  cache_implementation="static", return_dict_in_generate=True, output_scores=True)
    assert type(actual).__name__ == "GenerateEncoderDecoderOutput"
    assert compile_stats()["decode_loops"] == 1


def test_an_encoder_decoders_settings_that_read_its_prompt_are_kept_in_the_one_program():
    """``encoder_no_repeat_ngram_size`` (transformers looks the last tokens up among the prompt's n-grams on the
    host every step) and ``encoder_repetition_penalty`` run inside the loop: CPU's tokens, which they change."""
    from hf_tpu.compile import compile_stats

    model = tiny_t5()
    prompt = torch.randint(2, 99, (2, 9), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", return_dict_in_generate=True)
    settings = dict(encoder_no_repeat_ngram_size=2, encoder_repetition_penalty=3.0)
    _, expected = _compare_generate(model, prompt, **options, **settings)
    assert expected.sequences.tolist() != model.generate(prompt, **options).sequences.tolist()
    assert compile_stats()["decode_loops"] == 1


def _tiny_bart():
    config = transformers.BartConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
                                     decoder_ffn_dim=37, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(config).eval(), torch.randint(3, 99, (2, 7))


def _tiny_whisper():
    config = transformers.WhisperConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
                                        decoder_ffn_dim=37, num_mel_bins=16, max_source_positions=30,
                                        max_target_positions=40, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None)
    torch.manual_seed(0)
    return transformers.WhisperForConditionalGeneration(config).eval(), torch.randn(2, 16, 60)


@pytest.mark.parametrize("make", [_tiny_bart, _tiny_whisper], ids=["bart", "whisper"])
def test_other_encoder_decoders_decode_in_one_program_as_on_cpu(make):
    from hf_tpu.compile import compile_stats

    model, inputs = make()
    _compare_generate(model, inputs, max_new_tokens=6, do_sample=False, cache_implementation="static",
                      return_dict_in_generate=True, output_scores=True)
    assert compile_stats()["decode_loops"] == 1


def test_encoder_decoder_sampling_in_one_program_draws_as_transformers_loop():
    """A seeded draw (top-k, repetition penalty) gives the tokens and scores of transformers' own loop on tpu
    (``HF_TPU_STEPWISE_DECODE=1``), which draws from the same device stream."""
    from hf_tpu.compile import compile_stats

    model = tiny_t5().to("tpu")
    prompt = torch.randint(2, 99, (3, 7), generator=torch.Generator().manual_seed(2)).to("tpu")
    options = dict(max_new_tokens=8, do_sample=True, top_k=5, repetition_penalty=1.3, cache_implementation="static",
                   return_dict_in_generate=True, output_scores=True)
    results = []
    for stepwise in ("0", "1"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_TPU_STEPWISE_DECODE", stepwise)
            torch.manual_seed(1)
            results.append(model.generate(prompt, **options))
    assert compile_stats()["decode_loops"] == 1
    one_program, stepwise = results
    assert one_program.sequences.cpu().tolist() == stepwise.sequences.cpu().tolist()
    for a, b in zip(one_program.scores, stepwise.scores):
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=1e-5, rtol=1e-5)


def test_compiled_generate_keeps_transformers_compile_contract():
    """What transformers' own tests check of a compiled ``generate`` (``test_generate_compile_model_forward_fullgraph``,
    ``test_static_cache_no_recompile_with_smaller_length``): the model holds its compiled forward
    (``_compiled_call``) after a static-cache generate, whose decode steps run as hf_tpu's one program; a second
    generate with a shorter prompt compiles nothing, in Dynamo (``fail_on_recompile``) or XLA (the same program);
    and the tokens and scores are those of eager decoding with a dynamic cache on CPU."""
    from hf_tpu.compile import compile_stats, decode_loop, reset_compile_stats

    cpu_model = tiny_llama().eval()
    cpu_model.generation_config.pad_token_id = 0
    model = copy.deepcopy(cpu_model).to("tpu")
    compile_config = transformers.CompileConfig(fullgraph=True, dynamic=False)
    options = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (2, 7), generator=generator), torch.randint(1, 128, (2, 4), generator=generator)]
    assert not hasattr(model, "_compiled_call")
    reset_compile_stats()
    results = []
    for index, prompt in enumerate(prompts):
        stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
        with stance:
            results.append(model.generate(to_tpu(prompt), cache_implementation="static",
                                          compile_config=compile_config, **options))
        assert hasattr(model, "_compiled_call")
    assert compile_stats()["decode_loops"] == 2
    assert len(decode_loop._programs[model]) == 1
    for prompt, result in zip(prompts, results):
        expected = cpu_model.generate(prompt, **options)
        assert result.sequences.cpu().tolist() == expected.sequences.tolist()
        _assert_outputs_match(result.scores, expected.scores, "scores")
