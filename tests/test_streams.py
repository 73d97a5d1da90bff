"""Streams, events, non-blocking copies and pinned host memory on ``torch.tpu`` (CUDA's names and semantics)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from test_offloading import _run_unet, _unet, unet_on_tpu_output, unet_weights  # noqa: F401  (fixtures)

from hf_tpu.backend import completion, storage, streams

MATRIX = 1024  # a chain of CHAIN matmuls of this size keeps the device busy for well over 0.1 s
CHAIN = 12


def busy_device(matrix: torch.Tensor | None = None) -> torch.Tensor:
    """Queues a chain of matmuls (JAX's dispatch returns at once) and returns its result."""
    a = torch.randn(MATRIX, MATRIX, device="tpu") / MATRIX**0.5 if matrix is None else matrix
    result = a
    for _ in range(CHAIN):
        result = result @ a
    return result


def array_of(tensor: torch.Tensor):
    """The array a tensor's storage holds (in fused eager mode, its recorded value's, once its chain ran)."""
    buffer = storage.buffer_of(tensor)
    return buffer.pending.array if buffer.array is None else buffer.array


def computed(tensor: torch.Tensor) -> bool:
    """Whether the device has computed a tensor's value (in fused eager mode, not before its chain ran)."""
    array = array_of(tensor)
    return array is not None and array.is_ready()


@pytest.fixture
def side():
    stream = torch.tpu.Stream()
    yield stream
    torch.tpu.synchronize()


# API --------------------------------------------------------------------------------------------------------


def test_streams_have_cudas_api():
    stream = torch.tpu.Stream(priority=-1)
    assert isinstance(stream, torch.Stream) and isinstance(stream, torch.tpu.Stream)
    assert stream.device == torch.device("tpu", 0) and stream.priority == -1
    assert stream.stream_id != 0 and torch.tpu.Stream().stream_id not in (0, stream.stream_id)
    default = torch.tpu.default_stream()
    assert default.stream_id == 0 and default is torch.tpu.default_stream("tpu:0")
    assert torch.tpu.current_stream() is default
    with torch.tpu.stream(stream):
        assert torch.tpu.current_stream() is stream and torch.tpu.current_stream(0) is stream
        with torch.tpu.StreamContext(None):
            assert torch.tpu.current_stream() is stream
    assert torch.tpu.current_stream() is default
    with stream as entered:
        assert entered is stream and torch.tpu.current_stream() is stream
    torch.tpu.set_stream(stream)
    assert torch.tpu.current_stream() is stream
    torch.tpu.set_stream(default)
    assert stream.query() and default.query()
    stream.synchronize()


def test_bad_stream_arguments_say_what_to_do():
    with pytest.raises(TypeError, match="priority must be an int"):
        torch.tpu.Stream(priority="high")
    with pytest.raises(ValueError, match="Expected a tpu device"):
        torch.tpu.Stream("cpu")
    with pytest.raises(ValueError, match="Expected a tpu stream"):
        torch.tpu.set_stream(torch.Stream(device="cpu"))
    with pytest.raises(ValueError, match="Expected a tpu stream"):
        torch.ones(2, device="tpu").record_stream(torch.Stream(device="cpu"))
    unknown = torch.Stream(stream_id=10**6, device_index=0, device_type=torch.tpu.Stream().device_type)
    with pytest.raises(ValueError, match="create streams with torch.tpu.Stream"):
        torch.tpu.set_stream(unknown)


def test_torch_stream_event_and_accelerator_route_to_torch_tpu():
    stream = torch.Stream(device="tpu")
    assert type(stream) is torch.tpu.Stream and type(torch.Stream()) is torch.tpu.Stream
    assert isinstance(stream, torch.Stream) and issubclass(torch.tpu.Stream, torch.Stream)
    assert type(torch.Stream(device="cpu")) is torch._C.Stream  # other devices: torch's own
    event = torch.Event(device="tpu", enable_timing=True)
    assert type(event) is torch.tpu.Event and event.enable_timing and isinstance(event, torch.Event)
    assert type(torch.Event()) is torch.tpu.Event and type(torch.Event(device="cpu")) is torch._C.Event

    assert torch.accelerator.current_stream() is torch.tpu.default_stream()
    torch.accelerator.set_stream(stream)
    assert torch.accelerator.current_stream() is stream is torch.tpu.current_stream()
    # torch hands kernels generic stream objects naming the device and id: they resolve to the same stream
    generic = torch.Stream(stream_id=stream.stream_id, device_index=0, device_type=stream.device_type)
    torch.accelerator.set_stream(torch.tpu.default_stream())
    torch.tpu.set_stream(generic)
    assert torch.tpu.current_stream() is stream
    torch.tpu.set_stream(torch.tpu.default_stream())


def test_event_api():
    event = torch.tpu.Event()
    assert event.query() and repr(event) == "<torch.tpu.Event uninitialized>"
    event.synchronize()  # never recorded: nothing to wait for
    event.record()
    assert "recorded on tpu:0" in repr(event)
    event.wait()
    event.wait(torch.tpu.Stream())
    stream = torch.tpu.Stream()
    recorded = stream.record_event()
    assert isinstance(recorded, torch.tpu.Event) and stream.record_event(event) is event
    event.synchronize()
    assert event.query()
    plain, timed = torch.tpu.Event(), torch.tpu.Event(enable_timing=True)
    plain.record()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        plain.elapsed_time(timed)
    with pytest.raises(RuntimeError, match="must be recorded"):
        timed.elapsed_time(torch.tpu.Event(enable_timing=True))


# what streams and events mark -------------------------------------------------------------------------------


def test_a_stream_tracks_the_work_issued_while_it_is_current(side):
    with torch.tpu.stream(side):
        result = busy_device()
        event = side.record_event()
    assert not side.query() and not event.query()  # the chain takes far longer than queueing it
    side.synchronize()
    assert side.query() and event.query() and array_of(result).is_ready()
    assert completion.stream_tracker is None  # no side stream current: the default path is untouched


def test_default_stream_and_synchronize_cover_transfers_after_compute():
    result = busy_device()
    torch.ones(3).to("tpu")  # a transfer ready at once must not hide the queued compute
    event = torch.tpu.current_stream().record_event()
    assert not event.query()
    event.synchronize()
    assert array_of(result).is_ready()
    result = busy_device()
    torch.ones(3).to("tpu")
    torch.tpu.synchronize()
    assert array_of(result).is_ready()


def test_elapsed_time_measures_device_completion_not_host_queueing():
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    matrix = torch.randn(MATRIX, MATRIX, device="tpu") / MATRIX**0.5
    busy_device(matrix)  # compiles what the timed run runs (fused eager mode: its chain's program)
    torch.tpu.synchronize()
    began = time.perf_counter()
    start.record()
    result = busy_device(matrix)  # kept: fused eager mode does not run what nothing reads
    end.record()
    queued = time.perf_counter() - began
    elapsed = start.elapsed_time(end)  # waits for the device
    total = time.perf_counter() - began
    assert 0.5 * total * 1e3 < elapsed <= total * 1e3
    assert elapsed > 2 * queued * 1e3  # the host queued the chain much faster than the device ran it
    assert array_of(result).is_ready()
    idle_start, idle_end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    idle_start.record()
    idle_end.record()
    assert 0 <= idle_start.elapsed_time(idle_end) < 50


# ordering across streams ------------------------------------------------------------------------------------


def test_a_reader_on_another_stream_sees_the_writers_result(side):
    data = torch.zeros(4, device="tpu")
    with torch.tpu.stream(side):
        data.add_(busy_device()[0, :4] * 0 + 1)  # the writer: in place, behind a long chain
    torch.tpu.current_stream().wait_stream(side)
    assert torch.equal(data.cpu(), torch.ones(4))
    with torch.tpu.stream(side):
        data.mul_(3)
    # without a wait too: every op sees the ops issued before it, on any stream (stronger than CUDA)
    assert torch.equal((data + 1).cpu(), torch.full((4,), 4.0))


def test_wait_stream_orders_host_copies_after_the_other_streams_copies(side):
    values = torch.arange(1 << 20, dtype=torch.float32)
    device_values = values.to("tpu") * 2
    host = torch.empty(1 << 20, pin_memory=True)
    with torch.tpu.stream(side):
        host.copy_(device_values, non_blocking=True)  # filled by the side stream's worker
    torch.tpu.current_stream().wait_stream(side)
    assert torch.equal(host.to("tpu").cpu(), values * 2)  # the default stream's copy waits for it


def test_wait_event_orders_a_streams_copies_after_the_event(side):
    values = torch.randn(1 << 18)
    host = torch.empty(1 << 18, pin_memory=True)
    with torch.tpu.stream(side):
        host.copy_(values.to("tpu") + 1, non_blocking=True)
        written = side.record_event()
    other = torch.tpu.Stream()
    other.wait_event(written)
    with torch.tpu.stream(other):
        back = host.to("tpu", non_blocking=True)
    other.synchronize()
    assert written.query()
    torch.testing.assert_close(back.cpu(), values + 1, rtol=0, atol=0)


def test_a_stream_waiting_for_the_default_stream_copies_after_its_compute(side):
    result = busy_device()
    side.wait_stream(torch.tpu.current_stream())
    with torch.tpu.stream(side):
        torch.ones(4).pin_memory().to("tpu", non_blocking=True)
    side.synchronize()
    assert array_of(result).is_ready()


# non-blocking copies ----------------------------------------------------------------------------------------


def test_non_blocking_copies_to_and_from_the_device_on_a_stream(side):
    values = torch.randn(256, 64)
    pinned = values.pin_memory()
    with torch.tpu.stream(side):
        on_device = pinned.to("tpu", non_blocking=True)
        assert storage.buffer_of(on_device).pending is not None  # queued on the stream's worker
        doubled = on_device * 2  # reads wait for the copy
        back = doubled.to("cpu", non_blocking=True)
        assert back.is_pinned()
        into = torch.empty(256, 64, device="tpu")
        into.copy_(pinned, non_blocking=True)
        host = torch.empty(256, 64, pin_memory=True)
        host.copy_(into, non_blocking=True)
        half = pinned.to("tpu", torch.float16, non_blocking=True)
    side.synchronize()
    torch.testing.assert_close(back, values * 2, rtol=0, atol=0)
    torch.testing.assert_close(host, values, rtol=0, atol=0)
    torch.testing.assert_close(into.cpu(), values, rtol=0, atol=0)
    torch.testing.assert_close(half.cpu(), values.half(), rtol=0, atol=0)


def test_copies_that_cannot_be_asynchronous_complete_before_returning(side):
    values = torch.randn(8, 8)
    with torch.tpu.stream(side):
        unpinned = values.to("tpu", non_blocking=True)  # pageable source: synchronous, as on CUDA
        assert storage.buffer_of(unpinned).pending is None
        view = torch.zeros(8, 16, device="tpu")[:, :8]
        view.copy_(values.pin_memory(), non_blocking=True)  # a view: written at once
        blocking = values.pin_memory().to("tpu")
        host = unpinned.to("cpu")
        assert not host.is_pinned()
    for tensor in (unpinned, view, blocking, host):
        torch.testing.assert_close(tensor.cpu(), values, rtol=0, atol=0)
    on_default = values.pin_memory().to("tpu", non_blocking=True)  # the default stream stays synchronous
    assert storage.buffer_of(on_default).pending is None


def test_a_copy_into_pinned_memory_is_queued_on_the_default_stream_too():
    result = busy_device()
    host = torch.empty(MATRIX, MATRIX, pin_memory=True)
    start = time.perf_counter()
    host.copy_(result, non_blocking=True)  # as CUDA queues it: returns before the device is done
    assert time.perf_counter() - start < 0.1 and not computed(result)
    done = torch.tpu.Event()
    done.record()  # runs nothing (fused eager mode's recorded ops neither)
    assert not computed(result) and not done.query()
    done.synchronize()
    expected = result.cpu()
    assert torch.equal(host, expected)

    host.copy_(result * 2, non_blocking=True)
    host.copy_(result)  # a blocking copy on the default stream runs after the queued one
    assert torch.equal(host, expected)
    host.copy_(result * 2, non_blocking=True)
    assert torch.equal(host.to("tpu").cpu(), expected * 2)  # so does a copy out of the host tensor
    host.copy_(result + 1, non_blocking=True)
    torch.tpu.synchronize()
    assert torch.equal(host, expected + 1)
    unpinned, later = torch.zeros(MATRIX, MATRIX), busy_device(result)
    unpinned.copy_(later, non_blocking=True)  # pageable memory: synchronous, as on CUDA
    assert array_of(later).is_ready() and not result.to("cpu", non_blocking=True).is_pinned()


def test_queued_host_copies_land_in_issue_order_at_any_host_sync():
    values = torch.arange(6.0, device="tpu")
    host = torch.zeros(6, pin_memory=True)
    for scale in (1.0, 2.0, 3.0):  # into one host tensor: the last one issued is what it holds
        host.copy_(values * scale, non_blocking=True)
    assert (values.sum() * 0).item() == 0  # .item() syncs the device: the copies queued before it are done
    assert host.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    first, second = torch.zeros(6, pin_memory=True), torch.zeros(6, pin_memory=True)
    first.copy_(values + 1, non_blocking=True)
    second.copy_(values + 2, non_blocking=True)
    event = torch.tpu.Event()
    event.record()
    event.synchronize()
    assert first.tolist() == (torch.arange(6.0) + 1).tolist() and second.tolist() == (torch.arange(6.0) + 2).tolist()
    for _ in range(100):  # copies never waited for do not pile up: a new one does those whose values are computed
        host.copy_(values, non_blocking=True)
        torch.tpu.current_stream().query()
    assert len(streams._host_copies[0]) <= 2
    torch.tpu.synchronize()
    assert not streams._host_copies[0] and torch.equal(host, torch.arange(6.0))


def test_a_flag_copied_to_the_host_with_an_event_runs_no_fused_chain_of_its_own():
    """generate's stopping check each token: a flag copied into pinned memory and an event recorded after it. In
    fused eager mode neither runs the ops recorded so far: they run with the next ones, at the next sync point."""
    from hf_tpu.backend import fused

    torch.tpu.set_eager_mode("fused")
    try:
        tokens = torch.arange(8, device="tpu")
        torch.tpu.synchronize()
        flag, copied = torch.zeros((), dtype=torch.bool, pin_memory=True), torch.tpu.Event()
        runs = fused.stats()["flushes"]
        flag.copy_((tokens + 1).max() == 8, non_blocking=True)
        copied.record()
        assert fused.stats()["flushes"] == runs and fused.stats()["pending"] == 3  # add, max, eq
        following = tokens * 2  # recorded into the same chain
        copied.synchronize()  # runs it: one run
        assert fused.stats()["flushes"] == runs + 1 and bool(flag) and following.tolist() == list(range(0, 16, 2))
    finally:
        torch.tpu.set_eager_mode("strict")


def test_a_write_after_a_pending_copy_replaces_it(side):
    with torch.tpu.stream(side):
        tensor = torch.randn(1000).pin_memory().to("tpu", non_blocking=True)
    tensor.fill_(3.0)
    side.synchronize()
    assert torch.equal(tensor.cpu(), torch.full((1000,), 3.0))
    with torch.tpu.stream(side):
        grown = torch.arange(4.0).pin_memory().to("tpu", non_blocking=True)
    grown.resize_(6)
    assert grown.cpu()[:4].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_memory_statistics_count_pending_copies_once(side):
    gc.collect()
    before = torch.tpu.memory_allocated()
    with torch.tpu.stream(side):
        tensor = torch.zeros(1024).pin_memory().to("tpu", non_blocking=True)
    assert torch.tpu.memory_allocated() - before == 4096
    tensor.cpu()
    assert torch.tpu.memory_allocated() - before == 4096
    del tensor
    gc.collect()
    assert torch.tpu.memory_allocated() == before


def test_synchronize_waits_for_every_streams_copies(side):
    with torch.tpu.stream(side):
        tensors = [torch.randn(1 << 20).pin_memory().to("tpu", non_blocking=True) for _ in range(4)]
    torch.tpu.synchronize()
    assert all(storage.buffer_of(t).pending.done() for t in tensors) and side.query()
    assert torch.accelerator.synchronize() is None


def test_a_failed_copy_is_raised_at_first_use_and_by_synchronize(side, monkeypatch):
    from hf_tpu.backend.ops import memory

    def failing(*args):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(memory, "_transferred", failing)
    with torch.tpu.stream(side):
        tensor = torch.ones(3).pin_memory().to("tpu", non_blocking=True)
    with pytest.raises(RuntimeError, match="copy failed"):
        side.synchronize()
    with pytest.raises(RuntimeError, match="copy failed"):
        tensor.cpu()


# record_stream ----------------------------------------------------------------------------------------------


def test_record_stream_keeps_the_memory_until_the_streams_work_is_done(side):
    values = torch.randn(MATRIX, MATRIX)
    with torch.tpu.stream(side):
        weight = (values / MATRIX**0.5).pin_memory().to("tpu", non_blocking=True)
    default = torch.tpu.current_stream()
    weight.record_stream(default)
    pending = storage.buffer_of(weight).pending
    result = busy_device(weight)  # the default stream's compute reads it
    del weight
    gc.collect()
    assert any(contents is pending for _, contents in default._kept)  # still held
    expected = busy_device((values / MATRIX**0.5).to("tpu"))
    torch.testing.assert_close(result.cpu(), expected.cpu(), rtol=0, atol=0)
    default.synchronize()
    assert not default._kept


def test_record_stream_accepts_the_generic_stream_torch_hands_over(side):
    tensor = torch.ones(3, device="tpu")
    generic = torch.Stream(stream_id=side.stream_id, device_index=0, device_type=side.device_type)
    tensor.record_stream(generic)
    assert len(side._kept) == 1
    torch.empty(3, device="tpu").record_stream(side)  # never written: nothing to keep
    assert len(side._kept) == 1


# pinned host memory -----------------------------------------------------------------------------------------


def test_pin_memory_marks_a_host_copy():
    tensor = torch.randn(4, 3)
    pinned = tensor.pin_memory()
    assert pinned.is_pinned() and not tensor.is_pinned() and pinned.device.type == "cpu"
    assert pinned.data_ptr() != tensor.data_ptr() and torch.equal(pinned, tensor)
    assert pinned[1:].is_pinned() and pinned.t().is_pinned()  # views share the pinned storage
    assert pinned.pin_memory() is pinned
    strided = tensor.t().pin_memory()
    assert strided.stride() == tensor.t().stride() and strided.is_pinned()


FACTORIES = {
    "empty": lambda **kw: torch.empty(2, 3, **kw),
    "empty_strided": lambda **kw: torch.empty_strided((2, 3), (1, 2), **kw),
    "zeros": lambda **kw: torch.zeros(2, 3, **kw),
    "ones": lambda **kw: torch.ones(2, 3, dtype=torch.int64, **kw),
    "full": lambda **kw: torch.full((2, 3), 7.0, **kw),
    "empty_like": lambda **kw: torch.empty_like(torch.ones(2, 3), **kw),
    "zeros_like": lambda **kw: torch.zeros_like(torch.ones(2, 3), **kw),
    "ones_like": lambda **kw: torch.ones_like(torch.ones(2, 3), **kw),
    "full_like": lambda **kw: torch.full_like(torch.ones(2, 3), 7.0, **kw),
}


@pytest.mark.parametrize("name", FACTORIES)
def test_factories_make_pinned_tensors(name):
    factory = FACTORIES[name]
    pinned, plain = factory(pin_memory=True), factory()
    assert pinned.is_pinned() and not plain.is_pinned() and not factory(pin_memory=False).is_pinned()
    assert (pinned.shape, pinned.stride(), pinned.dtype) == (plain.shape, plain.stride(), plain.dtype)
    if "empty" not in name:
        assert torch.equal(pinned, plain)


def test_pinning_a_device_tensor_is_refused():
    with pytest.raises(RuntimeError, match="Only dense CPU tensors can be pinned"):
        torch.zeros(2, device="tpu", pin_memory=True)


def test_code_calling_the_factories_still_compiles():
    def make(x):
        return x + torch.zeros(3) + torch.ones(3, dtype=x.dtype) + torch.full_like(x, 2.0)

    compiled = torch.compile(make, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.ones(3)), make(torch.ones(3)))
    on_tpu = torch.compile(lambda x: x + torch.zeros(3, device="tpu"), backend="tpu", fullgraph=True)
    assert torch.equal(on_tpu(torch.ones(3, device="tpu")).cpu(), torch.ones(3))

    def zeros_plus_ones() -> torch.Tensor:
        return torch.zeros(2) + torch.ones(2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated, still used
        scripted = torch.jit.script(zeros_plus_ones)
    torch.testing.assert_close(scripted(), torch.ones(2))


def test_dataloader_pins_batches():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(6.0)), batch_size=3,
                                         pin_memory=True)
    assert all(batch.is_pinned() for (batch,) in loader)


