"""The op table's jit cache keys (what must make a cached program not apply), and its kernels built when first
run."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.extend
import torch

from hf_tpu.backend import fused


def test_static_numbers_of_different_types_do_not_share_a_program():
    assert torch.arange(4.0, device="tpu").dtype == torch.float32
    assert torch.arange(4, device="tpu").dtype == torch.int64  # 4 == 4.0, but not the same op


def test_default_dtype_is_part_of_the_key():
    ints = torch.arange(3, device="tpu")
    assert (ints + 2.5).dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert (ints + 2.5).dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)


def _primitives(jaxpr) -> set[str]:
    """The primitives of ``jaxpr`` and of the jaxprs inside its equations."""
    return {eqn.primitive.name for eqn in jaxpr.eqns}.union(*map(_primitives, jax.extend.core.subjaxprs(jaxpr)))


def test_specialized_scalars_get_a_program_each_and_other_values_share_one():
    """pow's exponent is traced (one program for every value, XLA's power function) except at the values its
    lowering specializes, which reach it as numbers (``x * x`` for 2). Read off the programs fused eager records."""
    x = torch.rand(13, 7, device="tpu") + 0.5
    torch.tpu.set_eager_mode("fused")
    try:
        traces = {}
        for exponent in (1.5, 2.5, 2, 0.5):
            x.pow(exponent)
            traces[exponent] = fused._chain.ops[-1].trace
    finally:
        torch.tpu.set_eager_mode("strict")
    assert traces[1.5] is traces[2.5]
    assert len({id(trace) for trace in traces.values()}) == 3
    assert "pow" in _primitives(traces[1.5].jaxpr.jaxpr)
    assert "pow" not in _primitives(traces[2].jaxpr.jaxpr) and "mul" in _primitives(traces[2].jaxpr.jaxpr)
    assert "sqrt" in _primitives(traces[0.5].jaxpr.jaxpr)


_TABLE_OBJECTS = r"""
import gc, json
import torch
from hf_tpu.backend import op_table
gc.collect()
before = len(gc.get_objects())
op_table.TABLE.install()
gc.collect()
added = len(gc.get_objects()) - before
x = torch.arange(4.0, device="tpu")
print(json.dumps({"added": added, "kernels": len(op_table.TABLE.installed), "sum": (x + x).sum().item()}))
"""


def test_the_op_table_builds_a_kernel_when_its_op_first_runs():
    """A built kernel is some 60 objects that every full garbage collection walks; the table holds 1,300 and a
    process runs few of them."""
    completed = subprocess.run([sys.executable, "-c", _TABLE_OBJECTS], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    outcome = json.loads(completed.stdout.strip().splitlines()[-1])
    assert outcome["kernels"] > 1000 and outcome["added"] < 10 * outcome["kernels"]
    assert outcome["sum"] == 12.0
