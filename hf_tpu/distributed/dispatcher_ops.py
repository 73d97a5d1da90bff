"""PrivateUse1 kernels of the dispatcher's collective ops, which DTensor, ``torch.distributed._functional_collectives``
and the coalesced ``torch.distributed`` functions call: each resolves its process group and calls a
:class:`~.process_group.TpuProcessGroup` method (one implementation of every collective).

torch's own kernels of these ops look up the group's C++ ``c10d::Backend`` for the tensor's device, and a Python
process group has none for tpu ("No backend type associated with device type tpu"). Kernels registered here run
instead for tpu tensors:

* ``_c10d_functional.*`` (and ``_c10d_functional_autograd.*``, whose backward torch defines in terms of the former):
  asynchronous, as on GPUs. Each returns its output at once and registers the collective's Work for it in torch's
  work registry, the one torch's own ``wait_tensor`` kernel waits on; the values land in the output when it is
  waited for (``AsyncCollectiveTensor`` does so on first use).
* ``c10d.*`` (what a ``ProcessGroup`` method that ``TpuProcessGroup`` does not override, such as
  ``allreduce_coalesced``, runs): complete before returning, with a finished Work (the op's Work crosses into C++,
  where a Work written in Python cannot be waited for once its Python object is gone).

Registration (:func:`register`) is JAX-free; the kernels import the JAX side when they first run.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
               "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
               "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
_libraries: list[torch.library.Library] = []  # a Library's kernels live as long as it does


def _group(group: Any, what: str) -> Any:
    """The ``TpuProcessGroup`` that ``group`` (a registered group name, a ``ProcessGroup`` or its boxed script
    object) names; a clear error for a group that cannot run collectives on tpu tensors."""
    from .process_group import TpuProcessGroup

    if isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    elif isinstance(group, str):
        group = torch._C._distributed_c10d._resolve_process_group(group)
    if not isinstance(group, TpuProcessGroup):
        raise ValueError(f"tpu_dist: {what} got tpu tensors and a {group.name()} process group, which cannot run "
                         "collectives on tpu; use a tpu_dist group: init_process_group() (tpu_dist is tpu's "
                         "default), or new_group(ranks, backend='cpu:gloo,tpu:tpu_dist'), or move the tensors to cpu.")
    return group


def _reduce_op(name: str) -> dist.ReduceOp:
    try:
        return _REDUCE_OPS[name.lower()]
    except KeyError:
        raise ValueError(f"tpu_dist: unknown reduce op {name!r}; use one of {', '.join(_REDUCE_OPS)}.") from None


def _options(kind: Callable[[], Any], **fields: Any) -> Any:
    options = kind()
    for field, value in fields.items():
        setattr(options, field, value)
    return options


def _check_group_size(what: str, group: Any, group_size: int) -> None:
    if group_size != group.size():
        raise ValueError(f"tpu_dist: {what} was given group_size={group_size}, but the group has {group.size()} "
                         "ranks; pass the group's size (dist.get_world_size(group)).")


def _same_device_type(what: str, tensors: Sequence[torch.Tensor]) -> None:
    from .process_group import _device_type

    _device_type(tensors, what)


def _issued(outputs: Sequence[torch.Tensor], work: dist.Work) -> None:
    """Registers ``work`` as the collective that writes ``outputs``: ``wait_tensor`` on one of them waits for it."""
    for output in outputs:
        torch._C._distributed_c10d._register_work(output, work)


# _c10d_functional: asynchronous; the output's values are there once wait_tensor has run on it.

def all_reduce_(input: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    """``input`` reduced over the group in place."""
    return all_reduce_coalesced_([input], reduce_op, group_name)[0]


def all_reduce(input: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    """A new tensor: ``input`` reduced over the group."""
    return all_reduce_(input.clone(memory_format=torch.contiguous_format), reduce_op, group_name)


def all_reduce_coalesced_(inputs: list[torch.Tensor], reduce_op: str, group_name: Any) -> list[torch.Tensor]:
    group = _group(group_name, "all_reduce")
    work = group.allreduce(inputs, _options(dist.AllreduceOptions, reduceOp=_reduce_op(reduce_op)))
    _issued(inputs, work)
    return inputs


def all_reduce_coalesced(inputs: list[torch.Tensor], reduce_op: str, group_name: Any) -> list[torch.Tensor]:
    copies = [t.clone(memory_format=torch.contiguous_format) for t in inputs]
    return all_reduce_coalesced_(copies, reduce_op, group_name)


def all_gather_into_tensor_out(input: torch.Tensor, group_size: int, group_name: Any, *,
                               out: torch.Tensor) -> torch.Tensor:
    """Every rank's ``input`` stacked along dim 0 into ``out``, in group rank order."""
    group = _group(group_name, "all_gather_into_tensor")
    _check_group_size("all_gather_into_tensor", group, group_size)
    _issued([out], group.all_gather_single(out, input.contiguous()))
    return out


