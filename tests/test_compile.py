"""torch.compile(backend="tpu"): each Dynamo graph runs as one jitted XLA program built from the op table."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import tiny_llama, to_tpu
from hf_tpu.compile import compile_stats

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_mlp_forward_and_backward_match_cpu():
    cpu_model = _mlp()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    x = torch.randn(5, 8)
    expected = cpu_model(x).square().mean()
    expected.backward()

    compiled = torch.compile(tpu_model, backend="tpu", fullgraph=True)
    result = compiled(to_tpu(x)).square().mean()
    result.backward()

    torch.testing.assert_close(result.cpu(), expected.detach())
    for tpu_param, cpu_param in zip(tpu_model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(tpu_param.grad.cpu(), cpu_param.grad)


def test_each_graph_is_one_jitted_program_traced_once():
    compiled = torch.compile(_mlp().to("tpu"), backend="tpu", fullgraph=True)
    x = torch.randn(5, 8, device="tpu")
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
    stats = compile_stats()
    assert (stats["graphs"], stats["compilations"], stats["cache_hits"], stats["calls"]) == (1, 1, 2, 3)


def _update(buffer, index, values):
    buffer.index_copy_(0, index, values)
    buffer.add_(1)
    return buffer.sum()


def test_input_mutations_are_applied_to_the_callers_tensors():
    buffer, index, values = torch.zeros(4, 3), torch.tensor([1, 3]), torch.randn(2, 3)
    tpu_buffer, tpu_index, tpu_values = to_tpu((buffer, index, values))
    expected = _update(buffer, index, values)

    result = torch.compile(_update, backend="tpu", fullgraph=True)(tpu_buffer, tpu_index, tpu_values)

    torch.testing.assert_close(result.cpu(), expected)
    torch.testing.assert_close(tpu_buffer.cpu(), buffer)
    assert compile_stats()["calls"] == 1


def _write_and_read_rows(cache, layer_views, rows, values, read):
    """As continuous batching's paged cache: rows written into, and read from, views of one large buffer."""
    outputs = []
    for view, layer_values in zip(layer_views, values):
        view.index_copy_(0, rows, layer_values)
        outputs.append(view.index_select(0, read))
    return torch.stack(outputs)


@pytest.fixture
def folded(monkeypatch, tmp_path):
    """What ``row_updates.fold`` rewrote in each graph compiled in the test: (writes, reads)."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    from hf_tpu.compile import row_updates

    # traced here, not loaded from an earlier run's warm-start entry (whose graph is saved rewritten already)
    monkeypatch.setattr(AOTAutogradCache, "_get_tmp_dir", classmethod(lambda cls: str(tmp_path / "aotautograd")))
    rewritten = []
    fold = row_updates.fold
    monkeypatch.setattr(row_updates, "fold", lambda graph_module: rewritten.append(fold(graph_module)))
    return rewritten


def test_rows_written_and_read_through_views_of_a_buffer_touch_only_those_rows(folded):
    torch.manual_seed(0)
    cache = torch.randn(64 * 3, 2, 4)
    views = [cache[16:], cache[72:], cache.view(-1)[8:].view(-1, 2, 4)]  # the last at an offset of one row
    rows, read = torch.tensor([3, 0, 9]), torch.tensor([9, 3, 1, 0, 40])
    values = torch.randn(3, 3, 2, 4)
    tpu_cache = cache.to("tpu")
    tpu_views = [tpu_cache[16:], tpu_cache[72:], tpu_cache.view(-1)[8:].view(-1, 2, 4)]
    expected = _write_and_read_rows(cache, views, rows, values, read)

    result = torch.compile(_write_and_read_rows, backend="tpu", fullgraph=True)(
        tpu_cache, tpu_views, rows.to("tpu"), values.to("tpu"), read.to("tpu"))

    torch.testing.assert_close(result.cpu(), expected)
    torch.testing.assert_close(tpu_cache.cpu(), cache)
    assert folded == [(3, 3)]  # each layer's write and read became a scatter and a gather of its rows
    assert compile_stats()["fallbacks"] == 0


def _write_and_read_tokens_of_pages(page_views, rows, values, read):
    """As the decode fast path of continuous batching: each layer's pages seen as tokens, written and read."""
    outputs = []
    for pages, layer_values in zip(page_views, values):
        tokens = pages.view(-1, 2, 4)
        tokens.index_copy_(0, rows, layer_values)
        outputs.append(tokens.index_select(0, read))
    return torch.stack(outputs)


