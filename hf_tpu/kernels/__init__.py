"""Custom kernels for the ``tpu`` device.

:func:`jax_op` (also ``torch.tpu.pallas.jax_op`` and ``torch_tpu._internal.pallas.jax_op``) makes a JAX or
Pallas function a PyTorch op on tpu tensors; :func:`to_jax` / :func:`from_jax` hand arrays between the two
without copies (:mod:`.jax_interop`). :func:`enable` runs a transformers model (:mod:`.transformers_wiring`)
or a diffusers model or pipeline (:mod:`.diffusers_wiring`) on tpu on the built-in Pallas kernels.
:func:`tpu_mapping` is the ``kernels`` layer mapping of hf_tpu's own kernel repositories (:mod:`.hub`), which
transformers' ``use_kernels`` finds for tpu models. They are imported at first use: this package must not
import JAX when ``import torch`` registers the device. The ``kernels`` library finds TPU builds of Hub
kernels for this device because hf_tpu sets ``torch.backends.tpu``.
"""

import sys
from typing import Any

_INTEROP = ("jax_op", "to_jax", "from_jax")


def enable(model_or_pipeline: Any) -> Any:
    """Runs a model on tpu on the built-in Pallas kernels; returns it, changed in place.

    A transformers model: attention, mixture-of-experts experts, RMSNorm and activations
    (:func:`.transformers_wiring.enable`). A diffusers model or pipeline: every attention module's processor
    (:func:`.diffusers_wiring.enable`). Off TPU chips the kernels run in TPU interpret mode (slow: for testing).
    """
    diffusers = sys.modules.get("diffusers")
    if diffusers is not None and isinstance(model_or_pipeline, (diffusers.DiffusionPipeline, diffusers.ModelMixin)):
        from . import diffusers_wiring

        return diffusers_wiring.enable(model_or_pipeline)
    from . import transformers_wiring

    return transformers_wiring.enable(model_or_pipeline)


def __getattr__(name: str) -> Any:
    if name in _INTEROP:
        from . import jax_interop

        return getattr(jax_interop, name)
    if name == "tpu_mapping":
        from .hub import tpu_mapping

        return tpu_mapping
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_INTEROP, "enable", "tpu_mapping"]
