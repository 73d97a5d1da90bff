"""Eager forward of a tiny Llama on the tpu device next to torch CPU eager, in one process.

LlamaForCausalLM (hidden 256, 4 layers, 4 heads, intermediate 688, vocab 1024), built from a config
(no downloads), input (1, 64). Both devices run the same weights under ``torch.no_grad()``; each
timing is the best of several forwards after a warm-up (the tpu warm-up compiles every op once),
and ends with the logits on the host, so queued device work is counted.

    python benchmarks/llama_eager.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)


def best_milliseconds(model: torch.nn.Module, input_ids: torch.Tensor, repeats: int) -> float:
    with torch.no_grad():
        for _ in range(3):
            model(input_ids).logits.cpu()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids).logits.cpu()
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=1024,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (1, 64))

    cpu = best_milliseconds(model, input_ids, args.repeats)
    tpu = best_milliseconds(copy.deepcopy(model).to("tpu"), input_ids.to("tpu"), args.repeats)
    print(f"tpu device backed by: {torch.tpu.get_device_name()}")
    print("Tiny Llama forward (hidden 256, 4 layers, seq 64), eager, ms per forward\n")
    print(f"{'torch cpu':>10} {'tpu':>8} {'tpu/cpu':>8}")
    print(f"{cpu:10.1f} {tpu:8.1f} {tpu / cpu:7.1f}x")


if __name__ == "__main__":
    main()
