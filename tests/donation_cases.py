"""Run by tests/test_donation.py in a process of its own. In-place updates give their old array to XLA when nothing
else holds it: the update writes into the tensor's own memory (as on CPU), and a holder that forbids it (a JAX
array, another storage) keeps its values, the copy counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_tpu
from conftest import assert_same
from hf_tpu.backend import storage


def _address(tensor: torch.Tensor) -> int:
    buffer = storage.buffer_of(tensor)
    return (buffer.array if buffer.array is not None else buffer.materialize()).unsafe_buffer_pointer()


def _copies() -> int:
    return torch.tpu.memory_stats()["in_place_copies"]


UPDATES = {
    "add_": lambda x: x.add_(1),
    "mul_scalar": lambda x: x.mul_(0.5),
    "addcmul_": lambda x: x.addcmul_(torch.full_like(x, 0.5), torch.full_like(x, 2.0)),
    "clamp_": lambda x: x.clamp_(min=0.1),
    "row_write": lambda x: x[3].fill_(7.0),
    "column_slice_write": lambda x: x[:, 2:5].mul_(3),
    "setitem": lambda x: x.__setitem__((slice(None), 7), -1.0),
}


@pytest.mark.parametrize("name", UPDATES)
def test_an_update_writes_into_the_tensors_own_memory(name):
    torch.manual_seed(0)
    cpu = torch.rand(16, 32)
    x = cpu.to("tpu")
    UPDATES[name](x)  # compiled (a first update may also make the array the storage keeps)
    UPDATES[name](cpu)
    address, copies = _address(x), _copies()
    UPDATES[name](x)
    UPDATES[name](cpu)
    assert _address(x) == address
    assert _copies() == copies
    assert_same(x, cpu)


def test_a_foreach_update_donates_every_tensor_of_its_list():
    tensors = [torch.rand(8, 8, device="tpu") for _ in range(3)]
    torch._foreach_mul_(tensors, 2.0)
    addresses, copies = [_address(t) for t in tensors], _copies()
    torch._foreach_add_(tensors, [torch.ones(8, 8, device="tpu")] * 3)
    assert [_address(t) for t in tensors] == addresses
    assert _copies() == copies


def test_a_jax_array_holding_the_old_value_keeps_it_and_the_copy_is_counted():
    x = torch.zeros(4, 4, device="tpu")
    held = hf_tpu.to_jax(x)
    copies = _copies()
    x.add_(1)
    assert _copies() == copies + 1
    assert float(held.sum()) == 0.0
    assert x.sum().item() == 16.0


@pytest.mark.parametrize("name", ["row_write", "column_slice_write", "setitem"])
def test_a_jax_array_holding_the_old_value_keeps_it_through_a_view_write(name):
    """A write into a view of a storage (written back into the storage's array) with another holder of that array:
    the holder keeps its values, the copy counted."""
    x = torch.zeros(16, 32, device="tpu")
    held = hf_tpu.to_jax(x)
    copies = _copies()
    UPDATES[name](x)
    assert _copies() > copies
    assert float(held.sum()) == 0.0 and not held.is_deleted()


def test_a_view_sees_the_update_and_another_storage_does_not():
    x = torch.zeros(4, 4, device="tpu")
    view, other = x[1:], x.clone()
    x.add_(2)
    assert_same(view, torch.full((3, 4), 2.0))
    assert_same(other, torch.zeros(4, 4))


def test_an_update_of_a_tensor_autograd_saved_fails_at_backward_as_on_cpu():
    def run(device):
        w = torch.ones(3, device=device, requires_grad=True)
        x = torch.full((3,), 2.0, device=device)
        y = (w * x).sum()  # saves x for w's gradient
        x.add_(1)
        y.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run("cpu")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run("tpu")


def test_a_cache_written_at_moving_positions_stays_in_its_memory():
    cache, cpu = torch.zeros(1, 2, 64, 8, device="tpu"), torch.zeros(1, 2, 64, 8)
    cache[:, :, 1] = torch.ones(1, 2, 8, device="tpu")
    address = _address(cache)
    for position in range(2, 40, 5):
        cache[:, :, position] = torch.full((1, 2, 8), float(position), device="tpu")
        cpu[:, :, position] = float(position)
    cpu[:, :, 1] = 1.0
    assert _address(cache) == address
    assert_same(cache, cpu)


def _write_rows(floats, rows, values):
    floats[2:].index_copy_(0, rows, values)


def test_a_byte_buffer_a_compiled_step_updates_as_floats_is_updated_in_place():
    """As a paged cache: bytes, viewed and written as floats by each step."""
    cpu_bytes = torch.zeros(64 * 4 * 4, dtype=torch.uint8)
    tpu_bytes = cpu_bytes.to("tpu")
    step = torch.compile(_write_rows, backend="tpu", fullgraph=True)
    for index in range(3):
        rows, values = torch.tensor([index, 9 + index]), torch.full((2, 4), index + 0.5)
        _write_rows(cpu_bytes.view(torch.float32).view(64, 4), rows, values)
        step(tpu_bytes.view(torch.float32).view(64, 4), rows.to("tpu"), values.to("tpu"))
        if index == 0:  # from the first step on, the storage holds floats: the next steps update it in place
            address, copies = _address(tpu_bytes.view(torch.float32)), _copies()
    assert _address(tpu_bytes.view(torch.float32)) == address
    assert _copies() == copies
    assert_same(tpu_bytes, cpu_bytes)
    assert_same(tpu_bytes.view(torch.float32), cpu_bytes.view(torch.float32))
    # a new buffer (the next generate's cache) passed to the same step is updated in place from its first step
    new_bytes = torch.zeros(64 * 4 * 4, dtype=torch.uint8, device="tpu")
    step(new_bytes.view(torch.float32).view(64, 4), rows.to("tpu"), values.to("tpu"))
    address, copies = _address(new_bytes.view(torch.float32)), _copies()
    step(new_bytes.view(torch.float32).view(64, 4), rows.to("tpu"), (values + 1).to("tpu"))
    assert _address(new_bytes.view(torch.float32)) == address and _copies() == copies
    expected = torch.zeros(64, 4)
    _write_rows(expected, rows, values + 1)
    assert_same(new_bytes.view(torch.float32).view(64, 4), expected)


def test_fused_mode_gives_the_same_values():
    torch.tpu.set_eager_mode("fused")
    try:
        x, cpu = torch.zeros(8, 8, device="tpu"), torch.zeros(8, 8)
        for step in range(3):
            for tensor in (x, cpu):
                tensor.add_(step)
                tensor[:, step].mul_(2)
        assert_same(x, cpu)
    finally:
        torch.tpu.set_eager_mode("strict")


@pytest.mark.parametrize("name", ["add_", "row_write", "setitem"])
def test_a_fused_chain_writes_into_the_tensors_own_memory(name):
    from hf_tpu.backend import fused

    torch.manual_seed(0)
    cpu = torch.rand(512, 1024)  # 2 MiB: past the size below which a chain donates nothing
    assert cpu.numel() * 4 >= fused.DONATED_BYTES
    x = cpu.to("tpu")
    torch.tpu.set_eager_mode("fused")
    try:
        for _ in range(2):  # the chain's program, built at the first run
            UPDATES[name](x)
            UPDATES[name](cpu)
            torch.tpu.synchronize()
        address = _address(x)
        UPDATES[name](x)
        UPDATES[name](cpu)
        torch.tpu.synchronize()
        assert _address(x) == address
        held = hf_tpu.to_jax(x)  # a holder of the old value: that chain copies, and the holder keeps its values
        before = np.array(held)
        UPDATES[name](x)
        UPDATES[name](cpu)
        torch.tpu.synchronize()
        assert np.array_equal(np.asarray(held), before)
    finally:
        torch.tpu.set_eager_mode("strict")
    assert_same(x, cpu)
