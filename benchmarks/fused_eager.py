"""Fused eager mode against strict eager mode, raw ``jax.jit`` and torch CPU eager, side by side in one run.

Three workloads:

* an ``x = x + b`` chain of ``--chain`` ops on 64x64 float32 tensors, ending with a device sync, per op:
  tpu fused, tpu strict, and ``jax.jit(jnp.add)`` called on JAX arrays (the floor hf_tpu builds on);
* the tiny Llama forward of ``tiny_llama.py`` (``torch.no_grad``), ending with a device sync: tpu fused,
  tpu strict and torch CPU eager;
* a training step of the same model (forward with labels, backward, ``torch.optim.AdamW`` step, zeroing the
  gradients), ending with a device sync: tpu fused, tpu strict and torch CPU eager.

and, over ``--steps`` training steps of the same model in fused mode, the program cache's hit rate after a
warm-up of 10 steps (goal ~100%) with the cached programs, the device memory in use and the process's resident
memory at step 10 and at the end (goal: no growth).

Timings are the best of ``--repeats`` runs after warm-up runs that compile everything (fused programs are
cached by the chain's structure, so the timed runs find them). Prints each time and the ratios the goals are
stated in: fused / jax.jit per op (goal <= 1.3x), fused / torch CPU for the forward (goal <= 1.2x) and for
the training step (goal <= 1.5x).

    python benchmarks/fused_eager.py [--chain 200] [--repeats 10] [--steps 1000]
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import jax
import jax.numpy as jnp
import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from hf_tpu.backend import dispatch, fused
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


def timed_in_mode(device: str, mode: str, step: Callable[[], object], repeats: int) -> float:
    """Best seconds of ``step`` on ``device`` (tpu in eager ``mode``, synchronized after each step). What
    ``step`` returns is held over the sync: fused eager computes only results that are still referenced."""
    if device == "tpu":
        torch.tpu.set_eager_mode(mode)

    def run() -> None:
        result = step()
        if device == "tpu":
            torch.tpu.synchronize()
        del result

    try:
        return best_seconds(run, repeats)
    finally:
        if device == "tpu":
            torch.tpu.set_eager_mode("strict")


def llama_forward(device: str, mode: str, repeats: int) -> float:
    """Seconds per tiny Llama forward on ``device`` (tpu in eager ``mode``)."""
    model, input_ids = tiny_llama()
    model, input_ids = model.to(device).eval(), input_ids.to(device)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids).logits

    return timed_in_mode(device, mode, forward, repeats)


def llama_training_step(device: str, mode: str, repeats: int) -> float:
    """Seconds per tiny Llama training step (forward, backward, AdamW) on ``device`` (tpu in eager ``mode``)."""
    model, input_ids = tiny_llama()
    model, input_ids = model.to(device).train(), input_ids.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        model(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return timed_in_mode(device, mode, step, repeats)


def compare_with_cpu(title: str, workload: Callable[[str, str, int], float], goal: float, repeats: int) -> None:
    """Prints ``workload``'s milliseconds on torch CPU, tpu strict and tpu fused, and the ratios to CPU."""
    cpu = workload("cpu", "strict", repeats)
    strict = workload("tpu", "strict", repeats)
    fused.reset_stats()
    fused_time = workload("tpu", "fused", repeats)
    counts = fused.stats()
    print(title)
    print(f"  torch cpu {cpu * 1e3:8.2f}   tpu strict {strict * 1e3:8.2f}   tpu fused {fused_time * 1e3:8.2f}")
    print(f"  fused / cpu {fused_time / cpu:5.2f}x (goal <= {goal}x)   strict / cpu {strict / cpu:5.2f}x   "
          f"fused: {counts['flushes']} chain runs, {counts['program_hits']} cache hits, "
          f"{counts['program_misses']} misses\n")


def resident_megabytes() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def steady_state(steps: int, warmup: int = 10) -> None:
    """Prints fused eager's program-cache hit rate over ``steps`` training steps after ``warmup``, and what the
    caches and memory hold at the end of the warm-up and at the end."""
    model, input_ids = tiny_llama()
    model, input_ids = model.to("tpu").train(), input_ids.to("tpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.tpu.set_eager_mode("fused")
    try:
        marks = {}
        for step in range(steps):
            model(input_ids, labels=input_ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.tpu.synchronize()
            if step + 1 in (warmup, steps):
                marks[step + 1] = {**fused.stats(), "eager programs": dispatch.eager_program_count(),
                                   "device MiB": torch.tpu.memory_allocated() / 2**20, "RSS MiB": resident_megabytes()}
    finally:
        torch.tpu.set_eager_mode("strict")
    start, end = marks[warmup], marks[steps]
    hits, misses = end["program_hits"] - start["program_hits"], end["program_misses"] - start["program_misses"]
    print(f"fused eager over {steps} tiny Llama training steps (after {warmup} warm-up steps)")
    print(f"  program cache hit rate {hits / max(hits + misses, 1):.2%} ({hits} hits, {misses} misses)")
    for name in ("programs", "eager programs", "device MiB", "RSS MiB"):
        print(f"  {name:15s} at step {warmup}: {start[name]:9.1f}   at step {steps}: {end[name]:9.1f}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=int, default=200, help="ops per add chain (default 200)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs; the best is kept (default 10)")
    parser.add_argument("--steps", type=int, default=1000, help="training steps for the cache's steady state")
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

    compare_with_cpu("tiny Llama forward (hidden 256, 4 layers, 64 tokens), ms per forward", llama_forward, 1.2,
                     args.repeats)
    compare_with_cpu("tiny Llama training step (forward, backward, AdamW), ms per step", llama_training_step, 1.5,
                     args.repeats)
    steady_state(args.steps)


if __name__ == "__main__":
    main()
