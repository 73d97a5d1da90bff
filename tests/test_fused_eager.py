"""Fused eager mode: recorded ops give strict mode's results bit for bit, and the CPU's, run as cached programs."""

from __future__ import annotations

import inspect
import sys
import threading
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import four_chips
import hf_tpu
from conftest import tiny_llama
from hf_tpu.backend import checks, dispatch, fused, runtime, segmented_cache, storage


@pytest.fixture(autouse=True)
def strict_after():
    yield
    torch.tpu.set_eager_mode("strict")


def in_mode(mode: str, fn, *args):
    """``fn(*args)`` in an eager mode, its tensors brought to the CPU (the read is the sync point)."""
    torch.tpu.set_eager_mode(mode)
    try:
        return [t.cpu() for t in fn(*args)]
    finally:
        torch.tpu.set_eager_mode("strict")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns (so that NaNs and signed zeros compare too)."""
    if tensor.is_floating_point():
        return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.dtype.itemsize])
    return tensor


def assert_bitwise(actual: list, expected: list) -> None:
    """Bit for bit where chains isolate float ops; to rounding on a GPU, where XLA fuses across them
    (:func:`fused._build`)."""
    assert len(actual) == len(expected)
    for position, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, position
        if a.is_floating_point() and not fused._isolating():
            torch.testing.assert_close(a, e, equal_nan=True, msg=f"result {position}: fused differs from strict")
        else:
            assert torch.equal(bits(a), bits(e)), f"result {position}: fused differs from strict"


def pointwise_chain(a, b):
    x = a * b + a  # mul then add: a fused loop would contract them into one fma
    y = torch.exp(x) / (1 + b * b)
    z = (y.tanh() * 3 - x.sigmoid()).clamp(-1, 2)
    return [z, x.sum(0), (a > b).to(torch.int64).cumsum(1), torch.where(a > 0, a, b).mean()]


def test_pointwise_chain_matches_strict_and_cpu():
    torch.manual_seed(0)
    a, b = torch.randn(16, 24), torch.randn(16, 24)
    expected = pointwise_chain(a, b)
    strict = in_mode("strict", pointwise_chain, a.to("tpu"), b.to("tpu"))
    fused_results = in_mode("fused", pointwise_chain, a.to("tpu"), b.to("tpu"))
    assert_bitwise(fused_results, strict)
    for actual, reference in zip(fused_results, expected):
        torch.testing.assert_close(actual, reference)


def normalized(x, w, device="tpu"):
    x, w = x.to(device), w.to(device)  # copies recorded in fused mode: the whole computation is one chain
    y = torch.tanh(x @ w) * 0.5 + x.sin()
    divisor = y.abs().max() + 1
    return [y / divisor, divisor]  # divided by a value of the chain that is one of its results


def test_a_division_by_a_value_of_the_chain_matches_strict_and_cpu():
    """XLA rewrote a division by a broadcast parameter (strict mode) as a product with its reciprocal, but not one
    by a value of the chain that is also a result: fused and strict mode gave 347 elements of 1024 apart. Both
    divide now (``pointwise.divided``), as CPU does."""
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 32, generator=generator), torch.randn(32, 32, generator=generator)
    strict = in_mode("strict", normalized, x, w)
    assert_bitwise(in_mode("fused", normalized, x, w), strict)
    torch.testing.assert_close(strict[0], normalized(x, w, "cpu")[0])


def iterate_in_threads(mode: str, starts: list) -> list:
    """Each start iterated in a thread of its own, all at once (their ops interleave in the chains), in ``mode``."""
    def iterate(index: int) -> None:
        x, w = starts[index][0].to("tpu"), starts[index][1].to("tpu")
        for step in range(40):
            x = torch.tanh(x @ w) * 0.5 + x.sin()
            if step % 7 == 0:
                x = x / (x.abs().max() + 1)
            if step % 11 == 0:
                float(x.sum())  # a host read: a sync point amid the other threads' ops
        results[index] = x.cpu()

    torch.tpu.set_eager_mode(mode)
    results = [None] * len(starts)
    threads = [threading.Thread(target=iterate, args=(index,)) for index in range(len(starts))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        torch.tpu.set_eager_mode("strict")
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_threads_recording_at_once_get_strict_results():
    """Chaotic loops (a last-bit difference grows to O(1) within them) in four threads, with host reads."""
    generator = torch.Generator().manual_seed(0)
    starts = [(torch.randn(16, 16, generator=generator), torch.randn(16, 16, generator=generator)) for _ in range(4)]
    assert_bitwise(iterate_in_threads("fused", starts), iterate_in_threads("strict", starts))


def test_ops_are_recorded_until_a_value_is_read():
    a = torch.arange(6.0, device="tpu")
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    b = (a + 1) * 2
    assert torch.tpu.get_eager_mode() == "fused"
    assert fused.stats()["pending"] == 2 and fused.stats()["flushes"] == 0
    assert b.shape == (6,) and b.dtype == torch.float32  # known without running
    assert b.sum().item() == 42.0  # .item() is a sync point
    assert fused.stats()["pending"] == 0 and fused.stats()["flushes"] == 1
    c = b - 1
    torch.tpu.synchronize()
    assert fused.stats()["pending"] == 0 and fused.stats()["flushes"] == 2
    assert c.tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    if (c > 10).any():  # control flow on a tensor reads it
        assert fused.stats()["pending"] == 0


def shared_operands(tensors):
    divisor = 0.0316
    quotients = torch._foreach_div(tensors, [divisor, divisor, divisor])  # one Python float, three operands
    return list(quotients) + [tensors[0] / tensors[0], tensors[1] * 2 + tensors[1] * 3]


def test_an_array_read_twice_by_one_op_gives_strict_results():
    torch.manual_seed(2)
    tensors = [torch.randn(32, 32).abs() for _ in range(3)]
    strict = in_mode("strict", shared_operands, [t.to("tpu") for t in tensors])
    assert_bitwise(in_mode("fused", shared_operands, [t.to("tpu") for t in tensors]), strict)


def views_and_in_place(x):
    x = x.clone()
    rows = x[1:3]
    rows += 1  # through a view: the base sees it
    x.t()[0].mul_(2)  # a strided column
    x[:, -1] = x[:, 0]  # copy between views of one storage
    y = x.view(-1)[::5]
    y.sub_(0.5)
    diagonal = x.diagonal()
    diagonal.zero_()
    out = torch.empty(0, device=x.device)
    torch.add(x, rows.sum(), out=out)  # out= resizes
    return [x, rows, y, out, x.transpose(0, 1).contiguous() * 3]


def test_views_in_place_ops_and_aliasing_match_strict_and_cpu():
    torch.manual_seed(1)
    x = torch.randn(4, 5)
    expected = views_and_in_place(x)
    strict = in_mode("strict", views_and_in_place, x.to("tpu"))
    actual = in_mode("fused", views_and_in_place, x.to("tpu"))
    assert_bitwise(actual, strict)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_a_recorded_op_sees_its_inputs_as_they_were_when_recorded():
    x = torch.arange(4.0, device="tpu")
    torch.tpu.set_eager_mode("fused")
    doubled = x * 2
    x.add_(100)  # after the recorded read
    x.copy_(torch.full((4,), -1.0))  # a hand-written kernel writing the storage
    assert doubled.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert x.tolist() == [-1.0] * 4


def test_a_recorded_op_runs_as_it_was_traced_when_recorded():
    ints = torch.arange(3, device="tpu")
    torch.tpu.set_eager_mode("fused")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # read by the lowering when it is traced: at record time
    try:
        wide = ints + 2.5
    finally:
        torch.set_default_dtype(previous)
    narrow = ints + 2.5
    assert (wide.dtype, narrow.dtype) == (torch.float64, torch.float32)
    assert wide.cpu().dtype == torch.float64 and wide.tolist() == narrow.tolist() == [2.5, 3.5, 4.5]


def test_lazy_empty_and_copy_into_recorded_values():
    torch.tpu.set_eager_mode("fused")
    a = torch.ones(3, device="tpu") * 5
    b = torch.empty(3, device="tpu")
    b.copy_(a)
    c = torch.empty_like(a).fill_(2) + b
    assert c.tolist() == [7.0, 7.0, 7.0]


def copies(x, z):
    """Copies and casts on one chip, of pending values and of views of them."""
    y = x * 3
    into = torch.zeros(4, 6, device=x.device, dtype=torch.bfloat16)
    into[:, 1:4].copy_(y.t()[:4, :3])  # a view into a view, cast on the way
    halves = (y + 1).to(torch.float16)
    strided = y.t().contiguous().to(memory_format=torch.contiguous_format)
    real = torch.empty(4, device=x.device)
    with warnings.catch_warnings():  # the CPU warns once per process; tpu's warning is tested below
        warnings.simplefilter("ignore", UserWarning)
        real.copy_(z * 2)
    return [into, halves, strided, y.clone(), real]


def test_copies_on_one_chip_are_recorded_and_match_strict():
    x, z = torch.randn(6, 4), torch.randn(4, dtype=torch.complex64)
    expected = copies(x, z)
    strict = in_mode("strict", copies, x.to("tpu"), z.to("tpu"))
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    results = copies(x.to("tpu"), z.to("tpu"))
    assert fused.stats()["flushes"] == 0 and fused.stats()["pending"] > 0  # nothing ran yet
    actual = [t.cpu() for t in results]
    assert_bitwise(actual, strict)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        torch.empty(4, device="tpu").copy_(z.to("tpu") * 2)


def copies_of_computed(x, target):
    """Copies, casts and a view write whose inputs hold computed arrays (not values of the chain)."""
    target[1:3].copy_(x[0:2])  # a view read and a view write
    return [x[1:4, ::2].clone(), x.t().to(torch.bfloat16), x[:, 1].to(copy=True, dtype=torch.float32), target]


def test_copies_of_computed_values_are_recorded_too():
    """A view read, a cast or a view write of arrays already computed is recorded in fused mode like any op
    (run at once, each would be a program launch of its own), with strict mode's results."""
    x, target = torch.randn(6, 4), torch.zeros(4, 4)
    expected = copies_of_computed(x, target.clone())
    strict = in_mode("strict", copies_of_computed, x.to("tpu"), target.to("tpu"))
    inputs = [x.to("tpu"), target.to("tpu")]
    torch.tpu.synchronize()  # every input computed
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    results = copies_of_computed(*inputs)
    # the transposed bfloat16 copy keeps the source's strides (as on CPU): a view write into its new storage,
    # whose zeros (it was never written) are recorded too
    assert [op.name for op in fused._chain.ops] == ["view read", "view write", "view read", "view read", "cast",
                                                    "zeros", "view write", "view read"]
    assert fused.stats()["flushes"] == 0
    actual = [t.cpu() for t in results]
    assert_bitwise(actual, strict)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def fills_of_new_storages():
    filled = torch.empty(3, 4, device="tpu").fill_(2.0)
    written = torch.empty(4, 4, device="tpu")
    written[1:3] = 1.0  # rows 0 and 3 keep the zeros a tpu storage holds until it is written
    return [filled, written]


