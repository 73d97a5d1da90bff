"""Grouped matrix products for mixture-of-experts layers: ``aten::_grouped_mm`` as XLA's ragged dot.

``offs`` holds the cumulative end of each group along the grouped dimension (int32, as torch and
transformers build it). Rows (or columns) past ``offs[-1]`` belong to no group; CPU and CUDA leave them
uninitialized, here they are zero. Half-precision inputs accumulate in float32, as in ``mm``.

The experts' form (2-D tokens x 3-D expert weights) runs on the Pallas grouped matmul (megablox
``gmm``) where Pallas kernels are used (TPU chips, see :func:`~hf_tpu.backend.runtime.pallas_kernels`):
it streams each expert's weights once for the rows routed to it, while XLA's TPU lowering of the
ragged dot is one masked dense product per group.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import runtime
from ..dispatch import lowering
from .linalg import _accumulator


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.issubdtype(dtype, jnp.inexact) else None


def _group_sizes(offs):
    """Cumulative group ends -> group sizes (int32, as ``ragged_dot`` wants them)."""
    ends = offs.astype(jnp.int32)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def _ragged(lhs, rhs, offs, lhs_ragged: int, rhs_group: tuple, contracting: tuple):
    """One ``ragged_dot_general`` with no batch dimensions, at the inputs' precision."""
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contracting, ((), ())),
        lhs_ragged_dimensions=(lhs_ragged,),
        rhs_group_dimensions=rhs_group,
    )
    return lax.ragged_dot_general(
        lhs, rhs, _group_sizes(offs), numbers, precision=_precision(lhs.dtype),
        preferred_element_type=_accumulator(lhs.dtype),
    )


def _rows_by_group(self, mat2, offs):
    """2-D ``[M, K]`` x 3-D ``[G, K, N]``: the Pallas grouped matmul where Pallas kernels are used, else the ragged
    dot. Its gradients are other ``_grouped_mm`` forms and take the same choice where they have it."""
    if runtime.pallas_kernels() and self.dtype in (jnp.float32, jnp.bfloat16):
        from ...kernels import pallas

        return pallas.grouped_matmul(self, mat2, _group_sizes(offs))
    return _ragged(self, mat2, offs, lhs_ragged=0, rhs_group=(0,), contracting=((1,), (1,)))


def _column_groups(self, mat2, offs):
    """3-D ``[G, M, K]`` x 2-D ``[K, N]`` with the columns of ``mat2`` grouped: one masked contraction over
    (group, K). Written densely because the ragged form needs a transposed result, which XLA's CPU
    dot rejects for bfloat16; a rare form (MoE experts use 2-D x 3-D, and 2-D x 2-D in their backward)."""
    column = jnp.arange(mat2.shape[1])
    ends = offs.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    mask = (column >= starts[:, None]) & (column < ends[:, None])  # [G, N]
    grouped = jnp.where(mask[:, None, :], mat2[None], jnp.zeros((), mat2.dtype))  # [G, K, N]
    return jnp.einsum(
        "gmk,gkn->mn", self, grouped, precision=_precision(self.dtype), preferred_element_type=_accumulator(self.dtype)
    )


def _check(self, mat2, offs, bias, out_dtype) -> None:
    if self.dtype != mat2.dtype:
        raise RuntimeError(f"Expected mat_a and mat_b to have the same dtype, but got {self.dtype} and {mat2.dtype}")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if out_dtype is not None and jnp.dtype(out_dtype) != self.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if self.ndim not in (2, 3) or mat2.ndim not in (2, 3):
        raise RuntimeError(f"_grouped_mm takes 2-D or 3-D matrices, got {self.ndim}-D and {mat2.ndim}-D")
    if (self.ndim == 2 or mat2.ndim == 2) != (offs is not None):
        raise RuntimeError("_grouped_mm needs offs when either matrix is 2-D, and takes none for two 3-D matrices")


@lowering("_grouped_mm", calls_kernels=True)
def grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    """Groups of matrix products, by the inputs' ranks:

    - 2-D ``[M, K]`` x 3-D ``[G, K, N]``: rows of ``self`` in group g times ``mat2[g]`` -> ``[M, N]``;
    - 2-D ``[M, K]`` x 2-D ``[K, N]``: the contraction split into groups along K -> ``[G, M, N]``;
    - 3-D ``[G, M, K]`` x 2-D ``[K, N]``: columns of ``mat2`` in group g times ``self[g]`` -> ``[M, N]``;
    - 3-D ``[G, M, K]`` x 3-D ``[G, K, N]`` (no ``offs``): a batched product -> ``[G, M, N]``.
    """
    _check(self, mat2, offs, bias, out_dtype)
    if self.ndim == 3 and mat2.ndim == 3:
        accumulator = _accumulator(self.dtype)
        result = jnp.matmul(self, mat2, precision=_precision(self.dtype), preferred_element_type=accumulator)
    elif self.ndim == 2 and mat2.ndim == 3:
        result = _rows_by_group(self, mat2, offs)
    elif self.ndim == 2:
        result = _ragged(self, mat2, offs, lhs_ragged=1, rhs_group=(), contracting=((1,), (0,)))
    else:
        result = _column_groups(self, mat2, offs)
    return result.astype(self.dtype)
