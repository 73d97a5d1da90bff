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
cached by the chain's structure, so the timed runs find them); the variants of a workload are timed in turn, one
timed run of each per round (after untimed ones), so that a change of the host's load during the run reaches all
of them. Prints each time and the ratios the goals are stated in: fused / jax.jit per op (goal <= 1.3x), fused /
torch CPU for the forward (goal <= 1.2x) and for the training step (goal <= 1.5x); where torch has CUDA, the
forward also against torch CUDA eager (not the step: a CUDA backward cannot run in a process where tpu is
registered, pytorch/pytorch#161129). For the forward and the step it also prints where fused mode's time goes: the
host's time until the call returns (recording the ops; their chains are queued), and XLA's time to run the
recorded chain programs, each alone on inputs already computed (on JAX's CPU platform the two share the host's
cores).

    python benchmarks/fused_eager.py [--chain 200] [--repeats 10] [--steps 1000]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report
from hf_tpu.backend import dispatch, fused
from tiny_llama import tiny_llama


def add_chain_tpu(length: int) -> Callable[[], None]:
    """An ``x = x + b`` chain of ``length`` ops on tpu, ending with a device sync."""
    start, b = torch.randn(64, 64).to("tpu"), torch.randn(64, 64).to("tpu")

    def run() -> None:
        x = start
        for _ in range(length):
            x = x + b
        torch.tpu.synchronize()

    return run


def add_chain_jax(length: int) -> Callable[[], None]:
    """The same chain with ``jax.jit(jnp.add)`` on JAX arrays."""
    add = jax.jit(jnp.add)
    start, b = jnp.ones((64, 64), jnp.float32), jnp.ones((64, 64), jnp.float32)

    def run() -> None:
        x = start
        for _ in range(length):
            x = add(x, b)
        x.block_until_ready()

    return run


class Timing(NamedTuple):
    """Best seconds of a workload: to its result after a device sync (``total``), and until the call returned with
    its device work queued (``host``: what the host spends, recording in fused mode)."""

    total: float
    host: float


class Variant(NamedTuple):
    """A workload on ``device`` (tpu in eager ``mode``): ``step`` returns what it computed, held over the sync
    (fused eager computes only results that are still referenced)."""

    device: str
    mode: str
    step: Callable[[], object]


def alternated(variants: dict[str, Variant], repeats: int, warmups: int = 3, settle: int = 2) -> dict[str, Timing]:
    """Best times of each variant (synchronized after each step), the variants timed in turn: per round, each
    runs ``settle`` untimed steps and one timed step, so that a change of the host's load over the run reaches all
    of them, and each is timed in its own steady state (torch's and XLA's worker threads spin a while after a
    step: a step timed right after another variant's shares the cores with them)."""
    syncs = {"tpu": torch.tpu.synchronize, "cuda": torch.cuda.synchronize}

    def once(variant: Variant) -> Timing:
        sync = syncs.get(variant.device, lambda: None)
        if variant.device == "tpu":
            torch.tpu.set_eager_mode(variant.mode)
        try:
            start = time.perf_counter()
            result = variant.step()
            returned = time.perf_counter()
            sync()
            end = time.perf_counter()
            del result
            return Timing(end - start, returned - start)
        finally:
            if variant.device == "tpu":
                torch.tpu.set_eager_mode("strict")

    for variant in variants.values():
        for _ in range(warmups):
            once(variant)
    best = {name: Timing(float("inf"), float("inf")) for name in variants}
    for _ in range(repeats):
        for name, variant in variants.items():
            for _ in range(settle):
                once(variant)
            timing = once(variant)
            best[name] = Timing(min(best[name].total, timing.total), min(best[name].host, timing.host))
    return best


def chain_seconds(step: Callable[[], object], repeats: int, warmups: int = 3) -> float:
    """Best seconds XLA takes to run the chain programs of one ``step`` in fused mode, each run alone on inputs
    already computed: the device's share, which bounds fused mode whatever recording costs (the benchmark wraps
    fused eager's cached programs, which the warm-up builds, to time them)."""
    torch.tpu.set_eager_mode("fused")
    programs, spent = fused._programs, []

    def timed(program: Callable) -> Callable:
        def run(*inputs: object) -> object:
            jax.block_until_ready(inputs)
            start = time.perf_counter()
            outputs = program(*inputs)
            jax.block_until_ready(outputs)
            spent.append(time.perf_counter() - start)
            return outputs
        return run

    try:
        for _ in range(warmups):
            step()
            torch.tpu.synchronize()
        originals = dict(programs)
        programs.update({key: timed(program) for key, program in originals.items()})
        best = float("inf")
        for _ in range(repeats):
            spent.clear()
            result = step()
            torch.tpu.synchronize()
            best = min(best, sum(spent))
            del result
        for key in originals.keys() & programs.keys():
            programs[key] = originals[key]
        return best
    finally:
        torch.tpu.set_eager_mode("strict")


def llama_forward(device: str) -> Callable[[], torch.Tensor]:
    """The tiny Llama forward on ``device`` (``torch.no_grad``), returning the logits."""
    model, input_ids = tiny_llama()
    model, input_ids = model.to(device).eval(), input_ids.to(device)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids).logits

    return forward


