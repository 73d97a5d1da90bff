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

import copy

import torch
from tiny_llama import best_milliseconds, print_table, repeats_from_command_line, tiny_llama

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)


def forward_milliseconds(model: torch.nn.Module, input_ids: torch.Tensor, repeats: int) -> float:
    with torch.no_grad():
        return best_milliseconds(lambda: model(input_ids).logits.cpu(), repeats)


def main() -> None:
    repeats = repeats_from_command_line(__doc__.splitlines()[0])
    model, input_ids = tiny_llama()
    model.eval()

    cpu = forward_milliseconds(model, input_ids, repeats)
    tpu_model = copy.deepcopy(model).to("tpu")
    tpu_ids = input_ids.to("tpu")
    eager = forward_milliseconds(tpu_model, tpu_ids, repeats)
    compiled = forward_milliseconds(torch.compile(tpu_model, backend="tpu"), tpu_ids, repeats)
    print_table("Tiny Llama forward (hidden 256, 4 layers, seq 64)", "forward",
                [("torch cpu eager", cpu), ("tpu eager", eager), ("tpu compiled", compiled)])


if __name__ == "__main__":
    main()
