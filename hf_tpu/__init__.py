"""hf_tpu: a PyTorch ``"tpu"`` device on JAX/XLA for the Hugging Face stack.

Importing hf_tpu (or just ``import torch`` once hf_tpu is installed, through torch's backend
autoload, except on a machine with NVIDIA GPUs: see :mod:`hf_tpu._autoload`) registers the device::

    import torch
    x = torch.ones(2, device="tpu")
"""

import torch  # noqa: F401  (first: if torch autoloads hf_tpu, it does so before .backend is half-imported)

from . import _autoload
from .registration import register

if not _autoload.imported_by_torch_autoload():  # under autoload, torch calls _autoload.load() itself
    _autoload.register_or_warn()


def __getattr__(name: str) -> object:
    import importlib

    if name == "export":  # ahead-of-time packages, imported at first use (they import JAX)
        return importlib.import_module(".export", __name__)
    if name in ("jax_op", "to_jax", "from_jax"):  # JAX interop, imported at first use too
        return getattr(importlib.import_module(".kernels.jax_interop", __name__), name)
    if name in ("distribute", "mesh", "placement", "sharding_of"):  # sharded tensors, imported at first use too
        return getattr(importlib.import_module(".sharding", __name__), name)
    if name == "shard":  # tensor parallelism over local chips, imported at first use too
        return importlib.import_module(".tp_plans.apply", __name__).shard
    if name == "tp_plans":
        return importlib.import_module(".tp_plans", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["distribute", "export", "from_jax", "jax_op", "mesh", "placement", "register", "shard", "sharding_of",
           "to_jax", "tp_plans"]
__version__ = "0.2.0"
