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


@pytest.fixture(scope="module")
def compiled_unet_pipeline():
    """The tiny StableDiffusionPipeline on tpu with ``torch.compile(pipe.unet, backend="tpu")``, and the images
    of 3 steps of its CPU twin."""
    name = "stable_diffusion"
    pipe = build(name)
    expected = generate(pipe, name, num_inference_steps=3)
    pipe.to("tpu")
    pipe.unet = torch.compile(pipe.unet, backend="tpu")
    return pipe, expected


def compiles_and_runs(pipe, name, **arguments) -> tuple[int, int]:
    """(programs compiled, programs run) during one pipeline call."""
    before = torch.tpu.compile_stats()
    generate(pipe, name, **arguments)
    after = torch.tpu.compile_stats()
    return after["compilations"] - before["compilations"], after["calls"] - before["calls"]


def test_compiled_unet_compiles_once_not_per_step(compiled_unet_pipeline):
    pipe, expected = compiled_unet_pipeline
    name = "stable_diffusion"
    assert compiles_and_runs(pipe, name, num_inference_steps=1) == (1, 1)
    before = torch.tpu.compile_stats()
    actual = generate(pipe, name, num_inference_steps=3)  # a new timestep at each step: no new program
    after = torch.tpu.compile_stats()
    assert (after["compilations"] - before["compilations"], after["calls"] - before["calls"]) == (0, 3)
    difference = (actual.cpu() - expected).abs().max().item()
    assert difference <= FLOAT32_TOLERANCE, f"max abs difference {difference}"


def test_compiled_unet_compiles_once_for_a_new_size(compiled_unet_pipeline):
    """torch's default ``dynamic=None``: Dynamo recompiles the second size as a graph with symbolic sizes."""
    pipe, _ = compiled_unet_pipeline
    assert compiles_and_runs(pipe, "stable_diffusion", height=48, width=48) == (1, 2)
    assert compiles_and_runs(pipe, "stable_diffusion", height=48, width=48) == (0, 2)


def test_transformer_compile_with_static_shapes_compiles_once_per_size():
    name = "flux"
    pipe = build(name)
    pipe.to("tpu")
    pipe.transformer.compile(backend="tpu", dynamic=False)
    assert compiles_and_runs(pipe, name) == (1, 2)
    assert compiles_and_runs(pipe, name, num_inference_steps=3) == (0, 3)
    assert compiles_and_runs(pipe, name, height=32, width=32) == (1, 2)
    assert compiles_and_runs(pipe, name) == (0, 2)
