"""transformers ``generate()`` with a static cache on tpu: cache lengths rounded up to buckets.

generate() sizes a StaticCache for prompt + new tokens and compiles the decode step for that
cache shape; transformers keeps the largest length seen so far, so growing prompts still compile
once per new length. On tpu the length is rounded up to a bucket (:func:`bucket`), so prompts of
many lengths share a few programs. Results do not change: positions past the written part of a
static cache are masked out of attention.
"""

from __future__ import annotations

import functools
from typing import Any

_SMALLEST = 64
_LARGEST_POWER_OF_TWO = 2048


def bucket(length: int) -> int:
    """The cache length used for ``length`` positions: the next power of two from 64 up to 2048,
    then the next multiple of 2048 (at most 2x the memory for short caches, less for long ones)."""
    if length <= _LARGEST_POWER_OF_TWO:
        return max(_SMALLEST, 1 << (length - 1).bit_length())
    return -(-length // _LARGEST_POWER_OF_TWO) * _LARGEST_POWER_OF_TWO


def install(module: Any) -> None:
    """Wraps ``GenerationMixin._prepare_static_cache`` of ``transformers.generation.utils``."""
    mixin = module.GenerationMixin
    prepare = mixin._prepare_static_cache
    if getattr(prepare, "_hf_tpu", False):
        return

    @functools.wraps(prepare)
    def prepare_static_cache(self: Any, cache_implementation: str, batch_size: int, max_cache_len: int,
                             *args: Any, **kwargs: Any) -> Any:
        if self.device.type == "tpu":
            max_cache_len = bucket(max_cache_len)
        return prepare(self, cache_implementation, batch_size, max_cache_len, *args, **kwargs)

    prepare_static_cache._hf_tpu = True
    mixin._prepare_static_cache = prepare_static_cache
