"""Hooks into the Hugging Face libraries, applied when (and only if) a library is imported.

``import torch`` must stay fast, so nothing here imports transformers, diffusers or accelerate.
:func:`when_imported` runs a callback right after a module finishes importing (or at once if it
already has); each integration module registers its patches that way from :func:`install`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Any, Callable

_pending: dict[str, list[Callable[[Any], None]]] = {}
_lock = threading.RLock()

# module name -> integration module (in this package) whose ``install(module)`` patches it
INTEGRATIONS: dict[str, str] = {
    "transformers.generation.utils": "generation",
    "accelerate.utils.modeling": "accelerate",  # not "accelerate": its __init__ imports torch first
    "transformers": "transformers",
    # not "transformers": by then transformers.utils has bound is_kernels_available
    "transformers.utils.import_utils": "hub_kernels",
    "diffusers.utils.torch_utils": "diffusers",
    "torch._inductor": "inductor",  # ahead-of-time compilation: tpu programs go to hf_tpu.export
    "torch._dynamo": "dynamo",  # torch's caching precompile for HF models
    "safetensors": "safetensors",
    "kernels": "kernels",  # the Hugging Face kernels library (not hf_tpu.kernels)
}


def _initializing(module: Any) -> bool:
    """Whether ``module`` is still executing (it imported torch, say, before defining what it patches)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of a watched module so that its callbacks run after it executes; runs the
    callbacks of modules found half-imported once they are complete (at the next import)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if _half_imported:
            _run_completed()
        if fullname not in _pending:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _run_callbacks(module.__name__)


_finder = _Finder()
_half_imported: set[str] = set()


def _run_completed() -> None:
    with _lock:
        done = [name for name in _half_imported if not _initializing(sys.modules.get(name))]
        _half_imported.difference_update(done)
    for name in done:
        if name in sys.modules:
            _run_callbacks(name)


def _run_callbacks(name: str) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
    for callback in callbacks:
        callback(sys.modules[name])


def when_imported(name: str, callback: Callable[[Any], None]) -> None:
    """Calls ``callback(module)`` once module ``name`` is imported: now if it already is, else right
    after its import finishes. Exceptions raised by the callback propagate to the importer."""
    with _lock:
        if name not in sys.modules or _initializing(sys.modules[name]):
            _pending.setdefault(name, []).append(callback)
            if name in sys.modules:
                _half_imported.add(name)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    callback(sys.modules[name])


def install() -> None:
    """Registers every integration of :data:`INTEGRATIONS` to run when its library is imported."""
    import importlib

    for module_name, integration in INTEGRATIONS.items():
        when_imported(module_name, importlib.import_module(f"{__name__}.{integration}").install)
