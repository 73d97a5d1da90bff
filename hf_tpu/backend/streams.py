"""Streams and events of the tpu device: ``torch.tpu.Stream``, ``torch.tpu.Event``, ``torch.tpu.stream``.

They follow ``torch.cuda``'s names and semantics, on top of JAX's asynchronous dispatch:

* **Compute is ordered by issue.** A chip runs its programs in the order they were issued, whatever
  stream was current, and an op reads the arrays its inputs hold when it is issued. So an op sees the
  effects of every op issued before it, on any stream: what CUDA guarantees only after
  ``wait_stream``/``wait_event``. Programs of different streams do not run concurrently.
* **Copies are what streams overlap.** A non-default stream has a worker thread that runs its copies
  between host and device in issue order. ``non_blocking=True`` copies from pinned host memory to the
  device, and from the device into pinned host memory, are queued there and return at once: the device
  tensor's storage waits for its copy when first used, while the host tensor must not be read (nor a
  pinned source changed) before the stream, or an event recorded after the copy, is synchronized,
  as on CUDA. Its other copies wait for its queue and then complete before returning. On the default
  stream every copy is synchronous, as before streams existed, except a ``non_blocking=True`` copy into
  pinned host memory: it is queued (a :class:`HostCopy`, which no thread runs: what waits for it does it).
* **Completion markers.** A stream's work is its queued copies and the arrays computed while it was
  current; the default stream's is the device's newest computed and transferred arrays. Events record
  these markers; ``query``/``synchronize`` test or wait for them; ``wait_event``/``wait_stream`` make
  the waiting stream's later copies start after them.
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import torch

from . import completion, devices

_PRIVATE_USE1 = int(torch._C._autograd.DeviceType.PrivateUse1)
_stream_ids = itertools.count(1)  # 0 is each device's default stream
_streams: weakref.WeakValueDictionary[tuple[int, int], Stream] = weakref.WeakValueDictionary()
_defaults: dict[int, Stream] = {}
_lock = threading.Lock()
_local = threading.local()  # .current: device index -> the thread's current stream, where one was set
_side_streams_current = 0  # (thread, device) pairs whose current stream is not the default one
_waiting_defaults: set[int] = set()  # devices whose default stream has events to wait for
_in_flight: dict[int, set[Any]] = collections.defaultdict(set)  # queued copies per device (futures, HostCopy)


def _done(marker: Any) -> bool:
    """Whether a completion marker is done: a queued copy's future, or one with a JAX array's ``is_ready`` (an
    array, a :class:`HostCopy`, the ops fused eager mode recorded)."""
    return marker.done() if isinstance(marker, Future) else marker.is_ready()


def _wait(markers: Iterable[Any], device_index: int) -> None:
    """Waits for each marker (a queued copy or a JAX array); errors are raised as ``synchronize`` does."""
    from .forks import check_not_forked
    from .out_of_memory import raise_if_out_of_memory

    check_not_forked()  # a forked child has no worker threads: its copies would never complete
    try:
        for marker in markers:
            if isinstance(marker, Future):
                marker.result()
            else:
                marker.block_until_ready()
    except Exception as error:
        raise_if_out_of_memory(error, device_index)
        raise


class Stream(torch._C.Stream):
    """An ordering domain for tpu work, like ``torch.cuda.Stream`` (semantics: see ``hf_tpu.backend.streams``).

    ``priority`` is accepted for compatibility; tpu streams have no priorities.
    """

    def __new__(cls, device: Any = None, priority: int = 0) -> Stream:
        if not isinstance(priority, int):
            raise TypeError(f"Stream priority must be an int, got {type(priority).__name__}")
        return _create(cls, devices.index_of(device), next(_stream_ids), priority)

    def __repr__(self) -> str:
        return f"<torch.tpu.Stream device=tpu:{self.device_index} stream_id={self.stream_id}>"

    def query(self) -> bool:
        """Whether all work queued on the stream has completed."""
        return all(_done(marker) for marker in self._markers())

    def synchronize(self) -> None:
        """Waits until all work queued on the stream has completed."""
        _wait(self._markers(), self.device_index)
        self._kept.clear()
        # Forget completed markers (unless newer work came meanwhile): they hold device arrays.
        if self._last_copy is not None and _done(self._last_copy):
            self._last_copy = None
        if self._computed is not None and self._computed.is_ready():
            self._computed = None

    def wait_event(self, event: Event) -> None:
        """Makes the stream's later work wait for the work ``event`` recorded."""
        markers = event._markers
        if not markers:
            return
        if self._worker is not None:
            queue_copy(self, _wait, markers, self.device_index)
            return
        self._waits = [marker for marker in self._waits if not _done(marker)] + list(markers)
        _waiting_defaults.add(self.device_index)

    def wait_stream(self, stream: Stream) -> None:
        """Makes the stream's later work wait for the work queued on ``stream`` so far."""
        self.wait_event(_resolve(stream).record_event())

    def record_event(self, event: Event | None = None) -> Event:
        """Records ``event`` (a new one if None) on the stream and returns it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def __enter__(self) -> Stream:
        context = StreamContext(self)
        context.__enter__()
        self._contexts.append(context)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._contexts.pop().__exit__(*exc)

    def _markers(self) -> tuple:
        """What the stream's work so far completes with: futures of queued copies, JAX arrays; on the default
        stream, the ops fused eager mode recorded, which run when the marker is asked (so that recording an event
        runs nothing: ``generate`` records one after each token's flag copy), not now."""
        if self._worker is None:
            fused = _fused_on()
            recorded = None if fused is None else fused.recorded()
            pending = () if recorded is None else (recorded,)
            copies = () if self._last_copy is None else (self._last_copy,)
            return (*completion.newest(self.device_index), *pending, *self._waits, *copies)
        _run_recorded()
        return tuple(marker for marker in (self._last_copy, self._computed) if marker is not None)


def _create(cls: type, device_index: int, stream_id: int, priority: int) -> Stream:
    stream = torch._C.Stream.__new__(cls, stream_id=stream_id, device_index=device_index, device_type=_PRIVATE_USE1)
    stream.priority = priority
    # The default stream has no worker: its copies run on the calling thread, except the ones into pinned
    # host memory, queued as HostCopy markers.
    stream._worker = ThreadPoolExecutor(1, f"hf_tpu-stream-{stream_id}") if stream_id else None
    stream._last_copy = None  # the newest copy queued: a future of the worker's task, or a HostCopy
    stream._computed = None  # the newest array computed while the stream was current
    stream._waits = []  # default stream: markers its next copies wait for
    stream._kept = collections.deque()  # (markers, device contents) kept alive by Tensor.record_stream
    stream._contexts = []
    _streams[device_index, stream_id] = stream
    return stream


def default_stream(device: Any = None) -> Stream:
    """The default stream of a tpu device (the current device if None)."""
    index = devices.index_of(device)
    stream = _defaults.get(index)
    if stream is None:
        with _lock:
            stream = _defaults.get(index) or _create(Stream, index, 0, 0)
            _defaults[index] = stream
    return stream


def current_stream(device: Any = None) -> Stream:
    """The calling thread's current stream of a tpu device (the current device if None)."""
    index = devices.index_of(device)
    stream = getattr(_local, "current", {}).get(index)
    return default_stream(index) if stream is None else stream


def set_stream(stream: torch.Stream | None) -> None:
    """Makes ``stream`` the calling thread's current stream of its device (None: no change)."""
    global _side_streams_current
    if stream is None:
        return
    stream = _resolve(stream)
    current = _local.__dict__.setdefault("current", {})
    previous = current.get(stream.device_index)
    if previous is not stream:
        _run_recorded()
    current[stream.device_index] = stream
    change = (stream._worker is not None) - (previous is not None and previous._worker is not None)
    if change:
        with _lock:
            _side_streams_current += change
            completion.stream_tracker = _track if _side_streams_current else None


def _fused_on() -> Any:
    """The fused eager module if fused mode is on, else None (it is not imported before the device's first op)."""
    fused = sys.modules.get(f"{__package__}.fused")
    return fused if fused is not None and fused.ON else None


def _run_recorded() -> None:
    """Runs the ops fused eager mode recorded (a sync point): before the current stream changes, so that their work
    is the stream's that was current when they were issued, and before a stream's work is read."""
    fused = _fused_on()
    if fused is not None:
        fused.flush()


def _track(array: Any, device_index: int) -> None:
    """``completion.stream_tracker``: records a computed array on the thread's current stream."""
    stream = getattr(_local, "current", {}).get(device_index)
    if stream is not None and stream._worker is not None:
        stream._computed = array


def _resolve(stream: Any) -> Stream:
    """The ``torch.tpu.Stream`` that ``stream`` is (torch hands kernels and accelerator calls generic
    ``torch.Stream`` objects naming the device and stream id)."""
    if isinstance(stream, Stream):
        return stream
    if not isinstance(stream, torch._C.Stream) or stream.device.type != "tpu":
        raise ValueError(f"Expected a tpu stream (torch.tpu.Stream), got {stream!r}")
    if stream.stream_id == 0:
        return default_stream(stream.device_index)
    found = _streams.get((stream.device_index, stream.stream_id))
    if found is None:
        raise ValueError(f"{stream!r} is no live torch.tpu.Stream; create streams with torch.tpu.Stream()")
    return found


class StreamContext:
    """Makes ``stream`` the current stream of its device inside a ``with`` block, like
    ``torch.cuda.StreamContext``; ``None`` changes nothing."""

    def __init__(self, stream: Stream | None) -> None:
        self.stream = None if stream is None else _resolve(stream)
        self._previous: Stream | None = None

    def __enter__(self) -> None:
        if self.stream is not None:
            self._previous = current_stream(self.stream.device_index)
            set_stream(self.stream)

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None:
            set_stream(self._previous)


def stream(stream: Stream | None) -> StreamContext:
    """``with torch.tpu.stream(s):`` runs the block with ``s`` as its device's current stream."""
    return StreamContext(stream)


class Event(torch._C.Event):
    """A completion marker of the work queued on a stream, like ``torch.cuda.Event``.

    With ``enable_timing``, a helper thread stamps the time at which the recorded work completes, so
    ``elapsed_time`` measures the device's completion times, not the host's queueing. ``blocking`` and
    ``interprocess`` are accepted for compatibility and have no effect.
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, *,
                chip: int | None = None) -> Event:
        """``chip``: the chip the event is for (``torch.Event(device="tpu:N")``): ``record()`` records its current
        stream, as CUDA's does for a named device; without it, the first record's stream sets the chip."""
        event = torch._C.Event.__new__(cls, device="tpu")
        event.enable_timing, event.blocking, event.interprocess = enable_timing, blocking, interprocess
        event._markers = ()
        event._device_index = event._named_chip = chip
        event._completion = None
        return event

    def __repr__(self) -> str:
        if self._device_index is None:
            return "<torch.tpu.Event uninitialized>"
        return f"<torch.tpu.Event recorded on tpu:{self._device_index}>"

    def record(self, stream: Stream | None = None) -> None:
        """Records the work queued so far on ``stream`` (if None: the current stream of the chip the event was
        made for, else of the current chip)."""
        stream = current_stream(self._named_chip) if stream is None else _resolve(stream)
        if self._device_index not in (None, stream.device_index):
            raise RuntimeError(
                f"Event device tpu:{self._device_index} does not match recording stream's device "
                f"tpu:{stream.device_index}."
            )
        self._device_index = stream.device_index
        self._markers = stream._markers()
        if self.enable_timing:
            self._completion = _CompletionTime(self._markers)

    def wait(self, stream: Stream | None = None) -> None:
        """Makes the later work of ``stream`` (the current stream if None) wait for this event."""
        (current_stream() if stream is None else _resolve(stream)).wait_event(self)

    def query(self) -> bool:
        """Whether the recorded work has completed (True if never recorded)."""
        return all(_done(marker) for marker in self._markers)

    def synchronize(self) -> None:
        """Waits until the recorded work has completed."""
        _wait(self._markers, self._device_index or 0)

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between the completion of this event's work and of ``end_event``'s (waits for both)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._completion is None or end_event._completion is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._completion.time() - self._completion.time()) * 1000


class _CompletionTime:
    """When some markers completed, stamped by a thread waiting for them (at once if they have)."""

    def __init__(self, markers: tuple) -> None:
        self._time = 0.0
        self._thread = None
        if all(_done(marker) for marker in markers):
            self._time = time.perf_counter()
        else:
            self._thread = threading.Thread(target=self._stamp, args=(markers,), name="hf_tpu-event-timer")
            self._thread.start()

    def _stamp(self, markers: tuple) -> None:
        for marker in markers:
            try:
                _wait((marker,), 0)
            except Exception:  # a failed copy or program: synchronize() reports it; the time is still when it ended
                pass
        self._time = time.perf_counter()

    def time(self) -> float:
        if self._thread is not None:
            self._thread.join()
        return self._time


def copy_stream(device_index: int, into_pinned_host: bool = False) -> Stream | None:
    """The stream a copy between the host and ``device_index`` belongs to: the calling thread's
    current stream if it is not the default one. Otherwise None, after waiting for the events the
    default stream was made to wait for and for its queued copies: its copies run on the calling thread.
    A non_blocking copy into pinned host memory (``into_pinned_host``) is queued on the default stream
    too: for it the default stream is returned, after the waits."""
    if not (into_pinned_host or _side_streams_current or _waiting_defaults or _in_flight.get(device_index)):
        return None
    stream = current_stream(device_index)
    if stream._worker is not None:
        return stream
    if stream._waits:
        waits, stream._waits = stream._waits, []
        _waiting_defaults.discard(device_index)
        _wait(waits, device_index)
    if into_pinned_host:
        return stream
    if stream._last_copy is not None and not _done(stream._last_copy):
        _wait((stream._last_copy,), device_index)
    return None


def queue_copy(stream: Stream, task: Callable[..., Any], *args: Any) -> Future:
    """Queues ``task(*args)`` on the stream's worker (a non-default stream's), after the work queued there
    before it. The task must return only once its copy is complete: its future is the copy's completion marker."""
    future = stream._worker.submit(task, *args)
    stream._last_copy = future
    in_flight = _in_flight[stream.device_index]
    in_flight.add(future)
    future.add_done_callback(in_flight.discard)
    return future


