"""Fuzzing the op table against the CPU with hypothesis: random shapes (0-sized too), dtypes, strided
views and in-place chains; the tpu result (or the tpu error type) must equal the CPU's.

CI runs the "ci" profile: 200 examples per test, derandomized (the same examples on every run). For
a release check run the long profile, a fresh random sample each time:

    python -m pytest tests/test_fuzz.py --hypothesis-profile=release
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

settings.register_profile(
    "ci", max_examples=200, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "release", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool]


@st.composite
def tensors(draw, max_dims: int = 4) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=max_dims))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * 3
    if dtype == torch.bool:
        return values > 0
    return values.round().to(dtype) if not dtype.is_floating_point else values.to(dtype)


def _view_steps(draw, tensor: torch.Tensor) -> list:
    """A chain of view operations valid for ``tensor``'s shape, as (name, arguments) pairs."""
    steps, shape = [], list(tensor.shape)
    for _ in range(draw(st.integers(0, 3))):
        kinds = ["unsqueeze"]
        if len(shape) >= 2:
            kinds += ["transpose", "permute", "diagonal"]
        if shape:
            kinds += ["slice", "flip_view"]
            if any(n > 0 for n in shape):
                kinds.append("select")
            if 1 in shape:
                kinds.append("expand")
        kind = draw(st.sampled_from(kinds))
        if kind == "unsqueeze":
            dim = draw(st.integers(0, len(shape)))
            shape.insert(dim, 1)
            steps.append(("unsqueeze", (dim,)))
        elif kind == "transpose":
            a, b = draw(st.integers(0, len(shape) - 1)), draw(st.integers(0, len(shape) - 1))
            shape[a], shape[b] = shape[b], shape[a]
            steps.append(("transpose", (a, b)))
        elif kind == "permute":
            order = draw(st.permutations(range(len(shape))))
            shape = [shape[d] for d in order]
            steps.append(("permute", (tuple(order),)))
        elif kind == "diagonal":
            shape = shape[2:] + [min(shape[0], shape[1])]
            steps.append(("diagonal", ()))
        elif kind in ("slice", "flip_view"):
            dim = draw(st.integers(0, len(shape) - 1))
            start = draw(st.integers(0, shape[dim]))
            step = draw(st.integers(1, 3))
            shape[dim] = len(range(start, shape[dim], step))
            steps.append(("slice", (dim, start, step)))
        elif kind == "select":
            dim = draw(st.sampled_from([d for d, n in enumerate(shape) if n > 0]))
            index = draw(st.integers(-shape[dim], shape[dim] - 1))
            shape.pop(dim)
            steps.append(("select", (dim, index)))
        else:
            dim = shape.index(1)
            shape[dim] = draw(st.integers(0, 3))
            steps.append(("expand", (tuple(shape),)))
    return steps


def _apply_views(tensor: torch.Tensor, steps: list) -> torch.Tensor:
    for name, arguments in steps:
        if name == "slice":
            dim, start, step = arguments
            tensor = tensor[(slice(None),) * dim + (slice(start, None, step),)]
        elif name == "diagonal":
            tensor = tensor.diagonal()
        else:
            tensor = getattr(tensor, name)(*arguments)
    return tensor


UNARY = {
    "neg": lambda x: -x,
    "abs": torch.abs,
    "exp": torch.exp,
    "sin": torch.sin,
    "sigmoid": torch.sigmoid,
    "floor": torch.floor,
    "relu": torch.relu,
    "clamp": lambda x: x.clamp(-1, 1),
    "sum": lambda x: x.sum(),
    "sum_last": lambda x: x.sum(-1, keepdim=True),
    "mean_first": lambda x: x.mean(0),
    "amax_last": lambda x: x.amax(-1),
    "argmax": lambda x: x.argmax(),
    "cumsum_last": lambda x: x.cumsum(-1),
    "sort_last": lambda x: x.sort(-1, stable=True).values,
    "flip": lambda x: x.flip(0),
    "roll": lambda x: x.roll(1, 0),
    "cat": lambda x: torch.cat([x, x], 0),
    "where": lambda x: torch.where(x > 0, x, x * 2),
    "contiguous_reshape": lambda x: x.reshape(-1),
    "to_float": lambda x: x.float(),
    "to_int": lambda x: x.to(torch.int32),
    "nonzero": lambda x: torch.nonzero(x),
    "masked_select": lambda x: x[x > 0],
    "tril": lambda x: x.tril(),
    "pad": lambda x: torch.nn.functional.pad(x, (1, 2)),
    "softmax": lambda x: x.softmax(-1),
    "floor_divide_by_2": lambda x: x // 2,
}

