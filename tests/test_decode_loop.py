"""generate() from a static cache on tpu decodes as one program (hf_tpu/compile/decode_loop.py): greedy tokens
and the cache are CPU's and transformers' loop's, sampled tokens and the random stream transformers' loop's, rows
stop at their own end-of-sequence token, and what the program cannot serve goes to transformers' loop."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from conftest import generation_pair, tiny_llama, to_tpu
from hf_tpu.compile import compile_stats, decode_loop
from tiny_models import Collector

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

NEW_TOKENS = 10


@pytest.fixture
def models():
    return generation_pair()


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts, the second left-padded by three tokens."""
    prompt = torch.randint(1, 128, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    prompt[1, :3], mask[1, :3] = 0, 0
    return prompt, mask


def _generate(model, prompt, mask=None, **options):
    inputs = {} if mask is None else {"attention_mask": mask.to(prompt.device)}
    options = dict(dict(max_new_tokens=NEW_TOKENS, do_sample=False), **options)
    if prompt.device.type == "tpu":
        options.setdefault("cache_implementation", "static")
    return model.generate(prompt, **inputs, **options)


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padded"])
def test_greedy_tokens_are_cpus_and_the_program_is_reused(models, padded):
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch() if padded else (_padded_batch()[0][:1], None)
    expected = _generate(cpu_model, prompt, mask)
    for _ in range(2):
        assert _generate(tpu_model, to_tpu(prompt), mask).cpu().tolist() == expected.tolist()
    assert compile_stats()["decode_loops"] == 2
    assert len(decode_loop._programs[tpu_model]) == 1


def test_rows_stop_at_their_own_end_of_sequence_token(models):
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    free = _generate(cpu_model, prompt, mask)[:, prompt.shape[1]:]
    eos = int(free[0, 3])  # the first row stops after 4 tokens at most, the others when they meet it, or at the end
    expected = _generate(cpu_model, prompt, mask, eos_token_id=eos)
    result = _generate(tpu_model, to_tpu(prompt), mask, eos_token_id=eos)
    assert result.cpu().tolist() == expected.tolist()
    assert (expected[0, prompt.shape[1]:] == 0).any()  # a finished row is padded while others go on
    assert compile_stats()["decode_loops"] == 1


@pytest.mark.parametrize("new_tokens", [1, 2])
def test_the_shortest_generations(models, new_tokens):
    """One new token comes from the prefill alone: the loop runs no step."""
    cpu_model, tpu_model = models
    prompt = _padded_batch()[0]
    expected = _generate(cpu_model, prompt, max_new_tokens=new_tokens)
    assert _generate(tpu_model, to_tpu(prompt), max_new_tokens=new_tokens).cpu().tolist() == expected.tolist()


@pytest.mark.parametrize("stop_early", [False, True], ids=["to_the_end", "eos"])
def test_a_streamer_gets_each_token_as_transformers_loop_hands_it_over(models, stop_early):
    """Streamed decoding runs one program per 8 tokens; the streamer gets the prompt, then each token."""
    cpu_model, tpu_model = models
    prompt = _padded_batch()[0][:1]
    options = {"eos_token_id": int(_generate(cpu_model, prompt)[0, prompt.shape[1] + 3])} if stop_early else {}
    streamed = []
    for model, inputs in ((cpu_model, prompt), (tpu_model, to_tpu(prompt))):
        streamer = Collector()
        result = _generate(model, inputs, streamer=streamer, **options)
        streamed.append((streamer.chunks, result.cpu().tolist()))
    assert streamed[1] == streamed[0]
    assert len(streamed[0][0]) == (6 if stop_early else NEW_TOKENS + 2)  # the prompt, the tokens, the end
    assert compile_stats()["decode_loops"] == (1 if stop_early else 2)  # 9 tokens after the prefill's: 8, then 1


def test_a_streamer_can_get_each_token_from_its_own_program_run(models, monkeypatch):
    """``HF_TPU_STREAMED_TOKENS=1``: a program run per token, the streamer's chunks as transformers' loop's."""
    cpu_model, tpu_model = models
    prompt = _padded_batch()[0][:1]
    streamed = []
    for model, inputs in ((cpu_model, prompt), (tpu_model, to_tpu(prompt))):
        streamer = Collector()
        monkeypatch.setenv("HF_TPU_STREAMED_TOKENS", "1")
        _generate(model, inputs, streamer=streamer)
        streamed.append(streamer.chunks)
    assert streamed[1] == streamed[0]
    assert compile_stats()["decode_loops"] == NEW_TOKENS - 1  # the first token is the prefill's
    monkeypatch.setenv("HF_TPU_STREAMED_TOKENS", "0")
    with pytest.raises(ValueError, match="HF_TPU_STREAMED_TOKENS='0' must be a positive number of tokens"):
        _generate(tpu_model, to_tpu(prompt), streamer=Collector())


@pytest.mark.parametrize("cancelled_at", [None, 3], ids=["never_cancelled", "cancelled_at_the_third_check"])
def test_a_criterion_checked_between_runs_stops_the_one_program_between_its_runs(models, monkeypatch, cancelled_at):
    """As serve's check that a client cancelled: a criterion that reads no token is checked between runs."""
    cpu_model, tpu_model = models
    prompt = _padded_batch()[0][:1]
    checks = []

    def cancelled(input_ids, scores, **kwargs):
        checks.append(input_ids.shape[1])
        return torch.full((input_ids.shape[0],), len(checks) == cancelled_at, device=input_ids.device)

    monkeypatch.setattr(decode_loop, "_BETWEEN_RUNS", [lambda criterion: criterion is cancelled])
    monkeypatch.setenv("HF_TPU_STREAMED_TOKENS", "3")
    expected = _generate(cpu_model, prompt)
    tokens = _generate(tpu_model, to_tpu(prompt), stopping_criteria=[cancelled]).cpu()
    runs = compile_stats()["decode_loops"]
    if cancelled_at is None:
        assert tokens.tolist() == expected.tolist() and runs == 3  # 9 tokens after the prefill's, 3 a run
    else:  # checked after the prefill's token and after each run: stopped after the second run
        assert tokens.tolist() == expected[:, :prompt.shape[1] + 7].tolist() and runs == 2
    assert checks[:3] == [prompt.shape[1] + 1, prompt.shape[1] + 4, prompt.shape[1] + 7]


def test_the_cache_handed_back_is_the_one_transformers_loop_leaves(models, monkeypatch):
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    expected = _generate(cpu_model, prompt, mask, return_dict_in_generate=True)
    ours = _generate(tpu_model, to_tpu(prompt), mask, return_dict_in_generate=True)
    assert compile_stats()["decode_loops"] == 1
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")
    stepwise = _generate(tpu_model, to_tpu(prompt), mask, return_dict_in_generate=True)
    assert ours.sequences.cpu().tolist() == stepwise.sequences.cpu().tolist() == expected.sequences.tolist()
    length = int(expected.past_key_values.get_seq_length())
    assert int(ours.past_key_values.get_seq_length()) == int(stepwise.past_key_values.get_seq_length()) == length
    assert length == prompt.shape[1] + NEW_TOKENS - 1  # the last token is not in it
    for mine, theirs in zip(ours.past_key_values.layers, stepwise.past_key_values.layers):
        assert mine.keys.shape == theirs.keys.shape  # trimmed from the bucket to the length it has on CPU
        torch.testing.assert_close(mine.keys[:, :, :length].cpu(), theirs.keys[:, :, :length].cpu())
        torch.testing.assert_close(mine.values[:, :, :length].cpu(), theirs.values[:, :, :length].cpu())


def test_a_static_cache_passed_in_decodes_in_one_program_and_serves_the_next_turn(models):
    """A ``StaticCache`` the caller made (as transformers' docs make one for compiled decoding) decodes in one
    program; passed again with the answer and a reply appended, generate prefills the new tokens only and decodes
    on: CPU's tokens both times, and the cache holds the same positions."""
    from transformers import StaticCache

    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    reply = torch.randint(1, 128, (3, 4), generator=torch.Generator().manual_seed(5))
    turns = {}
    for model, device in ((cpu_model, "cpu"), (tpu_model, "tpu")):
        cache = StaticCache(config=model.config, max_cache_len=48)
        first = _generate(model, prompt.to(device), mask, cache=cache, cache_implementation=None)
        second = _generate(model, torch.cat([first, reply.to(device)], dim=1),
                           torch.cat([mask, torch.ones(3, NEW_TOKENS + 4, dtype=mask.dtype)], dim=1), cache=cache,
                           cache_implementation=None)
        turns[device] = (first.cpu().tolist(), second.cpu().tolist(), int(cache.get_seq_length()))
    assert turns["tpu"] == turns["cpu"]
    assert compile_stats()["decode_loops"] == 2


@pytest.mark.parametrize("options", [dict(prefix_allowed_tokens_fn=lambda row, tokens: list(range(64))),
                                     dict(max_time=600.0), dict(return_dict_in_generate=True, output_attentions=True)],
                         ids=["python_callback_processor", "wall_clock_criterion", "attentions"])
def test_what_the_program_does_not_do_goes_to_transformers_loop(models, options):
    cpu_model, tpu_model = models
    prompt = _padded_batch()[0]
    expected = _generate(cpu_model, prompt, **options)
    result = _generate(tpu_model, to_tpu(prompt), **options)
    sequences = result.sequences if "return_dict_in_generate" in options else result
    expected = expected.sequences if "return_dict_in_generate" in options else expected
    assert sequences.cpu().tolist() == expected.tolist()
    assert compile_stats()["decode_loops"] == 0


@pytest.mark.parametrize("least", [dict(min_new_tokens=6), dict(min_length=13)], ids=["min_new_tokens", "min_length"])
def test_a_minimum_length_is_kept_in_the_one_program(models, least):
    """The end-of-sequence token is banned until the minimum is reached, by the loop's own count of the tokens so
    far: CPU's tokens, and one program for every generate."""
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    free = _generate(cpu_model, prompt, mask)[:, prompt.shape[1]:]
    eos = int(free[0, 1])  # without a minimum the first row would stop after 2 tokens
    expected = _generate(cpu_model, prompt, mask, eos_token_id=eos, **least)
    assert expected.tolist() != _generate(cpu_model, prompt, mask, eos_token_id=eos).tolist()
    for _ in range(2):
        assert _generate(tpu_model, to_tpu(prompt), mask, eos_token_id=eos, **least).cpu().tolist() == \
            expected.tolist()
    assert compile_stats()["decode_loops"] == 2
    assert len(decode_loop._programs[tpu_model]) == 1
    shorter = prompt[:, 2:]  # another prompt length, the same cache bucket: the same program
    assert _generate(tpu_model, to_tpu(shorter), mask[:, 2:], eos_token_id=eos, **least).cpu().tolist() == \
        _generate(cpu_model, shorter, mask[:, 2:], eos_token_id=eos, **least).tolist()
    assert len(decode_loop._programs[tpu_model]) == 1


def _settings(free: torch.Tensor) -> dict[str, dict]:
    """generate's settings whose processors read the tokens so far or their count, made to change the greedy
    tokens ``free`` of the padded batch (each row's new tokens)."""
    token = lambda row, column: int(free[row, column])  # noqa: E731
    return {
        "no_repeat_ngram_size_1": dict(no_repeat_ngram_size=1),
        "no_repeat_ngram_size_2": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[token(0, 2)], [token(1, 3), token(1, 4)], [token(2, 5), token(2, 6)]]),
        "sequence_bias": dict(sequence_bias=[[[token(0, 3)], -4.0], [[token(2, 4), token(0, 1)], 50.0]]),
        "suppress_tokens": dict(suppress_tokens=[token(0, 2), token(1, 5)], begin_suppress_tokens=[token(2, 0)]),
        "forced_eos_token_id": dict(forced_eos_token_id=token(0, 0), eos_token_id=token(0, 0)),
        "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(3, 40.0),
                                                 eos_token_id=token(1, 8)),
        "penalty_and_ngrams": dict(repetition_penalty=3.0, no_repeat_ngram_size=3, min_new_tokens=4,
                                   eos_token_id=token(0, 1)),
    }


