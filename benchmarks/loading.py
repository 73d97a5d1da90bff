"""Loading cost: from_pretrained(device_map="tpu") next to device_map="cpu" on one generated checkpoint.

Writes a Llama safetensors checkpoint of about ``--size-gb`` (float32, random weights; reused if the
directory already holds one), then loads it several times, alternating cpu and tpu, each load in a fresh
subprocess so that peak resident memory (``VmHWM``) belongs to that load alone. For each load it
records the wall time of ``from_pretrained`` (the tpu one ends with ``torch.tpu.synchronize()``), the
resident memory just before it (after imports and device start-up) and the peak. It prints the best of
the repeats and the tpu/cpu ratios; the goals are a peak (above the resident memory before loading) at
most 1.3x the checkpoint size and a wall time at most 1.5x that of the cpu load.

    python benchmarks/loading.py [--size-gb 1.0] [--dtype float32|bfloat16] [--repeats 3] [--dir PATH]

On JAX's CPU platform the device's memory is host memory, so the tpu load's peak includes the loaded
weights themselves, as the cpu load's does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _report import report

_MEASURE = r"""
import json, sys, time
import torch, transformers
directory, mode, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
device_map = mode.split("+")[0]
if device_map == "tpu":
    torch.ones(1, device="tpu").cpu()  # start the device before measuring the baseline
def status(field):  # VmRSS: resident now; VmHWM: peak resident of this process image (ru_maxrss survives exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
config = transformers.AutoConfig.from_pretrained(directory)
model_class = getattr(transformers, config.architectures[0])  # imported now, not inside the timed load
before = status("VmRSS")
start = time.perf_counter()
model = model_class.from_pretrained(directory, device_map=device_map, dtype=dtype)
if device_map == "tpu":
    torch.tpu.synchronize()
if mode == "cpu+read":  # the cpu load maps the file lazily: read one value per page of every weight
    for parameter in model.parameters():
        parameter.detach().reshape(-1)[:: 4096 // parameter.element_size()].sum()
wall = time.perf_counter() - start
assert {p.device.type for p in model.parameters()} == {device_map}
print(json.dumps({"wall": wall, "before": before, "peak": status("VmHWM")}))
"""


# cpu: from_pretrained(device_map="cpu"), which maps the file and reads weights only when first used;
# cpu+read: the same, then one read of every page of the weights; tpu: from_pretrained(device_map="tpu").
MODES = ("cpu", "cpu+read", "tpu")


def write_checkpoint(directory: str, size_gb: float) -> int:
    """A float32 Llama checkpoint of about ``size_gb`` GB in ``directory``; returns its size in bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    path = os.path.join(directory, "model.safetensors")
    if not os.path.exists(path):
        hidden, intermediate, vocab = 1024, 4096, 32000
        per_layer = 4 * (4 * hidden * hidden + 3 * hidden * intermediate)
        layers = max(1, round((size_gb * 1e9 - 2 * 4 * vocab * hidden) / per_layer))
        config = transformers.LlamaConfig(
            hidden_size=hidden, intermediate_size=intermediate, vocab_size=vocab, num_hidden_layers=layers,
            num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
        )
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        generator = torch.Generator().manual_seed(0)
        weights = {name: torch.randn(p.shape, generator=generator) * 0.02 for name, p in model.state_dict().items()}
        save_file(weights, path, metadata={"format": "pt"})
        config.save_pretrained(directory)
        del weights
    return os.path.getsize(path)


def measure(directory: str, mode: str, dtype: str) -> dict:
    environment = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    completed = subprocess.run(
        [sys.executable, "-c", _MEASURE, directory, mode, dtype],
        env=environment, capture_output=True, text=True, check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"loading ({mode}) failed:\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where to write (or find) the checkpoint; a temporary directory by default")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir or scratch
        os.makedirs(directory, exist_ok=True)
        start = time.perf_counter()
        size = write_checkpoint(directory, args.size_gb)
        print(f"checkpoint: {size / 1e9:.2f} GB float32 ({time.perf_counter() - start:.1f} s), loading as {args.dtype}")
        with open(os.path.join(directory, "model.safetensors"), "rb") as f:  # warm the page cache for both
            while f.read(1 << 26):
                pass
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                results[mode].append(measure(directory, mode, args.dtype))

    best = {}
    print(f"{'load':>9} {'wall s':>7} {'rss before GB':>14} {'peak GB':>8} {'added GB':>9} {'added/ckpt':>11}")
    for mode, runs in results.items():
        wall = min(r["wall"] for r in runs)
        run = min(runs, key=lambda r: r["peak"])
        added = run["peak"] - run["before"]
        best[mode] = (wall, added)
        print(f"{mode:>9} {wall:7.2f} {run['before'] / 1e9:14.2f} {run['peak'] / 1e9:8.2f} {added / 1e9:9.2f} "
              f"{added / size:11.2f}")
    tpu_wall, tpu_added = best["tpu"]
    print(f"tpu / cpu wall time: {tpu_wall / best['cpu'][0]:.2f}x, "
          f"tpu / cpu+read: {tpu_wall / best['cpu+read'][0]:.2f}x (goal <= 1.5x)")
    print(f"tpu peak RSS added by loading / checkpoint size: {tpu_added / size:.2f}x (goal <= 1.3x)")
    report(f"from_pretrained as {args.dtype}, tpu / cpu wall time", tpu_wall / best["cpu"][0], "x",
           'device_map="cpu" (maps the file, reads weights when first used)')
    report(f"from_pretrained as {args.dtype}, tpu / cpu+read wall time", tpu_wall / best["cpu+read"][0], "x",
           'device_map="cpu", then every page read (goal <= 1.5x)')
    report(f"from_pretrained as {args.dtype}, tpu peak RSS added / checkpoint size", tpu_added / size, "x",
           f"the {size / 1e9:.2f} GB float32 checkpoint (goal <= 1.3x)")


if __name__ == "__main__":
    main()
