"""transformers' continuous batching on tpu: the paged cache sized from the chip's memory, not the host's.

``PagedAttentionCache`` sizes its cache from ``get_device_and_memory_breakdown()``, which knows cuda, xpu and mps
and, for any other device, reports the host's RAM: for a tpu model it asked for 90% of the host (the process was
killed while the cache's zeros were written on JAX's CPU platform; a TPU VM's hundreds of GB of RAM would be asked
of a chip of 16-95 GB). Here a cache made for a tpu device is sized from ``torch.tpu.mem_get_info`` of its chip: on
chips, the chip's free memory; on JAX's CPU platform, the memory the host has available (see
:func:`hf_tpu.backend.devices.mem_get_info`).

The share of it the cache may take is the user's ``max_memory_percent`` when set, else transformers' default for
an accelerator (0.9, 0.8 with logits processors) on chips; on JAX's CPU platform, whose memory is the host's and
whose zeros are written (not lazily mapped as CPU tensors' are), transformers' CPU default (0.6) of the available
memory, capped at :data:`HOST_CACHE_BYTES`. An explicit ``num_blocks`` is used as is.

Patches ``PagedAttentionCache.__init__`` and the ``get_device_and_memory_breakdown`` it calls
(``transformers/generation/continuous_batching/cache.py``) and ``resolve_max_memory_percent``
(``transformers/generation/continuous_batching/initialization.py``), transformers 5.2x.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

import torch

HOST_CACHE_BYTES = 4 << 30
"""The most a paged cache takes by default on JAX's CPU platform (the host's memory)."""

_SIZED_FOR: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("hf_tpu_paged_cache", default=None)


def _on_chips() -> bool:
    from ..backend import runtime

    return runtime.backing_platform() != "cpu"


def _install_chip_memory_breakdown(cache: Any) -> None:
    """A paged cache made for a tpu device sees its chip's memory (``get_device_and_memory_breakdown``)."""
    breakdown, init = cache.get_device_and_memory_breakdown, cache.PagedAttentionCache.__init__
    if getattr(init, "_hf_tpu", False):
        return

    @functools.wraps(breakdown)
    def get_device_and_memory_breakdown() -> tuple[torch.device, int, int, int]:
        device = _SIZED_FOR.get()
        if device is None:
            return breakdown()
        free, total = torch.tpu.mem_get_info(device)
        used = total - free
        return device, total, used, used

    @functools.wraps(init)
    def __init__(self: Any, config: Any, continuous_batching_config: Any, device: Any, *args: Any, **kwargs: Any):
        device = torch.device(device)
        if device.type != "tpu":
            return init(self, config, continuous_batching_config, device, *args, **kwargs)
        chip = torch.device("tpu", torch.tpu.current_device() if device.index is None else device.index)
        sizing = _SIZED_FOR.set(chip)
        try:
            return init(self, config, continuous_batching_config, device, *args, **kwargs)
        finally:
            _SIZED_FOR.reset(sizing)

    __init__._hf_tpu = True
    cache.get_device_and_memory_breakdown = get_device_and_memory_breakdown
    cache.PagedAttentionCache.__init__ = __init__


def _install_default_share(initialization: Any) -> None:
    """The share of memory a tpu model's paged cache takes by default (see the module docstring)."""
    resolve = initialization.resolve_max_memory_percent
    if getattr(resolve, "_hf_tpu", False):
        return

    @functools.wraps(resolve)
    def resolve_max_memory_percent(cb_config: Any, has_logit_processors: bool, device: Any = None) -> None:
        if device is None or torch.device(device).type != "tpu" or cb_config.max_memory_percent is not None \
                or _on_chips():
            return resolve(cb_config, has_logit_processors, device)
        free, _ = torch.tpu.mem_get_info(device)
        cb_config.max_memory_percent = min(0.6, HOST_CACHE_BYTES / max(free, 1))

    resolve_max_memory_percent._hf_tpu = True
    initialization.resolve_max_memory_percent = resolve_max_memory_percent


def install(cache: Any) -> None:
    """Patches ``transformers.generation.continuous_batching.cache`` and its ``initialization`` sibling."""
    from . import when_imported

    _install_chip_memory_breakdown(cache)
    when_imported("transformers.generation.continuous_batching.initialization", _install_default_share)
