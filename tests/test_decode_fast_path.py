"""Graph mode's cheap path for a step called again like its previous call (hf_tpu/compile/fast_call.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_llama, to_tpu
from hf_tpu.compile import compile_stats, fast_call, graph_lowering

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _step(cache, weight, x, position):
    cache.index_copy_(0, position, x @ weight)
    return torch.tanh(cache).sum(0)


def _inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(1, 8, generator=generator), torch.tensor([step])


def test_a_step_called_again_with_the_same_cache_and_weights_takes_the_cheap_path():
    torch.manual_seed(0)
    cpu_cache, cpu_weight = torch.zeros(6, 4), torch.randn(8, 4)
    cache, weight = to_tpu(cpu_cache), to_tpu(cpu_weight)
    compiled = torch.compile(_step, backend="tpu", fullgraph=True)
    for step in range(6):
        x, position = _inputs(step)
        if step == 3:  # written in place between steps: the weight's new array must be what the step reads
            cpu_weight.mul_(2)
            weight.mul_(2)
        result = compiled(cache, weight, to_tpu(x), to_tpu(position))
        torch.testing.assert_close(result.cpu(), _step(cpu_cache, cpu_weight, x, position))
    torch.testing.assert_close(cache.cpu(), cpu_cache)
    stats = compile_stats()
    assert stats["compilations"] == 1 and stats["calls"] == 6
    assert stats["fast_calls"] == 5  # every call after the first


def test_a_new_cache_passed_at_every_step_is_read_in_full_only_at_its_first_step(monkeypatch):
    full_reads = []
    read_new = fast_call.CallPlan._read_new

    def spy(plan, tensor, record):
        full_reads.append(tuple(tensor.shape))
        return read_new(plan, tensor, record)

    monkeypatch.setattr(fast_call.CallPlan, "_read_new", spy)
    torch.manual_seed(0)
    cpu_weight = torch.randn(8, 4)
    weight = to_tpu(cpu_weight)
    compiled = torch.compile(_step, backend="tpu", fullgraph=True)
    for _ in range(2):  # two generates, each with a cache of its own
        cpu_cache = torch.zeros(6, 4)
        cache = to_tpu(cpu_cache)
        for step in range(4):
            x, position = _inputs(step)
            result = compiled(cache, weight, to_tpu(x), to_tpu(position))
            torch.testing.assert_close(result.cpu(), _step(cpu_cache, cpu_weight, x, position))
        torch.testing.assert_close(cache.cpu(), cpu_cache)
    assert compile_stats()["fast_calls"] == 7
    assert full_reads.count((6, 4)) == 1  # the second cache at its first step; then it is the record


def _lowered_graph(monkeypatch, fn, *args) -> graph_lowering.CompiledGraph:
    """The CompiledGraph torch.compile builds for ``fn`` on ``args``, to call directly with other inputs."""
    from hf_tpu.compile import backend

    graphs = []
    lower = backend.lower

    def spy(graph_module):
        graphs.append(lower(graph_module))
        return graphs[-1]

    monkeypatch.setattr(backend, "lower", spy)
    torch.compile(fn, backend="tpu", fullgraph=True)(*args)
    (graph,) = graphs
    return graph


def _scale_into(buffer, x):
    buffer.add_(x * 3)
    return buffer * 2


def test_inputs_unlike_the_last_call_take_the_full_path_and_give_the_same_results(monkeypatch):
    buffer, mirror = torch.zeros(4, 4, device="tpu"), torch.zeros(4, 4)
    graph = _lowered_graph(monkeypatch, _scale_into, buffer, torch.ones(4, 4, device="tpu"))
    _scale_into(mirror, torch.ones(4, 4))

    def check(target: torch.Tensor, x: torch.Tensor, target_mirror: torch.Tensor, fast_path: bool) -> None:
        fast = compile_stats()["fast_calls"]
        (result,) = graph([target, x])
        torch.testing.assert_close(result.cpu(), _scale_into(target_mirror, x.cpu()), rtol=0, atol=0)
        torch.testing.assert_close(target.cpu(), target_mirror, rtol=0, atol=0)
        assert compile_stats()["fast_calls"] == fast + fast_path

    check(buffer, torch.ones(4, 4, device="tpu"), mirror, fast_path=True)  # a new x of the same shape
    big = torch.arange(32, dtype=torch.float32, device="tpu").reshape(4, 8)
    check(buffer, big[:, ::2], mirror, fast_path=True)  # a strided view: read through its view, the same program
    check(buffer, torch.full((4, 4), 2.0), mirror, fast_path=False)  # on the host: the full path places it
    check(buffer, torch.ones(4, 4, device="tpu"), mirror, fast_path=True)  # back on tpu: the same program again
    buffer.t_(), mirror.t_()  # the same tensor, transposed in place: read (and written) through its new view
    check(buffer, torch.ones(4, 4, device="tpu"), mirror, fast_path=False)  # a view's array is not donated

    compilations = compile_stats()["compilations"]
    check(torch.zeros(4, 8, device="tpu"), torch.ones(4, 8, device="tpu"), torch.zeros(4, 8), fast_path=False)
    assert compile_stats()["compilations"] == compilations + 1  # another shape: a program of its own


def test_mutated_inputs_are_written_whole_or_through_their_view_on_the_cheap_path():
    compiled = torch.compile(_scale_into, backend="tpu", fullgraph=True)
    whole, whole_mirror = torch.zeros(2, 4, device="tpu"), torch.zeros(2, 4)
    base, base_mirror = torch.zeros(3, 4, device="tpu"), torch.zeros(3, 4)
    for target, mirror in ((lambda: whole, whole_mirror), (lambda: base[1:], base_mirror[1:])):  # a new view each call
        for step in range(3):
            x = torch.full((2, 4), float(step + 1))
            result = compiled(target(), x.to("tpu"))
            torch.testing.assert_close(result.cpu(), _scale_into(mirror, x), rtol=0, atol=0)
    torch.testing.assert_close(whole.cpu(), whole_mirror, rtol=0, atol=0)
    torch.testing.assert_close(base.cpu(), base_mirror, rtol=0, atol=0)
    # the second and third call of each: the view's first call takes the full path (a view is not donated)
    assert compile_stats()["fast_calls"] == 4


def test_a_held_array_is_not_donated_on_the_cheap_path():
    compiled = torch.compile(_scale_into, backend="tpu", fullgraph=True)
    buffer, x = torch.zeros(8, device="tpu"), torch.ones(8, device="tpu")
    for _ in range(3):
        compiled(buffer, x)
    from hf_tpu.backend import storage

    held = storage.read(buffer)
    compiled(buffer, x)  # the same inputs, but the buffer's array is held: not donated, so not the cheap path
    assert not held.is_deleted() and held.tolist() == [9.0] * 8 and buffer.cpu().tolist() == [12.0] * 8
    assert compile_stats()["fast_calls"] == 2


def test_static_cache_decode_steps_take_the_cheap_path_with_the_tokens_of_cpu(monkeypatch):
    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")  # transformers' loop, a compiled step per token
    cpu_model = tiny_llama(tie_word_embeddings=False).eval()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    expected = cpu_model.generate(prompt, max_new_tokens=8, do_sample=False)
    for _ in range(2):
        result = tpu_model.generate(to_tpu(prompt), max_new_tokens=8, do_sample=False, cache_implementation="static")
        assert result.cpu().tolist() == expected.tolist()
    stats = compile_stats()
    # one program at most: a test before this one in the process may have compiled the same decode step
    assert stats["compilations"] <= 1 and stats["calls"] == 14  # 7 decode steps per generate
    assert stats["fast_calls"] >= 12  # all but the first step of each generate (new cache tensors)