def all_gather_into_tensor(input: torch.Tensor, group_size: int, group_name: Any) -> torch.Tensor:
    out = input.new_empty((input.shape[0] * group_size, *input.shape[1:]) if input.dim() else (group_size,))
    return all_gather_into_tensor_out(input, group_size, group_name, out=out)


def all_gather_into_tensor_coalesced(inputs: list[torch.Tensor], group_size: int,
                                     group_name: Any) -> list[torch.Tensor]:
    _same_device_type("all_gather_into_tensor_coalesced", inputs)
    return [all_gather_into_tensor(t, group_size, group_name) for t in inputs]


def reduce_scatter_tensor_out(input: torch.Tensor, reduce_op: str, group_size: int, group_name: Any, *,
                              out: torch.Tensor) -> torch.Tensor:
    """``input`` reduced over the group; this rank's 1/group_size of it along dim 0, into ``out``."""
    group = _group(group_name, "reduce_scatter_tensor")
    _check_group_size("reduce_scatter_tensor", group, group_size)
    if input.dim() == 0 or input.shape[0] % group_size:
        raise ValueError(f"tpu_dist: reduce_scatter_tensor needs dim 0 of the input ({tuple(input.shape)}) "
                         f"divisible by the group size ({group_size}); pad it first.")
    options = _options(dist.ReduceScatterOptions, reduceOp=_reduce_op(reduce_op))
    _issued([out], group.reduce_scatter_single(out, input.contiguous(), options))
    return out


def reduce_scatter_tensor(input: torch.Tensor, reduce_op: str, group_size: int, group_name: Any) -> torch.Tensor:
    rows = input.shape[0] // group_size if input.dim() else 0
    out = input.new_empty((rows, *input.shape[1:]))
    return reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, out=out)


def reduce_scatter_tensor_coalesced(inputs: list[torch.Tensor], reduce_op: str, group_size: int,
                                    group_name: Any) -> list[torch.Tensor]:
    _same_device_type("reduce_scatter_tensor_coalesced", inputs)
    return [reduce_scatter_tensor(t, reduce_op, group_size, group_name) for t in inputs]


def all_to_all_single(input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                      group_name: Any) -> torch.Tensor:
    """Block j of ``input`` (dim 0, ``input_split_sizes``) goes to rank j; the result's block i came from rank i."""
    group = _group(group_name, "all_to_all_single")
    rows = sum(output_split_sizes) if output_split_sizes else input.shape[0]
    out = input.new_empty((rows, *input.shape[1:]))
    _issued([out], group.all_to_all_single(out, input.contiguous(), list(output_split_sizes),
                                           list(input_split_sizes)))
    return out


