"""accelerate: make tpu the default device and give its memory planner the chips' memory.

accelerate (1.x) knows TPUs only through torch_xla. Without these hooks ``Accelerator().device`` is the
CPU unless ``ACCELERATE_TORCH_DEVICE=tpu`` is set, and ``device_map="auto"`` silently loads on the CPU
because ``get_max_memory`` lists no tpu memory. An explicit ``Accelerator(cpu=True)``, a user's
``max_memory`` and ``ACCELERATE_TORCH_DEVICE`` keep taking precedence.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch


def _tpu_available() -> bool:
    return torch.tpu.is_available()


def _default_device(original: Callable[[Any], torch.device]) -> Callable[[Any], torch.device]:
    @functools.wraps(original)
    def default_device(self: Any) -> torch.device:
        device = original(self)
        return torch.device("tpu") if device.type == "cpu" and _tpu_available() else device

    return default_device


def _get_max_memory(original: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(original)
    def get_max_memory(max_memory: dict | None = None) -> dict:
        """accelerate's ``get_max_memory`` with tpu chips as its accelerators: integer keys are chip indices
        (``torch.device(0)`` is ``tpu:0``); unset, each chip gets its free memory."""
        if not _tpu_available():
            return original(max_memory)
        if max_memory is None:
            result = original(None)
            if any(isinstance(key, int) for key in result):  # another accelerator accelerate knows
                return result
            chips = {index: torch.tpu.mem_get_info(index)[0] for index in range(torch.tpu.device_count())}
            return {**chips, **result}
        from accelerate.utils import convert_file_size_to_int

        for key, size in max_memory.items():  # in place, as accelerate does: transformers compares the sizes after
            if isinstance(size, str):
                max_memory[key] = convert_file_size_to_int(size)
        chips = {}
        for index, size in sorted((k, v) for k, v in max_memory.items() if isinstance(k, int)):
            if not 0 <= index < torch.tpu.device_count():
                raise ValueError(f"max_memory names tpu:{index}, but there are {torch.tpu.device_count()} tpu chips")
            chips[index] = size
        others = original({key: value for key, value in max_memory.items() if not isinstance(key, int)})
        return {**chips, **others}

    return get_max_memory


def _clear_device_cache(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def clear_device_cache(garbage_collection: bool = False) -> None:
        original(garbage_collection)
        if _tpu_available():
            torch.tpu.empty_cache()

    return clear_device_cache


def _rebind(package: str, original: Any, replacement: Any) -> None:
    """Replaces ``original`` in every loaded module of ``package`` that imported it by name."""
    for name, module in list(sys.modules.items()):
        if module is not None and (name == package or name.startswith(package + ".")):
            for attribute, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attribute, replacement)


def install(accelerate: Any) -> None:
    """Patches accelerate's device choice, memory planner and cache clearing for tpu (idempotent)."""
    from accelerate.state import PartialState
    from accelerate.utils import memory, modeling

    if getattr(modeling.get_max_memory, "__wrapped__", None) is not None:
        return
    PartialState.default_device = property(_default_device(PartialState.default_device.fget))
    for original, wrap in (
        (modeling.get_max_memory, _get_max_memory),
        (memory.clear_device_cache, _clear_device_cache),
    ):
        _rebind("accelerate", original, wrap(original))
