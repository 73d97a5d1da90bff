"""A view's storage offset is an argument of the programs that read and write it, not part of them: a slice at
a new position compiles nothing new (strict and fused eager), and every position gives CPU's values."""

from __future__ import annotations

import pytest
import torch

from conftest import TRACED, assert_same, counting_jax_events


@pytest.fixture(params=["strict", "fused"])
def eager_mode(request):
    torch.tpu.set_eager_mode(request.param)
    yield request.param
    torch.tpu.set_eager_mode("strict")


def _base(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(8 * 64, dtype=dtype).reshape(8, 64)


def _written(write):
    """The base tensor after ``write(x, p)``."""
    return lambda x, p: (write(x, p), x)[1]


OPERATIONS = {
    # name: (what is done with the base tensor at position p, the positions tried)
    "read_columns": (lambda x, p: (x[:, p:p + 4] * 2).sum(1), [1, 5, 33, 60]),
    "read_rows": (lambda x, p: x[p:p + 2] + 1, [1, 3, 6]),
    "select": (lambda x, p: x[p] * 3, [1, 4, 7]),
    "select_negative": (lambda x, p: x[-p] * 3, [1, 3, 7]),
    "narrow": (lambda x, p: x.narrow(1, p, 3).exp(), [2, 9, 61]),
    "step_slice": (lambda x, p: x[:, p::8].clone(), [1, 3, 7]),
    "as_strided": (lambda x, p: x.as_strided((3, 4), (5, 2), p) - 1, [1, 17, 400]),
    "overlapping_windows": (lambda x, p: x.view(-1).as_strided((5, 4), (1, 1), p) * 1, [1, 2, 500]),
    "unfold": (lambda x, p: x[p].unfold(0, 4, 2).sum(-1), [1, 5, 7]),
    "write_columns": (_written(lambda x, p: x[:, p:p + 4].copy_(torch.full((8, 4), -1.0, device=x.device))),
                      [1, 30, 60]),
    "write_select": (_written(lambda x, p: x[p].fill_(7.0)), [1, 2, 7]),
    "add_into_slice": (_written(lambda x, p: x[:, p:p + 2].add_(x[:, :2])), [3, 11, 62]),
    "setitem_position": (_written(lambda x, p: x.__setitem__((slice(None), p), 5.0)), [1, 40, 63]),
}


@pytest.mark.parametrize("name", OPERATIONS)
def test_every_position_gives_cpus_values(name, eager_mode):
    operation, positions = OPERATIONS[name]
    for position in positions:
        expected = operation(_base(), position)
        assert_same(operation(_base().to("tpu"), position), expected)


@pytest.mark.parametrize("name", OPERATIONS)
def test_a_new_position_compiles_nothing(name, eager_mode):
    operation, positions = OPERATIONS[name]
    base = _base(torch.float16)  # a dtype no other test reads at these positions: its programs are traced here
    operation(base.to("tpu"), positions[0]).cpu()  # the programs, traced at the first position
    with counting_jax_events(TRACED) as traces:
        for position in positions[1:]:
            operation(base.to("tpu"), position).cpu()
    assert not traces, f"{len(traces)} programs traced at new positions"


def test_a_fused_chain_at_a_new_position_reuses_its_program():
    from hf_tpu.backend import fused

    torch.tpu.set_eager_mode("fused")
    try:
        x = torch.zeros(4, 256, device="tpu")
        for position in (0, 16):  # offset 0 is part of the program; a moving one is an argument
            x[:, position:position + 16] = (x[:, position:position + 16] + 1) * 2
            torch.tpu.synchronize()
        fused.reset_stats()
        for position in (32, 48, 200):
            x[:, position:position + 16] = (x[:, position:position + 16] + 1) * 2
            torch.tpu.synchronize()
        assert fused.stats()["program_misses"] == 0, fused.stats()
    finally:
        torch.tpu.set_eager_mode("strict")
    expected = torch.zeros(4, 256)
    for position in (0, 16, 32, 48, 200):
        expected[:, position:position + 16] = 2.0
    assert_same(x, expected)


def test_views_of_other_dtypes_and_lazy_bits_at_a_moving_position():
    base = torch.randn(6, 8, dtype=torch.complex64)
    for position in (1, 3):
        assert_same(base.to("tpu")[position:position + 2].conj() * 1, base[position:position + 2].conj() * 1)
        assert_same(base.to("tpu")[position].view(torch.float32) + 0, base[position].view(torch.float32) + 0)
    flags = torch.rand(5, 7) > 0.5
    for position in (1, 4):
        assert_same(flags.to("tpu")[position] & True, flags[position] & True)


@pytest.mark.parametrize("operation", [
    lambda x: x.narrow(1, 62, 4),
    lambda x: x.select(0, 8),
    lambda x: x.as_strided((2, 2), (1, 1), 600),
])
def test_positions_out_of_range_raise_cpus_error(operation):
    with pytest.raises((RuntimeError, IndexError)) as on_cpu:
        operation(_base())
    with pytest.raises(type(on_cpu.value)):
        operation(_base().to("tpu")).cpu()


def test_empty_views_at_an_offset():
    for base in (torch.zeros(0, 0, 3), torch.zeros(2, 0, 4)):
        assert_same(base.to("tpu")[:, :, 1:].abs(), base[:, :, 1:].abs())
        assert_same(base.to("tpu")[..., 2].neg(), base[..., 2].neg())
