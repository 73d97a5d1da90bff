"""Python's garbage collector kept to the new objects while Dynamo compiles, or while a bounded piece of work runs
(:func:`kept_to_new_objects`), in a process using the tpu device.

Dynamo's tracing allocates millions of short-lived objects, so the cyclic collector runs hundreds of times during
a compile, and each older-generation collection walks every object of the process: torch, JAX, transformers and
the model hold about 600,000. A tiny Llama's first compiled call spent about half a second of its 2-3 s in the
collector (``benchmarks/warm_start.py``). While a frame compiles, the objects that existed before it are frozen
(:func:`gc.freeze`: moved to the permanent generation, which no collection walks) and unfrozen when it ends
(:func:`gc.unfreeze`: back to the oldest generation): collections during the compile walk only what it made, and
garbage that existed before is collected at the next full collection after it instead.

Registered with Dynamo's compile callbacks (``torch._dynamo.callback``: start and end of each frame's compile,
the end one also when the compile fails), only where the tpu device has run an op, and never where the process
froze objects itself (a server freezing its start-up heap: its frozen objects are left as they are).
``torch._dynamo.reset()`` clears Dynamo's callbacks; graph mode registers them again at its next graph.

:func:`kept_to_new_objects` does the same around a call that ends with a full collection of its own:
transformers' ``generate_batch`` collects when it stops its manager, to release what the batch used, and in a
process using tpu (about 1.8 times a CPU process's objects) that walk took 0.4 s of a 1.5 s call.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from typing import Any, Iterator

_holder: object | None = None
"""Who froze the heap: a compile (:data:`_COMPILE`) or a :func:`kept_to_new_objects` block; only it unfreezes it."""
_COMPILE = object()
_lock = threading.Lock()


def register() -> None:
    """Registers the callbacks with Dynamo if they are not (Dynamo imported: a graph is being compiled)."""
    callback = sys.modules.get("torch._dynamo.callback")
    if callback is not None and _freeze not in callback.callback_handler.start_callbacks:
        callback.on_compile_start(_freeze)
        callback.on_compile_end(_unfreeze)


def _freeze_for(holder: object) -> None:
    global _holder
    op_table = sys.modules.get("hf_tpu.backend.op_table")  # not imported: the device has run no op yet
    with _lock:
        if _holder is None and op_table is not None and op_table.TABLE.installed and gc.isenabled() \
                and gc.get_freeze_count() == 0:
            gc.freeze()
            _holder = holder


def _unfreeze_for(holder: object) -> None:
    global _holder
    with _lock:
        if _holder is holder:
            _holder = None
            gc.unfreeze()


def _freeze(args: Any) -> None:
    _freeze_for(_COMPILE)


def _unfreeze(args: Any) -> None:
    _unfreeze_for(_COMPILE)


@contextlib.contextmanager
def kept_to_new_objects() -> Iterator[None]:
    """Collections inside the block walk only the objects made inside it, as a compile's do (the objects that
    existed before are frozen, unless they already are, and unfrozen at its end; a compile inside it leaves them
    frozen). For bounded work only: garbage from before the block is left until the first full collection after
    it."""
    block = object()
    _freeze_for(block)
    try:
        yield
    finally:
        _unfreeze_for(block)
