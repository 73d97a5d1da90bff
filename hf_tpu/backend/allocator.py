"""Bookkeeping of device memory: fake storage addresses and live byte counts per chip.

Every tpu storage gets a fresh, never reused address range (so ``data_ptr()`` identifies storages
as on CUDA); its bytes count as allocated from the moment its buffer holds an array until it dies. A
storage spread over several chips (a sharded tensor) counts each chip's shard on that chip.
These counts are what ``torch.tpu.memory_allocated`` and friends report.
"""

from __future__ import annotations

import threading
from collections import defaultdict

_ALIGNMENT = 256
# More than any chip or host holds: refused at once, so that a huge request cannot use up the address space.
LARGEST_ALLOCATION = 1 << 50
_lock = threading.Lock()
_next_address = 1 << 44
_current: defaultdict[int, int] = defaultdict(int)
_peak: defaultdict[int, int] = defaultdict(int)
_allocations: defaultdict[int, int] = defaultdict(int)
_frees: defaultdict[int, int] = defaultdict(int)


def new_address(nbytes: int, device_index: int, materialized: bool) -> int:
    """A fresh address range for a new storage; counts its bytes now if it already holds data."""
    global _next_address
    if nbytes > LARGEST_ALLOCATION:
        from .out_of_memory import too_large_error

        raise too_large_error(nbytes, device_index)
    with _lock:
        address = _next_address
        _next_address = address + (-(-nbytes // _ALIGNMENT) or 1) * _ALIGNMENT
        if materialized:
            _count(device_index, nbytes)
    return address


def allocated(device_index: int, nbytes: int) -> None:
    allocated_shards(((device_index, nbytes),))


def allocated_shards(shards: tuple[tuple[int, int], ...]) -> None:
    """Counts a storage's bytes: ``(chip, bytes)`` for each chip it lives on (one, or each of a sharded one's)."""
    with _lock:
        for device_index, nbytes in shards:
            _count(device_index, nbytes)


def _count(device_index: int, nbytes: int) -> None:
    current = _current[device_index] = _current[device_index] + nbytes
    _allocations[device_index] += 1
    if current > _peak[device_index]:
        _peak[device_index] = current


def freed(device_index: int, nbytes: int) -> None:
    with _lock:
        _current[device_index] -= nbytes
        _frees[device_index] += 1


def freed_shards(shards: tuple[tuple[int, int], ...]) -> None:
    for device_index, nbytes in shards:
        freed(device_index, nbytes)


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
