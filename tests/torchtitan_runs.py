"""TorchTitan (the PyPI release) trained on tpu with torchrun: what tests/test_torchtitan.py and
benchmarks/torchtitan.py run. TorchTitan's Llama 3 debug config reads ./tests/assets/tokenizer and
./tests/assets/c4_test from its working directory; :func:`assets` makes both (a word-level tokenizer, documents of
``seq_len`` tokens each), so every rank's batches are the same tokens whatever the data parallelism, and
:func:`seed_checkpoint` gives every run the same initial weights.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


def assets(folder: Path, seq_len: int) -> None:
    """The tokenizer and dataset TorchTitan's debug config reads, in ``folder``."""
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


def options(steps: int, seq_len: int, checkpoint_interval: int) -> list[str]:
    """The stock Llama 3 debug config (FlexAttention, selective activation checkpointing) for ``steps`` steps,
    saving a distributed checkpoint every ``checkpoint_interval`` steps, from the initial weights of seed 0."""
    return ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", str(steps),
            "--training.seq_len", str(seq_len), "--validator.no-enable", "--checkpoint.enable",
            "--checkpoint.interval", str(checkpoint_interval), "--parallelism.spmd_backend", "partial_dtensor",
            "--debug.seed", "0"]


def _torchrun(folder: Path, processes: int, arguments: list[str], timeout: float) -> str:
    """``python -m torchtitan.train arguments`` under torchrun; its output. Past ``timeout`` the launch and its
    workers are stopped and RuntimeError says so; a failed launch raises RuntimeError with its output."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--standalone",
               "-m", "torchtitan.train", *arguments]
    environment = {**os.environ, "HF_TPU_STRICT_COMPILE": "1"}
    environment.pop("HF_TPU_NUM_DEVICES", None)  # one chip per process
    process = subprocess.Popen(command, cwd=folder, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise RuntimeError(f"TorchTitan on {processes} processes ran over {timeout} s:\n{output[-3000:]}") from None
    if process.returncode:
        raise RuntimeError(f"TorchTitan on {processes} processes failed:\n{output[-5000:]}")
    return re.sub(r"\x1b\[[0-9;]*m", "", output)


def seed_checkpoint(folder: Path, common: list[str], timeout: float = 600) -> None:
    """The initial weights every run starts from, in ``folder/seed``."""
    _torchrun(folder, 1, [*common, "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree",
                          "1", "--dump_folder", str(folder / "seed")], timeout)


def train(folder: Path, name: str, processes: int, batch: int, extra: tuple | list, common: list[str],
          timeout: float = 1800) -> dict[int, tuple[float, float, float, float]]:
    """Trains with ``processes`` ranks of ``batch`` samples each, in ``folder/name`` (started from the seed
    checkpoint; a second call with the same ``name`` resumes from that run's latest checkpoint). Rank 0's
    (loss, memory GiB, tokens/s, mfu %) of each step it trained."""
    dump = folder / name.replace(" ", "_").replace(",", "").replace("=", "")
    if not (dump / "checkpoint").exists():
        shutil.copytree(folder / "seed/checkpoint/step-0", dump / "checkpoint/step-0")
    text = _torchrun(folder, processes, [*common, *extra, "--dump_folder", str(dump), "--training.local_batch_size",
                                         str(batch)], timeout)
    steps: dict[int, tuple[float, float, float, float]] = {}
    for match in STEP.finditer(text):
        steps.setdefault(int(match.group(1)), (float(match.group(2)), float(match.group(3)),
                                               float(match.group(4).replace(",", "")), float(match.group(5))))
    return dict(sorted(steps.items()))
