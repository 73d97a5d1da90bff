"""Graph-mode runtime: default backend choice, RNG, donation, the on-disk cache, recompilation."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import to_tpu
from hf_tpu.compile import compile_stats, graph_lowering

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_torch_compile_without_a_backend_uses_tpu_for_tpu_inputs_only(monkeypatch):
    inductor_graphs = []

    def fake_inductor(model, inputs, **kwargs):
        inductor_graphs.append(model)
        return model

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_inductor)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    expected = model(x)

    result = torch.compile(nn.Linear(4, 3).to("tpu").requires_grad_(False))(to_tpu(x))
    assert result.device.type == "tpu" and compile_stats()["compilations"] == 1 and not inductor_graphs

    torch.compile(lambda v: model(v) * 1)(x)
    assert len(inductor_graphs) == 1 and compile_stats()["compilations"] == 1
    tpu_model = nn.Linear(4, 3)
    tpu_model.load_state_dict(model.state_dict())
    torch.testing.assert_close(torch.compile(tpu_model.to("tpu"))(to_tpu(x)).cpu(), expected)


def test_torch_compile_without_a_backend_reads_inductor_s_configuration_only_when_asked():
    child = """
import json, pickle, sys
import torch
compiled = torch.compile(torch.nn.Linear(4, 3).to("tpu"))
compiled(torch.ones(2, 4, device="tpu"))
imported = "torch._inductor.compile_fx" in sys.modules
config = compiled.get_compiler_config()
from torch._inductor.compile_fx import get_patched_config_dict
expected = get_patched_config_dict(config_patches={})
print(json.dumps({"imported": imported, "same": dict(config) == expected and config["max_autotune"] is False,
                  "pickled": pickle.loads(pickle.dumps(config)) == expected}))
