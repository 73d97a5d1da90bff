"""Moving data between host and device: to/copy_/cpu, scalars, printing, threads, lazy allocation."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import assert_same


def _sample(shape=(3, 5), dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * 1.37 - 7).to(dtype)


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16, torch.int32, torch.float32])
def test_host_to_device_with_dtype_conversion(target):
    host = _sample()
    assert_same(host.to("tpu", target), host.to(target), rtol=0, atol=0)
    assert_same(host.to(device="tpu", dtype=target), host.to(target), rtol=0, atol=0)
    destination = torch.empty(3, 5, dtype=target, device="tpu")
    assert destination.copy_(host) is destination
    assert_same(destination, host.to(target), rtol=0, atol=0)


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float64, torch.int64])
def test_device_to_host_with_dtype_conversion(target):
    host = _sample()
    device = host.to("tpu")
    expected = host.to(target)
    for result in (device.to("cpu", target), device.to(target).cpu(), torch.empty(3, 5, dtype=target).copy_(device)):
        assert result.device.type == "cpu"
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


def test_to_same_device_returns_self():
    device = _sample().to("tpu")
    for same in (device.to("tpu"), device.to("tpu:0"), device.to(torch.float32), device.tpu()):
        assert same is device
    assert device.to("tpu", copy=True) is not device


@pytest.mark.parametrize("non_blocking", [False, True])
def test_round_trip(non_blocking):
    host = _sample((4, 7))
    device = host.to("tpu", non_blocking=non_blocking)
    assert device.device == torch.device("tpu:0")
    back = device.to("cpu", non_blocking=non_blocking)
    torch.accelerator.synchronize()
    torch.testing.assert_close(back, host, rtol=0, atol=0)
    torch.testing.assert_close(device.cpu(), host, rtol=0, atol=0)


def test_copy_broadcasts_host_source():
    destination = torch.zeros(2, 3, device="tpu")
    destination.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert destination.cpu().tolist() == [[1.0, 2.0, 3.0]] * 2


def test_device_to_device_copy():
    source = _sample().to("tpu")
    destination = torch.empty(3, 5, dtype=torch.bfloat16, device="tpu")
    destination.copy_(source)
    torch.testing.assert_close(destination.cpu(), _sample().to(torch.bfloat16), rtol=0, atol=0)
    assert source.untyped_storage().data_ptr() != destination.untyped_storage().data_ptr()


def test_copy_into_non_contiguous_device_view():
    def copy_into_views(destination):
        destination.t()[1:4].copy_(torch.arange(12.0).reshape(3, 4))
        destination[:, ::2].copy_(torch.full((4, 3), -1.0))
        return destination

    assert_same(copy_into_views(torch.zeros(4, 6, device="tpu")), copy_into_views(torch.zeros(4, 6)))


@pytest.mark.parametrize(
    "view_fn",
    [lambda t: t.t(), lambda t: t[:, 1::2], lambda t: t.unfold(1, 2, 1), lambda t: t[1:, :1].expand(2, 4)],
    ids=["transpose", "step_slice", "overlapping_unfold", "expand"],
)
def test_copy_from_non_contiguous_device_view_to_host(view_fn):
    host = _sample()
    expected = view_fn(host)
    actual = view_fn(host.to("tpu"))
    for result in (actual.cpu(), torch.empty(expected.shape).copy_(actual)):
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.transpose(0, 2),
    "permuted": lambda t: t.permute(1, 2, 0),
    "step_slice": lambda t: t[:, ::2],
    "expanded": lambda t: t[:, :1].expand(2, 5, 4),
    "channels_last": lambda t: t.unsqueeze(0).contiguous(memory_format=torch.channels_last),
}
CONVERSIONS = {  # (where the source lives, the conversion): each a _to_copy with preserve_format
    "host_to_device": ("cpu", lambda t: t.to("tpu")),
    "device_dtype_change": ("tpu", lambda t: t.to(torch.float64)),
    "device_to_host": ("tpu", lambda t: t.cpu()),
}


@pytest.mark.parametrize("conversion", CONVERSIONS.values(), ids=CONVERSIONS.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_to_preserves_strides_like_cpu(layout, conversion):
    source_device, convert = conversion
    host = torch.arange(24.0).reshape(2, 3, 4)
    expected = layout(host).to(torch.float64)  # CPU's own preserve_format copy
    actual = convert(layout(host.to(source_device)))
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0, check_dtype=False)


@pytest.mark.parametrize("source_device", ["cpu", "tpu"])
def test_to_channels_last(source_device):
    host = torch.arange(48.0).reshape(2, 3, 2, 4)
    expected = host.to(memory_format=torch.channels_last)
    actual = host.to(source_device).to("tpu", memory_format=torch.channels_last)
    assert actual.is_contiguous(memory_format=torch.channels_last)
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)


UNINITIALIZED_IN_FORMAT = {
    "empty": lambda t: torch.empty(2, 3, 2, 4, device=t.device, memory_format=torch.channels_last),
    "empty_3d": lambda t: torch.empty(2, 3, 1, 2, 4, device=t.device, memory_format=torch.channels_last_3d),
    "empty_like_preserve": lambda t: torch.empty_like(t.permute(0, 2, 3, 1)),
}
COPIES_IN_FORMAT = {
    "contiguous": lambda t: t.contiguous(memory_format=torch.channels_last),
    "clone": lambda t: t.clone(memory_format=torch.channels_last),
    "clone_preserve": lambda t: t.permute(0, 2, 3, 1).clone(),
}


@pytest.mark.parametrize("op", UNINITIALIZED_IN_FORMAT.values(), ids=UNINITIALIZED_IN_FORMAT.keys())
def test_memory_format_of_empty_tensors_matches_cpu(op):
    host = torch.arange(48.0).reshape(2, 3, 2, 4)
    assert op(host.to("tpu")).stride() == op(host).stride()


@pytest.mark.parametrize("op", COPIES_IN_FORMAT.values(), ids=COPIES_IN_FORMAT.keys())
def test_memory_format_of_copies_matches_cpu(op):
    host = torch.arange(48.0).reshape(2, 3, 2, 4)
    expected, actual = op(host), op(host.to("tpu"))
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)


def test_complex_to_real_on_device_warns_like_cpu():
    complex_tensor = torch.tensor([1 + 2j, 3 - 1j], device="tpu")
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        real = complex_tensor.to(torch.float32)
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        torch.empty(2, device="tpu").copy_(complex_tensor)
    assert real.cpu().tolist() == [1.0, 3.0]


@pytest.mark.parametrize(
    "value",
    [3.25, -7, True, 2**40 + 3, 1 + 2j],
    ids=["float", "int", "bool", "int64_large", "complex"],
)
def test_item(value):
    host = torch.tensor(value)
    device = host.to("tpu")
    assert device.item() == host.item() == value
    assert type(device.item()) is type(host.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tolist(dtype):
    host = _sample((2, 3), dtype)
    assert host.to("tpu").tolist() == host.tolist()
    assert host.to("tpu")[1].tolist() == host[1].tolist()


@pytest.mark.parametrize(
    "host",
    [torch.tensor([1.5, -2.0, 3.0]), torch.tensor([[1, 2], [3, 4]]), torch.tensor(2.5, dtype=torch.bfloat16),
     torch.tensor([True, False])],
    ids=["float", "int", "bf16_scalar", "bool"],
)
def test_repr_matches_cuda_style(host):
    expected = repr(host)  # CUDA style: the device goes before the dtype, e.g. "tensor(1., device='cuda:0', dtype=...)"
    if ", dtype=" in expected:
        expected = expected.replace(", dtype=", ", device='tpu:0', dtype=", 1)
    else:
        expected = expected[:-1] + ", device='tpu:0')"
    assert repr(host.to("tpu")) == expected
    assert str(host.to("tpu")) == expected


def test_numpy_raises_type_error_like_cuda():
    with pytest.raises(TypeError, match="Tensor.cpu()"):
        torch.ones(2, device="tpu").numpy()


def test_concurrent_copies_from_threads():
    sources = [torch.full((64, 33), float(i)) + torch.arange(33.0) for i in range(200)]
    destinations = [torch.empty(64, 33, device="tpu") for _ in sources]

    def copy(i):
        destinations[i].copy_(sources[i])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(copy, range(len(sources))))
    for source, destination in zip(sources, destinations):
        torch.testing.assert_close(destination.cpu(), source, rtol=0, atol=0)


def test_huge_empty_is_lazy_and_freed():
    for _ in range(3):  # garbage of earlier tests can take more than one collection (weakref callbacks)
        gc.collect()
    before = torch.tpu.memory_allocated()
    start = time.perf_counter()
    huge = torch.empty(2**32, dtype=torch.float16, device="tpu")  # 8 GiB
    assert time.perf_counter() - start < 1.0
    assert huge.untyped_storage().nbytes() == 2**33
    assert torch.tpu.memory_allocated() == before
    buffer = weakref.ref(huge.untyped_storage()._hf_buffer)
    del huge
    gc.collect()
    assert buffer() is None
    assert torch.tpu.memory_allocated() == before


@pytest.mark.parametrize(
    "upload",
    [lambda h: h.to("tpu"), lambda h: torch.empty(h.shape, device="tpu").copy_(h), lambda h: h.t().to("tpu").t()],
    ids=["to", "copy_", "to_non_contiguous"],
)
def test_device_copy_does_not_alias_host_memory(upload):
    host = _sample()
    device = upload(host)
    host.fill_(0)
    torch.testing.assert_close(device.cpu(), _sample(), rtol=0, atol=0)
    downloaded = device.cpu()
    downloaded.fill_(1)
    torch.testing.assert_close(device.cpu(), _sample(), rtol=0, atol=0)


@pytest.mark.parametrize("map_location", [None, "cpu", "tpu"])
def test_torch_save_and_load_of_device_tensors(map_location):
    weight = _sample().to("tpu")
    checkpoint = {"weight": weight, "row": weight[1], "step": torch.tensor(7, device="tpu")}
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location=map_location)
    expected_device = "tpu" if map_location in (None, "tpu") else "cpu"
    assert loaded["weight"].device.type == expected_device
    torch.testing.assert_close(loaded["weight"].cpu(), _sample(), rtol=0, atol=0)
    torch.testing.assert_close(loaded["row"].cpu(), _sample()[1], rtol=0, atol=0)
    assert loaded["step"].item() == 7
    assert loaded["row"].untyped_storage().data_ptr() == loaded["weight"].untyped_storage().data_ptr()


def test_load_host_checkpoint_onto_device():
    buffer = io.BytesIO()
    torch.save({"weight": _sample()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location="tpu")
    assert_same(loaded["weight"], _sample(), rtol=0, atol=0)


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda t: pickle.loads(pickle.dumps(t))], ids=["deepcopy", "pickle"])
def test_deepcopy_and_pickle_of_device_tensor(clone):
    original = _sample().to("tpu")
    copied = clone(original)
    assert copied.device.type == "tpu"
    assert copied.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    torch.testing.assert_close(copied.cpu(), _sample(), rtol=0, atol=0)


def test_untyped_storage_constructor_on_device():
    empty = torch.UntypedStorage(12, device="tpu")
    assert empty.device == torch.device("tpu:0") and empty.nbytes() == 12
    filled = torch.UntypedStorage([1, 2, 250], device="tpu")
    assert filled.device.type == "tpu"
    assert torch.empty(0, dtype=torch.uint8).set_(filled.cpu()).tolist() == [1, 2, 250]
    assert torch.UntypedStorage(3).device.type == "cpu"


def test_pin_memory_for_the_device():
    host = _sample().t()
    pinned = host.pin_memory()
    assert pinned.stride() == host.stride() and pinned.data_ptr() != host.data_ptr()
    torch.testing.assert_close(pinned, host, rtol=0, atol=0)
    torch.testing.assert_close(pinned.to("tpu", non_blocking=True).cpu(), host, rtol=0, atol=0)


def test_dataloader_with_pin_memory():
    from torch.utils.data import DataLoader, TensorDataset

    dataset = TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))
    loader = DataLoader(dataset, batch_size=4, pin_memory=True)
    batches = [(x.to("tpu", non_blocking=True), y.to("tpu")) for x, y in loader]
    assert [len(y) for _, y in batches] == [4, 2]
    torch.testing.assert_close(torch.cat([x.cpu() for x, _ in batches]), torch.arange(12.0).reshape(6, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA device beside tpu")
def test_copies_between_cuda_and_tpu_go_through_the_host():
    values = torch.arange(6.0).reshape(2, 3)
    on_cuda = values.to("cuda")
    assert torch.equal(on_cuda.to("tpu").cpu(), values)
    target = torch.zeros(2, 3, device="tpu")
    target.copy_(on_cuda)
    assert torch.equal(target.cpu(), values)
    assert torch.equal(values.to("tpu").to("cuda").cpu(), values)
    back = torch.zeros(2, 3, device="cuda")
    back.copy_(values.to("tpu"))
    assert torch.equal(back.cpu(), values)
