"""Elementwise ops, with PyTorch's type promotion (:func:`..dtypes.result_type`).

Like torch, half-precision math runs in float32 and is rounded once (``_opmath``), and ops that
only make sense in floating point (``sqrt``, ``atan2``, true division) give the default float dtype
for integer and bool inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .. import checks, dtypes
from ..dispatch import lowering
from ..dtypes import result_type

_HALF = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


def _opmath(dtype):
    """The dtype torch computes ``dtype`` math in (``at::opmath_type``): float32 for half types."""
    return np.dtype(jnp.float32) if np.dtype(dtype) in _HALF else np.dtype(dtype)


def rounded_to(value, dtype):
    """Traced: ``value`` rounded to the precision of the narrower float ``dtype``, kept in its own dtype (torch's
    intermediate rounding). For bfloat16 this is ``reduce_precision``, the same bits as a round trip through
    bfloat16: XLA's GPU compiler removes such a round trip (excess precision) but not this op. float16 keeps the
    round trip (``reduce_precision`` flushes its subnormals)."""
    if np.dtype(dtype) == np.dtype(jnp.bfloat16):
        info = jnp.finfo(dtype)
        return lax.reduce_precision(value, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return value.astype(dtype).astype(value.dtype)


def _is_float(value) -> bool:
    return jnp.issubdtype(value.dtype, jnp.inexact)


def _float_result(*operands):
    dtype = result_type(*operands)
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else dtypes.to_jax(torch.get_default_dtype())


def _math(fn, dtype, *operands):
    """``fn`` over the operands (arrays or Python scalars) cast to ``dtype``'s opmath type, rounded to ``dtype``."""
    compute = _opmath(dtype)
    return fn(*(None if x is None else jnp.asarray(x, compute) for x in operands)).astype(dtype)


def divided(dividend, divisor):
    """Traced: ``dividend / divisor`` rounded once, as torch's CPU kernels divide. XLA's algebraic simplifier
    turns a division by a broadcast value (a number, a row, a constant) into a product with its reciprocal, which
    rounds twice (``x / 3.0`` was one unit in the last place off in a third of its elements). It does not look
    through an optimization barrier, which XLA drops before fusing: the division is still one fused loop."""
    shape = jnp.broadcast_shapes(jnp.shape(dividend), jnp.shape(divisor))
    return dividend / lax.optimization_barrier(jnp.broadcast_to(divisor, shape))


def _scaled(value, alpha):
    return value if isinstance(alpha, int) and alpha == 1 else value * jnp.asarray(alpha, value.dtype)


# --- arithmetic ---------------------------------------------------------------------------------


@lowering("add.Tensor", "add_.Tensor", "add.out", "add.Scalar", "add_.Scalar", "add.Scalar_out")
def add(self, other, alpha=1):
    return _math(lambda a, b: a + _scaled(b, alpha), result_type(self, other), self, other)


def _check_no_bool_subtraction(self, other) -> None:
    """The CPU refuses ``-`` on bool tensors (and says what was probably meant)."""
    bools = sum(isinstance(v, bool) or getattr(v, "dtype", None) == jnp.bool_ for v in (self, other))
    if bools == 2:
        raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. "
                           "Use the `^` or `logical_xor()` operator instead.")
    if bools:
        raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. "
                           "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead.")


@lowering("sub.Tensor", "sub_.Tensor", "sub.out", "sub.Scalar", "sub_.Scalar", "sub.Scalar_out")
def sub(self, other, alpha=1):
    _check_no_bool_subtraction(self, other)
    return _math(lambda a, b: a - _scaled(b, alpha), result_type(self, other), self, other)


@lowering("rsub.Tensor", "rsub.Tensor_out", "rsub.Scalar", "rsub.Scalar_out")
def rsub(self, other, alpha=1):
    _check_no_bool_subtraction(self, other)
    return _math(lambda a, b: b - _scaled(a, alpha), result_type(self, other), self, other)


@lowering("mul.Tensor", "mul_.Tensor", "mul.out", "mul.Scalar", "mul_.Scalar", "mul.Scalar_out")
def mul(self, other):
    return _math(jnp.multiply, result_type(self, other), self, other)


@lowering("div.Tensor", "div_.Tensor", "div.out", "div.Scalar", "div_.Scalar", "div.Scalar_out")
def div(self, other):
    return _math(divided, _float_result(self, other), self, other)


def _trunc_divide(a, b):
    return jnp.trunc(divided(a, b)) if _is_float(a) else lax.div(a, b)


