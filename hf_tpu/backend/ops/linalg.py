"""Matrix products.

Half-precision inputs accumulate in float32 and are rounded once at the end, as on CUDA. float32
products run at full precision (``Precision.HIGHEST``), matching torch's default
``torch.get_float32_matmul_precision() == "highest"``; TPUs would otherwise use one bfloat16 pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .. import runtime
from ..dispatch import lowering
from ..dtypes import result_type


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


@lowering("mm", "mm.out", "bmm", "bmm.out", "mv", "mv.out", "dot", "dot.out")
def matmul(self, other):
    """mm, bmm, mv and dot: one product each, in the inputs' dtype (accumulated in float32 for halves)."""
    return _matmul(self, other).astype(self.dtype)


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


@lowering("addr", "addr_", "addr.out", static=("beta", "alpha"))
def addr(self, vec1, vec2, beta=1, alpha=1):
    """``beta * self + alpha * vec1 (x) vec2`` as CPU's kernel evaluates it: the scalars cast to the
    dtype, then each operation rounded in it (so bfloat16 matches); ``beta == 0`` ignores ``self``,
    NaN included; bool tensors use and/or."""
    dtype = result_type(self, vec1, vec2)
    if not jnp.issubdtype(dtype, jnp.inexact):
        for name, value in (("beta", beta), ("alpha", alpha)):
            if isinstance(value, float):
                raise RuntimeError(f"For integral input tensors, argument {name} must not be a floating point number.")
    self, column, row = self.astype(dtype), vec1.astype(dtype)[:, None], vec2.astype(dtype)[None, :]
    if dtype == jnp.bool_:
        product = column & row if alpha else jnp.zeros_like(column & row)
        return product if not beta else (self | product)
    product = jnp.asarray(alpha, dtype) * column * row
    return product if beta == 0 else jnp.asarray(beta, dtype) * self + product


@lowering("linalg_cross", "linalg_cross.out")
def cross(self, other, dim=-1):
    """The cross product along ``dim`` (size 3), each product and difference rounded in the dtype, as CPU."""
    dtype = result_type(self, other)
    shape = jnp.broadcast_shapes(self.shape, other.shape)
    a, b = jnp.broadcast_to(self, shape).astype(dtype), jnp.broadcast_to(other, shape).astype(dtype)
    axis = dim % len(shape)
    if shape[axis] != 3:
        raise RuntimeError(f"linalg.cross: inputs dimension {dim} must have length 3. Got {self.shape[axis]} and "
                           f"{other.shape[axis]}")
    nxt, last = np.array([1, 2, 0]), np.array([2, 0, 1])
    return (jnp.take(a, nxt, axis) * jnp.take(b, last, axis)) - (jnp.take(a, last, axis) * jnp.take(b, nxt, axis))


# --- decompositions and solvers -----------------------------------------------------------------
# jnp.linalg / lax.linalg run LAPACK on JAX's CPU platform and XLA's own algorithms on TPU; results
# whose sign or order is not unique (SVD, eigh vectors) follow the algorithm, as on CUDA.


def _batch_info(a):
    """The ``info`` output of the ``*_ex`` ops: zeros (success) per matrix, int32."""
    return jnp.zeros(a.shape[:-2], jnp.int32)


def _broadcast_batch(a, b):
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _adjoint(a):
    return jnp.conj(jnp.swapaxes(a, -1, -2))


def _hp(fn, *args, **kwargs):
    with jax.default_matmul_precision("highest"):
        return fn(*args, **kwargs)


@lowering("linalg_cholesky_ex", "linalg_cholesky_ex.L")
def cholesky_ex(self, upper=False, check_errors=False):
    if self.shape[-1] == 0:
        return self, _batch_info(self)
    lower = jnp.linalg.cholesky(self)
    failed = jnp.isnan(jnp.diagonal(lower, axis1=-2, axis2=-1))
    info = jnp.where(jnp.any(failed, axis=-1), jnp.argmax(failed, axis=-1) + 1, 0).astype(jnp.int32)
    lower = jnp.where(jnp.isnan(lower), jnp.zeros((), lower.dtype), lower)
    return (_adjoint(lower) if upper else lower), info


def cholesky(self, upper=False):
    return cholesky_ex(self, upper)[0]


if hasattr(torch.ops.aten, "cholesky"):  # torch 2.14 removed aten::cholesky (torch.cholesky raises there)
    lowering("cholesky", "cholesky.out")(cholesky)


