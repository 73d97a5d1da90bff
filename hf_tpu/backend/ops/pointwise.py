"""Elementwise ops, with PyTorch's type promotion (:func:`..dtypes.result_type`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..dtypes import result_type
from ..dispatch import lowering


def _float_result(*operands):
    dtype = result_type(*operands)
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.dtype("float32")


@lowering("add.Tensor", "add_.Tensor", "add.out", "add.Scalar", "add_.Scalar")
def add(self, other, alpha=1):
    dtype = result_type(self, other)
    other = other if isinstance(alpha, int) and alpha == 1 else other * alpha
    return jnp.add(self.astype(dtype), jnp.asarray(other).astype(dtype))


@lowering("sub.Tensor", "sub_.Tensor", "sub.out", "sub.Scalar", "sub_.Scalar")
def sub(self, other, alpha=1):
    dtype = result_type(self, other)
    other = other if isinstance(alpha, int) and alpha == 1 else other * alpha
    return jnp.subtract(self.astype(dtype), jnp.asarray(other).astype(dtype))


@lowering("mul.Tensor", "mul_.Tensor", "mul.out", "mul.Scalar", "mul_.Scalar")
def mul(self, other):
    dtype = result_type(self, other)
    return jnp.multiply(self.astype(dtype), jnp.asarray(other).astype(dtype))


@lowering("div.Tensor", "div_.Tensor", "div.out", "div.Scalar", "div_.Scalar")
def div(self, other):
    dtype = _float_result(self, other)
    return jnp.divide(self.astype(dtype), jnp.asarray(other).astype(dtype))


@lowering("abs", "abs_", "abs.out")
def abs_(self):
    return jnp.abs(self)


@lowering("neg", "neg_", "neg.out")
def neg(self):
    return lax.neg(self) if self.dtype != jnp.bool_ else ~self


@lowering("isfinite")
def isfinite(self):
    return jnp.isfinite(self) if jnp.issubdtype(self.dtype, jnp.inexact) else jnp.ones(self.shape, bool)


def _compare(fn):
    def compare(self, other):
        dtype = result_type(self, other)
        return fn(self.astype(dtype), jnp.asarray(other).astype(dtype))

    return compare


for _name, _fn in {"eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
                   "gt": jnp.greater, "ge": jnp.greater_equal}.items():
    lowering(f"{_name}.Tensor", f"{_name}.Scalar", f"{_name}_.Tensor", f"{_name}_.Scalar",
             f"{_name}.Tensor_out", f"{_name}.Scalar_out")(_compare(_fn))
