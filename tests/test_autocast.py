"""torch.autocast("tpu") follows CUDA's op policies, with bfloat16 as the default low precision."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same


def _tensor(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=generator).to("tpu", dtype)


def test_default_autocast_dtype_is_bfloat16():
    assert torch.get_autocast_dtype("tpu") == torch.bfloat16
    with torch.autocast("tpu"):
        assert torch.is_autocast_enabled("tpu")
        assert (_tensor(2, 3) @ _tensor(3, 4)).dtype == torch.bfloat16


def test_default_autocast_dtype_is_bfloat16_in_every_thread():
    results = []

    def in_thread():
        results.append(torch.get_autocast_dtype("tpu"))
        with torch.autocast("tpu"):
            results.append((_tensor(2, 3) @ _tensor(3, 4)).dtype)
        with torch.autocast("tpu", dtype=torch.float16):
            results.append((_tensor(2, 3) @ _tensor(3, 4)).dtype)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert results == [torch.bfloat16, torch.bfloat16, torch.float16]


LOWER_PRECISION_OPS = {
    "matmul": lambda: _tensor(2, 3) @ _tensor(3, 4),
    "mm": lambda: torch.mm(_tensor(2, 3), _tensor(3, 4)),
    "bmm": lambda: torch.bmm(_tensor(2, 2, 3), _tensor(2, 3, 4)),
    "linear": lambda: F.linear(_tensor(2, 3), _tensor(4, 3), _tensor(4)),
    "addmm": lambda: torch.addmm(_tensor(4), _tensor(2, 3), _tensor(3, 4)),
    "baddbmm": lambda: torch.baddbmm(_tensor(2, 2, 4), _tensor(2, 2, 3), _tensor(2, 3, 4)),
    "einsum": lambda: torch.einsum("ij,jk->ik", _tensor(2, 3), _tensor(3, 4)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", LOWER_PRECISION_OPS.values(), ids=LOWER_PRECISION_OPS.keys())
def test_matmul_family_runs_in_autocast_dtype(op, dtype):
    with torch.autocast("tpu", dtype=dtype):
        assert op().dtype == dtype


FP32_OPS = {
    "exp": lambda x: torch.exp(x),
    "log_softmax": lambda x: F.log_softmax(x, -1),
    "softmax": lambda x: torch.softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, (3,)),
    "mse_loss": lambda x: F.mse_loss(x, x),
    "sum": lambda x: x.sum(),
    "pow": lambda x: x.pow(2),
}


@pytest.mark.parametrize("op", FP32_OPS.values(), ids=FP32_OPS.keys())
def test_precision_sensitive_ops_run_in_float32(op):
    with torch.autocast("tpu"):
        assert op(_tensor(2, 3, dtype=torch.bfloat16)).dtype == torch.float32


def test_explicit_dtype_wins_over_fp32_policy():
    with torch.autocast("tpu"):
        assert torch.softmax(_tensor(2, 3, dtype=torch.bfloat16), -1, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_promote_ops_use_widest_input_type():
    with torch.autocast("tpu"):
        assert torch.cat([_tensor(2), _tensor(2, dtype=torch.bfloat16)]).dtype == torch.float32
        assert torch.stack([_tensor(2, dtype=torch.bfloat16)] * 2).dtype == torch.bfloat16


def test_unlisted_ops_and_float64_are_left_alone():
    with torch.autocast("tpu"):
        x = _tensor(2, 3)
        assert (x + 1).dtype == torch.float32
        assert x[0].relu().dtype == torch.float32
        assert x.cpu().dtype == torch.float32
        double = _tensor(2, 3, dtype=torch.float64)
        assert (double @ double.t()).dtype == torch.float64


def test_disabled_and_nested_autocast():
    with torch.autocast("tpu", enabled=False):
        assert (_tensor(2, 3) @ _tensor(3, 4)).dtype == torch.float32
    with torch.autocast("tpu"):
        with torch.autocast("tpu", enabled=False):
            assert (_tensor(2, 3) @ _tensor(3, 4)).dtype == torch.float32
        assert (_tensor(2, 3) @ _tensor(3, 4)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("tpu")


def test_binary_cross_entropy_is_banned_as_on_cuda():
    with torch.autocast("tpu"), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(torch.full((2,), 0.5, device="tpu"), torch.ones(2, device="tpu"))


def test_training_step_under_autocast_matches_cpu():
    def step(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2)).to(device)
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            output = model(inputs)
            loss = F.cross_entropy(output, torch.tensor([0, 1, 1, 0], device=device))
        loss.backward()
        return output.dtype, loss.dtype, [p.grad for p in model.parameters()]

    expected, actual = step("cpu"), step("tpu")
    assert actual[:2] == expected[:2] == (torch.bfloat16, torch.float32)
    assert_same(actual[2], expected[2], rtol=2e-2, atol=2e-3)
