"""Device state: which tpu chips there are, which one is current, and their memory.

The floor of ``torch.tpu`` (:mod:`hf_tpu.device_module`), kept here so that the layers below the facade
(storage, streams, dispatch, the op families) can resolve a device index without importing it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import torch

from . import runtime

_local = threading.local()
_initialized = False


def index_of(device: Any = None) -> int:
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
    if index == _launcher_local_rank() and index >= count:
        return 0  # CUDA code's name for this process's device, tpu:LOCAL_RANK, is its own first chip
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


def device_count() -> int:
    """The tpu devices of this process. Under a launcher that runs several processes on the host (torchrun),
    counted without starting JAX while ``init_process_group`` has yet to start it: as on CUDA, scripts count and
    pick devices first."""
    before_start = _count_before_start()
    if before_start is not None:
        return before_start
    _lazy_init()
    return len(runtime.devices())


def _launcher_local_rank() -> int | None:
    """This process's LOCAL_RANK when a launcher runs several processes on the host."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1 or "LOCAL_RANK" not in os.environ:
        return None
    return int(os.environ["LOCAL_RANK"])


def _count_before_start() -> int | None:
    """The devices this process will drive once ``tpu_dist`` starts JAX's runtime, known before JAX starts: on
    TPU chips one each (the split of :mod:`hf_tpu.distributed.runtime`, or as many as the user's
    ``TPU_VISIBLE_CHIPS`` names), elsewhere ``HF_TPU_NUM_DEVICES`` (one by default). ``None`` outside
    a multi-process launch or once JAX has started."""
    if _launcher_local_rank() is None or runtime.backends_started():
        return None
    if runtime.tpu_chips():
        return len(os.environ.get("TPU_VISIBLE_CHIPS", "0").split(","))
    return runtime.requested_device_count() or 1


def current_device() -> int:
    return getattr(_local, "index", 0)


def set_device(device: Any) -> None:
    _make_current(index_of(device))


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
        self.index = -1 if device is None or device == -1 else index_of(device)  # None, -1: no change (CUDA)
        self.previous = 0

    def __enter__(self) -> None:
        self.previous = current_device()
        if self.index >= 0:
            _make_current(self.index)

    def __exit__(self, *exc: Any) -> None:
        _local.index = self.previous


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of device memory; on JAX's CPU platform, what the host can give this process
    (:func:`host_memory`)."""
    jax_device = runtime.device(index_of(device))
    stats = jax_device.memory_stats() if hasattr(jax_device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return total - int(stats.get("bytes_in_use", 0)), total
    return host_memory()


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory for this process: the kernel's estimate of what can be allocated
    without swapping (``MemAvailable``: free memory and reclaimable caches, not only ``MemFree``) and the physical
    total, each within the process's cgroup limit if it has one (a container's). Allocations past the available
    figure are granted, then the OS kills the process when it writes them: on JAX's CPU platform, the device
    refuses a result larger than this with ``torch.OutOfMemoryError`` instead."""
    meminfo = _meminfo()
    available, total = meminfo.get("MemAvailable", meminfo.get("MemFree", 0)), meminfo.get("MemTotal", 0)
    limit, used = _cgroup_memory()
    if limit is not None:
        available, total = min(available, max(limit - used, 0)), min(total, limit)
    return available, total


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as meminfo:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo if line.rstrip().endswith("kB")}
    except OSError:  # not Linux
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return {"MemAvailable": os.sysconf("SC_AVPHYS_PAGES") * page_size, "MemTotal": pages * page_size}


# cgroup v2, then v1: (limit, usage) files
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _cgroup_memory() -> tuple[int | None, int]:
    """The process's cgroup memory limit and usage, ``(None, 0)`` without a limit."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                value, used = limit.read().strip(), int(usage.read().strip())
        except (OSError, ValueError):
            continue
        if value.isdigit() and int(value) < 1 << 60:  # v1 reports "no limit" as a huge number, v2 as "max"
            return int(value), used
        return None, 0
    return None, 0
