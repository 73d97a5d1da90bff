"""transformers ``generate()`` with a static cache on tpu: cache lengths rounded up to buckets, invisibly.

generate() sizes a StaticCache for prompt + new tokens and compiles the decode step for that cache
shape; transformers keeps the largest length seen so far, so growing prompts still compile once per
new length. On tpu the length is rounded up to a bucket (:func:`bucket`), so prompts of many lengths
share a few programs. Results do not change: positions past the written part of a static cache are
masked out of attention. The cache generate hands back (``return_dict_in_generate=True``) is trimmed
to the length it has on any other device (views of the bucketed buffers), and so are each step's self-attention
weights (``output_attentions``), so bucketing is invisible.
An explicit ``max_cache_len`` in the generation config is the user's own choice of size: it is used
as is, not bucketed.

A model with sharded weights (:mod:`hf_tpu.sharding`) gets a static cache sharded like the keys and values
written into it (usually split by head, as the k/v projections are), made on its shards, instead of the zeros
transformers allocates on the model's ``device`` (one chip): each step then writes and reads the cache where it
lives, with no copy between one chip and the mesh, and each chip holds its heads only, at every moment.

Decoding reads its stopping flag one step late on tpu, as transformers does on mps (``DeferredStopCheck``,
transformers 5.24+): the flag and the tokens are copied into pinned host memory without waiting, so the host
queues step n+1 while the device computes step n, instead of waiting for every token. A stop found late costs
one extra step, which transformers undoes (tokens, scores and the cache's length); results do not change.

Each decode step's attention mask is built inside the compiled step on tpu. For a compilable cache, transformers
builds the 4D mask before every step, outside the compiled forward, from the 2D mask and the cache's sizes
(``create_masks_for_generate``): some 40 eager ops per token (``arange``, comparisons, ``expand``), about a
sixth of a decode step's host time on tpu. When every layer of the cache is a full-attention static layer, whose
mask size is the fixed cache length, the step gets the 2D mask padded to that length instead (zeros, as
transformers pads it), and the model's forward builds the same 4D mask from it inside the compiled graph, where it
costs nothing per token. Sliding-window layers size their masks from a Python count that changes every step, so
in transformers' loop their masks stay outside.

Decoding from a static cache (generate's, or a ``StaticCache`` the caller passed) of full-attention layers (and for
a decoder, sliding-window layers: :mod:`hf_tpu.compile.sliding_window`), greedy or sampled, runs every step after
the prefill as one program on tpu (:mod:`hf_tpu.compile.decode_loop`): ``_sample`` does the prefill and first token
as transformers does, then hands the loop to that program (decoder-only and encoder-decoder models), or, for what it
does not serve (logits processors it does not run, per-step attentions and hidden states, other caches,
``HF_TPU_STEPWISE_DECODE=1``), runs transformers' own. Either way the model gets transformers' compiled forward
(``model._compiled_call``, from ``get_compiled_call``) as it does on any device, and a later ``generate`` whose
prompt is shorter reuses the program (the cache's bucket is the same): neither Dynamo nor XLA compiles again. Beam
search from such a cache runs the same way (:mod:`hf_tpu.compile.beam_loop`): ``_beam_search`` does the prefill and
the first token's bookkeeping, then hands every later step to one program.

Patches ``GenerationMixin._prepare_cache_for_generation``, ``GenerationMixin.generate``,
``GenerationMixin._sample``, ``GenerationMixin._beam_search``, ``DeferredStopCheck`` (``is_supported``,
``__init__``) and the ``create_masks_for_generate`` that ``prepare_inputs_for_generation`` calls, of
``transformers/generation/utils.py``, ``StaticLayer.lazy_initialization`` of ``transformers/cache_utils.py``,
and ``_preprocess_mask_arguments`` of ``transformers/masking_utils.py`` (transformers 5.x).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from . import traced_by_dynamo, when_imported

_SMALLEST = 64
_LARGEST_POWER_OF_TWO = 2048
_VISIBLE = "_hf_tpu_visible_max_cache_length"  # on a model: the length its caches have elsewhere


def bucket(length: int) -> int:
    """The cache length used for ``length`` positions: the next power of two from 64 up to 2048,
    then the next multiple of 2048 (at most 2x the memory for short caches, less for long ones)."""
    if length <= _LARGEST_POWER_OF_TWO:
        return max(_SMALLEST, 1 << (length - 1).bit_length())
    return -(-length // _LARGEST_POWER_OF_TWO) * _LARGEST_POWER_OF_TWO


def _static_cache(cache: Any) -> Any:
    """The StaticCache of a decoder's cache (the self-attention half of an encoder-decoder cache)."""
    return getattr(cache, "self_attention_cache", cache)


