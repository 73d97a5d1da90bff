"""Makes ``tpu`` a PyTorch device: PrivateUse1 renamed, hooks, guard, ``torch.tpu``, patches.

Everything here is cheap and JAX-free, so it can run during ``import torch`` (autoload). The op
table and JAX are loaded by the PrivateUse1 fallback on the first tpu op.
"""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Any

import torch

_lock = threading.Lock()
_registered = False


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


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
        from .. import compile as graph_mode
        from .. import integrations
        from . import autocast, device_module, fallback

        if name != "tpu":
            torch.utils.rename_privateuse1_backend("tpu")
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
        torch._register_device_module("tpu", device_module)
        torch._C._acc.register_python_privateuseone_hook(_Hooks())
        torch._C._acc.register_python_privateuseone_device_guard(_Guard())
        fallback.install()
        autocast.install()
        _install_backends_flag()
        _patch_accelerator(device_module)
        _patch_module_conversion()
        _patch_storage_constructor()
        _install_host_pinning()
        _guard_autograd_devices()
        _explain_device_generators()
        integrations.install()
        graph_mode.install()
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
    """torch's pure-Python PrivateUse1 path leaves these raising; route them to ``torch.tpu``."""
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
    }
    for namespace in (torch.accelerator, torch.accelerator.memory):
        for name, replacement in replacements.items():
            original = getattr(namespace, name, None)
            if original is not None and not hasattr(original, "__wrapped__"):
                setattr(namespace, name, _delegating(original, replacement))


_module_to = torch.nn.Module.to
_module_cpu = torch.nn.Module.cpu


def _holds_tpu_tensors(module: torch.nn.Module) -> bool:
    return any(t.device.type == "tpu" for t in module.parameters()) or any(
        t.device.type == "tpu" for t in module.buffers()
    )


@contextlib.contextmanager
def _swap_params_on_conversion():
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    torch.utils.swap_tensors = _swap_keeping_attributes
    try:
        yield
    finally:
        torch.utils.swap_tensors = _swap_tensors
        torch.__future__.set_swap_module_params_on_conversion(previous)


_swap_tensors = torch.utils.swap_tensors


def _swap_keeping_attributes(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``Module._apply`` swaps each parameter with a fresh Parameter holding the moved data, which would
    drop the parameter's Python attributes (``param.data = ...`` keeps them on CUDA): carry them over."""
    for name, value in vars(t1).items():
        vars(t2).setdefault(name, value)
    _swap_tensors(t1, t2)


def _patch_module_conversion() -> None:
    """Moving a module to or from tpu swaps parameter contents in place, so they stay
    ``nn.Parameter`` objects and tied weights (``lm_head``/``embed_tokens``) stay tied."""

    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if (device is not None and device.type == "tpu") or _holds_tpu_tensors(self):
            with _swap_params_on_conversion():
                return _module_to(self, *args, **kwargs)
        return _module_to(self, *args, **kwargs)

    def cpu(self: torch.nn.Module) -> torch.nn.Module:
        if _holds_tpu_tensors(self):
            with _swap_params_on_conversion():
                return _module_cpu(self)
        return _module_cpu(self)

    def tpu(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        return to(self, torch.device("tpu", device) if isinstance(device, int) else device or "tpu")

    to.__doc__ = _module_to.__doc__
    torch.nn.Module.to = to
    torch.nn.Module.cpu = cpu
    torch.nn.Module.tpu = tpu


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


_pinning_library: list[torch.library.Library] = []


def _install_host_pinning() -> None:
    """``Tensor.pin_memory()`` (DataLoader(pin_memory=True), the Trainer's default) asks the PrivateUse1
    hooks for a pinned allocator, which a Python backend cannot provide. JAX stages host transfers itself,
    so "pinning" for tpu is a plain host copy with the same strides."""

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride(), dtype=self.dtype).copy_(self)

    library = torch.library.Library("aten", "IMPL")
    library.impl("_pin_memory", pin_memory, "CPU")
    _pinning_library.append(library)


def _check_autograd_roots(tensors: Any) -> None:
    roots = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    for tensor in roots or ():
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "tpu" and tensor.device.index:
            raise RuntimeError(
                f"backward through tensors on {tensor.device} is not supported: torch's Python device guard "
                "reports a single device, so the autograd engine only runs on tpu:0. Run one process per "
                "chip (each process's chip is then tpu:0), as TorchTPU and the Hugging Face libraries do."
            )


def _guard_autograd_devices() -> None:
    """The engine would fail an internal assert on ``tpu:k`` (k > 0); say why instead."""
    backward, grad = torch.autograd.backward, torch.autograd.grad

    def checked_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        _check_autograd_roots(tensors)
        return backward(tensors, *args, **kwargs)

    def checked_grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        _check_autograd_roots(outputs)
        return grad(outputs, *args, **kwargs)

    checked_backward.__doc__, checked_grad.__doc__ = backward.__doc__, grad.__doc__
    checked_backward.__wrapped__, checked_grad.__wrapped__ = backward, grad
    torch.autograd.backward, torch.autograd.grad = checked_backward, checked_grad


_GENERATOR_MESSAGE = (
    "torch.Generator(device={device!r}) is not supported: PyTorch creates device generators only for C++ backends. "
    "Pass a CPU generator instead, e.g. torch.Generator().manual_seed(0) (diffusers' randn_tensor and "
    "transformers sample with it and move the numbers to tpu), or seed the device's own stream with "
    "torch.manual_seed(0)."
)


def _explain_device_generators() -> None:
    """``torch.Generator(device="tpu")`` fails with torch's note to C++ backend authors; make it say
    what to do instead. Other devices get torch's own generator, unchanged."""
    original = torch._C.Generator
    if torch.Generator is not original:
        return

    class GeneratorType(type(original)):
        """Keeps ``isinstance(g, torch.Generator)`` true for every generator torch makes."""

        def __instancecheck__(cls, instance: Any) -> bool:
            return isinstance(instance, original)

        def __subclasscheck__(cls, subclass: type) -> bool:
            return issubclass(subclass, original)

    class Generator(original, metaclass=GeneratorType):
        __doc__ = original.__doc__

        def __new__(cls, device: Any = None) -> Any:
            if device is not None and torch.device(device).type == "tpu":
                raise RuntimeError(_GENERATOR_MESSAGE.format(device=str(device)))
            return original() if device is None else original(device)

    Generator.__module__, Generator.__qualname__ = "torch", "Generator"
    torch.Generator = Generator