class HostCopy:
    """A copy of a device value into pinned host memory queued on the default stream (``non_blocking=True``), as
    CUDA queues it; a completion marker as a JAX array is one (``is_ready``, ``block_until_ready``).

    No thread runs it (a worker's hand-offs cost the host more than the copy): whatever waits for it does it, after
    the host copies queued before it, so that the host sees them in issue order: an event's or a stream's
    ``synchronize``, ``torch.tpu.synchronize``, a later copy between the host and the chip, ``.item()``; and a
    ``query`` that finds the value computed. ``fill(array)`` writes the host tensor. The value may be one fused
    eager mode has not computed yet: queuing the copy runs nothing (a sync point later runs it with the ops
    recorded after it), and asking whether the copy is done runs it.
    """

    __slots__ = ("_fill", "_value", "_error", "finished", "device_index")

    def __init__(self, fill: Callable[[Any], None], value: Any, device_index: int) -> None:
        self._fill, self._value, self.device_index = fill, value, device_index
        self._error: BaseException | None = None
        self.finished = False
        if hasattr(value, "copy_to_host_async"):  # a computed array: its transfer starts as soon as it is ready
            value.copy_to_host_async()

    def is_ready(self) -> bool:
        return self.finished or _run_host_copies(self, wait=False)

    def block_until_ready(self) -> None:
        if not self.finished:
            _run_host_copies(self, wait=True)
        if self._error is not None:
            raise self._error

    def _computed(self, run_recorded: bool = True) -> bool:
        """Whether the value is computed; a value fused eager mode recorded is computed first with
        ``run_recorded``, else counts as not computed while its chain has not run."""
        from . import fused

        value = self._value
        if value.__class__ is fused.Lazy and value.array is None and not run_recorded:
            return False
        return fused.concrete(value).is_ready()

    def _run(self) -> None:
        from . import fused

        try:
            self._fill(fused.concrete(self._value))
        except Exception as error:  # noqa: BLE001 (raised to whoever waits for this copy, as a future's error)
            self._error = error
        self._value, self.finished = None, True


