"""Bessel functions of the first and second kind, modified Bessel K, and the Airy function Ai.

Each function is a few Chebyshev expansions, one per range, in a variable that makes the piece
smooth: near zero a power series in ``x**2`` (after the ``log(x)`` and ``1/x`` singularities are
taken out), far from zero the amplitude of the asymptotic form (``sqrt(2/(pi x))`` times a phase,
or ``exp(-x)/sqrt(x)``) as a function of ``1/x``. The coefficients are fitted once, on the host,
to SciPy's double-precision functions at Chebyshev nodes, and the expansions are evaluated in the
input's own precision (float32 for half types), so float32 inputs need no float64 on the chip.

Conventions follow torch: ``J0``, ``J1`` and ``Ai`` take any real ``x`` (NaN at ±inf); ``Y0``,
``Y1``, ``K0``, ``K1`` are NaN for ``x < 0`` and ``-inf``/``inf`` at zero; float32 ``Ai`` is 0
beyond x = 25.77, where torch's single-precision kernel stops.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np

from ..dispatch import lowering
from .pointwise import _float_result, _math

_DEGREE = 40  # fitted degree; trailing coefficients below double precision are dropped
_AIRY_ZETA0 = 2 / 3 * 2 ** 1.5  # zeta = 2/3 |x|^(3/2) at |x| = 2, where Ai's outer pieces start


def _fit(fn) -> tuple[float, ...]:
    """Chebyshev coefficients of ``fn`` on [-1, 1] (numpy float64 in and out), trailing tiny ones dropped."""
    coefficients = np.polynomial.chebyshev.chebinterpolate(fn, _DEGREE)
    keep = np.nonzero(np.abs(coefficients) > 1e-17 * np.abs(coefficients).max())[0][-1] + 1
    return tuple(float(c) for c in coefficients[:keep])


def _clenshaw(coefficients, t):
    """``sum(c_k T_k(t))`` by Clenshaw's recurrence."""
    b1 = b2 = jnp.zeros_like(t)
    for c in reversed(coefficients[1:]):
        b1, b2 = c + 2 * t * b1 - b2, b1
    return coefficients[0] + t * b1 - b2


def _near(t):
    """[-1, 1] -> a in [0, 8] with a**2 linear in t (the series variable of J and Y)."""
    return np.sqrt(32 * (t + 1))


def _far(t):
    """[-1, 1] -> a = 8 / s for s in (0, 1]: the asymptotic variable of J and Y."""
    return 8 / ((t + 1) / 2)


def _hankel_amplitudes(order, a):
    """P and Q of ``J = sqrt(2/(pi a)) (P cos chi - Q sin chi)``, ``Y = ... (P sin chi + Q cos chi)``."""
    from scipy import special

    chi = a - (2 * order + 1) * math.pi / 4
    j, y = special.jv(order, a), special.yv(order, a)
    scale = np.sqrt(math.pi * a / 2)
    return scale * (j * np.cos(chi) + y * np.sin(chi)), scale * (y * np.cos(chi) - j * np.sin(chi))


@functools.cache
def _coefficients(name: str) -> tuple[float, ...]:
    from scipy import special

    def k_near(t):
        return np.sqrt(2 * (t + 1))  # [0, 2], a**2 linear in t

    def k_far(t):
        return 2 / ((t + 1) / 2)  # a = 2 / s, s in (0, 1]

    def airy_far(t):
        return (1.5 * _AIRY_ZETA0 / ((t + 1) / 2)) ** (2 / 3)  # |x| from zeta = zeta0 / s

    fns = {
        "j0_near": lambda t: special.j0(_near(t)),
        "j1_near": lambda t: special.j1(_near(t)) / _near(t),
        "y0_near": lambda t: special.y0(_near(t)) - 2 / math.pi * np.log(_near(t)) * special.j0(_near(t)),
        "y1_near": lambda t: (special.y1(_near(t)) - 2 / math.pi * np.log(_near(t)) * special.j1(_near(t))
                              + 2 / (math.pi * _near(t))) / _near(t),
        "p0_far": lambda t: _hankel_amplitudes(0, _far(t))[0],
        "q0_far": lambda t: _hankel_amplitudes(0, _far(t))[1],
        "p1_far": lambda t: _hankel_amplitudes(1, _far(t))[0],
        "q1_far": lambda t: _hankel_amplitudes(1, _far(t))[1],
        "k0_near": lambda t: special.k0(k_near(t)) + np.log(k_near(t) / 2) * special.i0(k_near(t)),
        "k1_near": lambda t: (special.k1(k_near(t)) - np.log(k_near(t) / 2) * special.i1(k_near(t))
                              - 1 / k_near(t)) / k_near(t),
        "k0_far": lambda t: special.k0e(k_far(t)) * np.sqrt(k_far(t)),
        "k1_far": lambda t: special.k1e(k_far(t)) * np.sqrt(k_far(t)),
        "ai_near": lambda t: special.airy(2 * t)[0],
        "ai_right": lambda t: special.airye(airy_far(t))[0] * airy_far(t) ** 0.25,
        "ai_left_p": lambda t: _airy_amplitudes(airy_far(t))[0],
        "ai_left_q": lambda t: _airy_amplitudes(airy_far(t))[1],
    }
    return _fit(fns[name])


