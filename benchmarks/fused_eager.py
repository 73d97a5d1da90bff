"""Fused eager mode against strict eager mode, raw ``jax.jit`` and torch CPU eager, side by side in one run.

Two workloads:

* an ``x = x + b`` chain of ``--chain`` ops on 64x64 float32 tensors, ending with a device sync, per op:
  tpu fused, tpu strict, and ``jax.jit(jnp.add)`` called on JAX arrays (the floor hf_tpu builds on);
* the tiny Llama forward of ``tiny_llama.py`` (``torch.no_grad``), ending with a device sync: tpu fused,
  tpu strict and torch CPU eager.

Timings are the best of ``--repeats`` runs after warm-up runs that compile everything (fused programs are
cached by the chain's structure, so the timed runs find them). Prints each time and the ratios the goals are
stated in: fused / jax.jit per op (goal <= 1.3x) and fused / torch CPU for the forward (goal <= 1.2x).

    python benchmarks/fused_eager.py [--chain 200] [--repeats 10]
"""

from __future__ import annotations

import argparse
from typing import Callable

import jax
import jax.numpy as jnp
import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from hf_tpu.backend import fused
from tiny_llama import best_milliseconds, tiny_llama


def best_seconds(run: Callable[[], None], repeats: int, warmups: int = 3) -> float:
    return best_milliseconds(run, repeats, warmups) / 1e3


def add_chain_tpu(mode: str, length: int, repeats: int) -> float:
    """Seconds per op of an ``x = x + b`` chain on tpu in ``mode``."""
    torch.tpu.set_eager_mode(mode)
    start, b = torch.randn(64, 64).to("tpu"), torch.randn(64, 64).to("tpu")

    def run() -> None:
        x = start
        for _ in range(length):
            x = x + b
        torch.tpu.synchronize()

    try:
        return best_seconds(run, repeats) / length
    finally:
        torch.tpu.set_eager_mode("strict")


def add_chain_jax(length: int, repeats: int) -> float:
    """Seconds per op of the same chain with ``jax.jit(jnp.add)`` on JAX arrays."""
    add = jax.jit(jnp.add)
    start, b = jnp.ones((64, 64), jnp.float32), jnp.ones((64, 64), jnp.float32)

    def run() -> None:
        x = start
        for _ in range(length):
            x = add(x, b)
        x.block_until_ready()

    return best_seconds(run, repeats) / length


def llama_forward(device: str, mode: str, repeats: int) -> float:
    """Seconds per tiny Llama forward on ``device`` (tpu in eager ``mode``)."""
    model, input_ids = tiny_llama()
    model, input_ids = model.to(device).eval(), input_ids.to(device)
    if device == "tpu":
        torch.tpu.set_eager_mode(mode)

    def run() -> None:
        with torch.no_grad():
            model(input_ids)
        if device == "tpu":
            torch.tpu.synchronize()

    try:
        return best_seconds(run, repeats)
    finally:
        if device == "tpu":
            torch.tpu.set_eager_mode("strict")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=int, default=200, help="ops per add chain (default 200)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs; the best is kept (default 10)")
    args = parser.parse_args()

    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}\n")
    jit = add_chain_jax(args.chain, args.repeats)
    strict = add_chain_tpu("strict", args.chain, args.repeats)
    fused.reset_stats()
    fused_op = add_chain_tpu("fused", args.chain, args.repeats)
    hits = fused.stats()
    print(f"x = x + b chain of {args.chain} ops, 64x64 float32, µs per op")
    print(f"  jax.jit {jit * 1e6:8.1f}   tpu strict {strict * 1e6:8.1f}   tpu fused {fused_op * 1e6:8.1f}")
    print(f"  fused / jax.jit {fused_op / jit:5.2f}x (goal <= 1.3x)   strict / jax.jit {strict / jit:5.2f}x   "
          f"program cache: {hits['program_hits']} hits, {hits['program_misses']} misses\n")

    cpu = llama_forward("cpu", "strict", args.repeats)
    strict = llama_forward("tpu", "strict", args.repeats)
    fused_forward = llama_forward("tpu", "fused", args.repeats)
    print("tiny Llama forward (hidden 256, 4 layers, 64 tokens), ms per forward")
    print(f"  torch cpu {cpu * 1e3:8.2f}   tpu strict {strict * 1e3:8.2f}   tpu fused {fused_forward * 1e3:8.2f}")
    print(f"  fused / cpu {fused_forward / cpu:5.2f}x (goal <= 1.2x)   strict / cpu {strict / cpu:5.2f}x")


if __name__ == "__main__":
    main()
