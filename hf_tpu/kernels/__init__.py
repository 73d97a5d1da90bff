"""Custom kernels for the ``tpu`` device.

:func:`jax_op` (also ``torch.tpu.pallas.jax_op`` and ``torch_tpu._internal.pallas.jax_op``) makes a JAX or
Pallas function a PyTorch op on tpu tensors; :func:`to_jax` / :func:`from_jax` hand arrays between the two
without copies (:mod:`.jax_interop`). :func:`enable` runs a transformers model on tpu on the built-in Pallas
kernels (:mod:`.transformers_wiring`). They are imported at first use: this package must not import JAX when
``import torch`` registers the device. The ``kernels`` library finds TPU builds of Hub kernels for this
device because hf_tpu sets ``torch.backends.tpu``.
"""

from typing import Any

_INTEROP = ("jax_op", "to_jax", "from_jax")


def __getattr__(name: str) -> Any:
    if name in _INTEROP:
        from . import jax_interop

        return getattr(jax_interop, name)
    if name == "enable":
        from . import transformers_wiring

        return transformers_wiring.enable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_INTEROP, "enable"]
