"""DeviceMesh("tpu"), DTensor and tensor-parallel modules over the ``tpu_dist`` backend, across real processes.

Two torchrun launches (tests/torchrun_cases.py) run this file's cases: 2 processes for the 1-D mesh (``case_*``)
and 4 processes for the 2-D one (``case_2d_*``, compiled graphs with collectives over both sub-meshes among them).
Every result is compared with the same computation on CPU, on the whole tensors, in the same process: what one
process without any sharding gets.
"""

from __future__ import annotations

import copy
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import hf_tpu  # noqa: F401  (registers the device even where autoload is off)
import torchrun_cases
from hf_tpu.compile.stats import compile_stats, reset_compile_stats


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    assert actual.device.type == "tpu", actual.device
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-5)


def _mesh_1d():
    return init_device_mesh("tpu", (dist.get_world_size(),))


def _full(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def case_device_mesh_is_over_tpu_dist():
    mesh = _mesh_1d()
    assert mesh.device_type == "tpu" and mesh.size() == 2
    assert mesh.get_group() is dist.group.WORLD and type(mesh.get_group()).__name__ == "TpuProcessGroup"
    assert mesh.get_local_rank() == dist.get_rank()


def case_distribute_tensor_takes_rank_0s_values():
    """Rank 1 passes other values: distribute_tensor scatters (Shard) or broadcasts (Replicate) rank 0's."""
    mesh, rank = _mesh_1d(), dist.get_rank()
    full = _full(4, 6)
    given = full if rank == 0 else torch.zeros(4, 6)
    for placement, local in ((Shard(0), full.chunk(2, 0)[rank]), (Shard(1), full.chunk(2, 1)[rank]),
                             (Replicate(), full)):
        tensor = distribute_tensor(given.to("tpu"), mesh, [placement])
        assert tensor.placements == (placement,) and tensor.shape == full.shape
        _close(tensor.to_local(), local)
        _close(tensor.full_tensor(), full)
    uneven = _full(5, 3)  # torch.chunk's split: 3 rows, then 2
    tensor = distribute_tensor((uneven if rank == 0 else torch.zeros(5, 3)).to("tpu"), mesh, [Shard(0)])
    _close(tensor.to_local(), uneven.chunk(2, 0)[rank])
    _close(tensor.full_tensor(), uneven)


def case_from_local_and_redistribute():
    mesh, rank = _mesh_1d(), dist.get_rank()
    pieces = [_full(2, 4, seed=k) for k in range(2)]  # each rank's local tensor
    mine = pieces[rank].to("tpu")
    stacked, summed = torch.cat(pieces), pieces[0] + pieces[1]
    sharded = DTensor.from_local(mine, mesh, [Shard(0)])
    _close(sharded.redistribute(mesh, [Replicate()]).to_local(), stacked)
    _close(sharded.redistribute(mesh, [Shard(1)]).to_local(), stacked.chunk(2, 1)[rank])
    partial = DTensor.from_local(mine, mesh, [Partial()])
    _close(partial.redistribute(mesh, [Replicate()]).to_local(), summed)
    _close(partial.redistribute(mesh, [Shard(0)]).to_local(), summed.chunk(2, 0)[rank])
    _close(partial.full_tensor(), summed)
    averaged = DTensor.from_local(mine, mesh, [Partial("avg")])
    _close(averaged.full_tensor(), summed / 2)
    replicated = DTensor.from_local(pieces[0].to("tpu"), mesh, [Replicate()])
    _close(replicated.redistribute(mesh, [Shard(1)]).to_local(), pieces[0].chunk(2, 1)[rank])


def case_dtensor_ops_forward_and_backward():
    """A row-sharded matmul with a replicated weight, then a sum: values and gradients as on CPU."""
    mesh = _mesh_1d()
    x, w = _full(4, 3, seed=1), _full(3, 5, seed=2)
    dx = distribute_tensor(x.to("tpu"), mesh, [Shard(0)]).requires_grad_()
    dw = distribute_tensor(w.to("tpu"), mesh, [Replicate()]).requires_grad_()
    out = torch.relu(dx @ dw)
    assert out.placements == (Shard(0),)
    out.sum().backward()
    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.relu(rx @ rw).sum().backward()
    _close(out, torch.relu(x @ w))
    _close(dx.grad, rx.grad)
    _close(dw.grad, rw.grad)


class _Mlp(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _Block(nn.Module):
    """A tiny pre-norm transformer block's MLP half: a norm, then the MLP, with a residual."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), _Mlp(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _mlp_plan() -> dict:
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _compare_grads(sharded: nn.Module, reference: nn.Module) -> None:
    for (name, param), (_, expected) in zip(sharded.named_parameters(), reference.named_parameters()):
        assert isinstance(param, DTensor), name
        _close(param.grad, expected.grad)


def _parallelized(module: nn.Module, mesh, plan: dict) -> tuple[nn.Module, nn.Module]:
    """The module sharded by ``plan`` over ``mesh`` (on tpu) and an unsharded CPU copy of it."""
    reference = copy.deepcopy(module)
    return parallelize_module(module.to("tpu"), mesh, plan), reference


def case_parallelize_mlp_colwise_rowwise():
    torch.manual_seed(0)
    mesh = _mesh_1d()
    mlp, reference = _parallelized(_Mlp(), mesh, _mlp_plan())
    assert mlp.up.weight.placements == (Shard(0),) and mlp.down.weight.placements == (Shard(1),)
    assert mlp.up.weight.to_local().shape == (8, 8)  # half of the hidden features on each rank
    x = _full(3, 8, seed=3)
    out = mlp(x.to("tpu"))
    out.pow(2).sum().backward()
    expected = reference(x)
    expected.pow(2).sum().backward()
    _close(out, expected.detach())
    _compare_grads(mlp, reference)


def case_parallelize_block_with_sequence_parallel():
    """The norm sequence-parallel (activations sharded along the sequence), the MLP's features tensor-parallel;
    the block's input and output are this rank's part of the sequence."""
    torch.manual_seed(0)
    mesh = _mesh_1d()
    plan = {"norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=Shard(1))}
    block, reference = _parallelized(_Block(), mesh, plan)
    x, rank = _full(2, 6, 8, seed=4), dist.get_rank()
    mine = x.chunk(2, 1)[rank].to("tpu").requires_grad_()  # this rank's half of the sequence
    out = block(mine)
    out.pow(2).sum().backward()  # summed over the ranks: the whole sequence's loss
    rx = x.clone().requires_grad_()
    expected = reference(rx)
    expected.pow(2).sum().backward()
    _close(out, expected.detach().chunk(2, 1)[rank])
    _close(mine.grad, rx.grad.chunk(2, 1)[rank])
    _compare_grads(block, reference)


def _mesh_2d():
    return init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))


def case_2d_mesh_sub_meshes_are_tpu_dist_groups():
    mesh, rank = _mesh_2d(), dist.get_rank()
    for name, ranks in (("dp", [rank % 2, rank % 2 + 2]), ("tp", [rank // 2 * 2, rank // 2 * 2 + 1])):
        sub = mesh[name]
        assert sub.device_type == "tpu" and sub.mesh.tolist() == ranks, (name, sub.mesh)
        assert type(sub.get_group()).__name__ == "TpuProcessGroup"
        assert dist.get_process_group_ranks(sub.get_group()) == ranks
        everyone = torch.tensor([float(rank)], device="tpu")
        dist.all_reduce(everyone, group=sub.get_group())
        _close(everyone, torch.tensor([float(sum(ranks))]))


def case_2d_distribute_and_redistribute():
    mesh, rank = _mesh_2d(), dist.get_rank()
    full = _full(4, 6)
    tensor = distribute_tensor(full.to("tpu"), mesh, [Shard(0), Shard(1)])
    _close(tensor.to_local(), full.chunk(2, 0)[rank // 2].chunk(2, 1)[rank % 2])
    _close(tensor.full_tensor(), full)
    moved = tensor.redistribute(mesh, [Replicate(), Shard(0)])
    _close(moved.to_local(), full.chunk(2, 0)[rank % 2])
    partial = DTensor.from_local(torch.full((2, 2), float(rank), device="tpu"), mesh, [Partial(), Shard(0)])
    _close(partial.redistribute(mesh, [Replicate(), Shard(0)]).to_local(), torch.full((2, 2), float(rank % 2 * 2 + 2)))


def case_2d_tensor_parallel_mlp_per_data_parallel_rank():
    """TP over "tp", different data on each "dp" row; the gradients summed over "dp": the whole batch's."""
    torch.manual_seed(0)
    mesh, rank = _mesh_2d(), dist.get_rank()
    mlp, reference = _parallelized(_Mlp(), mesh["tp"], _mlp_plan())
    inputs = [_full(3, 8, seed=10 + row) for row in range(2)]
    mlp(inputs[rank // 2].to("tpu")).sum().backward()
    reference(torch.cat(inputs)).sum().backward()
    for param, expected in zip(mlp.parameters(), reference.parameters()):
        local = param.grad.to_local()
        dist.all_reduce(local, group=mesh["dp"].get_group())  # summed over dp: the gradient of the whole batch
        _close(param.grad, expected.grad)


def _compiled_once(fn):
    """``fn`` compiled by graph mode as one graph (``fullgraph``), the compile counters reset."""
    torch._dynamo.reset()
    reset_compile_stats()
    return torch.compile(fn, backend="tpu", fullgraph=True)


def _strict_compile():
    """HF_TPU_STRICT_COMPILE set while in use: a graph that cannot be lowered is an error, not eager code."""
    return mock.patch.dict(os.environ, {"HF_TPU_STRICT_COMPILE": "1"})


def _ran_as_one_program(graphs: int = 1) -> None:
    """Graph mode lowered ``graphs`` graphs (forward, and backward), one XLA program each, and ran none eagerly."""
    stats = compile_stats()
    assert (stats["graphs"], stats["compilations"], stats["fallbacks"]) == (graphs, graphs, 0), stats


def case_2d_one_compiled_graph_communicates_over_both_sub_meshes_and_the_world():
    """Collectives over "tp", "dp" and the world in one graph: one XLA program per rank over the (2, 2) grid."""
    mesh, rank = _mesh_2d(), dist.get_rank()
    tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()

    def step(x):
        row = funcol.all_gather_tensor(x, 0, tp)
        summed = funcol.all_reduce(row, "sum", dp)
        return (summed, funcol.all_reduce(x, "max", dist.group.WORLD),
                funcol.reduce_scatter_tensor(summed, "sum", 0, tp), funcol.broadcast(x * 2, 1, dp))

    xs = [_full(2, 3, seed=r) for r in range(4)]
    with _strict_compile():
        summed, highest, scattered, broadcast = _compiled_once(step)(xs[rank].to("tpu"))
    rows = [torch.cat(xs[r // 2 * 2:r // 2 * 2 + 2]) for r in range(4)]  # what each rank's tp row gathers
    _close(summed, rows[0] + rows[2])  # the same on every rank: column sums of rows
    _close(highest, torch.stack(xs).amax(0))
    _close(scattered, 2 * (rows[0] + rows[2]).chunk(2)[rank % 2])
    _close(broadcast, xs[rank % 2 + 2] * 2)  # dp rank 1 of column rank % 2
    _ran_as_one_program()


def case_2d_compiled_tensor_parallel_mlp_summed_over_data_parallel_rows_forward_and_backward():
    """A DTensor MLP over "tp" and a sum over "dp" in one compiled graph, and its backward (torch's formulas: the
    sum's backward sums the rows' gradients, so each row gets the gradient of its own outputs' sum), as on CPU."""
    torch.manual_seed(0)
    mesh, rank = _mesh_2d(), dist.get_rank()
    mlp, reference = _parallelized(_Mlp(), mesh["tp"], _mlp_plan())
    dp = mesh["dp"].get_group()
    inputs = [_full(3, 8, seed=20 + row) for row in range(2)]
    with _strict_compile():
        loss = _compiled_once(lambda x: funcol.all_reduce(mlp(x), "sum", dp).sum() / 2)(inputs[rank // 2].to("tpu"))
        loss.backward()
    _close(loss, (reference(inputs[0]) + reference(inputs[1])).sum().detach() / 2)
    reference(inputs[rank // 2]).sum().backward()
    _compare_grads(mlp, reference)
    _ran_as_one_program(graphs=2)


def _cases(world: int) -> list[str]:
    return [name for name in torchrun_cases.cases(globals()) if name.startswith("case_2d_") == (world == 4)]


reports_2 = torchrun_cases.report_fixture(__file__, world=2, timeout=120)
reports_4 = torchrun_cases.report_fixture(__file__, world=4, timeout=150)


@pytest.mark.parametrize("case", _cases(2))
@pytest.mark.parametrize("rank", range(2))
def test_two_processes(reports_2, rank, case):
    assert reports_2[rank][case] == "ok", reports_2[rank][case]


@pytest.mark.parametrize("case", _cases(4))
@pytest.mark.parametrize("rank", range(4))
def test_four_processes_2d_mesh(reports_4, rank, case):
    assert reports_4[rank][case] == "ok", reports_4[rank][case]


if __name__ == "__main__":
    torchrun_cases.main({name: globals()[name] for name in _cases(int(os.environ["WORLD_SIZE"]))})
