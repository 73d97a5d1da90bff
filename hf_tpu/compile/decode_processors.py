"""transformers' logits processors and stopping criteria as the one-program decode loop runs them.

transformers' processors read the count of tokens so far from ``input_ids.shape[-1]`` and the tokens from
``input_ids``, whose width grows by one a step. The loop's step is one program for every step, so there the tokens
so far are a fixed-width array (the maximum length's columns, the first ``length`` written) and their count a traced
number. Each class here restates one processor's rule on those two, with transformers' ops in transformers' order
so that the scores are the same, and is registered by :func:`loop_form` for the transformers classes it stands for.
Processors that read the scores alone (temperature, top-k, top-p, ...) run as they are.

Left to transformers' step-by-step loop (the loop's caller falls back for them): ``PrefixConstrainedLogitsProcessor``
calls Python with each row's tokens every step; the watermarking processors hash the tokens on the host; classifier-free
guidance runs a second forward per step; Whisper's and Bark's and Dia's processors read model-specific state;
``MaxTimeCriteria`` reads the wall clock.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Sequence

import torch

_FORMS: dict[str, type] = {}  # transformers' class name -> the class that runs it in the loop


def loop_form(*names: str) -> Callable[[type], type]:
    """Registers a class as the loop's form of the transformers processors or criteria called ``names``."""
    def register(form: type) -> type:
        _FORMS.update(dict.fromkeys(names, form))
        return form
    return register


class LoopProcessor:
    """A logits processor as the loop runs it: ``form(tokens, scores, length, **inputs)``, the tokens so far
    ``(batch, the cache's length)`` with the first ``length`` columns written (a stopping criterion: ``form(tokens,
    length)``). Its public attributes are plain numbers
    and tuples (what the program depends on: :meth:`key`); :attr:`inputs` are tensors of one ``generate`` that the
    step takes as inputs; attributes named with ``_`` are the trace's constants."""

    inputs: dict[str, torch.Tensor] = {}

    @classmethod
    def accepts(cls, processor: Any) -> bool:
        return True

    def key(self) -> tuple:
        return type(self), tuple(sorted((name, value) for name, value in vars(self).items()
                                        if not name.startswith("_") and name != "inputs"))


def _token_ids(value: Any) -> tuple[int, ...]:
    return tuple(int(token) for token in torch.as_tensor(value).reshape(-1).tolist())


def _vocabulary_mask(scores: torch.Tensor, tokens: tuple[int, ...]) -> torch.Tensor:
    vocabulary = torch.arange(scores.shape[-1], device=scores.device)
    return torch.isin(vocabulary, torch.tensor(tokens, device=scores.device))


def _length_input(count: int, sequences: torch.Tensor) -> torch.Tensor:
    """A count of tokens that depends on the prompt's length, as an input of the step (a 0-d int64 tensor)."""
    return torch.tensor(count, dtype=torch.int64, device=sequences.device)


def _last_columns(tokens: torch.Tensor, length: torch.Tensor, count: int, before_start: int | None = None
                  ) -> torch.Tensor:
    """The ``count`` columns of ``tokens`` that end at column ``length`` (exclusive); those before the first column
    hold ``before_start`` (the first column's token if ``None``)."""
    positions = length - count + torch.arange(count, device=tokens.device)
    window = tokens.gather(1, positions.clamp(min=0).expand(tokens.shape[0], count))
    return window if before_start is None else torch.where(positions >= 0, window, before_start)


