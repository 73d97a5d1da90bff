"""``torch_tpu._internal.pallas.jax_op`` without TorchTPU: the import path Hub kernels written for TorchTPU use.

A finder at the end of ``sys.meta_path`` provides ``torch_tpu``, ``torch_tpu._internal`` and
``torch_tpu._internal.pallas`` (and its ``pallas`` module) only when no other finder has them, so a real
TorchTPU install always wins. The top module exposes nothing but ``_internal``, and no distribution metadata
exists for it, so version checks (diffusers' ``_is_package_available``) still see no TorchTPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_PACKAGES = ("torch_tpu", "torch_tpu._internal", "torch_tpu._internal.pallas")
_MODULES = _PACKAGES + ("torch_tpu._internal.pallas.pallas",)
_DOC = "hf_tpu's stand-in for TorchTPU's {} (only jax_op); install torch_tpu for the real one."


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _MODULES:
            return None
        # Submodules only under this shim's torch_tpu: a real one lacking them gets no graft.
        top = sys.modules.get("torch_tpu")
        if fullname != "torch_tpu" and getattr(getattr(top, "__spec__", None), "loader", None) is not self:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in _PACKAGES)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        module.__doc__ = _DOC.format(module.__name__)
        if module.__name__.startswith("torch_tpu._internal.pallas"):
            from .jax_interop import jax_op

            module.jax_op = jax_op
            module.__all__ = ["jax_op"]


_finder = _Finder()


def install() -> None:
    """Appends the finder (last, after the path finder that would find a real torch_tpu); idempotent."""
    if _finder not in sys.meta_path:
        sys.meta_path.append(_finder)
