"""Sentence embeddings on tpu: mean-pooled token states, and ``hf-tpu embed MODEL_DIR TEXT...``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .models import CommandError, load, quiet_transformers


def embed(model: Callable[..., Any], tokenizer: Any, texts: Sequence[str], device: str) -> Any:
    """L2-normalised embeddings: the model's token states, mean-pooled over real tokens."""
    import torch

    batch = tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt").to(device)
    with torch.no_grad():
        states = getattr(model(**batch), "last_hidden_state", None)
        if states is None:
            raise CommandError("the model returns no last_hidden_state: it is not a text encoder hf-tpu can pool.")
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled.float(), p=2, dim=1)


def timed_embed(model: Callable[..., Any], tokenizer: Any, texts: Sequence[str], device: str, runs: int = 2):
    """Embeddings on ``device`` and the seconds each of ``runs`` runs took, waiting for the device (the
    first run includes one-time work such as XLA compilation)."""
    import torch

    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        embeddings = embed(model, tokenizer, texts, device)
        if device == "tpu":
            torch.tpu.synchronize()
        seconds.append(time.perf_counter() - start)
    return embeddings, seconds


def print_similarities(texts: Sequence[str], embeddings: Any) -> None:
    """The numbered texts and their cosine-similarity matrix."""
    for number, text in enumerate(texts, start=1):
        print(f"  [{number}] {text}")
    print("\nCosine similarities (computed on tpu):")
    print("       " + "".join(f"{f'[{n}]':>8}" for n in range(1, len(texts) + 1)))
    for number, row in enumerate((embeddings @ embeddings.T).cpu().tolist(), start=1):
        print(f"  {f'[{number}]':<5}" + "".join(f"{value:8.3f}" for value in row))


def run_embed(model_dir: Path, texts: Sequence[str]) -> int:
    """``hf-tpu embed``: embeds ``texts`` with the model in ``model_dir`` on tpu; prints the similarities."""
    quiet_transformers()
    import torch
    from transformers import AutoModel

    tokenizer, model = load(model_dir, AutoModel, "embeddings", device_map="tpu")
    print(f"Model: {model_dir} ({model.config.model_type}) on {torch.tpu.get_device_name()}\n")
    embeddings, seconds = timed_embed(model, tokenizer, texts, "tpu", runs=1)
    print_similarities(texts, embeddings)
    print(f"\nEmbeddings: {tuple(embeddings.shape)} in {seconds[0]:.2f} s (including XLA compilation)")
    return 0