BINARY = {
    "add": torch.add,
    "mul": torch.mul,
    "sub": torch.sub,
    "div": torch.div,
    "maximum": torch.maximum,
    "eq": torch.eq,
    "lt": torch.lt,
    "remainder": torch.remainder,
    "atan2": torch.atan2,
    "matmul": torch.matmul,
    "bitwise_and": torch.bitwise_and,
}

IN_PLACE = {
    "add_": lambda x, y: x.add_(y),
    "mul_": lambda x, y: x.mul_(y),
    "copy_": lambda x, y: x.copy_(y),
    "clamp_": lambda x, y: x.clamp_(-1, 1),
    "zero_": lambda x, y: x.zero_(),
    "fill_": lambda x, y: x.fill_(2),
    "neg_": lambda x, y: x.neg_(),
    "masked_fill_": lambda x, y: x.masked_fill_(y > 0, 1),
}


def _outcome(fn, *args):
    """The result (as CPU tensors), or the exception type the call raised."""
    try:
        result = fn(*args)
        results = result if isinstance(result, tuple) else (result,)
        return tuple(r.detach().cpu() if isinstance(r, torch.Tensor) else r for r in results)  # a sync: may raise
    except Exception as error:  # noqa: BLE001 (any exception type is compared between devices)
        return type(error)


def _assert_same_outcome(tpu, cpu) -> None:
    if cpu is NotImplementedError:  # a dtype the CPU kernel lacks ("not implemented for 'Bool'"): tpu may have it
        return
    if isinstance(cpu, type) or isinstance(tpu, type):
        # both fail, with the same exception class (messages may differ in wording)
        assert tpu == cpu or (isinstance(tpu, type) and isinstance(cpu, type) and issubclass(tpu, cpu)), (tpu, cpu)
        return
    assert len(tpu) == len(cpu)
    for actual, expected in zip(tpu, cpu):
        if not isinstance(expected, torch.Tensor):
            assert actual == expected
            continue
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        if expected.dtype == torch.bfloat16:
            torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2, equal_nan=True)
        else:
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


@given(data=st.data())
def test_unary_ops_on_random_views_match_cpu(data):
    base = data.draw(tensors())
    steps = _view_steps(data.draw, base)
    name = data.draw(st.sampled_from(sorted(UNARY)))
    cpu = _outcome(lambda t: UNARY[name](_apply_views(t, steps)), base)
    tpu = _outcome(lambda t: UNARY[name](_apply_views(t, steps)), base.to("tpu"))
    _assert_same_outcome(tpu, cpu)


@given(data=st.data())
def test_binary_ops_with_broadcasting_and_mixed_dtypes_match_cpu(data):
    first = data.draw(tensors(max_dims=3))
    second = data.draw(tensors(max_dims=3))
    if data.draw(st.booleans()):  # a broadcastable partner: first's trailing dims, some set to 1
        shape = [n if data.draw(st.booleans()) else 1 for n in first.shape[data.draw(st.integers(0, first.dim())):]]
        second = torch.randn(shape).to(second.dtype) if second.dtype != torch.bool else torch.randn(shape) > 0
    steps = _view_steps(data.draw, first)
    name = data.draw(st.sampled_from(sorted(BINARY)))
    cpu = _outcome(lambda a, b: BINARY[name](_apply_views(a, steps), b), first, second)
    tpu = _outcome(lambda a, b: BINARY[name](_apply_views(a, steps), b), first.to("tpu"), second.to("tpu"))
    _assert_same_outcome(tpu, cpu)


@given(data=st.data())
def test_in_place_chains_through_views_update_the_base_as_on_cpu(data):
    base = data.draw(tensors())
    chain = []
    for _ in range(data.draw(st.integers(1, 3))):
        steps = _view_steps(data.draw, base)
        chain.append((steps, data.draw(st.sampled_from(sorted(IN_PLACE))), data.draw(st.integers(0, 2**16))))

    def run(tensor: torch.Tensor):
        tensor = tensor.clone()
        for steps, name, seed in chain:
            view = _apply_views(tensor, steps)
            other = (torch.randn(view.shape, generator=torch.Generator().manual_seed(seed)) * 2).to(view.dtype)
            IN_PLACE[name](view, other.to(view.device))
        return tensor

    _assert_same_outcome(_outcome(run, base.to("tpu")), _outcome(run, base))


def test_profiles_are_registered():
    assert settings.get_profile("ci").max_examples == 200
    assert settings.get_profile("release").max_examples == 5000


@pytest.mark.parametrize("shape", [(0,), (0, 3), (2, 0, 4)])
def test_zero_sized_tensors_through_common_ops(shape):
    x = torch.zeros(shape)
    for fn in (lambda t: t + 1, lambda t: t.sum(), lambda t: t.reshape(-1), lambda t: t.transpose(0, -1).contiguous()):
        _assert_same_outcome(_outcome(fn, x.to("tpu")), _outcome(fn, x))
