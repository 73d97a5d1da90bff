"""safetensors: ``safe_open(..., device="tpu")`` and ``load_file(..., device="tpu")``.

safetensors' Rust reader knows a fixed list of device names and refuses ``"tpu"`` ("device tpu is
invalid"). accelerate's disk offload (``accelerate/utils/offload.py``, ``OffloadedWeightsLoader``) and
diffusers' group offloading to disk (``diffusers/hooks/group_offloading.py``, ``_onload_from_disk``)
read offloaded weights straight to their execution device that way. Patches ``safe_open`` of
``safetensors/__init__.py`` (and the name ``safetensors/torch.py`` imported, which ``load_file``
uses): for a tpu device the file is read on the CPU (memory-mapped, as upstream) and each tensor is
moved to the chip as it is read; every other device goes to safetensors unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _tpu_device(device: Any) -> torch.device | None:
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "tpu":
        return torch.device(device)
    return None


class _SliceOnDevice:
    def __init__(self, inner: Any, device: torch.device) -> None:
        self._inner, self._device = inner, device

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._inner[index].to(self._device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _OpenOnDevice:
    """A CPU ``safe_open`` handle whose tensors come out on ``device``."""

    def __init__(self, inner: Any, device: torch.device) -> None:
        self._inner, self._device = inner, device

    def __enter__(self) -> _OpenOnDevice:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._inner.get_tensor(name).to(self._device)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {name: tensor.to(self._device) for name, tensor in self._inner.get_tensors().items()}

    def get_slice(self, name: str) -> _SliceOnDevice:
        return _SliceOnDevice(self._inner.get_slice(name), self._device)

    def __getattr__(self, name: str) -> Any:  # keys, metadata, offset_keys, ...
        return getattr(self._inner, name)


def _safe_open_on_tpu(original: Any) -> Any:
    def safe_open(filename: Any, framework: str, device: Any = "cpu", **kwargs: Any) -> Any:
        target = _tpu_device(device)
        if target is None or framework not in ("pt", "torch"):
            return original(filename, framework, device=device, **kwargs)
        return _OpenOnDevice(original(filename, framework, device="cpu", **kwargs), target)

    safe_open.__doc__ = original.__doc__
    safe_open.__wrapped__ = original
    return safe_open


def install(safetensors: Any) -> None:
    original = safetensors.safe_open
    if hasattr(original, "__wrapped__"):
        return
    patched = _safe_open_on_tpu(original)
    safetensors.safe_open = patched
    reader = sys.modules.get("safetensors.torch")
    if reader is not None and getattr(reader, "safe_open", None) is original:
        reader.safe_open = patched
