"""``HF_TPU_CHECK_TPU_LOWERING``: proof that what runs here is what a TPU would run.

Without TPU chips the device runs on JAX's CPU platform, which accepts programs a TPU cannot run:
64-bit floating point (TPUs have no float64 units), CPU-only operations (the non-symmetric
eigensolver), host callbacks. With this switch on, every program the device builds (eager ops,
view readers and writers, compiled graphs) is also exported for TPU with
``jax.export.export(..., platforms=["tpu"])`` the first time it runs with an input signature:

- ``1``: a program that does not lower for TPU raises :class:`TPULoweringError` at once, naming it;
- ``record:PATH``: each such program is appended to ``PATH`` as a JSON line (``program``, ``reason``)
  and the run goes on, to survey a whole test suite (``tests/test_tpu_lowering.py`` does).
"""

from __future__ import annotations

import json
import os
import re
import threading
import traceback
from typing import Any, Callable

import jax

from . import runtime


class TPULoweringError(RuntimeError):
    """A program the device built would not run on TPU chips."""


def _setting() -> tuple[str, str | None]:
    value = os.environ.get("HF_TPU_CHECK_TPU_LOWERING", "").strip()
    if value.lower().startswith("record:") and len(value) > len("record:"):
        return "record", value[len("record:"):]
    return ("raise" if runtime.flag("HF_TPU_CHECK_TPU_LOWERING") else "off"), None


MODE, RECORD_PATH = _setting()
_checked: set[tuple] = set()
_lock = threading.Lock()
_FLOAT64 = re.compile(r"x(f64|complex<f64>)>|<(f64|complex<f64>)>")


def _signature(args: tuple) -> tuple:
    return tuple((leaf.shape, str(leaf.dtype)) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                 else (type(leaf), leaf)  # a static value, e.g. a DTensor graph's DeviceMesh
                 for leaf in jax.tree_util.tree_leaves(args))


def problem(fn: Callable[..., Any], args: tuple) -> str | None:
    """Why the jitted ``fn`` applied to ``args`` would not run on a TPU (``None`` if it would)."""
    # Traced afresh for the chips (Pallas kernels lowered by Mosaic, not interpreted), and afresh again after,
    # so that this host's own runs do not reuse the chips' trace.
    retrace = getattr(fn, "clear_cache", None) if runtime.backing_platform() != "tpu" else None
    try:
        if retrace is not None:
            retrace()
        with runtime.lowering_for_tpu_chips():
            exported = jax.export.export(fn, platforms=["tpu"])(*args)
    except Exception as error:  # noqa: BLE001 (every reason a lowering fails is what we report)
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    finally:
        if retrace is not None:
            retrace()
    if _FLOAT64.search(exported.mlir_module()):
        return "uses 64-bit floating point (float64/complex128), which TPU chips do not have"
    return None


def check(name: str, fn: Callable[..., Any], args: tuple) -> None:
    """Exports ``fn(*args)`` for TPU once per (program, input signature); raises or records a failure."""
    key = (name, id(fn), _signature(args))
    if key in _checked:
        return
    with _lock:
        _checked.add(key)
    reason = problem(fn, args)
    if reason is None:
        return
    if MODE == "record":
        entry = {"program": name, "reason": reason, "origin": _origin()}
        with _lock, open(RECORD_PATH, "a") as record:
            record.write(json.dumps(entry) + "\n")
        return
    raise TPULoweringError(f"{name}: this program does not lower for TPU chips: {reason}")


def _origin() -> str:
    """The innermost caller outside torch, JAX and hf_tpu: the library or test line that ran the program."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        if not any(part in path for part in ("/hf_tpu/", "/torch/", "/jax/", "/jaxlib/", "<frozen")):
            library = path.split("site-packages/")[-1]
            return f"{library.split('/tests/')[-1]}:{frame.lineno}"
    return "?"


def checked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a jitted function), checked for TPU on each new input signature when the switch is on
    (after it ran: an input the op itself rejects raises its own error first)."""
    if MODE == "off":
        return fn

    def run(*args: Any) -> Any:
        result = fn(*args)
        check(name, fn, args)
        return result

    run.__wrapped__ = fn  # fused eager mode checks it when it records it, and runs it inside a chain's program
    return run