def test_a_never_written_storage_read_in_fused_mode_records_its_zeros():
    """A ``fill_`` or a write through a view of a new ``empty`` tensor reads its storage: in fused mode the zeros it
    holds are recorded in the chain (no program runs at once), with strict mode's results."""
    strict = [t.cpu() for t in in_mode("strict", fills_of_new_storages)]
    torch.tpu.synchronize()
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    results = fills_of_new_storages()
    names = [op.name for op in fused._chain.ops]
    # three storages never written: the two tensors and the one torch fills with the 1.0 it copies from
    assert names.count("zeros") == 3 and fused.stats()["flushes"] == 0, names
    assert_bitwise([t.cpu() for t in results], strict)


def tiny_training_step(model, ids):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    output = model(ids, labels=ids)
    output.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return [output.logits, output.loss] + grads + [p.detach() for p in model.parameters()]


def test_tiny_llama_forward_backward_and_adamw_step_match_strict_bitwise():
    ids = torch.arange(16).reshape(2, 8) % 128
    expected = tiny_training_step(tiny_llama(num_hidden_layers=1), ids)
    strict = in_mode("strict", tiny_training_step, tiny_llama(num_hidden_layers=1).to("tpu"), ids.to("tpu"))
    fused.reset_stats()
    actual = in_mode("fused", tiny_training_step, tiny_llama(num_hidden_layers=1).to("tpu"), ids.to("tpu"))
    assert fused.stats()["ops"] > 100  # forward, backward (from autograd's thread) and the optimizer were recorded
    assert_bitwise(actual, strict)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def random_ops(x):
    torch.manual_seed(7)
    noise = torch.randn(3, 4, device="tpu")
    dropped = torch.nn.functional.dropout(x * 2, p=0.5, training=True)
    uniform = torch.rand_like(x) + noise
    return [noise, dropped, uniform, torch.tpu.get_rng_state()]


