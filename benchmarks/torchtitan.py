"""TorchTitan's Llama 3 debug model trained on tpu: 1, 2 and 4 processes, eager and compiled.

Needs TorchTitan, which the README's test command installs (see docs/guide/torchtitan.md). Makes a word-level
tokenizer and a dataset whose documents are all the same ``--seq-len`` tokens (so every rank's batches are the same
tokens whatever the data parallelism), a seed checkpoint in one process (the same initial weights for every run),
then trains ``--steps`` steps of each configuration with ``torchrun`` (tests/torchtitan_runs.py). Prints the
tokens/s and model-FLOPs utilisation TorchTitan reports (the mean over the steps after the first two), the peak
memory per rank, and whether each run's losses are those of one process (within 1e-3).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _report import report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from torchtitan_runs import assets, options, seed_checkpoint, train  # noqa: E402  (shared with the test)

TP2 = ("--parallelism.tensor_parallel_degree", "2")
RUNS = {  # name: (processes, batch per data-parallel rank (2 in all), TorchTitan options)
    "1 process": (1, 2, ()),
    "1 process, compiled": (1, 2, ("--compile.enable",)),
    "2 processes, FSDP2": (2, 1, ()),
    "2 processes, FSDP2, compiled": (2, 1, ("--compile.enable",)),
    "2 processes, TP=2": (2, 2, (*TP2, "--parallelism.data_parallel_shard_degree", "1")),
    "4 processes, FSDP2 x TP=2": (4, 1, (*TP2, "--parallelism.data_parallel_shard_degree", "2")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    common = options(args.steps, args.seq_len, checkpoint_interval=10 * args.steps)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        assets(folder, args.seq_len)
        seed_checkpoint(folder, common)
        results = {run: list(train(folder, run, *settings, common).values()) for run, settings in RUNS.items()}
    reference = [loss for loss, *_ in results["1 process"]]
    print(f"TorchTitan llama3 debug model, {args.steps} steps of 2 x {args.seq_len} tokens (global batch)\n")
    print(f"{'run':<30} {'tokens/s':>9} {'mfu %':>7} {'GiB/rank':>9} {'losses = 1 process':>19}")
    for run, steps in results.items():
        timed = steps[2:] or steps
        tokens = sum(step[2] for step in timed) / len(timed)
        mfu = sum(step[3] for step in timed) / len(timed)
        same = all(abs(loss - expected) <= 1e-3 for (loss, *_), expected in zip(steps, reference))
        print(f"{run:<30} {tokens:9.0f} {mfu:7.3f} {max(step[1] for step in steps):9.2f} {str(same):>19}")
        report(f"torchtitan tokens/s per rank, {run}", tokens, "tokens/s", "")
    print("\nlosses of one process:", ", ".join(f"{loss:.5f}" for loss in reference))


if __name__ == "__main__":
    main()
