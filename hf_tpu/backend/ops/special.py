"""Special functions: gamma family, Bessel functions, error-function relatives, zeta, polynomials.

Like the other elementwise ops, half-precision inputs are computed in float32 and rounded once,
and integer inputs give the default float dtype. Most are ``jax.scipy.special`` functions; torch's
conventions at poles and edges (``digamma(0) = -inf``, ``sinc(0) = 1``) are applied on top.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jss
from jax import lax

from ..dispatch import lowering
from ..dtypes import result_type
from .pointwise import _binary_float, _float_result, _math, _unary_float


def _unary(names, fn):
    """Registers ``fn`` for the functional, in-place and ``out=`` overloads of each name."""
    for name in names:
        overloads = [name, f"{name}.out"] + ([f"{name}_"] if not name.startswith("special_") else [])
        lowering(*overloads)(_unary_float(fn))


def _digamma(x):
    """torch: ±inf at zero (sign opposite to the zero's), NaN at negative integers."""
    return jnp.where(x == 0, jnp.copysign(jnp.full_like(x, jnp.inf), -x), jss.digamma(x))


def _i1(x):
    return jss.i1(x)


def _spherical_bessel_j0(x):
    safe = jnp.where(x == 0, jnp.ones_like(x), x)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)


def _zeta(s, q):
    """Hurwitz zeta; ``jss.zeta`` is only right for q > 0, so terms ``(q + k)**-s`` are summed until
    ``q + k >= 1`` first (as Cephes, which torch uses, does): poles give inf, non-integer ``s``
    with negative ``q`` NaN."""
    s, q = jnp.broadcast_arrays(s, q)

    def shifting(q, count):
        return (q < 1) & jnp.isfinite(q) & (count < 1 << 16)

    def body(state):
        q, total, count = state
        shift = shifting(q, count)
        total = total + jnp.where(shift, q ** -s, jnp.zeros_like(q))
        return jnp.where(shift, q + 1, q), total, count + 1

    q, total, _ = lax.while_loop(lambda state: jnp.any(shifting(state[0], state[2])), body,
                                 (q, jnp.zeros_like(q), jnp.zeros((), jnp.int32)))
    return total + jss.zeta(s, q)


_unary(("i0", "special_modified_bessel_i0"), jss.i0)
_unary(("special_i0e",), jss.i0e)
_unary(("special_i1", "special_modified_bessel_i1"), _i1)
_unary(("special_i1e",), jss.i1e)
_unary(("lgamma",), jss.gammaln)
_unary(("digamma",), _digamma)
_unary(("special_ndtri",), jss.ndtri)
_unary(("special_log_ndtr",), jss.log_ndtr)
_unary(("special_erfcx",), jss.erfcx)
_unary(("special_entr",), jss.entr)
_unary(("sinc",), jnp.sinc)
_unary(("special_spherical_bessel_j0",), _spherical_bessel_j0)


def _trigamma(x):
    """``polygamma(1, x)`` as torch computes it: reflection ``pi**2 / sin(pi x)**2 - trigamma(1 - x)``
    below 1/2 (so near the poles the rounding of ``pi * x`` shows as on CPU), six steps of the
    recurrence, then the asymptotic series."""
    reflect = x < 0.5
    sin_pi_x = jnp.sin(math.pi * x)
    y = jnp.where(reflect, 1 - x, x)
    result = sum(1 / ((y + i) * (y + i)) for i in range(6))
    y = y + 6
    inverse_square = 1 / (y * y)
    result = result + (1 + 1 / (2 * y) + inverse_square * (1 / 6 - inverse_square * (1 / 30 - inverse_square / 42))) / y
    return jnp.where(reflect, math.pi ** 2 / (sin_pi_x * sin_pi_x) - result, result)


@lowering("polygamma", "polygamma.out")
def polygamma(n, self):
    if n < 0:
        raise RuntimeError("polygamma(n, x) does not support negative n.")
    if n == 0:
        return _math(_digamma, _float_result(self), self)
    if n == 1:
        return _math(_trigamma, _float_result(self), self)
    sign = 1.0 if n % 2 else -1.0
    factorial = math.factorial(n)
    return _math(lambda x: sign * factorial * _zeta(jnp.asarray(n + 1, x.dtype), x), _float_result(self), self)


@lowering("polygamma_")
def polygamma_(self, n):
    return polygamma(n, self)


@lowering("mvlgamma", "mvlgamma_", "mvlgamma.out")
def mvlgamma(self, p):
    if p < 1:
        raise RuntimeError("p has to be greater than or equal to 1")

    def fn(x):
        offsets = jnp.arange(p, dtype=x.dtype) / 2
        return jnp.sum(jss.gammaln(x[..., None] - offsets), axis=-1) + p * (p - 1) / 4 * math.log(math.pi)

    return _math(fn, _float_result(self), self)


@lowering("logit", "logit_", "logit.out")
def logit(self, eps=None):
    def fn(x):
        if eps is not None:
            x = jnp.clip(x, jnp.asarray(eps, x.dtype), jnp.asarray(1 - eps, x.dtype))
        return jnp.log(x / (1 - x))

    return _math(fn, _float_result(self), self)


