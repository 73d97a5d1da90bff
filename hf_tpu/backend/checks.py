"""Checked indices and integer division: the CPU's error, raised at the next host sync as on CUDA.

XLA clamps an out-of-range gather index and defines integer division by zero; PyTorch raises. A
lowering states what must hold with :func:`require` (or the helpers below): the condition is
computed inside the op's own program, next to its result, and comes out of it as one small array
``[code, value]`` (0 when every condition held; otherwise the first failed condition's message code
and the offending value). The kernel hands that array to :func:`defer` without waiting for it; the
next host sync (``.item()``, ``.cpu()``, printing, ``torch.tpu.synchronize()``) reads the pending
arrays and raises the first failure with the CPU's exception type and message, as CUDA reports a
device-side assert at its next sync. A compiled graph carries one combined check for its whole
program.

``HF_TPU_CHECKS`` chooses: ``1`` (default) as above, ``immediate`` (each failing op raises at once,
at the cost of a sync per checked op: the error points at the line that ran it), ``0`` (no checks:
XLA's clamping, for those who want every last microsecond).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from . import runtime


MODE = runtime.checks_mode()  # part of every program's cache key: programs are traced per mode


def mode() -> str:
    """``deferred``, ``immediate`` or ``off`` (``HF_TPU_CHECKS``, or :func:`set_mode`)."""
    return MODE


def set_mode(value: str) -> None:
    """Switches checks for the programs run from now on: ``"deferred"``, ``"immediate"`` or ``"off"``."""
    global MODE
    if value not in ("deferred", "immediate", "off"):
        raise ValueError(f"checks mode {value!r} is not one of 'deferred', 'immediate', 'off'")
    raise_pending()
    MODE = value


# Message templates, numbered from 1 in order of first use; code 0 means "nothing failed".
_messages: list[tuple[type, str]] = [(RuntimeError, "")]
_codes: dict[tuple[type, str], int] = {}
_messages_lock = threading.Lock()


def code(error: type, message: str) -> int:
    """The code of a message template (numbered in this process at first use)."""
    key = (error, message)
    number = _codes.get(key)
    if number is None:
        with _messages_lock:
            number = _codes.get(key)
            if number is None:
                number = _codes[key] = len(_messages)
                _messages.append(key)
    return number


def messages() -> tuple[tuple[type, str], ...]:
    """Every message template by code (code 0: nothing failed), as this process's programs number them."""
    return tuple(_messages)


_tracing = threading.local()


def require(ok: Any, error: type, message: str, value: Any = 0) -> None:
    """Inside a lowering: ``ok`` (a traced boolean) must hold, or ``error(message)`` is raised at the next
    sync; ``{}`` in ``message`` becomes ``value`` (a traced integer, e.g. the offending index)."""
    collected = getattr(_tracing, "collected", None)
    if collected is not None:
        collected.append((ok, code(error, message), value))


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    """While a program is traced: collects the conditions its lowerings :func:`require`."""
    outer = getattr(_tracing, "collected", None)
    collected: list = [] if MODE != "off" else None
    _tracing.collected = collected
    try:
        yield collected
    finally:
        _tracing.collected = outer


def combined(collected: list | None) -> Any:
    """Traced: ``[code, value]`` of the first condition that failed, ``[0, 0]`` if none; ``None`` if none
    were collected (the program then has no check output)."""
    if not collected:
        return None
    code, value = jnp.zeros((), jnp.int64), jnp.zeros((), jnp.int64)
    for ok, condition_code, condition_value in reversed(collected):
        failed = jnp.logical_not(ok)
        code = jnp.where(failed, condition_code, code)
        value = jnp.where(failed, jnp.asarray(condition_value).astype(jnp.int64), value)
    return jnp.stack([code, value])


_pending: dict[int, list[Any]] = {}  # device index -> check arrays not read yet
_pending_lock = threading.Lock()
_MERGE_AT = 64  # a device's pending checks are merged into one there, so a loop without syncs holds few


def defer(check: Any, device_index: int) -> None:
    """After a checked program ran on ``tpu:device_index``: its check array, read at the next sync (or
    now, in immediate mode)."""
    if MODE == "immediate":
        _raise_for(np.asarray(check))
        return
    checks = _pending.get(device_index)
    if checks is None:
        with _pending_lock:
            checks = _pending.setdefault(device_index, [])
    checks.append(check)
    if len(checks) >= _MERGE_AT:
        with _pending_lock:
            if len(checks) >= _MERGE_AT:
                checks[:] = [_first_failure(tuple(checks))]


@jax.jit
def _first_failure(checks: tuple) -> Any:
    stacked = jnp.stack(checks)
    return stacked[jnp.argmax(stacked[:, 0] != 0)]


flush_recorded: Callable[[], None] | None = None  # set by fused.py: runs the ops fused eager mode recorded


def raise_pending() -> None:
    """At a host sync: raises the first failed check since the last sync (and forgets the others), after
    running what fused eager mode recorded (its checks are computed then)."""
    if flush_recorded is not None:
        flush_recorded()
    if not any(_pending.values()):
        return
    with _pending_lock:
        taken = [check for checks in _pending.values() for check in checks]
        for checks in _pending.values():
            checks.clear()
    for check in taken:
        _raise_for(np.asarray(check))


def _raise_for(check: np.ndarray) -> None:
    code = int(check[0])
    if code:
        error, message = _messages[code]
        raise error(message.format(int(check[1])))


# --- conditions lowerings state -------------------------------------------------------------------------


def indices_in_range(index: Any, size: int, error: type, message: str, negative: bool = True) -> None:
    """Every element of ``index`` addresses one of ``size`` positions: ``0 <= i < size``, or from
    ``-size`` with ``negative`` (counting from the end). ``{}`` in ``message`` is the first bad index."""
    if index.size == 0 or getattr(_tracing, "collected", None) is None:
        return
    flat = index.reshape(-1)
    count = flat.shape[0]
    bad = (flat >= size) | (flat < (-size if negative else 0))
    # one reduction (the first bad position, ``count`` if none) and one element read: XLA's CPU
    # runtime pays per kernel, and this is ~3 µs where any() plus argmax() cost ~13 µs
    first = jnp.min(jnp.where(bad, jax.lax.iota(jnp.int32, count), count))
    require(first == count, error, message, flat[jnp.minimum(first, count - 1)])


def out_of_bounds(dim: int, size: int) -> str:
    """The CPU's message for an index past a dimension's size (``{}``: the index)."""
    return f"index {{}} is out of bounds for dimension {dim} with size {size}"


def nonzero_divisor(divisor: Any, dtype: Any) -> None:
    """Integer division and remainder by zero raise ``RuntimeError: ZeroDivisionError`` on the CPU."""
    if getattr(_tracing, "collected", None) is None or not jnp.issubdtype(dtype, jnp.integer):
        return
    if isinstance(divisor, (int, np.integer)):  # a static Python divisor: no program output needed
        if divisor == 0:
            require(jnp.asarray(False), RuntimeError, "ZeroDivisionError")
        return
    require(jnp.all(jnp.asarray(divisor) != 0), RuntimeError, "ZeroDivisionError")