@pytest.mark.parametrize("setting", list(_settings(torch.zeros(3, NEW_TOKENS, dtype=torch.long))))
def test_each_setting_that_reads_the_tokens_so_far_is_kept_in_the_one_program(models, setting):
    """Every generation setting whose state is the tokens so far and their count runs inside the loop: CPU's
    tokens (which the setting changes); a generate of other prompts, padding and prompt length reuses the
    program."""
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    plain = _generate(cpu_model, prompt, mask)
    options = _settings(plain[:, prompt.shape[1]:])[setting]
    expected = _generate(cpu_model, prompt, mask, **options)
    assert expected.tolist() != plain.tolist()
    assert _generate(tpu_model, to_tpu(prompt), mask, **options).cpu().tolist() == expected.tolist()
    assert compile_stats()["decode_loops"] == 1
    if setting == "penalty_and_ngrams":  # tensors of each generate (the penalty's ignored padding) are inputs
        prompt, mask = prompt.flip(0), mask.flip(0)  # the padded row last
        assert _generate(tpu_model, to_tpu(prompt), mask, **options).cpu().tolist() == \
            _generate(cpu_model, prompt, mask, **options).tolist()
    shorter, shorter_mask = prompt[:, 1:], mask[:, 1:]  # another prompt length, the same cache bucket
    assert _generate(tpu_model, to_tpu(shorter), shorter_mask, **options).cpu().tolist() == \
        _generate(cpu_model, shorter, shorter_mask, **options).tolist()
    assert len(decode_loop._programs[tpu_model]) == 1


