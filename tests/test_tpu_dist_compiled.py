"""Collectives inside ``torch.compile(backend="tpu")`` graphs under ``tpu_dist`` (hf_tpu/compile/graph_collectives.py).

One torchrun launch of 2 processes (tests/torchrun_cases.py) runs every ``case_*`` function of this file. Each
compiled function (``fullgraph=True``: no graph break) must run as the rank's one XLA program with its
collectives inside (one lowered graph per direction, no eager fallback: graph mode's counters say so) and give
what the eager ProcessGroup API, or the math over every rank's values on CPU, gives. Collectives come from the
ProcessGroup API, the functional collectives and DTensor (``parallelize_module``), in forward and backward graphs.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import hf_tpu  # noqa: F401  (registers the device even where autoload is off)
import torchrun_cases
from hf_tpu.compile.graph_collectives import grid
from hf_tpu.compile.stats import compile_stats, reset_compile_stats

WORLD = 2
LAUNCH_TIMEOUT_S, WORKER_TIMEOUT_S = 120, 100

_LIBRARY = torch.library.Library("hf_tpu_test_dist_compiled", "DEF")
_LIBRARY.define("mystery(Tensor x) -> Tensor")  # an op graph mode has no lowering for
_LIBRARY.impl("mystery", lambda x: x.clone(), "CompositeExplicitAutograd")


def _values(rank: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Different values on each rank (exact in every dtype used here)."""
    numel = torch.Size(shape).numel()
    return (torch.arange(numel, dtype=torch.float32).reshape(shape) * (rank + 2) - 3 * rank).to(dtype)


def _every(*shape: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [_values(rank, *shape, dtype=dtype) for rank in range(WORLD)]


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device.type == "tpu", actual.device
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.cpu(), expected)


