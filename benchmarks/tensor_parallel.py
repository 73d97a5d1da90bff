"""Tensor-parallel decode of a small Llama: TP=1 against TP=2 and 4, one process per chip (torchrun +
``tpu_dist``) and one process driving every chip (SPMD), side by side in one run.

A LlamaForCausalLM built from a config (random weights, float32, no downloads; hidden 512, 4 layers, 8 heads /
4 KV heads by default) is saved once, then every row loads that checkpoint with transformers' ``from_pretrained``
in fresh processes, which the benchmark starts itself, one row after the other, each bounded by ``--timeout``:

- **TP=1**: one process, one chip: ``from_pretrained(path, device_map="tpu")`` (``HF_TPU_NUM_DEVICES=1``);
- **tpu_dist, TP=N**: ``torchrun --nproc-per-node N``, one process per chip, each driving its chip as ``tpu:0``:
  ``from_pretrained(path, distributed_config=DistributedConfig(tp_size=N))`` (DTensor weights, collectives on
  ``tpu_dist``);
- **SPMD, TP=N**: one process, N chips (``HF_TPU_NUM_DEVICES=N``, no torchrun):
  ``from_pretrained(path, device_map="tpu", distributed_config=DistributedConfig(tp_size=N))``, which loads
  straight into shards (what ``hf_tpu.shard(model, tp_size=N)`` does to a loaded model).

Each row measures the weight bytes on each chip (``torch.tpu.memory_allocated`` after loading, less before: per
rank for tpu_dist, per chip for SPMD) and greedy decode with the static cache (whose decode step is compiled),
batch 1: a warm-up ``generate`` (compiles; its new tokens are the row's tokens, compared with TP=1's and, for
tpu_dist, across ranks), then the median of ``--repeats`` timed ``generate`` calls, each ending with the tokens
on the host (tpu_dist: rank 0's time, every rank starting after a barrier). tokens/s counts the new tokens over
the whole call (prefill included). Ratios: tokens/s and the fullest chip's bytes over TP=1's, and SPMD's
tokens/s over tpu_dist's at the same tp (above 1: SPMD is faster).

Without TPU chips (no libtpu) the chips are JAX CPU devices (``HF_TPU_PLATFORM=cpu``) sharing the host's cores:
TP > 1 cannot be faster there, and the figures are the cost of the collectives and of partitioning.

    python benchmarks/tensor_parallel.py [--quick] [--tp 1,2,4] [--hidden 512] [--layers 4] [--heads 8]
                                         [--kv-heads 4] [--intermediate 1376] [--vocab 2048] [--prompt 16]
                                         [--new-tokens 32] [--repeats 3] [--timeout 300]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _report

FULL = dict(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1376, vocab=2048, prompt=16, new_tokens=32,
            repeats=3, tp="1,2,4")
QUICK = dict(FULL, hidden=128, layers=2, intermediate=344, vocab=512, prompt=8, new_tokens=8, repeats=1, tp="1,2")
PATHS = ("one chip", "tpu_dist", "SPMD")  # rows at tp 1 are "one chip"; both others at every tp > 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"a short run: {', '.join(f'{k} {v}' for k, v in QUICK.items() if FULL[k] != v)}")
    parser.add_argument("--tp", help=f"comma-separated tp sizes, starting with 1 (default {FULL['tp']})")
    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "prompt", "new_tokens"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {FULL[name]}")
    parser.add_argument("--repeats", type=int, help=f"timed generate calls per row (default {FULL['repeats']})")
    parser.add_argument("--timeout", type=float, default=300, help="seconds each row's processes may run")
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)  # a row's process (internal)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the unset ones from the default (or ``--quick``) preset."""
    args = build_parser().parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.tp_sizes = [int(size) for size in args.tp.split(",")]
    if args.tp_sizes[0] != 1 or any(size < 1 for size in args.tp_sizes):
        raise SystemExit(f"--tp {args.tp}: pass positive tp sizes starting with 1, the reference (e.g. 1,2,4)")
    return args


