"""Random sampling, from the per-device stream of :mod:`..random_state`.

Each op takes ``(seed, offset)`` from the device's stream and samples with the JAX key
``fold_in(key(seed), offset)``; both travel to the jitted sampler as traced values, so drawing
again never recompiles. A ``generator=`` argument (a CPU ``torch.Generator``; torch cannot create
tpu generators) supplies the seed instead: each op draws one 63-bit seed from it, so a seeded
generator reproduces the same samples and advances like any other generator use.
Half-precision samples are drawn in float32 and rounded, as torch's CPU kernels do.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes, random_state, runtime, storage
from ..dispatch import kernel


def key_parts(device_index: int, generator: torch.Generator | None = None):
    """A device array ``[seed, offset]`` for one random op (see :func:`key`)."""
    if generator is not None:
        seed, offset = int(torch.empty((), dtype=torch.int64).random_(generator=generator)), 0
    else:
        seed, offset = random_state.next_key_parts(device_index)
    return jax.device_put(np.array([seed, offset], np.uint64), runtime.device(device_index))


def key_parts_beside(tensor: torch.Tensor, generator: torch.Generator | None = None) -> tuple[int, Any]:
    """``tensor``'s chip index and :func:`key_parts` where a program may combine them with its array: on its chip,
    or replicated over its mesh for a sharded tensor."""
    buffer = storage.buffer_of(tensor)
    return buffer.device_index, storage.beside(buffer, key_parts(buffer.device_index, generator))


def key(parts):
    """The JAX key of ``key_parts`` (call inside jit); streams repeat after 2**32 ops per seed."""
    return jax.random.fold_in(jax.random.key(parts[0]), parts[1].astype(jnp.uint32))


def _sample_dtype(dtype):
    return jnp.dtype("float32") if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _fill(self: torch.Tensor, sampler, generator, *args) -> torch.Tensor:
    """Writes ``sampler(key_parts, shape, dtype, *args)`` into ``self``."""
    if self.numel():
        parts = key_parts_beside(self, generator)[1]
        storage.write(self, sampler(parts, tuple(self.shape), dtypes.to_jax(self.dtype), *args))
    return self


def _check_floating(self: torch.Tensor, name: str) -> None:
    if not self.is_floating_point():
        raise NotImplementedError(f'"{name}" not implemented for \'{self.dtype}\'')


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(parts, shape, dtype, mean, std):
    values = jax.random.normal(key(parts), shape, _sample_dtype(dtype))
    return (values * std + mean).astype(dtype)


@kernel("normal_")
def normal_(self, mean=0.0, std=1.0, generator=None):
    _check_floating(self, "normal_kernel_cpu")
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    return _fill(self, _normal, generator, mean, std)


@jax.jit
def _normal_around(parts, mean, std):
    dtype = dtypes.result_type(mean, std)
    values = jax.random.normal(key(parts), jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std)), _sample_dtype(dtype))
    return (values * std + mean).astype(dtype)


@kernel("normal.Tensor_float", "normal.float_Tensor", "normal.Tensor_Tensor")
def normal(mean, std=1.0, generator=None):
    """A new tensor of samples with elementwise (broadcast) means and standard deviations."""
    index, parts = key_parts_beside(mean if isinstance(mean, torch.Tensor) else std, generator)
    mean, std = (storage.read(v) if isinstance(v, torch.Tensor) else v for v in (mean, std))
    samples = _normal_around(parts, mean, std)
    return storage.wrap(samples, dtypes.to_torch(samples.dtype), index)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _uniform(parts, shape, dtype, low, high):
    values = jax.random.uniform(key(parts), shape, _sample_dtype(dtype))
    return (values * (high - low) + low).astype(dtype)


@kernel("uniform_")
def uniform_(self, from_=0.0, to=1.0, generator=None):
    _check_floating(self, "check_uniform_bounds")
    if from_ > to:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={from_} > to={to}")
    return _fill(self, _uniform, generator, from_, to)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _exponential(parts, shape, dtype, rate):
    return (jax.random.exponential(key(parts), shape, _sample_dtype(dtype)) / rate).astype(dtype)


@kernel("exponential_")
def exponential_(self, lambd=1.0, generator=None):
    _check_floating(self, "exponential_cpu")
    if lambd <= 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    return _fill(self, _exponential, generator, lambd)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _log_normal(parts, shape, dtype, mean, std):
    return jnp.exp(jax.random.normal(key(parts), shape, _sample_dtype(dtype)) * std + mean).astype(dtype)


@kernel("log_normal_")
def log_normal_(self, mean=1.0, std=2.0, generator=None):
    _check_floating(self, "log_normal_cpu")
    if std <= 0:
        raise RuntimeError(f"log_normal_ expects std > 0.0, but found std={std}")
    return _fill(self, _log_normal, generator, mean, std)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cauchy(parts, shape, dtype, median, sigma):
    return (jax.random.cauchy(key(parts), shape, _sample_dtype(dtype)) * sigma + median).astype(dtype)


@kernel("cauchy_")
def cauchy_(self, median=0.0, sigma=1.0, generator=None):
    if not self.is_floating_point():
        raise RuntimeError("Cauchy distribution is a continuous probability distribution. dtype must be a floating "
                           f"point but you specified {self.dtype}")
    if sigma <= 0:
        raise RuntimeError(f"cauchy_ expects sigma > 0.0, but found sigma={sigma}")
    return _fill(self, _cauchy, generator, median, sigma)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _geometric(parts, shape, dtype, p):
    """The number of Bernoulli(p) trials up to the first success, ``ceil(log(u) / log1p(-p))`` as CPU."""
    u = jax.random.uniform(key(parts), shape, jnp.float64 if dtype == jnp.float64 else jnp.float32,
                           minval=jnp.finfo(jnp.float32).tiny)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-p)).astype(dtype)


@kernel("geometric_")
def geometric_(self, p, generator=None):
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p}")
    return _fill(self, _geometric, generator, p)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _bernoulli(parts, shape, dtype, p):
    draws = jax.random.uniform(key(parts), shape, jnp.dtype("float32") if p.dtype != jnp.float64 else p.dtype)
    return (draws < jnp.broadcast_to(p, shape).astype(draws.dtype)).astype(dtype)


@kernel("bernoulli_.float")
def bernoulli_float_(self, p=0.5, generator=None):
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    return _fill(self, _bernoulli, generator, jnp.asarray(p, jnp.float32))


@kernel("bernoulli_.Tensor")
def bernoulli_tensor_(self, p, generator=None):
    return _fill(self, _bernoulli, generator, storage.read(p.to(self.device)))


@kernel("bernoulli")
def bernoulli(self, generator=None):
    """Samples each element with probability ``self[i]`` (a new tensor like ``self``)."""
    return bernoulli_tensor_(torch.empty_like(self), self, generator)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _integers(parts, shape, dtype, low, span):
    """Integers in ``[low, low + span)``; ``span == 0`` means all 2**64 values (uint64 wrap-around)."""
    bits = jax.random.bits(key(parts), shape, jnp.uint64)
    offsets = jnp.where(span == 0, bits, bits % jnp.maximum(span, np.uint64(1)))
    values = jax.lax.bitcast_convert_type(low + offsets, jnp.int64)
    return values.astype(dtype)


_MANTISSA_DIGITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def _inclusive_max(dtype: torch.dtype) -> int:
    if dtype.is_floating_point:
        return 2 ** _MANTISSA_DIGITS[dtype]
    if dtype == torch.bool:
        return 1
    return torch.iinfo(dtype).max


def _random(self, low, high, generator):
    """Fills ``self`` with integers in ``[low, high)``."""
    if low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    span = (high - low) % 2**64
    return _fill(self, _integers, generator, np.uint64(low % 2**64), np.uint64(span))


@kernel("random_")
def random_(self, generator=None):
    """Integers in ``[0, 2**digits]`` for floating dtypes (exact in the mantissa), ``[0, max]`` otherwise."""
    return _random(self, 0, _inclusive_max(self.dtype) + 1, generator)


@kernel("random_.from")
def random_from_(self, from_, to=None, generator=None):
    return _random(self, from_, _inclusive_max(self.dtype) + 1 if to is None else to, generator)


@kernel("random_.to")
def random_to_(self, to, generator=None):
    return _random(self, 0, to, generator)


@jax.jit
def _poisson(parts, rates):
    samples = jax.random.poisson(key(parts), rates.astype(_sample_dtype(rates.dtype)), rates.shape, jnp.int64)
    return samples.astype(rates.dtype)


@kernel("poisson")
def poisson(self, generator=None):
    index, parts = key_parts_beside(self, generator)
    return storage.wrap(_poisson(parts, storage.read(self)), self.dtype, index)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _multinomial(parts, probabilities, num_samples, replacement):
    logits = jnp.log(probabilities.astype(_sample_dtype(probabilities.dtype)))
    if replacement:
        samples = jax.random.categorical(key(parts), logits, shape=(num_samples,) + logits.shape[:-1])
        return jnp.moveaxis(samples, 0, -1).astype(jnp.int64)
    perturbed = logits + jax.random.gumbel(key(parts), logits.shape, logits.dtype)
    return jax.lax.top_k(perturbed, num_samples)[1].astype(jnp.int64)


@kernel("multinomial")
def multinomial(self, num_samples, replacement=False, generator=None):
    """Samples category indices; without replacement by the Gumbel top-k trick."""
    if self.dim() not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not replacement and num_samples > self.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    index, parts = key_parts_beside(self, generator)
    samples = _multinomial(parts, storage.read(self), num_samples, replacement)
    return storage.wrap(samples, torch.int64, index)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _permutation(parts, n, dtype):
    return jax.random.permutation(key(parts), n).astype(dtype)


@kernel("randperm.generator_out")
def randperm_out(n, generator=None, out=None):
    if tuple(out.shape) != (n,):
        out.resize_((n,))
    if n:
        storage.write(out, _permutation(key_parts_beside(out, generator)[1], n, dtypes.to_jax(out.dtype)))
    return out
