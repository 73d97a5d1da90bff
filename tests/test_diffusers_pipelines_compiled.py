"""Compiled denoisers: one XLA program per image size, reused at every denoising step.

``torch.tpu.compile_stats()["compilations"]`` counts XLA programs built, ``["calls"]`` programs run;
``HF_TPU_STRICT_COMPILE=1`` makes a graph that graph mode cannot lower an error rather than an eager fallback.
(Runs after test_diffusers_pipelines.py, whose eager programs for the text encoders and VAEs it reuses.)
"""

from __future__ import annotations

import pytest
import torch

from test_diffusers_pipelines import FLOAT32_TOLERANCE, build, generate


@pytest.fixture(scope="module", autouse=True)
def strict_compile():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_TPU_STRICT_COMPILE", "1")
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def compiles_and_runs(pipe, name, **arguments) -> tuple[int, int]:
    """(programs compiled, programs run) during one pipeline call."""
    before = torch.tpu.compile_stats()
    generate(pipe, name, **arguments)
    after = torch.tpu.compile_stats()
    return after["compilations"] - before["compilations"], after["calls"] - before["calls"]


def test_compiled_unet_compiles_once_not_per_step():
    name = "stable_diffusion"
    pipe = build(name)
    expected = generate(pipe, name, num_inference_steps=3)
    pipe.to("tpu")
    pipe.unet = torch.compile(pipe.unet, backend="tpu")
    assert compiles_and_runs(pipe, name, num_inference_steps=1) == (1, 1)
    before = torch.tpu.compile_stats()
    actual = generate(pipe, name, num_inference_steps=3)  # a new timestep at each step: no new program
    after = torch.tpu.compile_stats()
    assert (after["compilations"] - before["compilations"], after["calls"] - before["calls"]) == (0, 3)
    difference = (actual.cpu() - expected).abs().max().item()
    assert difference <= FLOAT32_TOLERANCE, f"max abs difference {difference}"


def test_compiled_transformer_compiles_once_per_image_size():
    """torch's default ``dynamic=None``: Dynamo recompiles the second size as a graph with symbolic sizes."""
    name = "flux"
    pipe = build(name)
    pipe.to("tpu")
    pipe.transformer.compile(backend="tpu")
    assert compiles_and_runs(pipe, name) == (1, 2)
    assert compiles_and_runs(pipe, name, num_inference_steps=3) == (0, 3)
    assert compiles_and_runs(pipe, name, height=32, width=32) == (1, 2)
    assert compiles_and_runs(pipe, name) == (0, 2)
