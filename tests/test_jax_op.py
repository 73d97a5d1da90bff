"""``jax_op``: JAX and Pallas functions as PyTorch ops on tpu tensors, eager and compiled; ``to_jax``/``from_jax``."""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import textwrap
from typing import Literal, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import pallas as pl

import hf_tpu
from hf_tpu import from_jax, jax_op, to_jax
from hf_tpu.backend import runtime, storage

from conftest import to_tpu


class Mode(str, enum.Enum):
    ADD = "add"
    MUL = "mul"


@jax_op("jax_op_test::combine")
def combine(x: jax.Array, others: Sequence[jax.Array], scale: float, mode: Mode, power: Literal[1, 2] = 1,
            bias: Optional[jax.Array] = None, dtype: jnp.dtype = None) -> tuple[jax.Array, jax.Array]:
    total = sum(others, jnp.zeros_like(x))
    first = x * scale + total if mode is Mode.ADD else x * scale * total
    if bias is not None:
        first = first + bias
    second = x ** power
    return first, second if dtype is None else second.astype(dtype)


def combine_reference(x, others, scale, mode, power=1, bias=None, dtype=None):
    total = sum(others, torch.zeros_like(x))
    first = x * scale + total if mode is Mode.ADD else x * scale * total
    if bias is not None:
        first = first + bias
    second = x ** power
    return first, second if dtype is None else second.to(dtype)


def test_eager_values_statics_and_tuple_outputs():
    x, others, bias = torch.randn(3, 4), [torch.randn(3, 4), torch.randn(3, 4)], torch.randn(4)
    for args in [(x, others, 2.0, Mode.ADD), (x, others, 0.5, Mode.MUL, 2, bias, torch.float64)]:
        result = combine(*to_tpu(args))
        assert isinstance(result, tuple) and all(r.device.type == "tpu" for r in result)
        for actual, expected in zip(result, combine_reference(*args)):
            assert actual.dtype == expected.dtype
            torch.testing.assert_close(actual.cpu(), expected)


def test_one_trace_per_statics_and_shape():
    traces = []

    @jax_op("jax_op_test::counted")
    def counted(x: jax.Array, k: int) -> jax.Array:
        traces.append((x.shape, k))
        return x + k

    x = torch.ones(4, device="tpu")
    for _ in range(3):
        counted(x, 1)
    counted(x, 2)
    counted(torch.ones(5, device="tpu"), 2)
    assert traces == [((4,), 1), ((4,), 2), ((5,), 2)]


_DONATION_SCRIPT = """
import jax, jax.numpy as jnp, torch
from hf_tpu import from_jax, jax_op, to_jax
from hf_tpu.backend import storage

def twice(x: jax.Array) -> jax.Array:
    return x * 2

donating = jax_op("jax_op_test::twice_donated", twice, donate_argnums=(0,))
array = jnp.arange(8.0, dtype=jnp.float32)
address = array.unsafe_buffer_pointer()
x = from_jax(array)
del array  # held here it could not be donated
y = donating(x)
result = to_jax(y)
# XLA wrote the result into the donated input's buffer: the storage's array went in as is, and the
# array the program returned is the new tensor's storage.
assert result.unsafe_buffer_pointer() == address
assert storage.buffer_of(y).array is result
assert storage.buffer_of(x).array.is_deleted()
torch.testing.assert_close(y.cpu(), torch.arange(8.0) * 2)
"""


