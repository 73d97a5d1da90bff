"""Decoding as one XLA program: the decode step and the token's choice inside a ``while`` loop on the chip.

transformers' ``generate`` runs one compiled decode step per token and, around it, a dozen eager ops (the logits
processors, argmax or a draw, padding of finished rows, appending the token, the stopping criteria, the mask) and a
read of the stopping flag. On tpu each of those is a dispatch from Python, and that host work, not the chip, bounds
tokens/s. For greedy decoding and sampling from a static cache of full-attention layers (an encoder-decoder model's
pair of them, the cross-attention half written by the prefill), with logits processors that
read the scores alone (temperature, top-k, top-p, min-p, typical, epsilon) or the repetition penalty, and stopping
on length and end-of-sequence tokens only, :func:`decode` runs every step after the first token as one program: the
model's decode step and the token's choice, traced as AOTAutograd traces graph mode's graphs and lowered by graph
mode, in a ``jax.lax.while_loop`` that also pads finished rows, stops as transformers' criteria would and extends
the mask. The host reads one number at the end (how many steps ran).

The tokens are transformers' (the same step, the same rules; a draw takes the key transformers' loop would
draw for it from the device's random stream, which ends where that loop leaves it); the cache ends as
transformers' loop leaves it, without the extra step its deferred stop check takes and undoes. Programs are
kept per model, keyed by the step's inputs, the token's choice and what the forward depends on besides them:
each module's class, ``forward`` and mode, the hooks on it, the attention and experts implementations,
autocast and the checks mode.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import math
import warnings
import weakref
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..backend import checks, dispatch, dtypes, random_state, runtime, storage
from . import graph_lowering
from .stats import count

_PROGRAMS_PER_MODEL = 8
_programs: weakref.WeakKeyDictionary[torch.nn.Module, collections.OrderedDict] = weakref.WeakKeyDictionary()
# a model whose step could not be one program -> what its forward depended on then (see _forward_fingerprint)
_unsupported: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def supports(model: torch.nn.Module) -> bool:
    """Whether the model's decode step may be one program: its weights are tpu tensors (on one chip or sharded
    over a mesh: not tensor subclasses such as the DTensors of tensor parallelism under torchrun, whose
    steps hold collectives), no try has failed for the forward as it is now (dropout in train mode, say,
    which a later ``model.eval()`` turns off), and ``HF_TPU_STEPWISE_DECODE`` does not ask for transformers'
    loop, step by step."""
    if runtime.flag("HF_TPU_STEPWISE_DECODE"):
        return False
    if any(type(parameter.data) is not torch.Tensor for parameter in model.parameters()):
        return False
    failed = _unsupported.get(model)
    return failed is None or failed != _forward_fingerprint(model)


def mark_unsupported(model: torch.nn.Module, reason: str) -> None:
    """Records that the model's decode step, with its forward as it is now, cannot be one program, warning with
    ``reason``."""
    _unsupported[model] = _forward_fingerprint(model)
    warnings.warn(f"hf_tpu: decoding with this {type(model).__name__} runs step by step, not as one program "
                  f"({reason})", stacklevel=2)


def next_tokens(logits: torch.Tensor, input_ids: torch.Tensor, processors: Sequence,
                do_sample: bool, length: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """generate's choice of each row's next token from a forward's ``logits``: its last position's, in float32
    (``"logits"``), through the logits ``processors`` (``"scores"``; a :class:`MinLength` reads ``length``, the
    tokens so far), then drawn from their softmax or their argmax (``"tokens"``)."""
    raw = logits[:, -1].to(copy=True, dtype=torch.float32)  # a copy: a view would hold all of a prefill's logits
    scores = raw
    for processor in processors:
        scores = processor(input_ids, scores, length) if isinstance(processor, MinLength) else \
            processor(input_ids, scores)
    if do_sample:
        tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        tokens = scores.argmax(-1)
    return {"tokens": tokens, "scores": scores, "logits": raw}


class MinLength:
    """transformers' ``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor`` as the loop runs them:
    the end-of-sequence tokens' scores are -inf while the tokens so far are fewer than ``min_length`` (the prompt's
    length plus ``min_new_tokens`` for the latter), the count of tokens so far a traced number (the loop's, which
    transformers' processors read from the shape of ``input_ids``), so that one program serves every step."""

    def __init__(self, min_length: int, eos_token_ids: tuple[int, ...]) -> None:
        self.min_length, self.eos_token_ids = min_length, eos_token_ids

    @classmethod
    def of(cls, processor: Any) -> MinLength:
        skipped = getattr(processor, "prompt_length_to_skip", None)
        least = processor.min_length if skipped is None else skipped + processor.min_new_tokens
        return cls(least, tuple(int(t) for t in torch.as_tensor(processor.eos_token_id).reshape(-1).tolist()))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        vocabulary = torch.arange(scores.shape[-1], device=scores.device)
        eos = torch.isin(vocabulary, torch.tensor(self.eos_token_ids, device=scores.device))
        return torch.where(eos & (length < self.min_length), -math.inf, scores)


def as_run(processors: Sequence) -> list:
    """The processors as the loop runs them: the minimum-length ones as :class:`MinLength`."""
    lengths = _processor_kinds()["length"]
    return [MinLength.of(processor) if type(processor) in lengths else processor for processor in processors]


def choice_key(processors: Sequence, do_sample: bool) -> tuple | None:
    """What a program's choice of the token depends on: the processors' classes and settings (plain numbers) and
    whether it draws; ``None`` where a processor is of a kind the loop does not run (see :func:`_runs_in_the_loop`)."""
    if not all(map(_runs_in_the_loop, processors)):
        return None
    return tuple((type(processor), tuple(sorted(vars(processor).items())))
                 for processor in as_run(processors)), do_sample


def _runs_in_the_loop(processor: Any) -> bool:
    """Whether the loop runs a logits processor as transformers' loop does: one that reads the scores alone
    (temperature, top-k, top-p, min-p, typical, epsilon, invalid values removed, renormalization), a minimum
    length, which reads their count (:class:`MinLength`), or the repetition penalty, which reads the tokens so far
    (see :func:`_tokens_so_far`)."""
    kinds = _processor_kinds()
    kind = type(processor)
    return kind in kinds["scores"] or kind in kinds["length"] or kind is MinLength or (
        type(processor) in kinds["tokens"] and getattr(processor, "logits_indices", None) is None)


def _reads_tokens(processors: Sequence) -> bool:
    return any(type(processor) in _processor_kinds()["tokens"] for processor in processors)


@functools.cache
def _processor_kinds() -> dict[str, frozenset]:
    """transformers' logits processors the loop runs, which hold plain numbers: those that read the scores alone
    and those that read the tokens so far too."""
    from transformers.generation import logits_process

    def present(*names: str) -> frozenset:
        return frozenset(getattr(logits_process, name) for name in names if hasattr(logits_process, name))

    return {"scores": present("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                              "TypicalLogitsWarper", "EpsilonLogitsWarper", "InfNanRemoveLogitsProcessor",
                              "LogitNormalization"),
            "tokens": present("RepetitionPenaltyLogitsProcessor"),
            "length": present("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")}


_TOKENS = "tokens so far"  # the step's input that holds them, for processors that read them (not a model input)
_LENGTH = "length so far"  # the step's input that counts them, for MinLength (not a model input)
_ENCODER = "encoder_outputs"  # an encoder-decoder step's input: the encoder's last hidden state


def _tokens_so_far(processors: Sequence, sequences: torch.Tensor, max_length: int) -> tuple[list, torch.Tensor]:
    """The processors as the loop runs them, and the tokens so far as they read them: ``max_length`` columns, where
    those not decoded yet, and those of the prompt the repetition penalty ignores (``prompt_ignore_length``, which
    generate sets to each row's left padding), hold the row's last token. That token was decoded after the prompt,
    so the penalty counts it anyway, and a token counted twice is penalized once: the scores are transformers'
    loop's. The penalty then runs without ``prompt_ignore_length`` (a tensor of each call, which would key a new
    program every time)."""
    length = sequences.shape[1]
    last = sequences[:, -1:]
    tokens = torch.cat([sequences, last.expand(-1, max_length - length)], dim=1)
    readers = [processor for processor in processors if type(processor) in _processor_kinds()["tokens"]]
    if len(readers) > 1:
        raise NotImplementedError("more than one logits processor reads the tokens so far")
    ignored = readers[0].prompt_ignore_length
    if ignored is None:
        return list(processors), tokens
    if isinstance(ignored, int) and ignored >= length:
        raise NotImplementedError("the repetition penalty ignores every token decoded so far")
    bound = torch.as_tensor(ignored, device=sequences.device).reshape(-1, 1)
    tokens = torch.where(torch.arange(max_length, device=sequences.device) < bound, last, tokens)
    penalty = copy.copy(readers[0])
    penalty.prompt_ignore_length = None
    return [penalty if processor is readers[0] else processor for processor in processors], tokens


class _Step(torch.nn.Module):
    """One decode step of ``model`` on ``cache``: takes the cache layers' keys, values and lengths, then the
    step's other inputs (``input_names``), all positionally, so that tracing sees the cache's updates as input
    mutations; returns the next token of each row, chosen by :func:`next_tokens`, then the step's ``outputs``
    (``"scores"``, ``"logits"``) that generate hands back. An encoder-decoder model's ``encoder_outputs`` come in
    as their last hidden state and go to the model as ``encoder_output_type``."""

    def __init__(self, model: torch.nn.Module, cache: Any, cache_key: str, constants: dict,
                 input_names: list[str], choice: tuple, outputs: tuple[str, ...],
                 encoder_output_type: type | None = None) -> None:
        super().__init__()
        self.model = model
        self._cache, self._cache_key, self._constants, self._input_names = cache, cache_key, constants, input_names
        self._processors, self._do_sample = choice
        self._outputs = outputs
        self._encoder_output_type = encoder_output_type

    def forward(self, *arguments: torch.Tensor) -> tuple[torch.Tensor]:
        layers = len(_layers(self._cache))
        saved = _layer_state(self._cache)
        try:
            _set_layer_state(self._cache, *(arguments[k * layers:(k + 1) * layers] for k in range(3)))
            inputs = dict(zip(self._input_names, arguments[3 * layers:]))
            tokens = inputs.pop(_TOKENS, inputs[_token_name(inputs)])
            length = inputs.pop(_LENGTH, None)
            if self._encoder_output_type is not None:
                inputs[_ENCODER] = self._encoder_output_type(last_hidden_state=inputs[_ENCODER])
            logits = self.model(**inputs, **{self._cache_key: self._cache}, **self._constants).logits
        finally:
            _set_layer_state(self._cache, *saved)
        chosen = next_tokens(logits, tokens, self._processors, self._do_sample, length)
        return (chosen["tokens"], *(chosen[name] for name in self._outputs))


def _token_name(inputs: Any) -> str:
    """The step's input that holds the token: a decoder's ``input_ids``, an encoder-decoder's
    ``decoder_input_ids``."""
    return "decoder_input_ids" if "decoder_input_ids" in inputs else "input_ids"


def _layers(cache: Any) -> list:
    """The cache's layers: a decoder's, or an encoder-decoder cache's self-attention layers (which each step writes)
    then its cross-attention layers (which the prefill wrote and each step reads)."""
    halves = (cache.self_attention_cache, cache.cross_attention_cache) if hasattr(cache, "cross_attention_cache") \
        else (cache,)
    return [layer for half in halves for layer in half.layers]


def _layer_state(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The cache's state: every layer's keys, values and lengths."""
    layers = _layers(cache)
    return [layer.keys for layer in layers], [layer.values for layer in layers], \
        [layer.cumulative_length for layer in layers]


def _set_layer_state(cache: Any, keys: list, values: list, lengths: list) -> None:
    for layer, state in zip(_layers(cache), zip(keys, values, lengths)):
        layer.keys, layer.values, layer.cumulative_length = state


def _layer_tensors(cache: Any) -> list[torch.Tensor]:
    """The cache's state in the step's input order: every layer's keys, then values, then lengths."""
    return [tensor for tensors in _layer_state(cache) for tensor in tensors]


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true while the step is traced, as it is while Dynamo traces generate's
    compiled step: transformers takes the same compile-friendly paths (no data-dependent checks of the mask)."""
    compiling = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = compiling


class _Program:
    """The traced step of one input signature and its decode loop, jitted with and without donating the cache.

    The step is traced as AOTAutograd traces graph mode's graphs (functionalized, below autograd, with graph
    mode's decompositions; ``aot_export_module``) and lowered by graph mode. Its inputs are the model's
    parameters and buffers, then the cache's tensors, ``input_ids`` (the token) and, if generate passes them,
    ``attention_mask`` (2D, the cache's length) and ``position_ids``, and the tokens so far for a repetition
    penalty; each step writes the cache, and the loop sets the next token, marks its column of the mask, adds
    one to the positions and writes the token into the tokens so far, as generate's
    ``_update_model_kwargs_for_generation`` and its loop do. An encoder-decoder model's step takes
    ``decoder_input_ids`` (the token), the encoder's last hidden state and its ``attention_mask`` (the encoder's,
    which stays as it is). ``choice``: the logits processors and whether the token is
    drawn (a draw's key comes from the device's random stream, as transformers' loop draws it)."""

    def __init__(self, model: torch.nn.Module, cache: Any, cache_key: str, constants: dict, inputs: dict,
                 choice: tuple, outputs: tuple[str, ...], encoder_output_type: type | None = None) -> None:
        from torch._functorch.aot_autograd import aot_export_module

        from .backend import decompositions, lower

        step = _Step(model, cache, cache_key, constants, list(inputs), choice, outputs, encoder_output_type)
        self._token_name = _token_name(inputs)
        # the mask the loop extends by a column a step: a decoder's own (an encoder-decoder's is the encoder's)
        self._growing_mask = "attention_mask" if self._token_name == "input_ids" else None
        state = [*_layer_tensors(cache), *inputs.values()]
        with torch.no_grad(), _compiling():
            graph_module, signature = aot_export_module(step, state, trace_joint=False,
                                                        decompositions=decompositions())
        if signature.buffers_to_mutate:
            raise NotImplementedError(f"the decode step updates buffers ({', '.join(signature.buffers_to_mutate)})")
        graph = lower(graph_module)
        placeholders = [node.name for node in graph_module.graph.nodes if node.op == "placeholder"]
        weights = placeholders[:len(placeholders) - len(state)]
        self._weights = [(signature.inputs_to_parameters[name], "PARAMETER") if name in signature.inputs_to_parameters
                         else (signature.inputs_to_buffers[name], "BUFFER") for name in weights]
        self._constants = graph.constants
        user_inputs = list(signature.user_inputs)
        self._cache_slots = range(len(state) - len(inputs))  # the cache's tensors come first
        self._slots = {name: len(self._cache_slots) + index for index, name in enumerate(inputs)}
        results = [node.name for node in graph_module.graph.find_nodes(op="output")[0].args[0]]
        self._updates = [(results.index(output), user_inputs.index(target))
                         for output, target in signature.user_inputs_to_mutate.items()]
        if any(slot not in self._cache_slots for _, slot in self._updates) or \
                len(signature.user_outputs) != 1 + len(outputs):
            raise NotImplementedError("the decode step updates inputs other than the cache")
        self._token = results.index(signature.user_outputs[0])
        named = {node.name: node for node in graph_module.graph.nodes}
        # each of the step's outputs: its place among the graph's results, and its shape and dtype
        self._outputs = [(results.index(name), tuple(named[name].meta["val"].shape), named[name].meta["val"].dtype)
                         for name in signature.user_outputs[1:]]
        self._draws = int(choice[1])  # random ops in a step: the draw of the token, if it is drawn
        self._function = graph.pure_function(fold_constants=False, draws=self._draws)
        self._capacity = _layers(cache)[0].max_cache_len
        self._loops = {donate: jax.jit(self._loop, static_argnums=(4, 5), donate_argnums=(1,) if donate else ())
                       for donate in (False, True)}

    def weights(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The program's weights: the model's parameters and buffers now (they may have been updated in place
        or replaced since the trace), then the constants the trace made (on the CPU if the forward made them
        there)."""
        return [*(model.get_parameter(target.removeprefix("model.")) if kind == "PARAMETER"
                  else model.get_buffer(target.removeprefix("model.")) for target, kind in self._weights),
                *self._constants]

    def _loop(self, weights: list, cache: tuple, inputs: tuple, limits: tuple, pad_finished: bool,
              rows: int) -> tuple:
        """Steps until no row is unfinished, or ``budget`` steps ran: ``inputs`` are the first step's (in the
        order of the step's inputs), ``limits`` the rows unfinished, the end-of-sequence tokens, the pad token,
        the length so far, the maximum length, the budget and the random stream's ``[seed, offset]``. Returns the
        number of steps, the tokens (``(batch, capacity)``, the first ``steps`` columns written), the step's outputs
        (each ``(rows, ...)``, the first ``steps`` rows written), the cache's new state, the next step's inputs,
        the rows unfinished, the length and the check."""
        unfinished, eos, pad, length, max_length, budget, stream = limits
        unfinished = unfinished != 0
        slots = self._slots

        def step(carry: tuple) -> tuple:
            count, state, unfinished, length, tokens, outputs_so_far, check = carry
            state = list(state)
            keys = (_keys(stream, count, self._draws),) if self._draws else ()
            outputs, _, step_check = self._function(*keys, *weights[:len(self._weights)], *state,
                                                    *weights[len(self._weights):])
            for result, slot in self._updates:
                state[slot] = outputs[result]
            outputs_so_far = tuple(written.at[count].set(outputs[result], mode="drop")
                                   for written, (result, _, _) in zip(outputs_so_far, self._outputs))
            token = outputs[self._token].astype(tokens.dtype)
            if pad_finished:
                token = jnp.where(unfinished, token, pad)
            tokens = tokens.at[:, count].set(token)
            length = length + 1
            unfinished = unfinished & ~jnp.isin(token, eos) & (length < max_length)
            state[slots[self._token_name]] = token[:, None]
            if self._growing_mask in slots:
                state[slots[self._growing_mask]] = state[slots[self._growing_mask]].at[:, length - 1].set(
                    1, mode="drop")
            if "position_ids" in slots:
                state[slots["position_ids"]] = state[slots["position_ids"]] + 1
            if _TOKENS in slots:
                state[slots[_TOKENS]] = state[slots[_TOKENS]].at[:, length - 1].set(token, mode="drop")
            if _LENGTH in slots:
                state[slots[_LENGTH]] = length.astype(state[slots[_LENGTH]].dtype)
            if step_check is not None:
                check = jnp.where(check[0] != 0, check, step_check)
            return count + 1, tuple(state), unfinished, length, tokens, outputs_so_far, check

        def going(carry: tuple) -> Any:
            return jnp.any(carry[2]) & (carry[0] < jnp.minimum(budget, self._capacity))

        ids = inputs[slots[self._token_name] - len(cache)]
        outputs = tuple(jnp.zeros((rows, *shape), dtypes.to_jax(dtype)) for _, shape, dtype in self._outputs)
        start = (jnp.zeros((), jnp.int64), (*cache, *inputs), unfinished, length,
                 jnp.zeros((ids.shape[0], self._capacity), ids.dtype), outputs, jnp.zeros(2, jnp.int64))
        count, state, unfinished, length, tokens, outputs, check = jax.lax.while_loop(going, step, start)
        return count, tokens, outputs, state[:len(cache)], state[len(cache):], unfinished, length, check

    def run(self, model: torch.nn.Module, cache: Any, inputs: dict, unfinished: torch.Tensor,
            limits: tuple[int, int, torch.Tensor | None, torch.Tensor | None], chunk: int | None) -> Iterator[Any]:
        """Decodes from the first step's ``inputs``, ``chunk`` steps a program run (all of them if ``None``):
        yields the tokens of each run ``(batch, steps)`` and the step's outputs ``(steps, ...)``, on tpu, after
        writing the cache's new state. A model with weights sharded over a mesh runs on the mesh."""
        input_ids = inputs[self._token_name]
        length, max_length, eos, pad = limits
        pad_finished = pad is not None
        eos = input_ids.new_zeros(0) if eos is None else eos.reshape(-1)
        pad = input_ids.new_zeros(()) if pad is None else pad
        weights, cache_tensors = self.weights(model), _layer_tensors(cache)
        tensors = [*weights, *cache_tensors, *(inputs[name] for name in self._slots), unfinished, eos, pad]
        device_index = storage.buffer_of(input_ids).device_index
        arrays = [graph_lowering._read(tensor, device_index) for tensor in tensors]
        arrays, device_index, _ = graph_lowering._on_one_mesh(tensors, arrays, device_index)
        first, last = len(weights), len(weights) + len(cache_tensors)
        weights, step_inputs, (unfinished, eos, pad) = arrays[:first], tuple(arrays[last:-3]), arrays[-3:]
        del arrays[:first], arrays[last - first:]  # the cache's arrays, held here and by their storages only
        rows = (chunk or max_length - length) if self._outputs else 0  # the most steps a run takes
        length, max_length = jnp.asarray(length, jnp.int64), jnp.asarray(max_length, jnp.int64)
        budget = jnp.asarray(chunk or self._capacity, jnp.int64)
        while True:
            stream = np.array(random_state.position(device_index), np.uint64)
            donate = all(storage.donatable(tensor, arrays[i], arrays) for i, tensor in enumerate(cache_tensors))
            steps, tokens, outputs, written, step_inputs, unfinished, length, check = self._loops[donate](
                weights, tuple(arrays), step_inputs, (unfinished, eos, pad, length, max_length, budget, stream),
                pad_finished, rows)
            arrays.clear()
            for tensor, value in zip(cache_tensors, written):
                storage.write(tensor, value)
            arrays.extend(written)
            del written
            if checks.mode() != "off":
                dispatch.defer_check(check, device_index)
            count("decode_loops")
            steps = int(steps)
            random_state.advance(device_index, steps * self._draws)
            yield _on_chip(tokens, input_ids.dtype, device_index)[:, :steps], tuple(
                _on_chip(output, dtype, device_index)[:steps] for output, (_, _, dtype) in zip(outputs, self._outputs))
            if chunk is None or steps < chunk:
                return


def _on_chip(array: Any, dtype: torch.dtype, device_index: int) -> torch.Tensor:
    """A tpu tensor of a loop's result, on the inputs' chip (a result spread over a mesh is gathered there)."""
    return storage.wrap(jax.device_put(array, runtime.device(device_index)) if storage.is_spread(array) else array,
                        dtype, device_index)


def _keys(stream: Any, count: Any, draws: int) -> Any:
    """Traced: the ``[seed, offset]`` rows of step ``count``'s ``draws`` random ops, the offsets after the steps'
    before it from ``stream``'s on: the keys transformers' loop would draw for them, one op after another."""
    offsets = stream[1] + count.astype(jnp.uint64) * draws + jnp.arange(draws, dtype=jnp.uint64)
    return jnp.stack([jnp.broadcast_to(stream[0], offsets.shape), offsets], axis=1)


def _forward_fingerprint(model: torch.nn.Module) -> tuple:
    """What a traced forward depends on besides its inputs' signature: every module's class, own ``forward``
    (``kernelize`` and accelerate's hooks replace it), mode and hooks, the attention and experts
    implementations, autocast and the checks mode."""
    hooks = torch.nn.modules.module
    parts: list = [getattr(model.config, "_attn_implementation", None),
                   repr(getattr(model.config, "_experts_implementation", None)),
                   torch.is_autocast_enabled("tpu"), torch.get_autocast_dtype("tpu"), checks.mode(),
                   tuple(hooks._global_forward_hooks.values()), tuple(hooks._global_forward_pre_hooks.values())]
    for module in model.modules():
        parts.append((type(module), module.__dict__.get("forward"), module.training,
                      tuple(module._forward_hooks.values()), tuple(module._forward_pre_hooks.values())))
    return tuple(parts)


def _signature(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.dtype, tensor.device


def decode(model: torch.nn.Module, cache: Any, cache_key: str, step_inputs: dict, unfinished: torch.Tensor,
           sequences: torch.Tensor, limits: tuple[int, torch.Tensor | None, torch.Tensor | None],
           choice: tuple = ((), False), chunk: int | None = None,
           outputs: tuple[str, ...] = ()) -> Iterator[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """The tokens generate appends to ``sequences`` (the tokens so far, the last not yet in ``cache``), stopping
    where transformers' loop would, in pieces of ``chunk`` tokens at most (one program run each; all at once if
    ``None``), each on tpu ``(batch, tokens)`` with the steps' ``outputs`` (``"scores"``, ``"logits"``: see
    :func:`next_tokens`), each ``(tokens, batch, vocabulary)``, the cache written before they come. ``step_inputs``
    are the first decode step's model inputs (``prepare_inputs_for_generation``: the token, the 2D mask padded to
    the cache's length, maybe the positions, the cache under ``cache_key``, constants; for an encoder-decoder model
    ``decoder_input_ids``, the encoder's outputs and mask and an ``EncoderDecoderCache``), ``unfinished`` the rows
    still going, ``limits`` the maximum length, the end-of-sequence tokens and the pad token (``None`` and ``None``
    without an end-of-sequence criterion), ``choice`` the logits processors (of the kinds :func:`choice_key` takes)
    and whether the token is drawn from their softmax (else their argmax).

    Raises ``NotImplementedError`` when the step cannot be one program (the caller then decodes step by step
    and records it with :func:`mark_unsupported`).
    """
    tensors = {name: value for name, value in step_inputs.items() if isinstance(value, torch.Tensor)}
    encoder_output_type = None
    if step_inputs.get(_ENCODER) is not None:
        encoder_outputs = step_inputs[_ENCODER]
        held = {name: value for name, value in encoder_outputs.items() if value is not None}
        if list(held) != ["last_hidden_state"]:
            raise NotImplementedError("the encoder's outputs hold more than its last hidden state")
        tensors[_ENCODER], encoder_output_type = held["last_hidden_state"], type(encoder_outputs)
    constants = {name: value for name, value in step_inputs.items() if name not in tensors and name != cache_key}
    processors, do_sample = choice
    if _reads_tokens(processors):
        processors, tensors[_TOKENS] = _tokens_so_far(processors, sequences, limits[0])
    if any(type(processor) in _processor_kinds()["length"] for processor in processors):
        processors = as_run(processors)
        tensors[_LENGTH] = torch.tensor(sequences.shape[1], device=sequences.device)
    choosing = choice_key(processors, do_sample)
    if choosing is None:
        raise NotImplementedError("a logits processor is of a kind the loop does not run")
    try:
        key = (cache_key, tuple(sorted(constants.items())), tuple((name, _signature(value)) for name, value in
               sorted(tensors.items())), tuple(map(_signature, _layer_tensors(cache))), choosing, outputs,
               encoder_output_type, _forward_fingerprint(model))
        hash(key)
    except TypeError as error:  # an unhashable constant or hook
        raise NotImplementedError(f"the decode step's inputs cannot key a program ({error})") from error
    programs = _programs.setdefault(model, collections.OrderedDict())
    program = graph_lowering._lookup(programs, key)
    if program is None:
        try:
            program = _Program(model, cache, cache_key, constants, tensors, (processors, do_sample), outputs,
                               encoder_output_type)
        except Exception as error:  # tracing or lowering failed: the caller decodes step by step
            raise NotImplementedError(f"{type(error).__name__}: {error}") from error
        graph_lowering._store(programs, key, program, _PROGRAMS_PER_MODEL)
    return program.run(model, cache, tensors, unfinished, (sequences.shape[1], *limits), chunk)