# several chips ----------------------------------------------------------------------------------------------

_TWO_CHIP_SCRIPT = """
import json, torch, hf_tpu
report = {}
second = torch.tpu.Stream("tpu:1")
with torch.tpu.stream(second):
    report["current"] = [torch.tpu.current_stream(0).stream_id, torch.tpu.current_stream(1) is second]
    moved = torch.arange(4.0).pin_memory().to("tpu:1", non_blocking=True)
    back = (moved * 2).to("cpu", non_blocking=True)
second.synchronize()
report["values"] = [str(moved.device), back.tolist()]
report["defaults"] = [torch.tpu.default_stream(1).device_index, torch.tpu.default_stream(0).device_index]
event = second.record_event()
try:
    event.record(torch.tpu.default_stream(0))
except RuntimeError as error:
    report["mismatch"] = str(error)
torch.tpu.synchronize(1)
# torch.Event(device="tpu:1") records tpu:1's current stream, where a non_blocking copy from tpu:1 into pinned
# memory is queued, whichever chip is current (transformers' deferred stop check reads its flag so)
flags = []
for mode in ("strict", "fused"):
    torch.tpu.set_eager_mode(mode)
    flag = torch.zeros((), dtype=torch.bool).pin_memory()
    done = torch.Event(device="tpu:1")
    flag.copy_(torch.zeros(4, dtype=torch.long, device="tpu:1").max() == 0, non_blocking=True)
    done.record()
    done.synchronize()
    flags.append(bool(flag))
torch.tpu.set_eager_mode("strict")
report["named chip"] = flags
print(json.dumps(report))
"""


