"""Entry point for torch's device-backend autoload (group ``torch.backends``).

Runs at the end of ``import torch``. It must never make ``import torch`` fail: on any error it
warns and leaves the device unregistered. Set ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to skip it.
"""


def load() -> None:
    try:
        from .backend import register

        register()
    except Exception as error:  # noqa: BLE001  (any failure must not break `import torch`)
        import warnings

        warnings.warn(f"hf_tpu: the 'tpu' device was not registered: {error!r}", RuntimeWarning, stacklevel=2)