def _banned(scores: torch.Tensor, tokens: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``scores`` with -inf at each row's ``tokens`` (``(batch, k)``) where ``where`` holds."""
    vocabulary_size = scores.shape[-1]
    banned = scores.new_zeros((scores.shape[0], vocabulary_size + 1), dtype=torch.bool)
    banned = banned.scatter(1, torch.where(where, tokens.clamp(max=vocabulary_size), vocabulary_size), True)
    return scores.masked_fill(banned[:, :vocabulary_size], -float("inf"))


def _widened(count: int) -> int:
    """How many entries an input of ``count`` is widened to: a power of two, 64 at least, so that one program
    serves many counts."""
    return max(64, 1 << (count - 1).bit_length())


def _per_row(prompts: torch.Tensor, rows: int) -> torch.Tensor:
    """A tensor of each prompt's, repeated for each of its ``rows`` (beam search's beams), as transformers does."""
    return prompts.repeat_interleave(rows // prompts.shape[0], dim=0) if rows > prompts.shape[0] else prompts


@loop_form("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")
class MinLength(LoopProcessor):
    """``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``: the end-of-sequence tokens' scores
    are -inf while the tokens so far are fewer than ``min_length`` (the prompt's length plus ``min_new_tokens`` for
    the latter). That length is an input of the step, so that one program serves every prompt's length."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        skipped = getattr(processor, "prompt_length_to_skip", None)
        least = processor.min_length if skipped is None else skipped + processor.min_new_tokens
        self.eos_token_ids = _token_ids(processor.eos_token_id)
        self.inputs = {"least": _length_input(least, sequences)}

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor,
                 least: torch.Tensor) -> torch.Tensor:
        return torch.where(_vocabulary_mask(scores, self.eos_token_ids) & (length < least), -math.inf, scores)


@loop_form("RepetitionPenaltyLogitsProcessor")
class RepetitionPenalty(LoopProcessor):
    """``RepetitionPenaltyLogitsProcessor``: each token so far has its score divided by the penalty (multiplied,
    if negative) once. The leading tokens it ignores (``prompt_ignore_length``, which generate sets to each row's
    left padding) are an input of the step, so that one program serves every prompt's padding."""

    @classmethod
    def accepts(cls, processor: Any) -> bool:
        return getattr(processor, "logits_indices", None) is None  # continuous batching's packed rows

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.penalty = float(processor.penalty)
        ignored = processor.prompt_ignore_length
        ignored = torch.as_tensor(0 if ignored is None else ignored, device=sequences.device)
        self.inputs = {"ignored": ignored.to(torch.int64).expand(sequences.shape[0]).contiguous()}

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor,
                 ignored: torch.Tensor) -> torch.Tensor:
        vocabulary_size = scores.shape[-1]
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        counted = (positions[None, :] >= ignored[:, None]) & (positions[None, :] < length)
        ids = tokens.masked_fill(~counted, vocabulary_size).clamp(max=vocabulary_size)
        scores = torch.nn.functional.pad(scores, (0, 1))
        score = torch.gather(scores, 1, ids)
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return scores.scatter(1, ids, score)[..., :vocabulary_size]


@loop_form("NoRepeatNGramLogitsProcessor")
class NoRepeatNGram(LoopProcessor):
    """``NoRepeatNGramLogitsProcessor``: a token that would complete an n-gram already among the tokens so far
    scores -inf."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        if processor.ngram_size > max_length:
            raise NotImplementedError("no_repeat_ngram_size is longer than the generation")
        self.ngram_size = processor.ngram_size

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        size = self.ngram_size
        prefix = _last_columns(tokens, length, size - 1)
        windows = tokens.unfold(dimension=1, size=size, step=1)
        complete = torch.arange(windows.shape[1], device=tokens.device) + size <= length  # within the tokens so far
        matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & complete
        return _banned(scores, windows[..., -1], matches)


@loop_form("SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor")
class SequenceBias(LoopProcessor):
    """``SequenceBiasLogitsProcessor`` and ``NoBadWordsLogitsProcessor`` (a bias of -inf): a token's bias is added
    when it completes a biased sequence, which for a sequence of several tokens means the tokens so far end in the
    rest of it. The bias tensors are made in the step, as the processor makes them, from its sequences."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.sequence_bias = tuple(sorted(processor.sequence_bias.items()))

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        single = torch.zeros((scores.shape[-1],), dtype=torch.float, device=scores.device)
        ones = [(sequence[0], bias) for sequence, bias in self.sequence_bias if len(sequence) == 1]
        if ones:
            single[[token for token, _ in ones]] = torch.tensor([bias for _, bias in ones], device=scores.device)
        bias = torch.zeros_like(scores)
        bias += single
        by_prefix_length: dict[int, list] = {}
        for sequence, sequence_bias in self.sequence_bias:
            if len(sequence) > 1:
                by_prefix_length.setdefault(len(sequence) - 1, []).append((sequence, sequence_bias))
        for prefix_length, group in by_prefix_length.items():
            if prefix_length > tokens.shape[1]:
                continue
            prefixes = torch.tensor([sequence[:-1] for sequence, _ in group], device=scores.device)
            last_tokens = torch.tensor([sequence[-1] for sequence, _ in group], device=scores.device)
            biases = torch.tensor([value for _, value in group], dtype=torch.float, device=scores.device)
            ending = _last_columns(tokens, length, prefix_length)
            matching = (ending[:, None] == prefixes).all(dim=-1) & (length >= prefix_length)
            bias.index_add_(1, last_tokens, torch.where(matching, biases, 0.0).to(bias.dtype))
        return scores + bias


def _forced(scores: torch.Tensor, tokens: tuple[int, ...]) -> torch.Tensor:
    """Scores that leave only ``tokens`` possible, as transformers' forcing processors write them."""
    forced = torch.full_like(scores, -math.inf)
    forced[:, list(tokens)] = 0
    return forced


@loop_form("ForcedBOSTokenLogitsProcessor")
class ForcedBOS(LoopProcessor):
    """``ForcedBOSTokenLogitsProcessor``: the token after a one-token prompt is the beginning-of-sequence token."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.bos_token_id = int(processor.bos_token_id)

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        return torch.where(length == 1, _forced(scores, (self.bos_token_id,)), scores)


@loop_form("ForcedEOSTokenLogitsProcessor")
class ForcedEOS(LoopProcessor):
    """``ForcedEOSTokenLogitsProcessor``: the last token is an end-of-sequence token. The maximum length (the
    prompt's length plus ``max_new_tokens``) is an input of the step, so that one program serves every prompt's
    length."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.eos_token_ids = _token_ids(processor.eos_token_id)
        self.inputs = {"longest": _length_input(processor.max_length, sequences)}

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor,
                 longest: torch.Tensor) -> torch.Tensor:
        return torch.where(length == longest - 1, _forced(scores, self.eos_token_ids), scores)


@loop_form("SuppressTokensAtBeginLogitsProcessor")
class SuppressTokensAtBegin(LoopProcessor):
    """``SuppressTokensAtBeginLogitsProcessor``: the first token generated is none of the suppressed ones. Where
    generation begins (the prompt's length) is an input of the step, so that one program serves every prompt's
    length."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.tokens = _token_ids(processor.begin_suppress_tokens)
        self.inputs = {"begin": _length_input(processor.begin_index, sequences)}

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor,
                 begin: torch.Tensor) -> torch.Tensor:
        return torch.where(_vocabulary_mask(scores, self.tokens) & (length == begin), -float("inf"), scores)


@loop_form("ExponentialDecayLengthPenalty")
class ExponentialDecayLength(LoopProcessor):
    """``ExponentialDecayLengthPenalty``: past a start, the end-of-sequence tokens' scores grow by a factor to the
    power of the tokens past it. The power is taken in float64, as Python takes transformers'. The start (counted
    from the prompt's end) is an input of the step, so that one program serves every prompt's length."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.factor = float(processor.regulation_factor)
        self.eos_token_ids = _token_ids(processor.eos_token_id)
        self.inputs = {"start": _length_input(processor.regulation_start, sequences)}

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor,
                 start: torch.Tensor) -> torch.Tensor:
        eos = list(self.eos_token_ids)
        growth = torch.tensor(self.factor, dtype=torch.float64, device=scores.device) ** (length - start) - 1
        penalty = torch.abs(scores[:, eos]) * growth.to(scores.dtype)
        penalty = penalty.masked_fill(~torch.isfinite(scores[:, eos]), 0.0)
        penalties = torch.zeros_like(scores)
        penalties[:, eos] = penalty
        return torch.where(length > start, scores + penalties, scores)


