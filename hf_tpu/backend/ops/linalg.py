"""Matrix products.

Half-precision inputs accumulate in float32 and are rounded once at the end, as on CUDA. float32
products run at full precision (``Precision.HIGHEST``), matching torch's default
``torch.get_float32_matmul_precision() == "highest"``; TPUs would otherwise use one bfloat16 pass.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..dispatch import lowering


def _check_same_dtype(first, second):
    if first.dtype != second.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {first.dtype} != {second.dtype}")


def _accumulator(dtype):
    if dtype in (jnp.bfloat16, jnp.float16):
        return jnp.dtype("float32")
    return dtype


def _matmul(a, b):
    _check_same_dtype(a, b)
    precision = lax.Precision.HIGHEST if jnp.issubdtype(a.dtype, jnp.inexact) else None
    return jnp.matmul(a, b, precision=precision, preferred_element_type=_accumulator(a.dtype))


def _scaled_sum(self, product, beta, alpha, dtype):
    """``beta * self + alpha * product``, where ``beta == 0`` ignores ``self`` (NaNs included)."""
    result = product if alpha == 1 else product * alpha
    if beta != 0:
        result = result + (self.astype(result.dtype) if beta == 1 else self.astype(result.dtype) * beta)
    return result.astype(dtype)


@lowering("mm", "mm.out")
def mm(self, mat2):
    return _matmul(self, mat2).astype(self.dtype)


@lowering("bmm", "bmm.out")
def bmm(self, mat2):
    return _matmul(self, mat2).astype(self.dtype)


@lowering("mv", "mv.out")
def mv(self, vec):
    return _matmul(self, vec).astype(self.dtype)


@lowering("dot", "dot.out")
def dot(self, tensor):
    return _matmul(self, tensor).astype(self.dtype)


@lowering("vdot", "vdot.out")
def vdot(self, other):
    return _matmul(jnp.conj(self), other).astype(self.dtype)


@lowering("addmm", "addmm_", "addmm.out", static=("beta", "alpha"))
def addmm(self, mat1, mat2, beta=1, alpha=1):
    return _scaled_sum(self, _matmul(mat1, mat2), beta, alpha, mat1.dtype)


@lowering("addmv", "addmv_", "addmv.out", static=("beta", "alpha"))
def addmv(self, mat, vec, beta=1, alpha=1):
    return _scaled_sum(self, _matmul(mat, vec), beta, alpha, mat.dtype)


@lowering("baddbmm", "baddbmm_", "baddbmm.out", static=("beta", "alpha"))
def baddbmm(self, batch1, batch2, beta=1, alpha=1):
    return _scaled_sum(self, _matmul(batch1, batch2), beta, alpha, batch1.dtype)


@lowering("addbmm", "addbmm_", "addbmm.out", static=("beta", "alpha"))
def addbmm(self, batch1, batch2, beta=1, alpha=1):
    product = _matmul(batch1, batch2).sum(axis=0)
    return _scaled_sum(self, product, beta, alpha, batch1.dtype)
