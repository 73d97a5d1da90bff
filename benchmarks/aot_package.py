"""Start-up of an ahead-of-time package against torch.compile's warm start, each in a fresh process.

The tiny Llama of ``tiny_llama.py`` (hidden 256, 4 layers, seq 64) is exported on tpu and saved with
``hf_tpu.export.save``. Then, each in a new Python process with the same on-disk XLA cache
(``HF_TPU_CACHE_DIR``, warmed by a first run of each):

- the package: ``hf_tpu.export.load`` (weights to the device) and its first call, in a process that
  imports neither transformers nor Dynamo;
- ``torch.compile(backend="tpu")``: the first compiled forward of the model already on tpu (Dynamo and
  AOTAutograd tracing, lowering, the XLA program loaded from the cache), measured as
  ``compile_time.py`` does.

    python benchmarks/aot_package.py [--warm-runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _report import report
from compile_time import run as compiled_first_call

_EXPORT = """
import sys, torch
import hf_tpu.export
from tiny_llama import tiny_llama
model, input_ids = tiny_llama()
model = model.eval().to("tpu")
exported = torch.export.export(model, (), {"input_ids": input_ids.to("tpu"), "use_cache": False})
hf_tpu.export.save(exported, sys.argv[1])
"""

_LOAD_AND_CALL = """
import json, sys, time
import torch
import hf_tpu.export
input_ids = torch.randint(0, 1024, (1, 64)).to("tpu")
start = time.perf_counter()
program = hf_tpu.export.load(sys.argv[1])
torch.tpu.synchronize()
loaded = time.perf_counter()
program(input_ids=input_ids, use_cache=False)["logits"].cpu()
first = time.perf_counter()
program(input_ids=input_ids, use_cache=False)["logits"].cpu()
second = time.perf_counter() - first
print(json.dumps({"load": loaded - start, "first": first - loaded, "second": second,
                  "imports transformers": "transformers" in sys.modules,
                  "imports Dynamo": "torch._dynamo" in sys.modules}))
"""


def _python(code: str, cache_dir: str, *args: str) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    environment = {**os.environ, "HF_TPU_CACHE_DIR": cache_dir,
                   "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run([sys.executable, "-c", code, *args], env=environment, capture_output=True, text=True)
    if completed.returncode:
        raise SystemExit(completed.stderr)
    return completed.stdout


def package_first_call(cache_dir: str, path: str) -> dict:
    return json.loads(_python(_LOAD_AND_CALL, cache_dir, path).strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-runs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir, tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "tiny_llama.hftpu")
        _python(_EXPORT, cache_dir, path)
        cold_package, cold_compiled = package_first_call(cache_dir, path), compiled_first_call(cache_dir)
        package = min((package_first_call(cache_dir, path) for _ in range(args.warm_runs)),
                      key=lambda r: r["load"] + r["first"])
        compiled = min((compiled_first_call(cache_dir) for _ in range(args.warm_runs)), key=lambda r: r["first"])
        size = os.path.getsize(path)
    print("Tiny Llama forward (hidden 256, 4 layers, seq 64), new process, warm XLA disk cache\n")
    print(f"package: {size / 2**20:.1f} MiB; its process imports transformers: {package['imports transformers']}, "
          f"Dynamo: {package['imports Dynamo']}")
    print(f"{'variant':<34} {'load s':>7} {'first call s':>13} {'load + first s':>15} {'second call ms':>15}")
    package_total = package["load"] + package["first"]
    print(f"{'hf_tpu.export package':<34} {package['load']:7.2f} {package['first']:13.2f} {package_total:15.2f} "
          f"{package['second'] * 1e3:15.2f}")
    print(f"{'torch.compile(backend=tpu)':<34} {'':>7} {compiled['first']:13.2f} {compiled['first']:15.2f} "
          f"{compiled['second'] * 1e3:15.2f}")
    print(f"\npackage load + first call / torch.compile first call: {package_total / compiled['first']:.2f}x")
    cold_total = cold_package["load"] + cold_package["first"]
    print(f"cold cache (XLA compiles): package load + first call {cold_total:.2f} s, "
          f"torch.compile first call {cold_compiled['first']:.2f} s")
    report("package load + first call / torch.compile first call, warm cache", package_total / compiled["first"], "x",
           "torch.compile(backend='tpu'), first call of a new process")
    report("package load + first call / torch.compile first call, cold cache", cold_total / cold_compiled["first"],
           "x", "torch.compile(backend='tpu'), first call of a new process")
    report("package load + first call, warm cache", package_total, "s", "")


if __name__ == "__main__":
    main()
