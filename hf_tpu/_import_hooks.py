"""Callbacks run when a module finishes importing: how hf_tpu patches a library only if, and once, it is used.

``import torch`` must stay fast, so hf_tpu imports none of the libraries it adapts: :func:`when_imported`
runs a callback right after a module finishes importing (or at once if it already has). This module imports
nothing of hf_tpu, so that every layer (graph mode, the integrations) may use it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Any, Callable

_pending: dict[str, list[Callable[[Any], None]]] = {}
_lock = threading.RLock()


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
