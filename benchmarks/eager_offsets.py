"""A slice at an offset seen before vs at a new one: tpu (strict and fused eager, and compiled) against JAX's own
eager indexing.

    python benchmarks/eager_offsets.py [--new 20]

A 64x4096 float32 tensor: a write ``x[:, a:a+16] = v`` and a read ``(x[:, a:a+16] * 2).sum()``, each synced to
the host. "seen" repeats one offset (best of 20 calls); "new" moves to an offset not used before every call
(median of ``--new`` calls). On tpu a view's storage offset is an argument of the programs that read and write
it, so a new offset reuses them; in a compiled function (``torch.compile``, the offset a Python int argument) the
offset is an argument of the graph's program once Dynamo has seen it change. JAX's eager indexing passes a slice's
start to ``dynamic_slice`` the same way. Goal: a new offset costs at most 3x a seen one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report

ROWS, COLUMNS, WIDTH = 64, 4096, 16


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _seen_and_new(operation, offsets: list[int]) -> tuple[float, float]:
    operation(offsets[0])
    seen = min(_seconds(lambda: operation(offsets[0])) for _ in range(20))
    new = statistics.median(_seconds(lambda offset=offset: operation(offset)) for offset in offsets[1:])
    return seen, new


def _tpu_operations(mode: str):
    x = torch.zeros(ROWS, COLUMNS, device="tpu")
    v = torch.ones(ROWS, WIDTH, device="tpu")

    def write_into(x: torch.Tensor, v: torch.Tensor, a: int) -> None:
        x[:, a:a + WIDTH] = v

    def read_from(x: torch.Tensor, a: int) -> torch.Tensor:
        return (x[:, a:a + WIDTH] * 2).sum()

    if mode == "compiled":
        write_into, read_from = (torch.compile(f, backend="tpu") for f in (write_into, read_from))

    def write(a: int) -> None:
        torch.tpu.set_eager_mode("strict" if mode == "compiled" else mode)
        write_into(x, v, a)
        torch.tpu.synchronize()

    def read(a: int) -> float:
        torch.tpu.set_eager_mode("strict" if mode == "compiled" else mode)
        return read_from(x, a).item()

    return {"write": write, "read": read}


def _jax_operations():
    state = {"x": jnp.zeros((ROWS, COLUMNS))}
    v = jnp.ones((ROWS, WIDTH))

    def write(a: int) -> None:
        state["x"] = state["x"].at[:, a:a + WIDTH].set(v)
        state["x"].block_until_ready()

    def read(a: int) -> float:
        return float((state["x"][:, a:a + WIDTH] * 2).sum())

    return {"write": write, "read": read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=20, help="calls at new offsets (default 20)")
    args = parser.parse_args()
    offsets = [1 + 37 * index for index in range(args.new + 1)]  # never 0: offset 0 is a program of its own
    print(f"jax {jax.__version__} on {jax.default_backend()}; {ROWS}x{COLUMNS} float32, slices of {WIDTH} columns")
    header = ("tpu seen", "tpu new", "new/seen", "jax seen", "jax new", "new/seen")
    print(f"{'':<16}" + "".join(f"{title:>10}" for title in header) + "  (ms)")
    jax_operations = _jax_operations()
    for mode in ("strict", "fused", "compiled"):
        tpu_operations = _tpu_operations(mode)
        for name in ("write", "read"):
            (tpu_seen, tpu_new), (jax_seen, jax_new) = (_seen_and_new(ops[name], offsets)
                                                        for ops in (tpu_operations, jax_operations))
            row = f"{name} {mode}"
            print(f"{row:<16}{tpu_seen * 1e3:>10.2f}{tpu_new * 1e3:>10.2f}{tpu_new / tpu_seen:>9.1f}x"
                  f"{jax_seen * 1e3:>10.2f}{jax_new * 1e3:>10.2f}{jax_new / jax_seen:>9.1f}x")
            report(f"slice {name} at a new offset / at a seen one, tpu {mode}", tpu_new / tpu_seen, "x",
                   "goal: at most 3x")
            report(f"slice {name} at a new offset, tpu {mode} / jax eager", tpu_new / jax_new, "x",
                   "JAX's eager indexing")
    torch.tpu.set_eager_mode("strict")


if __name__ == "__main__":
    main()
