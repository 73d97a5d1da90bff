"""What every tpu kernel goes through: the fork check (:mod:`forks`) and out-of-memory errors (``guarded``
wraps the hand-written kernels; kernels built from lowerings do the same inline, in ``dispatch.build_kernel``)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from . import devices, forks
from .out_of_memory import raise_if_out_of_memory


def _device_of(args: tuple, kwargs: dict) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.device.type == "tpu":
            return value.device.index or 0
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor) and item.device.type == "tpu":
                    return item.device.index or 0
    return devices.current_device()


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a kernel: refuses in a bad fork; XLA's out-of-memory error becomes ``torch.OutOfMemoryError``."""

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if forks.forked:
            raise RuntimeError(forks.FORK_MESSAGE)
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            raise_if_out_of_memory(error, _device_of(args, kwargs))
            raise

    return kernel
