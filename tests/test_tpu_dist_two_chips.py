"""Two processes with two chips each (``HF_TPU_NUM_DEVICES=2`` in each, virtual CPU chips): what a multi-host
pod looks like in miniature (hosts = processes, each driving its local chips).

One torchrun launch (tests/torchrun_cases.py) runs every ``case_*`` function in both processes: each process
sees its own two chips as ``tpu:0`` and ``tpu:1``; a collective on tensors on ``tpu:1`` runs over the
processes' ``tpu:1`` chips; a tensor sharded over a process's two chips (one-process SPMD, ``hf_tpu.distribute``
and ``hf_tpu.shard``) works inside a ``tpu_dist`` process, and collectives, DTensor and data parallelism across
the processes take such tensors as they are: they run over the process x chip mesh, and their results stay split
over each process's chips. Every result is compared with the values computed on the host.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import hf_tpu
import torchrun_cases
from hf_tpu import sharding
from hf_tpu.backend import runtime
from hf_tpu.distributed import runtime as dist_runtime

WORLD, CHIPS = 2, 2
BOTH_CHIPS = (torch.device("tpu", 0), torch.device("tpu", 1))
LAUNCH_TIMEOUT_S, WORKER_TIMEOUT_S = 120, 100


def _values(rank: int, *shape: int) -> torch.Tensor:
    """Different values on each rank (exact in float32)."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * (rank + 2) - 3 * rank


def _every(*shape: int) -> list[torch.Tensor]:
    return [_values(rank, *shape) for rank in range(WORLD)]


def _split(tensor: torch.Tensor, spec=("chips", None)) -> torch.Tensor:
    return hf_tpu.distribute(tensor, ["tpu:0", "tpu:1"], spec)


def _split_as(tensor: torch.Tensor, spec) -> None:
    assert hf_tpu.placement(tensor) == BOTH_CHIPS, hf_tpu.placement(tensor)
    actual = tuple(sharding.view_spec(tensor))
    assert actual == (*(spec or ()), *(None,) * (tensor.dim() - len(spec or ()))), actual


def _on_chip(tensor: torch.Tensor, chip: int) -> None:
    assert tensor.device == torch.device("tpu", chip), tensor.device
    assert hf_tpu.placement(tensor) == (torch.device("tpu", chip),), hf_tpu.placement(tensor)


def case_each_process_drives_its_own_two_chips():
    jax = runtime.jax_module()
    rank = dist.get_rank()
    assert torch.tpu.device_count() == CHIPS
    assert runtime.devices() == tuple(jax.local_devices())
    assert [d.process_index for d in runtime.devices()] == [rank] * CHIPS
    assert len(jax.devices()) == WORLD * CHIPS  # the other process's chips are known, not local
    assert tuple(dist_runtime.process_devices(rank)) == runtime.devices()


def case_a_collective_on_tpu1_runs_over_each_process_tpu1():
    rank = dist.get_rank()
    for chip in range(CHIPS):  # the group's mesh for tensors on tpu:<chip>: that chip of every process
        mesh = dist.group.WORLD._mesh(sharding.mesh([chip]))
        assert list(mesh.devices[:, 0]) == [dist_runtime.process_devices(r)[chip] for r in range(WORLD)]
        assert [d.process_index for d in mesh.devices[:, 0]] == list(range(WORLD))
    for chip in (1, 0):
        device = _values(rank, 3, 2).to(f"tpu:{chip}")
        dist.all_reduce(device)
        _on_chip(device, chip)
        torch.testing.assert_close(device.cpu(), _values(0, 3, 2) + _values(1, 3, 2))
    gathered = torch.empty(WORLD * 3, device="tpu:1")
    dist.all_gather_into_tensor(gathered, _values(rank, 3).to("tpu:1"))
    _on_chip(gathered, 1)
    torch.testing.assert_close(gathered.cpu(), torch.cat([_values(0, 3), _values(1, 3)]))


def case_a_collective_writes_into_a_parameter_as_gloo_does():
    """Broadcasting parameters (leaves that require grad), as DDP and accelerate do, on tpu:1 and on the CPU."""
    rank = dist.get_rank()
    device = torch.nn.Parameter(_values(rank, 4).to("tpu:1"))
    host = torch.nn.Parameter(_values(rank, 4))
    dist.broadcast(device, src=1)
    dist.broadcast(host, src=1)
    _on_chip(device, 1)
    assert device.requires_grad and device.is_leaf
    torch.testing.assert_close(device.detach().cpu(), host.detach())
    torch.testing.assert_close(host.detach(), _values(1, 4))


