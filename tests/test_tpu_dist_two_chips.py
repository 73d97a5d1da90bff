"""Two processes with two chips each (``HF_TPU_NUM_DEVICES=2`` in each, virtual CPU chips): what a multi-host
pod looks like in miniature (hosts = processes, each driving its local chips).

One torchrun launch (tests/torchrun_cases.py) runs every ``case_*`` function in both processes: each process
sees its own two chips as ``tpu:0`` and ``tpu:1``; a collective on tensors on ``tpu:1`` runs over the
processes' ``tpu:1`` chips; a tensor sharded over a process's two chips (one-process SPMD, ``hf_tpu.distribute``
and ``hf_tpu.shard``) works inside a ``tpu_dist`` process, next to the collectives across processes, which take
a tensor on one chip of each process (a sharded one is refused, saying how to gather it).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import hf_tpu
import torchrun_cases
from hf_tpu.backend import runtime
from hf_tpu.distributed import runtime as dist_runtime

WORLD, CHIPS = 2, 2
LAUNCH_TIMEOUT_S, WORKER_TIMEOUT_S = 120, 100


def _values(rank: int, *shape: int) -> torch.Tensor:
    """Different values on each rank (exact in float32)."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * (rank + 2) - 3 * rank


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
        mesh = dist.group.WORLD._mesh(chip)
        assert list(mesh.devices) == [dist_runtime.process_devices(r)[chip] for r in range(WORLD)]
        assert [d.process_index for d in mesh.devices] == list(range(WORLD))
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


def case_bad_input_says_what_to_do():
    sharded = hf_tpu.distribute(torch.ones(4, 2), ["tpu:0", "tpu:1"], ("chips",))
    with pytest.raises(ValueError, match=r"sharded over this process's chips tpu:0, tpu:1.*"
                                         r"hf_tpu\.distribute\(tensor, \['tpu:0'\]\)"):
        dist.all_reduce(sharded)
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