def test_random_numbers_and_generator_state_match_strict():
    x = torch.ones(3, 4)
    assert_bitwise(in_mode("fused", random_ops, x.to("tpu")), in_mode("strict", random_ops, x.to("tpu")))


def test_a_loop_body_runs_one_cached_program():
    weight = torch.randn(8, 8, device="tpu")
    state = torch.zeros(8, device="tpu")
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    losses = []
    for _ in range(5):
        state = torch.tanh(weight @ state + 1)
        losses.append((state * state).sum().item())
    stats = fused.stats()
    assert stats["flushes"] == 5
    assert stats["program_misses"] == 1 and stats["program_hits"] == 4
    torch.tpu.set_eager_mode("strict")
    state = torch.zeros(8, device="tpu")
    for expected in losses:
        state = torch.tanh(weight @ state + 1)
        assert (state * state).sum().item() == expected


def train_eagerly(mode: str, model, inputs, targets, steps: int, loss_fn) -> tuple[list[float], list[dict]]:
    """``steps`` AdamW steps in eager ``mode``, each read by ``loss.item()``; the losses, and after each step the
    fused eager counters with the live tpu bytes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, counters = [], []
    torch.tpu.set_eager_mode(mode)
    fused.reset_stats()
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            loss = loss_fn(model, inputs, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            counters.append({**fused.stats(), "bytes": torch.tpu.memory_allocated()})
    finally:
        torch.tpu.set_eager_mode("strict")
    return losses, counters


def assert_steady_after(counters: list[dict], warmup: int) -> None:
    """No program built, no program cached and no tpu byte allocated after step ``warmup``: every chain of a
    later step ran a cached program."""
    settled, last = counters[warmup - 1], counters[-1]
    assert last["program_misses"] == settled["program_misses"]
    assert last["program_hits"] - settled["program_hits"] == last["flushes"] - settled["flushes"] > 0
    assert {c["programs"] for c in counters[warmup - 1:]} == {settled["programs"]}
    assert {c["bytes"] for c in counters[warmup - 1:]} == {settled["bytes"]}
    assert last["pending"] == 0


def mlp_loss(model, inputs, targets):
    return torch.nn.functional.mse_loss(model(inputs), targets)


def llama_loss(model, ids, _):
    return model(ids, labels=ids).loss


def test_a_thousand_training_steps_run_cached_programs_without_growth():
    def run(mode: str):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to("tpu")
        inputs, targets = torch.randn(32, 8).to("tpu"), torch.randn(32, 1).to("tpu")
        return train_eagerly(mode, model, inputs, targets, 1000, mlp_loss)

    strict_losses, _ = run("strict")
    losses, counters = run("fused")
    assert_bitwise([torch.tensor(losses)], [torch.tensor(strict_losses)])  # the Python floats of float32 values
    assert counters[-1]["ops"] >= 10 * 1000  # forward, backward and optimizer ops were recorded
    assert_steady_after(counters, warmup=5)


def test_a_loop_whose_numbers_come_to_be_equal_keeps_its_programs(monkeypatch):
    """A loop with no sync point (cut at the size bound) whose Python numbers come to be equal, as AdamW's bias
    corrections do once ``beta ** step`` vanishes: equal numbers are one cached scalar array, but each use of one
    is a slot of its own, so the chains keep their structure and their programs."""
    monkeypatch.setattr(fused, "MAX_OPS", 16)

    def run(mode: str) -> tuple[torch.Tensor, list[int]]:
        torch.tpu.set_eager_mode(mode)
        fused.reset_stats()
        x, programs = torch.zeros(4, device="tpu"), []
        try:
            for step in range(100):
                x.mul_(1 + 0.5**step).add_(1.0)  # from step 53 on, both numbers are 1.0
                programs.append(fused.stats()["programs"])
            return x.cpu(), programs
        finally:
            torch.tpu.set_eager_mode("strict")

    strict, _ = run("strict")
    result, programs = run("fused")
    assert torch.equal(bits(result), bits(strict))
    assert programs[30] == programs[-1] > 0, programs


def test_tiny_llama_training_steps_reach_a_steady_program_cache():
    ids = (torch.arange(16).reshape(2, 8) % 128).to("tpu")

    def run(mode: str):
        return train_eagerly(mode, tiny_llama(num_hidden_layers=1).to("tpu"), ids, None, 8, llama_loss)

    strict_losses, _ = run("strict")
    losses, counters = run("fused")
    assert_bitwise([torch.tensor(losses)], [torch.tensor(strict_losses)])
    assert_steady_after(counters, warmup=3)
    # two chains per step: the forward and backward, run where the backward pass ends; the optimizer's step (its
    # copies too), run by loss.item()
    assert [later["flushes"] - earlier["flushes"] for earlier, later in zip(counters, counters[1:])] == [2] * 7


def test_a_backward_pass_ends_its_chain():
    """The ops recorded up to the end of a backward pass run then (asynchronously), not at the next sync."""
    weight = torch.ones(3, device="tpu", requires_grad=True)
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    (weight * 2).sum().backward()
    assert fused.stats()["pending"] == 0 and fused.stats()["flushes"] == 1
    (gradient,) = torch.autograd.grad((weight * weight).sum(), weight)
    assert fused.stats()["pending"] == 0 and fused.stats()["flushes"] == 2
    assert weight.grad.tolist() == [2.0] * 3 and gradient.tolist() == [2.0] * 3


def test_the_program_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(fused, "PROGRAM_CACHE_SIZE", 2)
    torch.tpu.set_eager_mode("fused")
    for n in range(1, 6):
        assert (torch.ones(n, device="tpu") * 3).sum().item() == 3 * n
    assert fused.stats()["programs"] <= 2


def _gathered_chain(n: int, index: int):
    x = torch.arange(float(n), device="tpu") * 3 + 1
    return [torch.exp(x) / (1 + x * x), x[torch.tensor([index], device="tpu")]]


def test_a_cycle_of_structures_longer_than_the_cache_runs_evicted_ones_op_by_op(monkeypatch):
    """A generate loop gives each step a new chain structure (its token tensors grow), and the next call the same
    cycle again: evicted programs are not built again at each run; their chains run op by op, as strict mode."""
    monkeypatch.setattr(fused, "PROGRAM_CACHE_SIZE", 2)
    monkeypatch.setattr(fused, "_programs", segmented_cache.SegmentedCache(lambda: fused.PROGRAM_CACHE_SIZE))
    monkeypatch.setattr(fused, "_built", type(fused._built)())
    expected = [in_mode("strict", _gathered_chain, n, n - 1) for n in (1, 2, 3)]
    fused.reset_stats()
    for _ in range(3):
        for n, strict in zip((1, 2, 3), expected):
            assert_bitwise(in_mode("fused", _gathered_chain, n, n - 1), strict)
    stats = fused.stats()
    # built once each (the third evicts the first); then the first runs op by op, the others hit
    assert stats["program_misses"] - stats["op_by_op"] == 3 and stats["op_by_op"] == 2 and stats["program_hits"] == 4
    with pytest.raises(IndexError) as strict_error:  # an op-by-op chain raises a failed check at the sync
        in_mode("strict", _gathered_chain, 1, 5)
    with pytest.raises(IndexError) as fused_error:
        in_mode("fused", _gathered_chain, 1, 5)
    assert fused.stats()["op_by_op"] == 3 and str(fused_error.value) == str(strict_error.value)


def test_an_evicted_structure_that_comes_back_twice_in_a_short_cycle_gets_its_program_again(monkeypatch):
    """A loop body whose programs another workload evicted (a generate with growing token tensors between two
    decodes) runs op by op once, then, coming back within half the cache's size of chain runs, is built again."""
    monkeypatch.setattr(fused, "PROGRAM_CACHE_SIZE", 2)
    monkeypatch.setattr(fused, "_programs", segmented_cache.SegmentedCache(lambda: fused.PROGRAM_CACHE_SIZE))
    monkeypatch.setattr(fused, "_built", type(fused._built)())
    expected = [in_mode("strict", _gathered_chain, n, n - 1) for n in (1, 2, 3, 4)]
    fused.reset_stats()
    for n in (1, 2, 3, 4, 1, 1, 1):  # 1 built, evicted by 2, 3 and 4; back: op by op, built, found
        assert_bitwise(in_mode("fused", _gathered_chain, n, n - 1), expected[n - 1])
    stats = fused.stats()
    assert stats["op_by_op"] == 1 and stats["program_misses"] == 6 and stats["program_hits"] == 1


