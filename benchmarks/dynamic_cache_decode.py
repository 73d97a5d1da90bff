"""Greedy decode with transformers' default dynamic cache against the static cache, on tpu, eager.

    python benchmarks/dynamic_cache_decode.py [--new-tokens 128]

A tiny Llama (benchmarks/tiny_llama.py) generates ``--new-tokens`` tokens from a 64-token prompt twice per cache:
the first run compiles what it needs, the second is timed. Printed per cache: tokens/s of the second run and the
programs JAX traced in each run (a program traced for new shapes counts again). The dynamic cache grows by a token
a step, so its tensors have a new shape every step: each step's operators on growing tensors trace new programs
(positions are arguments, shapes are not); the static cache's shapes do not change.
"""

from __future__ import annotations

import argparse
import time

import jax
import torch

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report
from tiny_llama import tiny_llama

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
traces: list[float] = []


def _count(event: str, duration: float, **kwargs) -> None:
    if event == TRACE_EVENT:
        traces.append(duration)


def _run(model, prompt: torch.Tensor, new_tokens: int, cache: str) -> tuple[float, int, list[int]]:
    """Seconds, programs traced and tokens of one greedy generate."""
    options = {"cache_implementation": "static"} if cache == "static" else {}
    before = len(traces)
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **options)
    tokens = out[0, prompt.shape[1]:].tolist()
    return time.perf_counter() - start, len(traces) - before, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_count)
    model, prompt = tiny_llama()
    model = model.eval().to("tpu")
    prompt = prompt.to("tpu")
    print(f"tiny Llama, greedy, {args.new_tokens} new tokens after a {prompt.shape[1]}-token prompt; tpu eager")
    print(f"{'cache':<10}{'tokens/s':>10}{'traced, 1st run':>18}{'traced, 2nd run':>18}")
    results = {}
    for cache in ("dynamic", "static"):
        _, first_traces, _ = _run(model, prompt, args.new_tokens, cache)
        seconds, second_traces, tokens = _run(model, prompt, args.new_tokens, cache)
        results[cache] = (args.new_tokens / seconds, first_traces, second_traces, tokens)
        print(f"{cache:<10}{results[cache][0]:>10.1f}{first_traces:>18}{second_traces:>18}")
    assert results["dynamic"][3] == results["static"][3], "the two caches chose different tokens"
    report("dynamic cache decode: programs traced in a first generate", results["dynamic"][1], "programs",
           f"{args.new_tokens} new tokens; the static cache's first generate: {results['static'][1]}")
    report("dynamic cache decode: tokens/s, dynamic / static cache", results["dynamic"][0] / results["static"][0],
           "x", "the static cache (one-program decode)")


if __name__ == "__main__":
    main()
