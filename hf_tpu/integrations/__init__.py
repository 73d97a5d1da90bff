"""Hooks into the Hugging Face libraries, applied when (and only if) a library is imported.

``import torch`` must stay fast, so nothing here imports transformers, diffusers or accelerate.
Each integration module registers its patches with :func:`hf_tpu._import_hooks.when_imported` (a callback
right after a module finishes importing, or at once if it already has) from :func:`install`.
"""

from __future__ import annotations

import functools
from typing import Callable

from .._import_hooks import when_imported

__all__ = ["INTEGRATIONS", "install", "traced_by_dynamo", "when_imported"]

# module name -> integration module(s) (in this package) whose ``install(module)`` patches it
INTEGRATIONS: dict[str, str | tuple[str, ...]] = {
    "transformers.generation.utils": ("generation", "bucketed_prefill"),
    "transformers.generation.continuous_batching.cache": "continuous_batching",
    "transformers.cli.serving.utils": "serving",  # `transformers serve`
    "accelerate.utils.modeling": "accelerate",  # not "accelerate": its __init__ imports torch first
    "transformers": "transformers",
    # not "transformers": by then transformers.utils has bound is_kernels_available
    "transformers.utils.import_utils": ("hub_kernels", "flex_attention"),
    "diffusers.utils.torch_utils": "diffusers",
    "torch._inductor": "inductor",  # ahead-of-time compilation: tpu programs go to hf_tpu.export
    "torch._dynamo": "dynamo",  # torch's caching precompile for HF models
    "safetensors": "safetensors",
    "kernels": "kernels",  # the Hugging Face kernels library (not hf_tpu.kernels)
    "torch.nn.attention.flex_attention": "flex_attention",
    "torch.distributed": "distributed",
}


def traced_by_dynamo(fn: Callable) -> Callable:
    """``fn``, which Dynamo traces although it skips hf_tpu's files (``torch._dynamo.dont_skip_tracing``): a patch
    called inside compiled code would otherwise break the graph there."""
    import torch._dynamo

    dont_skip_tracing = getattr(torch._dynamo, "dont_skip_tracing", None)
    # named as ``fn``: Dynamo's caching precompile finds a method it saves by its name
    return fn if dont_skip_tracing is None else functools.wraps(fn)(dont_skip_tracing(fn))


def install() -> None:
    """Registers every integration of :data:`INTEGRATIONS` to run when its library is imported."""
    import importlib

    for module_name, integrations in INTEGRATIONS.items():
        for integration in (integrations,) if isinstance(integrations, str) else integrations:
            when_imported(module_name, importlib.import_module(f"{__name__}.{integration}").install)