@contextlib.contextmanager
def _strict(on: bool = True):
    """HF_TPU_STRICT_COMPILE set (a graph that cannot be lowered is an error, so no eager fallback) or unset."""
    before = os.environ.pop("HF_TPU_STRICT_COMPILE", None)
    if on:
        os.environ["HF_TPU_STRICT_COMPILE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("HF_TPU_STRICT_COMPILE", None)
        if before is not None:
            os.environ["HF_TPU_STRICT_COMPILE"] = before


def _one_program(graphs: int = 1) -> None:
    """Graph mode lowered ``graphs`` ATen graphs (forward, and backward), built one XLA program for each and ran
    them, and ran no graph eagerly."""
    stats = compile_stats()
    assert (stats["graphs"], stats["compilations"], stats["fallbacks"]) == (graphs, graphs, 0), stats
    assert stats["calls"] >= graphs, stats


def _compiled(fn, **options):
    torch._dynamo.reset()
    reset_compile_stats()
    return torch.compile(fn, backend="tpu", fullgraph=True, **options)


def case_dist_all_reduce_in_a_graph_matches_eager():
    def step(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    rank = dist.get_rank()
    x = _values(rank, 3, 4).to("tpu")
    eager = x * 2
    dist.all_reduce(eager)
    pending, pending_host = _values(rank, 2).to("tpu"), _values(rank, 2)
    with _strict():
        compiled = _compiled(step)
        _same(compiled(x), (eager + 1).cpu())
        work = dist.all_reduce(pending, async_op=True)  # issued before the program: both run in program order
        _same(compiled(x), (eager + 1).cpu())
    work.wait()
    dist.all_reduce(pending_host)
    _same(pending, pending_host)
    _one_program()


def case_in_place_collectives_write_their_tensors():
    def step(x, scale, gathered, rows, scattered):
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        dist.all_gather_into_tensor(gathered, x)
        dist.reduce_scatter_tensor(scattered, rows)
        return x * scale

    rank = dist.get_rank()
    x, scale, rows = _values(rank, 5).to("tpu"), torch.tensor(3.0, device="tpu"), _values(rank, 2 * WORLD).to("tpu")
    gathered, scattered = torch.zeros(5 * WORLD, device="tpu"), torch.zeros(2, device="tpu")
    with _strict():
        result = _compiled(step)(x, scale, gathered, rows, scattered)
    highest = torch.maximum(*_every(5))
    _same(x, highest)
    _same(result, highest * 3)
    _same(gathered, torch.cat([highest] * WORLD))
    _same(scattered, sum(_every(2 * WORLD))[2 * rank:2 * rank + 2])
    _one_program()


def case_functional_collectives_in_one_program_match_cpu_math():
    group = dist.group.WORLD

    def step(x, rows, ints):
        total = funcol.all_reduce(x, "sum", group)
        mean = funcol.all_reduce(x, "avg", group)
        low = funcol.wait_tensor(funcol.all_reduce(ints, "min", group))
        product = funcol.all_reduce(ints, "product", group)
        along_0 = funcol.all_gather_tensor(x, 0, group)
        along_1 = funcol.all_gather_tensor(x, 1, group)
        scattered = funcol.reduce_scatter_tensor(rows, "sum", 0, group)
        swapped = funcol.all_to_all_single(rows, None, None, group)
        from_1 = funcol.broadcast(x, 1, group)
        high, most = funcol.all_reduce_coalesced([x, ints], "max", group)
        gathered, = funcol.all_gather_into_tensor_coalesced([ints], group)
        averaged, = funcol.reduce_scatter_tensor_coalesced([rows], "avg", [0], group)
        return total, mean, low, product, along_0, along_1, scattered, swapped, from_1, high, most, gathered, averaged

    rank = dist.get_rank()
    xs, rows, ints = _every(2, 3), _every(WORLD * 2, 3), _every(4, dtype=torch.int64)
    with _strict():
        results = _compiled(step)(xs[rank].to("tpu"), rows[rank].to("tpu"), ints[rank].to("tpu"))
    mine = slice(2 * rank, 2 * rank + 2)
    expected = (xs[0] + xs[1], (xs[0] + xs[1]) / 2, torch.minimum(*ints), ints[0] * ints[1], torch.cat(xs, 0),
                torch.cat(xs, 1), (rows[0] + rows[1])[mine], torch.cat([r[mine] for r in rows]), xs[1],
                torch.maximum(*xs), torch.maximum(*ints), torch.cat(ints), ((rows[0] + rows[1]) / 2)[mine])
    for actual, wanted in zip(results, expected, strict=True):
        _same(actual, wanted)
    _one_program()


def case_symbolic_sizes_give_one_graph_and_a_program_per_size():
    group = dist.group.WORLD

    def step(x):
        gathered = funcol.all_gather_tensor(x * 2, 0, group)
        swapped = funcol.all_to_all_single(gathered, None, None, group)
        return funcol.all_reduce(gathered, "sum", group) + x.shape[0], swapped

    rank, compiled = dist.get_rank(), _compiled(step, dynamic=True)
    with _strict():
        for rows in (3, 5):
            xs = [torch.arange(rows, dtype=torch.float32) + r for r in range(WORLD)]
            total, swapped = compiled(xs[rank].to("tpu"))
            _same(total, 2 * torch.cat(xs) * WORLD + rows)
            _same(swapped, torch.cat([2 * xs[rank]] * WORLD))
    stats = compile_stats()
    assert (stats["graphs"], stats["compilations"], stats["fallbacks"]) == (1, 2, 0), stats


def case_a_subgroup_runs_over_its_own_mesh():
    alone = dist.new_group([1])  # every rank creates it; only rank 1 is in it
    if dist.get_rank() == 1:
        x = _values(1, 3).to("tpu")
        with _strict():
            result = _compiled(lambda t: funcol.all_reduce(t * 2, "sum", alone))(x)
        _same(result, _values(1, 3) * 2)
        _one_program()


def case_the_world_and_each_ranks_own_group_in_one_graph():
    """Collectives over two groups of different ranks in one program, on a (2, 1) grid of the ranks (four
    processes run a 2-D DeviceMesh's, tests/test_dtensor.py)."""
    own = [dist.new_group([r]) for r in range(WORLD)][dist.get_rank()]  # every rank creates every group

    def step(x):
        total = funcol.all_reduce(x, "sum", dist.group.WORLD)
        mine = funcol.all_reduce(total * x, "sum", own)
        return funcol.all_gather_tensor(mine, 0, dist.group.WORLD), funcol.broadcast(x + 1, 0, own)

    rank, xs = dist.get_rank(), _every(2, 3)
    with _strict():
        gathered, broadcast = _compiled(step)(xs[rank].to("tpu"))
    _same(gathered, torch.cat([sum(xs) * x for x in xs]))
    _same(broadcast, xs[rank] + 1)
    _one_program()


class _TensorParallelMlp(torch.nn.Module):
    """Two linear layers split over the ranks: the first by output features, its outputs all-gathered; the second
    by input features, its partial products all-reduced."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Parameter(first), torch.nn.Parameter(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, rank = dist.group.WORLD, dist.get_rank()
        hidden = funcol.all_gather_tensor(x @ self.first, 1, group)
        mine = hidden[:, rank * self.second.shape[0]:(rank + 1) * self.second.shape[0]]
        return funcol.all_reduce(mine @ self.second, "sum", group)


def case_training_step_backward_communicates_too():
    rank, width, seed = dist.get_rank(), 4, torch.Generator().manual_seed(0)
    x, first, second = (torch.randn(*shape, generator=seed) for shape in ((3, 5), (5, width * WORLD),
                                                                          (width * WORLD, 2)))
    mine = slice(rank * width, (rank + 1) * width)
    model = _TensorParallelMlp(first[:, mine].clone(), second[mine].clone()).to("tpu")
    step = _compiled(lambda batch: model(batch).square().sum())
    with _strict():
        loss = step(x.to("tpu"))
        loss.backward()
    # every rank's loss counts: the collectives' backward sums the ranks' gradients (torch's formulas)
    reference = [first.clone().requires_grad_(), second.clone().requires_grad_()]
    (WORLD * (x @ reference[0] @ reference[1]).square().sum()).backward()
    torch.testing.assert_close(loss.cpu(), (x @ first @ second).square().sum())
    torch.testing.assert_close(model.first.grad.cpu(), reference[0].grad[:, mine])
    torch.testing.assert_close(model.second.grad.cpu(), reference[1].grad[mine])
    _one_program(graphs=2)


def case_dtensor_tensor_parallel_forward_and_backward_match_cpu():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, reference = torch.randn(5, 4), [p.detach().clone().requires_grad_() for p in layers.parameters()]
    model = parallelize_module(layers.to("tpu"), init_device_mesh("tpu", (WORLD,)),
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with _strict():
        result = _compiled(model)(x.to("tpu"))
        result.square().sum().backward()
    hidden = torch.relu(torch.nn.functional.linear(x, reference[0], reference[1]))
    expected = torch.nn.functional.linear(hidden, reference[2], reference[3])
    expected.square().sum().backward()
    _same(result, expected.detach())
    for parameter, wanted in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(parameter.grad.full_tensor().cpu(), wanted.grad)
    _one_program(graphs=2)


def case_a_graph_with_an_op_without_lowering_falls_back_to_eager():
    def step(x):
        y = torch.ops.hf_tpu_test_dist_compiled.mystery(x) + 1
        dist.all_reduce(y)
        return y

    rank = dist.get_rank()
    with _strict(False), pytest.warns(UserWarning, match="no lowering for the operator hf_tpu_test_dist_compiled"):
        result = _compiled(step)(_values(rank, 3).to("tpu"))
    _same(result, _values(0, 3) + _values(1, 3) + 2)
    assert compile_stats()["fallbacks"] == 1


def case_uneven_all_to_all_in_a_graph_runs_eagerly_with_eagers_values():
    """Uneven splits are each rank's own constants, so no padded width is known to all ranks when the graph is
    compiled: the graph runs eagerly (after a warning saying why), with the eager collective's results."""
    rank, xs = dist.get_rank(), _every(4, 2)
    sent, received = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])

    def step(x):
        return funcol.all_to_all_single(x * 2, received, sent, dist.group.WORLD) + 1

    with _strict(False), pytest.warns(UserWarning, match=r"split sizes .* only even splits over the 2 ranks"):
        result = _compiled(step)(xs[rank].to("tpu"))
    expected = torch.cat([xs[0][:1], xs[1][:2]]) if rank == 0 else torch.cat([xs[0][1:], xs[1][2:]])
    _same(result, expected * 2 + 1)
    assert compile_stats()["fallbacks"] == 1


