"""Graph mode: ``torch.compile(model, backend="tpu")`` runs each Dynamo graph as one XLA program.

The Dynamo backend ``"tpu"`` is found through the ``torch_dynamo_backends`` entry point (see
``pyproject.toml``), so neither ``import torch`` nor ``import hf_tpu`` imports Dynamo or JAX for it.
:func:`tpu_backend` is the backend itself; AOTAutograd turns each Dynamo graph into forward and
backward ATen graphs, and :mod:`.graph_lowering` lowers each to one ``jax.jit`` with the op table
eager mode uses (plus the graph-mode lowerings of :mod:`.graph_ops` for views, factories and copies).
"""

from __future__ import annotations

from typing import Any

from .stats import compile_stats, reset_compile_stats


def tpu_backend(graph_module: Any, example_inputs: list) -> Any:
    """The ``"tpu"`` Dynamo backend: ``torch.compile(fn, backend="tpu")`` (imports JAX when first called)."""
    from .backend import compile_graph

    return compile_graph(graph_module, example_inputs)


__all__ = ["compile_stats", "reset_compile_stats", "tpu_backend"]
