"""``transformers serve`` on tpu: requests generate with a static cache.

serve's ``GenerateRunner.generate`` (``transformers/cli/serving/utils.py``, transformers 5.2x) generates with the
model's generation config and the request's settings, and asks for a static cache only under ``--compile``. On tpu a
dynamic cache gives every prompt length and every decode step tensors of new shapes, each a new program: a cold
server spent its first minutes compiling. With a static cache, whose length generate buckets on tpu (see
:mod:`hf_tpu.integrations.generation`), a request's prefill and decode compile once per bucket, and a streamed
request decodes in one program per :func:`~hf_tpu.integrations.generation.streamed_tokens` tokens. A request or
generation config that names a cache implementation keeps it.

A request that does not stream is given serve's own stopping criterion, which checks whether the client cancelled
(it reads no token): the one-program loop checks it between its runs, one per ``streamed_tokens()`` tokens
(``decode_loop.check_between_runs``), so such a request decodes in programs of that many tokens too, not token by
token in transformers' loop.
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
