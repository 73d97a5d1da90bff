"""Peak memory of in-place updates: tpu against torch CPU, side by side in one process.

    python benchmarks/in_place_memory.py [--mib 512]

On JAX's CPU platform the device's memory is the process's, so the peak is the resident set's high-water mark
during the update (``VmHWM``, reset through ``/proc/self/clear_refs`` just before it) above what the process held
before the updated tensors were made: the tensors count, as in "add_ on a 2 GiB tensor peaks at 2 GiB on CPU".
Each case and device runs in a process of its own, after two warm-up updates (which compile what it runs).
Cases: ``add_`` on a tensor of ``--mib`` MiB; writing one position of a static KV cache of that size
(``cache[:, :, position] = new``); an AdamW step over parameters of that size (torch's default implementation,
gradients and state included). An in-place update whose old array XLA may reuse needs the tensor's size once, as
on CPU; ``torch.tpu.memory_stats()["in_place_copies"]`` counts those that could not. Goal: peak at most 1.2x
CPU's.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys

import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak(case, device: str, numel: int) -> tuple[int, int]:
    """Bytes the resident set rose to during one update of the case's tensors above what the process held before
    they were made, and the in-place copies counted during it."""
    small = case(device, 1 << 14)  # the device's runtime started and the case's code run once, at a small size
    small()
    small()
    _sync(device)
    del small
    gc.collect()
    baseline = _status("VmRSS")
    update = case(device, numel)
    for _ in range(2):  # compiles what the update runs (AdamW's first step also makes its state)
        update()
    _sync(device)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current resident set
    copies = torch.tpu.memory_stats()["in_place_copies"]
    update()
    _sync(device)
    return max(_status("VmHWM") - baseline, 0), torch.tpu.memory_stats()["in_place_copies"] - copies


def _sync(device: str) -> None:
    if device == "tpu":
        torch.tpu.synchronize()


def _add(device: str, numel: int):
    x = torch.ones(numel, device=device)  # written: its pages are resident (zeros may not be)
    return lambda: x.add_(1)


def _cache_write(device: str, numel: int):
    heads, dim = 8, 128
    cache = torch.ones(1, heads, numel // (heads * dim), dim, device=device)
    new = torch.full((1, heads, dim), 2.0, device=device)
    positions = iter(range(1, cache.shape[2]))

    def write() -> None:
        cache[:, :, next(positions)] = new

    return write


def _adamw_step(device: str, numel: int):
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(numel // 4, device=device)) for _ in range(4)]
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    return torch.optim.AdamW(parameters, lr=1e-3).step


CASES = {"add_": _add, "KV-cache write": _cache_write, "AdamW step": _adamw_step}


def _in_a_new_process(name: str, device: str, mib: int) -> tuple[int, int]:
    command = [sys.executable, __file__, "--mib", str(mib), "--one", name, device]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="size of the updated tensor(s) in MiB (default 512)")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "DEVICE"), help=argparse.SUPPRESS)  # a worker's case
    args = parser.parse_args()
    if args.one:
        name, device = args.one
        print(json.dumps(_peak(CASES[name], device, args.mib * (1 << 20) // 4)))
        return
    print(f"{args.mib} MiB of float32; peak resident memory during one update above the process's before the tensors")
    print(f"{'':<16}{'cpu MiB':>10}{'tpu MiB':>10}{'tpu/cpu':>10}{'copies':>8}")
    for name in CASES:
        peaks = {device: _in_a_new_process(name, device, args.mib) for device in ("cpu", "tpu")}
        copies = peaks["tpu"][1]
        peaks = {device: peak for device, (peak, _) in peaks.items()}
        ratio = peaks["tpu"] / peaks["cpu"]
        print(f"{name:<16}{peaks['cpu'] / 2**20:>10.0f}{peaks['tpu'] / 2**20:>10.0f}{ratio:>9.2f}x{copies:>8}")
        report(f"{name}: peak memory, tpu / cpu", ratio, "x", f"torch CPU, {args.mib} MiB; goal: at most 1.2x")


if __name__ == "__main__":
    main()
