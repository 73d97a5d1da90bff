"""transformers' continuous batching on tpu against on CPU, and against one batched static-cache ``generate``.

tiny_llama.py's model (hidden 256, 4 layers) generates ``--tokens`` tokens (greedy) for each of ``--requests``
prompts of 4 to 64 tokens, through ``model.generate_batch`` with a persistent manager (a paged cache of
:data:`PAGES` pages of :data:`PAGE_SIZE` tokens): a cold call (compiles and
warms up) then the best of three warm ones, on CPU and on tpu; the cold call starts from empty caches (XLA's
programs, and what Dynamo and AOTAutograd made of the steps; ``benchmarks/serving.py`` measures a server restarted
on filled ones). The same prompts then go to ``generate`` on tpu with a static cache, left-padded to one batch
(the best of three warm calls). Prints tokens/s, the programs each tpu run compiled, whether the tpu tokens are
the CPU's, the peak device memory of the static-cache and paged-cache runs, and the ratios (the issue's goals: tpu
continuous batching at least CPU's tokens/s, and within 1.5x of batched static generate).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from _report import report
from tiny_llama import tiny_llama


def prompts(count: int, vocab: int) -> list[list[int]]:
    draw = random.Random(0)
    return [[draw.randrange(3, vocab) for _ in range(draw.randint(4, 64))] for _ in range(count)]


WARM_CALLS = 3
PAGES, PAGE_SIZE = 128, 64
"""The paged cache: as many tokens as the static cache of :func:`static_generate` (64 prompts x 128, the bucket of
the longest prompt and its new tokens). transformers' default page of 256 tokens, sized for flash-attn's paged
kernel on GPUs, would give each of these requests (at most 95 tokens) a page mostly empty, and the cache would hold
half as many requests at once."""


def continuous_batching(model: torch.nn.Module, inputs: list[list[int]], tokens: int, **intervals: int) -> dict:
    """A cold ``generate_batch`` through a persistent manager, then the best of :data:`WARM_CALLS` warm ones:
    seconds, tokens and programs compiled. ``intervals``: transformers' ``q_padding_interval_size`` /
    ``kv_padding_interval_size``, where set."""
    generation = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(num_blocks=PAGES, page_size=PAGE_SIZE, max_batch_tokens=256, **intervals)
    runs = {}
    for name in ("cold", *["warm"] * WARM_CALLS):
        compiled = torch.tpu.compile_stats()["compilations"]
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=inputs, generation_config=generation, continuous_batching_config=config,
                                       persistent_manager=True)
        seconds = time.perf_counter() - start
        ordered = sorted(outputs.values(), key=lambda output: int(output.request_id.split("_")[-1]))
        run = {"seconds": seconds, "tokens": [output.generated_tokens for output in ordered],
               "programs": torch.tpu.compile_stats()["compilations"] - compiled}
        best = runs.setdefault(name, run)
        if run["tokens"] != best["tokens"]:
            raise AssertionError("a warm call gave other tokens than the one before it")
        if seconds < best["seconds"]:
            runs[name] = run
    model.destroy_cached_continuous_batching_manager()
    return runs


def static_generate(model: torch.nn.Module, inputs: list[list[int]], tokens: int) -> float:
    """Seconds of a warm ``generate`` of every prompt in one left-padded batch with a static cache (the best of
    :data:`WARM_CALLS`)."""
    longest = max(map(len, inputs))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in inputs], device="tpu")
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in inputs], device="tpu")
    settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                    cache_implementation="static")
    model.generate(ids, attention_mask=mask, **settings)
    seconds = []
    for _ in range(WARM_CALLS):
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, **settings).cpu()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def peak_bytes(run) -> int:
    torch.tpu.synchronize()
    torch.tpu.reset_peak_memory_stats()
    run()
    torch.tpu.synchronize()
    return torch.tpu.max_memory_allocated()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--q-interval", type=int, default=0,
                        help="pad a tpu step's query tokens to multiples of this (default: powers of two)")
    parser.add_argument("--kv-interval", type=int, default=0,
                        help="pad the cache tokens a tpu step reads to multiples of this (default: powers of two)")
    args = parser.parse_args()
    intervals = {"q_padding_interval_size": args.q_interval, "kv_padding_interval_size": args.kv_interval}
    caches = tempfile.TemporaryDirectory()  # the cold call compiles everything (set before the device's first use)
    os.environ["HF_TPU_CACHE_DIR"] = os.path.join(caches.name, "xla")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches.name, "torch")
    model, _ = tiny_llama()
    model.eval()
    inputs = prompts(args.requests, model.config.vocab_size)
    generated = args.requests * args.tokens
    cpu = continuous_batching(model, inputs, args.tokens)
    model.to("tpu")
    tpu = continuous_batching(model, inputs, args.tokens, **intervals)
    static_seconds = static_generate(model, inputs, args.tokens)
    static_peak = peak_bytes(lambda: static_generate(model, inputs, args.tokens))
    paged_peak = peak_bytes(lambda: continuous_batching(model, inputs, args.tokens, **intervals))

    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}")
    print(f"{args.requests} requests of 4-64 prompt tokens, {args.tokens} greedy tokens each\n")
    print(f"{'variant':<34} {'seconds':>8} {'tokens/s':>9} {'programs':>9} {'= cpu':>6}")
    for device, runs in (("cpu", cpu), ("tpu", tpu)):
        for name, run in runs.items():
            same = "-" if device == "cpu" else str(run["tokens"] == cpu[name]["tokens"])
            programs = "-" if device == "cpu" else run["programs"]
            print(f"{device + ' continuous batching, ' + name:<34} {run['seconds']:8.2f} "
                  f"{generated / run['seconds']:9.1f} {programs:>9} {same:>6}")
    print(f"{'tpu static generate, one batch':<34} {static_seconds:8.2f} {generated / static_seconds:9.1f}")
    print(f"\npeak tpu memory: static-cache generate {static_peak / 2**20:.1f} MiB, "
          f"continuous batching (paged cache) {paged_peak / 2**20:.1f} MiB\n")
    for name in ("cold", "warm"):
        ratio = cpu[name]["seconds"] / tpu[name]["seconds"]
        print(f"tpu / cpu continuous batching tokens/s, {name}: {ratio:.2f}x")
        report(f"continuous batching tokens/s, tpu / cpu, {name}", ratio, "x", "CPU continuous batching (goal >= 1)")
    ratio = static_seconds / tpu["warm"]["seconds"]
    print(f"tpu continuous batching / tpu static generate tokens/s, warm: {ratio:.2f}x")
    report("continuous batching / static generate tokens/s, tpu, warm", ratio, "x",
           "one batched static-cache generate (goal >= 0.67)")


if __name__ == "__main__":
    main()