def trim_to_visible_length(cache: Any) -> tuple[int, int] | None:
    """Cuts each layer of a bucketed static cache to the length the cache would have on another device; returns
    the bucketed and the visible length (``None`` for a cache that was not bucketed)."""
    cache = _static_cache(cache)
    length = getattr(cache, _VISIBLE, None)
    if length is None:
        return None
    bucketed = max(layer.max_cache_len for layer in cache.layers)
    for layer in cache.layers:
        if length >= layer.max_cache_len:
            continue
        if getattr(layer, "is_sliding", False) and not layer._is_croppable:  # the window capped the bucket
            layer._is_croppable = length <= layer.max_cache_len
        if getattr(layer, "is_initialized", False):
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
        layer.max_cache_len = length
    from ..compile import decode_loop

    delattr(cache, _VISIBLE)
    cache.__dict__.pop(decode_loop.CACHE_LENGTH, None)
    return bucketed, length


# the per-step outputs of generate whose last dimension is the self-attention cache's length
_SELF_ATTENTIONS = ("attentions", "decoder_attentions")


def _trim_attentions(result: Any, bucketed: int, visible: int) -> None:
    """Cuts each step's self-attention weights from the bucketed cache length to the visible one, as the cache is
    cut: the weights of positions past the visible length are exact zeros (never written, masked out)."""
    for name in _SELF_ATTENTIONS:
        steps = result.get(name)
        if steps is not None:
            result[name] = tuple(
                tuple(layer[..., :visible] if isinstance(layer, torch.Tensor) and layer.shape[-1] == bucketed
                      else layer for layer in step)
                for step in steps)


def _spread_spec(states: torch.Tensor) -> tuple[Any, list] | None:
    """The mesh and per-dim spec of a static cache buffer ``(batch, heads, length, head_dim)`` for sharded
    ``states``: split as they are, except along the length; ``None`` for ``states`` on one chip."""
    from jax.sharding import NamedSharding  # here: importing an integration must not import JAX

    from .. import sharding

    placement = sharding.sharding_of(states)
    if not isinstance(placement, NamedSharding):
        return None
    spec = list(sharding.view_spec(states) or ())  # a view view_spec cannot follow: replicated on its mesh
    if len(spec) > 2:
        spec[2] = None
    return placement.mesh, spec


