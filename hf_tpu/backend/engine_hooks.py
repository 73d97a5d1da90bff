"""What torch's C++ core calls back into for the ``tpu`` device: PrivateUse1 hooks, the device guard,
and checks around the autograd engine.

torch's C++ device guard for Python backends answers every question itself except the device type,
which it asks :meth:`DeviceGuard.type_`. It does so from ``noexcept`` stream-guard destructors too,
including while a Python exception raised by an autograd hook is still pending (torch's hook wrappers
throw without fetching it first): the call would then fail, and a failure there is ``std::terminate``,
an abort of the whole process. ``type_`` therefore takes such a pending exception off the thread and
keeps it; the engine then reports "returned NULL without setting an exception", which
:func:`_raise_kept_errors` replaces with the kept exception on the thread that called backward.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

import torch

_PRIVATE_USE1 = torch._C._autograd.DeviceType.PrivateUse1

# Raises the thread's pending exception, if any (ctypes checks the error indicator after a
# pythonapi call); costs ~0.2 µs.
_raise_pending = ctypes.pythonapi.PyErr_Occurred
_raise_pending.restype = ctypes.c_void_p
_raise_pending.argtypes = ()

backward_ended: Callable[[], None] = lambda: None
"""Called when a backward pass ends: fused eager mode runs the ops recorded then (``fused.flush``, set when the
backend's ops are loaded), so that the gradients are computed while the host records what reads them (an
optimizer's step), not after it."""

_kept_lock = threading.Lock()
_kept: list[BaseException] = []  # at most one: the newest exception taken off a thread


class Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self) -> Any:
        try:
            _raise_pending()
        except BaseException as error:  # an autograd hook's exception, about to be lost: keep it
            with _kept_lock:
                _kept[:] = [error]
        return _PRIVATE_USE1


def _lost_error(error: SystemError) -> bool:
    return "without setting an exception" in str(error)


def _raise_kept_errors(run: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps an autograd entry point so that an exception kept by :class:`DeviceGuard` is raised
    instead of the SystemError the engine reports when it finds the error indicator empty."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except SystemError as error:
            with _kept_lock:
                kept = _kept.pop() if _kept and _lost_error(error) else None
            if kept is None:
                raise
            raise kept.with_traceback(kept.__traceback__) from None

    return call


def _check_autograd_roots(tensors: Any) -> None:
    roots = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    for tensor in roots or ():
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
            raise RuntimeError(
                "backward through cuda tensors cannot run in a process where the tpu device is registered: torch's "
                "autograd engine follows one accelerator, PrivateUse1 once it is registered, and fails an internal "
                "assert on CUDA nodes (pytorch/pytorch#161129). Train on cuda in a process that does not import "
                "hf_tpu (on a machine with NVIDIA GPUs `import torch` leaves it off unless HF_TPU_PLATFORM is set)."
            )
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "tpu" and tensor.device.index:
            raise RuntimeError(
                f"backward through tensors on {tensor.device} is not supported: torch's Python device guard "
                "reports a single device, so the autograd engine only runs on tpu:0. Run one process per "
                "chip (each process's chip is then tpu:0), as TorchTPU and the Hugging Face libraries do."
            )


def _wrap_autograd_entry_points() -> None:
    """``backward``/``grad`` on ``tpu:k`` (k > 0) or on cuda would fail an internal assert of the engine: say why
    instead; raise hook exceptions that the device guard kept (see the module docstring); and call
    :data:`backward_ended` when a backward pass ends."""
    backward, grad = torch.autograd.backward, torch.autograd.grad
    checked_run_backward = _raise_kept_errors(backward)
    checked_run_grad = _raise_kept_errors(grad)

    def checked_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        _check_autograd_roots(tensors)
        result = checked_run_backward(tensors, *args, **kwargs)
        backward_ended()
        return result

    def checked_grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        _check_autograd_roots(outputs)
        result = checked_run_grad(outputs, *args, **kwargs)
        backward_ended()
        return result

    checked_backward.__doc__, checked_grad.__doc__ = backward.__doc__, grad.__doc__
    checked_backward.__wrapped__, checked_grad.__wrapped__ = backward, grad
    torch.autograd.backward, torch.autograd.grad = checked_backward, checked_grad


def install() -> None:
    torch._C._acc.register_python_privateuseone_hook(Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(DeviceGuard())
    _wrap_autograd_entry_points()