def test_rows_written_and_read_through_pages_seen_as_tokens_touch_only_those_rows(folded):
    torch.manual_seed(0)
    cache = torch.randn(64 * 8, 2, 4)
    tpu_cache = cache.to("tpu")
    pages = [lambda c: c[8:].view(-1, 8, 2, 4)[:60], lambda c: c[16:].view(-1, 8, 2, 4)[:60]]  # two layers' pages
    rows, read = torch.tensor([3, 0, 90]), torch.tensor([90, 3, 1, 0, 400])
    values = torch.randn(2, 3, 2, 4)
    expected = _write_and_read_tokens_of_pages([view(cache) for view in pages], rows, values, read)

    # dynamic: the page length is a symbolic size, as in a compiled continuous-batching step
    result = torch.compile(_write_and_read_tokens_of_pages, backend="tpu", fullgraph=True, dynamic=True)(
        [view(tpu_cache) for view in pages], rows.to("tpu"), values.to("tpu"), read.to("tpu"))

    torch.testing.assert_close(result.cpu(), expected)
    torch.testing.assert_close(tpu_cache.cpu(), cache)
    assert folded == [(2, 2)]
    assert compile_stats()["fallbacks"] == 0


def test_the_row_ops_a_graph_is_rewritten_with_also_run_op_by_op():
    """A rewritten graph that falls back to eager mode runs them as torch ops, on tpu as on CPU."""
    from hf_tpu.compile import row_updates  # noqa: F401  (defines the ops)

    base, rows, source = torch.arange(24.0).reshape(6, 4), torch.tensor([0, 2]), torch.full((2, 4), -1.0)
    for device in ("cpu", "tpu"):
        written = torch.ops.hf_tpu.row_scatter(*to_tpu((base, rows, source)) if device == "tpu" else
                                               (base, rows, source), 4, 4)
        read = torch.ops.hf_tpu.row_gather(base.to(device), rows.to(device), [4], 4)
        assert written.cpu()[[1, 3]].eq(-1).all() and written.cpu()[[0, 2, 4, 5]].equal(base[[0, 2, 4, 5]])
        assert read.cpu().equal(base[[1, 3]])


def _views_and_factories(x):
    left, right = x.t().split([2, 3], dim=0)
    rows = torch.unbind(x[1:, ::2].unsqueeze(0).expand(2, -1, -1), dim=1)
    ones = torch.ones(3, dtype=torch.int32, device=x.device)
    half = torch.full_like(x, 0.5).to(torch.bfloat16)
    return left.permute(1, 0).reshape(-1) * 2, right.squeeze(), rows[0] + ones, half


def test_graph_mode_views_factories_and_casts_match_cpu():
    x = torch.randn(4, 5)
    expected = _views_and_factories(x)
    result = torch.compile(_views_and_factories, backend="tpu", fullgraph=True)(to_tpu(x))
    for actual, wanted in zip(result, expected):
        assert actual.device.type == "tpu" and actual.dtype == wanted.dtype
        torch.testing.assert_close(actual.cpu(), wanted)