def test_one_off_chains_do_not_evict_a_loop_bodys_program(monkeypatch):
    """Programs found in the cache are evicted after those never found: a loop body's program outlives a run of
    one-off chains (a generate whose token tensors grow, between two runs of the loop)."""
    monkeypatch.setattr(fused, "PROGRAM_CACHE_SIZE", 4)
    monkeypatch.setattr(fused, "_programs", segmented_cache.SegmentedCache(lambda: fused.PROGRAM_CACHE_SIZE))
    monkeypatch.setattr(fused, "_built", type(fused._built)())
    expected = [in_mode("strict", _gathered_chain, n, n - 1) for n in range(1, 9)]
    fused.reset_stats()
    for n in (1, 1, *range(2, 9), 1):  # 1 built and found, 2..8 built once each, 1 found again
        assert_bitwise(in_mode("fused", _gathered_chain, n, n - 1), expected[n - 1])
    stats = fused.stats()
    assert stats["program_hits"] == 2 and stats["program_misses"] == 8 and stats["op_by_op"] == 0


@pytest.mark.parametrize("bound, value, size", [("MAX_OPS", 4, 3), ("MAX_WORK", 100, 30)], ids=["ops", "work"])
def test_the_chain_is_bounded(monkeypatch, bound, value, size):
    """At most 4 ops pending: 4 ops, or 4 ops of 30 elements (120 >= 100); then, where the loop body starts
    again, from half the bound on: chains of 4 + 2 + 2 + 2 ran, 2 ops pending."""
    monkeypatch.setattr(fused, bound, value)
    expected = x = torch.zeros(size, device="tpu")
    for _ in range(12):
        expected = expected.cos()  # not fusible (see the next test): counts its elements as work
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    for _ in range(12):
        x = x.cos()
        assert fused.stats()["pending"] <= 4
    assert fused.stats()["flushes"] == 4 and fused.stats()["pending"] == 2
    assert torch.equal(x.cpu(), expected.cpu())


