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
