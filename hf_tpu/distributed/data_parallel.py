"""``DistributedDataParallel`` on tpu: a clear error where torch's reducer cannot run.

With ``find_unused_parameters=True`` the C++ reducer (``torch/csrc/distributed/c10d/reducer.cpp``,
``all_reduce_local_used_map``) copies its map of used parameters through pinned host memory when the parameters
are on a PrivateUse1 device, and asks the device's hooks for a pinned-memory allocator, which a Python backend
cannot provide: the first backward pass would fail with torch's note to C++ backend authors.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_MESSAGE = (
    "DistributedDataParallel(find_unused_parameters=True) is not supported for a model on tpu: torch's reducer "
    "then needs a pinned-memory allocator that a Python device backend cannot provide. Pass "
    "find_unused_parameters=False (every parameter that requires grad must get a gradient in each step: "
    "freeze the ones a step does not use with requires_grad_(False)), or use FSDP2 (fully_shard)."
)


def install() -> None:
    """Wraps ``DistributedDataParallel.__init__`` with the check (idempotent)."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__
    if getattr(original, "__wrapped__", None) is not None:
        return

    signature = inspect.signature(original)

    def __init__(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        find_unused = signature.bind(self, module, *args, **kwargs).arguments.get("find_unused_parameters")
        if find_unused and any(p.device.type == "tpu" for p in module.parameters()):
            raise ValueError(_MESSAGE)
        original(self, module, *args, **kwargs)

    __init__.__wrapped__ = original
    DistributedDataParallel.__init__ = __init__