def test_a_stop_string_ends_a_row_inside_the_one_program(tmp_path):
    """``stop_strings`` (with the tokenizer) stop each row where transformers' criterion would: CPU's tokens."""
    from tiny_models import save_tiny_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenizers import decoders

    path = save_tiny_llama(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()  # tokens as their bytes, which the criterion reads
    cpu_model = AutoModelForCausalLM.from_pretrained(path).eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    prompt, mask = _padded_batch()
    prompt = prompt % cpu_model.config.vocab_size
    free = _generate(cpu_model, prompt, mask)[:, prompt.shape[1]:]
    stops = dict(stop_strings=[tokenizer.decode(free[0, 2:4]), tokenizer.decode(free[2, 4])], tokenizer=tokenizer)
    expected = _generate(cpu_model, prompt, mask, **stops)
    assert expected.shape[1] < prompt.shape[1] + NEW_TOKENS or (expected[:, -1] == 0).any()
    assert _generate(tpu_model, to_tpu(prompt), mask, **stops).cpu().tolist() == expected.tolist()
    assert compile_stats()["decode_loops"] == 1


def _sampled(model, prompt, mask=None, seed=3, **options):
    """Sampled tokens from ``seed``, and the device's random state after them."""
    torch.manual_seed(seed)
    tokens = _generate(model, prompt, mask, do_sample=True, **options).cpu().tolist()
    return tokens, torch.tpu.get_rng_state().tolist()


@pytest.mark.parametrize("streamed", [False, True], ids=["at_once", "streamed"])
@pytest.mark.parametrize("processors", [dict(top_k=20, top_p=0.9, temperature=0.8),
                                        dict(top_k=0, min_p=0.05, eta_cutoff=0.05, remove_invalid_values=True,
                                             renormalize_logits=True)],
                         ids=["top_k_top_p_temperature", "min_p_eta_renormalized"])
def test_sampling_draws_what_transformers_loop_draws(models, monkeypatch, processors, streamed):
    """The loop draws each token with the key transformers' loop would draw it with, and leaves the random stream
    where that loop leaves it (streamed: a program run per 8 tokens, each going on from the last's keys)."""
    _, tpu_model = models
    prompt, mask = _padded_batch()
    free = _sampled(tpu_model, to_tpu(prompt), mask, **processors)[0]
    eos = {"eos_token_id": free[0][prompt.shape[1] + 3]}  # the first row stops early, padded while others go on
    collectors = [Collector(), Collector()] if streamed else [None, None]
    ours = _sampled(tpu_model, to_tpu(prompt), mask, streamer=collectors[0], **processors, **eos)
    assert ours[0][0][:prompt.shape[1] + 4] == free[0][:prompt.shape[1] + 4] and ours[0][0][-1] == 0
    assert compile_stats()["decode_loops"] == (3 if streamed else 2)
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")
    assert ours == _sampled(tpu_model, to_tpu(prompt), mask, streamer=collectors[1], **processors, **eos)
    assert ours != _sampled(tpu_model, to_tpu(prompt), mask, seed=4, **processors, **eos)  # it does draw
    if streamed:
        assert collectors[0].chunks == collectors[1].chunks


def test_a_repetition_penalty_reads_the_tokens_so_far_as_transformers_loop_does(models, monkeypatch):
    """Greedy: CPU's tokens (a penalty strong enough to change them); sampled: transformers' loop's draws."""
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    penalty = dict(repetition_penalty=5.0)
    expected = _generate(cpu_model, prompt, mask, **penalty)
    assert expected.tolist() != _generate(cpu_model, prompt, mask).tolist()
    for _ in range(2):  # each generate's penalty ignores its own prompt's padding: the program is the same
        assert _generate(tpu_model, to_tpu(prompt), mask, **penalty).cpu().tolist() == expected.tolist()
    assert len(decode_loop._programs[tpu_model]) == 1
    ours = _sampled(tpu_model, to_tpu(prompt), mask, top_k=10, **penalty)
    assert compile_stats()["decode_loops"] == 3
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")
    assert ours == _sampled(tpu_model, to_tpu(prompt), mask, top_k=10, **penalty)


@pytest.mark.parametrize("streamed", [False, True], ids=["at_once", "streamed"])
def test_each_steps_scores_and_logits_are_transformers_loops(models, monkeypatch, streamed):
    """Greedy with a penalty: CPU's sequences, scores and logits; sampled: transformers' loop's on tpu."""
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    options = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, repetition_penalty=1.5,
                   eos_token_id=int(_generate(cpu_model, prompt, mask)[0, prompt.shape[1] + 3]))
    runs = []
    for model, inputs in ((cpu_model, prompt), (tpu_model, to_tpu(prompt))):
        streamer = Collector() if streamed and model is tpu_model else None
        runs.append(_generate(model, inputs, mask, streamer=streamer, **options))
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")
    torch.manual_seed(2)
    runs.append(_generate(tpu_model, to_tpu(prompt), mask, do_sample=True, top_k=20, **options))
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "0")
    torch.manual_seed(2)
    runs.append(_generate(tpu_model, to_tpu(prompt), mask, do_sample=True, top_k=20, **options))
    assert compile_stats()["decode_loops"] == (3 if streamed else 2)
    for expected, ours in (runs[:2], runs[2:]):
        assert ours.sequences.cpu().tolist() == expected.sequences.cpu().tolist()
        for name in ("scores", "logits"):
            assert len(getattr(ours, name)) == len(getattr(expected, name)) == NEW_TOKENS
            for mine, theirs in zip(getattr(ours, name), getattr(expected, name)):
                assert mine.shape == theirs.shape
                torch.testing.assert_close(mine.cpu(), theirs.cpu(), atol=1e-4, rtol=1e-4)


