"""TorchTitan's Llama 3 debug model trained on tpu: 1, 2 and 4 processes, eager and compiled.

Needs TorchTitan, which the test extra does not install (see docs/guide/torchtitan.md):
``pip install torchtitan triton`` in an environment of its own. Makes a word-level tokenizer and a dataset whose
documents are all the same ``--seq-len`` tokens (so every rank's batches are the same tokens whatever the data
parallelism), a seed checkpoint in one process (the same initial weights for every run), then trains ``--steps``
steps of each configuration with ``torchrun``. Prints the tokens/s and model-FLOPs utilisation TorchTitan reports
(the mean over the steps after the first two), the peak memory per rank, and whether each run's losses are those of
one process (within 1e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import report

TP2 = ("--parallelism.tensor_parallel_degree", "2")
RUNS = {  # name: (processes, batch per data-parallel rank (2 in all), TorchTitan options)
    "1 process": (1, 2, ()),
    "1 process, compiled": (1, 2, ("--compile.enable",)),
    "2 processes, FSDP2": (2, 1, ()),
    "2 processes, FSDP2, compiled": (2, 1, ("--compile.enable",)),
    "2 processes, TP=2": (2, 2, (*TP2, "--parallelism.data_parallel_shard_degree", "1")),
    "4 processes, FSDP2 x TP=2": (4, 1, (*TP2, "--parallelism.data_parallel_shard_degree", "2")),
}
STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


def assets(folder: Path, seq_len: int) -> None:
    """TorchTitan's debug config reads ./tests/assets/tokenizer and ./tests/assets/c4_test."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{index}" for index in range(1000)]
    tokenizer = Tokenizer(models.WordLevel(
        {word: index for index, word in enumerate(["<unk>", "<|begin_of_text|>", "<|end_of_text|>", *words])},
        unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (folder / "tests/assets/tokenizer").mkdir(parents=True)
    tokenizer.save(str(folder / "tests/assets/tokenizer/tokenizer.json"))
    (folder / "tests/assets/tokenizer/tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    document = " ".join(random.Random(0).choices(words, k=seq_len - 1))  # with BOS and EOS: one sample each
    (folder / "tests/assets/c4_test").mkdir(parents=True)
    (folder / "tests/assets/c4_test/data.json").write_text((json.dumps({"text": document}) + "\n") * 64)


def train(folder: Path, name: str, processes: int, batch: int, options: tuple, common: list[str]) -> list[tuple]:
    """Each step's (loss, memory GiB, tokens/s, mfu %) on rank 0."""
    dump = folder / name.replace(" ", "_").replace(",", "").replace("=", "")
    shutil.copytree(folder / "seed/checkpoint/step-0", dump / "checkpoint/step-0")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--standalone",
               "-m", "torchtitan.train", *common, *options, "--dump_folder", str(dump),
               "--training.local_batch_size", str(batch)]
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_TPU_STRICT_COMPILE": "1"})
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    text = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    steps = {}
    for match in STEP.finditer(text):
        steps.setdefault(int(match.group(1)), (float(match.group(2)), float(match.group(3)),
                                               float(match.group(4).replace(",", "")), float(match.group(5))))
    return [steps[step] for step in sorted(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    common = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", str(args.steps),
              "--training.seq_len", str(args.seq_len), "--validator.no-enable", "--checkpoint.enable",
              "--checkpoint.interval", str(10 * args.steps), "--parallelism.spmd_backend", "partial_dtensor"]
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        assets(folder, args.seq_len)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone", "-m",
                        "torchtitan.train", *common, "--checkpoint.create_seed_checkpoint",
                        "--parallelism.data_parallel_shard_degree", "1", "--dump_folder", str(folder / "seed")],
                       cwd=folder, check=True, capture_output=True, timeout=600)
        results = {run: train(folder, run, *settings, common) for run, settings in RUNS.items()}
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