def _install_sharded_static_cache(cache_utils: Any) -> None:
    layer = cache_utils.StaticLayer
    initialize = layer.lazy_initialization
    if getattr(initialize, "_hf_tpu", False):
        return

    @functools.wraps(initialize)
    def lazy_initialization(self: Any, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """For sharded states, transformers' own initialization runs on meta stand-ins (shapes only), then the
        buffers are made as sharded zeros, so no chip ever holds the whole cache."""
        placements = ({"keys": _spread_spec(key_states), "values": _spread_spec(value_states)}
                      if key_states.device.type == "tpu" and not torch.compiler.is_compiling() else {})
        if not placements or None in placements.values():
            return initialize(self, key_states, value_states)
        from .. import sharding

        before = {name: value for name, value in vars(self).items() if isinstance(value, torch.Tensor)}
        initialize(self, torch.empty_like(key_states, device="meta"), torch.empty_like(value_states, device="meta"))
        for name, value in before.items():  # what it moved to the states' device (cumulative_length, ...)
            if getattr(self, name) is not value and getattr(self, name).device.type == "meta":
                setattr(self, name, value.to(key_states.device))
        self.device = key_states.device
        for name, (grid, spec) in placements.items():
            buffer = getattr(self, name)
            setattr(self, name, sharding.zeros(buffer.shape, buffer.dtype, grid, spec))
            torch._dynamo.mark_static_address(getattr(self, name))

    lazy_initialization._hf_tpu = True
    layer.lazy_initialization = lazy_initialization


def _crops(cache: Any) -> bool:
    """Whether ``cache.crop`` works: an ``EncoderDecoderCache`` reports its self-attention half's ``is_croppable``
    but crops dynamic halves only (it raises for the static cache of a compiled encoder-decoder ``generate``)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    if isinstance(cache, EncoderDecoderCache):
        return isinstance(cache.self_attention_cache, DynamicCache) and isinstance(cache.cross_attention_cache,
                                                                                   DynamicCache)
    return cache is None or cache.is_croppable


def _install_deferred_stop_check(check: type) -> None:
    """``DeferredStopCheck`` for tpu under upstream's rules for mps (the one device it defers on), with its
    host slots pinned, which makes the copies into them asynchronous (upstream pins them on cuda only)."""
    is_supported = check.is_supported
    initialize = check.__init__
    if getattr(initialize, "_hf_tpu", False):
        return
    from ..backend import pinned

    @functools.wraps(is_supported)
    def supported(device: torch.device, cache: Any, cache_is_returned: bool, *args: Any, **kwargs: Any) -> bool:
        if device.type != "tpu":
            return is_supported(device, cache, cache_is_returned, *args, **kwargs)
        if cache_is_returned and not _crops(cache):
            return False
        return is_supported(torch.device("mps"), cache, cache_is_returned, *args, **kwargs)

    @functools.wraps(initialize)
    def init(self: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        initialize(self, input_ids, *args, **kwargs)
        if input_ids.device.type == "tpu":
            for slot in self.slots:
                for host in slot:
                    if isinstance(host, torch.Tensor) and host.device.type == "cpu":
                        pinned.mark(host)

    init._hf_tpu = True
    check.is_supported = staticmethod(supported)
    check.__init__ = init


def _fixed_mask_length(cache: Any) -> int | None:
    """The key/value length of every layer's mask when each is a full-attention static layer (whose mask sizes
    are constants); ``None`` for any other cache."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(_static_cache(cache), "layers", None)
    fixed = StaticLayer.get_mask_sizes
    if not layers or any(getattr(type(layer), "get_mask_sizes", None) is not fixed for layer in layers):
        return None
    return max(layer.max_cache_len for layer in layers)


# what create_masks_for_generate lays over the causal mask, which the forward may not be given the same way
_MASK_OVERLAYS = ("or_mask_function", "and_mask_function", "block_sequence_ids")


def _install_in_graph_decode_mask(module: Any) -> None:
    upstream = module.create_masks_for_generate
    if getattr(upstream, "_hf_tpu", False):
        return

    @functools.wraps(upstream)
    def create_masks_for_generate(config: Any, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                                  *args: Any, **kwargs: Any) -> Any:
        """On tpu, for a cache of full-attention static layers, the 2D mask padded to the cache length (or no
        mask), from which the model's forward builds the 4D mask in its compiled graph; else transformers'."""
        # the cache is the fourth argument: ``cache`` since transformers 5.2x, ``past_key_values`` before
        cache = args[0] if args else kwargs.get("cache", kwargs.get("past_key_values"))
        plain = len(args) <= 1 and all(kwargs.get(name) is None for name in _MASK_OVERLAYS)
        two_dims = attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2)
        if inputs_embeds.device.type == "tpu" and plain and two_dims:
            length = _fixed_mask_length(cache)
            if length is not None and attention_mask is None:
                return None
            if length is not None and attention_mask.shape[-1] <= length:
                return torch.nn.functional.pad(attention_mask, (0, length - attention_mask.shape[-1]))
        return upstream(config, inputs_embeds, attention_mask, *args, **kwargs)

    create_masks_for_generate._hf_tpu = True
    module.create_masks_for_generate = create_masks_for_generate


