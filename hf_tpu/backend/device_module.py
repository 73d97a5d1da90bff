"""``torch.tpu``: the device module that torch, transformers, diffusers and accelerate call.

Functions follow ``torch.cuda``'s names and semantics. Memory figures count live device buffers
created by hf_tpu; ``mem_get_info`` asks the JAX device (and the host, on JAX's CPU platform).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from ..compile.stats import compile_stats, reset_compile_stats  # noqa: F401  (torch.tpu.compile_stats)
from . import allocator as _stats
from . import random_state, runtime, streams
from .streams import Event, Stream, StreamContext, current_stream, default_stream, set_stream, stream  # noqa: F401

_local = threading.local()
_initialized = False


class _DeviceProperties(NamedTuple):
    name: str
    platform: str
    total_memory: int
    multi_processor_count: int


def _index(device: Any = None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "tpu":
            raise ValueError(f"Expected a tpu device, but got: {device}")
        index = current_device() if device.index is None else device.index
    if index == 0:  # there always is a first chip; counting them would start JAX, which tpu_dist must start
        return index
    count = device_count()
    if not 0 <= index < count:
        raise RuntimeError(
            f"Invalid device index tpu:{index}: there {'is' if count == 1 else 'are'} {count} tpu device(s)."
        )
    return index


def is_available() -> bool:
    """Always True: without TPU chips the device runs on JAX's CPU (or GPU) platform."""
    return True


def is_initialized() -> bool:
    return _initialized


def _lazy_init() -> None:
    global _initialized
    runtime.devices()
    _initialized = True


def _is_in_bad_fork() -> bool:
    from .guard import in_bad_fork

    return in_bad_fork()


def device_count() -> int:
    _lazy_init()
    return len(runtime.devices())


def current_device() -> int:
    return getattr(_local, "index", 0)


def set_device(device: Any) -> None:
    _make_current(_index(device))


def _make_current(index: int) -> None:
    _local.index = index
    if index != 0 and not _index_resolution_installed:
        _install_index_resolution()


_index_resolution_installed = False
_install_lock = threading.Lock()


def _resolved(device: Any) -> Any:
    if device == "tpu" or (isinstance(device, torch.device) and device.type == "tpu" and device.index is None):
        return torch.device("tpu", current_device())
    return device


def _install_index_resolution() -> None:
    """Makes a bare ``"tpu"`` in ``Tensor.to``/``torch.tensor``/``torch.as_tensor`` mean the current device.

    torch fills in a missing index from the PrivateUse1 device guard, which a Python backend cannot
    implement (it always answers 0). Installed only once a device other than tpu:0 is made current,
    so single-chip programs keep torch's own functions.
    """
    global _index_resolution_installed
    with _install_lock:
        if _index_resolution_installed:
            return
        _index_resolution_installed = True
    tensor_to, tensor, as_tensor = torch.Tensor.to, torch.tensor, torch.as_tensor

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            args = (_resolved(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _resolved(kwargs["device"])
        return tensor_to(self, *args, **kwargs)

    def with_device(factory: Any) -> Any:
        def create(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            return factory(*args, device=_resolved(device), **kwargs)

        create.__doc__ = factory.__doc__
        return create

    to.__doc__ = tensor_to.__doc__
    torch.Tensor.to = to
    torch.tensor = with_device(tensor)
    torch.as_tensor = with_device(as_tensor)


class device(contextlib.ContextDecorator):
    """Context manager that makes ``device`` the current tpu device."""

    def __init__(self, device: Any) -> None:
        self.index = -1 if device is None or device == -1 else _index(device)  # None, -1: no change (CUDA)
        self.previous = 0

    def __enter__(self) -> None:
        self.previous = current_device()
        if self.index >= 0:
            _make_current(self.index)

    def __exit__(self, *exc: Any) -> None:
        _local.index = self.previous


def synchronize(device: Any = None) -> None:
    """Waits until every computation and copy queued on the device, on every stream, has finished."""
    from . import checks, fused, storage
    from .guard import check_not_forked
    from .out_of_memory import raise_if_out_of_memory

    check_not_forked()
    index = _index(device)
    fused.flush()
    streams.wait_for_copies(index)
    try:
        storage.wait_for_pending(index)
    except Exception as error:
        raise_if_out_of_memory(error, index)
        raise
    checks.raise_pending()


def set_eager_mode(mode: str) -> None:
    """How eager ops on tpu tensors run: ``"strict"`` (each at once, the default), ``"fused"`` (recorded, and
    run as one XLA program when a value is needed) or ``"debug"`` (each at once, waiting for its result and
    raising its failed checks there). Also ``HF_TPU_EAGER_MODE``. What was recorded runs first."""
    from . import fused

    fused.set_mode(mode)


def get_eager_mode() -> str:
    """``"strict"``, ``"fused"`` or ``"debug"`` (see :func:`set_eager_mode`)."""
    from . import fused

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
    return random_state.get_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device: Any = "tpu") -> None:
    random_state.set_state(new_state, _index(device))


def get_rng_state_all() -> list[torch.Tensor]:
    return [random_state.get_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        random_state.set_state(state, index)


def empty_cache() -> None:
    """Nothing to release: device buffers are freed as soon as their storage dies."""


def memory_allocated(device: Any = None) -> int:
    return _stats.current(_index(device))


def max_memory_allocated(device: Any = None) -> int:
    return _stats.peak(_index(device))


def memory_reserved(device: Any = None) -> int:
    return _stats.current(_index(device))


def max_memory_reserved(device: Any = None) -> int:
    return _stats.peak(_index(device))


def reset_peak_memory_stats(device: Any = None) -> None:
    _stats.reset_peak(_index(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def memory_stats(device: Any = None) -> OrderedDict[str, int]:
    return OrderedDict(sorted(_stats.stats(_index(device)).items()))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of device memory; on JAX's CPU platform, of host memory."""
    jax_device = runtime.device(_index(device))
    stats = jax_device.memory_stats() if hasattr(jax_device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return total - int(stats.get("bytes_in_use", 0)), total
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page_size, pages * page_size


def get_device_name(device: Any = None) -> str:
    return runtime.device_name(_index(device))


def get_device_properties(device: Any = None) -> _DeviceProperties:
    index = _index(device)
    return _DeviceProperties(get_device_name(index), runtime.device(index).platform, mem_get_info(index)[1], 1)


def get_device_capability(device: Any = None) -> dict[str, Any]:
    return {"platform": runtime.device(_index(device)).platform}


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def __getattr__(name: str) -> Any:
    if name == "pallas":  # torch.tpu.pallas.jax_op, as TorchTPU names it; imported at first use (it imports JAX)
        import importlib

        return importlib.import_module("..kernels.jax_interop", __package__)
    raise AttributeError(f"module 'torch.tpu' has no attribute {name!r}")