def case_sharded_tensor_over_local_chips():
    rank = dist.get_rank()
    host = _values(rank, 4, 6)
    sharded = hf_tpu.distribute(host, ["tpu:0", "tpu:1"], ("chips", None))
    assert hf_tpu.placement(sharded) == (torch.device("tpu", 0), torch.device("tpu", 1))
    weight = _values(1 - rank, 6, 3)
    torch.testing.assert_close((sharded @ weight.to("tpu")).cpu(), host @ weight)
    torch.testing.assert_close(sharded.sum(0).cpu(), host.sum(0))


def case_sharded_model_inside_a_tpu_dist_process():
    rank = dist.get_rank()
    torch.manual_seed(rank)  # each process its own model
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    hf_tpu.shard(model, tp_size=CHIPS, plan={"0": "colwise", "2": "rowwise"})
    assert hf_tpu.placement(model[0].weight) == (torch.device("tpu", 0), torch.device("tpu", 1))
    inputs = _values(rank, 3, 8) / 10
    out = model(inputs.to("tpu"))
    torch.testing.assert_close(out.cpu(), reference(inputs), rtol=1e-5, atol=1e-5)
    gathered = hf_tpu.distribute(out, ["tpu:0"])  # one chip's tensor, for a collective across the processes
    assert hf_tpu.placement(gathered) == (torch.device("tpu", 0),)
    dist.all_reduce(gathered)
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, reference(inputs).detach())
    torch.testing.assert_close(gathered.cpu(), everyone[0] + everyone[1], rtol=1e-5, atol=1e-5)


def case_the_process_x_chip_mesh():
    """A collective on tensors split over a process's two chips runs over every process's two chips: a 2 x 2 mesh."""
    mesh = dist.group.WORLD._mesh(sharding.mesh(["tpu:0", "tpu:1"]))
    assert mesh.axis_names == ("ranks", "chips") and mesh.devices.shape == (WORLD, CHIPS)
    for rank in range(WORLD):
        assert list(mesh.devices[rank]) == dist_runtime.process_devices(rank)


def case_collectives_on_tensors_split_over_each_process_chips():
    rank = dist.get_rank()
    for spec in (("chips", None), (None, "chips"), None):  # split by rows, by columns, a whole copy per chip
        summed = _split(_values(rank, 4, 6), spec)
        dist.all_reduce(summed)
        _split_as(summed, spec)
        torch.testing.assert_close(summed.cpu(), sum(_every(4, 6)))
        largest = _split(_values(rank, 4, 6), spec)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        torch.testing.assert_close(largest.cpu(), torch.maximum(*_every(4, 6)))
        averaged = _split(_values(rank, 4, 6), spec)
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(averaged.cpu(), sum(_every(4, 6)) / WORLD)
        sent = _split(_values(rank, 4, 6), spec)
        dist.broadcast(sent, src=1)
        _split_as(sent, spec)
        torch.testing.assert_close(sent.cpu(), _values(1, 4, 6))

        gathered = _split(torch.empty(WORLD * 4, 6), spec)
        dist.all_gather_into_tensor(gathered, _split(_values(rank, 4, 6), spec))
        _split_as(gathered, spec)
        torch.testing.assert_close(gathered.cpu(), torch.cat(_every(4, 6)))
        pieces = [_split(torch.empty(4, 6), spec) for _ in range(WORLD)]
        dist.all_gather(pieces, _split(_values(rank, 4, 6), spec))
        for piece, expected in zip(pieces, _every(4, 6)):
            _split_as(piece, spec)
            torch.testing.assert_close(piece.cpu(), expected)

        mine = _split(torch.empty(2, 6), spec)  # dim 0 is split over the ranks, then over the chips
        dist.reduce_scatter_tensor(mine, _split(_values(rank, 4, 6), spec))
        _split_as(mine, spec)
        torch.testing.assert_close(mine.cpu(), sum(_every(4, 6))[2 * rank:2 * rank + 2])
        exchanged = _split(torch.empty(4, 6), spec)
        dist.all_to_all_single(exchanged, _split(_values(rank, 4, 6), spec))
        torch.testing.assert_close(exchanged.cpu(), torch.cat([every[2 * rank:2 * rank + 2]
                                                               for every in _every(4, 6)]))


