"""A first greedy ``generate`` in a new process, strict and fused eager mode side by side, cold caches.

Each measurement is a fresh Python process with empty caches (``HF_TPU_CACHE_DIR`` and torch's
``TORCHINDUCTOR_CACHE_DIR``) that builds the Llama of ``decode.py`` on tpu and times a first, then a second
``generate(..., cache_implementation="static")`` of 64 new tokens, in one eager mode. The first call compiles:
the prompt and decode-step graphs, and in eager mode one program per op and token length (the token tensors
grow at each step), in fused mode one chain program per step. Prints the seconds of each call, the seconds XLA
spent compiling (JAX's monitoring events) and how many programs it compiled.

    python benchmarks/first_generate.py [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _report import report

_CHILD = """
import json, sys, time
import jax, torch
import decode
compile_seconds, compiles = [0.0], [0]

def count_compiles(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        compile_seconds[0] += duration
        compiles[0] += 1

jax.monitoring.register_event_duration_secs_listener(count_compiles)
torch.tpu.set_eager_mode(sys.argv[1])
model = decode.build_model().to("tpu")
prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).to("tpu")
seconds = []
for _ in range(2):
    start = time.perf_counter()
    decode.hf_generate(model, prompt, cache_implementation="static")
    seconds.append(time.perf_counter() - start)
print(json.dumps({"first": seconds[0], "second": seconds[1], "compile": compile_seconds[0], "programs": compiles[0]}))
"""


def measure(mode: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        environment = dict(os.environ, HF_TPU_CACHE_DIR=os.path.join(cache, "hf_tpu"),
                           TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "torch"))
        here = os.path.dirname(os.path.abspath(__file__))
        done = subprocess.run([sys.executable, "-c", _CHILD, mode], env=environment, cwd=here, capture_output=True,
                              text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    runs = parser.parse_args().runs
    print(f"{'mode':<8} {'first s':>8} {'second s':>9} {'XLA compile s':>14} {'programs':>9}")
    first = {"strict": float("inf"), "fused": float("inf")}
    for _ in range(runs):
        for mode in first:
            result = measure(mode)
            print(f"{mode:<8} {result['first']:8.2f} {result['second']:9.2f} {result['compile']:14.2f} "
                  f"{result['programs']:9d}")
            first[mode] = min(first[mode], result["first"])
    for mode, seconds in first.items():
        report(f"first generate, {mode} eager mode", seconds, "s", f"best of {runs} new processes")
    report("first generate, fused / strict", first["fused"] / first["strict"], "x", "strict eager mode's first call")


if __name__ == "__main__":
    main()
