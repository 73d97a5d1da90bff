"""Why graph mode compiles again: ``HF_TPU_LOG_RECOMPILES=1`` logs each recompilation with its reason.

Two things make a new XLA program: Dynamo re-tracing a function whose guards failed (a new Python
value, a new shape it specialized on; Dynamo's own ``recompiles`` log says which guard, and this
switch turns it on), and a lowered graph meeting a new input signature (shapes, dtypes or static
sizes), logged here with the inputs that changed. Also counts programs loaded from the on-disk cache.
"""

from __future__ import annotations

import logging
from typing import Any

from ..backend import runtime

logger = logging.getLogger("hf_tpu.recompiles")

_disk_cache_hits = 0
_listening = False


def enabled() -> bool:
    return runtime.flag("HF_TPU_LOG_RECOMPILES")


def enable_dynamo_log() -> None:
    """Turns on Dynamo's guard-failure log when ``HF_TPU_LOG_RECOMPILES`` is set."""
    if enabled():
        import torch._logging

        torch._logging.set_logs(recompiles=True)


def _describe(old: tuple, new: tuple) -> list[str]:
    (old_static, old_arrays), (new_static, new_arrays) = old, new
    changes = [
        f"size argument {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(old_static, new_static)) if a != b
    ]
    for i, ((old_shape, old_dtype), (new_shape, new_dtype)) in enumerate(zip(old_arrays, new_arrays)):
        if old_shape != new_shape:
            changes.append(f"input {i} shape {tuple(old_shape)} -> {tuple(new_shape)}")
        if old_dtype != new_dtype:
            changes.append(f"input {i} dtype {old_dtype} -> {new_dtype}")
    return changes or ["a new argument pattern (donation or device)"]


def log_retrace(name: str, old: tuple, new: tuple) -> None:
    """Logs that graph ``name`` compiles again because its input signature went from ``old`` to ``new``."""
    if enabled():
        logger.warning("hf_tpu: recompiling %s: %s", name, "; ".join(_describe(old, new)))


def _on_event(event: str, **kwargs: Any) -> None:
    global _disk_cache_hits
    if event == "/jax/compilation_cache/cache_hits":
        _disk_cache_hits += 1


def disk_cache_hits() -> int:
    """Programs JAX has loaded from its persistent compilation cache in this process."""
    global _listening
    if not _listening:
        import jax

        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    return _disk_cache_hits
