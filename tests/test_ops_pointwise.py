"""Elementwise ops on tpu against CPU: values, dtypes and type promotion, in-place, out= and views."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from conftest import check_against_cpu

torch.manual_seed(0)
SHAPE = (3, 5)  # one shape throughout: every op compiles once per dtype
X = torch.randn(SHAPE) * 2
Y = torch.randn(SHAPE) * 2
INTS = torch.randint(-7, 8, SHAPE)
J = torch.randint(1, 5, SHAPE)  # positive, to divide by and raise to
B = torch.rand(SHAPE) > 0.5
SPECIAL = torch.tensor(
    [[math.nan, math.inf, -math.inf, 0.0, -0.0], [1.5, -1.5, 2.5, -2.5, 0.5], [3.0, -7.25, 1e-3, 1e30, -1e-30]]
)

FLOAT_DTYPES = [torch.float32, torch.bfloat16]
ALL_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def sample(dtype: torch.dtype, domain: str = "real") -> torch.Tensor:
    """A SHAPE tensor of ``dtype`` whose values lie in the op's domain."""
    if dtype == torch.bool:
        return B.clone()
    if not dtype.is_floating_point:
        values = {"real": INTS, "positive": J, "unit": INTS.clamp(-1, 1), "atleast1": J}[domain]
        return values.to(dtype)
    values = {"real": X, "positive": X.abs() + 0.1, "unit": X.tanh() * 0.95, "atleast1": X.abs() + 1}[domain]
    return values.to(dtype)


UNARY_FLOAT = {
    "exp": "real", "exp2": "real", "expm1": "real", "log": "positive", "log2": "positive", "log10": "positive",
    "log1p": "positive", "sqrt": "positive", "rsqrt": "positive", "reciprocal": "positive", "sin": "real",
    "cos": "real", "tan": "unit", "asin": "unit", "acos": "unit", "atan": "real", "sinh": "real", "cosh": "real",
    "tanh": "real", "asinh": "real", "acosh": "atleast1", "atanh": "unit", "sigmoid": "real", "erf": "real",
    "erfc": "real", "erfinv": "unit",
}


@pytest.mark.parametrize(
    "name, dtype",
    [(n, d) for n in UNARY_FLOAT for d in FLOAT_DTYPES + [torch.int64]] + [("exp", torch.bool), ("sqrt", torch.bool)],
    ids=str,
)
def test_unary_float_ops(name, dtype):
    """Integer and bool inputs give float32, as torch."""
    fn = getattr(torch, name)
    check_against_cpu(fn, sample(dtype, UNARY_FLOAT[name]), equal_nan=True)


@pytest.mark.parametrize("name", ["exp", "sqrt", "sigmoid", "log1p", "erfinv", "tanh"])
def test_unary_float_inplace_and_out(name):
    x = sample(torch.float32, UNARY_FLOAT[name])
    check_against_cpu(lambda t: getattr(t.clone(), f"{name}_")(), x)
    check_against_cpu(lambda t: getattr(torch, name)(t, out=torch.empty_like(t)), x)


def test_unary_float_inplace_on_int_raises():
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.arange(4, device="tpu").sqrt_()


SAME_DTYPE_UNARY = ["abs", "neg", "floor", "ceil", "round", "trunc", "frac", "sign", "sgn", "relu", "bitwise_not",
                    "logical_not", "signbit", "isnan", "isinf", "isposinf", "isneginf", "isfinite", "nan_to_num"]
CPU_LACKS = {("frac", torch.int64), ("bitwise_not", torch.float32), ("bitwise_not", torch.bfloat16)} | {
    (name, torch.bool) for name in ("abs", "neg", "floor", "ceil", "round", "trunc", "frac", "relu")
}


@pytest.mark.parametrize(
    "name, dtype", [(n, d) for n in SAME_DTYPE_UNARY for d in ALL_DTYPES if (n, d) not in CPU_LACKS], ids=str
)
def test_unary_ops(name, dtype):
    source = SPECIAL.to(dtype) if dtype.is_floating_point else sample(dtype)
    check_against_cpu(getattr(torch, name), source, equal_nan=True)