def _refused(fn, message: str, *args: torch.Tensor) -> None:
    """Strict graph mode refuses ``fn``'s graph, raising NotImplementedError with ``message`` before it runs."""
    with _strict(), pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=message) as error:
        _compiled(fn)(*args)
    assert isinstance(error.value.inner_exception, NotImplementedError)


def case_what_cannot_be_compiled_says_so():
    group, x = dist.group.WORLD, torch.ones(4, 2, device="tpu")
    _refused(lambda t: funcol.all_reduce(t, "band", group), "reduce op 'band' needs integer or bool tensors", x)
    flags = torch.tensor([1, 2, 4 * (dist.get_rank() + 1)], device="tpu")
    with _strict():
        combined = _compiled(lambda t: funcol.all_reduce(t, "bor", group))(flags)
    assert combined.cpu().tolist() == [1, 2, 12]
    _refused(lambda t: funcol.all_to_all_single(t, [1, 3], [3, 1], group),
             r"split sizes \[1, 3\] \(output\) and \[3, 1\] \(input\).*only even splits", x)
    gloo = dist.new_group([0, 1], backend="gloo")
    _refused(lambda t: funcol.all_reduce(t, "sum", gloo), "got tpu tensors and a gloo process group", x)


def case_zz_a_rank_that_never_runs_the_graph_times_out():
    """Rank 0's run gives up after the group's timeout, naming the graph and the ranks; rank 1 then runs it too,
    so the program completes and the processes end cleanly."""
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    dist.barrier()  # the new group's Gloo connects within its timeout: both ranks start it together
    impatient = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    compiled = _compiled(lambda t: funcol.all_reduce(t, "sum", impatient))
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"compiled graph \d+ over ranks \[0, 1\] did not finish within"):
            compiled(torch.ones(2, device="tpu"))
        store.set("compiled_timed_out", "1")
    else:
        store.wait(["compiled_timed_out"])
        _same(compiled(torch.ones(2, device="tpu")), torch.full((2,), 2.0))
    dist.barrier()


