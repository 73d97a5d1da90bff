"""View ops: metadata only, so they run torch's own CPU kernels on the tpu TensorImpl.

The CPU kernels build the view from the input's storage and dispatch keys, so the result is a tpu
tensor aliasing the same storage (and thus the same device buffer), with ``_base`` and version
counter handled by autograd's ADInplaceOrView layer as usual. Every other ATen view op is
CompositeExplicitAutograd over these.
"""

from __future__ import annotations

import torch

from ..dispatch import kernel

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

_METADATA_OPS = (
    "as_strided",
    "view",
    "_reshape_alias",
    "unfold",
    "view_as_real",
    "view_as_complex",
    "set_.source_Storage_storage_offset",
    "set_.source_Storage",
    "set_.source_Tensor",
)


def _on_cpu_kernel(name: str):
    namespace_op = getattr(torch.ops.aten, name.split(".")[0])
    op = getattr(namespace_op, name.split(".")[1] if "." in name else "default")

    def run(*args, **kwargs):
        return op.redispatch(_CPU_KEYS, *args, **kwargs)

    run.__name__ = f"tpu_{name.replace('.', '_')}"
    return run


for _name in _METADATA_OPS:
    kernel(_name)(_on_cpu_kernel(_name))