@pytest.mark.parametrize("name", ["abs", "neg", "floor", "round", "frac", "sign", "nan_to_num"])
def test_unary_inplace_and_out(name):
    check_against_cpu(lambda t: getattr(t.clone(), f"{name}_")(), SPECIAL, equal_nan=True)
    check_against_cpu(lambda t: getattr(torch, name)(t, out=torch.empty_like(t)), SPECIAL, equal_nan=True)


def test_round_decimals():
    values = torch.tensor([1.2345, -2.5551, 1234.5, 0.125, -0.375])
    for decimals in (2, 0, -2):
        check_against_cpu(lambda t: torch.round(t, decimals=decimals), values)
    check_against_cpu(lambda t: t.clone().round_(decimals=1), values)


def test_nan_to_num_arguments():
    check_against_cpu(lambda t: torch.nan_to_num(t, nan=1.0, posinf=2.0, neginf=-3.0), SPECIAL)
    check_against_cpu(lambda t: torch.nan_to_num(t.bfloat16()), SPECIAL)


# --- binary ops ---------------------------------------------------------------------------------

ARITHMETIC = {
    "add": lambda a, b: torch.add(a, b, alpha=2),
    "sub": lambda a, b: torch.sub(a, b, alpha=2),
    "rsub": lambda a, b: torch.rsub(a, b, alpha=2),
    "mul": torch.mul,
    "div": torch.div,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "floor_divide": torch.floor_divide,
    "remainder": torch.remainder,
    "fmod": torch.fmod,
    "pow": torch.pow,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "fmax": torch.fmax,
    "fmin": torch.fmin,
    "atan2": torch.atan2,
    "hypot": torch.hypot,
    "copysign": torch.copysign,
    "xlogy": torch.xlogy,
    "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2,
    "heaviside": torch.heaviside,
}
FLOAT_ONLY_BINARY = {"hypot", "logaddexp", "logaddexp2"}


def _binary_operands(name, dtype):
    if not dtype.is_floating_point:
        exponent_like = name in ("pow",)
        return sample(dtype), (J if exponent_like or "div" in name or name in ("remainder", "fmod") else INTS).to(dtype)
    if name == "pow":
        return sample(dtype, "positive"), Y.to(dtype)
    if name == "xlogy":
        return X.masked_fill(B, 0).to(dtype), sample(dtype, "positive")
    if name == "heaviside":
        return X.masked_fill(B, 0).to(dtype), Y.to(dtype)
    return X.to(dtype), Y.to(dtype)


@pytest.mark.parametrize(
    "name, dtype",
    [(n, d) for n in ARITHMETIC for d in (torch.float32, torch.bfloat16, torch.int64)
     if d.is_floating_point or n not in FLOAT_ONLY_BINARY],
    ids=str,
)
def test_binary_ops(name, dtype):
    check_against_cpu(ARITHMETIC[name], *_binary_operands(name, dtype), equal_nan=True)


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div", "div_floor", "remainder", "fmod", "pow", "floor_divide"])
def test_binary_ops_with_scalar(name):
    scalar = 3 if name == "pow" else -2.5
    check_against_cpu(lambda t: ARITHMETIC[name](t, scalar), X)
    check_against_cpu(lambda t: ARITHMETIC[name](t, 3), J)


@pytest.mark.parametrize("name", ["pow", "remainder", "xlogy", "bitwise_and"])
def test_scalar_first_overloads(name):
    check_against_cpu(lambda t: getattr(torch, name)(3, t), J)


def test_floor_and_trunc_division_edge_cases():
    a = torch.tensor([5.0, -5.0, 0.0, -0.0, 7.5, -7.5, 1.0, 1e30])
    b = torch.tensor([0.0, 0.0, 0.0, 3.0, -2.0, 2.0, -1e-30, 3.0])
    for mode in ("floor", "trunc"):
        check_against_cpu(lambda x, y: torch.div(x, y, rounding_mode=mode), a, b, equal_nan=True)
    check_against_cpu(torch.floor_divide, a, b, equal_nan=True)
    check_against_cpu(torch.remainder, a, b, equal_nan=True)
    i = torch.tensor([7, -7, 7, -7, 0])
    j = torch.tensor([2, 2, -2, -2, 3])
    for fn in (torch.floor_divide, torch.remainder, torch.fmod, lambda x, y: torch.div(x, y, rounding_mode="trunc")):
        check_against_cpu(fn, i, j)


