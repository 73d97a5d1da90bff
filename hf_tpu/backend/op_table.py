"""The op table installed as PrivateUse1 kernels: every lowering of the op families (:mod:`ops`) and every
hand-written kernel, registered with torch once, on the device's first op (:mod:`fallback` asks).

Importing :mod:`ops` fills :data:`dispatch.LOWERINGS` and :data:`dispatch.CUSTOM_KERNELS`; this module, above
both, turns them into kernels, so that dispatch (the schema reading every op family uses) imports no op family.
A lowering's kernel is built when its op first runs (:func:`built_on_first_call`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from . import guard, ops  # noqa: F401  (importing the op modules fills LOWERINGS and CUSTOM_KERNELS)
from .dispatch import CUSTOM_KERNELS, LOWERINGS, Lowering, build_kernel, resolve


def built_on_first_call(op: torch._ops.OpOverload, entry: Lowering) -> Callable[..., Any]:
    """The kernel :func:`dispatch.build_kernel` makes of ``entry``, built when ``op`` first runs: a process runs
    few of the table's 1,300 ops, and a built kernel is some 60 objects (its closures' cells, lists, caches)
    that every full collection of Python's garbage collector walks, 85,000 for the whole table, built in a
    quarter of a second of the device's first use."""
    kernel = None

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal kernel
        if kernel is None:  # two threads may both build it: the same kernel, one kept
            kernel = build_kernel(op, entry)
        return kernel(*args, **kwargs)

    run.__name__ = f"tpu_{op.__name__}"
    return run


class Table:
    """Installs the op table as PrivateUse1 kernels, once, on first use of the device."""

    def __init__(self) -> None:
        self.installed: frozenset[str] = frozenset()
        self._libraries: dict[str, torch.library.Library] = {}
        self._lock = threading.Lock()

    def install(self) -> None:
        if self._libraries:
            return
        with self._lock:  # transformers loads weights from several threads at once
            if self._libraries:
                return
            libraries: dict[str, torch.library.Library] = {}
            installed = set()
            kernels = [(name, guard.guarded(fn)) for name, fn in CUSTOM_KERNELS.items()] + [
                # a hand-written kernel serves eager; its lowering, graphs
                (name, built_on_first_call(resolve(name), entry)) for name, entry in LOWERINGS.items()
                if name not in CUSTOM_KERNELS
            ]
            for name, fn in kernels:
                op = resolve(name)
                if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
                    # A backend kernel would replace the decomposition under autograd and lose gradients.
                    raise RuntimeError(f"{op.name()} is CompositeImplicitAutograd: lower what it decomposes into")
                if op.namespace not in libraries:
                    libraries[op.namespace] = torch.library.Library(op.namespace, "IMPL")
                libraries[op.namespace].impl(op, fn, "PrivateUse1")
                installed.add(op.name())
            self.installed = frozenset(installed)
            self._libraries = libraries


TABLE = Table()
