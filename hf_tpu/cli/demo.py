"""``hf-tpu demo``: a real sentence-embedding model on tpu (eager and compiled) against the CPU, then text
generation with a small random-weight Llama, token for token against the CPU."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

from .embeddings import print_similarities, timed_embed
from .generation import generate, generate_twice, random_llama
from .models import default_model_path, load, quiet_transformers

DEFAULT_SENTENCES = (
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The stock market fell sharply today.",
    "Shares dropped on Wall Street this morning.",
)
# float32 results of one model on two backends; XLA may fuse and reorder reductions.
TOLERANCE = 1e-3
PROMPT = "The tpu device"
RUNS = 5  # per way of running the model: the first compiles, the best of the others is the latency
NEW_TOKENS = 16


def _compiled_embeddings(model: Any, tokenizer: Any, sentences: Sequence[str]) -> tuple[Any, list[float], dict]:
    """Embeddings through ``torch.compile(model, backend="tpu")``, the run times (the first compiles)
    and what graph mode did meanwhile."""
    import torch
    from hf_tpu.compile import compile_stats

    before = compile_stats()
    embeddings, seconds = timed_embed(torch.compile(model, backend="tpu"), tokenizer, sentences, "tpu", RUNS)
    after = compile_stats()
    return embeddings, seconds, {name: after[name] - before[name] for name in after}


def _embeddings_part(name: str, tokenizer: Any, model: Any, sentences: Sequence[str]) -> int:
    print(f"1. Sentence embeddings with {name} ({model.config.model_type}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, real weights)\n")
    on_cpu, cpu_seconds = timed_embed(model, tokenizer, sentences, "cpu", RUNS)
    model.to("tpu")
    on_tpu, tpu_seconds = timed_embed(model, tokenizer, sentences, "tpu", RUNS)
    print_similarities(sentences, on_tpu)
    eager_difference = (on_tpu.cpu() - on_cpu).abs().max().item()
    print(f"\nEmbeddings {tuple(on_tpu.shape)}: max |tpu - cpu| = {eager_difference:.2e} (tolerance {TOLERANCE:g})")
    status = 0 if eager_difference <= TOLERANCE else 1

    try:
        compiled, compiled_seconds, stats = _compiled_embeddings(model, tokenizer, sentences)
    except (RuntimeError, NotImplementedError) as error:
        print(f"torch.compile(model, backend='tpu') failed: {type(error).__name__}: {str(error).splitlines()[0]}",
              file=sys.stderr)
        return 1
    compiled_difference = (compiled.cpu() - on_cpu).abs().max().item()
    print(f"Compiled (torch.compile(model, backend='tpu')): max |tpu - cpu| = {compiled_difference:.2e}")
    print(f"Latency per batch after warm-up (best of {RUNS - 1}): cpu {min(cpu_seconds[1:]) * 1e3:.1f} ms, "
          f"tpu eager {min(tpu_seconds[1:]) * 1e3:.1f} ms, tpu compiled {min(compiled_seconds[1:]) * 1e3:.1f} ms")
    print(f"First run (compiles): tpu eager {tpu_seconds[0]:.2f} s (one XLA program per op), compiled "
          f"{compiled_seconds[0]:.2f} s ({stats['compilations']:.0f} XLA program(s), {stats['graphs']:.0f} graph(s))")
    if stats["fallbacks"]:
        print(f"Note: {stats['fallbacks']:.0f} graph(s) had an operator graph mode cannot lower and ran op by op.")
    if not (eager_difference <= TOLERANCE and compiled_difference <= TOLERANCE):
        print("MISMATCH: the tpu embeddings differ from the CPU embeddings.", file=sys.stderr)
        status = 1
    return status


def _generation_part(tokenizer: Any) -> int:
    model = random_llama(tokenizer.vocab_size)
    print(f"\n2. Text generation with a small Llama-architecture model built here with RANDOM weights "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters): the text is meaningless; "
          "the point is that tpu picks the same tokens as the CPU. Greedy, static cache (compiled).\n")
    expected = generate(model, tokenizer, PROMPT, NEW_TOKENS, "cpu")
    model.to("tpu")
    generated = generate_twice(model, tokenizer, PROMPT, NEW_TOKENS, cache_implementation="static")
    if generated.tokens != expected.tokens:
        print(f"MISMATCH: the CPU generates {expected.text!r}", file=sys.stderr)
        return 1
    print("Same tokens as on the CPU.")
    return 0


def run_demo(model_path: Path | None, sentences: Sequence[str]) -> int:
    """Runs the demo; returns the exit status: 0 when tpu and cpu agree, 1 when they differ or graph
    mode fails."""
    quiet_transformers()
    import torch
    from transformers import AutoModel

    import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    path = model_path or default_model_path()
    print(f"The tpu device runs on: {torch.tpu.get_device_name()}\n")
    tokenizer, model = load(path, AutoModel, "embeddings")
    status = _embeddings_part(str(model_path) if model_path else "all-MiniLM-L6-v2", tokenizer, model, sentences)
    status = max(status, _generation_part(tokenizer))
    print("\nOK: tpu and cpu agree." if status == 0 else "\nFAILED: see the messages above.")
    return status