def _install_sliding_window_masks(masking_utils: Any) -> None:
    upstream = masking_utils._preprocess_mask_arguments
    if getattr(upstream, "_hf_tpu", False):
        return

    @functools.wraps(upstream)
    def preprocess_mask_arguments(config: Any, inputs_embeds: torch.Tensor, attention_mask: Any, cache: Any,
                                  *args: Any, **kwargs: Any) -> tuple:
        """Upstream's sizes of a mask, except over a sliding-window layer whose decode step a one-program loop is
        tracing (``hf_tpu.compile.sliding_window.slot_mask_arguments``); Dynamo, which never traces such a step,
        sees upstream's alone."""
        arguments = upstream(config, inputs_embeds, attention_mask, cache, *args, **kwargs)
        if torch.compiler.is_dynamo_compiling() or cache is None:
            return arguments
        from ..compile import sliding_window

        layer_idx = kwargs["layer_idx"] if "layer_idx" in kwargs else args[1] if len(args) > 1 else None
        return sliding_window.slot_mask_arguments(arguments, cache, layer_idx)

    preprocess_mask_arguments = traced_by_dynamo(preprocess_mask_arguments)
    preprocess_mask_arguments._hf_tpu = True
    masking_utils._preprocess_mask_arguments = preprocess_mask_arguments


# the tensors among a decode step's inputs that the one-program loop knows how to carry from step to step
_STEP_TENSORS = ("input_ids", "decoder_input_ids", "attention_mask", "position_ids")


def streamed_tokens() -> int:
    """The tokens a streamer gets at a time from the one-program loop (a program run each):
    ``HF_TPU_STREAMED_TOKENS``, 8 by default; 1 streams token by token, at a program run per token."""
    value = os.environ.get("HF_TPU_STREAMED_TOKENS", "8")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HF_TPU_STREAMED_TOKENS={value!r} must be a positive number of tokens.")
    return int(value)


# what generate can return per step besides the sequences: what the one-program loop keeps (the option, and the
# output of decode_loop.next_tokens) and what it does not
_STEP_OUTPUTS = {"output_scores": "scores", "output_logits": "logits"}
_OUTPUTS = ("output_attentions", "output_hidden_states")


def _kept_step_outputs(generation_config: Any) -> tuple[str, ...]:
    """What generate hands back of each step (``"scores"``, ``"logits"``), as ``generation_config`` asks."""
    return tuple(name for option, name in _STEP_OUTPUTS.items()
                 if generation_config.return_dict_in_generate and getattr(generation_config, option))


def _decoder_static_cache(cache: Any, sliding: bool = False) -> Any:
    """The static cache generate decodes with: a decoder's ``StaticCache``, or the self-attention half of an
    ``EncoderDecoderCache`` of two (the cross-attention half written by the prefill, read by each step); ``None``
    for any other cache, or one with layers other than full-attention ``StaticLayer``s (or, if ``sliding``, a
    decoder's sliding-window layers: ``StaticSlidingWindowLayer``)."""
    from transformers.cache_utils import EncoderDecoderCache, StaticCache, StaticLayer, StaticSlidingWindowLayer

    encoder_decoder = type(cache) is EncoderDecoderCache
    halves = (cache.self_attention_cache, cache.cross_attention_cache) if encoder_decoder else (cache,)
    kinds = (StaticLayer,) if encoder_decoder or not sliding else (StaticLayer, StaticSlidingWindowLayer)
    if any(type(half) is not StaticCache or any(type(layer) not in kinds for layer in half.layers)
           for half in halves):
        return None
    return halves[0]


