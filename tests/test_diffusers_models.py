"""diffusers models loaded straight onto tpu, and diffusers' random numbers with CPU generators.

Loading in bfloat16 (``dtype=torch.bfloat16, device_map="tpu"``) is tested with a whole pipeline in
test_diffusers_pipelines.py.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same
from test_diffusers_pipelines import diffusers, tiny_unet


def unet_inputs():
    """Shaped as the UNet's inputs in the tiny StableDiffusionPipeline of the pipeline tests (32x32 images,
    classifier-free guidance), so the two tests share compiled programs."""
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn(2, 4, 16, 16, generator=generator)
    text = torch.randn(2, 16, 32, generator=generator)
    return sample, torch.tensor(10), text


def run_unet(unet, sample, timestep, text):
    device = unet.device
    with torch.no_grad():
        return unet(sample.to(device), timestep.to(device), encoder_hidden_states=text.to(device)).sample


def test_from_pretrained_with_device_map_tpu(tmp_path):
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    unet.save_pretrained(tmp_path)
    loaded = diffusers.UNet2DConditionModel.from_pretrained(tmp_path, device_map="tpu")
    parameters = list(loaded.parameters())
    assert {p.device.type for p in parameters} == {"tpu"} and {p.dtype for p in parameters} == {torch.float32}
    inputs = unet_inputs()
    assert_same(run_unet(loaded, *inputs), run_unet(unet, *inputs), atol=1e-4, rtol=1e-4)


def test_randn_tensor_with_cpu_generators():
    """A CPU generator samples on the CPU and the result moves to tpu: the same numbers as on CPU."""
    from diffusers.utils.torch_utils import randn_tensor

    tpu = torch.device("tpu")
    expected = randn_tensor((2, 3, 4), generator=torch.Generator().manual_seed(7), device=torch.device("cpu"))
    actual = randn_tensor((2, 3, 4), generator=torch.Generator().manual_seed(7), device=tpu)
    assert_same(actual, expected)
    generators = [torch.Generator().manual_seed(seed) for seed in (3, 4)]
    batched = randn_tensor((2, 3), generator=generators, device=tpu)
    assert_same(batched, torch.stack([torch.randn(3, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]))
    assert randn_tensor((2, 3), device=tpu).device.type == "tpu"  # no generator: the device's own seeded stream


def test_tpu_generator_is_refused_with_what_to_do_instead():
    """torch's Python device hooks cannot create device generators (README: pass a CPU generator instead)."""
    for device in ("tpu", "tpu:0", torch.device("tpu")):
        with pytest.raises(RuntimeError, match=r"Pass a CPU generator instead, e.g. torch.Generator\(\).manual_seed"):
            torch.Generator(device=device)
    generator = torch.Generator("cpu")
    assert isinstance(generator, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    expected = torch.randn(3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.randn(3, generator=generator.manual_seed(1)), expected)