# ---- a row's process ---------------------------------------------------------------------------------------


def load(path: str, kind: str, tp: int):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if kind == "one chip":
        return AutoModelForCausalLM.from_pretrained(path, device_map="tpu")
    config = DistributedConfig(tp_size=tp)
    if kind == "tpu_dist":
        return AutoModelForCausalLM.from_pretrained(path, distributed_config=config)
    return AutoModelForCausalLM.from_pretrained(path, device_map="tpu", distributed_config=config)


def worker(args: argparse.Namespace) -> None:
    """Loads the checkpoint as row ``args.worker`` at ``args.size``, decodes, and writes this process's figures."""
    import torch
    import torch.distributed as dist

    import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    if args.worker == "tpu_dist":
        dist.init_process_group()  # tpu's default backend: tpu_dist
    chips = range(torch.tpu.device_count())
    before = [torch.tpu.memory_allocated(chip) for chip in chips]
    model = load(args.model, args.worker, args.size).eval()
    gc.collect()
    weight_bytes = [torch.tpu.memory_allocated(chip) - start for chip, start in zip(chips, before)]
    model.generation_config.eos_token_id = None  # random weights: decode every new token
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to("tpu")

    def greedy() -> list[int]:
        if dist.is_initialized():
            dist.barrier()
        with torch.no_grad():
            output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                                    do_sample=False, cache_implementation="static", pad_token_id=0)
        return output[0, args.prompt:].cpu().tolist()

    tokens = greedy()  # warm-up: compiles the decode step
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        greedy()
        seconds.append(time.perf_counter() - start)
    rank = dist.get_rank() if dist.is_initialized() else 0
    figures = dict(tokens=tokens, seconds=statistics.median(seconds), weight_bytes=weight_bytes)
    Path(args.results, f"rank{rank}.json").write_text(json.dumps(figures))
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the benchmark: one process starting the rows --------------------------------------------------------------


