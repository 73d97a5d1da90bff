"""Pinned host memory for the tpu device: ``Tensor.pin_memory()``, ``Tensor.is_pinned()`` and the
factories' ``pin_memory=True``.

torch gets pinned memory from the PrivateUse1 hooks' allocator, which a Python backend cannot provide
(``DataLoader(pin_memory=True)``, the Trainer's default, and diffusers' streamed offloading ask for it).
JAX stages host transfers itself, so pinned memory here is ordinary host memory whose storage carries
a mark: ``is_pinned()`` reads it, and ``non_blocking=True`` copies on a stream treat marked memory as
CUDA treats pinned memory (see ``streams.py``). JAX-free: installed at registration.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.utils._device

_MARK = "_hf_pinned"  # an attribute of the host storage's Python object, which torch keeps with the storage
# The factories that take pin_memory= and that code pins memory with; the others (rand, arange, tensor,
# ...) keep torch's error: create the tensor, then call .pin_memory().
_FACTORIES = ("empty", "empty_strided", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like")
_libraries: list[torch.library.Library] = []


def mark(tensor: torch.Tensor) -> torch.Tensor:
    """Marks a CPU tensor's storage as pinned; returns ``tensor``."""
    setattr(tensor.untyped_storage(), _MARK, True)
    return tensor


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    return mark(torch.empty_strided(self.shape, self.stride(), dtype=self.dtype).copy_(self))


_is_pinned_op = torch.ops.aten.is_pinned.default


def _is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    if getattr(self.untyped_storage(), _MARK, False):
        return True
    return _is_pinned_op._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, self, device)  # torch's answer


def _pinning(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``factory`` accepting ``pin_memory=True``; calls without it go straight to ``factory``."""

    @functools.wraps(factory)
    def create(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not kwargs:  # no **{} forwarding: torch parses an empty keyword dict slowly
            return factory(*args)
        if not kwargs.pop("pin_memory", False):
            return factory(*args, **kwargs)
        tensor = factory(*args, **kwargs)
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise RuntimeError(f"Only dense CPU tensors can be pinned; this one is {tensor.layout} on {tensor.device}")
        return mark(tensor)

    return create


def install() -> None:
    library = torch.library.Library("aten", "IMPL")
    library.impl("_pin_memory", _pin_memory, "CPU")
    library.impl("is_pinned", _is_pinned, "CPU")
    _libraries.append(library)
    # Registries keyed by function identity: torch's default-device mode (``with torch.device("tpu"):``) caches
    # the set of factories it fills in, and __torch_function__ hands it the builtin, not the wrapper: cache
    # the builtins before wrapping. TorchScript's table is built from torch's attributes at its first use.
    torch.utils._device._device_constructors()
    builtins = torch.jit._builtins
    for name in _FACTORIES:
        original = getattr(torch, name)
        if hasattr(original, "__wrapped__"):  # installed already
            continue
        setattr(torch, name, _pinning(original))
        if builtins._builtin_table is not None:
            builtins._register_builtin(getattr(torch, name), f"aten::{name}")
