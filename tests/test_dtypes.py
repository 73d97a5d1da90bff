"""Every supported dtype survives cpu -> tpu -> cpu bit-exactly; on-device casts round like CPU; float64 policy."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_same
from hf_tpu.backend import runtime


def _extremes(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.tensor([True, False, True])
    if dtype.is_complex:
        return torch.tensor([1 + 2j, -3.5e30 - 1e-30j, complex(math.inf, -0.0), complex(math.nan, 1)], dtype=dtype)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        values = [0.0, -0.0, 1.0, -2.5, info.max, info.min, info.tiny, info.smallest_normal / 4, info.eps,
                  math.inf, -math.inf, math.nan]
        return torch.tensor(values, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    values = [0, 1, -1 if info.min else 2, info.max, info.min, info.max // 3]
    if dtype == torch.int64:
        values += [2**31, -(2**31) - 1, 2**40 + 7, 2**53 + 1, -(2**62) - 3]
    return torch.tensor(values, dtype=dtype)


ROUND_TRIP_DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
]


def _same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    if expected.dtype == torch.bool:
        return torch.equal(actual, expected)
    if expected.dtype.is_complex:
        return _same_bits(torch.view_as_real(actual), torch.view_as_real(expected))
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.element_size()]
    return torch.equal(actual.view(carrier), expected.view(carrier))


@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=str)
def test_round_trip_is_bit_exact(dtype):
    host = _extremes(dtype)
    device = host.to("tpu")
    assert device.dtype == dtype
    back = device.cpu()
    assert back.dtype == dtype
    assert _same_bits(back, host), (back, host)


@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=str)
def test_round_trip_through_copy_(dtype):
    host = _extremes(dtype)
    device = torch.empty(host.shape, dtype=dtype, device="tpu").copy_(host)
    assert _same_bits(torch.empty_like(host).copy_(device), host)


@pytest.mark.parametrize(
    "source, target",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.int32),
        (torch.float32, torch.uint8),
        (torch.int64, torch.float32),
        (torch.int32, torch.int8),
        (torch.float32, torch.bool),
        (torch.bool, torch.float32),
        (torch.float32, torch.complex64),
        (torch.complex64, torch.float32),
        (torch.float64, torch.float32),
    ],
    ids=str,
)
def test_on_device_cast_matches_cpu(source, target):
    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(257, generator=generator, dtype=torch.float64) * 100).to(source)
    if source.is_floating_point and target == torch.uint8:
        values = values.abs().clamp(max=255)  # out-of-range float -> uint8 is undefined behaviour in C++
    assert_same(values.to("tpu").to(target), values.to(target), rtol=0, atol=0)


def test_host_to_device_cast_rounds_like_cpu():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 1e3
    assert_same(values.to("tpu", torch.bfloat16), values.to(torch.bfloat16), rtol=0, atol=0)
    assert_same(values.to("tpu", torch.float16), values.to(torch.float16), rtol=0, atol=0)


def test_float64_is_held_in_64_bits():
    from hf_tpu.backend import dtypes

    assert str(dtypes.to_jax(torch.float64)) == "float64"
    assert str(dtypes.to_jax(torch.complex128)) == "complex128"


def test_float64_arithmetic_is_exact_off_tpu():
    if runtime.backing_platform() == "tpu":
        pytest.skip("float64 policy: TPUs emulate float64 in software or reject it (see dtypes.py)")
    third = torch.tensor([1 / 3, 1e-300, 2.0**60 + 1.0], dtype=torch.float64)
    device = third.to("tpu")
    assert device.dtype == torch.float64
    assert_same(device * 3, third * 3, rtol=0, atol=0)
    assert_same(device + 1e-16, third + 1e-16, rtol=0, atol=0)
    assert device[0].item() == 1 / 3


def test_float64_default_dtype_factories_keep_float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert torch.ones(2, device="tpu").dtype == torch.float64
        assert torch.tensor([0.1], device="tpu").dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)


def test_factories_with_a_64_bit_dtype_take_their_scalars_in_64_bits():
    if runtime.backing_platform() == "tpu":
        pytest.skip("float64 policy: TPUs emulate float64 in software or reject it (see dtypes.py)")
    for make in (lambda **device: torch.full((3,), 0.1, dtype=torch.float64, **device),
                 lambda **device: torch.linspace(0, 0.1, 5, dtype=torch.float64, **device),
                 lambda **device: torch.full((2,), 1 / 3 + 1j, dtype=torch.complex128, **device)):
        assert_same(make(device="tpu"), make(), rtol=0, atol=0)


def test_full_infers_torchs_dtype_from_its_fill_value():
    for value in (True, 7, 2**40, -1.5, 1 + 2j):
        for dtype in (None, torch.int32, torch.bfloat16, torch.bool, torch.complex64):
            if isinstance(value, complex) and dtype in (torch.int32, torch.bfloat16, torch.bool):
                continue  # the CPU refuses these
            if value == 2**40 and dtype in (torch.int32, torch.bfloat16):
                continue
            expected = torch.full((2, 3), value, dtype=dtype)
            result = torch.full((2, 3), value, dtype=dtype, device="tpu")
            assert result.dtype == expected.dtype
            assert_same(result, expected, rtol=0, atol=0)