def test_inputs_and_results_are_storage_arrays_without_copies():
    # In a new process: donation is decided by reference counts, and in a long test process a failed
    # Dynamo compilation earlier (test_compile's strict-compile test) leaves one more reference to every
    # new array, so nothing is donated there (safe, but not what this test checks).
    done = subprocess.run([sys.executable, "-c", _DONATION_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_donation_skips_shared_storages():
    def twice(x: jax.Array) -> jax.Array:
        return x * 2

    donating = jax_op("jax_op_test::twice_shared", twice, donate_argnums=(0,))
    x = torch.arange(6.0, device="tpu")
    view = x[2:]
    donating(x)  # a view shares the storage: not donated
    torch.testing.assert_close(view.cpu(), torch.arange(2.0, 6.0))
    del view
    held = to_jax(x)
    donating(x)  # the caller holds the array: not donated
    assert not held.is_deleted()
    torch.testing.assert_close(x.cpu(), torch.arange(6.0))
    w = torch.arange(6.0, device="tpu", requires_grad=True)
    donating(w).sum().backward()  # needed by autograd: not donated
    torch.testing.assert_close(w.grad.cpu(), torch.full((6,), 2.0))


def smooth(x: jax.Array, y: jax.Array, k: int) -> jax.Array:
    return jnp.sin(x) * y + x ** k


smooth_op = jax_op("jax_op_test::smooth", smooth)


def test_gradients_eager_and_compiled_match_torch_autograd():
    x, y = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    loss = (torch.sin(x) * y + x ** 3).sum()
    expected = torch.autograd.grad(loss, (x, y))
    compiled = torch.compile(lambda a, b: smooth_op(a, b, 3).sum(), backend="tpu", fullgraph=True)
    for run in (lambda a, b: smooth_op(a, b, 3).sum(), compiled):
        a, b = to_tpu((x, y))
        grads = torch.autograd.grad(run(a, b), (a, b))
        for actual, reference in zip(grads, expected):
            torch.testing.assert_close(actual.cpu(), reference)


def test_compiled_graph_is_one_program_matching_eager():
    x = torch.randn(3, 4, device="tpu")
    others = [torch.randn(3, 4, device="tpu")]

    def model(x, others):
        first, second = combine(x.cos(), others, 3.0, Mode.MUL, 2)
        return first + second

    torch.tpu.reset_compile_stats()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu", fullgraph=True)
    torch.testing.assert_close(compiled(x, others).cpu(), model(x, others).cpu())
    stats = torch.tpu.compile_stats()
    assert stats["graphs"] == 1 and stats["fallbacks"] == 0


@jax.custom_vjp
def clipped_identity(x):
    return x


clipped_identity.defvjp(lambda x: (x, None), lambda _, g: (g * 10.0,))  # deliberately not the true gradient


def test_custom_vjp_in_fn_is_used():
    def identity(x: jax.Array) -> jax.Array:
        return clipped_identity(x)

    op = jax_op("jax_op_test::custom_vjp", identity)
    compiled = torch.compile(lambda a: op(a).sum(), backend="tpu", fullgraph=True)
    for run in (lambda a: op(a).sum(), compiled):
        x = torch.ones(4, device="tpu", requires_grad=True)
        run(x).backward()
        torch.testing.assert_close(x.grad.cpu(), torch.full((4,), 10.0))


def _add_kernel(x_ref, y_ref, out_ref):
    out_ref[...] = x_ref[...] + y_ref[...]


def _blockwise_add(x, y):
    """A Pallas kernel written for TPUs (no interpret=): row blocks of 8 x 128."""
    block = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(_add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
                          in_specs=[block, block], out_specs=block)(x, y)


@jax_op("jax_op_test::pallas_add")
def pallas_add(x: jax.Array, y: jax.Array) -> jax.Array:
    return _blockwise_add(x, y)


@jax.custom_vjp
def doubled_with_kernel_backward(x):
    return x * 2


doubled_with_kernel_backward.defvjp(lambda x: (x * 2, None), lambda _, g: (_blockwise_add(g, g),))


def test_tpu_pallas_kernel_runs_on_this_host_eager_and_compiled():
    x, y = torch.randn(16, 128), torch.randn(16, 128)
    a, b = to_tpu((x, y))
    torch.testing.assert_close(pallas_add(a, b).cpu(), x + y)
    compiled = torch.compile(lambda a, b: pallas_add(a, b) * 2, backend="tpu", fullgraph=True)
    torch.testing.assert_close(compiled(a, b).cpu(), (x + y) * 2)


def test_custom_vjp_backward_kernel_runs_on_this_host():
    """A custom_vjp's backward is traced when its pullback runs, after jax.vjp: in interpret mode too."""

    def double(x: jax.Array) -> jax.Array:
        return doubled_with_kernel_backward(x)

    op = jax_op("jax_op_test::kernel_backward", double)
    compiled = torch.compile(lambda a: op(a).sum(), backend="tpu", fullgraph=True)
    for run in (lambda a: op(a).sum(), compiled):
        x = torch.ones(16, 128, device="tpu", requires_grad=True)
        run(x).backward()
        torch.testing.assert_close(x.grad.cpu(), torch.full((16, 128), 2.0))


def test_one_chip_mesh_and_partition_specs():
    mesh = jax.sharding.Mesh(np.array(runtime.devices()[:1]), ("rows",))
    spec = jax.sharding.PartitionSpec("rows")

    def local_double(x):
        return x * 2

    def double(x: jax.Array) -> jax.Array:
        return jax.shard_map(local_double, mesh=mesh, in_specs=spec, out_specs=spec)(x)

    op = jax_op("jax_op_test::mesh_double", double, mesh=mesh, input_partition_specs=[spec],
                output_partition_specs=spec)
    x = torch.arange(4.0, device="tpu", requires_grad=True)
    compiled = torch.compile(lambda a: op(a).sum(), backend="tpu", fullgraph=True)
    for run in (lambda a: op(a).sum(), compiled):
        x.grad = None
        run(x).backward()
        torch.testing.assert_close(x.grad.cpu(), torch.full((4,), 2.0))


_MULTI_CHIP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, torch
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import hf_tpu
    from hf_tpu.backend import runtime

    mesh = Mesh(np.array(runtime.devices()), ("rows",))

    def scaled_by_shard(x):
        return x * (jax.lax.axis_index("rows") + 1).astype(x.dtype)

    def kernel(x: jax.Array) -> jax.Array:
        return jax.shard_map(scaled_by_shard, mesh=mesh, in_specs=P("rows"), out_specs=P("rows"))(x)

    op = hf_tpu.jax_op("multi::scaled", kernel, mesh=mesh, input_partition_specs=[P("rows")],
                       output_partition_specs=P("rows"))
    expected = torch.tensor([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0]])
    y = op(torch.ones(4, 2, device="tpu:1"))
    assert y.device == torch.device("tpu:1"), y.device  # results come back to the inputs' chip
    torch.testing.assert_close(y.cpu(), expected)
    x = torch.ones(4, 2, device="tpu", requires_grad=True)  # autograd runs on tpu:0 only (engine_hooks)
    op(x).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), expected)
    try:
        hf_tpu.from_jax(jax.device_put(jnp.ones(4), NamedSharding(mesh, P("rows"))))
    except ValueError as error:
        assert "sharded" in str(error)
    else:
        raise AssertionError("from_jax took a sharded array")
    on_chip_1 = hf_tpu.from_jax(jax.device_put(jnp.arange(3.0), runtime.device(1)))
    assert on_chip_1.device == torch.device("tpu:1")
    print("ok")