def llama_training_step(device: str) -> Callable[[], None]:
    """A tiny Llama training step on ``device``: forward with labels, backward, AdamW, gradients zeroed."""
    model, input_ids = tiny_llama()
    model, input_ids = model.to(device).train(), input_ids.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        model(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def compare_with_cpu(name: str, title: str, workload: Callable[[str], Callable[[], object]], goal: float,
                     repeats: int, on_cuda: bool = False) -> None:
    """Prints ``workload``'s milliseconds on torch CPU, tpu strict and tpu fused (timed in turn, see
    :func:`alternated`), where fused mode's time goes (the host recording; XLA running the recorded chains), and
    the ratios to CPU."""
    variants = {"cpu": Variant("cpu", "strict", workload("cpu")), "strict": Variant("tpu", "strict", workload("tpu")),
                "fused": Variant("tpu", "fused", workload("tpu"))}
    if on_cuda and torch.cuda.is_available():
        variants["cuda"] = Variant("cuda", "strict", workload("cuda"))
    fused.reset_stats()
    best = alternated(variants, repeats)
    counts = fused.stats()
    cpu, strict, fused_time = best["cpu"].total, best["strict"].total, best["fused"]
    chains = chain_seconds(workload("tpu"), repeats)
    print(title)
    print(f"  torch cpu {cpu * 1e3:8.2f}   tpu strict {strict * 1e3:8.2f}   tpu fused {fused_time.total * 1e3:8.2f}")
    print(f"  fused / cpu {fused_time.total / cpu:5.2f}x (goal <= {goal}x)   strict / cpu {strict / cpu:5.2f}x   "
          f"fused: {counts['flushes']} chain runs, {counts['program_hits']} cache hits, "
          f"{counts['program_misses']} misses")
    report(f"{name}: tpu fused / torch cpu time", fused_time.total / cpu, "x", f"torch CPU eager (goal <= {goal}x)")
    report(f"{name}: tpu strict / torch cpu time", strict / cpu, "x", "torch CPU eager")
    print(f"  where fused mode's time goes: host until the call returns {fused_time.host * 1e3:.2f} "
          f"({fused_time.host / cpu:.2f}x cpu), XLA running its chains alone {chains * 1e3:.2f} "
          f"({chains / cpu:.2f}x cpu)")
    if "cuda" in best:
        cuda = best["cuda"].total
        print(f"  torch cuda eager {cuda * 1e3:.2f} on {torch.cuda.get_device_name()}: fused / cuda "
              f"{fused_time.total / cuda:.2f}x, strict / cuda {strict / cuda:.2f}x")
    print()


def resident_megabytes() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def steady_state(steps: int, warmup: int = 10) -> None:
    """Prints fused eager's program-cache hit rate over ``steps`` training steps after ``warmup``, and what the
    caches and memory hold at the end of the warm-up and at the end."""
    training_step = llama_training_step("tpu")
    torch.tpu.set_eager_mode("fused")
    try:
        marks = {}
        for step in range(steps):
            training_step()
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
    report(f"fused program cache hit rate over {steps} training steps", 100 * hits / max(hits + misses, 1), "%",
           f"goal ~100% after {warmup} warm-up steps")
    report(f"fused resident memory growth, step {warmup} to {steps}", end["RSS MiB"] - start["RSS MiB"], "MiB",
           "goal: no growth")
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
    fused.reset_stats()
    per_run = alternated({"jit": Variant("jax", "", add_chain_jax(args.chain)),
                          "strict": Variant("tpu", "strict", add_chain_tpu(args.chain)),
                          "fused": Variant("tpu", "fused", add_chain_tpu(args.chain))}, args.repeats)
    hits = fused.stats()
    jit, strict, fused_op = (per_run[name].total / args.chain for name in ("jit", "strict", "fused"))
    print(f"x = x + b chain of {args.chain} ops, 64x64 float32, µs per op")
    print(f"  jax.jit {jit * 1e6:8.1f}   tpu strict {strict * 1e6:8.1f}   tpu fused {fused_op * 1e6:8.1f}")
    print(f"  fused / jax.jit {fused_op / jit:5.2f}x (goal <= 1.3x)   strict / jax.jit {strict / jit:5.2f}x   "
          f"program cache: {hits['program_hits']} hits, {hits['program_misses']} misses\n")
    report("x = x + b: tpu fused / jax.jit time per op", fused_op / jit, "x", "jax.jit(jnp.add) (goal <= 1.3x)")
    report("x = x + b: tpu strict / jax.jit time per op", strict / jit, "x", "jax.jit(jnp.add)")

    compare_with_cpu("tiny Llama forward", "tiny Llama forward (hidden 256, 4 layers, 64 tokens), ms per forward",
                     llama_forward, 1.2, args.repeats, on_cuda=True)
    compare_with_cpu("tiny Llama training step",
                     "tiny Llama training step (forward, backward, AdamW), ms per step", llama_training_step, 1.5,
                     args.repeats)
    steady_state(args.steps)


if __name__ == "__main__":
    main()
