"""Forward of a tiny Llama: torch CPU eager, tpu eager and tpu compiled, side by side in one process.

LlamaForCausalLM (hidden 256, 4 layers, 4 heads, intermediate 688, vocab 1024), built from a config
(no downloads), input (1, 64). Every variant runs the same weights under ``torch.no_grad()``; each
timing is the best of several forwards after a warm-up (which compiles: every op once in eager
mode, the whole graph once with ``torch.compile(backend="tpu")``), and ends with the logits on the
host, so queued device work is counted. Goals: tpu eager at most 5x CPU eager (issue 3), tpu
compiled at most 0.4x CPU eager (issue 4).

    python benchmarks/llama_forward.py [--repeats 10]
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
    tpu_model = copy.deepcopy(model).to("tpu")
    tpu_ids = input_ids.to("tpu")
    eager = best_milliseconds(tpu_model, tpu_ids, args.repeats)
    compiled = best_milliseconds(torch.compile(tpu_model, backend="tpu"), tpu_ids, args.repeats)
    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}")
    print("Tiny Llama forward (hidden 256, 4 layers, seq 64), ms per forward (best of runs)\n")
    print(f"{'variant':<16} {'ms':>8} {'/ cpu eager':>12}")
    for name, value in (("torch cpu eager", cpu), ("tpu eager", eager), ("tpu compiled", compiled)):
        print(f"{name:<16} {value:8.2f} {value / cpu:11.2f}x")


if __name__ == "__main__":
    main()
