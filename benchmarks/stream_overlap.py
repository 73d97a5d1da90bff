"""Overlap of host-to-device copies with compute through streams: a chain of matmuls on tpu on the default
stream while large host->device copies run on a transfer stream, against the same work serialized.

Variants, side by side in one process on the same tensors, alternating round by round (best of each):

* compute alone, copies alone: the two parts on their own;
* serialized: blocking copies, then the compute, both on the default stream;
* streams: ``non_blocking=True`` copies of pinned tensors on a transfer stream, then the compute on the
  default stream (diffusers' streamed group offloading prefetches like this);
* dispatch order only: the compute first, then blocking copies on the default stream (JAX's asynchronous
  dispatch alone lets copies issued after queued compute run beside it).

Each run ends with ``torch.tpu.synchronize()``; the copies' values are checked once at the end. Prints ms
per run, serialized/streams, and how much of the shorter part the streams hid.

On JAX's CPU stand-in the "device" is the host: XLA's matmuls and the stream worker's host copies both use
every core, and they share memory bandwidth, so there is little idle capacity to overlap into. On TPU chips
compute and DMA transfers use separate hardware. ``--split-cores`` models that on the stand-in (Linux, two
cores or more): XLA's threads run on the first half of the cores, the transfer stream's worker (and the
threads its copies start) on the others.

    python benchmarks/stream_overlap.py [--copies 8] [--megabytes 32] [--matmuls 16] [--size 1024] [--rounds 5]
                                        [--split-cores]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Callable

import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report


def split_cores() -> tuple[set[int], set[int]]:
    """Restricts this thread (and so the threads JAX starts next) to the first half of the cores; returns
    (compute cores, copy cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--split-cores needs at least two cores")
    compute, copies = set(cores[: len(cores) // 2]), set(cores[len(cores) // 2:])
    os.sched_setaffinity(0, compute)
    return compute, copies


def move_stream_workers(cores: set[int]) -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("hf_tpu-stream"):
            os.sched_setaffinity(thread.native_id, cores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8, help="host tensors copied per run")
    parser.add_argument("--megabytes", type=int, default=32, help="size of each copied tensor")
    parser.add_argument("--matmuls", type=int, default=16, help="length of the matmul chain")
    parser.add_argument("--size", type=int, default=1024, help="matmul size (float32 square matrices)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--split-cores", action="store_true", help="compute and copies on separate cores")
    args = parser.parse_args()
    if args.split_cores:
        compute_cores, copy_cores = split_cores()

    hosts = [torch.randn(args.megabytes * 2**18).pin_memory() for _ in range(args.copies)]
    matrix = torch.randn(args.size, args.size, device="tpu") / args.size**0.5
    transfer = torch.tpu.Stream()
    if args.split_cores:  # start the stream's worker and move it before it starts threads of its own
        with torch.tpu.stream(transfer):
            torch.ones(1).pin_memory().to("tpu", non_blocking=True)
        transfer.synchronize()
        move_stream_workers(copy_cores)
    copied: list[torch.Tensor] = []

    def compute() -> None:
        result = matrix
        for _ in range(args.matmuls):
            result = result @ matrix

    def copy(non_blocking: bool = False) -> None:
        copied[:] = [host.to("tpu", non_blocking=non_blocking) for host in hosts]

    def copies_on_stream() -> None:
        with torch.tpu.stream(transfer):
            copy(non_blocking=True)

    variants: dict[str, Callable[[], None]] = {
        "compute alone": compute,
        "copies alone": copy,
        "serialized": lambda: (copy(), compute()),
        "streams": lambda: (copies_on_stream(), compute()),
        "dispatch order only": lambda: (compute(), copy()),
    }
    best = {name: float("inf") for name in variants}
    for round_ in range(args.rounds + 1):  # round 0 compiles and warms up
        for name, run in variants.items():
            torch.tpu.synchronize()
            start = time.perf_counter()
            run()
            torch.tpu.synchronize()
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    with torch.tpu.stream(transfer):
        copy(non_blocking=True)
    transfer.synchronize()
    assert all(torch.equal(c.cpu(), h) for c, h in zip(copied, hosts)), "copied values differ"

    cores = f"; compute on cores {sorted(compute_cores)}, copies on {sorted(copy_cores)}" if args.split_cores else ""
    print(f"{args.matmuls} matmuls {args.size}x{args.size} float32 on the default stream; {args.copies} copies of "
          f"{args.megabytes} MB host->device; ms per run, best of {args.rounds} (device: {torch.tpu.get_device_name()}"
          f"{cores})")
    print()
    for name, seconds in best.items():
        print(f"{name:22s}{seconds * 1e3:9.1f}")
    compute_ms, copies_ms = best["compute alone"] * 1e3, best["copies alone"] * 1e3
    serialized_ms, streams_ms = best["serialized"] * 1e3, best["streams"] * 1e3
    hidden = (compute_ms + copies_ms - streams_ms) / min(compute_ms, copies_ms)
    print()
    print(f"serialized / streams: {serialized_ms / streams_ms:.2f}x (ideal "
          f"{serialized_ms / max(compute_ms, copies_ms):.2f}x); the streams hid {hidden:.0%} of the shorter part")
    report("serialized / streams time", serialized_ms / streams_ms, "x",
           f"copies on a transfer stream (ideal {serialized_ms / max(compute_ms, copies_ms):.2f}x)")
    report("the shorter part's time the streams hid", 100 * hidden, "%", "compute alone, copies alone")


if __name__ == "__main__":
    main()
