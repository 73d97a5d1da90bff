"""Errors are clear and CUDA-like: missing lowerings, mixed devices, bad device indices, unsupported dtypes."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import assert_same

MIXED_DEVICES = re.escape(
    "Expected all tensors to be on the same device, but found at least two devices, tpu:0 and cpu!"
)


def test_op_without_lowering_names_the_aten_op():
    # Sparse layouts are not supported on tpu: the conversion has no lowering and no decomposition.
    with pytest.raises(NotImplementedError, match=re.escape("The operator 'aten::_to_sparse'")):
        torch.ones(2, 2, device="tpu").to_sparse()


MIXED_OPS = {
    "add": lambda d, c: d + c,
    "add_reversed": lambda d, c: c + d,
    "mul_": lambda d, c: d.mul_(c),
    "mm": lambda d, c: d @ c,
    "mm_reversed": lambda d, c: c @ d,
    "cat": lambda d, c: torch.cat([d, c]),
    "where": lambda d, c: torch.where(c > 0, d, d),
}


@pytest.mark.parametrize("op", MIXED_OPS.values(), ids=MIXED_OPS.keys())
def test_mixing_tpu_and_cpu_tensors_raises_like_cuda(op):
    with pytest.raises(RuntimeError, match=MIXED_DEVICES):
        op(torch.ones(2, 2, device="tpu"), torch.ones(2, 2))


ZERO_DIM_OPS = {
    "add": lambda t, s: t + s,
    "add_reversed": lambda t, s: s + t,
    "mul_": lambda t, s: t.mul_(s),
    "int_tensor_float_scalar": lambda t, s: t.long() * s,
    "double_scalar_keeps_float32": lambda t, s: t * s.double(),
    "where": lambda t, s: torch.where(t > 1, t, s),
}


@pytest.mark.parametrize("op", ZERO_DIM_OPS.values(), ids=ZERO_DIM_OPS.keys())
def test_zero_dim_cpu_tensor_joins_a_device_op_like_cuda(op):
    tensor = torch.arange(6.0).reshape(2, 3)
    scalar = torch.tensor(2.5)
    assert_same(op(tensor.to("tpu"), scalar), op(tensor, scalar))


def test_copy_between_devices_is_not_a_device_mismatch():
    device = torch.zeros(3, device="tpu")
    device.copy_(torch.ones(3))
    host = torch.zeros(3).copy_(device)
    assert host.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "action",
    [
        lambda index: torch.zeros(2).to(f"tpu:{index}"),
        lambda index: torch.zeros(2, device=f"tpu:{index}"),
        lambda index: torch.arange(3, device=f"tpu:{index}"),
        lambda index: torch.eye(2, device=f"tpu:{index}"),
        lambda index: torch.tpu.get_device_name(index),
    ],
    ids=["to", "factory", "arange", "eye", "device_name"],
)
def test_device_index_past_the_last_device_raises(action):
    index = torch.tpu.device_count()
    with pytest.raises(RuntimeError, match=f"tpu:{index}"):
        action(index)


def test_unsupported_dtype_raises_type_error_naming_it():
    with pytest.raises(TypeError, match="complex32"):
        torch.zeros(2, dtype=torch.complex32).to("tpu")


def _raise_in_hook(*args):
    raise RuntimeError("raised by a hook")


HOOKS = {
    "tensor_hook_on_leaf": lambda leaf, out: leaf.register_hook(_raise_in_hook),
    "tensor_hook": lambda leaf, out: out.register_hook(_raise_in_hook),
    "node_prehook": lambda leaf, out: out.grad_fn.register_prehook(_raise_in_hook),
    "node_hook": lambda leaf, out: out.grad_fn.register_hook(_raise_in_hook),
    "accumulate_grad_prehook": lambda leaf, out: torch.autograd.graph.get_gradient_edge(leaf).node.register_prehook(
        _raise_in_hook
    ),
}


@pytest.mark.parametrize(
    "hook, entry",
    [(hook, "backward") for hook in HOOKS] + [(hook, "grad") for hook in HOOKS if hook != "accumulate_grad_prehook"],
)
def test_exception_in_an_autograd_hook_is_raised_not_an_abort(hook, entry):
    """torch's C++ device guard calls into Python while the hook's exception is pending; that used to
    end in std::terminate (the whole process aborted)."""
    leaf = torch.randn(3, device="tpu", requires_grad=True)
    out = leaf * 2
    HOOKS[hook](leaf, out)
    with pytest.raises(RuntimeError, match="raised by a hook"):
        if entry == "backward":
            out.sum().backward()
        else:
            torch.autograd.grad(out.sum(), leaf)
    fresh = torch.randn(3, device="tpu", requires_grad=True)
    (fresh * 3).sum().backward()  # the device and the engine still work
    assert_same(fresh.grad, torch.full((3,), 3.0))


def _int8(device):
    return torch.ones(3, dtype=torch.int8, device=device)


def _half(device):
    return torch.ones(3, dtype=torch.float16, device=device)


# Scalars that do not fit the type an op computes in: some CPU kernels refuse them, others wrap them around
SCALAR_OVERFLOWS = {
    "fill_": (lambda d: _int8(d).fill_(200), "int8_t"),
    "full": (lambda d: torch.full((2,), 300, dtype=torch.uint8, device=d), "uint8_t"),
    "full_default_dtype": (lambda d: torch.full((2,), 1e300, device=d), "float"),
    "masked_fill_half": (lambda d: _half(d).masked_fill(torch.ones(3, dtype=torch.bool, device=d), -1e9), "Half"),
    "clamp": (lambda d: torch.ones(3, dtype=torch.int16, device=d).clamp(max=100000), "int16_t"),
    "where": (lambda d: torch.where(torch.ones(3, dtype=torch.bool, device=d), _int8(d), 300), "int8_t"),
    "alpha": (lambda d: torch.ones(3, dtype=torch.int32, device=d).add(1, alpha=2 ** 40), "int"),
    "index_fill": (lambda d: _int8(d).index_fill(0, torch.tensor([0], device=d), 300), "int8_t"),
    "fill_nan_into_int": (lambda d: _int8(d).fill_(float("nan")), "int8_t"),
    "wrapped_add": (lambda d: _int8(d) + 300, None),
    "wrapped_eq": (lambda d: torch.ops.aten.eq.Scalar(_int8(d), 300), None),
    "wrapped_and": (lambda d: _int8(d) & 300, None),
    "unsigned_takes_minus_one": (lambda d: torch.ones(3, dtype=torch.uint8, device=d).fill_(-1), None),
    "half_takes_infinity": (lambda d: _half(d).fill_(float("-inf")), None),
}


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("op, refused_type", SCALAR_OVERFLOWS.values(), ids=SCALAR_OVERFLOWS.keys())
def test_a_scalar_the_op_cannot_convert_is_refused_as_on_cpu(op, refused_type, mode):
    """Where CPU refuses a number (no silent wrap-around or infinity), tpu raises CPU's error; where CPU wraps it
    into a tensor and computes, tpu gives the same values."""
    if refused_type is None:
        expected = op("cpu")
        torch.tpu.set_eager_mode(mode)
        try:
            assert_same(op("tpu"), expected, rtol=0, atol=0)
        finally:
            torch.tpu.set_eager_mode("strict")
        return
    message = re.escape(f"value cannot be converted to type {'c10::' if refused_type == 'Half' else ''}"
                        f"{refused_type} without overflow")
    with pytest.raises(RuntimeError, match=message):
        op("cpu")
    torch.tpu.set_eager_mode(mode)
    try:
        with pytest.raises(RuntimeError, match=message):
            op("tpu")
    finally:
        torch.tpu.set_eager_mode("strict")
