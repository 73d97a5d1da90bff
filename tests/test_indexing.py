"""Joining, indexing, scattering, sorting, padding and factories on tpu against CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same, check_against_cpu, to_tpu

torch.manual_seed(0)
A = torch.randn(4, 6)
B = torch.randn(3, 4, 6)
ROWS = torch.tensor([2, 0, 3, 0])
MASK = A > 0


def test_cat_and_stack():
    check_against_cpu(lambda a, b: torch.cat([a, b], dim=0), A, A * 2)
    check_against_cpu(lambda a, b: torch.cat([a, b.int()], dim=-1), A, A)
    check_against_cpu(lambda a, e: torch.cat([a, e]), A, torch.empty(0))
    check_against_cpu(lambda a, b: torch.stack([a, b], dim=1), A, A + 1)


def test_cat_backward():
    def fn(a, b):
        out = torch.cat([a, b], dim=1)
        out.pow(2).sum().backward()
        return out, a.grad, b.grad

    check_against_cpu(fn, A.clone().requires_grad_(), A[:, :2].clone().requires_grad_())


@pytest.mark.parametrize(
    "key",
    [
        lambda: (ROWS,),
        lambda: (slice(None), torch.tensor([5, -1])),
        lambda: (ROWS, torch.tensor([0, 1, 2, 3])),
        lambda: (MASK,),
        lambda: (MASK[:, 0],),
        lambda: (Ellipsis, torch.tensor([True, False, True, False, False, True])),
        lambda: (torch.tensor(1),),
        lambda: (None, ROWS, None),
    ],
)
def test_index(key):
    key = key()
    check_against_cpu(lambda a, *k: a[k], A, *key)


def test_index_3d_mixed():
    check_against_cpu(lambda b, i, j: b[i, :, j], B, torch.tensor([[0, 2]]), torch.tensor([[1], [5]]))
    check_against_cpu(lambda b, m: b[:, m], B, torch.tensor([True, False, False, True]))


def test_index_with_cpu_indices():
    assert_same(A.to("tpu")[ROWS], A[ROWS])


def test_index_mask_shape_mismatch():
    with pytest.raises(IndexError, match="does not match the shape"):
        A.to("tpu")[torch.tensor([True, False], device="tpu")]


def test_index_backward():
    def fn(a, rows):
        out = a[rows] * 3
        out.sum().backward()
        return out, a.grad

    check_against_cpu(fn, A.clone().requires_grad_(), ROWS)
    check_against_cpu(fn, A.clone().requires_grad_(), MASK)


def _set(a, key, value, accumulate=False):
    a = a.clone()
    a.index_put_(key, value, accumulate=accumulate)
    return a


def test_index_put():
    check_against_cpu(lambda a, i, v: _set(a, (i,), v), A, torch.tensor([1, 3]), torch.randn(2, 6))
    check_against_cpu(lambda a, i, v: _set(a, (i,), v, True), A, ROWS, torch.randn(4, 6))
    check_against_cpu(lambda a, m, v: _set(a, (m,), v), A, MASK, torch.tensor(7.0))
    check_against_cpu(lambda a, m, v: _set(a, (m,), v), A, MASK, torch.arange(int(MASK.sum()), dtype=torch.float32))
    check_against_cpu(lambda a, m, v: _set(a, (m,), v, True), A, MASK, torch.tensor(1.0))


def test_setitem_mask_after_slice():
    def fn(b, m):
        b = b.clone()
        b[:, m] = -1.0
        b[1:, m] = torch.arange(24, dtype=torch.float32, device=b.device).reshape(2, 2, 6)
        return b

    check_against_cpu(fn, B, torch.tensor([True, False, False, True]))


def test_setitem():
    def fn(a, m, rows):
        a = a.clone()
        a[m] = 0.5
        a[rows, 1] = -1.0
        a[:, torch.tensor([0, 2])] += 1
        return a

    check_against_cpu(fn, A, MASK, ROWS)


def test_index_put_dtype_mismatch():
    with pytest.raises(RuntimeError, match="dtypes match"):
        A.to("tpu").index_put_((ROWS.to("tpu"),), torch.zeros(4, 6, dtype=torch.float64, device="tpu"))


def test_masked_select_and_nonzero():
    check_against_cpu(torch.masked_select, A, MASK)
    check_against_cpu(torch.masked_select, A, MASK[0])
    check_against_cpu(torch.nonzero, MASK)
    check_against_cpu(lambda m: torch.nonzero(m, as_tuple=True), MASK)
    check_against_cpu(torch.argwhere, A)
    check_against_cpu(lambda m: torch.nonzero_static(m, size=20), MASK)


def test_index_select_and_gather():
    check_against_cpu(torch.index_select, A, 1, torch.tensor([5, 0, 0]))
    check_against_cpu(torch.index_select, A, 0, torch.tensor(2))
    index = torch.tensor([[0, 5, 1], [2, 2, 0]])
    check_against_cpu(torch.gather, A, 1, index)
    check_against_cpu(torch.gather, A, 0, torch.tensor([[3, 1], [0, 0]]))

    def fn(a, i):
        out = torch.gather(a, 1, i)
        (out * 2).sum().backward()
        return out, a.grad

    check_against_cpu(fn, A.clone().requires_grad_(), index)


def test_scatter_family():
    index = torch.tensor([[0, 5, 1], [2, 2, 0]])
    src = torch.randn(2, 3)
    # a plain scatter of values to one place twice keeps either (torch: nondeterministic, and so is XLA on a GPU)
    unique = torch.tensor([[0, 5, 1], [2, 3, 0]])
    check_against_cpu(lambda a, i, s: a.scatter(1, i, s), A, unique, torch.randn(3, 4))
    check_against_cpu(lambda a, i: a.scatter(1, i, 2.5), A, index)
    check_against_cpu(lambda a, i, s: a.scatter(1, i, s, reduce="add"), A, index, src)
    check_against_cpu(lambda a, i, s: a.scatter(1, i, s, reduce="multiply"), A, index, src)
    check_against_cpu(lambda a, i, s: a.scatter_add(1, i, s), A, index, src)
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            check_against_cpu(lambda a, i, s: a.scatter_reduce(1, i, s, reduce, include_self=include_self),
                              A, index, src)
    ints = torch.arange(24).reshape(4, 6)
    check_against_cpu(lambda a, i, s: a.scatter_reduce(1, i, s, "mean", include_self=True), ints, index,
                      torch.tensor([[1, 2, 3], [4, 5, 6]]))


def test_index_add_copy_fill():
    index = torch.tensor([0, 3, 0])
    source = torch.randn(3, 6)
    check_against_cpu(lambda a, i, s: a.index_add(0, i, s), A, index, source)
    check_against_cpu(lambda a, i, s: a.index_add(0, i, s, alpha=-2), A, index, source)
    check_against_cpu(lambda a, i, s: a.index_copy(0, i, s), A, torch.tensor([1, 3, 2]), source)
    check_against_cpu(lambda a, i: a.index_fill(1, i, -3.0), A, torch.tensor([1, 4]))


def test_tril_triu_flip_roll_repeat():
    check_against_cpu(torch.tril, A)
    check_against_cpu(lambda a: torch.triu(a, diagonal=1), B)
    check_against_cpu(lambda a: a.tril_(-1), A.clone())
    check_against_cpu(lambda b: b.flip(0, -1), B)
    check_against_cpu(lambda b: b.roll(2), B)
    check_against_cpu(lambda b: b.roll((1, -2), (0, 2)), B)
    check_against_cpu(lambda a: a.repeat(2, 1, 3), A)
    check_against_cpu(lambda a: a.repeat_interleave(2, dim=0), A)


def test_sort_topk_argsort():
    values = torch.tensor([[3.0, float("nan"), 1.0, 3.0, -2.0], [0.0, 0.0, 5.0, -1.0, 2.0]])
    check_against_cpu(lambda v: torch.sort(v, stable=True), values, equal_nan=True)
    check_against_cpu(lambda v: torch.sort(v, dim=0, descending=True, stable=True), values, equal_nan=True)
    check_against_cpu(lambda v: torch.argsort(v, dim=1, stable=True), values)
    check_against_cpu(lambda a: torch.sort(a, descending=True), A)
    check_against_cpu(lambda a: torch.topk(a, 3), A)
    check_against_cpu(lambda a: torch.topk(a, 2, dim=0, largest=False), A)
    check_against_cpu(lambda v: torch.topk(v, 2, largest=False), torch.tensor([[5, 1, 7, 2]]))

    def fn(a):
        out = torch.topk(a, 2).values
        out.sum().backward()
        return out, a.grad

    check_against_cpu(fn, A.clone().requires_grad_())


def test_isin_and_unique():
    elements = torch.tensor([[1, 4, 7], [2, 9, 4]])
    check_against_cpu(torch.isin, elements, torch.tensor([4, 2, 11]))
    check_against_cpu(lambda e, t: torch.isin(e, t, invert=True), elements, torch.tensor([4, 2]))
    check_against_cpu(lambda e: torch.isin(e, 4), elements)
    check_against_cpu(lambda e: torch.unique(e, return_inverse=True, return_counts=True), elements)


def test_constant_pad():
    check_against_cpu(lambda b: F.pad(b, (1, 2)), B)
    check_against_cpu(lambda b: F.pad(b, (0, 1, 2, 0), value=-1.5), B)
    check_against_cpu(lambda b: F.pad(b, (-1, 1)), B)
    check_against_cpu(lambda t: F.pad(t, (0, 1), value=-100), torch.tensor([[3, 4], [5, 6]]))


def test_where_and_masked_fill():
    check_against_cpu(lambda a, m: torch.where(m, a, -a), A, MASK)
    check_against_cpu(lambda a, m: a.masked_fill(m, float("-inf")), A, MASK)
    check_against_cpu(lambda m: torch.where(m), MASK)


def test_factories():
    for args, kwargs in [((5,), {}), ((2, 11, 3), {}), ((0, 1, 0.1), {}), ((-3.5, 2), {"dtype": torch.float32}),
                         ((0, 5, 1.5), {"dtype": torch.int64}), ((10, 0, -3), {})]:
        assert_same(torch.arange(*args, device="tpu", **kwargs), torch.arange(*args, **kwargs))
    out = torch.empty(0, dtype=torch.int32, device="tpu")
    torch.arange(1, 7, 2, out=out)
    assert_same(out, torch.arange(1, 7, 2, dtype=torch.int32))
    assert_same(torch.linspace(-1, 2, 7, device="tpu"), torch.linspace(-1, 2, 7))
    assert_same(torch.linspace(0, 10, 4, device="tpu", dtype=torch.int64), torch.linspace(0, 10, 4, dtype=torch.int64))
    assert_same(torch.linspace(3, 3, 1, device="tpu"), torch.linspace(3, 3, 1))
    assert_same(torch.eye(3, device="tpu"), torch.eye(3))
    assert_same(torch.eye(2, 4, device="tpu", dtype=torch.int32), torch.eye(2, 4, dtype=torch.int32))
    assert_same(torch.full((2, 3), 1.5, device="tpu"), torch.full((2, 3), 1.5))
    assert_same(torch.full((2,), 7, device="tpu"), torch.full((2,), 7))
    assert_same(torch.zeros(2, 3, device="tpu", dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16))
    assert_same(torch.ones(4, device="tpu"), torch.ones(4))
    assert_same(torch.scalar_tensor(3, device="tpu"), torch.scalar_tensor(3))
    assert_same(torch._efficientzerotensor((2, 3), device="tpu"), torch.zeros(2, 3))
    assert_same(torch.tensor(2.5).to("tpu").new_full((2,), 4), torch.tensor(2.5).new_full((2,), 4))


def test_masked_scatter_take_search():
    source = torch.arange(30, dtype=torch.float32)
    check_against_cpu(lambda a, m, s: a.masked_scatter(m, s), A, MASK, source)
    check_against_cpu(lambda a, m, s: a.masked_scatter(m, s), A, MASK[0], source)
    check_against_cpu(torch.take, A, torch.tensor([[0, -1], [23, 5]]))
    boundaries = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    check_against_cpu(torch.bucketize, A, boundaries)
    check_against_cpu(lambda a, b: torch.bucketize(a, b, right=True, out_int32=True), A.round(), boundaries)
    check_against_cpu(torch.searchsorted, torch.sort(A).values, A[:, :2])
    check_against_cpu(lambda s, v: torch.searchsorted(s, v, side="right"), boundaries, torch.tensor(0.5))
    check_against_cpu(torch.repeat_interleave, torch.tensor([2, 0, 3]))
    check_against_cpu(lambda a, r: a.repeat_interleave(r, dim=0), A, torch.tensor([1, 0, 2, 1]))
    check_against_cpu(lambda e: torch.unique(e, dim=0), torch.tensor([[1, 2], [0, 1], [1, 2]]))
    check_against_cpu(lambda e: torch.unique_consecutive(e, return_counts=True), torch.tensor([1, 1, 2, 2, 2, 1]))


def test_masked_scatter_backward():
    """The source's gradient is the output's gradient at the masked positions, in order, then zeros."""
    def scatter(a, m, s):
        a.masked_scatter(m, s).square().sum().backward()
        return a.grad, s.grad

    for mask in (MASK, MASK[0]):
        check_against_cpu(scatter, A.clone().requires_grad_(), mask, torch.randn(5, 6, requires_grad=True))
    assert_same(torch.ops.aten.masked_scatter_backward(to_tpu(A), to_tpu(MASK), [3, 5]),
                torch.ops.aten.masked_scatter_backward(A, MASK, [3, 5]))


def test_index_factories():
    assert_same(torch.tril_indices(3, 4, device="tpu"), torch.tril_indices(3, 4))
    assert_same(torch.triu_indices(4, 3, 1, device="tpu"), torch.triu_indices(4, 3, 1))
    assert_same(torch.logspace(-1, 2, 5, device="tpu"), torch.logspace(-1, 2, 5))
    assert_same(torch.logspace(0, 3, 4, base=2, device="tpu"), torch.logspace(0, 3, 4, base=2))