def _binary_overloads(name, inplace=True):
    names = [name, f"{name}.out", f"{name}.self_scalar", f"{name}.self_scalar_out", f"{name}.other_scalar",
             f"{name}.other_scalar_out"]
    return names + ([f"{name}_"] if inplace else [])


lowering(*_binary_overloads("special_xlog1py", inplace=False))(
    _binary_float(lambda x, y: jnp.where(jnp.isnan(y), jnp.nan, jss.xlog1py(x, y))))
lowering(*_binary_overloads("special_zeta", inplace=False))(_binary_float(_zeta))
lowering("igamma", "igamma_", "igamma.out")(_binary_float(jss.gammainc))
lowering("igammac", "igammac_", "igammac.out")(_binary_float(jss.gammaincc))


@lowering("nextafter", "nextafter_", "nextafter.out")
def nextafter(self, other):
    dtype = result_type(self, other)
    return jnp.nextafter(self.astype(dtype), other.astype(dtype))


@lowering("gcd", "gcd_", "gcd.out")
def gcd(self, other):
    dtype = result_type(self, other)
    return jnp.gcd(self.astype(dtype), other.astype(dtype))


@lowering("lcm", "lcm_", "lcm.out")
def lcm(self, other):
    dtype = result_type(self, other)
    return jnp.abs(jnp.lcm(self.astype(dtype), other.astype(dtype)))


@lowering("frexp.Tensor", "frexp.Tensor_out")
def frexp(self):
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        raise RuntimeError("torch.frexp() only supports floating-point dtypes")
    mantissa, exponent = jnp.frexp(self)
    return mantissa.astype(self.dtype), exponent.astype(jnp.int32)


# --- orthogonal polynomials: the three-term recurrences, run to the largest degree asked ----------


def _recurrence(x, n, p0, p1, step):
    """``P_n(x)`` from ``P_0``, ``P_1`` and ``P_{k+1} = step(k, x, P_k, P_{k-1})``; NaN-free for n < 0 (0)."""
    n = jnp.broadcast_to(n, jnp.broadcast_shapes(x.shape, n.shape))
    x, p0, p1 = (jnp.broadcast_to(v, n.shape) for v in (x, p0, p1))
    top = jnp.max(n) if n.size else jnp.zeros((), n.dtype)

    def body(state):
        k, previous, current, result = state
        following = step(k.astype(x.dtype), x, current, previous)
        result = jnp.where(n == k + 1, following, result)
        return k + 1, current, following, result

    result = jnp.where(n == 0, p0, jnp.where(n == 1, p1, jnp.zeros_like(x)))
    state = (jnp.ones((), n.dtype), p0, p1, result)
    return lax.while_loop(lambda s: s[0] < top, body, state)[3]


def _polynomial(name, p0, p1, step):
    def fn(x, n):
        return _recurrence(x, jnp.trunc(n).astype(jnp.int64), p0(x), p1(x), step)

    def lower(x, n):
        dtype = _float_result(x, n)
        return _math(fn, dtype, x, n)

    lowering(f"special_{name}", f"special_{name}.out", f"special_{name}.x_scalar", f"special_{name}.x_scalar_out",
             f"special_{name}.n_scalar", f"special_{name}.n_scalar_out")(lower)


def _ones(x):
    return jnp.ones_like(x)


_polynomial("chebyshev_polynomial_t", _ones, lambda x: x, lambda k, x, p, q: 2 * x * p - q)
_polynomial("chebyshev_polynomial_u", _ones, lambda x: 2 * x, lambda k, x, p, q: 2 * x * p - q)
_polynomial("chebyshev_polynomial_v", _ones, lambda x: 2 * x - 1, lambda k, x, p, q: 2 * x * p - q)
_polynomial("chebyshev_polynomial_w", _ones, lambda x: 2 * x + 1, lambda k, x, p, q: 2 * x * p - q)
_polynomial("shifted_chebyshev_polynomial_t", _ones, lambda x: 2 * x - 1,
            lambda k, x, p, q: 2 * (2 * x - 1) * p - q)
_polynomial("shifted_chebyshev_polynomial_u", _ones, lambda x: 4 * x - 2,
            lambda k, x, p, q: 2 * (2 * x - 1) * p - q)
_polynomial("shifted_chebyshev_polynomial_v", _ones, lambda x: 4 * x - 3,
            lambda k, x, p, q: 2 * (2 * x - 1) * p - q)
_polynomial("shifted_chebyshev_polynomial_w", _ones, lambda x: 4 * x - 1,
            lambda k, x, p, q: 2 * (2 * x - 1) * p - q)
_polynomial("hermite_polynomial_h", _ones, lambda x: 2 * x, lambda k, x, p, q: 2 * x * p - 2 * k * q)
_polynomial("hermite_polynomial_he", _ones, lambda x: x, lambda k, x, p, q: x * p - k * q)
_polynomial("laguerre_polynomial_l", _ones, lambda x: 1 - x,
            lambda k, x, p, q: ((2 * k + 1 - x) * p - k * q) / (k + 1))
_polynomial("legendre_polynomial_p", _ones, lambda x: x,
            lambda k, x, p, q: ((2 * k + 1) * x * p - k * q) / (k + 1))
