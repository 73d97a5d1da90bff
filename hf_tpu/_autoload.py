"""Entry point for torch's device-backend autoload (group ``torch.backends``).

Runs at the end of ``import torch``. It must never make ``import torch`` fail: on any error it
warns and leaves the device unregistered. Set ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to skip it.

On a machine with NVIDIA GPUs it registers nothing unless ``HF_TPU_PLATFORM`` is set: torch's autograd
engine follows one accelerator, PrivateUse1 once it is registered, and then fails an internal assert on
every CUDA backward (pytorch/pytorch#161129). There ``import hf_tpu`` (or ``hf_tpu.register()``) turns
the device on, for processes that use tpu.
"""

from __future__ import annotations

import os
import sys


def load() -> None:
    """torch's autoload: registers the device, unless CUDA keeps the process (see the module docstring)."""
    package = sys.modules.get("hf_tpu")
    if package is not None and not hasattr(package, "register"):
        return  # `import hf_tpu` is importing torch: the package registers the device once its import ends
    if _cuda_keeps_the_process():
        for name in [name for name in sys.modules if name == "hf_tpu" or name.startswith("hf_tpu.")]:
            del sys.modules[name]  # so that a later `import hf_tpu` runs its registration
        return
    register_or_warn()


def register_or_warn() -> None:
    try:
        from .registration import register

        register()
    except Exception as error:  # noqa: BLE001  (any failure must not break `import torch`)
        import warnings

        warnings.warn(f"hf_tpu: the 'tpu' device was not registered: {error!r}", RuntimeWarning, stacklevel=2)


def imported_by_torch_autoload() -> bool:
    """Whether this import runs inside torch's ``_import_device_backends`` (then torch calls :func:`load`)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_import_device_backends":
            return True
        frame = frame.f_back
    return False


def _cuda_keeps_the_process() -> bool:
    if os.environ.get("HF_TPU_PLATFORM", "").strip().lower() not in ("", "auto"):
        return False
    import torch

    if not torch.backends.cuda.is_built():
        return False
    try:
        count = torch.cuda._device_count_nvml()  # NVML: no CUDA context, so a later fork stays safe
    except Exception:  # noqa: BLE001  (a private helper of torch's: if it moved, ask CUDA)
        count = -1
    return count > 0 if count >= 0 else torch.cuda.is_available()
