"""What the tiny-Llama benchmarks share: the model (built from a config, no downloads) and their table."""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from _report import report

SEQUENCE = 64


def tiny_llama() -> tuple[LlamaForCausalLM, torch.Tensor]:
    """LlamaForCausalLM (hidden 256, 4 layers, 4 heads, intermediate 688, vocab 1024) and (1, 64) tokens."""
    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=1024,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config), torch.randint(0, config.vocab_size, (1, SEQUENCE))


def print_table(title: str, unit: str, rows: list[tuple[str, float]]) -> None:
    """The device behind tpu, then each variant's time and its ratio to the first row's."""
    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}")
    print(f"{title}, ms per {unit} (best of runs)\n")
    print(f"{'variant':<16} {'ms':>8} {'/ ' + rows[0][0]:>20}")
    for name, value in rows:
        print(f"{name:<16} {value:8.2f} {value / rows[0][1]:19.2f}x")
    for name, value in rows[1:]:
        report(f"{name} / {rows[0][0]} time per {unit}", value / rows[0][1], "x", rows[0][0])


def repeats_from_command_line(description: str) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=10)
    return parser.parse_args().repeats


def best_milliseconds(step: Callable[[], None], repeats: int, warmups: int = 3) -> float:
    """The fastest of ``repeats`` calls of ``step`` after ``warmups`` calls (which compile)."""
    for _ in range(warmups):
        step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1e3