@lowering("cholesky_inverse", "cholesky_inverse.out")
def cholesky_inverse(self, upper=False):
    factor = _adjoint(self) if upper else self  # lower: A = L L^H
    n = self.shape[-1]
    identity = jnp.broadcast_to(jnp.eye(n, dtype=self.dtype), self.shape)
    inverse_l = lax.linalg.triangular_solve(factor, identity, left_side=True, lower=True)
    return _hp(jnp.matmul, _adjoint(inverse_l), inverse_l)


@lowering("_cholesky_solve_helper", "_cholesky_solve_helper.out")
def cholesky_solve_helper(self, A, upper):
    factor = _adjoint(A) if upper else A
    y = lax.linalg.triangular_solve(factor, self, left_side=True, lower=True)
    return lax.linalg.triangular_solve(factor, y, left_side=True, lower=True, transpose_a=True, conjugate_a=True)


@lowering("linalg_inv_ex", "linalg_inv_ex.inverse")
def inv_ex(A, check_errors=False):
    return _hp(jnp.linalg.inv, A), _batch_info(A)


def _lu(A):
    """LU with partial pivoting: (LU, 1-based int32 pivots as LAPACK, permutation)."""
    lu, pivots, permutation = lax.linalg.lu(A)
    return lu, (pivots + 1).astype(jnp.int32), permutation


def _factored_for_det(A, contiguous):
    """The LU factors CPU's kernels save for det's backward: of ``A^T`` when ``A`` is real and
    contiguous (det(A^T) = det(A); the backward formula then solves without the adjoint), else of ``A``."""
    transposed = contiguous[0] and not jnp.iscomplexobj(A)
    return _lu(jnp.swapaxes(A, -1, -2) if transposed else A)


@lowering("_linalg_det", "_linalg_det.result", sees_layout=True)
def det(A, *, contiguous=(True,)):
    lu, pivots, _ = _factored_for_det(A, contiguous)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=jnp.int32), axis=-1)
    sign = jnp.where(swaps % 2 == 0, 1, -1).astype(A.dtype)
    return sign * jnp.prod(diagonal, axis=-1), lu, pivots


@lowering("_linalg_slogdet", "_linalg_slogdet.sign", sees_layout=True)
def slogdet(A, *, contiguous=(True,)):
    lu, pivots, _ = _factored_for_det(A, contiguous)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=jnp.int32), axis=-1)
    sign = jnp.where(swaps % 2 == 0, 1, -1).astype(A.dtype) * jnp.prod(jnp.sign(diagonal), axis=-1)
    return sign, jnp.sum(jnp.log(jnp.abs(diagonal)), axis=-1), lu, pivots


def _is_vector_rhs(A, B):
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])


@lowering("_linalg_solve_ex", "_linalg_solve_ex.result")
def solve_ex(A, B, left=True, check_errors=False):
    vector = _is_vector_rhs(A, B)
    rhs = B[..., None] if vector else B
    if not left:
        rhs = _adjoint(rhs) if not vector else rhs
    matrix = A if left else _adjoint(A)
    matrix, rhs = _broadcast_batch(matrix, rhs)
    lu, pivots, permutation = _lu(matrix)
    x = _lu_solve_with(lu, permutation, rhs)
    if not left and not vector:
        x = _adjoint(x)
    return (x[..., 0] if vector else x), lu, pivots, _batch_info(matrix)


def _lu_solve_with(lu, permutation, b):
    """Solves ``A x = b`` given ``A[permutation] = L U``."""
    permuted = jnp.take_along_axis(b, permutation[..., :, None].astype(jnp.int64), axis=-2)
    y = lax.linalg.triangular_solve(lu, permuted, left_side=True, lower=True, unit_diagonal=True)
    return lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)


def _permutation(pivots, m):
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


@lowering("linalg_lu_factor_ex", "linalg_lu_factor_ex.out")
def lu_factor_ex(A, pivot=True, check_errors=False):
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the tpu device")
    lu, pivots, _ = _lu(A)
    return lu, pivots, _batch_info(A)


def _unpack(lu, permutation, m, n):
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    # A[permutation] = L U, so A = P L U with P[permutation[i], i] = 1.
    p = jnp.swapaxes(jax.nn.one_hot(permutation, m, dtype=lu.dtype), -1, -2)
    return p, lower, upper


@lowering("linalg_lu", "linalg_lu.out")
def linalg_lu(A, pivot=True):
    if not pivot:
        raise RuntimeError("linalg.lu: LU without pivoting is not implemented on the tpu device")
    lu, _, permutation = _lu(A)
    return _unpack(lu, permutation, A.shape[-2], A.shape[-1])


