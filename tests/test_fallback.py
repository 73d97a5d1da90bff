"""Ops without a lowering: torch's decompositions first, then the opt-in CPU fallback, else a clear error."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._decomp import decomposition_table, register_decomposition

from conftest import check_against_cpu

# Test-only operators with a CPU kernel and no tpu kernel: one with a decomposition, one without,
# and an in-place one. (Real ATen ops would gain lowerings over time and stop exercising the path.)
_library = torch.library.Library("hf_tpu_test", "DEF")
_library.define("decomposed(Tensor x) -> Tensor")
_library.define("decomposed.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)")
_library.define("host_only(Tensor x) -> Tensor")
_library.define("host_only_(Tensor(a!) x) -> Tensor(a!)")
_library.impl("decomposed", lambda x: x * 2 + 1, "CPU")
_library.impl("host_only", lambda x: x.exp() - x, "CPU")
_library.impl("host_only_", lambda x: x.mul_(3), "CPU")
decomposed = torch.ops.hf_tpu_test.decomposed.default
host_only = torch.ops.hf_tpu_test.host_only.default
host_only_ = torch.ops.hf_tpu_test.host_only_.default
register_decomposition(decomposed)(lambda x: x * 2 + 1)
# Like torch's decompositions that compute in a wider dtype, this one returns a new tensor, not `out`.
register_decomposition(torch.ops.hf_tpu_test.decomposed.out)(lambda x, *, out: (x * 2 + 1).to(out.dtype))


def test_op_with_a_decomposition_runs_through_it(monkeypatch):
    monkeypatch.delenv("HF_TPU_CPU_FALLBACK", raising=False)
    assert decomposed in decomposition_table
    check_against_cpu(decomposed, torch.linspace(-4, 4, 17))


def test_decomposed_out_overload_fills_its_out_tensor():
    out = torch.empty(0, dtype=torch.bfloat16, device="tpu")
    returned = torch.ops.hf_tpu_test.decomposed.out(torch.arange(4.0, device="tpu"), out=out)
    assert returned is out
    assert torch.equal(out.cpu(), torch.tensor([1.0, 3.0, 5.0, 7.0], dtype=torch.bfloat16))


def test_missing_op_error_names_the_op_and_the_cpu_fallback_switch(monkeypatch):
    monkeypatch.delenv("HF_TPU_CPU_FALLBACK", raising=False)
    with pytest.raises(NotImplementedError, match="hf_tpu_test::host_only.*HF_TPU_CPU_FALLBACK=1"):
        host_only(torch.ones(3, device="tpu"))


def test_cpu_fallback_runs_missing_ops_on_the_host_and_warns_once(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "1")
    values = torch.linspace(-2, 2, 9)
    with pytest.warns(UserWarning, match="hf_tpu_test::host_only has no tpu lowering; running it on the CPU"):
        check_against_cpu(host_only, values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per op, not at every call
        check_against_cpu(host_only, values)


def test_cpu_fallback_writes_mutated_arguments_back(monkeypatch):
    monkeypatch.setenv("HF_TPU_CPU_FALLBACK", "1")
    base = torch.arange(6.0).reshape(2, 3).to("tpu")
    view = base[:, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        returned = host_only_(view)
    assert returned is view
    torch.testing.assert_close(base.cpu(), torch.tensor([[0.0, 3.0, 2.0], [3.0, 12.0, 5.0]]))
