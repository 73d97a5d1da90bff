"""``transformers serve`` on tpu: requests generate with a static cache, from prompts padded to a few lengths.

serve's ``GenerateRunner.generate`` (``transformers/cli/serving/utils.py``, transformers 5.2x) generates with the
model's generation config and the request's settings, and asks for a static cache only under ``--compile``. On tpu a
dynamic cache gives every prompt length and every decode step tensors of new shapes, each a new program: a cold
server spent its first minutes compiling. With a static cache, whose length generate buckets on tpu (see
:mod:`hf_tpu.integrations.generation`), a request's prefill and decode compile once per bucket, and a streamed
request decodes in one program per :func:`~hf_tpu.integrations.generation.streamed_tokens` tokens. A request or
generation config that names a cache implementation keeps it.

Every prompt length is still new shapes for generate's eager work around the model (the attention mask and
positions it derives from the prompt, the slices and concatenations of its bookkeeping: some 25 small programs, about
1 s of compiling per new length), so a cold server answering prompts of many lengths spent most of its time
compiling. On tpu a prompt is padded on the left to :func:`~hf_tpu.integrations.generation.bucket` (64 tokens, 128,
...) with the pad token, under an attention mask that leaves the padding out, as batched generation pads its prompts:
prompts of many lengths then share every program. Only where the request's settings (with the model's generation
config) read nothing of the prompt but its length: a setting that reads its tokens (``repetition_penalty``,
``no_repeat_ngram_size``, ``bad_words_ids``, ...) or counts lengths from its start (``min_length``) leaves the prompt
as it is.

A request that does not stream is given serve's own stopping criterion, which checks whether the client cancelled
(it reads no token): the one-program loop checks it between its runs, one per ``streamed_tokens()`` tokens
(``decode_loop.check_between_runs``), so such a request decodes in programs of that many tokens too, not token by
token in transformers' loop.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def request_settings(model: Any, generation_kwargs: dict) -> dict:
    """A request's generation settings for ``model``: with a static cache on tpu, where neither the request nor the
    model's generation config names a cache implementation."""
    if (getattr(model, "device", None) is not None and model.device.type == "tpu"
            and generation_kwargs.get("cache_implementation") is None
            and getattr(model.generation_config, "cache_implementation", None) is None):
        return {**generation_kwargs, "cache_implementation": "static"}
    return generation_kwargs


# generation settings whose logits processors and stopping criteria read no token of the prompt and count lengths
# from its end; besides those, what the request sets (or a model's generation config sets) must be at its default
# for the prompt to be padded
_PROMPT_BLIND = frozenset((
    "max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "eos_token_id", "pad_token_id", "bos_token_id", "seed",
    "cache_implementation", "use_cache", "transformers_version", "_from_model_config",
))


def padded_prompt(model: Any, inputs: dict, generation_kwargs: dict) -> dict:
    """A request's model inputs for ``model``: on tpu, the prompt padded on the left to a bucket of lengths, with
    the pad token (else the end-of-sequence token) under an attention mask of zeros, where the request's settings
    read nothing of the prompt but its length; else ``inputs``."""
    from transformers import GenerationConfig

    from .generation import bucket

    prompt = inputs.get("input_ids")
    mask = inputs.get("attention_mask")
    if (getattr(model, "device", None) is None or model.device.type != "tpu" or model.config.is_encoder_decoder
            or not isinstance(prompt, torch.Tensor) or prompt.ndim != 2 or set(inputs) - {"input_ids", "attention_mask"}
            or (mask is not None and mask.shape != prompt.shape)):
        return inputs
    settings = {**model.generation_config.to_diff_dict(), **generation_kwargs}
    defaults = GenerationConfig()
    for name, value in settings.items():
        default = getattr(defaults, name, None)
        if name not in _PROMPT_BLIND and value != default and (value or default):  # off either way: the default
            return inputs
    pad = settings.get("pad_token_id", settings.get("eos_token_id"))
    pad = pad[0] if isinstance(pad, (list, tuple)) and pad else pad
    padding = bucket(prompt.shape[1]) - prompt.shape[1]
    if not isinstance(pad, int) or not padding:
        return inputs
    mask = torch.ones_like(prompt) if mask is None else mask
    return {"input_ids": torch.nn.functional.pad(prompt, (padding, 0), value=pad),
            "attention_mask": torch.nn.functional.pad(mask, (padding, 0), value=0)}


def _install_static_cache(runner: type) -> None:
    generate = runner.generate
    if getattr(generate, "_hf_tpu", False):
        return

    @functools.wraps(generate)
    def generate_with_a_static_cache_on_tpu(self: Any, request_id: int, inputs: dict, generation_kwargs: dict,
                                            stream: bool) -> None:
        settings = request_settings(self.model, generation_kwargs)
        padded = padded_prompt(self.model, inputs, settings)
        generate(self, request_id, padded, settings, stream)
        if padded is not inputs:  # serve counted the padding among the prompt tokens of its stats line
            self.count_tokens(prompt=inputs["input_ids"].shape[-1] - padded["input_ids"].shape[-1])

    generate_with_a_static_cache_on_tpu._hf_tpu = True
    runner.generate = generate_with_a_static_cache_on_tpu


def is_cancellation_check(criterion: Any) -> bool:
    """serve's stopping criterion for a request that does not stream (``stop_if_cancelled``, made in
    ``GenerateRunner.generate``): it reads whether the client cancelled, no token."""
    return (getattr(criterion, "__module__", None) == "transformers.cli.serving.utils"
            and getattr(criterion, "__qualname__", "") == "GenerateRunner.generate.<locals>.stop_if_cancelled")


def install(module: Any) -> None:
    from ..compile import decode_loop

    if hasattr(module, "GenerateRunner"):
        _install_static_cache(module.GenerateRunner)
        decode_loop.check_between_runs(is_cancellation_check)