def save_model(args: argparse.Namespace, folder: str) -> int:
    """The Llama of ``args`` saved in ``folder`` (on the CPU); returns its weight bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new_tokens, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment(kind: str, tp: int) -> dict[str, str]:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if importlib.util.find_spec("libtpu") is None:  # no TPU software: JAX's CPU devices are the chips
        environment.setdefault("HF_TPU_PLATFORM", "cpu")
    if kind == "tpu_dist":
        environment.pop("HF_TPU_NUM_DEVICES", None)  # each process drives its own chip
    else:
        environment["HF_TPU_NUM_DEVICES"] = str(tp)
    return environment


def _run(command: list[str], environment: dict[str, str], timeout: float) -> str:
    """Runs ``command`` in a session of its own; past ``timeout`` it is asked to stop (torchrun then stops its
    workers), then killed with everything it started. Returns its output; raises if it failed."""
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        raise SystemExit(f"{' '.join(command)} ran over {timeout} s:\n{output[-3000:]}")
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{output[-3000:]}")
    return output


def run_row(kind: str, tp: int, model: str, args: argparse.Namespace) -> list[dict]:
    """One row's processes; returns each process's figures (one per rank for tpu_dist)."""
    with tempfile.TemporaryDirectory(prefix="tensor_parallel_") as results:
        options = ["--worker", kind, "--size", str(tp), "--model", model, "--results", results,
                   "--vocab", str(args.vocab), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
                   "--repeats", str(args.repeats)]
        script = [os.path.abspath(__file__), *options]
        if kind == "tpu_dist":
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
                       "--master-port", str(_free_port()), *script]
        else:
            command = [sys.executable, *script]
        _run(command, _environment(kind, tp), args.timeout)
        processes = tp if kind == "tpu_dist" else 1
        return [json.loads(Path(results, f"rank{rank}.json").read_text()) for rank in range(processes)]


def rows_of(tp_sizes: list[int]) -> list[tuple[str, int]]:
    return [("one chip", 1)] + [(kind, tp) for tp in tp_sizes if tp > 1 for kind in ("tpu_dist", "SPMD")]


def report(args: argparse.Namespace, model_bytes: int, figures: dict[tuple[str, int], list[dict]]) -> bool:
    """Prints the tables; returns whether every row decoded TP=1's tokens (and every rank the same ones)."""
    reference = figures[("one chip", 1)][0]
    rate = {row: args.new_tokens / processes[0]["seconds"] for row, processes in figures.items()}
    per_chip = {row: [b for process in processes for b in process["weight_bytes"]]
                for row, processes in figures.items()}
    same = {row: all(process["tokens"] == reference["tokens"] for process in processes)
            for row, processes in figures.items()}
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, "
          f"intermediate {args.intermediate}, vocab {args.vocab}: {model_bytes / 2**20:.2f} MB of float32 weights. "
          f"Greedy, static cache, batch 1, prompt {args.prompt}, {args.new_tokens} new tokens; tokens/s over the "
          f"whole generate call, median of {args.repeats}.\n")
    print(f"{'path':<9} {'tp':>3} {'tokens/s':>9} {'/ TP=1':>7} {'SPMD/tpu_dist':>14} {'fullest chip MB':>16} "
          f"{'/ TP=1':>7} {'all chips MB':>13} {'same tokens as TP=1':>20}")
    for kind, tp in figures:
        fullest = max(per_chip[(kind, tp)])
        versus = f"{rate[(kind, tp)] / rate[('tpu_dist', tp)]:13.2f}x" if kind == "SPMD" else f"{'':>14}"
        print(f"{kind:<9} {tp:>3} {rate[(kind, tp)]:9.1f} {rate[(kind, tp)] / rate[('one chip', 1)]:6.2f}x {versus} "
              f"{fullest / 2**20:16.2f} {fullest / max(per_chip[('one chip', 1)]):6.2f}x "
              f"{sum(per_chip[(kind, tp)]) / 2**20:13.2f} {str(same[(kind, tp)]):>20}")
        if kind != "one chip":
            _report.report(f"{kind} TP={tp}: tokens/s / TP=1", rate[(kind, tp)] / rate[("one chip", 1)], "x",
                           "one process, one chip")
            _report.report(f"{kind} TP={tp}: fullest chip's weight bytes / TP=1",
                           fullest / max(per_chip[("one chip", 1)]), "x", "the whole model on one chip")
        if kind == "SPMD":
            _report.report(f"SPMD TP={tp}: tokens/s / tpu_dist", rate[(kind, tp)] / rate[("tpu_dist", tp)], "x",
                           f"torchrun + tpu_dist, {tp} processes")
    print("\nWeight MB on each chip (torch.tpu.memory_allocated after loading, less before; tpu_dist: rank k's chip)")
    for (kind, tp), used in per_chip.items():
        unit = "rank" if kind == "tpu_dist" else "chip"
        print(f"{kind:<9} {tp:>3}  " + "  ".join(f"{unit} {k}: {b / 2**20:.2f}" for k, b in enumerate(used)))
    print(f"\nTokens (TP=1): {reference['tokens']}")
    return all(same.values())


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if importlib.util.find_spec("libtpu") is None:
        print(f"No TPU chips: every chip is a JAX CPU device of this host ({os.cpu_count()} cores shared by all "
              "of them): TP > 1 cannot be faster here.\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="tensor_parallel_model_") as model:
        model_bytes = save_model(args, model)
        figures = {}
        for kind, tp in rows_of(args.tp_sizes):
            start = time.perf_counter()
            figures[(kind, tp)] = run_row(kind, tp, model, args)
            print(f"  {kind}, tp {tp}: done in {time.perf_counter() - start:.0f} s", flush=True)
        print()
        if not report(args, model_bytes, figures):
            raise SystemExit("some rows decoded other tokens than TP=1: their figures are not comparable")
        print("Tokens identical in every row (and every rank).")


if __name__ == "__main__":
    main()
