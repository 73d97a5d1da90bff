"""MoE decode at batch 64: one decode step of a small Qwen3-MoE with each experts implementation, on tpu (eager and
compiled) and hf_tpu's Pallas grouped matmul, next to torch CPU, side by side in one process.

Qwen3MoeForCausalLM built from a config (random weights, no downloads; defaults: 2 layers, hidden 256, 16 experts,
top-4, expert width 128, vocab 1024, float32; every option scales it). A static cache holds a ``--prompt``-token
prefill of ``--batch`` sequences; the timed step is one forward of ``[batch, 1]`` new tokens over that cache, the
step ``generate`` repeats (the prefill runs with transformers' defaults in every variant). Before each step the
cache is cropped back to the prefill (``cache.crop(-1)``), so every repeat does the same work and gives the same
logits. Variants (all from the same weights):

- ``cpu eager`` with each of transformers' experts implementations, ``cpu inductor`` with ``grouped_mm``;
- ``tpu eager`` and ``tpu compiled`` (``torch.compile(model.__call__, backend="tpu")``, as ``generate`` compiles its
  decode steps) with ``grouped_mm`` (transformers' default; tpu lowers ``aten::_grouped_mm`` to XLA's ragged dot),
  ``eager`` (a Python loop over the experts hit, with host syncs) and ``batched_mm`` (one gathered copy of the
  expert weights per (token, expert) pair, then ``bmm``; ``generate`` switches to it for decoding off CPU);
- ``tpu_pallas``: the experts on hf_tpu's Pallas grouped matmul (JAX's megablox ``gmm``; experts implementation
  ``"tpu_pallas"`` of :mod:`hf_tpu.kernels.transformers_wiring`), and ``kernels.enable``: every Pallas kernel
  (experts, attention, RMSNorm), as ``hf_tpu.kernels.enable(model)`` sets them.

Off TPU chips the Pallas kernels run in TPU interpret mode, whose times say nothing about the kernels: their
logits are still checked, but they are timed only on TPU chips (``hf_tpu.kernels.pallas.use_by_default()``) or
with ``--time-pallas``. Every variant's decode-step logits are compared with ``cpu eager grouped_mm`` first.
Times are the median of ``--repeats`` steps after two warm-up steps (which compile), each ending with
``torch.tpu.synchronize()``. A variant that fails (an op tpu does not lower, say) is reported with its error.
Inductor's first compile on a cold cache can take minutes on a small machine (``--skip-inductor``).

    python benchmarks/moe_decode.py [--batch 64] [--layers 2] [--hidden 256] [--heads 4] [--experts 16]
                                    [--top-k 4] [--expert-width 128] [--vocab 1024] [--prompt 16]
                                    [--dtype float32] [--repeats 10] [--skip-inductor] [--time-pallas]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import transformers

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report
from hf_tpu.kernels import pallas, transformers_wiring

IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")
PALLAS = transformers_wiring.NAME  # the Pallas experts implementation
REFERENCE = "cpu eager grouped_mm"


@dataclass(frozen=True)
class Variant:
    device: str
    backend: Optional[str]  # torch.compile backend, None = eager
    experts: str  # experts implementation, or "kernels.enable" for every Pallas kernel
    timed: bool = True

    @property
    def name(self) -> str:
        mode = "eager" if self.backend is None else ("compiled" if self.backend == "tpu" else self.backend)
        return f"{self.device} {mode} {self.experts}"


def build_model(args: argparse.Namespace) -> transformers.Qwen3MoeForCausalLM:
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.expert_width, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), head_dim=args.hidden // args.heads, num_experts=args.experts,
        num_experts_per_tok=args.top_k, decoder_sparse_step=1, max_position_embeddings=args.prompt + 1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to(getattr(torch, args.dtype)).eval()


def variants(skip_inductor: bool, time_pallas: bool) -> list[Variant]:
    found = [Variant("cpu", None, name) for name in IMPLEMENTATIONS]
    if not skip_inductor:
        found.append(Variant("cpu", "inductor", "grouped_mm"))
    for backend in (None, "tpu"):
        found += [Variant("tpu", backend, name) for name in IMPLEMENTATIONS]
        found += [Variant("tpu", backend, name, timed=time_pallas) for name in (PALLAS, "kernels.enable")]
    return found


def decode_step(model: torch.nn.Module, variant: Variant, prompt: torch.Tensor,
                new_tokens: torch.Tensor) -> tuple[Callable[[], torch.Tensor], Callable[[], None]]:
    """Places a copy of ``model`` as ``variant`` says, prefills a static cache with ``prompt`` (eagerly, with
    transformers' default attention and experts, so the slow interpreted Pallas kernels stay out of the prefill
    off chips) and then sets the variant's experts implementation.

    Returns ``(step, rewind)``: ``step()`` runs ``new_tokens`` (one per sequence) over the cache and returns the
    step's logits; ``rewind()`` crops the cache back to the prefill, so the next step writes the same slot again.
    """
    model = copy.deepcopy(model).to(variant.device)
    prompt, new_tokens = prompt.to(variant.device), new_tokens.to(variant.device)
    cache = transformers.StaticCache(config=model.config, max_cache_len=prompt.shape[1] + 1)
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
    if variant.experts == "kernels.enable":
        transformers_wiring.enable(model)
    else:
        model.set_experts_implementation(variant.experts)
    forward = model.__call__
    if variant.backend is not None:
        torch._dynamo.reset()  # one compiled model at a time: the earlier variants' guards must not pile up
        forward = torch.compile(forward, backend=variant.backend, dynamic=False)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return forward(input_ids=new_tokens, cache=cache, use_cache=True).logits

    return step, lambda: cache.crop(-1)


def synchronized(step: Callable[[], torch.Tensor]) -> torch.Tensor:
    logits = step()
    torch.tpu.synchronize()
    return logits


def measure(step: Callable[[], torch.Tensor], rewind: Callable[[], None], repeats: int,
            warmups: int = 2) -> tuple[float, torch.Tensor]:
    """(median ms of ``repeats`` steps after ``warmups`` untimed ones, the first step's logits on the host)."""
    logits = synchronized(step).float().cpu()
    times = []
    for index in range(warmups - 1 + repeats):
        rewind()
        torch.tpu.synchronize()
        start = time.perf_counter()
        synchronized(step)
        if index >= warmups - 1:
            times.append(time.perf_counter() - start)
    rewind()
    return (statistics.median(times) * 1e3 if times else float("nan")), logits


Result = Union[tuple[float, torch.Tensor], str]  # (median ms, logits), or why the variant failed


def run_variant(model: torch.nn.Module, variant: Variant, prompt: torch.Tensor, new_tokens: torch.Tensor,
                repeats: int) -> Result:
    print(f"{variant.name}...", file=sys.stderr, flush=True)
    try:
        step, rewind = decode_step(model, variant, prompt, new_tokens)
        return measure(step, rewind, repeats if variant.timed else 0, warmups=2 if variant.timed else 1)
    except Exception as error:  # a path that does not run on tpu is a result too
        return f"{type(error).__name__}: {error}".splitlines()[0]


def print_table(results: dict[Variant, Result], repeats: int) -> None:
    reference_ms, reference = next(r for v, r in results.items() if v.name == REFERENCE)
    print(f"{'variant':<30} {'ms/step':>9} {'/ ' + REFERENCE:>24} {'max |logits diff|':>18} {'same argmax':>12}")
    for variant, result in results.items():
        if isinstance(result, str):
            print(f"{variant.name:<30} {'failed':>9} (see below)")
            continue
        milliseconds, logits = result
        difference = (logits - reference).abs().max().item()
        same = torch.equal(logits.argmax(-1), reference.argmax(-1))
        if variant.timed:
            timing = f"{milliseconds:9.2f} {reference_ms / milliseconds:23.2f}x"
        else:
            timing = f"{'-':>9} {'(not timed)':>24}"
        print(f"{variant.name:<30} {timing} {difference:18.2e} {str(same):>12}")
    print(f"\n(median of {repeats} steps; ratio = {REFERENCE} ms / variant ms, above 1 = faster)")
    for variant, result in results.items():
        if isinstance(result, str):
            print(f"{variant.name} failed: {result}")


def summary(results: dict[Variant, Result]) -> None:
    timed = {v.name: r[0] for v, r in results.items() if v.timed and not isinstance(r, str)}
    best_cpu = min((ms, name) for name, ms in timed.items() if name.startswith("cpu"))
    best_tpu = min((ms, name) for name, ms in timed.items() if name.startswith("tpu"))
    print(f"best tpu ({best_tpu[1]}) vs best cpu ({best_cpu[1]}): {best_cpu[0] / best_tpu[0]:.2f}x")
    report("speed, best tpu / best cpu variant", best_cpu[0] / best_tpu[0], "x", f"{best_tpu[1]} against {best_cpu[1]}")
    default = timed.get("tpu compiled grouped_mm")
    if default:
        report("speed, tpu compiled grouped_mm / " + REFERENCE, timed[REFERENCE] / default, "x", REFERENCE)
    for name in ("tpu compiled batched_mm", f"tpu compiled {PALLAS}", "tpu compiled kernels.enable"):
        if default and name in timed:
            print(f"{name} vs tpu compiled grouped_mm: {default / timed[name]:.2f}x")
            report(f"speed, {name} / tpu compiled grouped_mm", default / timed[name], "x", "tpu compiled grouped_mm")
    print("(above 1 = the first is faster)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences decoded together")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4, help="query heads (half as many key/value heads)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4, help="experts per token")
    parser.add_argument("--expert-width", type=int, default=128, help="moe_intermediate_size")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=16, help="prefill length in the cache")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-inductor", action="store_true", help="leave out the (slow to compile) Inductor run")
    parser.add_argument("--time-pallas", action="store_true",
                        help="time the Pallas paths off TPU chips too (interpret mode: meaningless times)")
    args = parser.parse_args()

    on_chips = pallas.use_by_default()
    model = build_model(args)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=generator)
    new_tokens = torch.randint(0, args.vocab, (args.batch, 1), generator=generator)
    results = {variant: run_variant(model, variant, prompt, new_tokens, args.repeats)
               for variant in variants(args.skip_inductor, time_pallas=on_chips or args.time_pallas)}

    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}")
    print(f"Qwen3-MoE decode step: batch {args.batch}, {args.layers} layers, hidden {args.hidden}, {args.experts} "
          f"experts, top-{args.top_k}, expert width {args.expert_width}, {args.prompt} tokens cached, {args.dtype}")
    if not on_chips:
        timing = "timed anyway (--time-pallas)" if args.time_pallas else "logits checked, not timed (--time-pallas)"
        print(f"No TPU chips: the Pallas kernels run in TPU interpret mode, whose times are meaningless: {timing}")
    print()
    print_table(results, args.repeats)
    summary(results)
    print(f"graph mode: {torch.tpu.compile_stats()}")


if __name__ == "__main__":
    main()