def _one_program_cache_key(model: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                           generation_config: Any, synced_gpus: bool, model_kwargs: dict) -> str | None:
    """The key of the cache in ``model_kwargs`` when ``_sample`` can decode after the prefill as one program
    (:mod:`hf_tpu.compile.decode_loop`): greedy or sampling, on one chip or a mesh, from a static cache of
    full-attention layers (a decoder's may hold sliding-window layers; an encoder-decoder's pair of them), generate's
    or the caller's, long enough for the generation, which generate would compile the step for;
    logits processors and stopping criteria the loop runs (:mod:`hf_tpu.compile.decode_processors`), the sequences
    (and with ``return_dict_in_generate`` the cache and maybe each step's scores and logits) as the result."""
    from ..compile import decode_loop

    cache_key = next((name for name in ("cache", "past_key_values") if name in model_kwargs), None)
    cache = model_kwargs.get(cache_key)
    decoder_cache = _decoder_static_cache(cache, sliding=True) if cache is not None else None
    if (
        input_ids.device.type != "tpu" or synced_gpus
        or (generation_config.return_dict_in_generate and any(getattr(generation_config, name) for name in _OUTPUTS))
        or getattr(generation_config, "is_assistant", False)
        or not decode_loop.runs_in_the_loop(logits_processor, stopping_criteria)
        or decoder_cache is None
        or stopping_criteria.max_length is None
        or decode_loop.cache_length(decoder_cache) < stopping_criteria.max_length  # its full-attention layers' length
        or any(isinstance(value, torch.Tensor) for name, value in model_kwargs.items() if name not in _STEP_TENSORS)
        or getattr(model_kwargs.get("attention_mask"), "ndim", 2) != 2
        or not model._valid_auto_compile_criteria(model_kwargs, generation_config)
        or not decode_loop.supports(model)
    ):
        return None
    return cache_key


def _eos_tokens(stopping_criteria: Any) -> torch.Tensor | None:
    """The end-of-sequence tokens ``stopping_criteria`` stop on (``None`` without that criterion)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria

    eos = [criterion.eos_token_id.reshape(-1) for criterion in stopping_criteria
           if isinstance(criterion, EosTokenCriteria)]
    return torch.cat(eos) if eos else None


def _limits(stopping_criteria: Any, generation_config: Any) -> tuple | None:
    """The maximum length, end-of-sequence tokens and pad token of ``stopping_criteria``; ``None`` if they
    stop on end-of-sequence tokens without a pad token."""
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    eos = _eos_tokens(stopping_criteria)
    pad = generation_config._pad_token_tensor if eos is not None else None
    if eos is not None and pad is None:
        return None
    max_length = min(criterion.max_length for criterion in stopping_criteria
                     if isinstance(criterion, MaxLengthCriteria))
    return max_length, eos, pad


def _check_step_inputs(step_inputs: dict, cache: Any, cache_key: str, encoder_decoder: bool) -> None:
    """Raises ``NotImplementedError`` unless a decode step's model inputs are what the one-program loops carry
    from step to step: a token, maybe positions and a 2D mask of the cache's length (an encoder-decoder's: the
    encoder's), and the cache."""
    from ..compile import decode_loop

    mask = step_inputs.get("attention_mask")
    # a decoder's mask covers the cache and grows by a column a step; an encoder-decoder's is the encoder's
    mask_length = step_inputs["encoder_outputs"][0].shape[1] if encoder_decoder else decode_loop.cache_length(cache)
    if (
        step_inputs.get(cache_key) is not cache
        or (mask is not None and (not isinstance(mask, torch.Tensor) or mask.ndim != 2
                                  or mask.shape[-1] != mask_length))
        or any(isinstance(value, torch.Tensor) for name, value in step_inputs.items() if name not in _STEP_TENSORS)
        or not isinstance(step_inputs.get("decoder_input_ids" if encoder_decoder else "input_ids"), torch.Tensor)
    ):
        raise NotImplementedError("its inputs are not a token, positions and a 2D mask of the cache's length")


def _loop_step_inputs(model: Any, sequences: torch.Tensor, cache: Any, kwargs: dict) -> dict:
    """The first decode step's model inputs, as the one-program loops carry them: ``prepare_inputs_for_generation``'s,
    but for a cache with sliding-window layers, whose masks transformers builds before each step from the layers'
    counts, with the 2D mask padded to the cache's length, from which each step builds them
    (:mod:`hf_tpu.compile.sliding_window`)."""
    from ..compile import decode_loop, sliding_window

    step_inputs = model.prepare_inputs_for_generation(sequences, next_sequence_length=1, **kwargs)
    step_inputs["return_dict"] = True
    mask = kwargs.get("attention_mask")
    if sliding_window.layers_of(_static_cache(cache).layers) and (mask is None or mask.ndim == 2):
        step_inputs["attention_mask"] = None if mask is None else torch.nn.functional.pad(
            mask, (0, decode_loop.cache_length(cache) - mask.shape[-1]))
    return step_inputs