def case_a_compiled_graph_with_collectives_on_tensors_split_over_chips():
    """One XLA program per process: a tensor-parallel matmul over the process's chips (XLA's partitioner), then
    collectives across the processes (the graph's shard_map is manual over the processes only)."""
    from torch.distributed import _functional_collectives as funcol

    from hf_tpu.compile import compile_stats, reset_compile_stats

    rank = dist.get_rank()

    @torch.compile(backend="tpu", fullgraph=True)
    def step(x, w, scale):
        y = funcol.all_reduce(x @ w * scale, "sum", dist.group.WORLD)
        return y.relu(), funcol.all_gather_tensor(y.sum(0), 0, dist.group.WORLD), y.sum()

    weight = _values(0, 6, 8) / 10
    reset_compile_stats()
    for spec in (("chips", None), None):
        x = _split(_values(rank, 4, 6), spec)
        w = _split(weight, (None, "chips"))
        scale = torch.tensor(0.5, device="tpu")  # on one chip: copied onto the mesh for the call
        relu, gathered, total = step(x, w, scale)
        summed = sum(every @ weight for every in _every(4, 6)) * 0.5
        for result in (relu, gathered, total):
            assert hf_tpu.placement(result) == BOTH_CHIPS, hf_tpu.placement(result)
        torch.testing.assert_close(relu.cpu(), summed.relu())
        torch.testing.assert_close(gathered.cpu(), torch.cat([summed.sum(0)] * WORLD))
        torch.testing.assert_close(total.cpu(), summed.sum())
    assert compile_stats()["fallbacks"] == 0, compile_stats()


def case_dtensor_over_the_processes_of_tensors_split_over_chips():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    rank = dist.get_rank()
    mesh = init_device_mesh("tpu", (WORLD,))
    local = _split(_values(rank, 4, 6))
    rows = DTensor.from_local(local, mesh, [Shard(0)])
    whole = rows.full_tensor()  # on both chips, laid out as XLA chose
    assert hf_tpu.placement(whole) == BOTH_CHIPS
    torch.testing.assert_close(whole.cpu(), torch.cat(_every(4, 6)))
    replicated = rows.redistribute(mesh, [Replicate()]).to_local()
    torch.testing.assert_close(replicated.cpu(), torch.cat(_every(4, 6)))
    partial = DTensor.from_local(local, mesh, [Partial()])
    torch.testing.assert_close(partial.full_tensor().cpu(), sum(_every(4, 6)))
    weight = _values(0, 6, 3) / 10
    product = rows @ DTensor.from_local(_split(weight, None), mesh, [Replicate()])
    assert product.placements == (Shard(0),)
    torch.testing.assert_close(product.full_tensor().cpu(), torch.cat(_every(4, 6)) @ weight)


def case_data_parallel_over_processes_tensor_parallel_over_chips():
    """DDP over the two processes of a model split over each process's two chips (hf_tpu.shard): gradients
    averaged across the processes, still split over the chips, equal to one model's on both processes' batches."""
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)  # the same model in both processes
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    hf_tpu.shard(model, tp_size=CHIPS, plan={"0": "colwise", "2": "rowwise"})
    ddp = DistributedDataParallel(model)
    ddp(_values(rank, 3, 8).to("tpu") / 10).square().mean().backward()
    reference(torch.cat(_every(3, 8)) / 10).square().mean().backward()
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
        assert hf_tpu.placement(parameter.grad) == BOTH_CHIPS, name
        torch.testing.assert_close(parameter.grad.cpu(), expected.grad, rtol=1e-5, atol=1e-6, msg=name)


def case_fsdp2_over_processes_tensor_parallel_over_chips():
    """FSDP2 (fully_shard) over the two processes of a model split over each process's two chips: one step of
    AdamW gives the weights one model gets from both processes' batches. (FSDP2's own buffers, made with
    torch.empty, are on one chip: its shards and all-gathers are not split over the chips.)"""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    hf_tpu.shard(model, tp_size=CHIPS, plan={"0": "colwise", "2": "rowwise"})
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(_values(rank, 3, 8).to("tpu") / 10).square().mean().backward()
    optimizer.step()
    expected = torch.optim.AdamW(reference.parameters(), lr=0.1)
    reference(torch.cat(_every(3, 8)) / 10).square().mean().backward()
    expected.step()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.full_tensor().cpu(), wanted.detach(), rtol=1e-5, atol=1e-6, msg=name)


def case_bad_input_says_what_to_do():
    outputs = [torch.empty(2, device="tpu:0"), torch.empty(2, device="tpu:1")]
    with pytest.raises(ValueError, match=r"tensors on several chips \(\['tpu:0', 'tpu:1'\]\).*move them to one"):
        dist.all_gather(outputs, torch.ones(2, device="tpu:0"))
    dist.barrier()  # both ranks still join the next collective


reports = torchrun_cases.report_fixture(__file__, world=WORLD, timeout=LAUNCH_TIMEOUT_S,
                                        env={"HF_TPU_NUM_DEVICES": str(CHIPS)})


@pytest.mark.parametrize("case", torchrun_cases.cases(globals()))
@pytest.mark.parametrize("rank", range(WORLD))
def test_two_processes_two_chips_each(reports, rank, case):
    assert reports[rank][case] == "ok", reports[rank][case]


if __name__ == "__main__":
    torchrun_cases.main(globals(), worker_timeout=WORKER_TIMEOUT_S)