def _airy_amplitudes(a):
    """P and Q of ``Ai(-a) = (sin(theta) P - cos(theta) Q) / (sqrt(pi) a**(1/4))``, theta = zeta + pi/4."""
    from scipy import special

    ai, _, bi, _ = special.airy(-a)
    theta = 2 / 3 * a ** 1.5 + math.pi / 4
    scale = np.sqrt(math.pi) * a ** 0.25
    return scale * (ai * np.sin(theta) + bi * np.cos(theta)), scale * (bi * np.sin(theta) - ai * np.cos(theta))


def _series(name, a, top):
    """A near-zero expansion in ``a**2`` over [0, top] (clipped: the other branch serves larger a)."""
    return _clenshaw(_coefficients(name), jnp.minimum(a * a, top * top) * (2 / (top * top)) - 1)


def _reciprocal(name, a, bottom):
    """A far expansion in ``bottom / a`` over a >= bottom (clipped: the other branch serves smaller a)."""
    return _clenshaw(_coefficients(name), 2 * bottom / jnp.maximum(a, bottom) - 1)


def _hankel(order, a, second_kind):
    """J_order(a) or Y_order(a) for a > 8 from the fitted Hankel amplitudes."""
    p, q = _reciprocal(f"p{order}_far", a, 8.0), _reciprocal(f"q{order}_far", a, 8.0)
    chi = a - (2 * order + 1) * (math.pi / 4)
    phase = p * jnp.sin(chi) + q * jnp.cos(chi) if second_kind else p * jnp.cos(chi) - q * jnp.sin(chi)
    return jnp.sqrt(2 / (math.pi * jnp.maximum(a, 8.0))) * phase


def _j0(x):
    a = jnp.abs(x)
    return jnp.where(a <= 8, _series("j0_near", a, 8.0), _hankel(0, a, False))


def _j1(x):
    a = jnp.abs(x)
    far = _hankel(1, a, False)
    return jnp.where(a <= 8, x * _series("j1_near", a, 8.0), jnp.where(x < 0, -far, far))


def _y0(x):
    near = 2 / math.pi * jnp.log(x) * _j0(x) + _series("y0_near", x, 8.0)
    return jnp.where(x < 0, jnp.nan, jnp.where(x <= 8, near, _hankel(0, x, True)))


def _y1(x):
    safe = jnp.where(x == 0, 1, x)
    near = 2 / math.pi * (jnp.log(safe) * _j1(safe) - 1 / safe) + safe * _series("y1_near", safe, 8.0)
    result = jnp.where(x <= 8, near, _hankel(1, x, True))
    return jnp.where(x < 0, jnp.nan, jnp.where(x == 0, -jnp.inf, result))


def _k(order, x, scaled):
    """K_order(x), or ``exp(x) K_order(x)`` if ``scaled``."""
    safe = jnp.where(x == 0, 1, x)
    if order == 0:
        near = -jnp.log(safe / 2) * jss.i0(safe) + _series("k0_near", safe, 2.0)
    else:
        near = jnp.log(safe / 2) * jss.i1(safe) + 1 / safe + safe * _series("k1_near", safe, 2.0)
    far = _reciprocal(f"k{order}_far", x, 2.0) / jnp.sqrt(jnp.maximum(x, 2.0))
    if scaled:
        near = near * jnp.exp(jnp.minimum(x, 2.0))
    else:
        far = far * jnp.exp(-x)
    result = jnp.where(x <= 2, near, far)
    return jnp.where(x < 0, jnp.nan, jnp.where(x == 0, jnp.inf, result))


def _airy_ai(x):
    a = jnp.maximum(jnp.abs(x), 2.0)
    zeta = 2 / 3 * a * jnp.sqrt(a)
    t = 2 * _AIRY_ZETA0 / zeta - 1
    right = jnp.exp(-zeta) * _clenshaw(_coefficients("ai_right"), t) / jnp.sqrt(jnp.sqrt(a))
    theta = zeta + math.pi / 4
    left = (jnp.sin(theta) * _clenshaw(_coefficients("ai_left_p"), t)
            - jnp.cos(theta) * _clenshaw(_coefficients("ai_left_q"), t)) / (math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(a)))
    near = _clenshaw(_coefficients("ai_near"), jnp.clip(x, -2.0, 2.0) / 2)
    result = jnp.where(x < -2, left, jnp.where(x <= 2, near, right))
    if x.dtype != jnp.float64:
        result = jnp.where(x > 25.77, 0, result)
    return jnp.where(jnp.isinf(x), jnp.nan, result)


def _register(name, fn):
    def lower(self):
        return _math(fn, _float_result(self), self)

    lower.__name__ = name
    lowering(f"special_{name}", f"special_{name}.out")(lower)


_register("bessel_j0", _j0)
_register("bessel_j1", _j1)
_register("bessel_y0", _y0)
_register("bessel_y1", _y1)
_register("modified_bessel_k0", lambda x: _k(0, x, False))
_register("modified_bessel_k1", lambda x: _k(1, x, False))
_register("scaled_modified_bessel_k0", lambda x: _k(0, x, True))
_register("scaled_modified_bessel_k1", lambda x: _k(1, x, True))
_register("airy_ai", _airy_ai)
