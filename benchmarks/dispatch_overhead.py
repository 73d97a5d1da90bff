"""Eager dispatch overhead of one small op on the tpu device.

Times ``a + b`` and ``a.add_(b)`` on 64x64 float32 tensors in three ways, in one process:

* tpu: torch tensors on the ``tpu`` device (PyTorch dispatcher -> hf_tpu's op table -> a cached
  ``jax.jit`` function);
* jax.jit: ``jax.jit(jnp.add)`` called directly on JAX arrays, the floor hf_tpu builds on;
* torch cpu: the same PyTorch call on CPU tensors.

Each timing is the best of several loops of a few thousand calls, after a warm-up that compiles
everything. Device loops end by waiting for the device, so queued asynchronous work is counted.
Prints µs per op and the ratios tpu/jax.jit and tpu/cpu.

    python benchmarks/dispatch_overhead.py [--calls 3000] [--repeats 5] [--size 64]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import jax
import jax.numpy as jnp
import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report

WARMUP_CALLS = 200


def best_microseconds(loop: Callable[[int], None], calls: int, repeats: int) -> float:
    """Best time per call, in µs, of ``loop(calls)`` over ``repeats`` runs (after one warm-up run)."""
    loop(WARMUP_CALLS)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        loop(calls)
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def torch_loops(device: str, size: int) -> dict[str, Callable[[int], None]]:
    """Loops of ``a + b`` and ``a.add_(b)`` on torch tensors of ``device``, ending with a device sync."""
    a = torch.randn(size, size).to(device)
    b = torch.randn(size, size).to(device)
    sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)

    def add(calls: int) -> None:
        for _ in range(calls):
            a + b
        sync()

    def add_inplace(calls: int) -> None:
        for _ in range(calls):
            a.add_(b)
        sync()

    return {"a + b": add, "a.add_(b)": add_inplace}


def jax_loops(size: int) -> dict[str, Callable[[int], None]]:
    """The same loops on JAX arrays with ``jax.jit(jnp.add)``; the in-place form rebinds the result."""
    add = jax.jit(jnp.add)
    device = jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    b = jax.device_put(jnp.ones((size, size), jnp.float32), device)

    def functional(calls: int) -> None:
        result = None
        for _ in range(calls):
            result = add(a, b)
        result.block_until_ready()

    def rebinding(calls: int) -> None:
        x = a
        for _ in range(calls):
            x = add(x, b)
        x.block_until_ready()

    return {"a + b": functional, "a.add_(b)": rebinding}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per timing loop (default 3000)")
    parser.add_argument("--repeats", type=int, default=5, help="timing loops; the best is kept (default 5)")
    parser.add_argument("--size", type=int, default=64, help="tensors are size x size float32 (default 64)")
    args = parser.parse_args()

    columns = {
        "tpu": torch_loops("tpu", args.size),
        "jax.jit": jax_loops(args.size),
        "torch cpu": torch_loops("cpu", args.size),
    }
    print(f"tpu device backed by: {torch.tpu.get_device_name()}; jax.jit on: {jax.devices()[0]}")
    print(
        f"Eager dispatch, {args.size}x{args.size} float32, µs per op "
        f"(best of {args.repeats} loops of {args.calls} calls)\n"
    )
    print(f"{'op':<12}{'tpu':>10}{'jax.jit':>10}{'torch cpu':>11}{'tpu/jax.jit':>13}{'tpu/cpu':>10}")
    for op in ("a + b", "a.add_(b)"):
        tpu, jit, cpu = (best_microseconds(loops[op], args.calls, args.repeats) for loops in columns.values())
        print(f"{op:<12}{tpu:>10.1f}{jit:>10.1f}{cpu:>11.1f}{tpu / jit:>12.1f}x{tpu / cpu:>9.1f}x")
        report(f"{op}: tpu / jax.jit time per op", tpu / jit, "x", "jax.jit(jnp.add) on JAX arrays")
        report(f"{op}: tpu / torch cpu time per op", tpu / cpu, "x", "the same op on torch CPU tensors")


if __name__ == "__main__":
    main()
