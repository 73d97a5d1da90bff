"""The PrivateUse1 fallback: loads the op table on the first tpu op; names ops it lacks.

Kept free of JAX so that registering the device during ``import torch`` stays cheap.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_library: torch.library.Library | None = None
_local = threading.local()


def _fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    from .dispatch import TABLE

    TABLE.install()
    if op.name() in TABLE.installed and not getattr(_local, "retrying", False):
        _local.retrying = True  # the op reached us before its kernel was installed: call it again, once
        try:
            return op(*args, **kwargs)
        finally:
            _local.retrying = False
    raise NotImplementedError(
        f"The operator '{op.name()}' ({op._schema.overload_name or 'default'} overload) has no lowering "
        "for the tpu device (hf_tpu). Please open an issue naming this operator."
    )


def install() -> None:
    global _library
    if _library is None:
        _library = torch.library.Library("_", "IMPL")
        _library.fallback(_fallback, "PrivateUse1")