_host_copies: dict[int, collections.deque[HostCopy]] = collections.defaultdict(collections.deque)
_host_copies_lock = threading.RLock()


def _run_host_copies(last: HostCopy, wait: bool, run_recorded: bool = True) -> bool:
    """Does the host copies queued on ``last``'s chip, in order, up to ``last``; without ``wait``, only those whose
    values are computed (see :meth:`HostCopy._computed` for ``run_recorded``). Whether ``last`` is done."""
    with _host_copies_lock:
        queue = _host_copies[last.device_index]
        while not last.finished:
            first = queue[0]
            if not wait and not first._computed(run_recorded):
                return False
            first._run()
            queue.popleft()
            _in_flight[last.device_index].discard(first)
    return True


def queue_host_copy(stream: Stream, fill: Callable[[Any], None], value: Any) -> Any:
    """Queues a copy of ``value`` (a device array, or a value fused eager mode recorded) into pinned host memory on
    ``stream``: ``fill(array)`` writes it. On the default stream when something waits for it (see
    :class:`HostCopy`), on another one on its worker (the value computed now); returns the copy's marker."""
    if stream._worker is not None:
        from . import fused

        return queue_copy(stream, fill, fused.concrete(value))
    copy = HostCopy(fill, value, stream.device_index)
    with _host_copies_lock:
        queue = _host_copies[stream.device_index]
        if queue:  # the copies queued before whose values are computed now are done now, as on CUDA soon after
            _run_host_copies(queue[-1], wait=False, run_recorded=False)
        queue.append(copy)
        _in_flight[stream.device_index].add(copy)
    stream._last_copy = copy
    return copy


