"""Text generation on tpu with a progress bar: ``hf-tpu generate MODEL_DIR --prompt ...`` and the demo's."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .models import load, quiet_transformers


@dataclass
class Generated:
    """New token ids, their text, and the seconds the generation took."""

    tokens: list[int]
    text: str
    seconds: float


class _Progress:
    """A ``generate`` streamer that advances a tqdm bar by each new token."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, unit="tok", desc="Generating", leave=False)
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:  # generate first hands over the prompt
            self.bar.update(value.numel())
        self._prompt_seen = True

    def end(self) -> None:
        self.bar.close()


def generate(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, device: str,
             progress: bool = False, seed: int | None = None, **options: Any) -> Generated:
    """Generation of up to ``max_new_tokens`` after ``prompt`` (one sequence): greedy, or with a ``seed``
    sampled with the model's generation settings."""
    import torch

    inputs = tokenizer(prompt, return_tensors="pt", return_token_type_ids=False).to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if seed is not None:
        torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=seed is not None,
                                pad_token_id=pad, streamer=_Progress(max_new_tokens) if progress else None,
                                **options)
    tokens = output[0, inputs["input_ids"].shape[1]:].tolist()
    seconds = time.perf_counter() - start
    return Generated(tokens, tokenizer.decode(tokens, skip_special_tokens=True), seconds)


def generate_twice(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, **options: Any) -> Generated:
    """Generates on tpu twice, the first time with a progress bar; prints the text and both timings (the
    first run compiles) and returns the second run."""
    first = generate(model, tokenizer, prompt, max_new_tokens, "tpu", progress=True, **options)
    second = generate(model, tokenizer, prompt, max_new_tokens, "tpu", **options)
    print(f"Prompt:    {prompt}\nGenerated: {second.text}\n")
    print(f"{len(second.tokens)} new tokens: first run {first.seconds:.2f} s (includes XLA compilation), "
          f"second run {second.seconds:.2f} s = {len(second.tokens) / second.seconds:.1f} tokens/s")
    return second


def run_generate(model_dir: Path, prompt: str, max_new_tokens: int, cache: str, seed: int | None = None) -> int:
    """``hf-tpu generate``: generation with the causal language model in ``model_dir`` on tpu, greedy or (with a
    ``seed``) sampled with the model's generation settings."""
    quiet_transformers()
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer, model = load(model_dir, AutoModelForCausalLM, "text generation", device_map="tpu")
    decoding = "greedy" if seed is None else f"sampled from seed {seed}"
    print(f"Model: {model_dir} ({model.config.model_type}) on {torch.tpu.get_device_name()}, {cache} cache, "
          f"{decoding}\n")
    options = {"cache_implementation": "static"} if cache == "static" else {}
    generate_twice(model, tokenizer, prompt, max_new_tokens, seed=seed, **options)
    return 0


def random_llama(vocab_size: int) -> Any:
    """A small Llama-architecture model with random weights (seeded), built locally: nothing to download.
    It has no end-of-sequence token, so it always generates as many tokens as asked."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()
