"""torch <-> JAX dtype mapping and PyTorch's type-promotion rules.

float64 policy: float64 (and complex128) tensors are held and computed in 64 bits, never silently
narrowed, so results match the CPU exactly on JAX's CPU and GPU platforms. TPUs have no 64-bit float
units: there XLA emulates float64 in software (slowly) or rejects the program with an error, so
models meant for TPUs should use float32 or bfloat16 (as they do on CUDA for speed).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch


_TORCH_TO_NUMPY_NAME = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.bool: "bool",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


@functools.cache
def to_jax(dtype: torch.dtype) -> Any:
    """The JAX dtype that holds a torch dtype."""
    name = _TORCH_TO_NUMPY_NAME.get(dtype)
    if name is None:
        raise TypeError(f"dtype {dtype} is not supported on the tpu device")
    import ml_dtypes  # noqa: F401  (registers bfloat16/float8 with numpy)
    import jax.numpy as jnp

    return jnp.dtype(name)


@functools.cache
def to_torch(jax_dtype: Any) -> torch.dtype:
    name = np.dtype(jax_dtype).name
    for torch_dtype, numpy_name in _TORCH_TO_NUMPY_NAME.items():
        if numpy_name == name:
            return torch_dtype
    raise TypeError(f"JAX dtype {name} has no torch equivalent")


# c10::ScalarType's numbering: schema defaults such as `ScalarType dtype=long` arrive as these codes.
_SCALAR_TYPE_CODES = {
    0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
    6: torch.float32, 7: torch.float64, 9: torch.complex64, 10: torch.complex128, 11: torch.bool,
    15: torch.bfloat16,
}
_TYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}


def from_scalar_type_code(code: int) -> torch.dtype:
    return _SCALAR_TYPE_CODES[code]


def type_name(dtype: torch.dtype) -> str:
    """The name torch's error messages use for a dtype ("Float", "Long", ...)."""
    return _TYPE_NAMES.get(dtype, str(dtype))


def host_numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype with the same bytes as a torch dtype (for host transfers)."""
    import ml_dtypes  # noqa: F401

    return np.dtype(_TORCH_TO_NUMPY_NAME[dtype])


def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    """c10's combine_categories: a lower-priority group only wins by being of a higher category."""
    if higher is None:
        return lower
    if lower is None or higher.is_complex:
        return higher
    if lower.is_complex:
        return torch.complex128 if higher == torch.float64 else (torch.complex64 if higher.is_floating_point else lower)
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


def python_scalar_dtype(value: Any) -> torch.dtype:
    """The dtype torch gives a Python number (bool, int64, the default float dtype, complex64 or complex128 after it);
    ``value`` may also be the weakly-typed JAX scalar a lowering receives for one (see :func:`scalar_operand`)."""
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if isinstance(value, bool) or kind == "b":
        return torch.bool
    if isinstance(value, int) or kind in ("i", "u"):
        return torch.int64
    if isinstance(value, complex) or kind == "c":
        return torch.complex64 if torch.get_default_dtype() != torch.float64 else torch.complex128
    return torch.get_default_dtype()


@functools.lru_cache(maxsize=None)
def _limits(dtype: np.dtype) -> tuple[bool, float, float, float] | None:
    """``(floating, lowest integer, lowest float, highest)`` torch's checked conversion lets into ``dtype`` (a numpy
    or JAX dtype); ``None`` for bool and complex, which take any number. An unsigned type also takes negative
    integers down to -max (they wrap: uint8's -1 is 255), but no negative float."""
    import jax.numpy as jnp

    if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.complexfloating):
        return None
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return False, -int(info.max) if info.min == 0 else int(info.min), int(info.min), int(info.max)
    info = jnp.finfo(dtype)
    return True, float(info.min), float(info.min), float(info.max)


def fits_every_dtype(value: int | float) -> bool:
    """Whether torch converts the number to any dtype without a complaint (a quick test before
    :func:`scalar_overflows`): an integer of int8's range (uint8 takes -255..255), a float from 0 to 127."""
    return -128 <= value <= 127 if value.__class__ is int else 0.0 <= value <= 127.0