@loop_form("SuppressTokensLogitsProcessor")
class SuppressTokens(LoopProcessor):
    """``SuppressTokensLogitsProcessor``: the suppressed tokens score -inf."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.tokens = _token_ids(processor.suppress_tokens)

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        return torch.where(_vocabulary_mask(scores, self.tokens), -float("inf"), scores)


@loop_form("EtaLogitsWarper")
class EtaCutoff(LoopProcessor):
    """``EtaLogitsWarper`` (``eta_cutoff``): a token whose probability is under ``min(epsilon, sqrt(epsilon) *
    exp(-entropy))`` takes the filter value, unless it is among the ``min_tokens_to_keep`` most likely. It reads
    the scores alone, but holds ``epsilon`` as a tensor, a number here (in float32, as transformers' tensor holds
    it), and checks the distribution's argument by reading the device, which the trace does not."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.epsilon = float(processor.epsilon)
        self.filter_value = float(processor.filter_value)
        self.min_tokens_to_keep = int(processor.min_tokens_to_keep)

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        epsilon = torch.tensor(self.epsilon, dtype=torch.float32, device=scores.device)
        probabilities = scores.softmax(dim=-1)
        entropy = torch.distributions.Categorical(logits=scores, validate_args=False).entropy()
        eta = torch.min(epsilon, torch.sqrt(epsilon) * torch.exp(-entropy))[..., None]
        kept = min(self.min_tokens_to_keep, scores.size(-1))
        removed = (probabilities < eta) & (scores < torch.topk(scores, kept)[0][..., -1, None])
        return scores.masked_fill(removed, self.filter_value)


