"""Checked indices and integer division: the CPU's exception type and message, raised at the next sync."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hf_tpu.backend import checks


def _x(device):
    return torch.tensor([1.0, 2.0, 3.0], device=device)


def _i(device, *values):
    return torch.tensor(list(values), device=device)


CASES = {
    "index": lambda d: _x(d)[_i(d, 5)],
    "index_negative": lambda d: _x(d)[_i(d, -4)],
    "index_second_dim": lambda d: torch.zeros(2, 3, device=d)[:, _i(d, 3)],
    "index_first_bad_of_several": lambda d: _x(d)[_i(d, 0, 7, 9)],
    "setitem": lambda d: _x(d).__setitem__(_i(d, 5), 2.0),
    "index_put_accumulate": lambda d: _x(d).index_put_((_i(d, 5),), torch.tensor(1.0, device=d), accumulate=True),
    "index_put_two_indices": lambda d: torch.zeros(2, 3, device=d).index_put_((_i(d, 1), _i(d, 7)),
                                                                              torch.tensor(1.0, device=d)),
    "embedding": lambda d: F.embedding(_i(d, 5), torch.zeros(3, 2, device=d)),
    "embedding_negative": lambda d: F.embedding(_i(d, -1), torch.zeros(3, 2, device=d)),
    "gather": lambda d: torch.gather(_x(d), 0, _i(d, 5)),
    "gather_negative": lambda d: torch.gather(_x(d), 0, _i(d, -1)),
    "gather_second_dim": lambda d: torch.gather(torch.zeros(2, 3, device=d), 1, _i(d, [0], [3])),
    "index_select": lambda d: _x(d).index_select(0, _i(d, 5)),
    "take": lambda d: _x(d).take(_i(d, 5)),
    "take_negative": lambda d: _x(d).take(_i(d, -4)),
    "put": lambda d: _x(d).put_(_i(d, 5), _i(d, 1.0)),
    "scatter": lambda d: _x(d).scatter_(0, _i(d, 5), 1.0),
    "scatter_add": lambda d: _x(d).scatter_add_(0, _i(d, 5), _i(d, 1.0)),
    "scatter_reduce": lambda d: _x(d).scatter_reduce_(0, _i(d, 5), _i(d, 1.0), "sum"),
    "index_add": lambda d: _x(d).index_add_(0, _i(d, 5), _i(d, 1.0)),
    "index_copy": lambda d: _x(d).index_copy_(0, _i(d, 5), _i(d, 1.0)),
    "index_fill": lambda d: _x(d).index_fill_(0, _i(d, -4), 1.0),
    "floor_divide": lambda d: _i(d, 3) // _i(d, 0),
    "div_floor": lambda d: torch.div(_i(d, 3), _i(d, 0), rounding_mode="floor"),
    "div_trunc": lambda d: torch.div(_i(d, 3), _i(d, 0), rounding_mode="trunc"),
    "remainder": lambda d: _i(d, 3) % _i(d, 0),
    "remainder_by_python_zero": lambda d: _i(d, 3) % 0,
    "fmod": lambda d: torch.fmod(_i(d, 3), _i(d, 0)),
    "nll_loss": lambda d: F.nll_loss(torch.zeros(2, 3, device=d), _i(d, 0, 5)),
    "cross_entropy": lambda d: F.cross_entropy(torch.zeros(2, 3, device=d), _i(d, 0, -2)),
    "assert_async": lambda d: torch._assert_async(_i(d, 0)),
    "assert_async_message": lambda d: torch._assert_async(_i(d, 2.0) < 1, "expected {x} < 1"),
}


def _cpu_error(case) -> BaseException:
    with pytest.raises(Exception) as info:
        case("cpu")
    return info.value


@pytest.mark.parametrize("name", CASES)
def test_bad_index_or_division_raises_cpus_error_at_the_next_sync(name):
    expected = _cpu_error(CASES[name])
    CASES[name]("tpu")  # deferred: the op itself returns
    with pytest.raises(type(expected)) as info:
        torch.tpu.synchronize()
    assert str(info.value) == str(expected)
    assert torch.arange(3, device="tpu")[torch.tensor([2], device="tpu")].item() == 2  # usable, nothing pending


@pytest.mark.parametrize("sync", ["item", "cpu", "tolist", "print"])
def test_every_host_read_is_a_sync_that_raises(sync):
    result = _x("tpu")[_i("tpu", 5)]
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 0 with size 3"):
        if sync == "item":
            result.sum().item()
        elif sync == "cpu":
            result.cpu()
        elif sync == "tolist":
            result.tolist()
        else:
            str(result)


def test_valid_inputs_raise_nothing():
    x = _x("tpu")
    assert x[_i("tpu", -3, 2)].tolist() == [1.0, 3.0]
    assert x.index_fill(0, _i("tpu", -1), 0.0).tolist() == [1.0, 2.0, 0.0]
    assert (_i("tpu", 7) // _i("tpu", 2)).item() == 3
    assert (_i("tpu", 7.0) // _i("tpu", 0.0)).item() == float("inf")  # float division by zero is defined
    assert F.nll_loss(torch.zeros(2, 3, device="tpu"), _i("tpu", 0, -100)).item() == 0.0  # ignore_index
    assert x[torch.zeros(0, dtype=torch.long, device="tpu")].numel() == 0
    assert torch._assert_async(_i("tpu", True), "holds") is None
    torch.tpu.synchronize()


def test_one_compiled_program_carries_one_check():
    table = torch.nn.Embedding(10, 4).to("tpu")
    compiled = torch.compile(lambda ids: table(ids).sum() + (ids // 2).sum(), backend="tpu", fullgraph=True)
    assert compiled(_i("tpu", 1, 2)).item() == pytest.approx(table.weight[[1, 2]].sum().item() + 1, rel=1e-5)
    with pytest.raises(IndexError, match="index out of range in self"):
        compiled(_i("tpu", 1, 12)).item()
    assert compiled(_i("tpu", 3, 2)).item() == pytest.approx(table.weight[[3, 2]].sum().item() + 2, rel=1e-5)


def test_checks_pending_in_a_loop_without_syncs_are_merged_and_the_first_failure_wins():
    x = _x("tpu")
    for step in range(200):
        x[_i("tpu", 7 if step == 100 else 1)]
    assert sum(len(pending) for pending in checks._pending.values()) < 64
    with pytest.raises(IndexError, match="index 7 is out of bounds"):
        torch.tpu.synchronize()


def test_immediate_mode_raises_at_the_failing_op_and_off_mode_clamps():
    try:
        checks.set_mode("immediate")
        with pytest.raises(IndexError, match="index 5 is out of bounds"):
            _x("tpu")[_i("tpu", 5)]
        checks.set_mode("off")
        assert _x("tpu")[_i("tpu", 5)].tolist() == [3.0]  # XLA clamps
    finally:
        checks.set_mode("deferred")


@pytest.mark.parametrize("value", ["0", "immediate", "sometimes"])
def test_hf_tpu_checks_variable(value):
    code = "import torch\nx = torch.ones(3, device='tpu')\nprint(x[torch.tensor([5], device='tpu')].tolist())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HF_TPU_CHECKS": value})
    if value == "0":
        assert done.returncode == 0 and done.stdout.strip() == "[1.0]"
    elif value == "immediate":
        assert done.returncode != 0 and "IndexError: index 5 is out of bounds" in done.stderr
    else:
        assert done.returncode != 0 and "HF_TPU_CHECKS='sometimes' is not one of" in done.stderr
