"""Warm start: the first compiled call of a model in a new process, cold and warm caches.

Each measurement is a fresh Python process that builds the tiny Llama of ``compile_time.py`` (hidden 256,
4 layers, seq 64) from its config, moves it to the device and times its first ``torch.compile`` forward
under ``torch.no_grad()`` (Dynamo tracing, AOTAutograd or its cache, lowering, XLA compilation or a cache
load, one run), in wall seconds and in process CPU seconds (less sensitive to a busy host), and the wall seconds of
``torch.compile(model)`` and that call together (``with compile``: where a saved Dynamo package is loaded). Rows:

- ``tpu cold``: empty caches (``HF_TPU_CACHE_DIR`` and torch's ``TORCHINDUCTOR_CACHE_DIR``); it writes what
  Dynamo made of the forward (torch's caching precompile, on by default in a process using tpu:
  ``hf_tpu/integrations/dynamo.py``), AOTAutograd's result and the XLA program;
- ``tpu warm``: the default a second process gets: Dynamo's package is installed when ``torch.compile`` wraps the
  forward, nothing is traced, and the XLA program is loaded;
- ``tpu warm, no backend``: the same, compiled as users write it, ``torch.compile(model)`` (Inductor's wrapper,
  which sends tpu graphs to hf_tpu; reading its configuration is put off, since that imports Inductor's compiler);
- ``tpu warm, Dynamo traces``: the package off (``TORCH_CACHING_PRECOMPILE=0``, its own caches): Dynamo traces,
  AOTAutograd's result and the XLA program are loaded (the default before 2026-12-04);
- ``tpu warm, XLA cache only``: the AOTAutograd cache off too (``TORCHINDUCTOR_AUTOGRAD_CACHE=0``): Dynamo and
  AOTAutograd trace again;
- ``cpu eager backend``: Dynamo alone (``backend="eager"`` runs its graph as it is), what a cache below
  Dynamo leaves; but a process that never ran a tpu op, so Python's collector is not held back during its
  compile as it is in the tpu rows (``hf_tpu/compile/frozen_heap.py``, about half a second here);
- ``cpu inductor cold / warm``: torch's own backend with its own caches, for comparison (``--no-inductor``
  skips it: a cold Inductor compile of this model takes a minute on a small host).

    python benchmarks/warm_start.py [--runs 3] [--no-inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _report import report

GOAL_SECONDS = 1.0

_CHILD = """
import json, sys, time
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
device, backend = sys.argv[1], sys.argv[2]
config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=1024)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval().to(device)
input_ids = torch.randint(0, config.vocab_size, (1, 64)).to(device)
start = time.perf_counter()
compiled = torch.compile(model) if backend == "default" else torch.compile(model, backend=backend)
with torch.no_grad():
    wall, cpu = time.perf_counter(), time.process_time()
    logits = compiled(input_ids).logits.cpu()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
with_compile = time.perf_counter() - start
stats = torch.tpu.compile_stats() if device == "tpu" else {}
print(json.dumps({"wall": wall, "cpu": cpu, "with_compile": with_compile, "checksum": logits.double().sum().item(),
                  "packages": counters["dynamo_cache"]["dynamo_cache_hit"], **stats}))
"""


def measure(device: str, backend: str, cache_dir: str, **environment: str) -> dict:
    """One fresh process's first compiled call, with hf_tpu's and torch's caches under ``cache_dir``."""
    env = {**os.environ, "HF_TPU_CACHE_DIR": os.path.join(cache_dir, "xla"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "torch"), "HF_HUB_OFFLINE": "1", **environment}
    completed = subprocess.run([sys.executable, "-c", _CHILD, device, backend], env=env, capture_output=True,
                               text=True, timeout=900)
    if completed.returncode:
        raise SystemExit(completed.stderr)
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    print(f"measured {device} {backend} {environment or ''}: {result['wall']:.2f} s", file=sys.stderr, flush=True)
    return result


