"""``torch.tpu``: the device module that torch, transformers, diffusers and accelerate call.

Functions follow ``torch.cuda``'s names and semantics. Memory figures count live device buffers
created by hf_tpu; ``mem_get_info`` asks the JAX device (and the host, on JAX's CPU platform).

This module gathers what the layers below provide (device state, streams, RNG, memory, eager modes,
graph mode's statistics, Pallas interop) into one namespace; nothing in those layers imports it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from .backend import allocator as _stats
from .backend import devices, forks, random_state, runtime, streams
from .backend.devices import (  # noqa: F401  (torch.tpu's names)
    _lazy_init, current_device, device_count, is_available, is_initialized, mem_get_info, set_device,
)
from .backend.streams import (  # noqa: F401
    Event, Stream, StreamContext, current_stream, default_stream, set_stream, stream,
)
from .compile.stats import compile_stats, reset_compile_stats  # noqa: F401

__all__ = [
    "Event", "Stream", "StreamContext", "compile_stats", "current_device", "current_stream", "default_stream",
    "device", "device_count", "empty_cache", "get_amp_supported_dtype", "get_device_capability", "get_device_name",
    "get_device_properties", "get_eager_mode", "get_rng_state", "get_rng_state_all", "initial_seed", "is_available",
    "is_bf16_supported", "is_initialized", "manual_seed", "manual_seed_all", "max_memory_allocated",
    "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_reserved", "memory_stats",
    "reset_compile_stats", "reset_max_memory_allocated", "reset_peak_memory_stats", "seed", "seed_all", "set_device",
    "set_eager_mode", "set_rng_state", "set_rng_state_all", "set_stream", "stream", "synchronize",
]


class _DeviceProperties(NamedTuple):
    name: str
    platform: str
    total_memory: int
    multi_processor_count: int


def _is_in_bad_fork() -> bool:
    return forks.in_bad_fork()


def synchronize(device: Any = None) -> None:
    """Waits until every computation and copy queued on the device, on every stream, has finished."""
    from .backend import checks, completion, fused  # JAX: torch imports this module before the first tpu op
    from .backend.out_of_memory import raise_if_out_of_memory

    forks.check_not_forked()
    index = devices.index_of(device)
    fused.flush()
    streams.wait_for_copies(index)
    try:
        completion.wait_for_pending(index)
    except Exception as error:
        raise_if_out_of_memory(error, index)
        raise
    checks.raise_pending()


def set_eager_mode(mode: str) -> None:
    """How eager ops on tpu tensors run: ``"strict"`` (each at once, the default), ``"fused"`` (recorded, and
    run as one XLA program when a value is needed) or ``"debug"`` (each at once, waiting for its result and
    raising its failed checks there). Also ``HF_TPU_EAGER_MODE``. What was recorded runs first."""
    from .backend import fused

    fused.set_mode(mode)


def get_eager_mode() -> str:
    """``"strict"``, ``"fused"`` or ``"debug"`` (see :func:`set_eager_mode`)."""
    from .backend import fused

    return fused.MODE


def manual_seed(seed: int) -> None:
    random_state.manual_seed(seed, current_device())


def manual_seed_all(seed: int) -> None:
    random_state.manual_seed_all(seed)


def seed() -> None:
    random_state.seed(current_device())


def seed_all() -> None:
    value = random_state.seed(0)
    for index in range(1, device_count()):
        random_state.manual_seed(value, index)


def initial_seed() -> int:
    return random_state.initial_seed(current_device())


def get_rng_state(device: Any = "tpu") -> torch.Tensor:
    return random_state.get_state(devices.index_of(device))


def set_rng_state(new_state: torch.Tensor, device: Any = "tpu") -> None:
    random_state.set_state(new_state, devices.index_of(device))


def get_rng_state_all() -> list[torch.Tensor]:
    return [random_state.get_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        random_state.set_state(state, index)


def empty_cache() -> None:
    """Nothing to release: device buffers are freed as soon as their storage dies."""


def memory_allocated(device: Any = None) -> int:
    return _stats.current(devices.index_of(device))


def max_memory_allocated(device: Any = None) -> int:
    return _stats.peak(devices.index_of(device))


def memory_reserved(device: Any = None) -> int:
    return _stats.current(devices.index_of(device))


def max_memory_reserved(device: Any = None) -> int:
    return _stats.peak(devices.index_of(device))


def reset_peak_memory_stats(device: Any = None) -> None:
    _stats.reset_peak(devices.index_of(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def memory_stats(device: Any = None) -> OrderedDict[str, int]:
    """``torch.cuda.memory_stats``' keys that apply: ``allocated_bytes``, ``active_bytes`` and ``reserved_bytes``
    (``.all.current`` and ``.all.peak``; the three are one figure, the bytes of live tpu storages: XLA's allocator
    reserves nothing a caller could free), allocations and frees, ``num_ooms`` (``torch.OutOfMemoryError`` raised)
    and ``num_alloc_retries`` (always 0: nothing is retried), as TorchTitan's memory monitor reads them; and
    ``in_place_copies``: in-place updates that could not write into the tensor's own memory because something else
    held its old values (for a moment the chip held the tensor twice)."""
    return OrderedDict(sorted(_stats.stats(devices.index_of(device)).items()))


def get_device_name(device: Any = None) -> str:
    return runtime.device_name(devices.index_of(device))


def get_device_properties(device: Any = None) -> _DeviceProperties:
    index = devices.index_of(device)
    return _DeviceProperties(get_device_name(index), runtime.device(index).platform, mem_get_info(index)[1], 1)


def get_device_capability(device: Any = None) -> dict[str, Any]:
    return {"platform": runtime.device(devices.index_of(device)).platform}


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def __getattr__(name: str) -> Any:
    if name == "pallas":  # torch.tpu.pallas.jax_op, as TorchTPU names it; imported at first use (it imports JAX)
        import importlib

        return importlib.import_module(".kernels.jax_interop", __package__)
    raise AttributeError(f"module 'torch.tpu' has no attribute {name!r}")


device = devices.device  # the context manager, named as torch.cuda names it
