"""The torch ops behind hf_tpu's kernel repositories (and :func:`hf_tpu.kernels.enable`).

They live in this ordinary module, not in the repositories' packages: ``kernels`` imports a repository's
package under its metadata id, so an op defined there would be registered again by every other import of
the same code, while this module is imported once.
"""

from __future__ import annotations

from typing import Callable, Literal

import jax
import jax.numpy as jnp

from .. import pallas
from ..jax_interop import jax_op

Activation = Literal["silu", "gelu", "gelu_tanh", "fast_gelu", "quick_gelu"]


@jax_op("hf_tpu_kernels::rms_norm")
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``LlamaRMSNorm`` of ``x[..., H]`` with ``weight[H]`` (the Pallas ``rms_norm`` kernel)."""
    return pallas.rms_norm(x, weight, eps)


def _fast_gelu(x: jax.Array) -> jax.Array:
    """transformers' ``FastGELUActivation``: the tanh approximation, its constant rounded as there."""
    half, scale, cubic = (jnp.asarray(value, x.dtype) for value in (0.5, 0.7978845608, 0.044715))
    return half * x * (1 + jnp.tanh(x * scale * (1 + cubic * x * x)))


def _quick_gelu(x: jax.Array) -> jax.Array:
    """transformers' ``QuickGELUActivation``: ``x * sigmoid(1.702 * x)``."""
    return x * jax.nn.sigmoid(jnp.asarray(1.702, x.dtype) * x)


_FORMULAS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # also NewGELU's formula
    "fast_gelu": _fast_gelu,
    "quick_gelu": _quick_gelu,
}


@jax_op("hf_tpu_kernels::activation")
def activation(x: jax.Array, kind: Activation) -> jax.Array:
    """The activation ``kind`` of ``x``, elementwise; half-precision inputs are computed in float32."""
    if kind not in _FORMULAS:
        raise ValueError(f"unknown activation {kind!r}: use one of {', '.join(_FORMULAS)}")
    compute_dtype = jnp.promote_types(x.dtype, jnp.float32)
    return _FORMULAS[kind](x.astype(compute_dtype)).astype(x.dtype)
