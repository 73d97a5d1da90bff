"""Decoding as one XLA program: the decode step and the token's choice inside a ``while`` loop on the chip.

transformers' ``generate`` runs one compiled decode step per token and, around it, a dozen eager ops (the logits
processors, argmax or a draw, padding of finished rows, appending the token, the stopping criteria, the mask) and a
read of the stopping flag. On tpu each of those is a dispatch from Python, and that host work, not the chip, bounds
tokens/s. For greedy decoding and sampling from a static cache of full-attention layers (an encoder-decoder model's
pair of them, the cross-attention half written by the prefill; a decoder's may hold sliding-window layers too:
:mod:`hf_tpu.compile.sliding_window`), with logits processors and stopping criteria
that read the scores, the tokens so far and their count (:mod:`hf_tpu.compile.decode_processors`), :func:`decode`
runs every step after the first token as one program: the
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
import functools
import warnings
import weakref
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..backend import checks, dispatch, dtypes, random_state, runtime, storage
from . import decode_processors, graph_lowering, sliding_window
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


def next_tokens(logits: torch.Tensor, process: Callable[[torch.Tensor], torch.Tensor],
                do_sample: bool) -> dict[str, torch.Tensor]:
    """generate's choice of each row's next token from a forward's ``logits``: its last position's, in float32
    (``"logits"``), through the logits processors (``process``: ``"scores"``), then drawn from their softmax or their
    argmax (``"tokens"``)."""
    raw = logits[:, -1].to(copy=True, dtype=torch.float32)  # a copy: a view would hold all of a prefill's logits
    scores = process(raw)
    if do_sample:
        tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        tokens = scores.argmax(-1)
    return {"tokens": tokens, "scores": scores, "logits": raw}


_BETWEEN_RUNS: list[Callable[[Any], bool]] = []


def check_between_runs(names_one: Callable[[Any], bool]) -> None:
    """Registers a predicate that names stopping criteria which read no token, only state outside generate (a
    server's check that its client cancelled): the loop checks those on the host between its program runs, every
    ``HF_TPU_STREAMED_TOKENS`` tokens (:func:`hf_tpu.integrations.generation.streamed_tokens`), instead of sending
    the call to transformers' loop. A criterion that reads the tokens must not be named: between runs, it would
    stop later than transformers' loop."""
    if names_one not in _BETWEEN_RUNS:
        _BETWEEN_RUNS.append(names_one)


def checked_between_runs(criterion: Any) -> bool:
    return any(names_one(criterion) for names_one in _BETWEEN_RUNS)


def runs_in_the_loop(processors: Sequence, criteria: Sequence) -> bool:
    """Whether the loop runs every logits processor and stopping criterion as transformers' loop does (see
    :mod:`hf_tpu.compile.decode_processors`), or checks it between runs (:func:`check_between_runs`); the length
    and end-of-sequence criteria are the loop's own."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    return all(map(decode_processors.runs_in_the_loop, processors)) and all(
        type(criterion) in (MaxLengthCriteria, EosTokenCriteria) or decode_processors.runs_in_the_loop(criterion)
        or checked_between_runs(criterion) for criterion in criteria)


_TOKENS = "tokens so far"  # the step's inputs, for processors and criteria that read them (not model inputs):
_LENGTH = "length so far"  # the tokens so far (all of generate's columns, those not decoded yet zeros) and their count
_ENCODER = "encoder_outputs"  # an encoder-decoder step's input: the encoder's last hidden state


def _form_input(kind: str, index: int, name: str) -> str:
    """The step's input that holds a tensor of one generate of a processor or criterion as run
    (``LoopProcessor.inputs``)."""
    return f"{kind} {index}: {name}"


def _form_inputs(forms: Sequence, kind: str, inputs: dict) -> list[dict[str, torch.Tensor]]:
    """Each form's tensors, taken out of the step's ``inputs``."""
    return [{name: inputs.pop(_form_input(kind, index, name)) for name in getattr(form, "inputs", {})}
            for index, form in enumerate(forms)]


class _Step(torch.nn.Module):
    """One decode step of ``model`` on ``cache``: takes the cache layers' keys, values and lengths, then the
    step's other inputs (``input_names``), all positionally, so that tracing sees the cache's updates as input
    mutations; returns the next token of each row, chosen by :func:`next_tokens` through the logits processors as
    the loop runs them, then the step's ``outputs`` (``"scores"``, ``"logits"``) that generate hands back, then, if
    there are stopping criteria besides the loop's own, whether each row meets one with the token. An
    encoder-decoder model's ``encoder_outputs`` come in as their last hidden state and go to the model as
    ``encoder_output_type``."""

    def __init__(self, model: torch.nn.Module, cache: Any, cache_key: str, constants: dict,
                 input_names: list[str], choice: tuple, criteria: Sequence, outputs: tuple[str, ...],
                 encoder_output_type: type | None = None) -> None:
        super().__init__()
        self.model = model
        self._cache, self._cache_key, self._constants, self._input_names = cache, cache_key, constants, input_names
        self._processors, self._do_sample = choice
        self._criteria, self._outputs = criteria, outputs
        self._encoder_output_type = encoder_output_type

    def forward(self, *arguments: torch.Tensor) -> tuple[torch.Tensor]:
        inputs = dict(zip(self._input_names, arguments[3 * len(_layers(self._cache)):]))
        tokens, length = inputs.pop(_TOKENS, None), inputs.pop(_LENGTH, None)
        given = _form_inputs(self._processors, "processor", inputs)
        criteria_given = _form_inputs(self._criteria, "criterion", inputs)
        logits = step_logits(self.model, self._cache, self._cache_key, self._constants, arguments, inputs,
                             self._encoder_output_type, None if length is None else length - 1)
        chosen = next_tokens(logits, lambda scores: decode_processors.process(
            self._processors, tokens, scores, length, given), self._do_sample)
        stopped = ()
        if self._criteria:
            written = tokens.scatter(1, length.reshape(1, 1).expand(tokens.shape[0], 1), chosen["tokens"][:, None])
            meets = [criterion(written, length + 1, **its_inputs)
                     for criterion, its_inputs in zip(self._criteria, criteria_given)]
            stopped = (functools.reduce(torch.logical_or, meets),)
        return (chosen["tokens"], *(chosen[name] for name in self._outputs), *stopped)


def step_logits(model: torch.nn.Module, cache: Any, cache_key: str, constants: dict,
                arguments: Sequence[torch.Tensor], inputs: dict, encoder_output_type: type | None,
                position: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of the model's forward on ``inputs`` with the cache's layers' keys, values and lengths taken from
    the first of a step's ``arguments`` (the cache is left as it was); an encoder-decoder model's
    ``encoder_outputs`` come in as their last hidden state and go to the model as ``encoder_output_type``.
    ``position``: the step's token's (a 0-dim tensor), which the cache's sliding-window layers need
    (:mod:`~hf_tpu.compile.sliding_window`)."""
    layers = _layers(cache)
    saved = _layer_state(cache)
    try:
        _set_layer_state(cache, *(arguments[k * len(layers):(k + 1) * len(layers)] for k in range(3)))
        if encoder_output_type is not None:
            inputs[_ENCODER] = encoder_output_type(last_hidden_state=inputs[_ENCODER])
        with sliding_window.at_position(layers, position):
            return model(**inputs, **{cache_key: cache}, **constants).logits
    finally:
        _set_layer_state(cache, *saved)


def _token_name(inputs: Any) -> str:
    """The step's input that holds the token: a decoder's ``input_ids``, an encoder-decoder's
    ``decoder_input_ids``."""
    return "decoder_input_ids" if "decoder_input_ids" in inputs else "input_ids"


CACHE_LENGTH = "_hf_tpu_cache_length"  # on a static cache generate made on tpu: the length it was made with


def cache_length(cache: Any) -> int:
    """The positions a decoder's static cache holds (an encoder-decoder cache's self-attention half's): the length
    generate made it with (``CACHE_LENGTH``), else its longest layer's (sliding-window layers may hold fewer)."""
    own = getattr(cache, "self_attention_cache", cache)
    return getattr(own, CACHE_LENGTH, None) or max(layer.max_cache_len for layer in own.layers)


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


class TracedStep:
    """A decode step traced as AOTAutograd traces graph mode's graphs (functionalized, below autograd, with graph
    mode's decompositions; ``aot_export_module``) and lowered by graph mode, for a loop on the chip to run.

    ``step`` takes the cache's layers' keys, values and lengths, then ``inputs`` (by name, in order), positionally;
    it may write the cache's tensors in place, and nothing else, and returns ``outputs`` tensors. The program's
    inputs are the model's parameters and buffers, then the cache's tensors, then ``inputs``; ``draws``: its random
    ops (its keys come first). A loop keeps the results among them that generate hands back per step
    (``_outputs``, set by the loop: their places, shapes and dtypes) with :meth:`_no_outputs`,
    :meth:`_keep_outputs` and :meth:`_outputs_on_chip`."""

    _outputs: Sequence[tuple[int, tuple, torch.dtype]] = ()

    def __init__(self, step: torch.nn.Module, cache: Any, inputs: dict, outputs: int, draws: int) -> None:
        from torch._functorch.aot_autograd import aot_export_module

        from .backend import decompositions, lower

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
        if any(slot not in self._cache_slots for _, slot in self._updates) or len(signature.user_outputs) != outputs:
            raise NotImplementedError("the decode step updates inputs other than the cache")
        named = {node.name: node for node in graph_module.graph.nodes}
        # each of the step's outputs: its place among the graph's results, and its shape and dtype
        self._results = [(results.index(name), tuple(named[name].meta["val"].shape), named[name].meta["val"].dtype)
                         for name in signature.user_outputs]
        self._draws = draws
        self._function = graph.pure_function(fold_constants=False, draws=draws)
        self._capacity = cache_length(cache)

    def weights(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The program's weights: the model's parameters and buffers now (they may have been updated in place
        or replaced since the trace), then the constants the trace made (on the CPU if the forward made them
        there)."""
        return [*(model.get_parameter(target.removeprefix("model.")) if kind == "PARAMETER"
                  else model.get_buffer(target.removeprefix("model.")) for target, kind in self._weights),
                *self._constants]

    def _call(self, weights: list, state: list, stream: Any, count: Any, check: Any) -> tuple[list, Any]:
        """Traced: step ``count`` on ``state`` (the cache's arrays, then the inputs'), which gets the cache's new
        arrays; returns the step's results and the first failed check of the steps so far (``check``'s, or this
        step's)."""
        keys = (_keys(stream, count, self._draws),) if self._draws else ()
        results, _, step_check = self._function(*keys, *weights[:len(self._weights)], *state,
                                                *weights[len(self._weights):])
        for result, slot in self._updates:
            state[slot] = results[result]
        if step_check is not None:
            check = jnp.where(check[0] != 0, check, step_check)
        return results, check

    def _arrays(self, model: torch.nn.Module, cache: Any, inputs: list[torch.Tensor],
                device_index: int) -> tuple[list, list, list, int]:
        """The program's weights, the cache's arrays and ``inputs``' arrays, on one mesh if the model's weights are
        sharded over one, and the chip that results go to. The cache's arrays are held by the list returned and
        by their storages only, so that the program may be given them (:meth:`_donating`)."""
        weights, cache_tensors = self.weights(model), _layer_tensors(cache)
        tensors = [*weights, *cache_tensors, *inputs]
        arrays = [graph_lowering._read(tensor, device_index) for tensor in tensors]
        arrays, device_index, _ = graph_lowering._on_one_mesh(tensors, arrays, device_index)
        first, last = len(weights), len(weights) + len(cache_tensors)
        weights, others = arrays[:first], arrays[last:]
        del arrays[:first], arrays[last - first:]
        return weights, arrays, others, device_index

    def _no_outputs(self, rows: int) -> tuple:
        """Traced: room for the kept outputs of ``rows`` steps, ``(rows, ...)`` each."""
        return tuple(jnp.zeros((rows, *shape), dtypes.to_jax(dtype)) for _, shape, dtype in self._outputs)

    def _keep_outputs(self, kept: tuple, results: list, count: Any) -> tuple:
        """Traced: ``kept`` with step ``count``'s outputs among its ``results`` (none past the rows)."""
        return tuple(written.at[count].set(results[result], mode="drop")
                     for written, (result, _, _) in zip(kept, self._outputs))

    def _outputs_on_chip(self, kept: tuple, steps: int, device_index: int) -> tuple[torch.Tensor, ...]:
        """The kept outputs of a run of ``steps`` steps, on tpu, ``(steps, ...)`` each."""
        return tuple(_on_chip(output, dtype, device_index)[:steps]
                     for output, (_, _, dtype) in zip(kept, self._outputs))

    @staticmethod
    def _donating(cache: Any, arrays: list) -> bool:
        """Whether the cache's ``arrays`` can be donated to a program run (none is held elsewhere)."""
        passed = storage.occurrences(arrays)
        return all(storage.donatable(tensor, arrays, i, passed) for i, tensor in enumerate(_layer_tensors(cache)))

    def _ran(self, cache: Any, arrays: list, written: tuple, check: Any, steps: Any, device_index: int) -> int:
        """Records a program run of ``steps`` steps: the cache's tensors hold the ``written`` arrays (and so does
        ``arrays``, for the next run), the check is deferred, the device's random stream advanced past the
        steps' draws. Returns the number of steps."""
        arrays.clear()
        for tensor, value in zip(_layer_tensors(cache), written):
            storage.write(tensor, value)
        arrays.extend(written)
        if checks.mode() != "off":
            dispatch.defer_check(check, device_index)
        count("decode_loops")
        steps = int(steps)
        random_state.advance(device_index, steps * self._draws)
        sliding_window.advance(_layers(cache), steps)
        return steps


class _Program(TracedStep):
    """The traced step of one input signature and its decode loop, jitted with and without donating the cache.

    The step's inputs are the cache's tensors, ``input_ids`` (the token) and, if generate passes them,
    ``attention_mask`` (2D, the cache's length) and ``position_ids``, and the tokens so far for a repetition
    penalty; each step writes the cache, and the loop sets the next token, marks its column of the mask, adds
    one to the positions and writes the token into the tokens so far, as generate's
    ``_update_model_kwargs_for_generation`` and its loop do. An encoder-decoder model's step takes
    ``decoder_input_ids`` (the token), the encoder's last hidden state and its ``attention_mask`` (the encoder's,
    which stays as it is). ``choice``: the logits processors and whether the token is
    drawn (a draw's key comes from the device's random stream, as transformers' loop draws it)."""

    def __init__(self, model: torch.nn.Module, cache: Any, cache_key: str, constants: dict, inputs: dict,
                 choice: tuple, criteria: Sequence, outputs: tuple[str, ...],
                 encoder_output_type: type | None = None) -> None:
        step = _Step(model, cache, cache_key, constants, list(inputs), choice, criteria, outputs,
                     encoder_output_type)
        super().__init__(step, cache, inputs, 1 + len(outputs) + bool(criteria), int(choice[1]))
        self._token_name = _token_name(inputs)
        # the mask the loop extends by a column a step: a decoder's own (an encoder-decoder's is the encoder's)
        self._growing_mask = "attention_mask" if self._token_name == "input_ids" else None
        self._token = self._results[0][0]
        self._outputs = self._results[1:1 + len(outputs)]
        self._stopped = self._results[-1][0] if criteria else None
        self._loops = {donate: jax.jit(self._loop, static_argnums=(4, 5), donate_argnums=(1,) if donate else ())
                       for donate in (False, True)}

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
            outputs, check = self._call(weights, state, stream, count, check)
            outputs_so_far = self._keep_outputs(outputs_so_far, outputs, count)
            token = outputs[self._token].astype(tokens.dtype)
            if pad_finished:
                token = jnp.where(unfinished, token, pad)
            tokens = tokens.at[:, count].set(token)
            length = length + 1
            unfinished = unfinished & ~jnp.isin(token, eos) & (length < max_length)
            if self._stopped is not None:
                unfinished = unfinished & ~outputs[self._stopped]
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
            return count + 1, tuple(state), unfinished, length, tokens, outputs_so_far, check

        def going(carry: tuple) -> Any:
            return jnp.any(carry[2]) & (carry[0] < jnp.minimum(budget, self._capacity))

        ids = inputs[slots[self._token_name] - len(cache)]
        start = (jnp.zeros((), jnp.int64), (*cache, *inputs), unfinished, length,
                 jnp.zeros((ids.shape[0], self._capacity), ids.dtype), self._no_outputs(rows), jnp.zeros(2, jnp.int64))
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
        weights, arrays, others, device_index = self._arrays(
            model, cache, [*(inputs[name] for name in self._slots), unfinished, eos, pad],
            storage.buffer_of(input_ids).device_index)
        step_inputs, (unfinished, eos, pad) = tuple(others[:-3]), others[-3:]
        rows = (chunk or max_length - length) if self._outputs else 0  # the most steps a run takes
        left = max_length - length  # the most tokens still to come
        length, max_length = jnp.asarray(length, jnp.int64), jnp.asarray(max_length, jnp.int64)
        budget = jnp.asarray(chunk or self._capacity, jnp.int64)
        while True:
            stream = np.array(random_state.position(device_index), np.uint64)
            steps, tokens, outputs, written, step_inputs, unfinished, length, check = self._loops[
                self._donating(cache, arrays)](
                weights, tuple(arrays), step_inputs, (unfinished, eos, pad, length, max_length, budget, stream),
                pad_finished, rows)
            steps = self._ran(cache, arrays, written, check, steps, device_index)
            del written
            yield _on_chip(tokens, input_ids.dtype, device_index)[:, :steps], self._outputs_on_chip(
                outputs, steps, device_index)
            left -= steps
            if chunk is None or steps < chunk or left <= 0:
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


def split_inputs(step_inputs: dict, cache_key: str) -> tuple[dict, dict, type | None]:
    """A decode step's model inputs (``prepare_inputs_for_generation``'s) as a program takes them: its tensors by
    name (an encoder-decoder model's encoder outputs as their last hidden state), its other inputs (constants of
    the trace) and the type of the encoder's outputs (``None`` for a decoder)."""
    tensors = {name: value for name, value in step_inputs.items() if isinstance(value, torch.Tensor)}
    encoder_output_type = None
    if step_inputs.get(_ENCODER) is not None:
        encoder_outputs = step_inputs[_ENCODER]
        held = {name: value for name, value in encoder_outputs.items() if value is not None}
        if list(held) != ["last_hidden_state"]:
            raise NotImplementedError("the encoder's outputs hold more than its last hidden state")
        tensors[_ENCODER], encoder_output_type = held["last_hidden_state"], type(encoder_outputs)
    constants = {name: value for name, value in step_inputs.items() if name not in tensors and name != cache_key}
    return tensors, constants, encoder_output_type


def add_form_inputs(tensors: dict, processors: Sequence, criteria: Sequence) -> None:
    """Adds the tensors of the processors and criteria as run (:attr:`~decode_processors.LoopProcessor.inputs`) to
    a step's ``tensors``."""
    for kind, forms in (("processor", processors), ("criterion", criteria)):
        for index, form in enumerate(forms):
            for name, value in getattr(form, "inputs", {}).items():
                tensors[_form_input(kind, index, name)] = value


def program_for(model: torch.nn.Module, cache: Any, cache_key: str, constants: dict, tensors: dict, choosing: tuple,
                make: Callable[[], TracedStep]) -> TracedStep:
    """The model's program for a step of these inputs and ``choosing`` (what else the step depends on), made by
    ``make`` if none is kept; raises ``NotImplementedError`` if it cannot be made."""
    try:
        key = (cache_key, tuple(sorted(constants.items())), tuple((name, _signature(value)) for name, value in
               sorted(tensors.items())), tuple(map(_signature, _layer_tensors(cache))), choosing,
               _forward_fingerprint(model))
        hash(key)
    except TypeError as error:  # an unhashable constant or hook
        raise NotImplementedError(f"the decode step's inputs cannot key a program ({error})") from error
    programs = _programs.setdefault(model, collections.OrderedDict())
    program = graph_lowering._lookup(programs, key)
    if program is None:
        try:
            program = make()
        except Exception as error:  # tracing or lowering failed: the caller decodes step by step
            raise NotImplementedError(f"{type(error).__name__}: {error}") from error
        graph_lowering._store(programs, key, program, _PROGRAMS_PER_MODEL)
    return program


def decode(model: torch.nn.Module, cache: Any, cache_key: str, step_inputs: dict, unfinished: torch.Tensor,
           sequences: torch.Tensor, limits: tuple[int, torch.Tensor | None, torch.Tensor | None],
           choice: tuple = ((), False), criteria: Sequence = (), chunk: int | None = None,
           outputs: tuple[str, ...] = ()) -> Iterator[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """The tokens generate appends to ``sequences`` (the tokens so far, the last not yet in ``cache``), stopping
    where transformers' loop would, in pieces of ``chunk`` tokens at most (one program run each; all at once if
    ``None``), each on tpu ``(batch, tokens)`` with the steps' ``outputs`` (``"scores"``, ``"logits"``: see
    :func:`next_tokens`), each ``(tokens, batch, vocabulary)``, the cache written before they come. ``step_inputs``
    are the first decode step's model inputs (``prepare_inputs_for_generation``: the token, the 2D mask padded to
    the cache's length, maybe the positions, the cache under ``cache_key``, constants; for an encoder-decoder model
    ``decoder_input_ids``, the encoder's outputs and mask and an ``EncoderDecoderCache``), ``unfinished`` the rows
    still going, ``limits`` the maximum length, the end-of-sequence tokens and the pad token (``None`` and ``None``
    without an end-of-sequence criterion), ``choice`` transformers' logits processors and whether the token is drawn
    from their softmax (else their argmax), ``criteria`` transformers' stopping criteria (:func:`runs_in_the_loop`
    says which the loop runs).

    Raises ``NotImplementedError`` when the step cannot be one program (the caller then decodes step by step
    and records it with :func:`mark_unsupported`).
    """
    tensors, constants, encoder_output_type = split_inputs(step_inputs, cache_key)
    processors, do_sample = choice
    max_length = limits[0]
    if not runs_in_the_loop(processors, criteria):
        raise NotImplementedError("a logits processor or stopping criterion is of a kind the loop does not run")
    processors = decode_processors.as_run(processors, sequences, max_length)
    criteria = decode_processors.as_run([criterion for criterion in criteria
                                         if decode_processors.runs_in_the_loop(criterion)], sequences, max_length)
    sliding_window.check_position(_layers(cache), sequences.shape[1] - 1)
    if criteria or any(isinstance(processor, decode_processors.LoopProcessor) for processor in processors):
        # as wide as the cache (bucketed), not as the prompt plus the new tokens: one program for every prompt length
        tensors[_TOKENS] = torch.nn.functional.pad(sequences, (0, cache_length(cache) - sequences.shape[1]))
    if _TOKENS in tensors or sliding_window.layers_of(_layers(cache)):
        tensors[_LENGTH] = torch.tensor(sequences.shape[1], device=sequences.device)
    add_form_inputs(tensors, processors, criteria)
    choosing = decode_processors.key(processors), do_sample, decode_processors.key(criteria)
    program = program_for(model, cache, cache_key, constants, tensors, (choosing, outputs, encoder_output_type),
                          lambda: _Program(model, cache, cache_key, constants, tensors, (processors, do_sample),
                                           criteria, outputs, encoder_output_type))
    return program.run(model, cache, tensors, unfinished, (sequences.shape[1], *limits), chunk)