"""
    completed = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    # importing Inductor's compiler took 2 s of a new process's first torch.compile; a tpu model never uses it
    assert json.loads(completed.stdout.strip().splitlines()[-1]) == {"imported": False, "same": True,
                                                                     "pickled": True}


def _dropout_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).to("tpu")


def test_compiled_dropout_follows_manual_seed_and_draws_what_eager_draws():
    model = _dropout_mlp()
    compiled = torch.compile(model, backend="tpu")
    x = torch.randn(8, 16, device="tpu")

    torch.manual_seed(1)
    first, second = compiled(x).detach().cpu(), compiled(x).detach().cpu()
    torch.manual_seed(1)
    again = compiled(x).detach().cpu()
    torch.manual_seed(1)
    eager = model(x).detach().cpu()

    assert torch.equal(first, again) and not torch.equal(first, second)
    torch.testing.assert_close(first, eager)
    assert compile_stats()["compilations"] == 1  # the forward graph (no backward ran), nothing per call


def test_compiled_random_factories_have_the_right_moments():
    sample = torch.compile(lambda x: (torch.rand_like(x), torch.randn(x.shape, device=x.device)), backend="tpu")
    torch.manual_seed(0)
    uniform, normal = (t.cpu().double() for t in sample(torch.empty(200_000, device="tpu")))
    assert abs(uniform.mean() - 0.5) < 0.01 and abs(uniform.var() - 1 / 12) < 0.01
    assert uniform.min() >= 0 and uniform.max() < 1
    assert abs(normal.mean()) < 0.01 and abs(normal.std() - 1) < 0.01


def _accumulate(buffer, values):
    buffer.add_(values)
    return buffer.sum()


def test_mutated_inputs_are_donated_unless_something_else_holds_their_array(monkeypatch):
    donations = []
    donatable = graph_lowering.CompiledGraph._donatable

    def spy(self, tensors, arrays):
        donations.append(donatable(self, tensors, arrays))
        return donations[-1]

    monkeypatch.setattr(graph_lowering.CompiledGraph, "_donatable", spy)
    compiled = torch.compile(_accumulate, backend="tpu", fullgraph=True)
    buffer, values = torch.zeros(64, device="tpu"), torch.ones(64, device="tpu")
    for _ in range(3):
        compiled(buffer, values)
    assert donations == [(0,)] * 3
    assert buffer.cpu().tolist() == [3.0] * 64

    from hf_tpu.backend import storage

    held = storage.read(buffer)  # a JAX array of the buffer held elsewhere must survive the call
    compiled(buffer, values)
    assert donations[-1] == () and not held.is_deleted()
    assert held.tolist() == [3.0] * 64 and buffer.cpu().tolist() == [4.0] * 64


def test_dynamic_shapes_compile_one_graph_and_run_every_length():
    def attend(x, y):
        z = torch.cat([x, y], dim=-1)
        return torch.softmax(z * 2, -1).sum(-1) + z.shape[-1], z.reshape(-1, 2)

    compiled = torch.compile(attend, backend="tpu", dynamic=True)
    for length in (4, 6, 10):
        x, y = torch.randn(3, length), torch.randn(3, length)
        for result, expected in zip(compiled(*to_tpu((x, y))), attend(x, y)):
            torch.testing.assert_close(result.cpu(), expected)
    assert compile_stats()["graphs"] == 1 and compile_stats()["compilations"] == 3


def test_marked_dynamic_dimension_does_not_retrace_in_dynamo():
    compiled = torch.compile(lambda x: (x.cumsum(0) * 2).mean(0), backend="tpu")
    for length in (5, 7, 9):
        x = torch.randn(length, 3)
        tpu_x = to_tpu(x)
        torch._dynamo.mark_dynamic(tpu_x, 0)
        torch.testing.assert_close(compiled(tpu_x).cpu(), (x.cumsum(0) * 2).mean(0))
    assert compile_stats()["graphs"] == 1


def test_recompile_log_names_the_input_that_changed(monkeypatch, caplog):
    monkeypatch.setenv("HF_TPU_LOG_RECOMPILES", "1")
    compiled = torch.compile(lambda x: x * 2, backend="tpu", dynamic=True)
    with caplog.at_level(logging.WARNING, logger="hf_tpu.recompiles"):
        compiled(torch.ones(3, 4, device="tpu"))
        compiled(torch.ones(3, 6, device="tpu"))
    messages = [r.getMessage() for r in caplog.records if r.name == "hf_tpu.recompiles"]
    assert len(messages) == 1 and "shape (3, 4) -> (3, 6)" in messages[0]


_FIRST_CALL = """
import json, time, torch
from torch import nn
from hf_tpu.compile import compile_stats
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).to("tpu").requires_grad_(False)
x = torch.randn(4, 64, device="tpu")
start = time.perf_counter()
torch.compile(model, backend="tpu")(x).cpu()
print(json.dumps(compile_stats()))
"""


def test_a_second_process_loads_compiled_programs_from_the_disk_cache(tmp_path):
    environment = {**os.environ, "HF_TPU_CACHE_DIR": str(tmp_path / "xla")}

    def first_call() -> dict:
        completed = subprocess.run(
            [sys.executable, "-c", _FIRST_CALL], env=environment, capture_output=True, text=True, timeout=300
        )
        assert completed.returncode == 0, completed.stderr
        return json.loads(completed.stdout.strip().splitlines()[-1])

    cold, warm = first_call(), first_call()
    assert cold["compilations"] == warm["compilations"] == 1
    assert cold["disk_cache_hits"] == 0 and warm["disk_cache_hits"] == 1
    assert any((tmp_path / "xla").iterdir())


def test_outputs_keep_the_strides_they_have_on_cpu():
    def project(x, w):
        y = (x @ w).relu()
        return y.t(), y.reshape(2, 3, 4).permute(2, 0, 1) * 2, y + 1

    x, w = torch.randn(6, 5), torch.randn(5, 4)
    for result, expected in zip(torch.compile(project, backend="tpu")(*to_tpu((x, w))), project(x, w)):
        assert result.stride() == expected.stride()
        torch.testing.assert_close(result.cpu(), expected)
        torch.testing.assert_close(result.mT.reshape(-1).cpu(), expected.mT.reshape(-1))


def test_views_given_to_a_compiled_graph_are_taken_inside_its_program():
    from hf_tpu.backend import storage

    def project(x, w, bias_bits, scale):
        return (x @ w + bias_bits.view(torch.bfloat16)) * scale

    compiled = torch.compile(project, backend="tpu", dynamic=False)
    x, weight, bias, scales = torch.randn(3, 7), torch.randn(5, 7), torch.randn(5).to(torch.bfloat16), torch.randn(4)
    tpu_x, tpu_weight, tpu_bias, tpu_scales = to_tpu((x, weight, bias, scales))
    eager_view_reads = storage._view_reader.cache_info().misses
    # a transposed weight (as AOTAutograd saves it for the backward) and a storage seen in another dtype: taken in
    # the program; an element at each step's (nonzero) offset: read first, so that every step runs the same program
    for step in range(3):
        result = compiled(tpu_x, tpu_weight.t(), tpu_bias.view(torch.int16), tpu_scales[step + 1])
        torch.testing.assert_close(result.cpu(), project(x, weight.t(), bias.view(torch.int16), scales[step + 1]))
        weight.add_(1.0), tpu_weight.add_(1.0)  # the next call reads the storage's new array
    assert compile_stats()["compilations"] == 1
    assert storage._view_reader.cache_info().misses - eager_view_reads <= 1  # the element's reader, once
    # the same inputs, now whole: another program, reading them as they are
    result = compiled(tpu_x, tpu_weight.t().contiguous(), tpu_bias.view(torch.int16).clone(), tpu_scales[0])
    torch.testing.assert_close(result.cpu(), project(x, weight.t(), bias.view(torch.int16), scales[0]))


def test_a_view_a_compiled_graph_updates_in_place_writes_its_storage():
    compiled = torch.compile(lambda rows: rows.mul_(2).sum(), backend="tpu")
    base = torch.arange(12.0).reshape(3, 4)
    tpu_base = to_tpu(base)
    for _ in range(2):
        torch.testing.assert_close(compiled(tpu_base.t()[1:3]).cpu(), base.t()[1:3].mul_(2).sum())
    torch.testing.assert_close(tpu_base.cpu(), base)


def test_graph_breaks_run_the_code_between_graphs_eagerly():
    def branchy(x):
        y = torch.sin(x) * 2
        if y.sum().item() > 0:  # data-dependent control flow: Dynamo breaks the graph here
            return torch.cos(y) + 1
        return y - 1

    for sign in (1.0, -1.0):
        x = torch.full((3, 4), sign) * torch.linspace(0.1, 1.0, 12).reshape(3, 4)
        result = torch.compile(branchy, backend="tpu")(to_tpu(x))
        torch.testing.assert_close(result.cpu(), branchy(x))
    assert compile_stats()["compilations"] >= 2 and compile_stats()["fallbacks"] == 0


def _freeze_counts_seen_by_the_backend(calls: int) -> list[int]:
    """``gc.get_freeze_count()`` inside each of ``calls`` compiles of a new tpu graph (Dynamo's compile running)."""
    from hf_tpu.compile import tpu_backend

    seen = []

    def backend(graph_module, inputs):
        seen.append(gc.get_freeze_count())
        return tpu_backend(graph_module, inputs)

    x = torch.randn(3, device="tpu")
    for scale in range(calls):
        torch.compile(lambda t, scale=scale: t * (scale + 2) + 1, backend=backend)(x)
    return seen


def test_objects_are_frozen_while_dynamo_compiles_and_only_then():
    torch._dynamo.reset()  # clears Dynamo's callbacks: the first graph after it registers them again
    first, second = _freeze_counts_seen_by_the_backend(2)
    assert first == 0 and second > 0
    assert gc.get_freeze_count() == 0


def test_objects_the_process_froze_itself_are_left_frozen():
    _freeze_counts_seen_by_the_backend(1)  # registered
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()  # frozen objects still die of their references, so it only shrinks
        (seen,) = _freeze_counts_seen_by_the_backend(1)
        assert 0 < seen <= frozen and 0 < gc.get_freeze_count() <= frozen  # none frozen, none unfrozen
    finally:
        gc.unfreeze()


def test_a_transferred_tensor_a_compiled_graph_updates_in_place_leaves_a_device_sync_working():
    """A tensor just copied to the device and then updated in place by a compiled graph gives its array to the graph's
    program; waiting for the device's work then waits for that program, not for the array it consumed."""
    x = torch.randn(512, 512)

    @torch.compile(backend="tpu")
    def bump(t):
        t.add_(1)
        return t.sum()

    on_tpu = x.to("tpu")
    total = bump(on_tpu)
    torch.tpu.synchronize()
    assert torch.equal(on_tpu.cpu(), x + 1)
    assert torch.allclose(total.cpu(), (x + 1).sum())
