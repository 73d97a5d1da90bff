"""Small shape helpers shared by the kernel wrappers."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, size: int, value: float | bool = 0) -> jax.Array:
    """``x`` padded at the end of ``axis`` to ``size`` entries with ``value``."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)
