"""Compiled denoisers: one XLA program per image size, reused at every denoising step.

``torch.tpu.compile_stats()["compilations"]`` counts XLA programs built; ``HF_TPU_STRICT_COMPILE=1`` makes a graph
that graph mode cannot lower an error instead of an eager fallback, so these tests see every such graph.
"""

from __future__ import annotations

import pytest
import torch

from test_diffusers_pipelines import FLOAT32_TOLERANCE, build, generate


@pytest.fixture(autouse=True)
def strict_compile(monkeypatch):
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compilations_during(run) -> tuple[int, int, object]:
    """(programs compiled, programs run) while ``run()`` ran, and its result."""
    before = torch.tpu.compile_stats()
    result = run()
    after = torch.tpu.compile_stats()
    return after["compilations"] - before["compilations"], after["calls"] - before["calls"], result


def test_compiled_unet_compiles_once_not_per_step():
    name = "stable_diffusion"
    pipe = build(name)
    expected = generate(pipe, name, num_inference_steps=3)
    pipe.to("tpu")
    pipe.unet = torch.compile(pipe.unet, backend="tpu")
    compiled, runs, _ = compilations_during(lambda: generate(pipe, name, num_inference_steps=1))
    assert (compiled, runs) == (1, 1)
    # 3 more steps, each with its own timestep: no new program
    compiled, runs, actual = compilations_during(lambda: generate(pipe, name, num_inference_steps=3))
    assert (compiled, runs) == (0, 3)
    difference = (actual.cpu() - expected).abs().max().item()
    assert difference <= FLOAT32_TOLERANCE, f"max abs difference {difference}"


DYNAMIC_SHAPES_GAP = pytest.mark.xfail(
    strict=True, raises=torch._dynamo.exc.BackendCompilerFailed,
    reason="Dynamo's default automatic dynamic shapes recompile the second size as a graph with symbolic sizes; "
           "graph mode cannot lower its torch.sym_sum node")


@pytest.mark.parametrize("dynamic", [False, pytest.param(None, marks=DYNAMIC_SHAPES_GAP)])
def test_compiled_transformer_compiles_once_per_image_size(dynamic):
    name = "flux"
    pipe = build(name)
    pipe.to("tpu")
    pipe.transformer.compile(backend="tpu", dynamic=dynamic)
    assert compilations_during(lambda: generate(pipe, name, num_inference_steps=2))[:2] == (1, 2)
    assert compilations_during(lambda: generate(pipe, name, height=32, width=32))[:2] == (1, 2)
    assert compilations_during(lambda: generate(pipe, name, height=32, width=32, num_inference_steps=3))[:2] == (0, 3)
    assert compilations_during(lambda: generate(pipe, name, num_inference_steps=2))[:2] == (0, 2)
