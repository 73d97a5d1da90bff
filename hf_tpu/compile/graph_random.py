"""Graph-mode lowerings of random operators, with the RNG state threaded through the program.

Eager mode gives each random op its own ``(seed, offset)`` from the device's stream
(:mod:`..backend.random_state`). A compiled graph takes one such pair per random node, drawn from
the same stream when the graph runs and passed to the program as an input array, so
``torch.manual_seed`` makes compiled sampling reproducible, consecutive runs draw fresh numbers
without recompiling, and a graph draws exactly what the same ops would draw in eager mode.

Each function takes the node's ``parts`` (a ``[seed, offset]`` array), the JAX dtype of its
(first) result, then its ATen schema's inputs; ``generator=`` is not supported in graph mode
(Dynamo does not put generators into graphs).
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import torch

from ..backend.ops import nn, random
from .graph_ops import registrar

RANDOM_LOWERINGS: dict[torch._ops.OpOverload, Callable[..., Any]] = {}
random_lowering = registrar(RANDOM_LOWERINGS)


@random_lowering("rand")
def rand(parts, dtype, size, *unused):
    return random._uniform(parts, tuple(size), dtype, 0.0, 1.0)


@random_lowering("rand_like")
def rand_like(parts, dtype, self, *unused):
    return random._uniform(parts, self.shape, dtype, 0.0, 1.0)


@random_lowering("randn")
def randn(parts, dtype, size, *unused):
    return random._normal(parts, tuple(size), dtype, 0.0, 1.0)


@random_lowering("randn_like")
def randn_like(parts, dtype, self, *unused):
    return random._normal(parts, self.shape, dtype, 0.0, 1.0)


@random_lowering("uniform")
def uniform(parts, dtype, self, low=0.0, high=1.0, generator=None):
    return random._uniform(parts, self.shape, dtype, low, high)


@random_lowering("normal_functional")
def normal(parts, dtype, self, mean=0.0, std=1.0, generator=None):
    return random._normal(parts, self.shape, dtype, mean, std)


@random_lowering("exponential")
def exponential(parts, dtype, self, rate=1.0, generator=None):
    return random._exponential(parts, self.shape, dtype, rate)


def _integers(parts, dtype, shape, low, high):
    return random._integers(parts, tuple(shape), dtype, np.uint64(low % 2**64), np.uint64((high - low) % 2**64))


@random_lowering("randint")
def randint(parts, dtype, high, size, *unused):
    return _integers(parts, dtype, size, 0, high)


@random_lowering("randint.low")
def randint_low(parts, dtype, low, high, size, *unused):
    return _integers(parts, dtype, size, low, high)


@random_lowering("randint_like")
def randint_like(parts, dtype, self, high, *unused):
    return _integers(parts, dtype, self.shape, 0, high)


@random_lowering("randint_like.low_dtype")
def randint_like_low(parts, dtype, self, low, high, *unused):
    return _integers(parts, dtype, self.shape, low, high)


@random_lowering("bernoulli")
def bernoulli(parts, dtype, self, generator=None):
    return random._bernoulli(parts, self.shape, dtype, self)


@random_lowering("bernoulli.Tensor")
def bernoulli_tensor(parts, dtype, self, p, generator=None):
    return random._bernoulli(parts, self.shape, dtype, p)


@random_lowering("bernoulli.p")
def bernoulli_p(parts, dtype, self, p=0.5, generator=None):
    return random._bernoulli(parts, self.shape, dtype, jnp.asarray(p, jnp.float32))


@random_lowering("native_dropout")
def native_dropout(parts, dtype, input, p, train):
    if train is False:
        return input, jnp.ones(input.shape, jnp.bool_)
    return nn._dropout(parts, input, 1.0 - p)


@random_lowering("multinomial")
def multinomial(parts, dtype, self, num_samples, replacement=False, generator=None):
    return random._multinomial(parts, self, num_samples, replacement)


@random_lowering("randperm")
def randperm(parts, dtype, n, *unused):
    return random._permutation(parts, n, dtype)
