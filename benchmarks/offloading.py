"""Offloading on tpu: peak device memory and step time of each way of fitting a model, side by side in one process.

A diffusers SD3Transformer2DModel built from a config (hidden 384, 6 joint layers, ~85 MB of float32 weights;
no downloads), one denoising forward on a 32x32 latent (256 tokens) with a 32-token text. Each variant runs the
same forward from the same weights:

- fully on the chip (the reference);
- diffusers group offloading, block level (one transformer block per group) and leaf level, without and with a
  transfer stream (``use_stream=True``: the next group is copied while the current one computes);
- diffusers layerwise casting (weights stored in float8 on the chip, computed in float32);
- accelerate's ``cpu_offload`` (every module's weights copied to the chip for its forward).

Then a transformers LlamaForCausalLM (hidden 512, 8 layers, ~100 MB), one forward over 64 tokens: fully on the
chip, ``device_map="auto"`` with ``max_memory`` of half the model (the other layers on the host, copied to the
chip for their forward by accelerate's hooks), and the same plan with the host's layers on disk (``offload_folder``).

Peak memory is ``torch.tpu.max_memory_allocated`` over one forward (peak statistics reset first; weights that
stay on the chip count), as a fraction of the fully loaded model's. Times are the best of several forwards after
a warm-up, each ending with the output on the host, and are compared with the model on the chip.

    python benchmarks/offloading.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Callable

import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report


def transformer():
    import diffusers

    torch.manual_seed(0)
    return diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=6, attention_head_dim=64,
        num_attention_heads=6, caption_projection_dim=384, joint_attention_dim=384, pooled_projection_dim=256,
    ).eval()


def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 16, 32, 32, generator=generator),
        encoder_hidden_states=torch.randn(1, 32, 384, generator=generator),
        pooled_projections=torch.randn(1, 256, generator=generator),
        timestep=torch.tensor([500.0]),
    )


def group_offload(**options) -> Callable[[torch.nn.Module], None]:
    return lambda model: model.enable_group_offload(onload_device=torch.device("tpu"), **options)


def layerwise_casting(model: torch.nn.Module) -> None:
    model.to("tpu").enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


def accelerate_cpu_offload(model: torch.nn.Module) -> None:
    import accelerate

    accelerate.cpu_offload(model, execution_device=torch.device("tpu"))


VARIANTS: list[tuple[str, Callable[[torch.nn.Module], None]]] = [
    ("on chip", lambda model: model.to("tpu")),
    ("group block", group_offload(offload_type="block_level", num_blocks_per_group=1)),
    ("group block+stream", group_offload(offload_type="block_level", num_blocks_per_group=1, use_stream=True)),
    ("group leaf", group_offload(offload_type="leaf_level")),
    ("group leaf+stream", group_offload(offload_type="leaf_level", use_stream=True)),
    ("layerwise fp8", layerwise_casting),
    ("accelerate cpu_offload", accelerate_cpu_offload),
]


def measure(model: torch.nn.Module, on_tpu: dict, repeats: int) -> tuple[float, float, torch.Tensor]:
    """(peak device bytes of one forward, best forward ms, output) of ``model`` on the inputs ``on_tpu``."""
    gc.collect()  # offloading hooks and modules refer to each other: free the previous variant's weights first

    def forward() -> torch.Tensor:
        with torch.no_grad():
            output = model(**on_tpu)[0].cpu()
        torch.tpu.synchronize()
        return output

    output = forward()  # compiles every op once
    torch.tpu.reset_peak_memory_stats()
    forward()
    peak = torch.tpu.max_memory_allocated()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        forward()
        best = min(best, time.perf_counter() - start)
    return peak, best * 1e3, output


def print_table(model: str, title: str, rows: list[tuple[str, tuple[float, float, torch.Tensor]]]) -> None:
    print(f"{title}\n")
    print(f"{'variant':<24} {'peak MB':>9} {'/ on chip':>10} {'ms':>9} {'/ on chip':>10} {'max |diff|':>11}")
    peak_on_chip, milliseconds_on_chip, reference = rows[0][1]
    for name, (peak, milliseconds, output) in rows:
        difference = (output - reference).abs().max().item()
        print(f"{name:<24} {peak / 2**20:9.1f} {peak / peak_on_chip:9.2f}x {milliseconds:9.1f} "
              f"{milliseconds / milliseconds_on_chip:9.2f}x {difference:11.2e}")
        if name != rows[0][0]:
            report(f"{model}, {name}: peak device memory / on chip", peak / peak_on_chip, "x", "the model on the chip")
            report(f"{model}, {name}: forward time / on chip", milliseconds / milliseconds_on_chip, "x",
                   "the model on the chip")
    print()


def diffusers_rows(repeats: int) -> tuple[float, list]:
    weights = transformer().state_dict()
    on_tpu = {name: value.to("tpu") for name, value in inputs().items()}
    rows = []
    for name, prepare in VARIANTS:
        model = transformer()
        model.load_state_dict(weights)
        prepare(model)
        rows.append((name, measure(model, on_tpu, repeats)))
    return sum(v.numel() * v.element_size() for v in weights.values()), rows


def transformers_rows(repeats: int, folder: str) -> tuple[float, list]:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    size = sum(p.numel() * p.element_size() for p in transformers.LlamaForCausalLM(config).parameters())
    on_tpu = dict(input_ids=torch.randint(0, 1024, (1, 64), generator=torch.Generator().manual_seed(0)).to("tpu"))
    rows = []
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="tpu")
    rows.append(("on chip", measure(model, on_tpu, repeats)))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="auto",
                                                              max_memory={0: size // 2, "cpu": "4GB"})
    rows.append(("max_memory half", measure(model, on_tpu, repeats)))
    on_disk = {name: "disk" if place == "cpu" else place for name, place in model.hf_device_map.items()}
    del model
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map=on_disk,
                                                              offload_folder=f"{folder}/offload")
    rows.append(("same plan, disk", measure(model, on_tpu, repeats)))
    return size, rows


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}\n")
    size, rows = diffusers_rows(repeats)
    print_table("SD3 transformer", f"diffusers SD3 transformer, {size / 2**20:.1f} MB of float32 weights; "
                "one forward, 256 image + 32 text tokens", rows)
    with tempfile.TemporaryDirectory() as folder:
        size, rows = transformers_rows(repeats, folder)
    print_table("Llama", f"transformers Llama, {size / 2**20:.1f} MB of float32 weights; one forward over 64 tokens",
                rows)


if __name__ == "__main__":
    main()
