"""Device allocation failures as ``torch.OutOfMemoryError``, the error PyTorch code catches.

XLA reports a failed allocation as a ``JaxRuntimeError`` whose message starts with
``RESOURCE_EXHAUSTED`` (or, for a program that already ran asynchronously, names it when its result
is next used). Code written for CUDA (accelerate's ``find_executable_batch_size``,
transformers' automatic batch size, users' retry loops) catches ``torch.OutOfMemoryError`` and looks
for " out of memory." in its message; every tpu kernel and compiled graph raises that instead, with
the JAX error chained. Nothing was allocated for the failed op, so the device stays usable.
"""

from __future__ import annotations

import re

import torch

from . import allocator, devices, runtime
from .allocator import TooLarge

_REQUESTED = (
    re.compile(r"allocat\w* (\d+) bytes"),  # CPU and GPU platforms
    re.compile(r"allocate (\d+(?:\.\d+)?)\s*([KMGTP]i?B?)?"),  # TPU: "Attempting to allocate 4.00T"
)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def _jax_runtime_error() -> type:
    import jax

    return getattr(jax.errors, "JaxRuntimeError", None) or jax.errors.XlaRuntimeError


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(count) < 1024 or unit == "EiB":
            return f"{count:.2f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def requested_bytes(message: str) -> int | None:
    """The allocation size an XLA out-of-memory message names, if it names one."""
    match = _REQUESTED[0].search(message)
    if match:
        return int(match.group(1))
    match = _REQUESTED[1].search(message)
    if match:
        unit = (match.group(2) or "")[:1].upper()
        return int(float(match.group(1)) * _UNITS.get(unit, 1))
    return None


def is_out_of_memory(error: BaseException) -> bool:
    """XLA's RESOURCE_EXHAUSTED, or an asynchronous program's failed allocation found later."""
    if isinstance(error, TooLarge):
        return True
    if not isinstance(error, _jax_runtime_error()):
        return False
    message = str(error)
    return "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower()


def out_of_memory_error(error: BaseException, device_index: int) -> torch.OutOfMemoryError:
    """The ``torch.OutOfMemoryError`` for XLA's ``error`` on ``tpu:device_index``, worded like CUDA's."""
    message = str(error)
    requested = requested_bytes(message)
    allocator.ran_out(device_index)
    free, total = devices.mem_get_info(device_index)
    platform = runtime.backing_platform()
    where = f"tpu:{device_index}" + ("" if platform == "tpu" else f" (JAX's {platform} platform)")
    tried = f" Tried to allocate {format_bytes(requested)}." if requested is not None else ""
    return torch.OutOfMemoryError(
        f"tpu out of memory.{tried} {where} has a total capacity of {format_bytes(total)} of which "
        f"{format_bytes(free)} is free; {format_bytes(allocator.current(device_index))} is "
        "allocated by tpu tensors. Free what is no longer needed (del tensors, gc.collect()), use a smaller "
        "batch or sequence length, keep weights in bfloat16, or offload them (device_map='auto' with "
        f"max_memory). XLA said: {message.splitlines()[0]}"
    )


def raise_if_out_of_memory(error: BaseException, device_index: int) -> None:
    """Raises the ``torch.OutOfMemoryError`` for ``error`` if it is XLA's out-of-memory error."""
    if is_out_of_memory(error):
        raise out_of_memory_error(error, device_index) from error
