"""A training step of a tiny Llama: torch CPU eager, tpu eager and tpu compiled, side by side in one process.

LlamaForCausalLM (hidden 256, 4 layers, 4 heads, intermediate 688, vocab 1024), built from a config
(no downloads), a batch of (1, 64) tokens that are also the labels. A step is the forward with the LM
loss, the backward and one ``torch.optim.AdamW`` step; every variant starts from the same weights and
trains its own copy. Each timing is the best of several steps after a warm-up (which compiles: every op
once in eager mode, the forward and backward graphs once with ``torch.compile(backend="tpu")``; the
optimizer step runs eagerly in both tpu variants), and ends with the loss on the host and the device
idle, so queued work (the parameter updates) is counted.

    python benchmarks/training_step.py [--repeats 10]
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from tiny_llama import best_milliseconds, print_table, repeats_from_command_line, tiny_llama

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)


def step_milliseconds(model: torch.nn.Module, run: Callable, input_ids: torch.Tensor, repeats: int) -> float:
    """The fastest of ``repeats`` training steps of ``model`` (called through ``run``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss = run(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()
        if input_ids.device.type == "tpu":
            torch.tpu.synchronize()

    return best_milliseconds(step, repeats)


def main() -> None:
    repeats = repeats_from_command_line(__doc__.splitlines()[0])
    model, input_ids = tiny_llama()
    model.train()
    tpu_ids = input_ids.to("tpu")
    eager_model = copy.deepcopy(model).to("tpu")
    compiled_model = copy.deepcopy(model).to("tpu")

    cpu = step_milliseconds(model, model, input_ids, repeats)
    eager = step_milliseconds(eager_model, eager_model, tpu_ids, repeats)
    compiled = step_milliseconds(compiled_model, torch.compile(compiled_model, backend="tpu"), tpu_ids, repeats)
    print_table("Tiny Llama training step (forward, backward, AdamW; hidden 256, 4 layers, seq 64)", "step",
                [("torch cpu eager", cpu), ("tpu eager", eager), ("tpu compiled", compiled)])


if __name__ == "__main__":
    main()
