"""Beam search as one XLA program: each step's forward and transformers' beam bookkeeping in a loop on the chip.

transformers' ``_beam_search`` keeps its beams in static-shaped tensors (the running and the finished sequences,
their scores and beam indices). After each forward it picks the top continuations, sets finished beams aside,
reorders the cache and decides whether to go on, a decision the host reads every step. For a static cache of
full-attention layers, :func:`search` runs every step after the first token as one program: the model's decode
step, :func:`advance` (transformers' bookkeeping, through its own helpers) and the cache's reorder, in a
``jax.lax.while_loop`` that ends where transformers' loop would. The length so far, the prompt's length and the
maximum length are inputs of the program, and the beams' arrays are as wide as the cache, so one program serves
every prompt and every ``max_new_tokens`` that fit the cache's bucket.

The beams are transformers': the same scores through the same ops, ties broken by ``topk`` as on any device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..backend import random_state, storage
from . import decode_loop, decode_processors, sliding_window

# the beams' state, transformers' names (``cur_len``: the tokens so far; ``going``: its loop's condition)
_BEAMS = ("running_sequences", "running_beam_scores", "running_beam_indices", "sequences", "beam_scores",
          "beam_indices", "is_sent_finished", "is_early_stop_heuristic_unsatisfied", "cur_len", "going")
# what the beams are measured against: the prompt's length (``decoder_prompt_len``) and the maximum length
_LIMITS = ("decoder_prompt_len", "max_length")
_EOS = "end-of-sequence tokens"
_STEP_TENSORS = ("input_ids", "decoder_input_ids", "attention_mask", "position_ids")  # carried from step to step


@dataclasses.dataclass(frozen=True)
class Settings:
    """What shapes a beam search besides its tensors: transformers' ``batch_size``, ``num_beams``, ``beams_to_keep``
    (the continuations kept a step: a beam's worth more per end-of-sequence token, at least twice the beams),
    ``do_sample``, ``length_penalty`` and ``early_stopping``."""

    batch_size: int
    num_beams: int
    beams_to_keep: int
    do_sample: bool
    length_penalty: float
    early_stopping: bool | str

    @classmethod
    def of(cls, generation_config: Any, rows: int, eos: torch.Tensor | None) -> Settings:
        num_beams = generation_config.num_beams
        return cls(rows // num_beams, num_beams, max(2, 1 + (0 if eos is None else eos.shape[0])) * num_beams,
                   bool(generation_config.do_sample), float(generation_config.length_penalty),
                   generation_config.early_stopping)


def start(input_ids: torch.Tensor, settings: Settings, width: int, fill: int, max_length: int) -> dict:
    """The beams before the first token (transformers' initial state), their sequences and beam indices ``width``
    columns wide, the columns past the prompt holding ``fill``; and the limits."""
    batch, beams = settings.batch_size, settings.num_beams
    prompt_length, device = input_ids.shape[1], input_ids.device
    running_sequences = torch.full((batch, beams, width), fill, dtype=torch.int64, device=device)
    running_sequences[:, :, :prompt_length] = input_ids.reshape(batch, beams, prompt_length)
    running_beam_scores = torch.zeros((batch, beams), dtype=torch.float, device=device)
    running_beam_scores[:, 1:] = -1e9  # only the first beam's tokens count at first: no beam repeats another
    running_beam_indices = torch.full((batch, beams, width), -1, dtype=torch.int32, device=device)
    state = dict(
        running_sequences=running_sequences, running_beam_scores=running_beam_scores,
        running_beam_indices=running_beam_indices, sequences=running_sequences.clone(),
        beam_scores=torch.full((batch, beams), -1e9, dtype=torch.float, device=device),
        beam_indices=running_beam_indices.clone(),
        is_sent_finished=torch.zeros((batch, beams), dtype=torch.bool, device=device),
        is_early_stop_heuristic_unsatisfied=torch.ones((batch, 1), dtype=torch.bool, device=device),
        cur_len=torch.tensor(prompt_length, device=device),
        going=torch.tensor(True, device=device))
    limits = dict(decoder_prompt_len=torch.tensor(prompt_length, device=device),
                  max_length=torch.tensor(max_length, device=device))
    return {**state, **limits}


def _column(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[..., index]`` for a 0-d ``index`` tensor (torch reads such an index on the host)."""
    return tensor.gather(-1, index.reshape((1,) * tensor.ndim).expand(*tensor.shape[:-1], 1)).squeeze(-1)


def _with_column(tensor: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``tensor`` with ``tensor[..., index] = values`` for a 0-d ``index`` tensor."""
    where = index.reshape((1,) * tensor.ndim).expand(*tensor.shape[:-1], 1)
    return tensor.scatter(-1, where, values[..., None].to(tensor.dtype))


def _top_k_continuations(model: Any, log_probs: torch.Tensor, beams: dict,
                         settings: Settings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' ``_get_top_k_continuations``, with the length so far a tensor: the best ``beams_to_keep``
    continuations of all beams (or as many drawn without replacement), their sequences and beam indices."""
    if settings.do_sample:
        indices = torch.multinomial(torch.nn.functional.softmax(log_probs, dim=-1), num_samples=settings.beams_to_keep)
        top_log_probs = torch.gather(input=log_probs, dim=1, index=indices)
        top_log_probs, order = top_log_probs.sort(dim=-1, descending=True)
        indices = indices.gather(dim=-1, index=order)
    else:
        top_log_probs, indices = torch.topk(log_probs, k=settings.beams_to_keep)
    vocabulary_size = log_probs.shape[-1] // settings.num_beams
    beam = indices // vocabulary_size
    sequences = _with_column(model._gather_beams(beams["running_sequences"], beam), beams["cur_len"],
                             indices % vocabulary_size)
    offset = torch.arange(settings.batch_size, device=indices.device).view(-1, 1) * settings.num_beams
    beam_indices = _with_column(model._gather_beams(beams["running_beam_indices"], beam),
                                beams["cur_len"] - beams["decoder_prompt_len"], beam + offset)
    return top_log_probs, sequences, beam_indices


def advance(model: Any, beams: dict, logits: torch.Tensor, settings: Settings,
            process: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            stop: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict, torch.Tensor, dict]:
    """One step of transformers' beam search after the forward that gave ``logits``: the beams with the next
    token, the rows of the cache each running beam continues (its ``beam_idx``), and what transformers keeps of
    the step when asked (``"scores"``: the processed log-probabilities; ``"logits"``: the last position's logits
    in float32). ``process``: the logits processors, given the running sequences (flat, ``cur_len`` columns
    written) and the log-probabilities; ``stop``: the stopping criteria, given the continuations' sequences (flat,
    one more column written)."""
    batch, beams_count = settings.batch_size, settings.num_beams
    cur_len, prompt_length = beams["cur_len"], beams["decoder_prompt_len"]
    raw = logits[:, -1].to(copy=True, dtype=torch.float32)
    scores = process(model._flatten_beam_dim(beams["running_sequences"]), torch.nn.functional.log_softmax(raw, -1))
    log_probs = model._unflatten_beam_dim(scores, batch, beams_count) + beams["running_beam_scores"][:, :, None]
    top_log_probs, top_sequences, top_beam_indices = _top_k_continuations(model, log_probs.reshape(batch, -1),
                                                                          beams, settings)
    hits = model._unflatten_beam_dim(stop(model._flatten_beam_dim(top_sequences)), batch, settings.beams_to_keep)
    running_sequences, running_beam_scores, running_beam_indices = model._get_running_beams_for_next_iteration(
        topk_log_probs=top_log_probs, topk_running_sequences=top_sequences,
        topk_running_beam_indices=top_beam_indices, next_token_hits_stopping_criteria=hits, num_beams=beams_count)
    top_num_beam_mask = torch.arange(settings.beams_to_keep, device=hits.device) < beams_count
    sequences, beam_scores, beam_indices, is_sent_finished = model._update_finished_beams(
        sequences=beams["sequences"], topk_running_sequences=top_sequences, beam_scores=beams["beam_scores"],
        topk_log_probs=top_log_probs, beam_indices=beams["beam_indices"], topk_running_beam_indices=top_beam_indices,
        is_early_stop_heuristic_unsatisfied=beams["is_early_stop_heuristic_unsatisfied"],
        is_sent_finished=beams["is_sent_finished"], next_token_hits_stopping_criteria=hits,
        top_num_beam_mask=top_num_beam_mask, num_beams=beams_count, cur_len=cur_len,
        decoder_prompt_len=prompt_length, length_penalty=settings.length_penalty,
        early_stopping=settings.early_stopping)
    beam_idx = model._flatten_beam_dim(_column(running_beam_indices, cur_len - prompt_length))
    cur_len = cur_len + 1
    unsatisfied = model._check_early_stop_heuristic(
        is_early_stop_heuristic_unsatisfied=beams["is_early_stop_heuristic_unsatisfied"],
        running_beam_scores=running_beam_scores, beam_scores=beam_scores, is_sent_finished=is_sent_finished,
        cur_len=cur_len, max_length=beams["max_length"], decoder_prompt_len=prompt_length,
        early_stopping=settings.early_stopping, length_penalty=settings.length_penalty)
    going = model._beam_search_has_unfinished_sequences(unsatisfied, is_sent_finished, hits, settings.early_stopping)
    return dict(beams, running_sequences=running_sequences, running_beam_scores=running_beam_scores,
                running_beam_indices=running_beam_indices, sequences=sequences, beam_scores=beam_scores,
                beam_indices=beam_indices, is_sent_finished=is_sent_finished,
                is_early_stop_heuristic_unsatisfied=unsatisfied, cur_len=cur_len, going=going), beam_idx, \
        {"scores": scores, "logits": raw}


def reorder(cache: Any, beam_idx: torch.Tensor, layer_tensors: Sequence[torch.Tensor] | None = None) -> None:
    """Each running beam's cache rows become those of the beam it continues (the cache's ``reorder_cache``),
    written in place into the cache's tensors (``layer_tensors``, if given: every layer's keys, then values, then
    lengths). Only the self-attention layers: an encoder-decoder cache's cross-attention rows are the same for
    every beam of a prompt, and beams continue beams of their own prompt."""
    layer_tensors = decode_loop._layer_tensors(cache) if layer_tensors is None else layer_tensors
    layers = len(decode_loop._layers(cache))
    own = len(getattr(cache, "self_attention_cache", cache).layers)
    for tensor in (*layer_tensors[:own], *layer_tensors[layers:layers + own]):
        tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))


class _Step(torch.nn.Module):
    """One beam-search step of ``model`` on ``cache``: takes the cache layers' keys, values and lengths, then the
    step's other inputs (``input_names``: the beams, the limits, the model's step inputs, the end-of-sequence
    tokens, the processors' and criteria's inputs), positionally; writes the cache (the step's keys and values,
    then the reorder) and returns the beams and the next step's model inputs, in ``carried`` order, then the
    step's ``outputs`` (see :func:`advance`)."""

    def __init__(self, model: torch.nn.Module, cache: Any, cache_key: str, constants: dict, input_names: list[str],
                 settings: Settings, processors: Sequence, criteria: Sequence, carried: list[str],
                 outputs: tuple[str, ...], encoder_output_type: type | None) -> None:
        super().__init__()
        self.model = model
        self._cache, self._cache_key, self._constants, self._input_names = cache, cache_key, constants, input_names
        self._settings, self._processors, self._criteria, self._carried = settings, processors, criteria, carried
        self._outputs, self._encoder_output_type = outputs, encoder_output_type

    def forward(self, *arguments: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layers = len(decode_loop._layers(self._cache))
        inputs = dict(zip(self._input_names, arguments[3 * layers:]))
        beams = {name: inputs.pop(name) for name in (*_BEAMS, *_LIMITS)}
        eos = inputs.pop(_EOS, None)
        given = decode_loop._form_inputs(self._processors, "processor", inputs)
        criteria_given = decode_loop._form_inputs(self._criteria, "criterion", inputs)
        cur_len = beams["cur_len"]
        logits = decode_loop.step_logits(self.model, self._cache, self._cache_key, self._constants, arguments,
                                         dict(inputs), self._encoder_output_type, cur_len - 1)

        def stop(sequences: torch.Tensor) -> torch.Tensor:
            """transformers' criteria on the continuations: the maximum length, the end-of-sequence tokens, the
            criteria as run."""
            hits = (cur_len + 1 >= beams["max_length"]).expand(sequences.shape[0])
            if eos is not None:
                hits = hits | torch.isin(_column(sequences, cur_len), eos)
            for criterion, its_inputs in zip(self._criteria, criteria_given):
                hits = hits | criterion(sequences, cur_len + 1, **its_inputs)
            return hits

        beams, beam_idx, outputs = advance(self.model, beams, logits, self._settings, lambda tokens, scores: (
            decode_processors.process(self._processors, tokens, scores, cur_len, given)), stop)
        reorder(self._cache, beam_idx, arguments[:3 * layers])
        token_name = decode_loop._token_name(inputs)
        column = beams["cur_len"] - 1  # the token just chosen
        inputs[token_name] = _column(self.model._flatten_beam_dim(beams["running_sequences"]), column)[:, None]
        if token_name == "input_ids" and "attention_mask" in inputs:  # a decoder's mask grows by a column a step
            mask = inputs["attention_mask"]
            inputs["attention_mask"] = _with_column(mask, column, torch.ones(mask.shape[0], dtype=mask.dtype,
                                                                             device=mask.device))
        if "position_ids" in inputs:
            inputs["position_ids"] = inputs["position_ids"] + 1
        return (*({**beams, **inputs}[name] for name in self._carried), *(outputs[name] for name in self._outputs))


class _Program(decode_loop.TracedStep):
    """The traced beam-search step of one input signature and its loop, jitted with and without donating the
    cache; the loop carries the beams and the model's step inputs from step to step, and keeps each step's
    ``outputs``."""

    def __init__(self, model: torch.nn.Module, cache: Any, cache_key: str, constants: dict, inputs: dict,
                 settings: Settings, processors: Sequence, criteria: Sequence, outputs: tuple[str, ...],
                 encoder_output_type: type | None) -> None:
        self._carried = [name for name in inputs if name in _BEAMS or name in _STEP_TENSORS]
        step = _Step(model, cache, cache_key, constants, list(inputs), settings, processors, criteria,
                     self._carried, outputs, encoder_output_type)
        super().__init__(step, cache, inputs, len(self._carried) + len(outputs), int(settings.do_sample))
        self._outputs = self._results[len(self._carried):]
        self._loops = {donate: jax.jit(self._loop, donate_argnums=(1,) if donate else (), static_argnums=(4,))
                       for donate in (False, True)}

    def _loop(self, weights: list, cache: tuple, inputs: tuple, stream: Any, rows: int) -> tuple:
        """Steps while transformers' loop would (``going``), at most the cache's length: returns the number of
        steps, the cache's new state, the step's inputs after the last step, the outputs of the first ``rows``
        steps (``(rows, ...)`` each) and the check."""
        slots = self._slots

        def step(carry: tuple) -> tuple:
            count, state, outputs_so_far, check = carry
            state = list(state)
            results, check = self._call(weights, state, stream, count, check)
            for name, (result, _, _) in zip(self._carried, self._results):
                state[slots[name]] = results[result]
            return count + 1, tuple(state), self._keep_outputs(outputs_so_far, results, count), check

        def going(carry: tuple) -> Any:
            return carry[1][slots["going"]] & (carry[0] < self._capacity)

        start = (jnp.zeros((), jnp.int64), (*cache, *inputs), self._no_outputs(rows), jnp.zeros(2, jnp.int64))
        count, state, outputs, check = jax.lax.while_loop(going, step, start)
        return count, state[:len(cache)], state[len(cache):], outputs, check

    def run(self, model: torch.nn.Module, cache: Any, inputs: dict, rows: int) -> tuple[dict, tuple]:
        """Runs the loop from ``inputs`` (the step's, by name); returns the beams after the last step and the
        steps' outputs (``(steps, ...)`` each, kept for at most ``rows`` steps), on tpu, after writing the cache's
        new state."""
        weights, arrays, others, device_index = self._arrays(
            model, cache, list(inputs.values()), storage.buffer_of(inputs["cur_len"]).device_index)
        stream = np.array(random_state.position(device_index), np.uint64)
        steps, written, others, outputs, check = self._loops[self._donating(cache, arrays)](
            weights, tuple(arrays), tuple(others), stream, rows if self._outputs else 0)
        steps = self._ran(cache, arrays, written, check, steps, device_index)
        del written
        beams = {name: decode_loop._on_chip(value, inputs[name].dtype, device_index)
                 for name, value in zip(inputs, others) if name in _BEAMS}
        return beams, self._outputs_on_chip(outputs, steps, device_index)


def search(model: torch.nn.Module, cache: Any, cache_key: str, step_inputs: dict, beams: dict, settings: Settings,
           processors: Sequence, criteria: Sequence, eos: torch.Tensor | None, sequences: torch.Tensor,
           max_length: int, outputs: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """The beams where transformers' beam search ends, from ``beams`` after the first token (:func:`advance` on
    the prefill's logits) and the first decode step's model inputs ``step_inputs`` (as for
    :func:`decode_loop.decode`), the cache reordered for it; and each later step's ``outputs`` (``"scores"``,
    ``"logits"``: see :func:`advance`), by name, ``(steps, ...)`` each. ``processors``, ``criteria``:
    transformers' logits processors and its stopping criteria other than the maximum length and end-of-sequence
    ones, of a ``generate`` at ``sequences`` up to ``max_length``; ``eos``: the end-of-sequence tokens (``None``
    without that criterion).

    Raises ``NotImplementedError`` when the step cannot be one program (the caller then runs transformers' loop
    and records it with :func:`decode_loop.mark_unsupported`)."""
    if not (all(map(decode_processors.runs_in_the_loop, processors))
            and all(map(decode_processors.runs_in_the_loop, criteria))):
        raise NotImplementedError("a logits processor or stopping criterion is of a kind the loop does not run")
    tensors, constants, encoder_output_type = decode_loop.split_inputs(step_inputs, cache_key)
    sliding_window.check_position(decode_loop._layers(cache), sequences.shape[-1])
    processors = decode_processors.as_run(processors, sequences, max_length)
    criteria = decode_processors.as_run(criteria, sequences, max_length)
    tensors.update(beams)
    if eos is not None:
        tensors[_EOS] = eos
    decode_loop.add_form_inputs(tensors, processors, criteria)
    choosing = ("beams", settings, decode_processors.key(processors), decode_processors.key(criteria), outputs,
                encoder_output_type)
    program = decode_loop.program_for(model, cache, cache_key, constants, tensors, choosing, lambda: _Program(
        model, cache, cache_key, constants, tensors, settings, processors, criteria, outputs, encoder_output_type))
    final, kept = program.run(model, cache, tensors, max_length - sequences.shape[-1] - 1)  # the steps after the first
    return dict(beams, **final), dict(zip(outputs, kept))


def result(model: Any, beams: dict, generation_config: Any, cache: Any, prompt_length: int,
           steps: dict[str, tuple[torch.Tensor, ...]]) -> Any:
    """What ``_beam_search`` returns from its final beams: the best ``num_return_sequences`` of each prompt, cut
    to the longest generated, and with ``return_dict_in_generate`` their beam indices, the cache and what was
    asked of each step (``steps``: ``"scores"``, with the sequences' scores, and ``"logits"``; transformers' step
    5)."""
    from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateBeamEncoderDecoderOutput

    kept = generation_config.num_return_sequences
    sequences = model._flatten_beam_dim(beams["sequences"][:, :kept])
    beam_indices = model._flatten_beam_dim(beams["beam_indices"][:, :kept])
    generated = int((beam_indices + 1).bool().sum(dim=1).max())
    sequences, beam_indices = sequences[:, :prompt_length + generated], beam_indices[:, :generated]
    if not generation_config.return_dict_in_generate:
        return sequences
    output_type = GenerateBeamEncoderDecoderOutput if model.config.is_encoder_decoder else \
        GenerateBeamDecoderOnlyOutput
    # the cache's field: ``cache`` since transformers 5.2x, ``past_key_values`` before
    field = "cache" if "cache" in output_type.__dataclass_fields__ else "past_key_values"
    sequences_scores = model._flatten_beam_dim(beams["beam_scores"][:, :kept]) if "scores" in steps else None
    return output_type(sequences=sequences, sequences_scores=sequences_scores, scores=steps.get("scores"),
                       logits=steps.get("logits"), beam_indices=beam_indices, **{field: cache})