def test_a_dtype_view_in_a_graph_reads_the_same_bytes_as_on_cpu(monkeypatch):
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")

    def bits(x, packed, flags):
        return x.view(torch.int16) + 1, packed.view(torch.float32) * 2, x.view(torch.complex64), flags.view(torch.bool)

    x, packed = torch.randn(3, 4), torch.randn(2, 4).view(torch.int8)
    flags = torch.tensor([0, 1, 1, 0], dtype=torch.uint8)
    for actual, wanted in zip(torch.compile(bits, backend="tpu")(*to_tpu((x, packed, flags))), bits(x, packed, flags)):
        assert actual.shape == wanted.shape and actual.dtype == wanted.dtype
        torch.testing.assert_close(actual.cpu(), wanted)
    assert compile_stats()["fallbacks"] == 0


def test_backward_with_symbolic_sizes_matches_cpu(monkeypatch):
    """With ``dynamic=True`` the forward graph hands the sizes its backward needs out as numbers."""
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")

    def loss(x, w):
        return (x.reshape(-1, x.shape[-1] * 2) @ w).square().sum()

    compiled = torch.compile(loss, backend="tpu", dynamic=True)
    for rows in (3, 5):
        x, w = torch.randn(4, rows, 6, requires_grad=True), torch.randn(12, 2, requires_grad=True)
        tpu_x, tpu_w = to_tpu((x, w))
        loss(x, w).backward()
        compiled(tpu_x, tpu_w).backward()
        torch.testing.assert_close(tpu_x.grad.cpu(), x.grad)
        torch.testing.assert_close(tpu_w.grad.cpu(), w.grad)
    assert compile_stats()["fallbacks"] == 0


def test_complex_rotary_embedding_forward_and_backward_match_cpu(monkeypatch):
    """TorchTitan's rotary embedding: view_as_complex, a complex product, view_as_real, in one program each way."""
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")

    def rotary(x, frequencies):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rotated = torch.view_as_real(pairs * frequencies).flatten(-2)
        return (rotated.type_as(x) * torch.arange(16.0, device=x.device)).square().sum()

    torch.manual_seed(0)
    x = torch.randn(2, 8, 4, 16, requires_grad=True)
    frequencies = torch.polar(torch.ones(8, 1, 8), torch.randn(8, 1, 8))
    tpu_x = x.detach().to("tpu").requires_grad_()
    expected, result = rotary(x, frequencies), torch.compile(rotary, backend="tpu")(tpu_x, frequencies.to("tpu"))
    expected.backward()
    result.backward()
    torch.testing.assert_close(result.cpu(), expected)
    torch.testing.assert_close(tpu_x.grad.cpu(), x.grad)
    assert compile_stats()["fallbacks"] == 0


_LIBRARY = torch.library.Library("hf_tpu_test_compile", "DEF")
_LIBRARY.define("mystery(Tensor x) -> Tensor")
_LIBRARY.impl("mystery", lambda x: x.clone(), "CompositeExplicitAutograd")


def test_a_graph_with_an_op_without_a_lowering_runs_eagerly_with_a_warning(monkeypatch):
    compiled = torch.compile(lambda x: torch.ops.hf_tpu_test_compile.mystery(x) + 1, backend="tpu")
    with pytest.warns(UserWarning, match="no lowering for the operator hf_tpu_test_compile::mystery"):
        result = compiled(torch.ones(2, device="tpu"))
    assert result.device.type == "tpu" and result.cpu().tolist() == [2.0, 2.0]
    assert compile_stats()["fallbacks"] == 1


def test_strict_compile_names_the_op_without_a_lowering(monkeypatch):
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")
    compiled = torch.compile(lambda x: torch.ops.hf_tpu_test_compile.mystery(x) * 3, backend="tpu")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as error:
        compiled(torch.ones(2, device="tpu"))
    assert isinstance(error.value.inner_exception, NotImplementedError)
    assert "no lowering for the operator hf_tpu_test_compile::mystery" in str(error.value)


