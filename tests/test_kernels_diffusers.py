"""hf_tpu.kernels.diffusers_wiring.enable: diffusers models and pipelines on tpu computing attention on the
built-in Pallas flash-attention kernel (in TPU interpret mode here) give the outputs and gradients of the same
models on hf_tpu's SDPA lowering and on CPU. Tiny models built from the configs of the pipeline tests."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0, JointAttnProcessor2_0

from conftest import to_tpu
import hf_tpu.kernels
from hf_tpu.kernels import diffusers_wiring
from test_diffusers_models import run_unet, unet_inputs
from test_diffusers_pipelines import build, diffusers, generate, tiny_flux_transformer, tiny_sd3_transformer, tiny_unet
from test_kernels_wiring import _KernelLog

CLOSE = dict(atol=1e-4, rtol=1e-4)


def _on_tpu_with_and_without_kernels(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    plain = copy.deepcopy(model).to("tpu")
    return plain, diffusers_wiring.enable(copy.deepcopy(model).to("tpu"))


def _assert_matches(kernels: torch.Tensor, plain: torch.Tensor, cpu: torch.Tensor) -> None:
    torch.testing.assert_close(kernels.cpu(), plain.cpu(), **CLOSE)
    torch.testing.assert_close(kernels.cpu(), cpu, **CLOSE)


def _sd3_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return dict(hidden_states=torch.randn(1, 4, 8, 8, generator=generator),
                encoder_hidden_states=torch.randn(1, 16, 32, generator=generator),
                pooled_projections=torch.randn(1, 64, generator=generator), timestep=torch.tensor([3.0]))


def _flux_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    image_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
    return dict(hidden_states=torch.randn(1, 16, 4, generator=generator),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=generator),
                pooled_projections=torch.randn(1, 32, generator=generator), timestep=torch.tensor([0.5]),
                img_ids=image_ids.reshape(16, 3), txt_ids=torch.zeros(8, 3))


def test_unet_matches_the_unet_without_kernels_and_on_cpu():
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    plain, kernels = _on_tpu_with_and_without_kernels(unet)
    processors = list(kernels.attn_processors.values())
    assert all(isinstance(p, (diffusers_wiring.PallasProcessor, AttnProcessor2_0)) for p in processors)
    assert all(type(p) is AttnProcessor2_0 for p in unet.attn_processors.values())  # the original is left alone
    inputs = unet_inputs()
    with _KernelLog() as log:
        actual = run_unet(kernels, *inputs)
    assert log.ops == ["attention"] * len(processors)
    _assert_matches(actual, run_unet(plain, *inputs), run_unet(unet, *inputs))


def test_sd3_transformer_outputs_and_gradients_match():
    torch.manual_seed(0)
    transformer = tiny_sd3_transformer()
    plain, kernels = _on_tpu_with_and_without_kernels(transformer)
    assert all(isinstance(p, JointAttnProcessor2_0) for p in kernels.attn_processors.values())
    inputs = _sd3_inputs()
    inputs["hidden_states"].requires_grad_(True)

    def output_and_gradients(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        out = model(**inputs).sample
        wrt = [inputs["hidden_states"], inputs["encoder_hidden_states"], *model.parameters()]
        return [out, *torch.autograd.grad(out.square().mean(), wrt, allow_unused=True, materialize_grads=True)]

    inputs["encoder_hidden_states"].requires_grad_(True)
    with _KernelLog() as log:
        actual = output_and_gradients(kernels, to_tpu(inputs))
    assert "attention" in log.ops and "attention_vjp" in log.ops
    expected_tpu = output_and_gradients(plain, to_tpu(inputs))
    expected_cpu = output_and_gradients(transformer, inputs)
    for kernel_value, plain_value, cpu_value in zip(actual, expected_tpu, expected_cpu):
        _assert_matches(kernel_value, plain_value, cpu_value)


def test_compiled_sd3_transformer_keeps_the_kernel_in_one_graph():
    torch.manual_seed(0)
    model = tiny_sd3_transformer().eval()
    plain, kernels = _on_tpu_with_and_without_kernels(model)
    compiled = torch.compile(kernels, backend="tpu", fullgraph=True)
    inputs = to_tpu(_sd3_inputs())
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inputs).sample.cpu(), plain(**inputs).sample.cpu(), **CLOSE)


def test_flux_transformer_on_the_attention_dispatcher_matches():
    torch.manual_seed(0)
    transformer = tiny_flux_transformer().eval()
    plain, kernels = _on_tpu_with_and_without_kernels(transformer)
    inputs = _flux_inputs()
    with torch.no_grad(), _KernelLog() as log:
        actual = kernels(**to_tpu(inputs)).sample
        expected_tpu = plain(**to_tpu(inputs)).sample
        expected_cpu = transformer(**inputs).sample
    assert log.ops == ["attention"] * 2  # one double-stream and one single-stream block
    _assert_matches(actual, expected_tpu, expected_cpu)


def test_stable_diffusion_pipeline_gives_the_image_without_kernels():
    pipe = build("stable_diffusion").to("tpu")
    expected = generate(pipe, "stable_diffusion", num_inference_steps=1)
    assert hf_tpu.kernels.enable(pipe) is pipe  # the one call, for pipelines as for transformers models
    for model in (pipe.unet, pipe.vae):
        assert all(isinstance(p, diffusers_wiring.PallasProcessor) for p in model.attn_processors.values())
    with _KernelLog() as log:
        actual = generate(pipe, "stable_diffusion", num_inference_steps=1)
    assert "attention" in log.ops
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=1e-4, rtol=0)


def _attention_module(processor: object) -> Attention:
    torch.manual_seed(0)
    return Attention(query_dim=16, heads=2, dim_head=8, processor=processor).eval()


def test_boolean_masks_run_on_the_kernel():
    module = _attention_module(AttnProcessor2_0())
    plain, kernels = _on_tpu_with_and_without_kernels(module)
    hidden = torch.randn(2, 12, 16)
    mask = torch.ones(2, 1, 12, dtype=torch.bool)
    mask[1, :, 7:] = False  # the second sequence's last five keys are padding
    with torch.no_grad(), _KernelLog() as log:
        actual = kernels(hidden.to("tpu"), attention_mask=mask.to("tpu"))
        expected_tpu = plain(hidden.to("tpu"), attention_mask=mask.to("tpu"))
        expected_cpu = module(hidden, attention_mask=mask)
    assert log.ops == ["attention"]
    _assert_matches(actual, expected_tpu, expected_cpu)


def test_a_float_mask_falls_back_to_sdpa_with_a_warning():
    """The UNet turns ``encoder_attention_mask`` into an additive bias: its cross-attention stays on SDPA."""
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    plain, kernels = _on_tpu_with_and_without_kernels(unet)
    sample, timestep, text = (value.to("tpu") for value in unet_inputs())
    text_mask = torch.ones(2, 16, device="tpu")
    text_mask[:, 12:] = 0
    with torch.no_grad(), _KernelLog() as log, pytest.warns(UserWarning, match="float .additive. attn_mask"):
        actual = kernels(sample, timestep, text, encoder_attention_mask=text_mask).sample
    expected = plain(sample, timestep, text, encoder_attention_mask=text_mask).sample
    assert set(log.ops) == {"attention"} and len(log.ops) == len(kernels.attn_processors) // 2  # self-attention
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **CLOSE)


def test_a_processor_without_sdpa_is_left_alone_with_a_warning():
    module = _attention_module(AttnProcessor())
    plain, kernels = _on_tpu_with_and_without_kernels(module)
    hidden = torch.randn(1, 6, 16, device="tpu")
    with torch.no_grad(), pytest.warns(UserWarning, match="AttnProcessor computes attention without"):
        actual = kernels(hidden)
    torch.testing.assert_close(actual.cpu(), plain(hidden).detach().cpu(), **CLOSE)


def test_enable_is_idempotent():
    module = diffusers_wiring.enable(_attention_module(AttnProcessor2_0()).to("tpu"))
    processor = module.processor
    assert diffusers_wiring.enable(module).processor is processor


def test_bad_arguments_are_refused_with_what_to_do_instead():
    with pytest.raises(TypeError, match="takes a diffusers model .* not str"):
        diffusers_wiring.enable("unet")
    with pytest.raises(ValueError, match=r"parameters on cpu.*\.to\('tpu'\) first"):
        diffusers_wiring.enable(_attention_module(AttnProcessor2_0()))
    vae = diffusers.AutoencoderKL(block_out_channels=(4,), latent_channels=1, norm_num_groups=1,
                                  mid_block_add_attention=False).to("tpu")
    with pytest.raises(ValueError, match="AutoencoderKL has no diffusers attention modules"):
        diffusers_wiring.enable(vae)
    with pytest.raises(ValueError, match="for a transformers model use hf_tpu.kernels.enable"):
        diffusers_wiring.enable(torch.nn.Linear(2, 2).to("tpu"))
