"""LDL^T factorisation of symmetric matrices with Bunch-Kaufman pivoting, and solves with it.

``linalg_ldl_factor_ex`` follows LAPACK's ``sytf2`` (lower triangle), which CPU calls for the
matrices it sees, pivot for pivot, so the compact result is the same: ``L`` below the diagonal,
the 1x1 and 2x2 blocks of ``D`` on it (and on the first subdiagonal), and LAPACK's 1-based
``pivots`` (negative for both rows of a 2x2 block). Each step interchanges rows and columns of the
trailing matrix only, so ``A = P1 L1 P2 L2 ... D ... L2^T P2^T L1^T P1^T``. ``linalg_ldl_solve``
follows ``sytrs``. Real inputs only; the loop over pivots is a ``lax.while_loop`` per matrix.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..dispatch import lowering

_ALPHA = (1 + math.sqrt(17)) / 8  # Bunch-Kaufman's pivot threshold


def _check_real(a, name):
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        raise NotImplementedError(f"{name}: complex inputs are not implemented on the tpu device")


def _swap(w, k, first, second):
    """Interchanges rows and columns ``first`` and ``second`` of the trailing block ``w[k:, k:]``."""
    n = w.shape[0]
    index = jnp.arange(n)
    order = jnp.where(index == first, second, jnp.where(index == second, first, index))
    trailing = (index[:, None] >= k) & (index[None, :] >= k)
    return jnp.where(trailing, w[order][:, order], w)


def _factor_one(a):
    """``sytf2`` with uplo = 'L' on one (n, n) matrix: (LD, pivots, info)."""
    n = a.shape[0]
    index = jnp.arange(n)
    below_diagonal = index[:, None] >= index[None, :]
    w = jnp.where(below_diagonal, a, a.T)  # the lower triangle, mirrored

    def step(state):
        w, pivots, k, info = state
        column = jnp.abs(w[:, k])
        absakk = column[k]
        below = jnp.where(index > k, column, -1)
        imax = jnp.argmax(below)
        colmax = jnp.where(k < n - 1, column[imax], 0)
        singular = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        # The largest off-diagonal magnitude in row/column imax of the trailing block.
        row = jnp.abs(w[imax])
        rowmax = jnp.max(jnp.where((index >= k) & (index != imax), row, 0))
        keep = (absakk >= _ALPHA * colmax) | (absakk >= _ALPHA * colmax * (colmax / rowmax))
        one_by_one = singular | keep | (jnp.abs(w[imax, imax]) >= _ALPHA * rowmax)
        two_by_two = ~one_by_one
        kp = jnp.where(singular | keep, k, imax)
        kstep = jnp.where(two_by_two, 2, 1)
        swapped = _swap(w, k, k + kstep - 1, kp)

        x = jnp.where(index > k, swapped[:, k], 0)
        d11 = 1 / swapped[k, k]
        rank_one = swapped + x[:, None] * (-d11 * x)[None, :]
        rank_one = rank_one.at[:, k].set(jnp.where(index > k, x * d11, swapped[:, k]))

        k1 = jnp.minimum(k + 1, n - 1)
        d21 = swapped[k1, k]
        e11, e22 = swapped[k1, k1] / d21, swapped[k, k] / d21
        d21 = 1 / (e11 * e22 - 1) / d21
        rows = index > k + 1
        a_k, a_k1 = jnp.where(rows, swapped[:, k], 0), jnp.where(rows, swapped[:, k1], 0)
        wk, wkp1 = d21 * (e11 * a_k - a_k1), d21 * (e22 * a_k1 - a_k)
        rank_two = swapped - (a_k[:, None] * wk[None, :] + a_k1[:, None] * wkp1[None, :])
        rank_two = rank_two.at[:, k].set(jnp.where(rows, wk, swapped[:, k]))
        rank_two = rank_two.at[:, k1].set(jnp.where(rows, wkp1, swapped[:, k1]))

        updated = jnp.where(singular, swapped, jnp.where(two_by_two, rank_two, rank_one))
        updated = jnp.where(below_diagonal, updated, updated.T)
        pivot = jnp.where(two_by_two, -(kp + 1), kp + 1).astype(jnp.int32)
        pivots = pivots.at[k].set(pivot)
        pivots = jnp.where(two_by_two & (index == k + 1), pivot, pivots)
        info = jnp.where((info == 0) & singular, k + 1, info).astype(jnp.int32)
        return updated, pivots, k + kstep, info

    state = (w, jnp.zeros((n,), jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    w, pivots, _, info = lax.while_loop(lambda s: s[2] < n, step, state)
    return jnp.tril(w), pivots, info


@lowering("linalg_ldl_factor_ex", "linalg_ldl_factor_ex.out")
def ldl_factor_ex(self, hermitian=False, check_errors=False):
    _check_real(self, "linalg.ldl_factor")
    if self.size == 0:
        return self, jnp.zeros(self.shape[:-1], jnp.int32), jnp.zeros(self.shape[:-2], jnp.int32)
    batch, n = self.shape[:-2], self.shape[-1]
    ld, pivots, info = jax.vmap(_factor_one)(self.reshape(-1, n, n))
    return ld.reshape(self.shape), pivots.reshape(batch + (n,)), info.reshape(batch)


def _solve_one(ld, pivots, b):
    """``sytrs`` with uplo = 'L': solves ``A X = B`` from ``sytf2``'s factorisation."""
    n = ld.shape[0]
    index = jnp.arange(n)

    def swap_rows(b, first, second):
        order = jnp.where(index == first, second, jnp.where(index == second, first, index))
        return b[order]

    def forward(state):  # L D Y = P^T B, one pivot block at a time
        b, k = state
        pivot = pivots[k]
        single = pivot > 0
        k1 = jnp.minimum(k + 1, n - 1)
        b = swap_rows(b, jnp.where(single, k, k1), jnp.abs(pivot) - 1)
        first = jnp.where((index > k)[:, None], ld[:, k, None] * b[k][None, :], 0)
        second = jnp.where((index > k + 1)[:, None], ld[:, k1, None] * b[k1][None, :], 0)
        one = (b - first).at[k].multiply(1 / ld[k, k])
        two = b - jnp.where((index > k + 1)[:, None], first, 0) - second
        akm1k = ld[k1, k]
        akm1, ak = ld[k, k] / akm1k, ld[k1, k1] / akm1k
        denominator = akm1 * ak - 1
        bkm1, bk = two[k] / akm1k, two[k1] / akm1k
        two = two.at[k].set((ak * bkm1 - bk) / denominator).at[k1].set((akm1 * bk - bkm1) / denominator)
        return jnp.where(single, one, two), k + jnp.where(single, 1, 2)

    def backward(state):  # L^T P^T X = Y, from the last block up
        b, k = state
        pivot = pivots[k]
        single = pivot > 0
        rows = (index > k)[:, None]
        b = b.at[k].add(-jnp.sum(jnp.where(rows, ld[:, k, None] * b, 0), axis=0))
        km1 = jnp.maximum(k - 1, 0)
        b = jnp.where(single, b, b.at[km1].add(-jnp.sum(jnp.where(rows, ld[:, km1, None] * b, 0), axis=0)))
        b = swap_rows(b, k, jnp.abs(pivot) - 1)
        return b, k - jnp.where(single, 1, 2)

    b, _ = lax.while_loop(lambda s: s[1] < n, forward, (b, jnp.zeros((), jnp.int32)))
    b, _ = lax.while_loop(lambda s: s[1] >= 0, backward, (b, jnp.asarray(n - 1, jnp.int32)))
    return b


@lowering("linalg_ldl_solve", "linalg_ldl_solve.out")
def ldl_solve(LD, pivots, B, hermitian=False):
    _check_real(LD, "linalg.ldl_solve")
    batch = jnp.broadcast_shapes(LD.shape[:-2], pivots.shape[:-1], B.shape[:-2])
    shape = batch + B.shape[-2:]
    if LD.shape[-1] == 0 or math.prod(shape) == 0:
        return jnp.zeros(shape, B.dtype)
    n = LD.shape[-1]
    flat = jax.vmap(_solve_one)(jnp.broadcast_to(LD, batch + (n, n)).reshape(-1, n, n),
                                jnp.broadcast_to(pivots, batch + (n,)).reshape(-1, n),
                                jnp.broadcast_to(B, shape).reshape((-1,) + B.shape[-2:]))
    return flat.reshape(shape)