def test_fusible_ops_are_not_work(monkeypatch):
    """Ops XLA fuses into one loop (:func:`fused._fusible`) do not count towards MAX_WORK: their chain is cut
    at MAX_OPS only."""
    monkeypatch.setattr(fused, "MAX_WORK", 100)
    x = torch.zeros(30, device="tpu")
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    for _ in range(12):
        x = x + 1
    assert fused.stats()["flushes"] == 0 and fused.stats()["pending"] == 12
    assert x.tolist() == [12.0] * 30


def test_a_loop_without_sync_points_is_cut_where_its_body_starts_again(monkeypatch):
    monkeypatch.setattr(fused, "MAX_OPS", 16)  # a body of 7 ops cut every 16 ops would start chains 7 ways

    def loop(x, w):
        for _ in range(100):
            x = (torch.tanh(x * w) + 0.5).sigmoid() * 2 - 1
            x = x.abs()
        return [x]

    x, w = torch.linspace(-1, 1, 5, device="tpu"), torch.full((5,), 0.9, device="tpu")
    strict = in_mode("strict", loop, x, w)
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    actual = [t.cpu() for t in loop(x, w)]
    stats = fused.stats()
    assert stats["ops"] == 700 and stats["flushes"] >= 700 // 16
    # the first chain (cut at 16 ops), then chains of two whole bodies from where it stopped, then the rest
    assert stats["program_misses"] <= 3
    assert_bitwise(actual, strict)


def test_a_sync_point_within_the_bound_ends_the_chain(monkeypatch):
    monkeypatch.setattr(fused, "MAX_OPS", 16)
    x = torch.ones(3, device="tpu")
    torch.tpu.set_eager_mode("fused")
    fused.reset_stats()
    for _ in range(5):  # 15 ops between syncs, the first 10 alike: one chain each
        for _ in range(10):
            x = x * 1.5
        y = (x - 1).abs().sqrt().exp()
        assert y.sum().item() > 0
    assert fused.stats()["flushes"] == 5 and fused.stats()["program_misses"] == 1


def test_a_chain_that_ran_keeps_no_inputs():
    torch.tpu.set_eager_mode("fused")
    x = torch.ones(1000, device="tpu") * 2
    x.cpu()
    array = storage.read(x)
    alive = weakref.ref(array)
    y = x + 1  # the chain holds x's array
    del x, array
    assert alive() is not None
    assert y.sum().item() == 3000.0
    assert alive() is None


