"""Where a device's queued work ends: the newest array each chip computed and the newest one copied to it.

A chip runs its programs in the order they were issued, so waiting for the newest computed array waits
for all queued compute. Host-to-device transfers run beside that queue, so the newest one is kept too.
Storages record what they hold here (:mod:`storage`), fused eager chains what they computed (:mod:`fused`),
and ``torch.tpu.synchronize`` and streams wait on it.
"""

from __future__ import annotations

from typing import Any, Callable

_latest: dict[int, Any] = {}
_transfers: dict[int, Any] = {}
# Set by streams.py while some thread has a non-default stream current: records each computed array on it.
stream_tracker: Callable[[Any, int], None] | None = None


def is_latest(array: Any) -> int:
    """How many of the newest-array records (which :func:`wait_for_pending` holds) hold ``array``."""
    return sum(newest is array for newest in (*_latest.values(), *_transfers.values()))


def newest(device_index: int) -> tuple:
    """The newest computed array and the newest transferred array of a device, those that exist:
    waiting for both waits for all the work queued on it. One donated to a program since (a compiled graph's,
    which wrote its results into its memory) is left out: that program read it, and its results, recorded here
    when it ran, are waited for instead."""
    return tuple(a for a in (_latest.get(device_index), _transfers.get(device_index))
                 if a is not None and not a.is_deleted())


def computed(array: Any, device_index: int) -> None:
    """Records ``array`` as the newest computed on a device (see :func:`newest`)."""
    _latest[device_index] = array
    if stream_tracker is not None:
        stream_tracker(array, device_index)


def wait_for_pending(device_index: int) -> None:
    for array in newest(device_index):
        array.block_until_ready()