@loop_form("EncoderRepetitionPenaltyLogitsProcessor")
class EncoderRepetitionPenalty(LoopProcessor):
    """``EncoderRepetitionPenaltyLogitsProcessor`` (``encoder_repetition_penalty``): the prompt's tokens (the
    encoder's, for an encoder-decoder model) have their scores multiplied by the penalty (divided, if negative).
    Those tokens are an input of the step, widened to a power of two (64 at least) with each row's first token
    (written again, to the same score), so that one program serves prompts of many lengths."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.penalty = float(processor.penalty)  # the inverse of the setting, as transformers holds it
        prompt = processor.encoder_input_ids.to(sequences.device)
        filler = prompt[:, :1].expand(-1, _widened(prompt.shape[1]) - prompt.shape[1])
        self.inputs = {"prompt": torch.cat([prompt, filler], dim=1)}

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor,
                 prompt: torch.Tensor) -> torch.Tensor:
        prompt = _per_row(prompt, scores.shape[0])
        score = torch.gather(scores, 1, prompt)
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return scores.scatter(1, prompt, score)


@loop_form("EncoderNoRepeatNGramLogitsProcessor")
class EncoderNoRepeatNGram(LoopProcessor):
    """``EncoderNoRepeatNGramLogitsProcessor`` (``encoder_no_repeat_ngram_size``): a token that would complete an
    n-gram of the encoder's input scores -inf. transformers keeps each prompt's n-grams in a dictionary and looks
    up each row's last tokens in it on the host every step; here they are an input of the step, ``(prompts,
    n-grams, n)``, widened to a power of two (64 at least) with n-grams of -1 that match nothing."""

    def __init__(self, processor: Any, sequences: torch.Tensor, max_length: int) -> None:
        self.ngram_size = processor.ngram_size
        rows = [[(*prefix, token) for prefix, tokens in ngrams.items() for token in tokens]
                for ngrams in processor.generated_ngrams]
        count = _widened(max(map(len, rows)))
        filler = (-1,) * self.ngram_size
        self.inputs = {"ngrams": torch.tensor([row + [filler] * (count - len(row)) for row in rows],
                                              dtype=torch.int64, device=sequences.device)}

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor,
                 ngrams: torch.Tensor) -> torch.Tensor:
        ngrams = _per_row(ngrams, scores.shape[0])
        prefix = _last_columns(tokens, length, self.ngram_size - 1)
        matches = (ngrams[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & (length >= self.ngram_size - 1)
        return _banned(scores, ngrams[..., -1], matches & (ngrams[..., -1] >= 0))


@loop_form("StopStringCriteria")
class StopStrings(LoopProcessor):
    """``StopStringCriteria`` as the loop runs it: ``form(tokens, length, **inputs)`` is true for the rows whose
    tokens so far end in a stop string, by transformers' criterion on their last ``maximum_token_len`` tokens; a
    window that reaches before the first token holds, there, the token that matches nothing. The criterion's
    table of the tokenizer's tokens is an input of the step."""

    def __init__(self, criterion: Any, sequences: torch.Tensor, max_length: int) -> None:
        self._criterion = criterion
        self.stop_strings, self.maximum_token_len = criterion.stop_strings, criterion.maximum_token_len
        self.max_valid_positions = criterion.max_valid_positions
        device = sequences.device
        self.inputs = {"embedding": criterion.embedding_vec.to(device), "lengths": criterion.target_lens.to(device)}

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, embedding: torch.Tensor,
                 lengths: torch.Tensor) -> torch.Tensor:
        criterion = copy.copy(self._criterion)
        criterion.embedding_vec, criterion.target_lens = embedding, lengths
        nothing = embedding.shape[0] - 1
        return criterion(_last_columns(tokens, length, self.maximum_token_len, nothing), None)


