"""accelerate: make tpu the default device, give its memory planner the chips' memory, and run under torchrun.

accelerate (1.x) knows TPUs only through torch_xla. Without these hooks ``Accelerator().device`` is the
CPU (or CUDA, which transformers' Trainer does not pick while tpu is there) unless ``ACCELERATE_TORCH_DEVICE=tpu``
is set, ``device_map="auto"`` silently loads on the CPU because ``get_max_memory`` lists no tpu memory, and
under torchrun (one process per chip) accelerate sees no distributed backend, so ``Trainer`` trains each rank
alone. An explicit ``Accelerator(cpu=True)``, a user's
``max_memory`` and ``ACCELERATE_TORCH_DEVICE`` keep taking precedence.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import torch


def _tpu_available() -> bool:
    return torch.tpu.is_available()


def _default_device(original: Callable[[Any], torch.device]) -> Callable[[Any], torch.device]:
    """tpu where accelerate would pick the CPU, or CUDA: transformers' ``TrainingArguments.device`` picks tpu before
    cuda, and a Trainer whose accelerate state picked cuda would put the model on one and the batches on the
    other. ``ACCELERATE_TORCH_DEVICE`` keeps its choice."""

    @functools.wraps(original)
    def default_device(self: Any) -> torch.device:
        device = original(self)
        if device.type in ("cpu", "cuda") and "ACCELERATE_TORCH_DEVICE" not in os.environ and _tpu_available():
            return torch.device("tpu")
        return device

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
            if any(isinstance(key, int) for key in result) and torch.accelerator.current_accelerator().type != "tpu":
                return result  # another accelerator accelerate knows, which torch.device(index) names
            chips = {index: torch.tpu.mem_get_info(index)[0] for index in range(torch.tpu.device_count())}
            return {**chips, **{key: size for key, size in result.items() if not isinstance(key, int)}}
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


def _tpu_dist_backend(original: Callable[..., tuple]) -> Callable[..., tuple]:
    """``PartialState._prepare_backend`` (``accelerate/state.py``) finds no backend for tpu under torchrun; use
    ``tpu_dist``, with accelerate's ``MULTI_CPU`` type: its code path for an accelerator that accelerate does not
    name (``DistributedDataParallel`` without ``device_ids``, FSDP on top), the device set by
    :func:`_tpu_dist_device`."""

    @functools.wraps(original)
    def prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False,
                        backend: str | None = None) -> tuple:
        found, kind = original(self, cpu, sagemaker_dp, backend)
        under_torchrun = int(os.environ.get("LOCAL_RANK", -1)) != -1
        if (not cpu and under_torchrun and found in (None, "gloo") and backend in (None, "tpu_dist")
                and _tpu_available() and torch.accelerator.current_accelerator().type == "tpu"):
            from accelerate.utils import DistributedType

            return "tpu_dist", DistributedType.MULTI_CPU
        return found, kind

    return prepare_backend


def _tpu_dist_device(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``PartialState.set_device``: a ``tpu_dist`` process drives its own chip, ``tpu:0``."""

    @functools.wraps(original)
    def set_device(self: Any) -> None:
        if self.device is None and self.backend == "tpu_dist":
            self.device = torch.device("tpu", torch.tpu.current_device())
        original(self)

    return set_device


def _tpu_dist_fsdp(original: Callable[..., None]) -> Callable[..., None]:
    """``AcceleratorState.__init__`` turns on FSDP only for the distributed types it names, not ``MULTI_CPU``:
    do the same for ``tpu_dist`` (an FSDP plugin, or ``ACCELERATE_USE_FSDP=true``)."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        from accelerate.utils import DistributedType

        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        wanted = fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if wanted and self.backend == "tpu_dist" and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
        if fsdp_plugin is not None and self.backend == "tpu_dist" and getattr(self, "fsdp_plugin", None) is None:
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin

    return __init__


def _rebind(package: str, original: Any, replacement: Any) -> None:
    """Replaces ``original`` in every loaded module of ``package`` that imported it by name."""
    for name, module in list(sys.modules.items()):
        if module is not None and (name == package or name.startswith(package + ".")):
            for attribute, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attribute, replacement)


def install(accelerate: Any) -> None:
    """Patches accelerate's device choice, memory planner and cache clearing for tpu (idempotent)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import memory, modeling

    if getattr(modeling.get_max_memory, "__wrapped__", None) is not None:
        return
    PartialState.default_device = property(_default_device(PartialState.default_device.fget))
    PartialState._prepare_backend = _tpu_dist_backend(PartialState._prepare_backend)
    PartialState.set_device = _tpu_dist_device(PartialState.set_device)
    AcceleratorState.__init__ = _tpu_dist_fsdp(AcceleratorState.__init__)
    for original, wrap in (
        (modeling.get_max_memory, _get_max_memory),
        (memory.clear_device_cache, _clear_device_cache),
    ):
        _rebind("accelerate", original, wrap(original))