def test_deferred_checks_are_raised_at_the_sync():
    values = torch.arange(3.0, device="tpu")
    index = torch.tensor([5], device="tpu")
    with pytest.raises(IndexError) as strict_error:
        values[index].cpu()
    torch.tpu.set_eager_mode("fused")
    picked = values[index]  # recorded, no error yet
    with pytest.raises(IndexError) as fused_error:
        picked.cpu()
    assert str(fused_error.value) == str(strict_error.value)


def test_debug_mode_raises_failed_checks_at_the_op():
    values = torch.arange(3.0, device="tpu")
    index = torch.tensor([5], device="tpu")
    torch.tpu.set_eager_mode("debug")
    with pytest.raises(IndexError, match="out of bounds"):
        values[index]  # no sync needed: the op itself raises
    assert (values * 2).tolist() == [0.0, 2.0, 4.0]


@pytest.fixture(scope="module")
def exploding_op():
    """A lowered op whose program fails when it runs (a host callback raising), not when it is traced."""
    library = torch.library.Library("hf_tpu_fused_test", "DEF")
    library.define("explode(Tensor x) -> Tensor")

    def host(values):
        raise ValueError("the device program failed")

    def explode(x):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    op = dispatch.resolve("hf_tpu_fused_test::explode")
    library.impl("explode", dispatch.build_kernel(op, dispatch.Lowering(explode)), "PrivateUse1")
    yield torch.ops.hf_tpu_fused_test.explode
    library._destroy()


def test_an_error_when_a_chain_runs_names_the_op_and_the_line_that_recorded_it(exploding_op):
    x = torch.ones(4, device="tpu")
    torch.tpu.set_eager_mode("fused")
    doubled = x * 2
    line = inspect.currentframe().f_lineno + 1
    failing = exploding_op(doubled)
    result = failing + 1
    with pytest.raises(RuntimeError, match=rf"hf_tpu_fused_test::explode \(recorded at .*test_fused_eager.py:{line}\)"):
        result.cpu()
    with pytest.raises(RuntimeError, match="never computed"):
        result.cpu()
    assert doubled.tolist() == [2.0] * 4  # recorded before the failing op: computed, as in strict mode
    assert (failing.new_ones(2) + x[:2]).tolist() == [2.0, 2.0]  # the next chain runs


def test_the_line_is_found_for_an_op_recorded_deep_in_a_long_function(exploding_op):
    """The recorded place is resolved to a line only when an error is reported; far into a long function (where
    ``f_lineno`` would decode hundreds of lines at every op) the line is still the right one."""
    padding = "".join(f"    unused_{n} = {n}\n" for n in range(300))
    source = f"def long_function(op, x):\n{padding}    return op(x * 2) + 1\n"
    namespace = {}
    exec(compile(source, "generated_long_function.py", "exec"), namespace)
    torch.tpu.set_eager_mode("fused")
    result = namespace["long_function"](exploding_op, torch.ones(4, device="tpu"))
    with pytest.raises(RuntimeError, match=r"explode \(recorded at generated_long_function.py:302\)"):
        result.cpu()


