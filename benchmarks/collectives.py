"""all_reduce between 2 processes on this host: tpu_dist (tpu tensors, JAX's collectives) against torch's Gloo
(CPU tensors), side by side in one torchrun launch.

``python benchmarks/collectives.py`` launches itself under torchrun (``--processes`` workers, default 2; or run
it with ``hf-tpu launch --nproc-per-node 2 benchmarks/collectives.py``). Each worker joins the default group,
``tpu_dist`` (tpu's default backend), and a Gloo group (``dist.new_group(backend="gloo")``), then for each
size, float32 tensors of 4 KiB to 64 MiB per rank (x4 steps; ``--sizes`` in KiB), all-reduces (sum) a tpu
tensor in place over tpu_dist and a CPU tensor over Gloo. The first call of each checks the result (the sum of
every rank's values) and compiles tpu_dist's program for the shape; then each is timed, median of
``--repeats`` timed loops of calls (fewer calls for larger sizes), each loop ending with ``torch.tpu.synchronize()``
on the tpu side. The table gives per size the bytes each rank all-reduces, each backend's ms per all_reduce and
bus bandwidth (``2 (n-1)/n x bytes / time``, the bytes each rank sends and receives in a ring, per second),
and the ratio tpu_dist/Gloo of the times (above 1: tpu_dist is slower). "JAX alone" is tpu_dist's own JAX
program called on the tensor's array without torch (no Work, thread or output copy): what the collective
itself costs, against which tpu_dist's column shows the process group's overhead.

Without TPU chips (no libtpu) the tpu device is JAX's CPU platform (``HF_TPU_PLATFORM=cpu`` is set), so both
sides are CPU-to-CPU on one host, tpu_dist over JAX's Gloo CPU collectives: the ratio is tpu_dist's overhead
(JAX program dispatch, the Work's thread, the copy into the output), not ICI against Ethernet.

    python benchmarks/collectives.py [--processes 2] [--sizes 4,16,...,65536] [--repeats 3] [--budget-ms 150]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable

from _report import report

KIB = 1024
DEFAULT_SIZES_KIB = [4 * 4**k for k in range(8)]  # 4 KiB .. 64 MiB
LAUNCH_TIMEOUT_S = 600


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="torchrun workers (ranks) on this host")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES_KIB)),
                        help="comma-separated sizes per rank, in KiB (float32 tensors)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per size and backend (the median)")
    parser.add_argument("--budget-ms", type=float, default=150,
                        help="about how long one timed loop runs (it holds at least 1 call, at most 50)")
    return parser


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(argv: list[str], processes: int) -> int:
    """This script under torchrun, ``processes`` workers; returns torchrun's exit status."""
    environment = dict(os.environ)
    if importlib.util.find_spec("libtpu") is None:  # no TPU software: JAX's CPU platform is the tpu device
        environment.setdefault("HF_TPU_PLATFORM", "cpu")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
               "--master-port", str(_free_port()), os.path.abspath(__file__), *argv]
    return subprocess.run(command, env=environment, timeout=LAUNCH_TIMEOUT_S).returncode


def _timed(call: Callable[[], None], synchronize: Callable[[], None], calls: int, repeats: int) -> float:
    """Median seconds per call over ``repeats`` loops of ``calls`` calls, each loop ending in ``synchronize``."""
    import torch.distributed as dist

    loops = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize()
        loops.append((time.perf_counter() - start) / calls)
    return statistics.median(loops)


def _checked_first_call(numel: int, gloo) -> tuple:
    """One all_reduce on each backend, of each rank's (rank + 1)s: both must give the sum over the ranks."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.full((numel,), float(rank + 1), device="tpu")
    host = torch.full((numel,), float(rank + 1))
    dist.all_reduce(device)
    dist.all_reduce(host, group=gloo)
    expected = torch.full((numel,), float(world * (world + 1) // 2))
    torch.testing.assert_close(device.cpu(), expected)
    torch.testing.assert_close(host, expected)
    return device.zero_(), host.zero_()  # zeros stay zeros: repeated in-place sums never overflow


def _size(nbytes: int) -> str:
    return f"{nbytes // KIB} KiB" if nbytes < KIB * KIB else f"{nbytes // (KIB * KIB)} MiB"


def _row(nbytes: int, tpu_s: float, jax_s: float, gloo_s: float, world: int) -> str:
    moved = 2 * (world - 1) / world * nbytes  # bytes each rank sends (and receives) in a ring all-reduce
    return (f"{_size(nbytes):>8}  {nbytes:>10}  {tpu_s * 1e3:>9.3f}  {moved / tpu_s / 1e9:>6.3f}  {jax_s * 1e3:>9.3f}  "
            f"{gloo_s * 1e3:>9.3f}  {moved / gloo_s / 1e9:>6.3f}  {tpu_s / gloo_s:>8.2f}x")


def _jax_alone(device) -> Callable[[], None]:
    """tpu_dist's all_reduce program on the tensor's JAX array, called from JAX without torch around it."""
    import jax
    import torch.distributed as dist

    from hf_tpu.backend import storage
    from hf_tpu.distributed import collectives

    mesh, array = dist.group.WORLD._mesh(0), storage.read(device)
    return lambda: jax.block_until_ready(collectives.run("all_reduce", mesh, array, "sum"))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group()  # tpu_dist, tpu's default backend
    gloo = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"all_reduce (sum, float32, in place) over {world} processes; tpu = JAX "
              f"{torch.tpu.get_device_properties(0).platform}; median of {args.repeats} timed loops\n")
        print(f"{'size':>8}  {'bytes/rank':>10}  {'tpu_dist':>9}  {'GB/s':>6}  {'JAX alone':>9}  {'gloo':>9}  "
              f"{'GB/s':>6}  {'ratio':>9}\n{'':>8}  {'':>10}  {'ms':>9}  {'bus':>6}  {'ms':>9}  {'ms':>9}  "
              f"{'bus':>6}  {'tpu/gloo':>9}", flush=True)
    for kib in (int(text) for text in args.sizes.split(",")):
        device, host = _checked_first_call(kib * KIB // 4, gloo)
        calls = 1
        first = time.perf_counter()
        dist.all_reduce(host, group=gloo)  # one call's time sets the calls per loop, the same on every rank
        estimate = torch.tensor([time.perf_counter() - first])
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX, group=gloo)
        calls = max(1, min(50, int(args.budget_ms / 1e3 / max(float(estimate), 1e-6))))
        tpu_s = _timed(lambda: dist.all_reduce(device), torch.tpu.synchronize, calls, args.repeats)
        jax_s = _timed(_jax_alone(device), lambda: None, calls, args.repeats)
        gloo_s = _timed(lambda: dist.all_reduce(host, group=gloo), lambda: None, calls, args.repeats)
        if rank == 0:
            print(_row(kib * KIB, tpu_s, jax_s, gloo_s, world), flush=True)
            report(f"all_reduce {_size(kib * KIB)}: tpu_dist / gloo time", tpu_s / gloo_s, "x",
                   f"torch Gloo on CPU tensors, {world} processes")
    dist.destroy_process_group()


def main() -> int:
    args = build_parser().parse_args()
    if "RANK" not in os.environ:
        return launch(sys.argv[1:], args.processes)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