def test_sampling_from_the_top_token_alone_is_cpus_greedy_decoding(models):
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    expected = _generate(cpu_model, prompt, mask)
    assert _generate(tpu_model, to_tpu(prompt), mask, do_sample=True, top_k=1).cpu().tolist() == expected.tolist()
    assert compile_stats()["decode_loops"] == 1


def test_a_step_that_cannot_be_one_program_warns_once_and_decodes_step_by_step(models, monkeypatch):
    cpu_model, tpu_model = models
    prompt = _padded_batch()[0]
    tries = []

    def trace(step, *arguments):
        tries.append(1)
        raise NotImplementedError("aten::made_up has no lowering")

    monkeypatch.setattr(decode_loop._Step, "forward", trace)
    expected = _generate(cpu_model, prompt)
    with pytest.warns(UserWarning, match="runs step by step.*made_up"):
        assert _generate(tpu_model, to_tpu(prompt)).cpu().tolist() == expected.tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert _generate(tpu_model, to_tpu(prompt)).cpu().tolist() == expected.tolist()
    assert len(tries) == 1 and compile_stats()["decode_loops"] == 0


def test_sampling_falls_back_to_transformers_loop_with_its_draws(models, monkeypatch):
    """The first token, drawn before the loop is built, is drawn again by transformers' loop from the start."""
    _, tpu_model = models
    prompt = _padded_batch()[0]

    def trace(step, *arguments):
        raise NotImplementedError("aten::made_up has no lowering")

    monkeypatch.setattr(decode_loop._Step, "forward", trace)
    with pytest.warns(UserWarning, match="runs step by step.*made_up"):
        ours = _sampled(tpu_model, to_tpu(prompt))
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")
    assert ours == _sampled(tpu_model, to_tpu(prompt))