def _decode_in_one_program(model: Any, sample: Any, cache_key: str, input_ids: torch.Tensor, logits_processor: Any,
                           stopping_criteria: Any, generation_config: Any, streamer: Any,
                           model_kwargs: dict) -> Any:
    """``_sample``'s decoding: the prefill and first token as transformers does them, then every later
    step in one program (a run per :func:`streamed_tokens` tokens for a ``streamer``, which gets each token as
    transformers' loop hands it over, or for criteria checked between runs: ``decode_loop.check_between_runs``);
    falls back to transformers' loop (from the start, on a reset cache) if the
    step cannot be one program."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    from ..compile import decode_loop

    limits = _limits(stopping_criteria, generation_config)
    if limits is None:
        return sample(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer,
                      **model_kwargs)
    # the compiled forward transformers' loop would decode with (``model._compiled_call``, made lazily, as on any
    # device): the fallback below decodes with it, and code that checks generate compiled the model finds it
    model.get_compiled_call(generation_config.compile_config)
    kwargs = dict(model_kwargs)
    cache = kwargs[cache_key]
    stream = torch.tpu.get_rng_state(input_ids.device)  # where the loop from the start draws again, if it must
    outputs = model._prefill(input_ids, generation_config, kwargs, is_first_iteration=True)
    encoder_decoder = model.config.is_encoder_decoder
    kwargs = model._update_model_kwargs_for_generation(outputs, kwargs, is_encoder_decoder=encoder_decoder)
    between_runs = [criterion for criterion in stopping_criteria if decode_loop.checked_between_runs(criterion)]
    chunk = streamed_tokens() if streamer is not None or between_runs else None
    choice = (list(logits_processor), generation_config.do_sample)
    chosen = decode_loop.next_tokens(outputs.logits, lambda scores: logits_processor(input_ids, scores),
                                     generation_config.do_sample)
    del outputs
    token = chosen["tokens"]
    wanted = _kept_step_outputs(generation_config)
    per_step = {name: [chosen[name][None]] for name in wanted}  # each output's (steps, batch, vocabulary) pieces
    del chosen
    sequences = torch.cat([input_ids, token[:, None]], dim=-1)
    unfinished = ~stopping_criteria(sequences, None)
    step_inputs = _loop_step_inputs(model, sequences, cache, kwargs)
    try:
        _check_step_inputs(step_inputs, cache, cache_key, encoder_decoder)
        with model._optimize_model_for_decode():
            pieces = decode_loop.decode(model, cache, cache_key, step_inputs, unfinished, sequences, limits, choice,
                                        [c for c in stopping_criteria if c not in between_runs], chunk, wanted)
    except NotImplementedError as error:
        decode_loop.mark_unsupported(model, str(error))
        cache.reset()
        torch.tpu.set_rng_state(stream, input_ids.device)
        return sample(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer,
                      **model_kwargs)
    if streamer is not None:
        streamer.put(token.cpu())
    tokens = [sequences]
    with model._optimize_model_for_decode():
        for piece, outputs in pieces:
            for column in piece.cpu().unbind(1) if streamer is not None else ():
                streamer.put(column)
            tokens.append(piece)
            for name, output in zip(wanted, outputs):
                per_step[name].append(output)
            if between_runs and bool(StoppingCriteriaList(between_runs)(torch.cat(tokens, dim=-1), None).all()):
                break
    if streamer is not None:
        streamer.end()
    sequences = torch.cat(tokens, dim=-1)
    if not generation_config.return_dict_in_generate:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

    output_type = GenerateEncoderDecoderOutput if encoder_decoder else GenerateDecoderOnlyOutput
    # the cache's field: ``cache`` since transformers 5.2x, ``past_key_values`` before
    field = "cache" if "cache" in output_type.__dataclass_fields__ else "past_key_values"
    steps = {name: tuple(torch.cat(pieces).unbind(0)) for name, pieces in per_step.items()}  # one tensor a token
    return output_type(sequences=sequences, **steps, **{field: cache})


def _install_decode_in_one_program(mixin: Any) -> None:
    sample = mixin._sample
    if getattr(sample, "_hf_tpu", False) or not hasattr(mixin, "_prefill"):
        return

    @functools.wraps(sample)
    def sample_in_one_program(self: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                              generation_config: Any, synced_gpus: bool = False, streamer: Any = None,
                              **model_kwargs: Any) -> Any:
        cache_key = _one_program_cache_key(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                           synced_gpus, model_kwargs)
        if cache_key is None:
            return sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                          synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        return _decode_in_one_program(self, sample, cache_key, input_ids, logits_processor, stopping_criteria,
                                      generation_config, streamer, model_kwargs)

    sample_in_one_program._hf_tpu = True
    mixin._sample = sample_in_one_program


def _beam_search_cache_key(model: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                           generation_config: Any, synced_gpus: bool, model_kwargs: dict) -> str | None:
    """The key of the cache in ``model_kwargs`` when ``_beam_search`` can search after the first token as one
    program (:mod:`hf_tpu.compile.beam_loop`): as for greedy decoding (:func:`_one_program_cache_key`), with no
    criterion checked between program runs, and the maximum length transformers' criteria stop at is the
    generation config's."""
    from ..compile import decode_loop

    cache_key = _one_program_cache_key(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                       synced_gpus, model_kwargs)
    if (
        cache_key is None or generation_config.low_memory
        or any(map(decode_loop.checked_between_runs, stopping_criteria))
        or stopping_criteria.max_length != generation_config.max_length
    ):
        return None
    return cache_key