def _floor_divide(a, b):
    """Python's ``//``; for floats torch's ``div_floor_floating`` (exact, signed zeros, x/0 = ±inf)."""
    if not _is_float(a):
        return jnp.floor_divide(a, b)
    mod = jnp.fmod(a, b)
    quotient = divided(a - mod, b)
    quotient = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), quotient - 1, quotient)
    floor = jnp.floor(quotient)
    floor = jnp.where(quotient - floor > 0.5, floor + 1, floor)
    true_quotient = divided(a, b)
    floor = jnp.where(quotient == 0, jnp.copysign(jnp.zeros_like(quotient), true_quotient), floor)
    return jnp.where(b == 0, true_quotient, floor)


@lowering("div.Tensor_mode", "div_.Tensor_mode", "div.out_mode", "div.Scalar_mode", "div_.Scalar_mode",
          "div.Scalar_mode_out")
def div_mode(self, other, rounding_mode=None):
    if rounding_mode is None:
        return div(self, other)
    if rounding_mode not in ("trunc", "floor"):
        raise RuntimeError(
            f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{rounding_mode}'"
        )
    dtype = result_type(self, other)
    checks.nonzero_divisor(other, dtype)
    if rounding_mode == "trunc" and np.dtype(dtype) in _HALF:  # CPU rounds the quotient before truncating
        return _math(lambda a, b: jnp.trunc(rounded_to(divided(a, b), dtype)), dtype, self, other)
    return _math(_trunc_divide if rounding_mode == "trunc" else _floor_divide, dtype, self, other)


@lowering("floor_divide", "floor_divide_.Tensor", "floor_divide.out", "floor_divide.Scalar",
          "floor_divide_.Scalar", "floor_divide.Scalar_out")
def floor_divide(self, other):
    dtype = result_type(self, other)
    checks.nonzero_divisor(other, dtype)
    return _math(_floor_divide, dtype, self, other)


@lowering("remainder.Tensor", "remainder_.Tensor", "remainder.Tensor_out", "remainder.Scalar", "remainder_.Scalar",
          "remainder.Scalar_out", "remainder.Scalar_Tensor", "remainder.Scalar_Tensor_out")
def remainder(self, other):
    dtype = result_type(self, other)
    checks.nonzero_divisor(other, dtype)
    return _math(jnp.remainder, dtype, self, other)


@lowering("fmod.Tensor", "fmod_.Tensor", "fmod.Tensor_out", "fmod.Scalar", "fmod_.Scalar", "fmod.Scalar_out")
def fmod(self, other):
    dtype = result_type(self, other)
    checks.nonzero_divisor(other, dtype)
    return _math(jnp.fmod, dtype, self, other)


def _power(base, exponent):
    """``jnp.power``, except signed integers to negative powers: 0 unless the base is 1 or -1, as torch."""
    if not jnp.issubdtype(base.dtype, jnp.signedinteger):
        return jnp.power(base, exponent)
    reciprocal = jnp.where(base == 1, 1, jnp.where(base == -1, 1 - 2 * (exponent & 1), 0)).astype(base.dtype)
    return jnp.where(exponent < 0, reciprocal, jnp.power(base, jnp.maximum(exponent, 0)))


_POWERS_AS_CPU_COMPUTES_THEM = {
    1: lambda x: x, 2: lambda x: x * x, 3: lambda x: x * x * x, -2: lambda x: 1 / (x * x),
    0.5: jnp.sqrt, -0.5: lax.rsqrt, -1: lambda x: 1 / x,
}
"""The exponents torch's CPU kernel computes without its general power function (floating-point bases): the same
arithmetic here, several times faster than XLA's power of a traced exponent and equal to CPU's results. (1: the
backward of ``x ** 2`` is ``2 * x ** 1``.)"""


@lowering("pow.Tensor_Tensor", "pow_.Tensor", "pow.Tensor_Tensor_out", "pow.Tensor_Scalar", "pow_.Scalar",
          "pow.Tensor_Scalar_out", "pow.Scalar", "pow.Scalar_out",
          specialized={"exponent": tuple(_POWERS_AS_CPU_COMPUTES_THEM)})
def power(self, exponent):
    dtype = result_type(self, exponent)
    if exponent.__class__ in (int, float) and jnp.issubdtype(dtype, jnp.floating):
        form = _POWERS_AS_CPU_COMPUTES_THEM.get(exponent)
        if form is not None:
            return _math(form, dtype, self)
    return _math(_power, dtype, self, exponent)


@lowering("abs", "abs_", "abs.out")
def abs_(self):
    return jnp.abs(self)