def test_streams_on_several_chips():
    environment = dict(os.environ, HF_TPU_NUM_DEVICES="2", HF_TPU_PLATFORM="cpu")
    result = subprocess.run([sys.executable, "-c", _TWO_CHIP_SCRIPT], env=environment, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["current"] == [0, True]
    assert report["values"] == ["tpu:1", [0.0, 2.0, 4.0, 6.0]]
    assert report["defaults"] == [1, 0]
    assert report["mismatch"] == "Event device tpu:1 does not match recording stream's device tpu:0."
    assert report["named chip"] == [True, True]


# diffusers' streamed group offloading -----------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    dict(offload_type="block_level", num_blocks_per_group=1),
    dict(offload_type="block_level", num_blocks_per_group=1, record_stream=True, low_cpu_mem_usage=True),
    dict(offload_type="leaf_level"),
    dict(offload_type="leaf_level", record_stream=True),
    dict(offload_type="leaf_level", low_cpu_mem_usage=True),
], ids=["block", "block-record-low-cpu-mem", "leaf", "leaf-record", "leaf-low-cpu-mem"])
def test_group_offloading_with_streams_matches_the_model_on_tpu(
    unet_weights, unet_on_tpu_output, options, monkeypatch  # noqa: F811  (the imported fixtures)
):
    queued = []
    queue_copy = streams.queue_copy
    monkeypatch.setattr(streams, "queue_copy", lambda *args: queued.append(args) or queue_copy(*args))
    unet = _unet(unet_weights)
    unet.enable_group_offload(onload_device=torch.device("tpu"), use_stream=True, **options)
    for _ in range(2):  # the first forward records the order in which groups run, the second prefetches
        output = _run_unet(unet)
        torch.testing.assert_close(output.cpu(), unet_on_tpu_output, rtol=0, atol=0)
    assert queued  # the onloads ran as asynchronous copies on the transfer stream
    assert all(p.device.type == "cpu" for p in unet.parameters())
