"""diffusers models loaded straight onto tpu, and diffusers' random numbers with CPU generators."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same
from test_diffusers_pipelines import diffusers, tiny_unet


def unet_inputs():
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn(1, 4, 32, 32, generator=generator)
    text = torch.randn(1, 6, 32, generator=generator)
    return sample, torch.tensor([10]), text


def run_unet(unet, sample, timestep, text):
    device = unet.device
    with torch.no_grad():
        return unet(sample.to(device), timestep.to(device), encoder_hidden_states=text.to(device)).sample


@pytest.fixture(scope="module")
def saved_unet(tmp_path_factory):
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    path = tmp_path_factory.mktemp("unet")
    unet.save_pretrained(path)
    return unet, path


def test_from_pretrained_with_device_map_tpu(saved_unet):
    unet, path = saved_unet
    loaded = diffusers.UNet2DConditionModel.from_pretrained(path, device_map="tpu")
    parameters = list(loaded.parameters())
    assert {p.device.type for p in parameters} == {"tpu"} and {p.dtype for p in parameters} == {torch.float32}
    inputs = unet_inputs()
    assert_same(run_unet(loaded, *inputs), run_unet(unet, *inputs), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def saved_transformer(tmp_path_factory):
    torch.manual_seed(0)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, caption_projection_dim=16, joint_attention_dim=16, pooled_projection_dim=16)
    path = tmp_path_factory.mktemp("sd3")
    transformer.save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_dit_transformer_from_pretrained_on_tpu(saved_transformer, dtype, tolerance):
    """Against the same checkpoint loaded on CPU in the same dtype (bf16 rounding: 2e-2)."""
    loaded = diffusers.SD3Transformer2DModel.from_pretrained(saved_transformer, device_map="tpu", torch_dtype=dtype)
    assert {(p.device.type, p.dtype) for p in loaded.parameters()} == {("tpu", dtype)}
    reference = diffusers.SD3Transformer2DModel.from_pretrained(saved_transformer, torch_dtype=dtype)
    generator = torch.Generator().manual_seed(2)
    inputs = dict(hidden_states=torch.randn(1, 4, 8, 8, generator=generator),
                  encoder_hidden_states=torch.randn(1, 5, 16, generator=generator),
                  pooled_projections=torch.randn(1, 16, generator=generator), timestep=torch.tensor([3.0]))
    inputs = {k: v.to(dtype) for k, v in inputs.items()}
    with torch.no_grad():
        expected = reference(**inputs).sample
        actual = loaded(**{k: v.to("tpu") for k, v in inputs.items()}).sample
    assert_same(actual, expected, atol=tolerance, rtol=tolerance)


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


def test_tpu_generator_is_refused():
    """torch's Python device hooks cannot create device generators (README: pass a CPU generator instead)."""
    with pytest.raises(NotImplementedError, match="getNewGenerator"):
        torch.Generator(device="tpu")