@lowering("neg", "neg_", "neg.out")
def neg(self):
    if self.dtype == jnp.bool_:
        raise RuntimeError("Negation, the `-` operator, on a bool tensor is not supported. If you are trying to "
                           "invert a mask, use the `~` or `logical_not()` operator instead.")
    return lax.neg(self)


@lowering("reciprocal", "reciprocal_", "reciprocal.out")
def reciprocal(self):
    return _math(lambda x: 1 / x, _float_result(self), self)


@lowering("sign", "sign_", "sign.out")
def sign(self):
    """-1, 0 or 1; 0 for NaN, as torch."""
    if self.dtype == jnp.bool_:
        return self
    return (self > 0).astype(self.dtype) - (self < 0).astype(self.dtype)


@lowering("sgn", "sgn_", "sgn.out")
def sgn(self):
    """``sign`` for real tensors; ``z / |z|`` (0 at 0) for complex ones (the direction autograd uses for ``abs``)."""
    if not jnp.iscomplexobj(self):
        return sign(self)
    magnitude = jnp.abs(self)
    return jnp.where(magnitude == 0, jnp.zeros((), self.dtype), self / jnp.where(magnitude == 0, 1, magnitude))


@lowering("addcmul", "addcmul_", "addcmul.out")
def addcmul(self, tensor1, tensor2, value=1):
    return _math(lambda s, a, b, v: s + v * a * b, result_type(self, tensor1, tensor2), self, tensor1, tensor2, value)


@lowering("addcdiv", "addcdiv_", "addcdiv.out")
def addcdiv(self, tensor1, tensor2, value=1):
    return _math(lambda s, a, b, v: s + divided(v * a, b), result_type(self, tensor1, tensor2), self, tensor1,
                 tensor2, value)


def _lerp(start, end, weight):
    """torch's two-sided formula, exact at both ends."""
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * (end - start), end - (end - start) * (1 - weight))


@lowering("lerp.Scalar", "lerp_.Scalar", "lerp.Scalar_out", "lerp.Tensor", "lerp_.Tensor", "lerp.Tensor_out")
def lerp(self, end, weight):
    return _math(_lerp, result_type(self, end), self, end, weight)


# --- floating-point functions -------------------------------------------------------------------


def _unary_float(fn):
    def lower(self):
        return _math(fn, _float_result(self), self)

    lower.__name__ = fn.__name__
    return lower


_UNARY_FLOAT = {
    "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1, "log": jnp.log, "log2": jnp.log2, "log10": jnp.log10,
    "log1p": jnp.log1p, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt, "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan,
    "asin": jnp.arcsin, "acos": jnp.arccos, "atan": jnp.arctan, "sinh": jnp.sinh, "cosh": jnp.cosh,
    "tanh": jnp.tanh, "asinh": jnp.arcsinh, "acosh": jnp.arccosh, "atanh": jnp.arctanh, "sigmoid": jax.nn.sigmoid,
    "erf": lax.erf, "erfc": lax.erfc, "erfinv": lax.erf_inv,
}
for _name, _fn in _UNARY_FLOAT.items():
    lowering(_name, f"{_name}_", f"{_name}.out")(_unary_float(_fn))


def _binary_float(fn):
    def lower(self, other):
        return _math(fn, _float_result(self, other), self, other)

    lower.__name__ = fn.__name__
    return lower


def _xlogy(x, y):
    return jnp.where(jnp.isnan(y), jnp.nan, jnp.where(x == 0, 0, x * jnp.log(y)))


lowering("atan2", "atan2_", "atan2.out")(_binary_float(jnp.arctan2))
lowering("hypot", "hypot_", "hypot.out")(_binary_float(jnp.hypot))
lowering("logaddexp", "logaddexp.out")(_binary_float(jnp.logaddexp))
lowering("logaddexp2", "logaddexp2.out")(_binary_float(jnp.logaddexp2))
lowering("copysign.Tensor", "copysign_.Tensor", "copysign.out", "copysign.Scalar", "copysign_.Scalar",
         "copysign.Scalar_out")(_binary_float(jnp.copysign))
lowering("xlogy.Tensor", "xlogy_.Tensor", "xlogy.OutTensor", "xlogy.Scalar_Other", "xlogy_.Scalar_Other",
         "xlogy.OutScalar_Other", "xlogy.Scalar_Self", "xlogy.OutScalar_Self")(_binary_float(_xlogy))


def _rounding(fn):
    def lower(self):
        return fn(self) if _is_float(self) else self

    lower.__name__ = fn.__name__
    return lower