def test_ops_with_no_floating_point_value_run_unconditioned_in_a_chain():
    """Integer and boolean ops (generate's token and stopping bookkeeping) are not wrapped in a conditional, and
    give strict mode's results bit for bit, beside float ops that are."""
    exact = fused._exact
    ints = jax.ShapeDtypeStruct((1, 3), np.int32)
    assert exact(jax.make_jaxpr(lambda a, b: jax.numpy.concatenate([a, b], -1))(ints, ints).jaxpr)
    assert exact(jax.make_jaxpr(lambda a: (a > 1) | (a == 0))(ints).jaxpr)
    floats = jax.ShapeDtypeStruct((1, 3), np.float32)
    assert not exact(jax.make_jaxpr(lambda a: jax.numpy.argmax(a, -1))(floats).jaxpr)  # reads floats
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):  # floats, though not numpy's
        assert not exact(jax.make_jaxpr(lambda a: a.astype(np.float32) * 2)(jax.ShapeDtypeStruct((3,), dtype)).jaxpr)
    assert not exact(jax.make_jaxpr(lambda a: (a * 0.5).astype(np.int32))(ints).jaxpr)  # floats inside
    inner = jax.jit(lambda a: (a.astype(np.float32) + 1).astype(np.int32))
    assert not exact(jax.make_jaxpr(lambda a: inner(a) + 1)(ints).jaxpr)  # floats inside an inner jaxpr

    def bookkeeping(logits, tokens, finished):
        next_tokens = torch.argmax(logits * 1.5 + 0.25, dim=-1)  # float ops: isolated or pinned
        tokens = torch.cat([tokens, next_tokens[:, None]], dim=-1)
        stop = torch.full((tokens.shape[0],), tokens.shape[-1] >= 6, device=tokens.device, dtype=torch.bool)
        finished = finished | (next_tokens == 3) | stop
        return [tokens, finished, ~finished & (tokens.max(-1).values > 2), next_tokens.cumsum(0) * 7 // 3 % 5]

    torch.manual_seed(0)
    inputs = [torch.randn(4, 9), torch.randint(0, 9, (4, 5)), torch.tensor([False, True, False, False])]
    strict = in_mode("strict", bookkeeping, *[t.to("tpu") for t in inputs])
    torch.tpu.set_eager_mode("fused")
    before = fused.stats()["program_misses"]
    pending = bookkeeping(*[t.to("tpu") for t in inputs])
    isolated = {op.name for op in fused._chain.ops if not op.trace.exact}
    assert isolated == {"aten::mul.Tensor", "aten::add.Tensor", "aten::argmax"}, isolated
    assert {"aten::cat", "aten::bitwise_or.Tensor", "aten::bitwise_not", "aten::cumsum"} <= \
        {op.name for op in fused._chain.ops if op.trace.exact}
    results = [t.cpu() for t in pending]
    assert fused.stats()["program_misses"] == before + 1  # one chain, one program
    assert_bitwise(results, strict)
    assert_bitwise(results, bookkeeping(*inputs))


def test_correctly_rounded_ops_are_fusible_and_others_are_not():
    fusible, floats = fused._fusible, jax.ShapeDtypeStruct((4, 3), np.float32)
    for fn in (lambda a: a * 2 + 1, lambda a: a + 0.25 * (3 - a), lambda a: jnp.where(a > 0, jnp.sqrt(a), a / 3),
               lambda a: jnp.concatenate([a, -a]).T.astype(jnp.bfloat16), lambda a: jax.jit(lambda b: b * b)(a)):
        assert fusible(jax.make_jaxpr(fn)(floats).jaxpr)
    for fn in (jnp.exp, jnp.tanh, jax.nn.sigmoid, jax.lax.rsqrt, lambda a: a ** 1.5, lambda a: a.sum(0),
               lambda a: a @ a.T, lambda a: a.astype(np.complex64) * 1j, lambda a: jax.jit(jnp.log)(a)):
        assert not fusible(jax.make_jaxpr(fn)(floats).jaxpr)


def fusible_chain(a, b, c):
    """Correctly rounded ops only, which a fused loop could still get wrong: products and sums it could contract
    into multiply-adds, a product and a quotient it could cancel, bfloat16 results it could keep in float32."""
    return [a * b + c, (a * 3) / 3, a * b - c * b, torch.addcmul(c, a, b) * 0.1 + a,
            (a.bfloat16() * 1.1 + 0.3).float() * b, torch.where(a > b, a.abs().sqrt(), c / b)]


def test_fusible_ops_run_unconditioned_and_give_strict_results_bit_for_bit():
    """Ops of correctly rounded arithmetic are not wrapped in conditionals: XLA fuses them into one loop, and their
    results are pinned, so that no rounding changes (here: a quarter of the elements of a * b + c would change
    without, their multiply-add contracted)."""
    torch.manual_seed(0)
    inputs = [torch.randn(3, 1000) for _ in range(3)]
    strict = in_mode("strict", fusible_chain, *[t.to("tpu") for t in inputs])
    torch.tpu.set_eager_mode("fused")
    before = set(fused._programs)
    pending = fusible_chain(*[t.to("tpu") for t in inputs])
    assert all(op.trace.fusible and op.trace.work == 0 for op in fused._chain.ops)
    results = [t.cpu() for t in pending]
    (key, program), = [(key, program) for key, program in fused._programs.items() if key not in before]
    arguments = [jax.ShapeDtypeStruct(*signature[:2], weak_type=signature[2]) if len(signature) == 3 else
                 signature[0](1) for signature in key[2]]
    assert "stablehlo.case" not in program.func.lower(*program.args, *arguments).as_text()
    assert_bitwise(results, strict)
    for position, (actual, expected) in enumerate(zip(results, fusible_chain(*inputs))):
        tolerance = 2e-2 if position == 4 else 1e-5  # bfloat16 arithmetic in the fifth
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


def test_without_isolation_chains_keep_each_ops_rounding(monkeypatch):
    """The GPU's chains (no conditionals, :func:`fused._isolating`), run here on the CPU: bfloat16 results between
    elementwise ops keep their rounding, as in strict mode; float32 results match strict mode's to rounding (a
    multiply-add may be contracted). Whether XLA's GPU compiler keeps the bfloat16 rounding is checked on a GPU,
    where every test of this module runs chains so."""
    monkeypatch.setattr(fused, "_isolating", lambda: False)
    monkeypatch.setattr(fused, "_programs", segmented_cache.SegmentedCache(lambda: fused.PROGRAM_CACHE_SIZE))
    monkeypatch.setattr(fused, "_built", type(fused._built)())

    def rounded_between(x):
        return [(x * x).float() / 3, x.exp().float() + x.float(), (x * 3 - 1).float() * 1.5]

    x = torch.linspace(1, 2, 4096).to(torch.bfloat16).to("tpu")
    strict = in_mode("strict", rounded_between, x)
    fused_results = in_mode("fused", rounded_between, x)
    for actual, expected in zip(fused_results, strict):
        assert torch.equal(bits(actual), bits(expected))
    torch.manual_seed(0)
    a, b = torch.randn(16, 24), torch.randn(16, 24)
    assert_bitwise(in_mode("fused", pointwise_chain, a.to("tpu"), b.to("tpu")),
                   in_mode("strict", pointwise_chain, a.to("tpu"), b.to("tpu")))
    assert len(fused._programs) == 2


def common_calls(x, w, mask):
    """Calls of the common kind (tensors, lists of them, views too, Python numbers, Scalars at their defaults or
    numbers the op's dtypes hold; torch hands arguments that are not keyword-only over by position) and calls that
    are not (a keyword-only argument given, a CPU scalar tensor)."""
    plain = [x + w, torch.nn.functional.linear(x, w, None), x.sum(1), torch.where(mask, x, w), x.softmax(-1),
             x[1:].sum(0), x.sum(dim=1, keepdim=True), x.t() * w, x * 2.5, x[1:] + 1, x.pow(2), torch.lerp(x, w, 0.25),
             torch.cat([x, w]), torch.stack([x.t(), w[1:].sum(0).expand(4, 4)]), x.pow(1000), x.mul(-0.5)]
    other = [torch.add(x, w, alpha=2), x * torch.tensor(2.0)]
    return plain + other


def test_common_calls_in_fused_mode_reuse_strict_modes_programs_and_results(monkeypatch):
    """Fused mode records its common calls with less bookkeeping (``record_plainly`` in dispatch.build_kernel): the
    very programs strict mode runs (no new eager program is made for them) and the same results, bit for bit."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    inputs = [x.to("tpu"), w.to("tpu"), (x > 0).to("tpu")]
    strict = in_mode("strict", common_calls, *inputs)
    programs = dispatch.eager_program_count()
    recorded_by = []
    record = fused.record

    def spy(*args, **kwargs):
        recorded_by.append(sys._getframe(2).f_code.co_name)  # past dispatch's call(): the path that recorded
        return record(*args, **kwargs)

    monkeypatch.setattr(fused, "record", spy)
    fused_results = in_mode("fused", common_calls, *inputs)
    assert recorded_by == ["record_plainly"] * 17 + ["run"] * 2, recorded_by
    assert dispatch.eager_program_count() == programs
    assert_bitwise(fused_results, strict)
    # CPU's: XLA's dot (``linear``) and torch's CPU matmul may round differently, by the host's vector units
    for result, expected in zip(fused_results, common_calls(x, w, x > 0), strict=True):
        torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)


def test_scalars_a_dtype_cannot_hold_raise_cpus_error_in_fused_mode():
    """A number past the plain path's quick test that one of the op's dtypes cannot hold takes the general path,
    which raises CPU's error, as strict mode does."""
    small = torch.arange(4, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="cannot be converted") as on_cpu:
        torch.clamp(small, max=100000)
    for mode in ("strict", "fused"):
        torch.tpu.set_eager_mode(mode)
        with pytest.raises(RuntimeError) as on_tpu:
            torch.clamp(small.to("tpu"), max=100000)
        assert str(on_tpu.value) == str(on_cpu.value)
        assert torch.equal(torch.clamp(small.to("tpu"), max=-100).cpu(), torch.clamp(small, max=-100))


def test_tracing_errors_are_raised_by_the_op_itself():
    a, b = torch.ones(3, device="tpu"), torch.ones(4, device="tpu")
    with pytest.raises(RuntimeError) as strict_error:
        a + b
    torch.tpu.set_eager_mode("fused")
    with pytest.raises(RuntimeError, match="incompatible shapes") as fused_error:
        a + b  # shapes are inferred when the op is recorded
    assert str(fused_error.value) == str(strict_error.value)


def test_bad_modes_are_refused_naming_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="'lazy' is not one of strict, fused, debug"):
        torch.tpu.set_eager_mode("lazy")
    monkeypatch.setenv("HF_TPU_EAGER_MODE", "eventually")
    with pytest.raises(ValueError, match="HF_TPU_EAGER_MODE='eventually' is not one of strict, fused, debug"):
        runtime.check_environment()
    monkeypatch.setenv("HF_TPU_EAGER_MODE", "Fused")
    assert runtime.eager_mode() == "fused"