def _search_beams_in_one_program(model: Any, beam_search: Any, cache_key: str, input_ids: torch.Tensor,
                                 logits_processor: Any, stopping_criteria: Any, generation_config: Any,
                                 model_kwargs: dict) -> Any:
    """``_beam_search``: the prefill and first token as transformers does them, then every later step in one
    program; falls back to transformers' loop (from the start, on a reset cache) if the step cannot be one
    program."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    from ..compile import beam_loop, decode_loop

    model.get_compiled_call(generation_config.compile_config)  # as for greedy decoding (_decode_in_one_program)
    kwargs = dict(model_kwargs)
    cache = kwargs[cache_key]
    stream = torch.tpu.get_rng_state(input_ids.device)
    pad_token_id, eos_token_id = generation_config._pad_token_tensor, generation_config._eos_token_tensor
    fill = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1  # transformers' output_fill_value
    settings = beam_loop.Settings.of(generation_config, input_ids.shape[0], eos_token_id)
    prompt_length = input_ids.shape[1]
    beams = beam_loop.start(input_ids, settings, decode_loop.cache_length(cache), int(fill),
                            generation_config.max_length)
    outputs = model._prefill(input_ids, generation_config, kwargs, is_first_iteration=True)
    encoder_decoder = model.config.is_encoder_decoder
    kwargs = model._update_model_kwargs_for_generation(outputs, kwargs, is_encoder_decoder=encoder_decoder)
    beams, beam_idx, first = beam_loop.advance(
        model, beams, outputs.logits, settings,
        lambda tokens, scores: logits_processor(tokens[:, :prompt_length], scores),
        lambda sequences: stopping_criteria(sequences[:, :prompt_length + 1], None))
    del outputs
    kept = _kept_step_outputs(generation_config)
    beam_loop.reorder(cache, beam_idx)
    running = model._flatten_beam_dim(beams["running_sequences"][:, :, :prompt_length + 1])
    step_inputs = _loop_step_inputs(model, running, cache, kwargs)
    criteria = [criterion for criterion in stopping_criteria
                if not isinstance(criterion, (EosTokenCriteria, MaxLengthCriteria))]
    try:
        _check_step_inputs(step_inputs, cache, cache_key, encoder_decoder)
        with model._optimize_model_for_decode():
            beams, later = beam_loop.search(model, cache, cache_key, step_inputs, beams, settings,
                                            list(logits_processor), criteria, _eos_tokens(stopping_criteria),
                                            input_ids, generation_config.max_length, kept)
    except NotImplementedError as error:
        decode_loop.mark_unsupported(model, str(error))
        cache.reset()
        torch.tpu.set_rng_state(stream, input_ids.device)
        return beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config,
                           **model_kwargs)
    steps = {name: (first[name], *later[name].unbind(0)) for name in kept}
    return beam_loop.result(model, beams, generation_config, cache, prompt_length, steps)


def _install_beam_search_in_one_program(mixin: Any) -> None:
    beam_search = mixin._beam_search
    if getattr(beam_search, "_hf_tpu", False) or not hasattr(mixin, "_prefill"):
        return

    @functools.wraps(beam_search)
    def beam_search_in_one_program(self: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                                   generation_config: Any, synced_gpus: bool = False, **model_kwargs: Any) -> Any:
        cache_key = _beam_search_cache_key(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                           synced_gpus, model_kwargs)
        if cache_key is None:
            return beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config,
                               synced_gpus=synced_gpus, **model_kwargs)
        return _search_beams_in_one_program(self, beam_search, cache_key, input_ids, logits_processor,
                                            stopping_criteria, generation_config, model_kwargs)

    beam_search_in_one_program._hf_tpu = True
    mixin._beam_search = beam_search_in_one_program


def install(module: Any) -> None:
    """Wraps ``_prepare_cache_for_generation``, ``generate``, ``_sample``, ``_beam_search``, ``DeferredStopCheck`` and
    ``create_masks_for_generate`` of ``transformers.generation.utils``, the static cache's ``lazy_initialization``
    and ``masking_utils._preprocess_mask_arguments``."""
    when_imported("transformers.cache_utils", _install_sharded_static_cache)
    when_imported("transformers.masking_utils", _install_sliding_window_masks)
    if hasattr(module, "DeferredStopCheck"):
        _install_deferred_stop_check(module.DeferredStopCheck)
    if hasattr(module, "create_masks_for_generate"):
        _install_in_graph_decode_mask(module)
    mixin = module.GenerationMixin
    _install_decode_in_one_program(mixin)
    _install_beam_search_in_one_program(mixin)
    prepare = mixin._prepare_cache_for_generation
    generate = mixin.generate
    if getattr(prepare, "_hf_tpu", False):
        return
    static_implementations = set(getattr(module, "ALL_STATIC_CACHE_IMPLEMENTATIONS", ("static",)))

    @functools.wraps(prepare)
    def prepare_cache_for_generation(self: Any, generation_config: Any, model_kwargs: dict, generation_mode: Any,
                                     batch_size: int, max_cache_length: int, *args: Any, **kwargs: Any) -> Any:
        if (
            self.device.type != "tpu"
            or generation_config.cache_implementation not in static_implementations
            or model_kwargs.get("cache") is not None
        ):
            return prepare(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                           *args, **kwargs)
        explicit = getattr(generation_config, "max_cache_len", None)
        # what transformers sizes the cache to elsewhere: this call's need, the explicit size, earlier calls'
        visible = max(max_cache_length, explicit or -1, getattr(self, _VISIBLE, -1))
        setattr(self, _VISIBLE, visible)
        length = max_cache_length if explicit is not None else bucket(visible)
        result = prepare(self, generation_config, model_kwargs, generation_mode, batch_size, length, *args, **kwargs)
        cache = model_kwargs.get("cache")
        if cache is not None:
            from ..compile import decode_loop

            setattr(_static_cache(cache), _VISIBLE, visible)
            setattr(_static_cache(cache), decode_loop.CACHE_LENGTH, length)
        return result

    @functools.wraps(generate)
    def generate_then_trim(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = generate(self, *args, **kwargs)
        cache = result.get("cache", result.get("past_key_values")) if hasattr(result, "get") else None
        lengths = trim_to_visible_length(cache) if cache is not None else None
        if lengths is not None:
            _trim_attentions(result, *lengths)
        return result

    prepare_cache_for_generation._hf_tpu = True
    mixin._prepare_cache_for_generation = prepare_cache_for_generation
    mixin.generate = generate_then_trim