@lowering("lu_unpack", "lu_unpack.out")
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m, n = LU_data.shape[-2:]
    permutation = _permutation(LU_pivots, m)
    p, lower, upper = _unpack(LU_data, permutation, m, n)
    empty = jnp.zeros((0,), LU_data.dtype)
    return (p if unpack_pivots else empty), (lower if unpack_data else empty), (upper if unpack_data else empty)


@lowering("linalg_lu_solve", "linalg_lu_solve.out")
def lu_solve(LU, pivots, B, left=True, adjoint=False):
    m = LU.shape[-1]
    permutation = _permutation(pivots, m)
    if not left:  # X A = B  <=>  A^H X^H = B^H
        return _adjoint(lu_solve(LU, pivots, _adjoint(B), True, not adjoint))
    LU, B = _broadcast_batch(LU, B)
    permutation = jnp.broadcast_to(permutation, B.shape[:-2] + (m,))
    if not adjoint:
        return _lu_solve_with(LU, permutation, B)
    # A^H X = B with A = P L U:  U^H L^H P^T X = B
    y = lax.linalg.triangular_solve(LU, B, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
    z = lax.linalg.triangular_solve(LU, y, left_side=True, lower=True, unit_diagonal=True, transpose_a=True,
                                    conjugate_a=True)
    inverse = jnp.argsort(permutation, axis=-1)
    return jnp.take_along_axis(z, inverse[..., :, None].astype(jnp.int64), axis=-2)


@lowering("linalg_solve_triangular", "linalg_solve_triangular.out")
def solve_triangular(self, B, upper, left=True, unitriangular=False):
    A, B = _broadcast_batch(self, B)
    return lax.linalg.triangular_solve(A, B, left_side=left, lower=not upper, unit_diagonal=unitriangular)


@lowering("triangular_solve", "triangular_solve.X")
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    A, b = _broadcast_batch(A, self)
    x = lax.linalg.triangular_solve(A, b, left_side=True, lower=not upper, transpose_a=transpose,
                                    unit_diagonal=unitriangular)
    return x, A


@lowering("_linalg_svd", "_linalg_svd.U")
def svd(A, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        empty = jnp.zeros((0,), A.dtype)
        return empty, jnp.linalg.svd(A, compute_uv=False), empty
    u, s, vh = jnp.linalg.svd(A, full_matrices=full_matrices)
    return u, s, vh


@lowering("_linalg_eigh", "_linalg_eigh.eigenvalues")
def eigh(A, UPLO="L", compute_v=True):
    values, vectors = jnp.linalg.eigh(A, UPLO=UPLO, symmetrize_input=False)
    return values, (vectors if compute_v else jnp.zeros((0,), A.dtype))


@lowering("linalg_qr", "linalg_qr.out")
def qr(A, mode="reduced"):
    if mode == "r":
        return jnp.zeros((0,), A.dtype), jnp.linalg.qr(A, mode="r")
    return jnp.linalg.qr(A, mode="complete" if mode == "complete" else "reduced")


@lowering("linalg_householder_product", "linalg_householder_product.out")
def householder_product(input, tau):
    """``H_1 ... H_k`` (first n columns), ``H_i = I - tau_i v_i v_i^H`` with ``v_i`` below the diagonal."""
    m, n = input.shape[-2:]
    q = jnp.broadcast_to(jnp.eye(m, n, dtype=input.dtype), input.shape)
    rows = jnp.arange(m)
    for i in reversed(range(tau.shape[-1])):
        v = jnp.where(rows == i, jnp.ones((), input.dtype), jnp.where(rows > i, input[..., :, i], 0))
        projection = _hp(jnp.einsum, "...m,...mn->...n", jnp.conj(v), q)
        q = q - tau[..., i, None, None] * v[..., :, None] * projection[..., None, :]
    return q


@lowering("linalg_matrix_exp", "linalg_matrix_exp.out")
def matrix_exp(self):
    compute = _accumulator(self.dtype)
    flat = self.astype(compute).reshape((-1,) + self.shape[-2:])
    return _hp(jax.vmap(jax.scipy.linalg.expm), flat).reshape(self.shape).astype(self.dtype)


def _p_norm(diff, p):
    """The ``p``-norm over the last dim of ``diff`` (p = 0 counts nonzeros; p = inf is the max)."""
    if p == 0:
        return jnp.sum(diff != 0, axis=-1).astype(diff.dtype)
    if p == float("inf"):
        return jnp.max(diff, axis=-1, initial=0).astype(diff.dtype)
    if p == 1:
        return jnp.sum(diff, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    return jnp.sum(diff ** p, axis=-1) ** (1 / p)


@lowering("_cdist_forward", "_cdist_forward.out")
def cdist(x1, x2, p, compute_mode=None):
    """``p``-norm distances between the rows of ``x1`` (..., P, M) and ``x2`` (..., R, M)."""
    return _p_norm(jnp.abs(x1[..., :, None, :] - x2[..., None, :, :]), p)


@lowering("_pdist_forward", "_pdist_forward.out")
def pdist(self, p=2.0):
    """``p``-norm distances between the rows ``i < j`` of ``self`` (N, M), in row-major pair order."""
    first, second = np.triu_indices(self.shape[0], 1)
    return _p_norm(jnp.abs(self[first] - self[second]), p)


@lowering("geqrf", "geqrf.a")
def geqrf(self):
    """LAPACK's compact QR: R on and above the diagonal, the Householder vectors below it, and their taus."""
    h, tau = jnp.linalg.qr(self, mode="raw")
    return jnp.swapaxes(h, -1, -2), tau


@lowering("ormqr", "ormqr.out")
def ormqr(self, input2, input3, left=True, transpose=False):
    """``Q @ C`` (``C @ Q`` if not ``left``; ``Q^H`` if ``transpose``), Q given by ``geqrf``'s reflectors."""
    return _hp(lax.linalg.ormqr, self, input2, input3, left=left, transpose=transpose)


_LSTSQ_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


@lowering("linalg_lstsq.out")
def lstsq(self, b, rcond=None, driver=None):
    """Least-squares solutions of ``self @ X = b``, as CPU's LAPACK drivers report them.

    Every driver gives the minimum-norm solution over the singular values above ``rcond * max``
    (default ``rcond``: eps * max(m, n)), which is LAPACK's answer for full-rank matrices (``gels``
    assumes full rank; on rank-deficient ones its answer is ill-defined). ``rank`` comes
    with the rank-revealing drivers (gelsy, gelsd, gelss), ``singular_values`` with gelsd and gelss,
    and ``residuals`` (squared column norms of ``self @ X - b``) when m > n and the driver is not
    gelsy. Unlike CPU, which leaves them empty when a matrix is rank-deficient, residuals are
    returned whenever m > n.
    """
    driver = driver or "gelsy"
    if driver not in _LSTSQ_DRIVERS:
        raise RuntimeError(f"torch.linalg.lstsq: parameter `driver` should be one of {_LSTSQ_DRIVERS}")
    m, n = self.shape[-2:]
    vector = b.ndim == self.ndim - 1
    rhs = b[..., None] if vector else b
    a, rhs = _broadcast_batch(self, rhs)
    u, s, vh = _hp(jnp.linalg.svd, a, full_matrices=False)
    cutoff = (jnp.finfo(a.dtype).eps * max(m, n) if rcond is None or rcond < 0 else rcond) * s[..., :1]
    kept = s > cutoff
    inverse_s = jnp.where(kept, 1 / jnp.where(kept, s, 1), 0)
    solution = _hp(jnp.matmul, _adjoint(vh), inverse_s[..., :, None] * _hp(jnp.matmul, _adjoint(u), rhs))
    rank = jnp.sum(kept, axis=-1).astype(jnp.int64)
    residuals = jnp.zeros((0,), s.dtype)
    if m > n and driver != "gelsy":
        residuals = jnp.sum(jnp.abs(_hp(jnp.matmul, a, solution) - rhs) ** 2, axis=-2)
        residuals = residuals[..., 0] if vector else residuals
    empty_rank = jnp.zeros((0,), jnp.int64)
    return ((solution[..., 0] if vector else solution), residuals,
            (empty_rank if driver == "gels" else rank),
            (s if driver in ("gelsd", "gelss") else jnp.zeros((0,), s.dtype)))


@lowering("linalg_eig", "linalg_eig.out")
def eig(self):
    """Eigenvalues and right eigenvectors (unit norm, LAPACK ``geev``'s order and phases), complex.

    XLA has a non-symmetric eigensolver on CPU (LAPACK) and GPU only; on TPU chips this raises.
    """
    if runtime.backing_platform() == "tpu":
        raise NotImplementedError("aten::linalg_eig has no lowering on TPU chips: XLA has no non-symmetric "
                                  "eigendecomposition there; call it on a CPU copy of the tensor")
    values, vectors = jnp.linalg.eig(self)
    return values, vectors


@lowering("_linalg_eigvals", "linalg_eigvals.out")
def eigvals(self):
    return eig(self)[0]
