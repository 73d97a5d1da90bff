"""Python's garbage collector kept to the new objects while Dynamo compiles, in a process using the tpu device.

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
"""

from __future__ import annotations

import gc
import sys
from typing import Any

_frozen_here = False


def register() -> None:
    """Registers the callbacks with Dynamo if they are not (Dynamo imported: a graph is being compiled)."""
    callback = sys.modules.get("torch._dynamo.callback")
    if callback is not None and _freeze not in callback.callback_handler.start_callbacks:
        callback.on_compile_start(_freeze)
        callback.on_compile_end(_unfreeze)


def _freeze(args: Any) -> None:
    global _frozen_here
    op_table = sys.modules.get("hf_tpu.backend.op_table")  # not imported: the device has run no op yet

    if op_table is not None and op_table.TABLE.installed and gc.isenabled() and gc.get_freeze_count() == 0:
        gc.freeze()
        _frozen_here = True


def _unfreeze(args: Any) -> None:
    global _frozen_here
    if _frozen_here:
        _frozen_here = False
        gc.unfreeze()