""")


def _run_python(code: str, **environment: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **environment}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_mesh_of_two_virtual_chips_runs_per_shard():
    result = _run_python(_MULTI_CHIP, HF_TPU_NUM_DEVICES="2", HF_TPU_PLATFORM="cpu")
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_torch_tpu_import_paths():
    from torch_tpu._internal.pallas import jax_op as shim_jax_op
    from torch_tpu._internal.pallas import pallas

    import torch_tpu

    assert shim_jax_op is jax_op is pallas.jax_op is torch.tpu.pallas.jax_op is hf_tpu.kernels.jax_op
    assert [name for name in vars(torch_tpu) if not name.startswith("__")] == ["_internal"]


def test_a_real_torch_tpu_is_not_shadowed(tmp_path):
    package = tmp_path / "torch_tpu"
    (package / "_internal").mkdir(parents=True)
    (package / "__init__.py").write_text("REAL = True\n")
    (package / "_internal" / "__init__.py").write_text("")
    code = "import torch, torch_tpu; assert torch_tpu.REAL; import torch_tpu._internal.pallas"
    result = _run_python(code, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert "No module named 'torch_tpu._internal.pallas'" in result.stderr, result.stderr[-2000:]


def test_to_jax_and_from_jax_share_arrays():
    x = torch.arange(6.0, device="tpu")
    assert to_jax(x) is storage.buffer_of(x).array
    np.testing.assert_array_equal(np.asarray(to_jax(x.view(2, 3).t())), np.arange(6.0).reshape(2, 3).T)
    array = jnp.arange(4, dtype=jnp.int32)
    tensor = from_jax(array)
    assert tensor.device.type == "tpu" and tensor.dtype == torch.int32
    assert to_jax(tensor) is array
    tensor += 1  # a write replaces the storage's array: the caller's array is unchanged
    np.testing.assert_array_equal(np.asarray(array), np.arange(4))
    with pytest.raises(TypeError, match="tpu tensor"):
        to_jax(torch.ones(2))
    with pytest.raises(TypeError, match="jax.Array"):
        from_jax(np.ones(2))


def test_errors_say_what_to_do():
    with pytest.raises(TypeError, match="has no annotation"):
        jax_op("jax_op_test::bad1", lambda x: x)

    def unsupported(x: jax.Array, table: dict) -> jax.Array:
        return x

    with pytest.raises(TypeError, match="'table' is annotated .*annotate tensors as jax.Array"):
        jax_op("jax_op_test::bad2", unsupported)

    def no_result(x: jax.Array):
        return x

    with pytest.raises(TypeError, match="no return annotation"):
        jax_op("jax_op_test::bad3", no_result)

    def identity(x: jax.Array) -> jax.Array:
        return x

    with pytest.raises(ValueError, match="donate_argnums"):
        jax_op("jax_op_test::bad4", identity, donate_argnums=(1,))
    op = jax_op("identity", identity)  # no namespace: the default one
    assert op._qualname == "hf_tpu_jax::identity"
    with pytest.raises(RuntimeError, match="argument 'x' is on cpu.*to\\('tpu'\\)"):
        op(torch.ones(2))
