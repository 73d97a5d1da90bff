"""transformers ``generate()``'s prefill on tpu: prompts padded to a bucket of lengths, so they share programs.

A prefill is one forward over the prompt, run eagerly: every prompt length is new shapes for each of its ops, each a
new program on tpu (about 50 for a small Llama, 0.5-1 s of compiling). A server that answers prompts of many lengths
spent most of its first minutes there. On tpu the prompt of a prefill into an empty static cache of full-attention
layers is padded on the right to :func:`~hf_tpu.integrations.generation.bucket` (the length the cache itself is
rounded up to), so prompts of many lengths share a few programs.

Results do not change. Causal attention keeps the padding out of every real position's attention; the logits are
those of the prompt's last position (``logits_to_keep`` as positions); the cache is left holding the prompt's
keys and values only, its padded slots zeroed and its length the prompt's, as an unpadded prefill leaves it.

Patches ``GenerationMixin._prefill`` of ``transformers/generation/utils.py`` (transformers 5.x).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# the model inputs a padded prefill pads along the sequence; any other tensor input keeps the prompt as it is
_PADDED = ("input_ids", "attention_mask", "position_ids")


def _cache_in(model_kwargs: dict) -> Any:
    """The cache among generate's model inputs: ``cache`` since transformers 5.2x, ``past_key_values`` before."""
    return model_kwargs.get("cache", model_kwargs.get("past_key_values"))


def prefill_padding(model: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict) -> int:
    """The positions to pad a prefill of ``input_ids`` with on tpu; 0 to prefill the prompt as it is."""
    from .generation import _decoder_static_cache, bucket

    cache = _cache_in(model_kwargs)
    mask = model_kwargs.get("attention_mask")
    if (
        input_ids.device.type != "tpu" or model.config.is_encoder_decoder
        or cache is None or _decoder_static_cache(cache) is not cache
        or getattr(cache, "_is_user_defined", False)  # generate made it for this call: it is empty
        or getattr(generation_config, "prefill_chunk_size", None) is not None
        # transformers' own models take ``logits_to_keep`` as positions too (``slice_logits_to_keep``)
        or model_kwargs.get("logits_to_keep") != 1 or not type(model).__module__.startswith("transformers.")
        or (mask is not None and mask.ndim != 2)
        or any(getattr(generation_config, name, False) or model_kwargs.get(name)
               for name in ("output_attentions", "output_hidden_states"))
        or any(isinstance(value, torch.Tensor) for name, value in model_kwargs.items() if name not in _PADDED)
    ):
        return 0
    length = input_ids.shape[1]
    padded = min(bucket(length), min(layer.max_cache_len for layer in cache.layers))
    return max(padded - length, 0)


def _keep_the_prompt_only(cache: Any, length: int) -> None:
    """A static cache written by a padded prefill, as a prefill of ``length`` positions leaves it: that length,
    and zeros where the padding was written."""
    from .. import sharding

    paddings: dict[tuple, torch.Tensor] = {}  # one mask for the layers of one length and placement
    for layer in cache.layers:
        mesh = getattr(sharding.sharding_of(layer.keys), "mesh", None)  # a sharded cache: on each of its chips
        key = (layer.max_cache_len, layer.keys.device, mesh)
        if key not in paddings:
            padding = torch.arange(layer.max_cache_len)[:, None] >= length  # slot by slot, made on the host
            paddings[key] = padding.to(layer.keys.device) if mesh is None else sharding.distribute(padding, mesh)
        layer.keys.masked_fill_(paddings[key], 0)
        layer.values.masked_fill_(paddings[key], 0)
        layer.cumulative_length.fill_(length)


def _install(mixin: Any) -> None:
    prefill = mixin._prefill
    if getattr(prefill, "_hf_tpu", False):
        return

    @functools.wraps(prefill)
    def prefill_in_buckets(self: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict,
                           is_first_iteration: bool = True) -> Any:
        padding = prefill_padding(self, input_ids, generation_config, model_kwargs)
        if not padding:
            return prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=is_first_iteration)
        length = input_ids.shape[1]
        padded = {name: torch.nn.functional.pad(value, (0, padding)) if name in _PADDED and value is not None
                  else value for name, value in model_kwargs.items()}
        if padded.get("attention_mask") is None:  # made on the host: no program per prompt length
            prompt_positions = (torch.arange(length + padding) < length).long()
            padded["attention_mask"] = prompt_positions.repeat(input_ids.shape[0], 1).to(input_ids.device)
        padded["logits_to_keep"] = torch.tensor([length - 1], device=input_ids.device)
        outputs = prefill(self, torch.nn.functional.pad(input_ids, (0, padding)), generation_config, padded,
                          is_first_iteration=is_first_iteration)
        _keep_the_prompt_only(_cache_in(model_kwargs), length)
        return outputs

    prefill_in_buckets._hf_tpu = True
    mixin._prefill = prefill_in_buckets


def install(module: Any) -> None:
    """Wraps ``GenerationMixin._prefill`` of ``transformers.generation.utils``."""
    if hasattr(module.GenerationMixin, "_prefill"):
        _install(module.GenerationMixin)