def finish_host_copies(device_index: int) -> None:
    """For a host sync (``.item()``): does the host copies queued on the chip's default stream, as CUDA's sync of
    the stream completes them."""
    queue = _host_copies.get(device_index)
    if queue:
        _wait((queue[-1],), device_index)


def run_copy(stream: Stream, task: Callable[..., Any], *args: Any) -> Any:
    """Runs ``task(*args)`` on the stream's worker in the stream's order and returns its result."""
    return queue_copy(stream, task, *args).result()


def wait_for_copies(device_index: int) -> None:
    """For ``torch.tpu.synchronize``: waits for the copies queued on every stream of the device."""
    _wait(tuple(_in_flight[device_index]), device_index)
    default = _defaults.get(device_index)
    if default is not None:
        default._waits = []
    _waiting_defaults.discard(device_index)
    for stream in list(_streams.values()):
        if stream.device_index == device_index:
            stream._kept.clear()


def record_stream(tensor: torch.Tensor, stream: torch.Stream) -> None:
    """``Tensor.record_stream``: keeps the tensor's device memory alive until the work queued on
    ``stream`` so far has completed. (JAX itself keeps an array alive while programs issued before
    its last reference died still use it, which covers the work queued later.)"""
    from . import storage

    stream = _resolve(stream)
    buffer = storage.buffer_of(tensor)
    contents = buffer.array if buffer.array is not None else buffer.pending
    if contents is None:  # never written: no memory yet
        return
    kept = stream._kept
    while kept and all(_done(marker) for marker in kept[0][0]):
        kept.popleft()
    kept.append((stream._markers(), contents))