def test_immediate_checks_run_each_checked_op_at_once(monkeypatch):
    monkeypatch.setattr(checks, "MODE", "immediate")
    values = torch.arange(3.0, device="tpu")
    torch.tpu.set_eager_mode("fused")
    with pytest.raises(IndexError):
        values[torch.tensor([7], device="tpu")]
    assert np.asarray(storage.read(values * 1)).tolist() == [0.0, 1.0, 2.0]


def several_chips():
    """Chains on two chips in turn, a factory on the second, and a sharded tensor mixed with a recorded value."""
    a, b = torch.arange(8.0, device="tpu:1"), torch.ones(8, device="tpu:0")
    on_second = a * 2 + 1
    on_first = b - 3  # another chip: the chain of tpu:1 runs first
    made = torch.arange(4, device="tpu:1") * 3
    sharded = hf_tpu.distribute(torch.arange(16.0).reshape(4, 4), ["tpu:0", "tpu:1"], ("chips", None))
    mixed = (sharded * 2 + on_first[:4, None]).sum(0)  # a sharded input: strict, the pending value computed first
    assert on_second.device == made.device == torch.device("tpu:1")
    return [on_second, on_first, made, mixed]


def case_chains_per_chip_and_sharded_tensors():
    assert_bitwise(in_mode("fused", several_chips), in_mode("strict", several_chips))


four_chip_report = four_chips.report_fixture(__file__)


@pytest.mark.parametrize("case", four_chips.cases(globals()))
def test_on_four_chips(four_chip_report, case):
    assert four_chip_report[case] == "ok", four_chip_report[case]


if __name__ == "__main__":
    four_chips.main(globals())
