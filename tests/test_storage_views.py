"""The storage model: views alias their base, version counters, data_ptr identity, shared-storage detection."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same, check_against_cpu

VIEWS = {
    "view": lambda t: t.view(3, 8),
    "view_flat": lambda t: t.view(-1),
    "reshape": lambda t: t.reshape(2, 12),
    "slice": lambda t: t[1:3],
    "slice_columns": lambda t: t[:, 2:5],
    "slice_steps": lambda t: t[::2, 1::3],
    "select": lambda t: t[2],
    "select_column": lambda t: t.select(1, 4),
    "transpose": lambda t: t.transpose(0, 1),
    "t": lambda t: t.t(),
    "permute": lambda t: t.view(2, 2, 6).permute(2, 0, 1),
    "squeeze": lambda t: t[1:2].squeeze(0),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "diagonal": lambda t: t.diagonal(),
    "diagonal_offset": lambda t: t.diagonal(offset=2),
    "narrow": lambda t: t.narrow(1, 1, 3),
    "split": lambda t: t.split(4, dim=1)[1],
    "chunk": lambda t: t.chunk(2, dim=0)[1],
    "unbind": lambda t: t.unbind(1)[3],
    "unfold": lambda t: t.unfold(1, 2, 2),
    "as_strided": lambda t: t.as_strided((3, 2), (5, 1), 2),
    "alias": lambda t: torch.ops.aten.alias(t),
    "detach": lambda t: t.detach(),
    "view_as_int32": lambda t: t.view(torch.int32),
    "view_as_int16": lambda t: t.view(torch.int16),
    "view_as_uint8": lambda t: t.view(torch.uint8),
    "view_as_complex": lambda t: torch.view_as_complex(t.view(4, 3, 2)),
    "chained": lambda t: t.t()[1:5].narrow(1, 1, 2),
}

MUTATIONS = {
    "add_": lambda v: v.add_(1),
    "mul_": lambda v: v.mul_(2),
    "copy_from_host": lambda v: v.copy_(torch.arange(100, 100 + v.numel()).reshape(v.shape)),
    "copy_from_device": lambda v: v.copy_(torch.full(v.shape, 3, dtype=v.dtype).to(v.device)),
    "fill_": lambda v: v.fill_(7),
    "zero_": lambda v: v.zero_(),
    "setitem_ellipsis": lambda v: v.__setitem__(Ellipsis, 5),
    "setitem_slice": lambda v: v.__setitem__((Ellipsis, slice(None, None, 2)), -1),
    "setitem_zero_dim_tensor": lambda v: v.__setitem__(0, torch.tensor(9)),
    "setitem_index_tensor": lambda v: v.__setitem__(torch.tensor([0]), 4),
}


def _fresh_base(device: str) -> torch.Tensor:
    """A (4, 6) float32 tensor that is not itself a view."""
    return torch.arange(24, dtype=torch.float32).reshape(4, 6).clone().to(device)


def _mutate_through_view(device: str, view_fn, mutate) -> dict:
    base = _fresh_base(device)
    other_view = base.view(-1)
    view = view_fn(base)
    versions_before = (base._version, view._version)
    mutate(view)
    return {
        "base": base,
        "other_view": other_view,
        "view": view,
        "view_base_is_base": view._base is base,
        "versions_before": versions_before,
        "versions_after": (base._version, view._version, other_view._version),
    }


@pytest.mark.parametrize("mutation", MUTATIONS.values(), ids=MUTATIONS.keys())
@pytest.mark.parametrize("view_fn", VIEWS.values(), ids=VIEWS.keys())
def test_inplace_on_view_updates_base_and_other_views(view_fn, mutation):
    expected = _mutate_through_view("cpu", view_fn, mutation)
    actual = _mutate_through_view("tpu", view_fn, mutation)
    for key in ("base", "other_view", "view"):
        assert_same(actual[key], expected[key], rtol=0, atol=0, equal_nan=True)  # NaN: bits written via int32
    for key in ("view_base_is_base", "versions_before", "versions_after"):
        assert actual[key] == expected[key], key


@pytest.mark.parametrize("view_fn", VIEWS.values(), ids=VIEWS.keys())
def test_view_reads_base_writes(view_fn):
    def write_base_then_read_view(base):
        view = view_fn(base)
        base.mul_(-1)
        return view

    assert_same(write_base_then_read_view(_fresh_base("tpu")), write_base_then_read_view(_fresh_base("cpu")))


@pytest.mark.parametrize("view_fn", VIEWS.values(), ids=VIEWS.keys())
def test_view_geometry_and_pointers_match_cpu(view_fn):
    cpu_base, tpu_base = _fresh_base("cpu"), _fresh_base("tpu")
    cpu_view, tpu_view = view_fn(cpu_base), view_fn(tpu_base)
    assert tpu_view.shape == cpu_view.shape
    assert tpu_view.stride() == cpu_view.stride()
    assert tpu_view.storage_offset() == cpu_view.storage_offset()
    assert tpu_view.is_contiguous() == cpu_view.is_contiguous()
    assert tpu_view.untyped_storage().data_ptr() == tpu_base.untyped_storage().data_ptr()
    assert tpu_view.data_ptr() - tpu_base.data_ptr() == cpu_view.data_ptr() - cpu_base.data_ptr()
    assert tpu_view.untyped_storage().nbytes() == cpu_view.untyped_storage().nbytes() == 96


COMPLEX_VIEWS = {
    "view_as_real": torch.view_as_real,
    "real": lambda t: t.real,
    "imag": lambda t: t.imag,
    "view_as_float32": lambda t: t.view(torch.float32),
}


@pytest.mark.parametrize("mutation", ["add_", "fill_", "copy_from_host", "setitem_slice"])
@pytest.mark.parametrize("view_fn", COMPLEX_VIEWS.values(), ids=COMPLEX_VIEWS.keys())
def test_real_views_of_complex_alias_base(view_fn, mutation):
    def mutate(device):
        base = torch.complex(torch.arange(6.0), -torch.arange(6.0)).reshape(2, 3).to(device)
        view = view_fn(base)
        MUTATIONS[mutation](view)
        return base, view

    assert_same(mutate("tpu"), mutate("cpu"), rtol=0, atol=0)


def test_expand_aliases_base():
    def expand_then_write_base(base):
        expanded = base[:, :1].expand(4, 3)
        base.add_(10)
        return expanded, expanded.stride()

    cpu_result = expand_then_write_base(_fresh_base("cpu"))
    tpu_result = expand_then_write_base(_fresh_base("tpu"))
    assert_same(tpu_result[0], cpu_result[0])
    assert tpu_result[1] == cpu_result[1] == (6, 0)


OVERLAP_WRITES = {
    "add_": lambda v: v.add_(1),
    "copy_": lambda v: v.copy_(torch.ones(v.shape)),
    "copy_broadcast": lambda v: v.copy_(torch.ones(1)),
}


@pytest.mark.parametrize("write", OVERLAP_WRITES.values(), ids=OVERLAP_WRITES.keys())
@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_write_into_expanded_view_is_rejected_as_on_cpu(device, write):
    expanded = _fresh_base(device)[:, :1].expand(4, 3)
    with pytest.raises(RuntimeError, match="single memory location"):
        write(expanded)


@pytest.mark.parametrize("fill", [lambda v: v.fill_(2), lambda v: v.zero_()], ids=["fill_", "zero_"])
def test_fill_of_expanded_view_is_allowed_as_on_cpu(fill):
    def fill_expanded(base):
        fill(base[:, :1].expand(4, 3))
        return base

    assert_same(fill_expanded(_fresh_base("tpu")), fill_expanded(_fresh_base("cpu")))


def test_reshape_of_non_contiguous_copies_as_on_cpu():
    def reshape_transposed(base):
        copied = base.t().reshape(-1)
        copied.fill_(0)
        return base, copied._base is None

    assert_same(reshape_transposed(_fresh_base("tpu")), reshape_transposed(_fresh_base("cpu")))


def test_version_counter_of_leaf_tracks_inplace_ops():
    for device in ("cpu", "tpu"):
        tensor = _fresh_base(device)
        assert tensor._version == 0 and tensor._base is None
        tensor.add_(1)
        tensor[0].zero_()
        tensor.copy_(torch.ones(4, 6))
        assert tensor._version == 3, device


def test_distinct_tensors_have_distinct_nonzero_pointers():
    tensors = [torch.zeros(n, device="tpu") for n in (1, 7, 64, 1000)] + [torch.empty(5, device="tpu")]
    pointers = [t.untyped_storage().data_ptr() for t in tensors]
    assert all(pointers) and len(set(pointers)) == len(pointers)
    for tensor in tensors:
        assert tensor.untyped_storage().nbytes() == tensor.numel() * 4
        assert tensor.data_ptr() == tensor.untyped_storage().data_ptr()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "live storages overlap"


def test_empty_tensor_has_null_data_ptr_as_on_cpu():
    empty = torch.zeros(0, device="tpu")
    assert empty.data_ptr() == torch.zeros(0).data_ptr() == 0
    assert empty.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_storage_nbytes_per_dtype(dtype):
    tensor = torch.zeros(3, 5, dtype=dtype).to("tpu")
    assert tensor.untyped_storage().nbytes() == 15 * dtype.itemsize
    assert tensor.element_size() == dtype.itemsize
    assert tensor.nbytes == 15 * dtype.itemsize


def test_transformers_id_tensor_storage():
    from transformers.pytorch_utils import id_tensor_storage

    first, second = torch.zeros(4, 4, device="tpu"), torch.zeros(4, 4, device="tpu")
    tied = torch.nn.Parameter(first)
    assert id_tensor_storage(first) != id_tensor_storage(second)
    assert id_tensor_storage(first) == id_tensor_storage(tied) == id_tensor_storage(first.view(16))
    assert id_tensor_storage(first)[0] == torch.device("tpu:0")


def test_huggingface_hub_finds_shared_tensors():
    from huggingface_hub.serialization._torch import _find_shared_tensors, get_torch_storage_id

    weight = torch.zeros(4, 4, device="tpu")
    state_dict = {"a": weight, "b": weight, "c": weight[1:].view(-1), "d": torch.zeros(4, 4, device="tpu")}
    groups = sorted(sorted(group) for group in _find_shared_tensors(state_dict))
    assert groups == [["a", "b", "c"], ["d"]]
    assert get_torch_storage_id(state_dict["a"]) == get_torch_storage_id(state_dict["b"])
    assert get_torch_storage_id(state_dict["a"]) != get_torch_storage_id(state_dict["d"])


def test_save_and_reload_tiny_tied_model(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config).eval()
    reference = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.to("tpu")
    assert model.lm_head.weight is model.transformer.wte.weight
    model.save_pretrained(tmp_path)

    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


def test_lazily_conjugated_and_negated_views_read_and_write_as_on_cpu():
    values = torch.randn(2, 3, dtype=torch.complex64)

    def touch(tensor):
        conjugated = tensor.conj()
        read = (conjugated * 2, torch._neg_view(tensor) + 1, conjugated.resolve_conj())
        conjugated[0].copy_(torch.full((3,), 1 + 2j))
        return read + (tensor,)

    check_against_cpu(lambda tensor: touch(tensor.clone()), values)


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_clone_of_a_view_has_cpus_strides_and_its_own_storage(name):
    def clone_then_write(device: str) -> tuple[list, list]:
        base = _fresh_base(device)
        copies = [VIEWS[name](base).clone(), VIEWS[name](base).clone(memory_format=torch.contiguous_format)]
        base.mul_(-1)  # a write to the source after the clone ...
        copies[0].add_(1)  # ... and to the clone: neither sees the other
        return [t.cpu() for t in [base] + copies], [c.stride() for c in copies]

    values, strides = clone_then_write("tpu")
    expected_values, expected_strides = clone_then_write("cpu")
    assert strides == expected_strides
    for value, expected in zip(values, expected_values):
        torch.testing.assert_close(value, expected, rtol=0, atol=0)


LAYOUTS = {
    "permuted_slice": lambda t: t.permute(0, 2, 3, 1)[:, 1:3],
    "expanded_steps": lambda t: t.expand(3, 2, 3, 4, 5)[:, :, ::2],
    "transposed_steps": lambda t: t.transpose(1, 3)[:, ::2],
    "channels_last_slice": lambda t: t.contiguous(memory_format=torch.channels_last)[:, :, 1:3],
    "expanded_transposed": lambda t: t[:, :, :, None].expand(2, 3, 4, 3, 5).transpose(0, 4),
    "reversed_slices": lambda t: t.permute(3, 2, 1, 0)[::2, :, :1],
    "size_one_transposed": lambda t: t[0, 0, :, :1].t(),
    "empty_transposed": lambda t: t[:, :0].transpose(0, 1),
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_copies_of_strided_tensors_take_cpus_strides(name):
    """``clone``, ``empty_like`` and ``to`` keep the source's layout as CPU does: its strides when it is dense,
    else dense strides in its order of dims."""
    base = torch.arange(120.0).reshape(2, 3, 4, 5)
    cpu, tpu = LAYOUTS[name](base), LAYOUTS[name](base.to("tpu"))
    for copy in (torch.clone, torch.empty_like, lambda t: t.to(torch.float64)):
        assert copy(tpu).stride() == copy(cpu).stride()
    torch.testing.assert_close(tpu.clone().cpu(), cpu.clone(), rtol=0, atol=0)
