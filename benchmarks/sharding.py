"""One process, many chips: a small Llama sharded over tp = 1, 2, 4 chips (SPMD), side by side in one run.

LlamaForCausalLM built from a config (random weights, no downloads; every size is an option). For each tp
size the same weights go on one chip (tp 1, ``.to("tpu")``) or through ``hf_tpu.shard(model, tp_size=tp)``
(the model's own tensor-parallel plan), and the script measures:

1. per-chip weight bytes: ``torch.tpu.memory_allocated(i)`` of each chip after placing the model, less before;
   the ratio is the fullest chip's bytes over tp 1's (1/tp at best; what the plan replicates keeps it above);
2. greedy decode tokens/s: ``generate`` with the static cache (whose decode steps hf_tpu compiles) and with the
   dynamic cache (eager); the new tokens of every tp are checked identical to tp 1's before timing;
3. an eager op on tensors sharded over every chip (``hf_tpu.distribute``) against the same op on one chip:
   ``a + b`` and matmuls (a row-split left operand; and a column-split by row-split one, which ends in an
   all-reduce) of a small and a medium size, µs per op; results are checked against one chip before timing.

Times are the median of ``--repeats`` runs after a warm-up run (which compiles), each ending with the result on
the host (decode) or ``torch.tpu.synchronize()`` (ops). Ratios: tokens/s over tp 1's (below 1 = slower), µs
over one chip's (above 1 = slower). The multi-process "tpu_dist" path at the same tp is measured by
benchmarks/tensor_parallel.py (torchrun processes against this SPMD path, side by side). Without TPU chips
the chips are ``--chips`` virtual CPU devices (default 4:
``HF_TPU_NUM_DEVICES``, set here before torch starts, as is ``HF_TPU_PLATFORM=cpu`` unless libtpu is installed;
on a TPU VM the first ``--chips`` real chips are used). Virtual chips share the host's cores, so tp > 1 cannot
be faster on them: the figures there are the cost of partitioning and collectives, not a speed-up.

    python benchmarks/sharding.py [--chips 4] [--tp 1,2,4] [--hidden 256] [--layers 2] [--heads 8]
                                  [--kv-heads 4] [--intermediate 688] [--vocab 1024] [--prompt 16]
                                  [--new-tokens 16] [--repeats 5] [--op-repeats 20]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import time
from typing import Callable

from _report import report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", type=int, default=None,
                        help="chips to use (HF_TPU_NUM_DEVICES; default: its value, else 4)")
    parser.add_argument("--tp", default="1,2,4", help="comma-separated tp sizes; the first is the reference")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="timed generate calls per variant")
    parser.add_argument("--op-repeats", type=int, default=20, help="timed eager ops per op and size")
    return parser


def set_chip_environment(chips: int | None) -> None:
    """The chip count and platform must be set before torch (and with it JAX) starts."""
    if chips is not None:
        os.environ["HF_TPU_NUM_DEVICES"] = str(chips)
    os.environ.setdefault("HF_TPU_NUM_DEVICES", "4")
    if importlib.util.find_spec("libtpu") is None:  # no TPU software: virtual CPU chips
        os.environ.setdefault("HF_TPU_PLATFORM", "cpu")


if __name__ == "__main__":
    set_chip_environment(build_parser().parse_known_args()[0].chips)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import hf_tpu  # noqa: E402  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from hf_tpu.backend import runtime  # noqa: E402

OP_SIZES = {"small": 256, "medium": 1024}


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new_tokens, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # random weights: always decode every new token
    model.generation_config.pad_token_id = 0
    return model


def place(model: LlamaForCausalLM, tp: int) -> tuple[LlamaForCausalLM, list[int]]:
    """``model`` on one chip (tp 1) or sharded over the first ``tp`` chips, and each chip's added bytes."""
    chips = range(torch.tpu.device_count())
    before = [torch.tpu.memory_allocated(chip) for chip in chips]
    placed = model.to("tpu") if tp == 1 else hf_tpu.shard(model, tp_size=tp)
    torch.tpu.synchronize()
    return placed, [torch.tpu.memory_allocated(chip) - start for chip, start in zip(chips, before)]


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def greedy(model: LlamaForCausalLM, prompt: torch.Tensor, new_tokens: int, **options) -> list[int]:
    with torch.no_grad():
        output = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, **options)
    return output[0, prompt.shape[1]:].cpu().tolist()


CACHES = {"static (compiled)": dict(cache_implementation="static"), "dynamic (eager)": {}}


def decode_rates(model: LlamaForCausalLM, prompt: torch.Tensor, args: argparse.Namespace,
                 reference: dict[str, list[int]]) -> dict[str, tuple[float, bool]]:
    """Per cache: (tokens/s, same tokens as ``reference``); an empty ``reference`` is filled with these tokens."""
    rates = {}
    for cache, options in CACHES.items():
        tokens = greedy(model, prompt, args.new_tokens, **options)  # warm-up: compiles, and gives the tokens
        same = reference.setdefault(cache, tokens) == tokens
        seconds = median_seconds(lambda: greedy(model, prompt, args.new_tokens, **options), args.repeats)
        rates[cache] = (args.new_tokens / seconds, same)
    return rates


