"""hf_tpu's own kernels as Hugging Face kernel repositories, and the tpu layer mapping that points at them.

Each directory here is a kernel repository in the Hub layout (``<repo>/build/torch-tpu/metadata.json`` and
a package exporting ``layers``): ``rmsnorm`` (layer ``RMSNorm``, the Pallas ``rms_norm`` kernel) and
``activation`` (layers ``SiLU``, ``GeLU``, ``GeluTanh``, ``NewGELU``, ``FastGELU``, ``QuickGELU``). The
mapping loads them with ``kernels.LocalLayerRepository``, the same loader (variant selection, metadata
checks, layer validation) as Hub kernels; the ops they call are in :mod:`.ops`. Importing this package
imports neither JAX nor ``kernels``. Each ``metadata.json`` records the sha256 digest of its package's files,
which kernels 0.19 checks at each load (files that differ fail it; without a digest it warns): editing a
repository's package means writing the new digest (``tests/test_kernels_layers.py`` says which).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPOSITORIES = Path(__file__).parent
"""The directory holding the repositories."""

LAYERS: dict[str, str] = {
    "RMSNorm": "rmsnorm",
    "SiLU": "activation",
    "GeLU": "activation",
    "GeluTanh": "activation",
    "NewGELU": "activation",
    "FastGELU": "activation",
    "QuickGELU": "activation",
}
"""transformers' hub-kernel layer name -> the repository whose layer of that name replaces it on tpu."""


def tpu_mapping() -> dict[str, dict[str, Any]]:
    """The ``kernels`` layer mapping of :data:`LAYERS` for the ``tpu`` device: one repository per layer for
    every mode (the layers support training and ``torch.compile``)."""
    from kernels import LocalLayerRepository

    return {name: {"tpu": LocalLayerRepository(repo_path=REPOSITORIES / repo, layer_name=name)}
            for name, repo in LAYERS.items()}


__all__ = ["LAYERS", "REPOSITORIES", "tpu_mapping"]
