"""Makes ``tpu`` a PyTorch device: PrivateUse1 renamed, hooks, guard, ``torch.tpu``, patches.

Everything here is cheap and JAX-free, so it can run during ``import torch`` (autoload). The op
table and JAX are loaded by the PrivateUse1 fallback on the first tpu op.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import torch

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Registers the ``tpu`` device (idempotent, thread-safe)."""
    global _registered
    with _lock:
        if _registered:
            return
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", "tpu"):
            raise RuntimeError(
                f"PrivateUse1 is already renamed to {name!r} (another backend such as torchax is loaded); "
                "hf_tpu needs it as 'tpu'. Use one PrivateUse1 backend per process."
            )
        from . import compile as graph_mode
        from . import device_module, distributed, integrations
        from .backend import autocast, engine_hooks, fallback, module_conversion, pinned
        from .kernels import torch_tpu_shim

        if name != "tpu":
            torch.utils.rename_privateuse1_backend("tpu")
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
        torch._register_device_module("tpu", device_module)
        engine_hooks.install()
        fallback.install()
        autocast.install()
        _install_backends_flag()
        _patch_accelerator(device_module)
        module_conversion.install()
        _patch_storage_constructor()
        _patch_storage_resize()
        pinned.install()
        _explain_device_generators()
        _route_streams_and_events(device_module)
        integrations.install()
        graph_mode.install()
        torch_tpu_shim.install()  # `from torch_tpu._internal.pallas import jax_op` for Hub kernels
        distributed.register()  # the c10d backend "tpu_dist", tpu's default
        _registered = True


def _install_backends_flag() -> None:
    # HF `kernels` picks TPU builds when `torch.backends.tpu` exists.
    module = types.ModuleType("torch.backends.tpu", "The hf_tpu backend (JAX/XLA).")
    module.is_built = lambda: True
    module.is_available = lambda: True
    torch.backends.tpu = module


def _is_tpu_current() -> bool:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu"


def _delegating(original: Any, replacement: Any) -> Any:
    def patched(*args: Any, **kwargs: Any) -> Any:
        if _is_tpu_current():
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    patched.__name__ = getattr(original, "__name__", "patched")
    patched.__doc__ = getattr(original, "__doc__", None)
    patched.__wrapped__ = original
    return patched


def _patch_accelerator(tpu: Any) -> None:
    """torch's pure-Python PrivateUse1 path leaves these raising (the stream ones: answering with a generic
    stream that does nothing); route them to ``torch.tpu``."""
    replacements = {
        "synchronize": tpu.synchronize,
        "current_device_index": tpu.current_device,
        "current_device_idx": tpu.current_device,
        "set_device_index": tpu.set_device,
        "set_device_idx": tpu.set_device,
        "empty_cache": tpu.empty_cache,
        "memory_allocated": tpu.memory_allocated,
        "max_memory_allocated": tpu.max_memory_allocated,
        "memory_reserved": tpu.memory_reserved,
        "max_memory_reserved": tpu.max_memory_reserved,
        "reset_peak_memory_stats": tpu.reset_peak_memory_stats,
        "reset_accumulated_memory_stats": lambda device=None, /: None,
        "memory_stats": tpu.memory_stats,
        "get_memory_info": tpu.mem_get_info,
        "current_stream": tpu.current_stream,
        "set_stream": tpu.set_stream,
    }
    for namespace in (torch.accelerator, torch.accelerator.memory):
        for name, replacement in replacements.items():
            original = getattr(namespace, name, None)
            if original is not None and not hasattr(original, "__wrapped__"):
                setattr(namespace, name, _delegating(original, replacement))


_storage_new = torch.UntypedStorage.__new__


