"""The dispatcher's collective ops on tpu tensors (hf_tpu.distributed.dispatcher_ops), across real processes.

One torchrun launch of 2 processes (tests/torchrun_cases.py) runs every ``case_*`` function: the
``_c10d_functional`` ops (directly, and through ``torch.distributed._functional_collectives``), their autograd, the
``c10d`` ops that ``ProcessGroup`` methods run, and the errors for bad input. Each result is compared with the
values computed on CPU from what every rank holds (``_values`` of each rank), or with the same op on CPU tensors.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import hf_tpu  # noqa: F401  (registers the device even where autoload is off)
import torchrun_cases

WORLD = 2
ops = torch.ops._c10d_functional


def _values(rank: int, *shape: int) -> torch.Tensor:
    """Different values on each rank (exact in float32)."""
    numel = torch.Size(shape).numel()
    return torch.arange(numel, dtype=torch.float32).reshape(shape) * (rank + 2) - 3 * rank


def _every_rank(*shape: int) -> list[torch.Tensor]:
    return [_values(k, *shape) for k in range(WORLD)]


def _mine(*shape: int) -> torch.Tensor:
    return _values(dist.get_rank(), *shape).to("tpu")


def _name() -> str:
    return dist.group.WORLD.group_name


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device.type == "tpu", actual.device
    torch.testing.assert_close(actual.cpu(), expected)


def case_funcol_all_reduce_is_async_and_exact():
    for op, reduce in (("sum", lambda xs: xs[0] + xs[1]), ("max", lambda xs: torch.maximum(*xs)),
                       ("avg", lambda xs: (xs[0] + xs[1]) / 2)):
        result = funcol.all_reduce(_mine(3, 2), op, dist.group.WORLD)
        assert isinstance(result, funcol.AsyncCollectiveTensor)
        _same(result.wait(), reduce(_every_rank(3, 2)))


def case_functional_ops_by_name_and_by_group():
    rank = dist.get_rank()
    by_group = "str group_name" not in str(ops.all_reduce.default._schema)  # 2.13: a group too
    for group in (_name(), dist.group.WORLD) if by_group else (_name(),):
        everyone = _every_rank(4, 3)
        _same(ops.wait_tensor(ops.all_reduce(_mine(4, 3), "sum", group)), sum(everyone))
        _same(ops.wait_tensor(ops.all_gather_into_tensor(_mine(4, 3), WORLD, group)), torch.cat(everyone))
        _same(ops.wait_tensor(ops.reduce_scatter_tensor(_mine(4, 3), "sum", WORLD, group)),
              sum(everyone).chunk(WORLD)[rank])
        _same(ops.wait_tensor(ops.broadcast(_mine(4, 3), 1, group)), everyone[1])
        _same(ops.wait_tensor(ops.all_to_all_single(_mine(4, 3), [2, 2], [2, 2], group)),
              torch.cat([x.chunk(WORLD)[rank] for x in everyone]))


def case_in_place_and_out_variants():
    rank, everyone = dist.get_rank(), _every_rank(2, 2)
    tensor = _mine(2, 2)
    assert ops.all_reduce_(tensor, "sum", _name()) is tensor
    ops.wait_tensor(tensor)
    _same(tensor, sum(everyone))
    tensor = _mine(2, 2)
    ops.wait_tensor(ops.broadcast_(tensor, 0, _name()))
    _same(tensor, everyone[0])
    out = torch.empty(2 * WORLD, 2, device="tpu")
    ops.wait_tensor(ops.all_gather_into_tensor_out(_mine(2, 2), WORLD, _name(), out=out))
    _same(out, torch.cat(everyone))
    out = torch.empty(1, 2, device="tpu")
    ops.wait_tensor(ops.reduce_scatter_tensor_out(_mine(2, 2), "sum", WORLD, _name(), out=out))
    _same(out, sum(everyone)[rank:rank + 1])


def case_coalesced_ops():
    rank = dist.get_rank()
    shapes = ((2, 3), (4,))
    for result, shape in zip(ops.all_reduce_coalesced([_mine(*s) for s in shapes], "max", _name()), shapes):
        _same(ops.wait_tensor(result), torch.maximum(*_every_rank(*shape)))
    tensors = [_mine(*s) for s in shapes]
    ops.all_reduce_coalesced_(tensors, "sum", _name())
    for tensor, shape in zip(tensors, shapes):
        _same(ops.wait_tensor(tensor), sum(_every_rank(*shape)))
    gathered = ops.all_gather_into_tensor_coalesced([_mine(*s) for s in shapes], WORLD, _name())
    for result, shape in zip(gathered, shapes):
        _same(ops.wait_tensor(result), torch.cat(_every_rank(*shape)))
    scattered = ops.reduce_scatter_tensor_coalesced([_mine(*s) for s in shapes], "sum", WORLD, _name())
    for result, shape in zip(scattered, shapes):
        _same(ops.wait_tensor(result), sum(_every_rank(*shape)).chunk(WORLD)[rank])


def case_uneven_all_to_all_single():
    rank = dist.get_rank()
    sends = [[1, 2], [3, 1]]  # sends[r][j]: rows rank r sends to rank j
    tensors = [_values(k, sum(sends[k]), 2) for k in range(WORLD)]
    receives = [sends[k][rank] for k in range(WORLD)]
    result = ops.all_to_all_single(tensors[rank].to("tpu"), receives, sends[rank], _name())
    expected = torch.cat([tensors[k].split(sends[k])[rank] for k in range(WORLD)])
    _same(ops.wait_tensor(result), expected)


def case_wait_tensor_waits_for_the_registered_work():
    """The output carries its collective until wait_tensor, even once the Work object itself is gone."""
    before = torch._C._distributed_c10d._get_work_registry_size()
    result = ops.all_reduce(_mine(5), "sum", _name())
    gc.collect()
    assert torch._C._distributed_c10d._get_work_registry_size() == before + 1
    _same(ops.wait_tensor(result), sum(_every_rank(5)))
    assert torch._C._distributed_c10d._get_work_registry_size() == before


def _gradient(collective, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (collective(x) * weight).sum().backward()
    return x.grad


def case_autograd_ops_have_their_backward_on_tpu():
    """Each rank weights the collective's output by ``weight`` (the same on every rank); the gradient of the
    summed loss over every rank is the backward collective of the weights, worked out on CPU below."""
    rank, group = dist.get_rank(), dist.group.WORLD
    weight = torch.arange(8.0).reshape(4, 2) + 1
    grad = _gradient(lambda x: funcol.all_reduce(x, "sum", group), _mine(4, 2), weight.to("tpu"))
    _same(grad, WORLD * weight)  # all_reduce's backward: the grads all-reduced
    grad = _gradient(lambda x: funcol.all_gather_tensor_autograd(x, 0, group), _mine(2, 2), weight.to("tpu"))
    _same(grad, WORLD * weight.chunk(WORLD)[rank])  # all_gather's backward: reduce_scatter
    grad = _gradient(lambda x: funcol.reduce_scatter_tensor_autograd(x, "sum", 0, group), _mine(4, 2),
                     weight[:2].to("tpu"))
    _same(grad, torch.cat([weight[:2]] * WORLD))  # reduce_scatter's backward: all_gather
    grad = _gradient(lambda x: funcol.all_to_all_single_autograd(x, None, None, group), _mine(4, 2),
                     weight.to("tpu"))
    _same(grad, torch.cat([weight.chunk(WORLD)[rank]] * WORLD))  # all_to_all's backward: all_to_all back
    grad = _gradient(lambda x: ops.wait_tensor(torch.ops._c10d_functional_autograd.all_gather_into_tensor(
        x, WORLD, _name())), _mine(2, 2), weight.to("tpu"))
    _same(grad, WORLD * weight.chunk(WORLD)[rank])


def case_c10d_ops_behind_process_group_methods():
    """ProcessGroup methods tpu_dist does not override in Python run the c10d ops, whose tpu kernels are ours."""
    rank, group = dist.get_rank(), dist.group.WORLD
    tensors = [_mine(3), _mine(2, 2)]
    options = dist.AllreduceCoalescedOptions()
    options.reduceOp = dist.ReduceOp.SUM
    group.allreduce_coalesced(tensors, options).wait()
    _same(tensors[0], sum(_every_rank(3)))
    _same(tensors[1], sum(_every_rank(2, 2)))
    outs = [torch.empty(2 * WORLD, device="tpu"), torch.empty(WORLD, 3, device="tpu")]
    group.allgather_into_tensor_coalesced(outs, [_mine(2), _mine(1, 3)]).wait()
    _same(outs[0], torch.cat(_every_rank(2)))
    _same(outs[1], torch.cat(_every_rank(1, 3)))
    outs = [torch.empty(1, device="tpu")]
    group.reduce_scatter_tensor_coalesced(outs, [_mine(2)], dist.ReduceScatterOptions()).wait()
    _same(outs[0], sum(_every_rank(2))[rank:rank + 1])
    out = torch.empty(2 * WORLD, device="tpu")
    dist.ProcessGroup._allgather_base(group, out, _mine(2)).wait()
    _same(out, torch.cat(_every_rank(2)))


def _options(kind, **fields):
    options = kind()
    for field, value in fields.items():
        setattr(options, field, value)
    return options


def case_c10d_kernels_serve_the_base_process_group_methods():
    """What C++ callers reach: ProcessGroup's own methods (not tpu_dist's Python ones) run the c10d ops."""
    rank, group, base = dist.get_rank(), dist.group.WORLD, dist.ProcessGroup
    tensor = _mine(3)
    base.broadcast(group, [tensor], _options(dist.BroadcastOptions, rootRank=1)).wait()
    _same(tensor, _values(1, 3))
    tensor = _mine(3)
    base.allreduce(group, [tensor], _options(dist.AllreduceOptions, reduceOp=dist.ReduceOp.MAX)).wait()
    _same(tensor, torch.maximum(*_every_rank(3)))
    outs = [torch.empty(3, device="tpu") for _ in range(WORLD)]
    base.allgather(group, [outs], [_mine(3)]).wait()
    for out, expected in zip(outs, _every_rank(3)):
        _same(out, expected)
    out = torch.empty(2, device="tpu")
    base.reduce_scatter(group, [out], [list(_mine(4).chunk(WORLD))], dist.ReduceScatterOptions()).wait()
    _same(out, sum(_every_rank(4)).chunk(WORLD)[rank])
    base._reduce_scatter_base(group, out, _mine(4), dist.ReduceScatterOptions()).wait()
    _same(out, sum(_every_rank(4)).chunk(WORLD)[rank])
    out = torch.empty(4, device="tpu")
    base.alltoall_base(group, out, _mine(4), [2, 2], [2, 2], dist.AllToAllOptions()).wait()
    _same(out, torch.cat([x.chunk(WORLD)[rank] for x in _every_rank(4)]))
    tensor = _mine(3)
    base.reduce(group, [tensor], _options(dist.ReduceOptions, rootRank=0)).wait()
    _same(tensor, sum(_every_rank(3)) if rank == 0 else _values(rank, 3))
    out = torch.empty(2, device="tpu")
    chunks = [[t.to("tpu") for t in _values(0, 4).chunk(WORLD)]] if rank == 0 else []
    base.scatter(group, [out], chunks, _options(dist.ScatterOptions, rootRank=0)).wait()
    _same(out, _values(0, 4).chunk(WORLD)[rank])
    base.barrier(group).wait()
    with pytest.raises(NotImplementedError, match="send of tpu tensors is not supported yet"):
        base.send(group, [_mine(1)], 1 - rank, 0)


def case_tensor_list_all_to_all_and_all_gather_coalesced():
    """torch.distributed functions whose ProcessGroup methods tpu_dist leaves to the c10d ops."""
    rank = dist.get_rank()
    sends = [[1, 2], [3, 1]]  # sends[r][j]: rows rank r sends to rank j
    mine = [t.to("tpu") for t in _values(rank, sum(sends[rank]), 2).split(sends[rank])]
    outs = [torch.empty(sends[k][rank], 2, device="tpu") for k in range(WORLD)]
    dist.all_to_all(outs, mine)
    for k, out in enumerate(outs):
        _same(out, _values(k, sum(sends[k]), 2).split(sends[k])[rank])
    outs = [[torch.empty(*shape, device="tpu") for _ in range(WORLD)] for shape in ((2,), (1, 3))]
    dist.all_gather_coalesced(outs, [_mine(2), _mine(1, 3)])
    for k in range(WORLD):
        _same(outs[0][k], _values(k, 2))
        _same(outs[1][k], _values(k, 1, 3))


def case_coalescing_manager():
    """torch.distributed's coalescing (as DDP and FSDP use it) runs the coalesced c10d ops."""
    rank = dist.get_rank()
    tensors = [_mine(3), _mine(2, 2)]
    with dist._coalescing_manager():
        for tensor in tensors:
            dist.all_reduce(tensor)
    _same(tensors[0], sum(_every_rank(3)))
    _same(tensors[1], sum(_every_rank(2, 2)))
    gathered, scattered = torch.empty(2 * WORLD, device="tpu"), torch.empty(1, device="tpu")
    with dist._coalescing_manager(async_ops=True) as manager:
        dist.all_gather_into_tensor(gathered, _mine(2))
    manager.wait()
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(scattered, _mine(2))
    _same(gathered, torch.cat(_every_rank(2)))
    _same(scattered, sum(_every_rank(2))[rank:rank + 1])


