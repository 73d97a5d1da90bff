"""Byte counts of live device buffers, per device: what ``torch.tpu.memory_allocated`` reports."""

from __future__ import annotations

import threading
from collections import defaultdict

_lock = threading.Lock()
_current: defaultdict[int, int] = defaultdict(int)
_peak: defaultdict[int, int] = defaultdict(int)
_allocations: defaultdict[int, int] = defaultdict(int)
_frees: defaultdict[int, int] = defaultdict(int)


def allocated(device_index: int, nbytes: int) -> None:
    with _lock:
        _current[device_index] += nbytes
        _allocations[device_index] += 1
        if _current[device_index] > _peak[device_index]:
            _peak[device_index] = _current[device_index]


def freed(device_index: int, nbytes: int) -> None:
    with _lock:
        _current[device_index] -= nbytes
        _frees[device_index] += 1


def current(device_index: int) -> int:
    return _current[device_index]


def peak(device_index: int) -> int:
    return _peak[device_index]


def reset_peak(device_index: int) -> None:
    with _lock:
        _peak[device_index] = _current[device_index]


def stats(device_index: int) -> dict[str, int]:
    return {
        "allocated_bytes.all.current": _current[device_index],
        "allocated_bytes.all.peak": _peak[device_index],
        "allocation.all.allocated": _allocations[device_index],
        "allocation.all.freed": _frees[device_index],
        "active_bytes.all.current": _current[device_index],
        "reserved_bytes.all.current": _current[device_index],
    }
