"""The PrivateUse1 fallback: loads the op table on the first tpu op; names ops it lacks.

Kept free of JAX so that registering the device during ``import torch`` stays cheap.
"""

from __future__ import annotations

from typing import Any

import torch

_library: torch.library.Library | None = None


def _fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    from .dispatch import TABLE

    if TABLE.library is None:
        TABLE.install()
        if op.name() in TABLE.installed:
            return op(*args, **kwargs)
    raise NotImplementedError(
        f"The operator '{op.name()}' ({op._schema.overload_name or 'default'} overload) has no lowering "
        "for the tpu device (hf_tpu). Please open an issue naming this operator."
    )


def install() -> None:
    global _library
    if _library is None:
        _library = torch.library.Library("_", "IMPL")
        _library.fallback(_fallback, "PrivateUse1")