def test_tiny_llama_forward_matches_cpu():
    cpu_model = tiny_llama(tie_word_embeddings=False).eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    input_ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = cpu_model(input_ids).logits
        result = torch.compile(tpu_model, backend="tpu")(to_tpu(input_ids)).logits
    torch.testing.assert_close(result.cpu(), expected, atol=1e-4, rtol=1e-4)
    assert compile_stats()["graphs"] == compile_stats()["calls"] == 1


def test_generate_with_a_static_cache_compiles_decoding_into_one_graph(monkeypatch):
    """In transformers' loop (``HF_TPU_STEPWISE_DECODE``), transformers compiles the decode step with
    backend="tpu"; the cache's index_copy_ writes persist."""
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")
    cpu_model = tiny_llama(tie_word_embeddings=False).eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    input_ids = torch.randint(0, 128, (1, 8))
    options = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
    expected = cpu_model.generate(input_ids, **options)
    result = tpu_model.generate(to_tpu(input_ids), **options)
    assert result.cpu().tolist() == expected.tolist()
    stats = compile_stats()
    # one graph, run for the 5 decode steps; one program at most: a test before this one in the process (another
    # file's, stepwise too) may have compiled the same decode step, whose program is then shared
    assert stats["graphs"] == 1 and stats["compilations"] + stats["cache_hits"] == 5 and stats["compilations"] <= 1


def test_a_cpu_tensor_updated_in_place_by_a_compiled_graph_is_written_on_the_cpu():
    """A graph of tpu tensors that also updates a CPU scalar in place (a counter, as torch's optimizers keep their
    step counts) writes the new value into the CPU tensor."""
    def scaled(x, counter):
        counter.add_(1)
        return x * counter

    compiled = torch.compile(scaled, backend="tpu")
    counter, expected_counter = torch.tensor(0.0), torch.tensor(0.0)
    x = torch.arange(3.0)
    for _ in range(3):
        result = compiled(x.to("tpu"), counter)
        expected = scaled(x, expected_counter)
        assert counter.device.type == "cpu" and float(counter) == float(expected_counter)
        torch.testing.assert_close(result.cpu(), expected)


def test_a_host_tensor_made_in_a_graph_crosses_a_graph_break(monkeypatch):
    """A tensor the traced code makes on the host from constants (Gemma's ``torch.tensor(hidden_size ** 0.5)``
    scale) and still needs after a graph break is an output of the graph before it: that graph is still one program
    (none op by op), the tensor comes back on the host, a copy of its own at each call, and the results are CPU's."""
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")

    def scaled(x):
        scale = torch.tensor(2.0, dtype=x.dtype)
        y = x * scale
        torch._dynamo.graph_break()
        return y + scale, scale

    compiled = torch.compile(scaled, backend="tpu")
    x = torch.arange(3.0)
    before = compile_stats()
    for _ in range(2):
        result, scale = compiled(x.to("tpu"))
        assert scale.device.type == "cpu" and float(scale) == 2.0
        torch.testing.assert_close(result.cpu(), scaled(x)[0])
        scale.add_(1)  # the caller's own copy
    assert compile_stats()["fallbacks"] == before["fallbacks"]


def _tail_of(tensor, start):
    return tensor[start:]


def test_a_view_of_an_input_at_a_symbolic_offset_is_that_view():
    """AOTAutograd rebuilds such an output from the tensor the graph returns: it must be the input's view (it read
    and wrote ``t[0:]``'s elements before)."""
    buffer = torch.arange(24.0).reshape(12, 2)
    tpu_buffer = buffer.to("tpu")
    tail = torch.compile(_tail_of, backend="tpu", dynamic=True)
    for start in (4, 5):  # the second call: the offset is a symbol of the graph
        view = tail(tpu_buffer, start)
        assert view.storage_offset() == 2 * start and view.cpu().equal(buffer[start:])
    view.mul_(-1)
    buffer[5:].mul_(-1)
    assert tpu_buffer.cpu().equal(buffer)
