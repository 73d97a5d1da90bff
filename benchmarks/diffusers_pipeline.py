"""A tiny Stable-Diffusion-style pipeline, 10 steps at 64x64: torch CPU eager, tpu eager and tpu with the
UNet compiled, side by side in one process.

StableDiffusionPipeline from configs (no downloads): UNet2DConditionModel (channels 32/64, one cross-attention
block, 8-dim heads), AutoencoderKL (channels 32/64), DDIM scheduler, classifier-free guidance (the UNet sees
batch 2). Prompt embeddings are given (random, fixed), so no text encoder runs. Every variant starts from the
same CPU generator seed; each timing is the best of several whole pipeline calls (denoising loop and VAE
decode, images on the host at the end) after a warm-up that compiles. steps/s = denoising steps / call time.

    python benchmarks/diffusers_pipeline.py [--steps 10] [--size 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import diffusers
import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report


def tiny_stable_diffusion() -> diffusers.StableDiffusionPipeline:
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    scheduler = diffusers.DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                        clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = diffusers.StableDiffusionPipeline(
        unet=unet.eval(), vae=vae.eval(), scheduler=scheduler, text_encoder=None, tokenizer=None,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def best_seconds(pipe, embeddings, args) -> tuple[float, torch.Tensor]:
    device = pipe.unet.device
    positive, negative = (e.to(device) for e in embeddings)

    def call() -> torch.Tensor:
        return pipe(prompt_embeds=positive, negative_prompt_embeds=negative, num_inference_steps=args.steps,
                    height=args.size, width=args.size, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images.cpu()

    images = call()  # warm-up: compiles
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best, images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    pipe = tiny_stable_diffusion()
    generator = torch.Generator().manual_seed(1)
    embeddings = (torch.randn(1, 8, 32, generator=generator), torch.randn(1, 8, 32, generator=generator))
    results = {"torch cpu eager": best_seconds(pipe, embeddings, args)}
    pipe.to("tpu")
    results["tpu eager"] = best_seconds(pipe, embeddings, args)
    pipe.unet = torch.compile(pipe.unet, backend="tpu")
    results["tpu compiled unet"] = best_seconds(pipe, embeddings, args)

    cpu_seconds, cpu_images = results["torch cpu eager"]
    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}")
    print(f"Tiny SD pipeline, {args.steps} steps at {args.size}x{args.size} (best of {args.repeats} calls)\n")
    print(f"{'variant':<20} {'s/call':>8} {'steps/s':>9} {'x cpu steps/s':>14} {'max |img - cpu|':>16}")
    for name, (seconds, images) in results.items():
        difference = (images - cpu_images).abs().max().item()
        print(f"{name:<20} {seconds:8.3f} {args.steps / seconds:9.1f} {cpu_seconds / seconds:13.2f}x "
              f"{difference:16.2e}")
        if name != "torch cpu eager":
            report(f"steps/s, {name} / torch cpu eager", cpu_seconds / seconds, "x", "torch CPU eager pipeline")


if __name__ == "__main__":
    main()