def test_the_groups_of_a_2d_device_mesh_are_the_axes_of_one_grid():
    """(dp, tp) = (2, 2) over 4 ranks: rank 3's "tp" row [2, 3], "dp" column [1, 3] and the world."""
    found = grid([(2, 3), (1, 3), (0, 1, 2, 3)], rank=3, world=4)
    assert (found.ranks, found.shape) == ((0, 1, 2, 3), (2, 2))
    slow, fast = found.names
    assert found.axes == {(2, 3): (fast,), (1, 3): (slow,), (0, 1, 2, 3): (slow, fast)}


def test_a_grid_spans_only_the_axes_its_groups_run_over():
    alone = grid([(1, 3)], rank=3, world=4)  # one group is one axis, of its own ranks
    assert (alone.ranks, alone.shape, alone.axes) == ((1, 3), (2,), {(1, 3): alone.names})
    skipping = grid([(4, 5), (1, 5)], rank=5, world=8)  # strides 1 and 4: the axis of stride 2 is fixed
    assert (skipping.ranks, skipping.shape) == ((0, 1, 4, 5), (2, 2))
    single = grid([(0, 1), (1,)], rank=1, world=2)  # a rank's own group: an axis of size 1
    assert (single.ranks, single.shape) == ((0, 1), (2, 1))
    assert single.axes == {(0, 1): single.names[:1], (1,): single.names[1:]}


@pytest.mark.parametrize("groups, rank, world, why", [
    ([(0, 1, 2), (0, 1, 2, 3)], 0, 4, "their sizes do not nest"),
    ([(1, 2), (0, 1, 2, 3)], 1, 4, r"ranks \[1, 2\] are not one axis of a grid"),
    ([(0, 2, 3), (0, 1, 2, 3)], 0, 4, r"ranks \[0, 2, 3\] are not one axis of a grid"),
    ([(0, 1), (0, 2)], 0, 3, "their grid needs rank 3, of a world of 3"),
])
def test_groups_that_are_not_the_axes_of_a_grid_are_refused(groups, rank, world, why):
    with pytest.raises(NotImplementedError, match=rf"process groups of ranks .*not the axes of one grid of the ranks "
                                                  rf"\({why}.*graph_break\(\)"):
        grid(groups, rank, world)


# Every program of the launch, the collective graphs' included, is also lowered for TPU chips (an error if it
# would not run there).
reports = torchrun_cases.report_fixture(__file__, world=WORLD, timeout=LAUNCH_TIMEOUT_S,
                                        env={"HF_TPU_CHECK_TPU_LOWERING": "1"})


@pytest.mark.parametrize("case", torchrun_cases.cases(globals()))
@pytest.mark.parametrize("rank", range(WORLD))
def test_two_processes(reports, rank, case):
    assert reports[rank][case] == "ok", reports[rank][case]


if __name__ == "__main__":
    torchrun_cases.main(globals(), worker_timeout=WORKER_TIMEOUT_S)
