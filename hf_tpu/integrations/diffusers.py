"""diffusers: tpu among the devices without float64.

diffusers computes positional embeddings (2-D sin-cos, Flux's and others' rotary frequencies) in
float64, except on devices it lists as lacking float64 (``mps``, ``npu``, ``neuron``), where
``maybe_adjust_dtype_for_device`` gives float32. TPU chips have no float64 units either, so tpu joins
that list: the embeddings are computed in float32 on tpu whatever JAX platform backs it, so that what
runs on a CPU host is what a TPU runs (images stay within 1e-3 of the CPU pipeline's).

Patches ``_FP64_UNSUPPORTED_DEVICES`` and ``_DTYPE_UNSUPPORTED_DEVICES`` of
``diffusers/utils/torch_utils.py``; a no-op where diffusers already lists tpu.
"""

from __future__ import annotations

from typing import Any

import torch


def install(torch_utils: Any) -> None:
    unsupported = getattr(torch_utils, "_FP64_UNSUPPORTED_DEVICES", None)
    if unsupported is None or "tpu" in unsupported:
        return
    without_float64 = frozenset(unsupported) | {"tpu"}
    torch_utils._FP64_UNSUPPORTED_DEVICES = without_float64
    by_dtype = getattr(torch_utils, "_DTYPE_UNSUPPORTED_DEVICES", None)
    if isinstance(by_dtype, dict):
        by_dtype[torch.float64] = without_float64
