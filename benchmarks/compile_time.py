"""First-call time of a compiled model in a fresh process: cold and warm on-disk XLA cache.

Each measurement is a new Python process that builds the tiny Llama of ``llama_forward.py``
(hidden 256, 4 layers, seq 64), moves it to tpu and times its first ``torch.compile(backend="tpu")``
forward (Dynamo and AOTAutograd tracing, lowering, XLA compilation or a cache load, one run), then
a second call. The cold run uses an empty ``HF_TPU_CACHE_DIR``; the warm runs reuse what it wrote,
as a second process of a user does. Eager ops' programs are cached on disk as well, so the warm
process also skips compiling the weights' host-to-device copies.

    python benchmarks/compile_time.py [--warm-runs 2]
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
import json, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=1024)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval().to("tpu")
input_ids = torch.randint(0, config.vocab_size, (1, 64)).to("tpu")
compiled = torch.compile(model, backend="tpu")
with torch.no_grad():
    start = time.perf_counter()
    compiled(input_ids).logits.cpu()
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiled(input_ids).logits.cpu()
    second = time.perf_counter() - start
print(json.dumps({"first": first, "second": second, **torch.tpu.compile_stats()}))
"""


def run(cache_dir: str) -> dict:
    environment = {**os.environ, "HF_TPU_CACHE_DIR": cache_dir}
    completed = subprocess.run([sys.executable, "-c", _CHILD], env=environment, capture_output=True, text=True)
    if completed.returncode:
        raise SystemExit(completed.stderr)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-runs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = run(cache_dir)
        warm = min((run(cache_dir) for _ in range(args.warm_runs)), key=lambda r: r["first"])
    print("Tiny Llama forward (hidden 256, 4 layers, seq 64), torch.compile(backend='tpu'), new process\n")
    header = f"{'cache':<6} {'first call s':>13} {'XLA compile+load s':>19} {'loaded from disk':>17}"
    print(f"{header} {'second call ms':>15}")
    for name, result in (("cold", cold), ("warm", warm)):
        print(f"{name:<6} {result['first']:13.2f} {result['compile_seconds']:19.2f} "
              f"{result['disk_cache_hits']:17} {result['second'] * 1e3:15.2f}")
    print(f"\nwarm / cold first call: {warm['first'] / cold['first']:.2f}x")
    report("first compiled call, warm / cold XLA disk cache", warm["first"] / cold["first"], "x",
           "the same first call with an empty cache")
    report("first compiled call, warm cache", warm["first"], "s", "")


if __name__ == "__main__":
    main()
