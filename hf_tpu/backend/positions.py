"""Positions that may be traced: in graph mode, a slice's bounds or a select's index can be an argument of the
program (see :mod:`hf_tpu.compile.graph_lowering`) rather than a number in it."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def is_traced(*values: Any) -> bool:
    """Whether any of ``values`` is a traced JAX value rather than a Python number."""
    return any(isinstance(v, jax.core.Tracer) for v in values)


def normalized(index: Any, size: int) -> Any:
    """A traced position as torch reads a slice bound: negative counts from the end, then clamped to
    ``[0, size]``."""
    return jnp.clip(jnp.where(index < 0, index + size, index), 0, size)