@functools.cache
def _forms() -> dict[type, type]:
    from transformers.generation import logits_process, stopping_criteria

    return {getattr(module, name): form for name, form in _FORMS.items()
            for module in (logits_process, stopping_criteria) if hasattr(module, name)}


@functools.cache
def _reading_scores_alone() -> frozenset:
    """transformers' logits processors that read the scores alone and hold plain numbers: they run as they are."""
    from transformers.generation import logits_process

    return frozenset(getattr(logits_process, name) for name in (
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "TopHLogitsWarper", "MinPLogitsWarper",
        "TypicalLogitsWarper", "EpsilonLogitsWarper", "InfNanRemoveLogitsProcessor",
        "LogitNormalization") if hasattr(logits_process, name))


def runs_in_the_loop(processor: Any) -> bool:
    """Whether the loop runs a logits processor or stopping criterion (the end-of-sequence and length criteria
    are the loop's own)."""
    form = _forms().get(type(processor))
    return type(processor) in _reading_scores_alone() or (form is not None and form.accepts(processor))


def as_run(processors: Sequence, sequences: torch.Tensor, max_length: int) -> list:
    """The processors (or criteria) as the loop runs them, for a ``generate`` at ``sequences``."""
    return [processor if type(processor) in _reading_scores_alone() else
            _forms()[type(processor)](processor, sequences, max_length) for processor in processors]


def key(processors: Sequence) -> tuple:
    """What a program depends on of the processors as run: each form's :meth:`~LoopProcessor.key`, each processor
    that runs as it is by its class and settings."""
    return tuple(processor.key() if isinstance(processor, LoopProcessor) else
                 (type(processor), tuple(sorted(vars(processor).items()))) for processor in processors)


def process(processors: Sequence, tokens: torch.Tensor, scores: torch.Tensor, length: torch.Tensor | None,
            inputs: Sequence[dict]) -> torch.Tensor:
    """The scores through the processors as run (traced in the step), each form with its ``inputs``."""
    for processor, given in zip(processors, inputs):
        scores = processor(tokens, scores, length, **given) if isinstance(processor, LoopProcessor) else \
            processor(tokens, scores)
    return scores
