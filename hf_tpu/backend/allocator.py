"""Bookkeeping of device memory: fake storage addresses and live byte counts per chip.

Every tpu storage gets a fresh, never reused address range (so ``data_ptr()`` identifies storages
as on CUDA); its bytes count as allocated from the moment its buffer holds an array until it dies. A
storage spread over several chips (a sharded tensor) counts each chip's shard on that chip.
These counts are what ``torch.tpu.memory_allocated`` and friends report.

A storage of up to :data:`SLOT` bytes (nearly every one an eager op makes) takes the next slot of that size
from a counter, without a lock (``next`` on an ``itertools.count`` is atomic); a larger one takes its own size
from a second region, under the lock. The slots start at ``2**62``: at a hundred thousand storages a second
they last more than a year.
"""

from __future__ import annotations

import itertools
import threading

SLOT = 1 << 20
_ALIGNMENT = 256
# More than any chip or host holds: refused at once, so that a huge request cannot use up the address space.
LARGEST_ALLOCATION = 1 << 50
_lock = threading.Lock()
_slots = itertools.count(1 << 42)  # slot n is at n * SLOT: from 2**62 on
_next_large = 1 << 44


class _Chip:
    """One chip's counts, in bytes and storages."""

    __slots__ = ("current", "peak", "allocations", "frees", "in_place_copies", "out_of_memory")

    def __init__(self) -> None:
        self.current = self.peak = self.allocations = self.frees = self.in_place_copies = self.out_of_memory = 0


class _Chips(dict):
    def __missing__(self, device_index: int) -> _Chip:
        with _lock:
            return self.setdefault(device_index, _Chip())


_chips = _Chips()


def new_address(nbytes: int, device_index: int, materialized: bool) -> int:
    """A fresh address range for a new storage; counts its bytes now if it already holds data."""
    if nbytes <= SLOT:
        address = next(_slots) * SLOT
    else:
        address = _large_address(nbytes)
    if materialized:
        allocated(device_index, nbytes)
    return address


class TooLarge(RuntimeError):
    """A request larger than any chip holds, refused before XLA tries (the op's kernel raises it as
    ``torch.OutOfMemoryError``: :func:`hf_tpu.backend.out_of_memory.raise_if_out_of_memory`)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"RESOURCE_EXHAUSTED: Out of memory allocating {nbytes} bytes.")


def _large_address(nbytes: int) -> int:
    global _next_large
    if nbytes > LARGEST_ALLOCATION:
        raise TooLarge(nbytes)
    with _lock:
        address = _next_large
        _next_large = address + -(-nbytes // _ALIGNMENT) * _ALIGNMENT
    return address


def allocated(device_index: int, nbytes: int) -> None:
    chip = _chips[device_index]
    with _lock:
        current = chip.current = chip.current + nbytes
        chip.allocations += 1
        if current > chip.peak:
            chip.peak = current


def allocated_shards(shards: tuple[tuple[int, int], ...]) -> None:
    """Counts a storage's bytes: ``(chip, bytes)`` for each chip it lives on (one, or each of a sharded one's)."""
    for device_index, nbytes in shards:
        allocated(device_index, nbytes)


def freed(device_index: int, nbytes: int) -> None:
    chip = _chips[device_index]
    with _lock:
        chip.current -= nbytes
        chip.frees += 1


def freed_shards(shards: tuple[tuple[int, int], ...]) -> None:
    for device_index, nbytes in shards:
        freed(device_index, nbytes)


def copied_in_place(device_index: int) -> None:
    """Counts an in-place update that could not give its old array to XLA (a view of it, another storage or a JAX
    array held it): for a moment the chip held the tensor twice."""
    _chips[device_index].in_place_copies += 1


def ran_out(device_index: int) -> None:
    """Counts a ``torch.OutOfMemoryError`` raised for the chip (``num_ooms``)."""
    _chips[device_index].out_of_memory += 1


def current(device_index: int) -> int:
    return _chips[device_index].current


def peak(device_index: int) -> int:
    return _chips[device_index].peak


def reset_peak(device_index: int) -> None:
    chip = _chips[device_index]
    with _lock:
        chip.peak = chip.current


def stats(device_index: int) -> dict[str, int]:
    chip = _chips[device_index]
    return {
        "allocated_bytes.all.current": chip.current,
        "allocated_bytes.all.peak": chip.peak,
        "allocation.all.allocated": chip.allocations,
        "allocation.all.freed": chip.frees,
        "active_bytes.all.current": chip.current,
        "active_bytes.all.peak": chip.peak,
        "reserved_bytes.all.current": chip.current,
        "reserved_bytes.all.peak": chip.peak,
        "num_alloc_retries": 0,
        "num_ooms": chip.out_of_memory,
        "in_place_copies": chip.in_place_copies,
    }