def case_functional_ops_on_cpu_tensors_still_use_gloo():
    everyone = _every_rank(2, 2)
    result = ops.all_reduce(_values(dist.get_rank(), 2, 2), "sum", _name())
    torch.testing.assert_close(ops.wait_tensor(result), sum(everyone))
    result = ops.all_gather_into_tensor(_values(dist.get_rank(), 2, 2), WORLD, _name())
    torch.testing.assert_close(ops.wait_tensor(result), torch.cat(everyone))


def _raises(error: type, message: str, action) -> None:
    with pytest.raises(error, match=message):
        action()


def case_bad_input_says_what_to_do():
    tpu, cpu = torch.ones(2, device="tpu"), torch.ones(2)
    _raises(ValueError, r"one device type.*\.to\('tpu'\)", lambda: ops.all_reduce_coalesced([tpu, cpu], "sum", _name()))
    _raises(ValueError, r"one device type", lambda: dist.all_gather_into_tensor(torch.empty(2 * WORLD), tpu))
    _raises(ValueError, r"group_size=3, but the group has 2 ranks",
            lambda: ops.all_gather_into_tensor(tpu, 3, _name()))
    _raises(ValueError, r"unknown reduce op 'mean'", lambda: ops.all_reduce(tpu, "mean", _name()))
    _raises(ValueError, r"dim 0 of the input \(\(3,\)\) divisible by the group size",
            lambda: ops.reduce_scatter_tensor(torch.ones(3, device="tpu"), "sum", WORLD, _name()))
    peer = 1 - dist.get_rank()
    if hasattr(ops, "isend"):  # torch 2.13 has them, 2.11 not
        _raises(NotImplementedError, "send of tpu tensors is not supported yet",
                lambda: ops.isend(tpu, peer, 0, _name()))
        _raises(NotImplementedError, "recv of tpu tensors is not supported yet",
                lambda: ops.irecv(tpu, peer, 0, _name()))
    gloo = dist.new_group([0, 1], backend="gloo")
    _raises(ValueError, r"a gloo process group, which cannot run collectives on tpu; use a tpu_dist group",
            lambda: ops.all_reduce(tpu, "sum", gloo.group_name))
    dist.barrier()  # every rank still joins the next collective


reports = torchrun_cases.report_fixture(__file__, world=WORLD, timeout=120)


@pytest.mark.parametrize("case", torchrun_cases.cases(globals()))
@pytest.mark.parametrize("rank", range(WORLD))
def test_two_processes(reports, rank, case):
    assert reports[rank][case] == "ok", reports[rank][case]


if __name__ == "__main__":
    torchrun_cases.main(globals())
