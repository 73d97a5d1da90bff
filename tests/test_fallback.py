"""Ops without a lowering: torch's decompositions first, then the opt-in CPU fallback, else a clear error."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._decomp import decomposition_table

from conftest import check_against_cpu
from hf_tpu.backend import dispatch

# Elementwise ops torch decomposes; the test uses the first one that has no lowering of its own.
DECOMPOSED_CANDIDATES = [
    torch.ops.aten.hardswish.default,
    torch.ops.aten.mish.default,
    torch.ops.aten.celu.default,
    torch.ops.aten.softplus.default,
    torch.ops.aten.hardsigmoid.default,
]


def _lowered(op: torch._ops.OpOverload) -> bool:
    dispatch.TABLE.install()
    return op.name() in dispatch.TABLE.installed


def test_op_with_a_decomposition_runs_through_it():
    op = next((op for op in DECOMPOSED_CANDIDATES if not _lowered(op)), None)
    assert op is not None, "every candidate has a lowering now: add an op without one to DECOMPOSED_CANDIDATES"
    assert op in decomposition_table
    check_against_cpu(op, torch.linspace(-4, 4, 17))


def test_missing_op_error_names_the_cpu_fallback_switch(monkeypatch):
    monkeypatch.delenv("HF_TPU_CPU_FALLBACK", raising=False)
    with pytest.raises(NotImplementedError, match="aten::linalg_matrix_exp.*HF_TPU_CPU_FALLBACK=1"):
        torch.linalg.matrix_exp(torch.eye(3, device="tpu"))


def test_cpu_fallback_runs_missing_ops_on_the_host_and_warns(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "1")
    matrix = torch.randn(3, 3) / 3
    with pytest.warns(UserWarning, match="aten::linalg_matrix_exp has no tpu lowering; running it on the CPU"):
        check_against_cpu(torch.linalg.matrix_exp, matrix)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per op, not at every call
        check_against_cpu(torch.linalg.matrix_exp, matrix)


def test_cpu_fallback_writes_out_arguments_back(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "1")
    x, q = torch.tensor([2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 0.5])
    out = torch.empty(0, device="tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        returned = torch.special.zeta(x.to("tpu"), q.to("tpu"), out=out)
    assert returned is out and out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), torch.special.zeta(x, q))