def test_integer_pow_and_sqrt_of_int():
    check_against_cpu(lambda a, b: a**b, J, J)
    bases, negative_exponents = torch.tensor([2, -2, 1, -1, -1, 0, 3]), torch.tensor([-1, -3, -5, -5, -2, 3, 0])
    check_against_cpu(lambda a, b: a**b, bases, negative_exponents)
    check_against_cpu(lambda a: a**2, INTS)
    check_against_cpu(lambda a: a**0.5, J)
    check_against_cpu(lambda a: 2**a, J)
    check_against_cpu(lambda a: 2.0**a, J)
    check_against_cpu(torch.sqrt, J.int())


@pytest.mark.parametrize("exponent", [1, 2, 2.0, 3, -2, -1, -1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_powers_torch_computes_without_its_power_function_are_bit_identical(exponent, dtype, fresh_dynamo):
    """x ** 2 is x * x on CPU (and 3, -2, -1 likewise): the same arithmetic on tpu, eager and compiled (0.5 is
    ``sqrt`` on both, which XLA's CPU code rounds differently in the last bit now and then)."""
    base = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    expected = base.pow(exponent)
    assert torch.equal(base.to("tpu").pow(exponent).cpu().nan_to_num(), expected.nan_to_num())
    compiled = torch.compile(lambda t: t.pow(exponent), backend="tpu", fullgraph=True)
    assert torch.equal(compiled(base.to("tpu")).cpu().nan_to_num(), expected.nan_to_num())


def test_specialized_powers_keep_the_result_dtype():
    ints = torch.arange(1, 8)
    for exponent in (2, 2.0, -1.0, 0.5, -0.5, 3):
        check_against_cpu(lambda a: a**exponent, ints)
    check_against_cpu(lambda a: a.pow(2), X.to(torch.bfloat16))


def test_div_rejects_unknown_rounding_mode():
    with pytest.raises(RuntimeError, match="rounding_mode"):
        torch.div(X.to("tpu"), 2, rounding_mode="round")


@pytest.mark.parametrize("name", ["and", "or", "xor"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8], ids=str)
def test_bitwise_and_logical(name, dtype):
    a, b = (sample(torch.bool), ~sample(torch.bool)) if dtype == torch.bool else (INTS.to(dtype), J.to(dtype))
    check_against_cpu(getattr(torch, f"bitwise_{name}"), a, b)
    check_against_cpu(getattr(torch, f"logical_{name}"), a, b)
    operator = {"and": "__and__", "or": "__or__", "xor": "__xor__"}[name]
    check_against_cpu(lambda t: getattr(t, operator)(True if dtype == torch.bool else 6), a)
    check_against_cpu(lambda t, u: getattr(t.clone(), f"bitwise_{name}_")(u), a, b)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8], ids=str)
def test_shifts(dtype):
    values = torch.tensor([1, -3, 100, -128, 0, 5] if dtype == torch.int8 else [1, 3, 100, 127, 0, 5], dtype=dtype)
    amounts = torch.tensor([0, 1, 3, 7, 9, 70], dtype=dtype)
    check_against_cpu(lambda a, b: a << b, values, amounts)
    check_against_cpu(lambda a, b: a >> b, values, amounts)
    check_against_cpu(lambda a: a << 2, values)
    check_against_cpu(lambda a: a >> 1, values)
    check_against_cpu(torch.bitwise_left_shift, values, amounts)
    check_against_cpu(torch.bitwise_right_shift, values, amounts)

    def inplace(a, b):
        a = a.clone()
        a <<= b
        a >>= 1
        return a

    check_against_cpu(inplace, values, amounts)


# --- type promotion -----------------------------------------------------------------------------


