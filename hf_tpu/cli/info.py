"""``hf-tpu info``: what backs the ``tpu`` device, its chips and memory, and the installed versions;
``hf-tpu info --chips``: the number of local chips alone (``torchrun --nproc-per-node $(hf-tpu info --chips)``)."""

from __future__ import annotations

import os
import sys
from importlib import metadata

_VERSIONED_PACKAGES = ("hf-tpu", "torch", "jax", "jaxlib", "libtpu", "transformers", "diffusers", "accelerate",
                       "kernels", "safetensors")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _gib(size: float) -> str:
    return f"{size / 2**30:.1f} GiB"


def run_info(chips_only: bool = False) -> int:
    """Prints the platform, each chip with its memory, and the versions (``chips_only``: the number of local
    chips, ``torch.tpu.device_count()``, alone on a line); returns 0. This process opens the chips, and frees
    them when it exits."""
    import torch

    import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    if chips_only:
        print(torch.tpu.device_count())
        return 0
    properties = torch.tpu.get_device_properties(0)
    rows = [
        ("device name", torch.tpu.get_device_name(0)),
        ("device count", str(torch.tpu.device_count())),
        ("platform", properties.platform),
        ("HF_TPU_PLATFORM", os.environ.get("HF_TPU_PLATFORM", "auto (unset)")),
    ]
    for index in range(torch.tpu.device_count()):
        free, total = torch.tpu.mem_get_info(index)
        rows.append((f"tpu:{index} memory", f"{_gib(total)} total, {_gib(free)} free"))
    rows.append(("python", sys.version.split()[0]))
    rows += [(package, _version(package)) for package in _VERSIONED_PACKAGES]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