def test_a_model_generating_in_train_mode_decodes_as_one_program_once_in_eval_mode():
    cpu_model = tiny_llama(tie_word_embeddings=False, attention_dropout=0.5).eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu").train()
    prompt = _padded_batch()[0]
    with pytest.warns(UserWarning, match="runs step by step.*random operators"):
        _generate(tpu_model, to_tpu(prompt))  # dropout draws from the device's random stream at each step
    tpu_model.eval()
    assert _generate(tpu_model, to_tpu(prompt)).cpu().tolist() == _generate(cpu_model, prompt).tolist()
    assert compile_stats()["decode_loops"] == 1


def test_a_hook_added_after_the_first_generate_gets_a_new_program(models):
    cpu_model, tpu_model = models
    prompt = _padded_batch()[0]
    _generate(tpu_model, to_tpu(prompt))

    def favour_token_5(module, inputs, output):
        return output + torch.nn.functional.one_hot(torch.tensor(5), 128).to(output) * 10 * output.abs().max()

    for model in (cpu_model, tpu_model):
        model.lm_head.register_forward_hook(favour_token_5)
    expected = _generate(cpu_model, prompt)
    assert (expected[:, prompt.shape[1]:] == 5).all()
    assert _generate(tpu_model, to_tpu(prompt)).cpu().tolist() == expected.tolist()
    assert len(decode_loop._programs[tpu_model]) == 2


def test_an_index_out_of_range_inside_the_loop_raises_cpus_error_at_the_next_read(models):
    _, tpu_model = models
    forwards = []

    def out_of_range_after_the_prefill(module, inputs, output):
        forwards.append(1)
        index = torch.full((1,), 3 if len(forwards) == 1 else 500, device=output.device)
        return output + output.index_select(-1, index)

    tpu_model.lm_head.register_forward_hook(out_of_range_after_the_prefill)
    result = _generate(tpu_model, to_tpu(_padded_batch()[0]))
    with pytest.raises(IndexError, match="index out of range in self"):
        result.cpu()
    assert compile_stats()["decode_loops"] == 1


def test_fused_eager_mode_gives_the_same_tokens(models):
    cpu_model, tpu_model = models
    prompt, mask = _padded_batch()
    expected = _generate(cpu_model, prompt, mask)
    previous = torch.tpu.get_eager_mode()
    torch.tpu.set_eager_mode("fused")
    try:
        result = _generate(tpu_model, to_tpu(prompt), mask)
    finally:
        torch.tpu.set_eager_mode(previous)
    assert result.cpu().tolist() == expected.tolist()
    assert compile_stats()["decode_loops"] == 1