def broadcast_(input: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    """``input`` set to group rank ``src``'s, in place."""
    group = _group(group_name, "broadcast")
    _issued([input], group.broadcast([input], _options(dist.BroadcastOptions, rootRank=src)))
    return input


def broadcast(input: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    return broadcast_(input.clone(memory_format=torch.contiguous_format), src, group_name)


def isend(tensor: torch.Tensor, dst: int, tag: int, group_name: Any) -> torch.Tensor:
    """Sends ``tensor`` to group rank ``dst`` (for tpu tensors: not supported, the error says so)."""
    return batch_p2p_ops(["isend"], [dst], [tag], [tensor], group_name)[0]


def irecv(tensor: torch.Tensor, src: int, tag: int, group_name: Any) -> torch.Tensor:
    """Receives into ``tensor`` from group rank ``src`` (for tpu tensors: not supported, the error says so)."""
    return batch_p2p_ops(["irecv"], [src], [tag], [tensor], group_name)[0]


def batch_p2p_ops(op_list: list[str], peer_list: list[int], tag_list: list[int], tensors: list[torch.Tensor],
                  group_name: Any) -> list[torch.Tensor]:
    group = _group(group_name, "batch_isend_irecv")
    for op, peer, tag, tensor in zip(op_list, peer_list, tag_list, tensors):
        _issued([tensor], (group.send if op == "isend" else group.recv)([tensor], peer, tag))
    return tensors


_FUNCTIONAL = (all_reduce, all_reduce_, all_reduce_coalesced, all_reduce_coalesced_, all_gather_into_tensor,
               all_gather_into_tensor_out, all_gather_into_tensor_coalesced, reduce_scatter_tensor,
               reduce_scatter_tensor_out, reduce_scatter_tensor_coalesced, all_to_all_single, broadcast, broadcast_,
               isend, irecv, batch_p2p_ops)
_FUNCTIONAL_AUTOGRAD = (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single)


# c10d: complete on return (see the module docstring).

def _limit(timeout: int) -> datetime.timedelta | None:
    return None if timeout < 0 else datetime.timedelta(milliseconds=timeout)


def _done(work: dist.Work, outputs: list[torch.Tensor], timeout: int = -1) -> Any:
    """``work`` waited for, for at most ``timeout`` milliseconds (the op's own; the group's when negative, c10d's
    unset value); a finished Work (boxed, as the op returns it) in its place."""
    work.wait(_limit(timeout))
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(outputs)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()


def _c10d_reduce_op(reduce_op: Any) -> dist.ReduceOp:
    return dist.ReduceOp.RedOpType(reduce_op.op())


def _c10d_broadcast_(tensors, process_group, root_rank, root_tensor, async_op=True, timeout=-1):
    group = _group(process_group, "broadcast")
    options = _options(dist.BroadcastOptions, rootRank=root_rank, rootTensor=root_tensor)
    return tensors, _done(group.broadcast(tensors, options), tensors, timeout)


def _c10d_allreduce_(tensors, process_group, reduce_op, sparse_indices=None, async_op=True, timeout=-1):
    group = _group(process_group, "all_reduce")
    options = _options(dist.AllreduceOptions, reduceOp=_c10d_reduce_op(reduce_op))
    return tensors, _done(group.allreduce(tensors, options), tensors, timeout)


def _c10d_allreduce_coalesced_(tensors, process_group, reduce_op, async_op=True, timeout=-1):
    return _c10d_allreduce_(tensors, process_group, reduce_op, timeout=timeout)[1]


def _c10d_allgather_(output_tensors, input_tensors, process_group, async_op=True, timeout=-1):
    group = _group(process_group, "all_gather")
    outputs = [t for chunk in output_tensors for t in chunk]
    return output_tensors, _done(group.allgather(output_tensors, input_tensors), outputs, timeout)


def _c10d_allgather_coalesced_(output_lists, input_list, process_group, async_op=True):
    group = _group(process_group, "all_gather_coalesced")
    _same_device_type("all_gather_coalesced", [*input_list, *(t for outputs in output_lists for t in outputs)])
    works = [group.allgather([outputs], [input]) for outputs, input in zip(output_lists, input_list)]
    return _done_all(works, [t for outputs in output_lists for t in outputs])


def _c10d_allgather_base_(output_tensor, input_tensor, process_group, async_op=True, timeout=-1):
    group = _group(process_group, "all_gather_into_tensor")
    return output_tensor, _done(group.all_gather_single(output_tensor, input_tensor), [output_tensor], timeout)


def _c10d_allgather_into_tensor_coalesced_(outputs, inputs, process_group, async_op=True):
    group = _group(process_group, "all_gather_into_tensor_coalesced")
    _same_device_type("all_gather_into_tensor_coalesced", [*outputs, *inputs])
    works = [group.all_gather_single(output, input) for output, input in zip(outputs, inputs)]
    return _done_all(works, outputs)


def _done_all(works: list[dist.Work], outputs: list[torch.Tensor], timeout: int = -1) -> Any:
    for work in works[:-1]:
        work.wait(_limit(timeout))
    return _done(works[-1], outputs, timeout)


def _c10d_reduce_scatter_(output_tensors, input_tensors, process_group, reduce_op, async_op=True, timeout=-1):
    group = _group(process_group, "reduce_scatter")
    options = _options(dist.ReduceScatterOptions, reduceOp=_c10d_reduce_op(reduce_op))
    work = group.reduce_scatter(output_tensors, input_tensors, options)
    return output_tensors, _done(work, output_tensors, timeout)


def _c10d_reduce_scatter_base_(output_tensor, input_tensor, process_group, reduce_op, async_op=True, timeout=-1):
    group = _group(process_group, "reduce_scatter_tensor")
    options = _options(dist.ReduceScatterOptions, reduceOp=_c10d_reduce_op(reduce_op))
    work = group.reduce_scatter_single(output_tensor, input_tensor, options)
    return output_tensor, _done(work, [output_tensor], timeout)


def _c10d_reduce_scatter_tensor_coalesced_(outputs, inputs, process_group, reduce_op, async_op=True, timeout=-1):
    group = _group(process_group, "reduce_scatter_tensor_coalesced")
    _same_device_type("reduce_scatter_tensor_coalesced", [*outputs, *inputs])
    options = _options(dist.ReduceScatterOptions, reduceOp=_c10d_reduce_op(reduce_op))
    works = [group.reduce_scatter_single(output, input, options) for output, input in zip(outputs, inputs)]
    return _done_all(works, outputs, timeout)


def _c10d_reduce_(tensors, process_group, reduce_op, root_rank, root_tensor, async_op=True, timeout=-1):
    group = _group(process_group, "reduce")
    options = _options(dist.ReduceOptions, reduceOp=_c10d_reduce_op(reduce_op), rootRank=root_rank,
                       rootTensor=root_tensor)
    return _done(group.reduce(tensors, options), tensors, timeout)


def _c10d_gather_(output_tensors, input_tensors, process_group, root_rank, async_op=True, timeout=-1):
    group = _group(process_group, "gather")
    outputs = [t for chunk in output_tensors for t in chunk]
    options = _options(dist.GatherOptions, rootRank=root_rank)
    return _done(group.gather(output_tensors, input_tensors, options), outputs, timeout)


def _c10d_scatter_(output_tensors, input_tensors, process_group, root_rank, async_op=True, timeout=-1):
    group = _group(process_group, "scatter")
    options = _options(dist.ScatterOptions, rootRank=root_rank)
    return output_tensors, _done(group.scatter(output_tensors, input_tensors, options), output_tensors, timeout)


def _c10d_alltoall_base_(output, input, process_group, output_split_sizes, input_split_sizes, async_op=True,
                         timeout=-1):
    group = _group(process_group, "all_to_all_single")
    return _done(group.all_to_all_single(output, input, output_split_sizes, input_split_sizes), [output], timeout)


def _c10d_alltoall_(output_tensors, input_tensors, process_group, async_op=True, timeout=-1):
    """Tensor j to rank j, tensor i from rank i: one all_to_all_single of the tensors stacked along dim 0."""
    group = _group(process_group, "all_to_all")
    _same_device_type("all_to_all", [*output_tensors, *input_tensors])
    rows = [len(t) for t in output_tensors]
    received = torch.cat([t.detach() for t in output_tensors])  # the outputs' shape, for the values received
    work = group.all_to_all_single(received, torch.cat(list(input_tensors)), rows, [len(t) for t in input_tensors])
    done = _done(work, output_tensors, timeout)
    for output, piece in zip(output_tensors, received.split(rows)):
        output.copy_(piece)
    return output_tensors, done


def _c10d_barrier(tensor, process_group, device_ids, async_op=True, timeout=-1):
    return _done(_group(process_group, "barrier").barrier(), [tensor], timeout)


def _c10d_monitored_barrier_(tensor, process_group, device_ids, timeout, wait_all_ranks):
    _group(process_group, "monitored_barrier").barrier().wait(_limit(timeout))


def _c10d_send(tensors, process_group, dst, tag):
    return _done(_group(process_group, "send").send(tensors, dst, tag), tensors)


def _c10d_recv_(tensors, process_group, src, tag):
    return _done(_group(process_group, "recv").recv(tensors, src, tag), tensors)


_C10D = {
    "broadcast_": _c10d_broadcast_, "allreduce_": _c10d_allreduce_, "allreduce_coalesced_": _c10d_allreduce_coalesced_,
    "allgather_": _c10d_allgather_, "allgather_coalesced_": _c10d_allgather_coalesced_,
    "_allgather_base_": _c10d_allgather_base_,
    "allgather_into_tensor_coalesced_": _c10d_allgather_into_tensor_coalesced_,
    "reduce_scatter_": _c10d_reduce_scatter_, "_reduce_scatter_base_": _c10d_reduce_scatter_base_,
    "reduce_scatter_tensor_coalesced_": _c10d_reduce_scatter_tensor_coalesced_, "reduce_": _c10d_reduce_,
    "gather_": _c10d_gather_, "scatter_": _c10d_scatter_, "alltoall_base_": _c10d_alltoall_base_,
    "alltoall_": _c10d_alltoall_, "barrier": _c10d_barrier, "monitored_barrier_": _c10d_monitored_barrier_,
    "send": _c10d_send, "recv_": _c10d_recv_,
}


def register() -> None:
    """Registers the kernels for PrivateUse1 (tpu), once; JAX-free."""
    if _libraries or not dist.is_available():
        return
    for namespace, kernels in (("_c10d_functional", {fn.__name__: fn for fn in _FUNCTIONAL}),
                               ("_c10d_functional_autograd", {fn.__name__: fn for fn in _FUNCTIONAL_AUTOGRAD}),
                               ("c10d", _C10D)):
        library = torch.library.Library(namespace, "IMPL")
        with warnings.catch_warnings():  # replacing torch's c10d kernels for PrivateUse1 is the point
            warnings.filterwarnings("ignore", "(?s).*Overriding a previously registered kernel")
            for name, kernel in kernels.items():
                library.impl(name, kernel, "PrivateUse1")
        _libraries.append(library)
