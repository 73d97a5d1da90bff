"""Reductions and scans on tpu against CPU: values, result dtypes, dims/keepdim, dtype=, out=."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_same, check_against_cpu

torch.manual_seed(0)
SHAPE = (4, 6)
X = torch.randn(SHAPE)
INTS = torch.randint(-4, 5, SHAPE)
B = torch.rand(SHAPE) > 0.5
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def sample(dtype: torch.dtype) -> torch.Tensor:
    return {torch.bool: B, torch.int64: INTS}.get(dtype, X).to(dtype)


SUMS = {
    "sum": torch.sum,
    "sum_dim": lambda t: t.sum(1),
    "sum_dims_keepdim": lambda t: t.sum((0, 1), keepdim=True),
    "sum_empty_dims": lambda t: t.sum(dim=[]),
    "sum_neg_dim": lambda t: t.sum(-2),
    "nansum": lambda t: torch.nansum(t, 0),
    "prod": torch.prod,
    "prod_dim": lambda t: t.prod(0, keepdim=True),
    "cumsum": lambda t: t.cumsum(1),
    "cumprod": lambda t: t.cumprod(0),
    "count_nonzero": torch.count_nonzero,
    "count_nonzero_dim": lambda t: torch.count_nonzero(t, dim=1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SUMS)
def test_sum_like(name, dtype):
    """Integer and bool inputs give int64; bfloat16 accumulates in float32 like torch."""
    tolerances = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}  # summation order differs
    check_against_cpu(SUMS[name], sample(dtype), **tolerances)


EXTREMES = {
    "amax": lambda t: t.amax(1),
    "amin": lambda t: t.amin((0, 1), keepdim=True),
    "max": torch.max,
    "min": torch.min,
    "max_dim": lambda t: t.max(1),
    "min_dim_keepdim": lambda t: t.min(0, keepdim=True),
    "argmax": torch.argmax,
    "argmin_dim": lambda t: t.argmin(1),
    "argmax_keepdim": lambda t: t.argmax(keepdim=True),
    "aminmax": torch.aminmax,
    "aminmax_dim": lambda t: torch.aminmax(t, dim=0, keepdim=True),
    "any": torch.any,
    "all_dim": lambda t: t.all(1),
    "any_dims": lambda t: t.any(dim=(0, 1)),
    "all_empty_dims": lambda t: t.all(dim=()),
}


@pytest.mark.parametrize(
    "name, dtype", [(n, d) for n in EXTREMES for d in DTYPES if not (n.startswith("arg") and d == torch.bool)], ids=str
)
def test_extremes_and_truth(name, dtype):
    check_against_cpu(EXTREMES[name], sample(dtype))


def test_argmax_of_bool_raises_like_torch():
    with pytest.raises(RuntimeError, match=r"argmax\(\): does not support bool input"):
        B.to("tpu").argmax()


def test_nan_and_ties():
    values = torch.tensor([[1.0, math.nan, 3.0, math.nan], [2.0, 2.0, -1.0, 2.0], [-math.inf, 0.0, math.inf, 5.0]])
    for fn in (torch.argmax, torch.max, lambda t: t.max(1), lambda t: t.min(1), lambda t: t.argmin(1),
               lambda t: t.amax(1), lambda t: t.any(1), lambda t: torch.logsumexp(t, 1)):
        check_against_cpu(fn, values, equal_nan=True)
    check_against_cpu(lambda t: t.all(1), values)
    check_against_cpu(lambda t: torch.any(t.to(torch.uint8)), values.nan_to_num())


def test_zero_dim_inputs():
    scalar = torch.tensor(2.5)
    for fn in (lambda t: t.sum(0), lambda t: t.max(0), lambda t: t.argmax(0), lambda t: t.cumsum(0), torch.amax,
               lambda t: t.mean(-1), torch.aminmax):
        check_against_cpu(fn, scalar)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mean_var_std(dtype):
    x = sample(dtype)
    check_against_cpu(torch.mean, x)
    check_against_cpu(lambda t: t.mean(1, keepdim=True), x)
    check_against_cpu(lambda t: t.mean((0, 1)), x)
    check_against_cpu(torch.var, x)
    check_against_cpu(lambda t: t.var(1, correction=0), x)
    check_against_cpu(lambda t: t.std(0, keepdim=True), x)
    check_against_cpu(lambda t: t.std(dim=[]), x)
    check_against_cpu(lambda t: torch.var_mean(t, 1), x)
    check_against_cpu(lambda t: torch.std_mean(t, (0, 1), correction=2, keepdim=True), x)


def test_var_with_too_large_correction_is_inf_or_nan():
    check_against_cpu(lambda t: t.var(0, correction=5), X, equal_nan=True)


def test_dtype_argument():
    check_against_cpu(lambda t: t.sum(dtype=torch.float32), INTS)
    check_against_cpu(lambda t: t.sum(1, dtype=torch.bfloat16), X)
    check_against_cpu(lambda t: t.mean(dtype=torch.float32), INTS)
    check_against_cpu(lambda t: t.prod(1, dtype=torch.float64), X)
    check_against_cpu(lambda t: t.cumsum(0, dtype=torch.int32), INTS)
    check_against_cpu(lambda t: t.sum(dtype=torch.int32), B)


def test_integer_mean_and_var_raise_like_torch():
    with pytest.raises(RuntimeError, match=r"mean\(\): could not infer output dtype.*Got: Long"):
        INTS.to("tpu").mean()
    with pytest.raises(RuntimeError, match="std and var only support floating point"):
        INTS.to("tpu").var()


def test_dim_out_of_range():
    with pytest.raises(IndexError, match="Dimension out of range"):
        X.to("tpu").sum(2)


@pytest.mark.parametrize("ord", [2, 1, 0, 3.5, math.inf, -math.inf])
def test_vector_norm(ord):
    check_against_cpu(lambda t: torch.linalg.vector_norm(t, ord), X)
    check_against_cpu(lambda t: torch.linalg.vector_norm(t, ord, dim=1, keepdim=True), X)


def test_norms():
    check_against_cpu(torch.norm, X)
    check_against_cpu(lambda t: torch.norm(t, p=1, dim=0), X)
    check_against_cpu(lambda t: torch.linalg.vector_norm(t, dtype=torch.float64), X)
    check_against_cpu(lambda t: torch.linalg.vector_norm(t.bfloat16(), dim=(0, 1)), X)
    check_against_cpu(lambda t: t.norm(2, 1), X)
    check_against_cpu(lambda t: torch.ops.aten.norm.ScalarOpt_dim_dtype(t, 3, [1], False, dtype=torch.float64), X)


def test_logsumexp():
    check_against_cpu(lambda t: torch.logsumexp(t, 1), X)
    check_against_cpu(lambda t: torch.logsumexp(t, (0, 1), keepdim=True), X)
    check_against_cpu(lambda t: torch.logsumexp(t, 0), INTS)
    check_against_cpu(lambda t: torch.logsumexp(t, 1), X.bfloat16())
    check_against_cpu(lambda t: torch.logsumexp(t, 0), torch.tensor([[-math.inf, 1.0], [-math.inf, 2.0]]))


def test_out_variants():
    def outs(fn):
        return lambda t: fn(t, torch.empty(0, dtype=t.dtype, device=t.device))

    check_against_cpu(outs(lambda t, o: torch.sum(t, 1, out=o)), X)
    check_against_cpu(outs(lambda t, o: torch.mean(t, 0, keepdim=True, out=o)), X)
    check_against_cpu(outs(lambda t, o: torch.amax(t, 1, out=o)), X)
    check_against_cpu(outs(lambda t, o: torch.cumsum(t, 1, out=o)), X)
    check_against_cpu(outs(lambda t, o: torch.logsumexp(t, 1, out=o)), X)
    check_against_cpu(outs(lambda t, o: torch.prod(t, 1, out=o)), X)
    check_against_cpu(outs(lambda t, o: torch.std(t, 1, out=o)), X)
    check_against_cpu(outs(lambda t, o: torch.linalg.vector_norm(t, 2, 1, out=o)), X)

    def max_out(t):
        values = torch.empty(0, device=t.device)
        indices = torch.empty(0, dtype=torch.int64, device=t.device)
        result = torch.max(t, 1, out=(values, indices))
        assert result[0] is values and result[1] is indices
        return values, indices

    check_against_cpu(max_out, X)
    check_against_cpu(lambda t: torch.argmax(t, 1, out=torch.empty(4, dtype=torch.int64, device=t.device)), X)
    check_against_cpu(lambda t: torch.any(t, 1, out=torch.empty(4, dtype=torch.bool, device=t.device)), X)


def test_inplace_cumsum_on_view():
    def run(t):
        t = t.clone()
        t[:, 1:].cumsum_(1)
        return t

    check_against_cpu(run, X)


def test_reductions_with_autograd():
    def grads(t):
        t = t.clone().requires_grad_(True)
        (t.sum(1) * t.mean(0).sum() + t.amax(1) + t.var(1) + torch.logsumexp(t, 1) + t.norm(dim=1)).sum().backward()
        return t.grad

    check_against_cpu(grads, X, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_hash_tensor(dtype):
    x = (torch.randn(3, 4) * 5).to(dtype)
    check_against_cpu(torch.hash_tensor, x)
    check_against_cpu(lambda t: torch.hash_tensor(t, 1, keepdim=True), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_trace(dtype):
    x = (torch.randn(4, 5) * 3).to(dtype)
    try:
        torch.trace(x)
    except NotImplementedError:  # torch 2.11's CPU has no bfloat16 trace: the sum in float32, rounded once
        assert_same(torch.trace(x.to("tpu")), torch.trace(x.float()).to(dtype))
        return
    check_against_cpu(torch.trace, x)


def test_logcumsumexp_rounds_as_cpu_on_large_values_and_keeps_infinities():
    """CPU accumulates float32 logcumsumexp in float64: the scan must not drift on large values (its gradient
    formula subtracts two such scans), and -inf, inf and NaN propagate as on CPU."""
    torch.manual_seed(0)
    large = torch.randn(4, 300) * 1e4
    special = torch.tensor([float("-inf"), float("-inf"), 1.0, float("inf"), 2.0, float("nan"), 3.0])
    for x in (large, special):
        check_against_cpu(lambda t: torch.logcumsumexp(t, -1), x, atol=0, rtol=0, equal_nan=True)
    x = large.requires_grad_()
    grad = torch.randn(4, 300)
    (cpu_grad,) = torch.autograd.grad(torch.logcumsumexp(x, -1), x, grad)
    tpu_x = x.detach().to("tpu").requires_grad_()
    (tpu_grad,) = torch.autograd.grad(torch.logcumsumexp(tpu_x, -1), tpu_x, grad.to("tpu"))
    torch.testing.assert_close(tpu_grad.cpu(), cpu_grad)