PROMOTION_CASES = {
    "int tensor + float scalar": (lambda a: a + 2.5, (INTS,)),
    "int tensor * bool tensor": (lambda a, b: a * b, (INTS, B)),
    "int32 tensor + int64 0-dim": (lambda a, b: a + b, (INTS.int(), torch.tensor(3))),
    "bf16 tensor + 0-dim f64 tensor": (lambda a, b: a + b, (X.bfloat16(), torch.tensor(1.001, dtype=torch.float64))),
    "bf16 tensor + cpu 0-dim f64 tensor": (lambda a: a * torch.tensor(0.1, dtype=torch.float64), (X.bfloat16(),)),
    "f32 tensor + f64 tensor": (lambda a, b: a + b, (X, Y.double())),
    "uint8 tensor + negative int": (lambda a: a + (-3), (J.to(torch.uint8),)),
    "bool tensor + bool tensor": (lambda a, b: a + b, (B, ~B)),
    "int tensor / int tensor": (lambda a, b: a / b, (INTS, J)),
    "int tensor // float scalar": (lambda a: a // 2.5, (INTS,)),
    "bf16 tensor * float scalar": (lambda a: a * 0.1, (X.bfloat16(),)),
    "int tensor clamp float": (lambda a: a.clamp(min=-2.5, max=3.5), (INTS,)),
    "where int and float": (lambda c, a, b: torch.where(c, a, b), (B, INTS, Y)),
    "where bf16 and scalar 0-dim": (lambda c, a: torch.where(c, a, torch.tensor(0.5)), (B, X.bfloat16())),
    "int tensor pow float scalar": (lambda a: a**1.5, (J,)),
    "lerp bf16": (lambda a, b: torch.lerp(a, b, 0.3), (X.bfloat16(), Y.bfloat16())),
    "addcmul int": (lambda a, b, c: torch.addcmul(a, b, c, value=3), (INTS, J, INTS)),
}


@pytest.mark.parametrize("case", PROMOTION_CASES)
def test_type_promotion(case):
    fn, args = PROMOTION_CASES[case]
    check_against_cpu(fn, *args)


def test_inplace_promotion_errors():
    with pytest.raises(RuntimeError, match="can't be cast"):
        INTS.to("tpu").add_(1.5)
    x = torch.ones(3, device="tpu")
    x.add_(torch.tensor(2, dtype=torch.int64))  # a wider integer into float is allowed
    assert x.dtype == torch.float32 and x.cpu().tolist() == [3.0, 3.0, 3.0]


# --- in-place, views and out= -------------------------------------------------------------------


def test_inplace_through_views():
    def run(x, y):
        base = x.clone()
        base[:, 1].mul_(2)
        base.t()[2].add_(y[0, :3], alpha=-1)
        base[1:, ::2].clamp_(min=-0.5)
        base.view(-1)[4:9].sqrt_()
        base.diagonal().copysign_(y.diagonal())
        return base

    check_against_cpu(run, X.abs(), Y, equal_nan=True)


def test_inplace_on_view_updates_base_and_version():
    base = X.clone().to("tpu")
    column = base[:, 2]
    before = base._version
    column.exp_()
    assert base._version > before
    expected = X.clone()
    expected[:, 2].exp_()
    torch.testing.assert_close(base.cpu(), expected)


def test_out_variants():
    check_against_cpu(lambda a, b: torch.add(a, b, out=torch.empty_like(a)), X, Y)
    check_against_cpu(lambda a, b: torch.mul(a, b, out=torch.empty(SHAPE, dtype=torch.float64, device=a.device)), X, Y)
    check_against_cpu(lambda a, b: torch.atan2(a, b, out=torch.empty_like(a)), X, Y)
    check_against_cpu(lambda a, b: torch.where(a > 0, a, b, out=torch.empty_like(a)), X, Y)
    check_against_cpu(lambda a: torch.clamp(a, -1, 1, out=torch.empty_like(a)), X)
    check_against_cpu(lambda a, b: torch.pow(a.abs(), b, out=torch.empty_like(a)), X, Y)
    check_against_cpu(lambda a, b: torch.logical_and(a, b, out=torch.empty(SHAPE, device=a.device)), X, Y)
    check_against_cpu(lambda a: torch.signbit(a, out=torch.empty(SHAPE, dtype=torch.bool, device=a.device)), SPECIAL)


def test_out_is_resized():
    def run(a, b):
        out = torch.empty(0, dtype=a.dtype, device=a.device)
        torch.sub(a, b, out=out)
        return out

    check_against_cpu(run, X, Y)


def test_out_through_a_view():
    def run(a, b):
        out = torch.zeros(4, 6, device=a.device)
        torch.mul(a, b, out=out[1:, :5])
        return out

    check_against_cpu(run, X, Y)


# --- selection and clamping ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=str)
def test_where_and_masked_fill(dtype):
    a, b = sample(dtype), (Y.to(dtype) if dtype != torch.bool else ~B)
    check_against_cpu(torch.where, B, a, b)
    check_against_cpu(lambda t, m: t.masked_fill(m, 1), a, B)
    check_against_cpu(lambda t, m: t.clone().masked_fill_(m, torch.tensor(0)), a, B)
    check_against_cpu(lambda t, m: t.masked_fill(m[0], torch.tensor(1, device=t.device)), a, B)


def test_masked_fill_broadcasts_and_checks():
    check_against_cpu(lambda t, m: t.masked_fill(m, -1.5), X[0], B)
    check_against_cpu(lambda t, m: t.masked_fill(m, 2.7), INTS, B)  # float value truncated into int
    with pytest.raises(RuntimeError, match="boolean masks"):
        X.to("tpu").masked_fill(INTS.to("tpu"), 1)
    with pytest.raises(RuntimeError, match="0-dimensional"):
        X.to("tpu").masked_fill(B.to("tpu"), torch.ones(2, device="tpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_clamp(dtype):
    x = sample(dtype)
    low, high = torch.full(SHAPE, -1).to(dtype), J.to(dtype)
    check_against_cpu(lambda t: t.clamp(-1, 2), x)
    check_against_cpu(lambda t: t.clamp(min=1), x)
    check_against_cpu(lambda t: t.clamp(max=0), x)
    check_against_cpu(lambda t, lo, hi: t.clamp(lo, hi), x, low, high)
    check_against_cpu(lambda t, lo: torch.clamp_min(t, lo), x, low)
    check_against_cpu(lambda t, hi: torch.clamp_max(t, hi), x, high)
    check_against_cpu(lambda t: t.clone().clamp_(min=0, max=1), x)
    check_against_cpu(lambda t: t.clamp(3, 1), x)  # min > max gives max, as torch


def test_clamp_propagates_nan_and_needs_a_bound():
    check_against_cpu(lambda t: t.clamp(-1, 1), SPECIAL, equal_nan=True)
    with pytest.raises(RuntimeError, match="At least one of 'min' or 'max'"):
        torch.clamp(X.to("tpu"))


def test_maximum_minimum_nan():
    check_against_cpu(torch.maximum, SPECIAL, SPECIAL.flip(0), equal_nan=True)
    check_against_cpu(torch.fmin, SPECIAL, SPECIAL.flip(1), equal_nan=True)
    check_against_cpu(torch.maximum, B, ~B)


# --- ternary ops and gradients ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_lerp_addcmul_addcdiv(dtype):
    a, b, c = X.to(dtype), Y.to(dtype), (X.abs() + 0.5).to(dtype)
    check_against_cpu(lambda s, e: torch.lerp(s, e, 0.25), a, b)
    check_against_cpu(lambda s, e: torch.lerp(s, e, 0.75), a, b)
    check_against_cpu(lambda s, e, w: torch.lerp(s, e, w), a, b, torch.rand(SHAPE).to(dtype))
    check_against_cpu(lambda s, t1, t2: torch.addcmul(s, t1, t2, value=-0.5), a, b, c)
    check_against_cpu(lambda s, t1, t2: torch.addcdiv(s, t1, t2, value=0.3), a, b, c)
    check_against_cpu(lambda s, t1, t2: s.clone().addcdiv_(t1, t2), a, b, c)
    check_against_cpu(lambda s, t1, t2: s.clone().lerp_(t1, 0.9), a, b, c)


def test_activation_backward_ops():
    def grads(fn, x):
        x = x.clone().requires_grad_(True)
        fn(x).sum().backward()
        return x.grad

    check_against_cpu(lambda x: grads(torch.sigmoid, x), X)
    check_against_cpu(lambda x: grads(torch.tanh, x), X)
    check_against_cpu(lambda x: grads(torch.relu, x), X)
    check_against_cpu(lambda x: grads(lambda t: (t.exp() * t.sin() / t.cosh()).clamp(-1, 1), x), X)
    check_against_cpu(lambda g, y: torch.ops.aten.threshold_backward(g, y, 0.5), X, Y)


def test_threshold():
    check_against_cpu(lambda t: torch.threshold(t, 0.5, -2.0), X)
    check_against_cpu(lambda t: torch.nn.functional.threshold(t.clone(), 0.1, 20, inplace=True), X)


def test_lowering_names_exist_and_reach_the_backend():
    """Every lowering here names a real overload, none CompositeImplicitAutograd (whose own kernel would be
    bypassed, and autograd with it)."""
    from hf_tpu.backend import dispatch
    from hf_tpu.backend.ops import foreach, pointwise, reductions

    modules = {pointwise.__name__, reductions.__name__, foreach.__name__}
    names = [n for n, e in dispatch.LOWERINGS.items() if e.fn.__module__ in modules]
    names += [n for n, k in dispatch.CUSTOM_KERNELS.items() if k.__module__ in modules]
    assert len(names) > 400
    for name in names:
        op = dispatch.resolve(name)
        if name != "isfinite":  # bool-valued, nothing for autograd to lose
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"), name


def test_no_warnings_for_plain_ops():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (X.to("tpu") * 2 + 1).exp().cpu()


def test_bfloat16_trunc_division_rounds_the_quotient_first():
    """CPU rounds a / b to bfloat16 before truncating: 17.99 becomes 18, not 17."""
    torch.manual_seed(1)
    x, y = (torch.randn(2000) * 30).bfloat16(), torch.randn(2000).bfloat16()
    check_against_cpu(lambda a, b: torch.div(a, b, rounding_mode="trunc"), x, y, atol=0, rtol=0)


LAYOUT_CASES = {
    "unary on a transposed tensor": lambda x, other: torch.sigmoid(x),
    "binary, transposed first": lambda x, other: x * other,
    "binary, contiguous first": lambda x, other: other + x,
    "broadcast scalar row": lambda x, other: x + other[0, 0],
    "comparison": lambda x, other: x > other,
    "sliced (not dense) input": lambda x, other: x[:, :, :2] * 2,
}


@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_pointwise_results_take_the_memory_layout_cpu_gives_them(name):
    """TensorIterator lays a result out like its first operand: ``(x.mT * 2).mT`` is contiguous again."""
    x = torch.randn(2, 3, 4).transpose(1, 2)
    other = torch.randn(2, 4, 3)
    expected = LAYOUT_CASES[name](x, other)
    result = LAYOUT_CASES[name](x.to("tpu"), other.to("tpu"))
    assert result.stride() == expected.stride()
    torch.testing.assert_close(result.cpu(), expected)
    torch.testing.assert_close(result.transpose(1, 2).reshape(-1).cpu(), expected.transpose(1, 2).reshape(-1))


DIVISIONS = {
    "by a number": lambda x, y: x / 3.0,
    "by a zero-dim tensor": lambda x, y: x / y[0, 0],
    "by a row": lambda x, y: x / y[:1],
    "by a column": lambda x, y: x / y[:, :1],
    "in place by a number": lambda x, y: x.clone().div_(7.0),
    "trunc by a number": lambda x, y: torch.div(x, 0.3, rounding_mode="trunc"),
    "floor by a column": lambda x, y: torch.div(x, y[:, :1], rounding_mode="floor"),
    "addcdiv by a row": lambda x, y: torch.addcdiv(x, x, y[:1], value=0.1),
    "foreach by numbers": lambda x, y: torch._foreach_div([x, y], [3.0, 0.7])[1],
    "round to 3 decimals": lambda x, y: torch.round(x * 100, decimals=3),
}


@pytest.mark.parametrize("name", DIVISIONS)
def test_divisions_by_a_broadcast_divisor_are_rounded_once_as_on_cpu(name):
    """CPU's kernels divide; XLA's simplifier would multiply by the divisor's reciprocal (two roundings: a third of
    the elements of ``x / 3.0`` one unit in the last place off), bit for bit."""
    x, y = torch.randn(64, 256), torch.randn(64, 256) + 3
    expected = DIVISIONS[name](x, y)
    result = DIVISIONS[name](x.to("tpu"), y.to("tpu")).cpu()
    assert torch.equal(result, expected), f"{(result != expected).sum().item()} elements differ from CPU's"
