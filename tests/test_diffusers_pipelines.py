"""diffusers pipelines built from tiny configs: ``pipe.to("tpu")`` generates the images the CPU pipeline does.

Every pipeline gets the same prompt, 2 inference steps and a CPU ``torch.Generator`` with the same seed, so
the initial latents are identical (``randn_tensor`` samples on the generator's device) and the images must
agree: float32 to 1e-3 (max abs difference, images in [0, 1]); bfloat16 to ``BF16_TOLERANCE`` against the
float32 CPU images (bfloat16 keeps 8 mantissa bits: each op rounds to about 4e-3 relative, and the T5 encoder, two
denoising steps through the PixArt transformer and the VAE decoder compound that; 0.019 measured).
Tokenizers are built offline from a vocabulary written here; nothing is downloaded.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import diffusers  # noqa: E402  (after HF_HUB_OFFLINE: both read it at import)
import transformers  # noqa: E402

FLOAT32_TOLERANCE = 1e-3
BF16_TOLERANCE = 0.05
TEXT_LENGTH = 16  # tokenizer model_max_length and max_sequence_length: one text-encoder shape for all pipelines


def _byte_alphabet() -> list[str]:
    """GPT-2/CLIP's printable stand-ins for the 256 byte values (the alphabet of byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def clip_tokenizer() -> transformers.CLIPTokenizer:
    """A byte-level CLIP tokenizer without merges: every character is a token."""
    alphabet = _byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["<|startoftext|>", "<|endoftext|>"]
    return transformers.CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[],
                                      model_max_length=TEXT_LENGTH)


def t5_tokenizer() -> transformers.T5Tokenizer:
    """A T5 (Unigram) tokenizer over lowercase letters, built with the tokenizers library, no sentencepiece."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TEXT_LENGTH)


def clip_text_config(**overrides) -> transformers.CLIPTextConfig:
    return transformers.CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, vocab_size=1000, hidden_size=32, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, layer_norm_eps=1e-5, **overrides)


def t5_encoder() -> transformers.T5EncoderModel:
    return transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8))


def tiny_unet(**overrides) -> diffusers.UNet2DConditionModel:
    settings = dict(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=2)
    return diffusers.UNet2DConditionModel(**{**settings, **overrides})


def one_block_vae(latent_channels: int) -> diffusers.AutoencoderKL:
    return diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035)


def stable_diffusion() -> diffusers.StableDiffusionPipeline:
    vae = diffusers.AutoencoderKL(
        block_out_channels=(4, 8), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=2,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    scheduler = diffusers.DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                        clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return diffusers.StableDiffusionPipeline(
        unet=tiny_unet(), vae=vae, scheduler=scheduler, text_encoder=transformers.CLIPTextModel(clip_text_config()),
        tokenizer=clip_tokenizer(), safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def tiny_sd3_transformer() -> diffusers.SD3Transformer2DModel:
    return diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64)


def stable_diffusion_3() -> diffusers.StableDiffusion3Pipeline:
    return diffusers.StableDiffusion3Pipeline(
        transformer=tiny_sd3_transformer(), vae=one_block_vae(4),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        text_encoder=transformers.CLIPTextModelWithProjection(clip_text_config(projection_dim=32)),
        tokenizer=clip_tokenizer(),
        text_encoder_2=transformers.CLIPTextModelWithProjection(clip_text_config(projection_dim=32)),
        tokenizer_2=clip_tokenizer(), text_encoder_3=t5_encoder(), tokenizer_3=t5_tokenizer())


def tiny_flux_transformer() -> diffusers.FluxTransformer2DModel:
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])


def flux() -> diffusers.FluxPipeline:
    return diffusers.FluxPipeline(
        transformer=tiny_flux_transformer(), vae=one_block_vae(1),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        text_encoder=transformers.CLIPTextModel(clip_text_config()), tokenizer=clip_tokenizer(),
        text_encoder_2=t5_encoder(), tokenizer_2=t5_tokenizer())


def pixart() -> diffusers.PixArtAlphaPipeline:
    transformer = diffusers.PixArtTransformer2DModel(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, caption_channels=32,
        in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6)
    return diffusers.PixArtAlphaPipeline(
        transformer=transformer, vae=one_block_vae(4), scheduler=diffusers.DDIMScheduler(),
        text_encoder=t5_encoder(), tokenizer=t5_tokenizer())


# builder, call arguments beyond the shared ones
PIPELINES = {
    "stable_diffusion": (stable_diffusion, dict(height=32, width=32)),
    "stable_diffusion_3": (stable_diffusion_3, dict(height=32, width=32, max_sequence_length=TEXT_LENGTH)),
    "flux": (flux, dict(height=16, width=16, max_sequence_length=TEXT_LENGTH)),
    "pixart": (pixart, dict(height=16, width=16, max_sequence_length=TEXT_LENGTH, use_resolution_binning=False,
                            clean_caption=False)),
}


def build(name: str) -> diffusers.DiffusionPipeline:
    """The pipeline with seeded weights, every module in eval mode (dropout off), as from_pretrained leaves it."""
    torch.manual_seed(0)
    pipe = PIPELINES[name][0]()
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: diffusers.DiffusionPipeline, name: str, **overrides) -> torch.Tensor:
    arguments = dict(prompt="a tiny cat", num_inference_steps=2, output_type="pt",
                     generator=torch.Generator().manual_seed(0), **PIPELINES[name][1])
    return pipe(**{**arguments, **overrides}).images


@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_on_tpu_matches_cpu(name):
    pipe = build(name)
    expected = generate(pipe, name)
    pipe.to("tpu")
    assert pipe.device.type == "tpu"
    actual = generate(pipe, name)
    assert actual.device.type == "tpu"
    assert actual.shape == expected.shape
    difference = (actual.cpu() - expected).abs().max().item()
    assert difference <= FLOAT32_TOLERANCE, f"{name}: max abs difference {difference}"


def test_bfloat16_pipeline_from_pretrained_on_tpu(tmp_path):
    """The saved pipeline loaded with ``dtype=torch.bfloat16, device_map="tpu"``: every model lands on tpu in
    bf16 (each through its own ``from_pretrained``) and the images stay within ``BF16_TOLERANCE`` of float32 CPU."""
    name = "pixart"
    pipe = build(name)
    expected = generate(pipe, name)
    pipe.save_pretrained(tmp_path)
    loaded = type(pipe).from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="tpu")
    loaded.set_progress_bar_config(disable=True)
    models = [c for c in loaded.components.values() if isinstance(c, torch.nn.Module)]
    assert {(p.device.type, p.dtype) for model in models for p in model.parameters()} == {("tpu", torch.bfloat16)}
    actual = generate(loaded, name)
    assert actual.device.type == "tpu"
    difference = (actual.float().cpu() - expected).abs().max().item()
    assert difference <= BF16_TOLERANCE, f"bf16: max abs difference {difference}"
