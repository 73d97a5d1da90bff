"""A view's storage offset is an argument of the programs that read and write it, not part of them: a slice at
a new position compiles nothing new (strict and fused eager, and graph mode once Dynamo has made the position
dynamic), and every position gives CPU's values."""

from __future__ import annotations

import pytest
import torch

from conftest import COMPILED, TRACED, assert_same, counting_jax_events


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
    "roll": (lambda x, p: torch.roll(x, (p, 1), (1, 0)) * 1, [1, 5, -3, 64]),
    "roll_flat": (lambda x, p: torch.roll(x, p) * 1, [1, 70, -513]),
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


@pytest.mark.parametrize("name", OPERATIONS)
def test_a_compiled_function_gives_cpus_values_at_every_position(name):
    operation, positions = OPERATIONS[name]
    compiled = torch.compile(lambda x, p: operation(x, p), backend="tpu")
    for position in positions:
        assert_same(compiled(_base().to("tpu"), position), operation(_base(), position))


# step_slice: the result's length depends on the position; setitem_position: Dynamo specializes ``x[:, p] = v`` on
# an int p on every device (inductor's CPU programs too)
POSITION_IS_AN_ARGUMENT = [name for name in OPERATIONS if name not in ("step_slice", "setitem_position")]


@pytest.mark.parametrize("name", POSITION_IS_AN_ARGUMENT)
def test_a_compiled_graph_at_a_new_position_compiles_nothing(name):
    operation, _ = OPERATIONS[name]
    compiled = torch.compile(lambda x, p: operation(x, p), backend="tpu")
    for position in (2, 3):  # Dynamo's graph for 2, then the one where the position is an input
        compiled(_base().to("tpu"), position)
    for position in (4, 5):  # away from the edges, where Dynamo's guards may ask for a graph of their own
        with counting_jax_events(COMPILED) as compilations:
            result = compiled(_base().to("tpu"), position)
        assert not compilations, f"{len(compilations)} programs compiled at a new position"
        assert_same(result, operation(_base(), position))


def test_a_compiled_training_step_at_a_new_position_compiles_nothing():
    def step(weight, p):
        (weight[:, p:p + 8] ** 2).sum().backward()  # the backward's slice bounds come from the forward
        return weight.grad

    compiled = torch.compile(step, backend="tpu", dynamic=True)  # the position an input from the first call on
    for position in (2, 3, 40):
        weight = torch.randn(4, 64)
        with counting_jax_events(COMPILED) as compilations:
            result = compiled(weight.to("tpu").requires_grad_(), position)
        assert position == 2 or not compilations
        assert_same(result, step(weight.requires_grad_(), position))


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
    lambda x: torch.roll(x, (1, 2), (0,)),
    lambda x: torch.roll(x[0, 0], 1, 0),
    lambda x: x.select(0, 8),
    lambda x: x.as_strided((2, 2), (1, 1), 600),
])
def test_positions_out_of_range_raise_cpus_error(operation):
    with pytest.raises((RuntimeError, IndexError)) as on_cpu:
        operation(_base())
    with pytest.raises(type(on_cpu.value)):
        operation(_base().to("tpu")).cpu()


def test_a_compiled_select_past_the_end_raises_cpus_error():
    compiled = torch.compile(lambda x, p: x.select(0, p) + 1, backend="tpu")
    for position in (2, 3):
        compiled(_base().to("tpu"), position)
    with pytest.raises(IndexError, match="out of range"):
        _base().select(0, 8)
    with pytest.raises(IndexError, match="out of range"):
        compiled(_base().to("tpu"), 8)


def test_empty_views_at_an_offset():
    for base in (torch.zeros(0, 0, 3), torch.zeros(2, 0, 4)):
        assert_same(base.to("tpu")[:, :, 1:].abs(), base[:, :, 1:].abs())
        assert_same(base.to("tpu")[..., 2].neg(), base[..., 2].neg())
