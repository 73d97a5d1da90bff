"""Factory ops: arange, linspace, eye, zero tensors.

``arange``'s bounds decide its length, so they are static (one compilation per distinct range);
``linspace``/``logspace``'s end points are traced, their number of steps static. ``full``, ``zeros`` and ``ones``
make their result in one program (torch's composite, ``empty`` then ``fill_``, would run two: the fill reads the
never-written ``empty``). ``scalar_tensor`` and the ``*_like`` factories are torch's composites over ``empty_like``
and ``fill_`` (a sharded tensor's ``zeros_like`` keeps its sharding that way).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .. import dtypes, storage
from ..dispatch import kernel, lowering


def _arange_dtype(start, end, step, dtype):
    if dtype is not None:
        return dtype
    integral = all(isinstance(v, (bool, int)) for v in (start, end, step))
    return torch.int64 if integral else torch.get_default_dtype()


# torch sizes an arange from its bounds truncated to integers when all three are integers and, before
# 2.14, also for any int64 result; otherwise from the bounds as given (arange(0, 5, 1.5, dtype=int64)
# has 5 elements before 2.14, 4 from 2.14; as int32, 4 in both). An integral result's values are
# start + i * step with both truncated (torch._refs.arange).
_INT64_TRUNCATES = torch.__version__ < (2, 14)


def _arange_length(start, end, step, dtype: torch.dtype):
    if step == 0:
        raise RuntimeError("step must be nonzero")
    if (step > 0 and end < start) or (step < 0 and end > start):
        raise RuntimeError("upper bound and larger bound inconsistent with step sign")
    integral_bounds = all(isinstance(v, (bool, int)) for v in (start, end, step))
    if integral_bounds or (_INT64_TRUNCATES and dtype == torch.int64):
        return -((int(start) - int(end)) // int(step))
    return math.ceil((end - start) / step)


def _float_accumulator(dtype: torch.dtype):
    """float64 only for 64-bit outputs (TPUs have no float64 units), float32 otherwise.

    torch's CPU kernels accumulate float32 results in double, so fractional steps may differ in the
    last bit; integral starts and steps are exact below 2**24.
    """
    return jnp.dtype("float64") if dtype in (torch.float64, torch.complex128) else jnp.dtype("float32")


@lowering("full")
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    """``fill_value`` cast to the dtype (as ``fill_`` casts it) in every element; without ``dtype``, the dtype
    torch gives the Python number."""
    return jnp.full(tuple(size), fill_value, dtypes.to_jax(dtype or dtypes.python_scalar_dtype(fill_value)))


@lowering("zeros")
def zeros(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), dtypes.to_jax(dtype or torch.get_default_dtype()))


@lowering("ones")
def ones(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), dtypes.to_jax(dtype or torch.get_default_dtype()))


@lowering("arange.start_step", static=("start", "end", "step"))
def arange_start_step(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    """``start + i * step``; integral dtypes truncate the bounds to integers first, as torch does."""
    dtype = _arange_dtype(start, end, step, dtype)
    length = _arange_length(start, end, step, dtype)
    if dtype.is_floating_point or dtype.is_complex:
        accumulator = _float_accumulator(dtype)
    else:
        accumulator, start, step = jnp.dtype("int64"), int(start), int(step)
    return (start + step * lax.iota(accumulator, length)).astype(dtypes.to_jax(dtype))


@lowering("arange.start", static=("start", "end"))
def arange_start(start, end, dtype=None, layout=None, device=None, pin_memory=None):
    return arange_start_step(start, end, 1, dtype)


@lowering("arange", static=("end",))
def arange(end, dtype=None, layout=None, device=None, pin_memory=None):
    return arange_start_step(0, end, 1, dtype)


def _into(out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if out.shape != value.shape:
        out.resize_(value.shape)
    storage.write(out, storage.read(value))
    return out


@kernel("arange.start_out")
def arange_start_out(start, end, step=1, out=None):
    return _into(out, torch.arange(start, end, step, dtype=out.dtype, device=out.device))


@kernel("arange.out")
def arange_out(end, out=None):
    return _into(out, torch.arange(0, end, 1, dtype=out.dtype, device=out.device))


@lowering("linspace")
def linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    """Evenly spaced values, computed from both ends toward the middle like torch's kernel."""
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    dtype = dtype or torch.get_default_dtype()
    compute, dtype = _float_accumulator(dtype), dtypes.to_jax(dtype)
    start, end = jnp.asarray(start).astype(compute), jnp.asarray(end).astype(compute)
    if steps == 1:
        return jnp.reshape(start, (1,)).astype(dtype)
    step = (end - start) / (steps - 1)
    i = lax.iota(compute, steps)
    values = jnp.where(i < steps // 2, start + step * i, end - step * (steps - 1 - i))
    return values.astype(dtype)


@kernel("linspace.out")
def linspace_out(start, end, steps, out=None):
    return _into(out, torch.linspace(start, end, steps, dtype=out.dtype, device=out.device))


@lowering("logspace")
def logspace(start, end, steps, base=10.0, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = dtype or torch.get_default_dtype()
    exponents = linspace(start, end, steps, torch.float64 if dtype == torch.float64 else torch.float32)
    return jnp.power(jnp.asarray(base, exponents.dtype), exponents).astype(dtypes.to_jax(dtype))


@kernel("logspace.out")
def logspace_out(start, end, steps, base=10.0, out=None):
    return _into(out, torch.logspace(start, end, steps, base, dtype=out.dtype, device=out.device))


def _index_dtype(dtype):
    """The schema default ``dtype=4`` arrives as the integer ScalarType::Long."""
    return dtypes.to_jax(dtype if isinstance(dtype, torch.dtype) else torch.int64)


@lowering("tril_indices", "tril_indices.out")
def tril_indices(row, col, offset=0, dtype=torch.int64, layout=None, device=None, pin_memory=None):
    """The (2, N) coordinates of the lower triangle, row by row (a compile-time constant)."""
    return jnp.asarray(np.stack(np.tril_indices(row, offset, col)), _index_dtype(dtype))


@lowering("triu_indices", "triu_indices.out")
def triu_indices(row, col, offset=0, dtype=torch.int64, layout=None, device=None, pin_memory=None):
    return jnp.asarray(np.stack(np.triu_indices(row, offset, col)), _index_dtype(dtype))


@lowering("eye")
def eye(n, dtype=None, layout=None, device=None, pin_memory=None):
    return eye_m(n, n, dtype)


@lowering("eye.m")
def eye_m(n, m, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m, dtype=dtypes.to_jax(dtype or torch.get_default_dtype()))


@lowering("eye.out")
def eye_out(n):
    """A boolean identity, cast to ``out``'s dtype on store."""
    return jnp.eye(n, dtype=jnp.bool_)


@lowering("eye.m_out")
def eye_m_out(n, m):
    return jnp.eye(n, m, dtype=jnp.bool_)


@lowering("_efficientzerotensor", "_efficientzerotensor.out")
def efficient_zero_tensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(size, dtypes.to_jax(dtype or torch.get_default_dtype()))