for _name, _fn in {"floor": jnp.floor, "ceil": jnp.ceil, "trunc": jnp.trunc, "round": jnp.round}.items():
    lowering(_name, f"{_name}_", f"{_name}.out")(_rounding(_fn))


@lowering("round.decimals", "round_.decimals", "round.decimals_out")
def round_decimals(self, decimals):
    """Half-to-even rounding of ``self * 10**decimals``, computed like torch in the opmath type."""
    scale = 10.0 ** abs(decimals)
    if decimals >= 0:
        return _math(lambda x, s: divided(jnp.round(x * s), s), self.dtype, self, scale)
    return _math(lambda x, s: jnp.round(divided(x, s)) * s, self.dtype, self, scale)


@lowering("frac", "frac_", "frac.out")
def frac(self):
    return self - jnp.trunc(self)


@lowering("nan_to_num", "nan_to_num_", "nan_to_num.out")
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    if not _is_float(self):
        return self
    return jnp.nan_to_num(self, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


# --- predicates ---------------------------------------------------------------------------------


def _float_predicate(fn):
    def lower(self):
        return fn(self) if _is_float(self) else jnp.zeros(self.shape, jnp.bool_)

    lower.__name__ = fn.__name__
    return lower


lowering("isnan", "isnan.out")(_float_predicate(jnp.isnan))
lowering("isinf", "isinf.out")(_float_predicate(jnp.isinf))
lowering("isposinf", "isposinf.out")(_float_predicate(jnp.isposinf))
lowering("isneginf", "isneginf.out")(_float_predicate(jnp.isneginf))


@lowering("signbit", "signbit.out")
def signbit(self):
    if _is_float(self):
        return jnp.signbit(self)
    return self < 0 if jnp.issubdtype(self.dtype, jnp.signedinteger) else jnp.zeros(self.shape, jnp.bool_)


def _promoted(fn):
    """``fn`` of the operands cast to their promoted dtype (for exact ops, which need no opmath)."""

    def lower(self, other):
        dtype = result_type(self, other)
        return fn(jnp.asarray(self, dtype), jnp.asarray(other, dtype))

    lower.__name__ = fn.__name__
    return lower


for _name, _fn in {"eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
                   "gt": jnp.greater, "ge": jnp.greater_equal}.items():
    lowering(f"{_name}.Tensor", f"{_name}.Scalar", f"{_name}_.Tensor", f"{_name}_.Scalar",
             f"{_name}.Tensor_out", f"{_name}.Scalar_out")(_promoted(_fn))


# --- logical and bitwise ------------------------------------------------------------------------


@lowering("logical_not", "logical_not_", "logical_not.out")
def logical_not(self):
    return jnp.logical_not(self)


def _logical(fn):
    def lower(self, other):
        return fn(self != 0, other != 0)

    lower.__name__ = fn.__name__
    return lower


for _name, _fn in {"and": jnp.logical_and, "or": jnp.logical_or, "xor": jnp.logical_xor}.items():
    lowering(f"logical_{_name}", f"logical_{_name}_", f"logical_{_name}.out")(_logical(_fn))


@lowering("bitwise_not", "bitwise_not_", "bitwise_not.out")
def bitwise_not(self):
    return jnp.invert(self)


def _shift_right(a, b):
    """Arithmetic for signed types; shifts of the bit width or more (or negative) give the sign fill, as torch."""
    if jnp.issubdtype(a.dtype, jnp.signedinteger):
        return lax.shift_right_arithmetic(a, b)
    return lax.shift_right_logical(a, b)


for _name, _fn in {"and": jnp.bitwise_and, "or": jnp.bitwise_or, "xor": jnp.bitwise_xor}.items():
    lowering(f"bitwise_{_name}.Tensor", f"bitwise_{_name}_.Tensor", f"bitwise_{_name}.Tensor_out",
             f"bitwise_{_name}.Scalar", f"bitwise_{_name}_.Scalar", f"bitwise_{_name}.Scalar_out",
             f"bitwise_{_name}.Scalar_Tensor", f"bitwise_{_name}.Scalar_Tensor_out")(_promoted(_fn))

for _name, _dunder, _fn in (("left", "lshift", lax.shift_left), ("right", "rshift", _shift_right)):
    lowering(f"__{_dunder}__.Tensor", f"__{_dunder}__.Scalar", f"__i{_dunder}__.Tensor", f"__i{_dunder}__.Scalar",
             f"__{_dunder}__.Tensor_out", f"__{_dunder}__.Scalar_out",
             f"bitwise_{_name}_shift.Tensor", f"bitwise_{_name}_shift_.Tensor", f"bitwise_{_name}_shift.Tensor_out",
             f"bitwise_{_name}_shift.Tensor_Scalar", f"bitwise_{_name}_shift_.Tensor_Scalar",
             f"bitwise_{_name}_shift.Tensor_Scalar_out", f"bitwise_{_name}_shift.Scalar_Tensor",
             f"bitwise_{_name}_shift.Scalar_Tensor_out")(_promoted(_fn))


# --- selection, min/max, clamping ---------------------------------------------------------------


@lowering("where.self", "where.self_out", "prims::where")
def where(condition, self, other):
    dtype = result_type(self, other)
    return jnp.where(condition, jnp.asarray(self, dtype), jnp.asarray(other, dtype))


@lowering("masked_fill.Scalar", "masked_fill_.Scalar", "masked_fill.Scalar_out", "masked_fill.Tensor",
          "masked_fill_.Tensor", "masked_fill.Tensor_out")
def masked_fill(self, mask, value):
    if mask.dtype != jnp.bool_:
        raise RuntimeError(
            f"masked_fill_ only supports boolean masks, but got mask with dtype {dtypes.to_torch(mask.dtype)}"
        )
    if jnp.ndim(value):
        raise RuntimeError(
            "masked_fill_ only supports a 0-dimensional value tensor, but got tensor with "
            f"{jnp.ndim(value)} dimension(s)."
        )
    return jnp.where(mask, jnp.asarray(value, self.dtype), self)


for _name, _fn in {"maximum": jnp.maximum, "minimum": jnp.minimum, "fmax": jnp.fmax, "fmin": jnp.fmin}.items():
    lowering(_name, f"{_name}.out")(_promoted(_fn))


@lowering("clamp", "clamp_", "clamp.out", "clamp.Tensor", "clamp_.Tensor", "clamp.Tensor_out")
def clamp(self, min=None, max=None):
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")

    def bound(x, low, high):
        x = x if low is None else jnp.maximum(x, low)
        return x if high is None else jnp.minimum(x, high)

    return _math(bound, result_type(self, min, max), self, min, max)


@lowering("clamp_min", "clamp_min_", "clamp_min.out", "clamp_min.Tensor", "clamp_min_.Tensor", "clamp_min.Tensor_out")
def clamp_min(self, min):
    return clamp(self, min, None)


@lowering("clamp_max", "clamp_max_", "clamp_max.out", "clamp_max.Tensor", "clamp_max_.Tensor", "clamp_max.Tensor_out")
def clamp_max(self, max):
    return clamp(self, None, max)


@lowering("relu", "relu_", "relu.out")
def relu(self):
    return jnp.maximum(self, jnp.zeros((), self.dtype))


@lowering("threshold", "threshold_", "threshold.out")
def threshold(self, threshold, value):
    return jnp.where(self <= jnp.asarray(threshold, self.dtype), jnp.asarray(value, self.dtype), self)


@lowering("heaviside", "heaviside_", "heaviside.out")
def heaviside(self, values):
    dtype = result_type(self, values)
    return jnp.where(self == 0, jnp.asarray(values, dtype), (self > 0).astype(dtype))


# --- activation gradients -----------------------------------------------------------------------


@lowering("sigmoid_backward", "sigmoid_backward.grad_input")
def sigmoid_backward(grad_output, output):
    return _math(lambda g, y: g * (1 - y) * y, result_type(grad_output, output), grad_output, output)


@lowering("tanh_backward", "tanh_backward.grad_input")
def tanh_backward(grad_output, output):
    return _math(lambda g, y: g * (1 - y * y), result_type(grad_output, output), grad_output, output)


@lowering("threshold_backward", "threshold_backward.grad_input")
def threshold_backward(grad_output, self, threshold):
    dtype = result_type(grad_output, self)
    return jnp.where(self <= jnp.asarray(threshold, self.dtype), jnp.zeros((), dtype), jnp.asarray(grad_output, dtype))


@lowering("conj_physical.out", "conj_physical_")
def conj_physical(self):
    return jnp.conj(self) if jnp.issubdtype(self.dtype, jnp.complexfloating) else self


@lowering("angle", "angle.out")
def angle(self):
    """The argument of complex numbers; for reals 0 or pi (NaN stays NaN), in the float result dtype."""
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        return jnp.angle(self)
    dtype = _float_result(self)
    x = self.astype(_opmath(dtype))
    result = jnp.where(x < 0, jnp.asarray(np.pi, x.dtype), jnp.zeros((), x.dtype))
    return jnp.where(jnp.isnan(x), x, result).astype(dtype)