def _patch_storage_constructor() -> None:
    """``torch.UntypedStorage(n, device="tpu")`` (``torch.load`` of tpu tensors) would use the PrivateUse1
    allocator, which a Python backend cannot provide, and segfault; build the storage from a tensor."""

    def new(cls: type, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is None:
            return _storage_new(cls, *args, **kwargs)
        if torch.device(device).type != "tpu":
            return _storage_new(cls, *args, device=device, **kwargs)
        if args and not isinstance(args[0], int):  # from a sequence of byte values
            host = torch.empty(0, dtype=torch.uint8).set_(_storage_new(cls, *args, **kwargs))
            return host.to(device).untyped_storage()
        return torch.empty(args[0] if args else 0, dtype=torch.uint8, device=device).untyped_storage()

    torch.UntypedStorage.__new__ = new


_storage_resize = torch.UntypedStorage.resize_


def _patch_storage_resize() -> None:
    """``storage.resize_`` of a tpu storage would call ``resizePrivateUse1Bytes``, which the Python hooks cannot
    provide. FSDP2 frees a gathered parameter with ``resize_(0)`` and brings it back with ``resize_(nbytes)``
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, ``free_storage``/``alloc_storage``) before writing
    it whole: ``resize_(0)`` frees the elements, keeping the storage's size, and resizing to that size is a no-op
    (the next write allocates)."""

    def resize_(self: Any, size: int) -> Any:
        if self.device.type != "tpu":
            return _storage_resize(self, size)
        if size == 0:
            from .backend import storage

            storage.buffer_of(torch.empty(0, dtype=torch.uint8, device=self.device).set_(self)).release()
        elif size != self.nbytes():
            raise RuntimeError(f"resizing a tpu storage from {self.nbytes()} to {size} bytes is not supported: "
                               "make a new tensor of the size you need (torch.empty(..., device='tpu')).")
        return self

    resize_.__doc__ = _storage_resize.__doc__
    torch.UntypedStorage.resize_ = resize_


_GENERATOR_MESSAGE = (
    "torch.Generator(device={device!r}) is not supported: PyTorch creates device generators only for C++ backends. "
    "Pass a CPU generator instead, e.g. torch.Generator().manual_seed(0) (diffusers' randn_tensor and "
    "transformers sample with it and move the numbers to tpu), or seed the device's own stream with "
    "torch.manual_seed(0)."
)


def _standing_in_for(original: type) -> type:
    """A metaclass for a class that replaces the torch C type ``original``: ``isinstance`` and
    ``issubclass`` against the replacement stay true for everything torch makes."""

    class StandIn(type(original)):
        def __instancecheck__(cls, instance: Any) -> bool:
            return isinstance(instance, original)

        def __subclasscheck__(cls, subclass: type) -> bool:
            return issubclass(subclass, original)

    return StandIn


def _explain_device_generators() -> None:
    """``torch.Generator(device="tpu")`` fails with torch's note to C++ backend authors; make it say
    what to do instead. Other devices get torch's own generator, unchanged."""
    original = torch._C.Generator
    if torch.Generator is not original:
        return

    class Generator(original, metaclass=_standing_in_for(original)):
        __doc__ = original.__doc__

        def __new__(cls, device: Any = None) -> Any:
            if device is not None and torch.device(device).type == "tpu":
                raise RuntimeError(_GENERATOR_MESSAGE.format(device=str(device)))
            return original() if device is None else original(device)

    Generator.__module__, Generator.__qualname__ = "torch", "Generator"
    torch.Generator = Generator


def _names_tpu(device: Any) -> bool:
    return _is_tpu_current() if device is None else torch.device(device).type == "tpu"


def _route_streams_and_events(tpu: Any) -> None:
    """``torch.Stream(device="tpu")`` and ``torch.Event(device="tpu")`` (or with no device: tpu is the
    accelerator) would make torch's generic objects, whose methods do nothing for a Python backend;
    make them ``torch.tpu.Stream``/``torch.tpu.Event``. Other devices get torch's own, unchanged."""
    stream_type, event_type = torch._C.Stream, torch._C.Event
    if torch.Stream is not stream_type:
        return

    class Stream(stream_type, metaclass=_standing_in_for(stream_type)):
        __doc__ = stream_type.__doc__

        def __new__(cls, device: Any = None, *, priority: int = 0, **ids: Any) -> Any:
            if ids:  # stream_id, device_index, device_type: torch re-creating a stream it handed out
                return stream_type(priority=priority, **ids)
            if _names_tpu(device):
                return tpu.Stream(device, priority)
            return stream_type(device, priority=priority)

    class Event(event_type, metaclass=_standing_in_for(event_type)):
        __doc__ = event_type.__doc__

        def __new__(cls, device: Any = None, *, enable_timing: bool = False, blocking: bool = False,
                    interprocess: bool = False) -> Any:
            if _names_tpu(device):
                return tpu.Event(enable_timing, blocking, interprocess,
                                 chip=None if device is None else torch.device(device).index)
            return event_type(device, enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)

    Stream.__module__, Stream.__qualname__ = "torch", "Stream"
    Event.__module__, Event.__qualname__ = "torch", "Event"
    torch.Stream, torch.Event = Stream, Event