def scalar_overflows(value: int | float, dtype: Any) -> bool:
    """Whether torch refuses to convert the Python number ``value`` to ``dtype`` ("value cannot be converted to
    type ... without overflow", c10's ``overflows``): an integer outside the type's range (an unsigned type takes
    -max..max), a float outside an integer type's range or NaN, a finite number beyond a float type's largest.
    Infinities and NaN fit float types; bool and complex types take anything."""
    limits = _limits(np.dtype(dtype))
    if limits is None:
        return False
    floating, lowest_integer, lowest_float, highest = limits
    if value.__class__ is not float:
        return not lowest_integer <= value <= highest
    if floating and not np.isfinite(value):
        return False
    return not lowest_float <= value <= highest


_WIDE = frozenset((np.dtype("float64"), np.dtype("complex128")))


def needs_wide_scalars(operands: Any, result_dtype: torch.dtype | None = None) -> bool:
    """Whether Python float/complex scalars of an op must be passed in 64 bits: when the op computes
    in 64 bits (a float64/complex128 operand, float64 as torch's default dtype, or a 64-bit ``dtype``
    argument: ``torch.full(size, 0.1, dtype=torch.float64)`` has no operand)."""
    if torch.get_default_dtype() == torch.float64 or result_dtype in (torch.float64, torch.complex128):
        return True
    for operand in operands:
        items = operand if isinstance(operand, tuple) else (operand,)
        for item in items:
            dtype = getattr(item, "dtype", None)
            if dtype is not None and dtype in _WIDE:  # a set: `in` a tuple would compare a dtype with each
                return True
    return False


def scalar_operand(value: Any, wide: bool) -> Any:
    """A Python number as the weakly-typed JAX scalar a lowering receives. A float (complex) is passed
    in 32 (64) bits unless ``wide``: PyTorch casts a Python scalar to the op's computation dtype, so
    nothing is lost, and a program meant for TPU chips (which have no float64) carries no 64-bit value."""
    import jax.numpy as jnp
    from jax._src.lax import lax as lax_internal  # weakly-typed conversion: no public API makes one

    if not wide and isinstance(value, float):
        return lax_internal._convert_element_type(value, np.dtype("float32"), weak_type=True)
    if not wide and isinstance(value, complex):
        return lax_internal._convert_element_type(value, np.dtype("complex64"), weak_type=True)
    return jnp.asarray(value)


def weak_integer(value: Any) -> Any:
    """A traced integer as a lowering receives a Python int: a weakly-typed int64 scalar (an ``int8`` tensor plus
    it stays ``int8``)."""
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(value, np.dtype("int64"), weak_type=True)


def result_type(*operands: Any) -> Any:
    """torch.result_type over JAX arrays/tracers and Python scalars, as a JAX dtype.

    Weakly-typed JAX values (Python scalars passed through jit) count as Python scalars,
    0-d arrays as zero-dim tensors, everything else as dimensioned tensors.
    """
    groups: list[torch.dtype | None] = [None, None, None]  # dimensioned, zero-dim, wrapped scalars
    for operand in operands:
        if operand is None:
            continue
        aval = getattr(operand, "aval", None)
        if aval is None and not hasattr(operand, "dtype"):
            group, dtype = 2, python_scalar_dtype(operand)
        elif getattr(aval, "weak_type", False):
            kind = np.dtype(operand.dtype).kind
            group = 2
            dtype = {"b": torch.bool, "i": torch.int64, "u": torch.int64, "c": torch.complex64}.get(
                kind, torch.get_default_dtype()
            )
        else:
            group, dtype = (0 if operand.ndim else 1), to_torch(operand.dtype)
        groups[group] = dtype if groups[group] is None else torch.promote_types(groups[group], dtype)
    return to_jax(_combine(groups[0], _combine(groups[1], groups[2])))
