"""Factorisations and solvers on tpu against CPU: geqrf/ormqr and lstsq with each LAPACK driver."""

from __future__ import annotations

import pytest
import torch

from conftest import check_against_cpu

torch.manual_seed(0)
TALL, WIDE = torch.randn(2, 5, 3), torch.randn(4, 6)


@pytest.mark.parametrize("a", [TALL, WIDE], ids=["tall", "wide"])
def test_geqrf(a):
    check_against_cpu(torch.geqrf, a, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
def test_ormqr(left, transpose):
    reflectors, tau = torch.geqrf(torch.randn(5, 3))
    other = torch.randn(5, 2) if left else torch.randn(2, 5)
    check_against_cpu(lambda r, t, c: torch.ormqr(r, t, c, left=left, transpose=transpose), reflectors, tau, other,
                      atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("driver", ["gels", "gelsy", "gelsd", "gelss"])
@pytest.mark.parametrize("shape", [(3, 5, 3), (4, 3), (2, 4)], ids=["batched-tall", "tall", "wide"])
def test_lstsq(driver, shape):
    a, b = torch.randn(shape), torch.randn(shape[:-1] + (2,))
    check_against_cpu(lambda x, y: torch.linalg.lstsq(x, y, driver=driver), a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("driver", ["gelsy", "gelsd"])
def test_lstsq_rank_deficient(driver):
    """The minimum-norm solution and the numerical rank (residuals are left out: CPU omits them)."""
    a = torch.randn(5, 3)
    a[:, 2] = a[:, 1]
    b = torch.randn(5, 2)

    def solve(x, y):
        result = torch.linalg.lstsq(x, y, driver=driver)
        return result.solution, result.rank, result.singular_values

    check_against_cpu(solve, a, b, atol=1e-4, rtol=1e-4)


def _ldl_cases():
    """Symmetric indefinite matrices that take 1x1 and 2x2 pivots with and without interchanges."""
    general = torch.randn(6, 7, 7)
    zero_diagonal = torch.randn(7, 7)
    zero_diagonal.diagonal().zero_()  # forces 2x2 pivots
    singular = torch.randn(7, 3) @ torch.randn(3, 7)
    return torch.cat([general, zero_diagonal[None], (singular + singular.mT)[None], torch.zeros(1, 7, 7)])


def test_ldl_factor():
    a = _ldl_cases()
    ld, pivots, info = check_against_cpu(torch.linalg.ldl_factor_ex, a, atol=1e-4, rtol=1e-4)
    assert (pivots.cpu() < 0).any() and (info.cpu() > 0).any()  # both pivot kinds and a singular case ran


def test_ldl_solve():
    a = _ldl_cases()[:7]
    ld, pivots = torch.linalg.ldl_factor(a)
    check_against_cpu(torch.linalg.ldl_solve, ld, pivots, torch.randn(7, 7, 3), atol=1e-4, rtol=1e-4)
    check_against_cpu(torch.linalg.ldl_solve, ld[0], pivots[0], torch.randn(2, 7, 2), atol=1e-4, rtol=1e-4)


def _assert_same_eigenvalues(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The same eigenvalues, in any order: LAPACK builds (the CPU platform's, torch's) may order them differently."""
    assert actual.device.type == "tpu" and actual.dtype == expected.dtype
    distances = (actual.cpu()[..., :, None] - expected[..., None, :]).abs()
    assert distances.amin(-1).max() < 1e-4 and distances.amin(-2).max() < 1e-4


@pytest.mark.parametrize("seed", [0, 19])  # inputs where the phases (0) and the order (19) differ from torch CPU's
def test_eig(seed):
    """Complex eigenpairs of real matrices: torch's eigenvalues, and unit eigenvectors with A v = w v. Each
    vector is unique up to a phase only, which LAPACK builds choose differently (as CUDA's differs from CPU's)."""
    torch.manual_seed(seed)
    a = torch.randn(3, 5, 5)
    values, vectors = torch.linalg.eig(a.to("tpu"))
    _assert_same_eigenvalues(values, torch.linalg.eigvals(a))
    values, vectors = values.cpu(), vectors.cpu()
    torch.testing.assert_close(a.to(vectors.dtype) @ vectors, vectors * values[..., None, :], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.linalg.vector_norm(vectors, dim=-2), torch.ones(3, 5), atol=1e-5, rtol=0)
    b = torch.randn(4, 4)
    _assert_same_eigenvalues(torch.linalg.eigvals(b.to("tpu")), torch.linalg.eigvals(b))


@pytest.mark.parametrize("dtype, beta, alpha", [(torch.float32, 0.6, 0.2), (torch.bfloat16, 0.6, 0.2),
                                                (torch.int64, 2, 3), (torch.bool, True, True)])
def test_addr(dtype, beta, alpha):
    self, vec1, vec2 = (torch.randn(shape) * 4 for shape in ((5, 4), (5,), (4,)))
    self[0, 0] = float("nan")  # ignored when beta == 0
    args = [t.to(dtype) for t in (self.nan_to_num(), vec1, vec2)]
    check_against_cpu(lambda s, a, b: torch.addr(s, a, b, beta=beta, alpha=alpha), *args)
    check_against_cpu(lambda s, a, b: torch.addr(s, a, b, beta=0, alpha=alpha), self.to(dtype), *args[1:],
                      equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_rounds_like_cpu(dtype):
    check_against_cpu(lambda a, b: torch.linalg.cross(a, b, dim=1), torch.randn(50, 3, 4).to(dtype),
                      torch.randn(1, 3, 4).to(dtype), atol=0, rtol=0)