def model_figures(args: argparse.Namespace, tp_sizes: list[int]) -> None:
    reference_model = build_model(args)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to("tpu")
    bytes_of, rates_of, reference_tokens = {}, {}, {}
    for tp in tp_sizes:
        model, bytes_of[tp] = place(copy.deepcopy(reference_model), tp)
        rates_of[tp] = decode_rates(model, prompt, args, reference_tokens)
        del model
    chips = torch.tpu.device_count()
    first = tp_sizes[0]
    total = sum(p.numel() * p.element_size() for p in reference_model.parameters())
    print(f"1. Weight bytes per chip (torch.tpu.memory_allocated deltas), Llama hidden {args.hidden}, "
          f"{args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, {total / 2**20:.2f} MB of weights\n")
    print(f"{'tp':>3} " + " ".join(f"{'tpu:' + str(chip) + ' MB':>10}" for chip in range(chips))
          + f" {'fullest / tp ' + str(first):>16} {'all chips MB':>13}")
    for tp, per_chip in bytes_of.items():
        print(f"{tp:>3} " + " ".join(f"{used / 2**20:10.2f}" for used in per_chip)
              + f" {max(per_chip) / max(bytes_of[first]):15.2f}x {sum(per_chip) / 2**20:13.2f}")
        if tp != first:
            report(f"tp {tp}: fullest chip's weight bytes / tp {first}", max(per_chip) / max(bytes_of[first]), "x",
                   f"tp {first} (1/tp at best)")
    print(f"\n2. Greedy decode, prompt {args.prompt}, {args.new_tokens} new tokens (tokens/s over the whole generate "
          f"call, median of {args.repeats})\n")
    print(f"{'path':<30} {'cache':<18} {'tokens/s':>9} {'/ tp ' + str(first):>8} "
          f"{'same tokens as tp ' + str(first):>22}")
    for cache in CACHES:
        for tp, rates in rates_of.items():
            rate, same = rates[cache]
            print(f"{'SPMD one process, tp ' + str(tp):<30} {cache:<18} {rate:9.1f} "
                  f"{rate / rates_of[first][cache][0]:7.2f}x {str(same):>22}")
            if tp != first:
                report(f"tp {tp}, {cache} decode: tokens/s / tp {first}", rate / rates_of[first][cache][0], "x",
                       f"tp {first}, the same greedy decode")
    print(f"{'tpu_dist one process per chip':<30} {'any':<18} "
          "see python benchmarks/tensor_parallel.py (torchrun rows beside SPMD ones)")
    if runtime.backing_platform() == "cpu":
        print("\nThe chips here are virtual CPU devices sharing the host's cores: SPMD tp > 1 cannot be faster on them;"
              "\nits figures show what partitioning and the collectives cost.")
    if not all(same for rates in rates_of.values() for _, same in rates.values()):
        raise SystemExit("sharded decode gave other tokens than tp 1: the figures above are not comparable")


def op_cases(size: int, mesh) -> dict[str, tuple[Callable, tuple, tuple]]:
    """name -> (op, operands on one chip, the same operands sharded over ``mesh``)."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator) for _ in range(2))
    rows, columns, whole = ("chips", None), (None, "chips"), None
    one_chip = (a.to("tpu"), b.to("tpu"))

    def sharded(spec_a, spec_b) -> tuple:
        return hf_tpu.distribute(a, mesh, spec_a), hf_tpu.distribute(b, mesh, spec_b)

    return {
        "a + b (rows split)": (torch.add, one_chip, sharded(rows, rows)),
        "a @ b (a rows split)": (torch.matmul, one_chip, sharded(rows, whole)),
        "a @ b (all-reduce)": (torch.matmul, one_chip, sharded(columns, rows)),
    }


def microseconds_per_op(op: Callable, operands: tuple, repeats: int) -> float:
    def run() -> None:
        op(*operands)
        torch.tpu.synchronize()

    run()  # compiles
    return median_seconds(run, repeats) * 1e6


def op_figures(args: argparse.Namespace) -> None:
    mesh = hf_tpu.mesh()
    chips = mesh.devices.size
    print(f"\n3. Eager op on tensors sharded over {chips} chips against one chip (µs per op, median of "
          f"{args.op_repeats}, each ending with torch.tpu.synchronize())\n")
    print(f"{'op':<22} {'size':>11} {'one chip µs':>12} {str(chips) + ' chips µs':>11} {'/ one chip':>11} "
          f"{'max |diff|':>11}")
    for label, size in OP_SIZES.items():
        for name, (op, one_chip, sharded) in op_cases(size, mesh).items():
            expected, actual = op(*one_chip).cpu(), op(*sharded).cpu()
            torch.testing.assert_close(actual, expected, atol=1e-3, rtol=1e-4, msg=lambda message: (
                f"{name} at {size}x{size} on {chips} chips differs from one chip: {message}"))
            difference = (actual - expected).abs().max().item()
            single = microseconds_per_op(op, one_chip, args.op_repeats)
            spread = microseconds_per_op(op, sharded, args.op_repeats)
            print(f"{name:<22} {label + ' ' + str(size):>11} {single:12.1f} {spread:11.1f} {spread / single:10.2f}x "
                  f"{difference:11.2e}")
            report(f"{name} {size}x{size}, {chips} chips / one chip time", spread / single, "x",
                   "the same eager op on one chip")


def main() -> None:
    args = build_parser().parse_args()
    tp_sizes = [int(size) for size in args.tp.split(",")]
    chips = torch.tpu.device_count()
    if max(tp_sizes) > chips:
        raise SystemExit(f"--tp {args.tp} asks for {max(tp_sizes)} chips but there are {chips}: pass --chips "
                         f"{max(tp_sizes)} (virtual chips) or smaller tp sizes")
    print(f"tpu device backed by: {torch.tpu.get_device_name()} x {chips} chips; "
          f"torch threads: {torch.get_num_threads()}; host cores: {os.cpu_count()}\n")
    model_figures(args, tp_sizes)
    op_figures(args)


if __name__ == "__main__":
    main()