def best(runs: int, *args: str, **environment: str) -> dict:
    """The measurement of ``runs`` that took the least CPU time (the others met a busier host)."""
    return min((measure(*args, **environment) for _ in range(runs)), key=lambda result: result["cpu"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="warm measurements per row (the least CPU time is shown)")
    parser.add_argument("--no-inductor", action="store_true", help="skip the Inductor rows")
    args = parser.parse_args()
    rows = {}
    with (tempfile.TemporaryDirectory() as tpu_cache, tempfile.TemporaryDirectory() as cpu_cache,
          tempfile.TemporaryDirectory() as traced_cache):
        rows["tpu cold"] = measure("tpu", "tpu", tpu_cache)
        rows["tpu warm"] = best(args.runs, "tpu", "tpu", tpu_cache)
        rows["tpu warm, no backend"] = best(args.runs, "tpu", "default", tpu_cache)
        measure("tpu", "tpu", traced_cache, TORCH_CACHING_PRECOMPILE="0")  # fills its AOTAutograd and XLA caches
        rows["tpu warm, Dynamo traces"] = best(args.runs, "tpu", "tpu", traced_cache, TORCH_CACHING_PRECOMPILE="0")
        rows["tpu warm, XLA cache only"] = best(args.runs, "tpu", "tpu", traced_cache, TORCH_CACHING_PRECOMPILE="0",
                                                TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        rows["cpu eager backend"] = best(args.runs, "cpu", "eager", cpu_cache)
        if not args.no_inductor:
            rows["cpu inductor cold"] = measure("cpu", "inductor", cpu_cache)
            rows["cpu inductor warm"] = best(args.runs, "cpu", "inductor", cpu_cache)
    print("Tiny Llama forward (hidden 256, 4 layers, seq 64), first torch.compile call of a new process\n")
    print(f"{'':<32} {'wall s':>7} {'cpu s':>7} {'with compile':>13} {'Dynamo loaded':>14} "
          f"{'AOTAutograd loaded':>19} {'XLA loaded':>11}")
    for name, result in rows.items():
        loaded = (f"{result['warm_starts']:>19} {result['disk_cache_hits']:>11}" if "warm_starts" in result
                  else f"{'-':>19} {'-':>11}")
        print(f"{name:<32} {result['wall']:7.2f} {result['cpu']:7.2f} {result['with_compile']:13.2f} "
              f"{result['packages']:>14} {loaded}")
    cold, traced, before, warm = (rows[name] for name in ("tpu cold", "tpu warm, Dynamo traces",
                                                          "tpu warm, XLA cache only", "tpu warm"))
    tpu_rows = [result for name, result in rows.items() if name.startswith("tpu")]
    if len({result["checksum"] for result in tpu_rows}) != 1:
        raise SystemExit("a warm start changed the logits")
    for name in ("tpu warm", "tpu warm, no backend"):
        if not rows[name]["packages"]:
            print(f"({name} loaded no Dynamo package)")
    if not traced["warm_starts"]:
        print("(the traced row missed the AOTAutograd cache: hf_tpu's sources changed between the runs)")
    print(f"\ntpu warm / cold: {warm['wall'] / cold['wall']:.2f}x; warm / warm with Dynamo tracing: "
          f"{warm['wall'] / traced['wall']:.2f}x; / warm with the XLA cache only: {warm['wall'] / before['wall']:.2f}x")
    print(f"tpu warm / cpu eager backend (Dynamo alone): {warm['wall'] / rows['cpu eager backend']['wall']:.2f}x")
    report("first call, tpu warm / cold", warm["wall"] / cold["wall"], "x", "tpu with empty caches")
    report("first call, tpu warm / warm with Dynamo tracing", warm["wall"] / traced["wall"], "x",
           "TORCH_CACHING_PRECOMPILE=0")
    report("first call, tpu warm / cpu eager backend", warm["wall"] / rows["cpu eager backend"]["wall"], "x",
           "Dynamo alone (backend='eager' on CPU)")
    if not args.no_inductor:
        print(f"tpu warm / cpu inductor warm: {warm['wall'] / rows['cpu inductor warm']['wall']:.2f}x")
        report("first call, tpu warm / cpu inductor warm", warm["wall"] / rows["cpu inductor warm"]["wall"], "x",
               "Inductor on CPU, warm caches")
    for name in ("tpu warm", "tpu warm, no backend"):
        result = rows[name]
        verdict = "met" if result["with_compile"] <= GOAL_SECONDS else "not met"
        print(f"goal: {name}, torch.compile and first call <= {GOAL_SECONDS:.1f} s: {verdict} "
              f"({result['with_compile']:.2f} s; first call {result['wall']:.2f} s)")
        report(f"{name}: torch.compile and first call", result["with_compile"], "s", f"goal <= {GOAL_SECONDS:.1f} s")


if __name__ == "__main__":
    main()
