"""``transformers serve`` on tpu: requests generate with a static cache.

serve's ``GenerateRunner.generate`` (``transformers/cli/serving/utils.py``, transformers 5.2x) generates with the
model's generation config and the request's settings, and asks for a static cache only under ``--compile``. On tpu a
dynamic cache gives every prompt length and every decode step tensors of new shapes, each a new program: a cold
server spent its first minutes compiling. With a static cache, whose length generate buckets on tpu (see
:mod:`hf_tpu.integrations.generation`), a request's prefill and decode compile once per bucket, and a streamed
request decodes in one program per :func:`~hf_tpu.integrations.generation.streamed_tokens` tokens. A request or
generation config that names a cache implementation keeps it.
"""

from __future__ import annotations

import functools
from typing import Any


def request_settings(model: Any, generation_kwargs: dict) -> dict:
    """A request's generation settings for ``model``: with a static cache on tpu, where neither the request nor the
    model's generation config names a cache implementation."""
    if (getattr(model, "device", None) is not None and model.device.type == "tpu"
            and generation_kwargs.get("cache_implementation") is None
            and getattr(model.generation_config, "cache_implementation", None) is None):
        return {**generation_kwargs, "cache_implementation": "static"}
    return generation_kwargs


def _install_static_cache(runner: type) -> None:
    generate = runner.generate
    if getattr(generate, "_hf_tpu", False):
        return

    @functools.wraps(generate)
    def generate_with_a_static_cache_on_tpu(self: Any, request_id: int, inputs: dict, generation_kwargs: dict,
                                            stream: bool) -> None:
        return generate(self, request_id, inputs, request_settings(self.model, generation_kwargs), stream)

    generate_with_a_static_cache_on_tpu._hf_tpu = True
    runner.generate = generate_with_a_static_cache_on_tpu


def install(module: Any) -> None:
    if hasattr(module, "GenerateRunner"):
        _install_static_cache(module.GenerateRunner)
