"""The Pallas kernels (hf_tpu.kernels.pallas) against their pure-JAX references.

Off TPU chips the kernels run in TPU interpret mode, which is slow: shapes are tiny and the
parametrizations few. The lowering tests export each kernel and its gradient for TPU from this host
(Pallas -> Mosaic); they do not run Mosaic's compiler, so tiling errors only show on chips.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tpu.backend import runtime
from hf_tpu.kernels import pallas
from hf_tpu.kernels.pallas import references

DTYPES = [jnp.float32, jnp.bfloat16]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def random(key: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def assert_close(actual: jax.Array, expected: jax.Array, dtype: Any) -> None:
    """Equal dtype and shape; values within the dtype's tolerance, relative to the largest value."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    expected = np.asarray(expected, np.float32)
    atol = TOLERANCE[dtype] * max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=0, atol=atol)


def gradients(fn: Callable[..., jax.Array], args: tuple, cotangent: jax.Array) -> tuple:
    """The gradients of ``sum(fn(*args) * cotangent)`` in all ``args``, under ``jax.jit``."""
    def loss(*inputs: jax.Array) -> jax.Array:
        return jnp.sum(fn(*inputs).astype(jnp.float32) * cotangent)

    return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def test_use_by_default_only_on_tpu_chips() -> None:
    assert pallas.use_by_default() == (runtime.backing_platform() == "tpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: Any) -> None:
    x = random(0, (3, 7, 64), dtype)  # 21 rows: not a whole block
    weight = (1 + 0.1 * random(1, (64,))).astype(dtype)
    assert_close(pallas.rms_norm(x, weight, 1e-5), references.rms_norm_reference(x, weight, 1e-5), dtype)

    cotangent = random(2, x.shape)
    actual = gradients(pallas.rms_norm, (x, weight), cotangent)
    expected = gradients(references.rms_norm_reference, (x, weight), cotangent)
    for a, e in zip(actual, expected):
        assert_close(a, e, dtype)


def attention_inputs(dtype: Any, q_len: int = 10, kv_len: int = 20) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GQA inputs (4 query heads, 2 KV heads), lengths that are not whole kernel blocks."""
    kv_shape = (2, 2, kv_len, 32)
    return random(0, (2, 4, q_len, 32), dtype), random(1, kv_shape, dtype), random(2, kv_shape, dtype)


def boolean_mask(q_len: int = 10, kv_len: int = 20) -> jax.Array:
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, q_len, kv_len))
    return mask.at[..., 0].set(True)  # every query attends at least one key


MASKS = {
    "none": {},
    "causal": {"causal": True},
    "causal_bottom_right": {"causal": True, "query_offset": 10},
    "boolean": {"mask": boolean_mask()},
    "key_lengths": {"key_lengths": jnp.array([20, 13])},
}


@pytest.mark.parametrize("masks", MASKS.values(), ids=MASKS.keys())
def test_flash_attention_masks(masks: dict) -> None:
    q, k, v = attention_inputs(jnp.float32)
    actual = pallas.flash_attention(q, k, v, **masks)
    assert_close(actual, references.attention_reference(q, k, v, **masks), jnp.float32)


GRADIENT_MASKS = {
    "boolean_and_bottom_right_causal": {"mask": boolean_mask(), "causal": True, "query_offset": 10},
    "key_lengths_and_causal": {"key_lengths": jnp.array([20, 13]), "causal": True},
}


@pytest.mark.parametrize(
    "dtype, masks",
    [
        (jnp.float32, GRADIENT_MASKS["boolean_and_bottom_right_causal"]),
        (jnp.float32, GRADIENT_MASKS["key_lengths_and_causal"]),
        (jnp.bfloat16, GRADIENT_MASKS["boolean_and_bottom_right_causal"]),
    ],
    ids=["float32-boolean_causal", "float32-lengths_causal", "bfloat16-boolean_causal"],
)
def test_flash_attention_values_and_gradients(dtype: Any, masks: dict) -> None:
    q, k, v = attention_inputs(dtype)
    scale = 0.3
    assert_close(
        pallas.flash_attention(q, k, v, scale=scale, **masks),
        references.attention_reference(q, k, v, scale=scale, **masks),
        dtype,
    )
    cotangent = random(4, q.shape)
    actual = gradients(lambda *a: pallas.flash_attention(*a, scale=scale, **masks), (q, k, v), cotangent)
    expected = gradients(lambda *a: references.attention_reference(*a, scale=scale, **masks), (q, k, v), cotangent)
    for a, e in zip(actual, expected):
        assert_close(a, e, dtype)


def _causal_documents(q_len: int, kv_len: int) -> jax.Array:
    """Causal attention within documents of 100 tokens (packed sequences), the same for every example and head."""
    query, key = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
    return ((key <= query) & (key // 100 == query // 100))[None, None]


def _documents_per_example(q_len: int, kv_len: int) -> jax.Array:
    """Causal attention within documents of 100 tokens in example 0 and of 60 in example 1."""
    query, key = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
    documents = jnp.array([100, 60])[:, None, None]
    return ((key <= query) & (key // documents == query // documents))[:, None]


def _per_head(q_len: int, kv_len: int) -> jax.Array:
    """A random mask per head (the same for both examples) with whole blocks masked."""
    mask = jax.random.bernoulli(jax.random.key(6), 0.5, (1, 4, q_len, kv_len))
    return mask & (jnp.arange(kv_len) >= 128)  # the first key block masked whole


def _per_example_and_head(q_len: int, kv_len: int) -> jax.Array:
    """A random mask per example and head with whole blocks masked; query 7 of example 1 attends no key."""
    mask = jax.random.bernoulli(jax.random.key(5), 0.5, (2, 4, q_len, kv_len))
    mask = mask & (jnp.arange(kv_len) < 128)  # every key block but the first masked whole
    return mask.at[1, :, 7].set(False)


MASKED_ATTENTION_MASKS = {
    "causal_documents": _causal_documents,
    "documents_per_example": _documents_per_example,
    "per_head": _per_head,
    "per_example_and_head": _per_example_and_head,
}


@pytest.mark.parametrize(
    "dtype, mask",
    [*((jnp.float32, mask) for mask in MASKED_ATTENTION_MASKS.values()),
     (jnp.bfloat16, MASKED_ATTENTION_MASKS["per_example_and_head"])],
    ids=[*(f"float32-{name}" for name in MASKED_ATTENTION_MASKS), "bfloat16-per_example_and_head"],
)
def test_masked_attention_values_and_gradients(dtype: Any, mask: Callable[[int, int], jax.Array]) -> None:
    """Output, logsumexp and gradients (the backward given the forward's output and logsumexp) of the splash kernel
    equal dense attention's, with grouped heads and sequences that are not whole blocks (soft-capped logits with
    the mask per head: a cap of 0.5 changes every weight)."""
    q, k, v = attention_inputs(dtype, q_len=200, kv_len=330)
    mask, options = mask(200, 330), {"scale": 0.3, "soft_cap": 0.5 if mask is _per_head else None}
    out, logsumexp = pallas.masked_attention(q, k, v, mask, **options)
    expected_out, expected_logsumexp = references.masked_attention_reference(q, k, v, mask, **options)
    assert_close(out, expected_out, dtype)
    allowed = jnp.any(mask, axis=-1) & jnp.ones(logsumexp.shape, bool)
    assert bool(jnp.all(jnp.isneginf(logsumexp) == ~allowed))
    np.testing.assert_allclose(np.where(allowed, logsumexp, 0), np.where(allowed, expected_logsumexp, 0),
                               atol=TOLERANCE[dtype] * 10)

    cotangent = random(4, out.shape, dtype)
    actual = pallas.masked_attention_backward(q, k, v, out, logsumexp, cotangent, mask, **options)
    _, pullback = jax.vjp(lambda *a: references.masked_attention_reference(*a, mask, **options)[0], q, k, v)
    for a, e in zip(actual, pullback(cotangent)):
        assert_close(a, e, dtype)


@pytest.mark.parametrize(
    "dtype, max_len, lengths",
    [(jnp.float32, 384, [300, 5, 129]), (jnp.bfloat16, 384, [384, 1, 128]), (jnp.float32, 40, [40, 7, 21])],
    ids=["float32", "bfloat16", "float32-padded_cache"],
)
def test_decode_attention(dtype: Any, max_len: int, lengths: list[int]) -> None:
    q = random(0, (3, 8, 32), dtype)
    k_cache, v_cache = random(1, (3, 2, max_len, 32), dtype), random(2, (3, 2, max_len, 32), dtype)
    lengths = jnp.array(lengths, jnp.int32)
    assert_close(
        pallas.decode_attention(q, k_cache, v_cache, lengths),
        references.decode_attention_reference(q, k_cache, v_cache, lengths),
        dtype,
    )


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["rhs_KN", "rhs_NK"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul(dtype: Any, transpose_rhs: bool) -> None:
    lhs = random(0, (20, 32), dtype)
    rhs = random(1, (3, 48, 32) if transpose_rhs else (3, 32, 48), dtype)
    group_sizes = jnp.array([7, 0, 11], jnp.int32)  # an empty group; rows 18-19 in no group

    def kernel(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return pallas.grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)

    def reference(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return references.grouped_matmul_reference(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)

    assert_close(kernel(lhs, rhs), reference(lhs, rhs), dtype)
    cotangent = random(2, (20, 48))
    for a, e in zip(gradients(kernel, (lhs, rhs), cotangent), gradients(reference, (lhs, rhs), cotangent)):
        assert_close(a, e, dtype)


def spec(shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def summed(fn: Callable[..., jax.Array], argnums: tuple[int, ...]) -> Callable[..., Any]:
    return jax.grad(lambda *args: jnp.sum(fn(*args).astype(jnp.float32)), argnums=argnums)


def rms_norm_for_tpu(x: jax.Array, w: jax.Array) -> jax.Array:
    return pallas.rms_norm(x, w, interpret=False)


def flash_for_tpu(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    return pallas.flash_attention(q, k, v, mask, causal=True, interpret=False)


def flash_with_logsumexp_for_tpu(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    return pallas.flash_attention_with_logsumexp(q, k, v, causal=True, interpret=False)


def decode_for_tpu(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    return pallas.decode_attention(q, k, v, lengths, interpret=False)


def gmm_for_tpu(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return pallas.grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=True, interpret=False)


def masked_attention_for_tpu(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple:
    return pallas.masked_attention(q, k, v, mask, interpret=False)


def masked_attention_backward_for_tpu(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple:
    out = jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype)
    return pallas.masked_attention_backward(q, k, v, out, q[..., 0], q, mask, interpret=False)


RMS_NORM_SPECS = (spec((3, 5, 256)), spec((256,)))
FLASH_SPECS = (spec((2, 4, 200, 64)), spec((2, 2, 200, 64)), spec((2, 2, 200, 64)), spec((2, 1, 200, 200), bool))
GMM_SPECS = (spec((200, 256)), spec((4, 384, 256)), spec((4,), jnp.int32))
LOWERINGS = {
    "rms_norm": (rms_norm_for_tpu, RMS_NORM_SPECS),
    "rms_norm_grad": (summed(rms_norm_for_tpu, (0, 1)), RMS_NORM_SPECS),
    "flash_attention": (flash_for_tpu, FLASH_SPECS),
    "flash_attention_grad": (summed(flash_for_tpu, (0, 1, 2)), FLASH_SPECS),
    "flash_attention_with_logsumexp": (flash_with_logsumexp_for_tpu, FLASH_SPECS[:3]),
    "decode_attention": (
        decode_for_tpu,
        (spec((2, 8, 64)), spec((2, 2, 512, 64)), spec((2, 2, 512, 64)), spec((2,), jnp.int32)),
    ),
    "masked_attention": (masked_attention_for_tpu, FLASH_SPECS),
    "masked_attention_backward": (masked_attention_backward_for_tpu, FLASH_SPECS),
    "masked_attention_one_mask": (masked_attention_for_tpu, (*FLASH_SPECS[:3], spec((1, 1, 200, 200), bool))),
    "grouped_matmul": (gmm_for_tpu, GMM_SPECS),
    "grouped_matmul_grad": (summed(gmm_for_tpu, (0, 1)), GMM_SPECS),
}


@pytest.mark.parametrize("fn, specs", LOWERINGS.values(), ids=LOWERINGS.keys())
def test_lowers_for_tpu(fn: Callable[..., Any], specs: tuple[jax.ShapeDtypeStruct, ...]) -> None:
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*specs)
    assert "tpu_custom_call" in exported.mlir_module()
