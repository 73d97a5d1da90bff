"""``TpuProcessGroup``: the ``tpu_dist`` c10d backend, a Python process group whose collectives on tpu tensors
run as JAX programs (:mod:`.collectives`) and whose collectives on CPU tensors go to a Gloo group.

torch calls a Python process group's methods directly (``group.allreduce([tensor], opts)``); each returns a
:class:`TpuWork` whose ``wait()`` blocks until this rank's results are computed, for at most the group's
timeout (so a rank that never joins raises instead of hanging).
"""

from __future__ import annotations

import datetime
import functools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ProcessGroupGloo

from ..backend import storage
from . import collectives, runtime

_REDUCTIONS = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.MAX, "max"),
               (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.PRODUCT, "product"), (dist.ReduceOp.BAND, "band"),
               (dist.ReduceOp.BOR, "bor"), (dist.ReduceOp.BXOR, "bxor"))


def _reduction(op: dist.ReduceOp) -> tuple[str, Callable[[Any], Any] | None]:
    """The collective's reduction, and what is done to each rank's values first: for ``PREMUL_SUM`` (FSDP's
    gradient divide factor, ``dist._make_nccl_premul_sum(factor)``), the product by the factor, then a sum."""
    if op == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError("tpu_dist: ReduceOp.PREMUL_SUM needs its factor; make the op with "
                             "torch.distributed._make_nccl_premul_sum(factor).")
        factor = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
        return "sum", lambda array: (array * factor).astype(array.dtype)
    for known, name in _REDUCTIONS:
        if op == known:
            return name, None
    kind = getattr(op, "op", op)
    raise ValueError(f"tpu_dist: reduce op {getattr(kind, 'name', kind)} is not supported on tpu tensors.")


class _InOrder:
    """Runs functions one at a time, in the order given, on a daemon thread: every rank issues its collectives in
    program order, a caller can wait for one with a timeout (JAX's CPU client runs a collective in the thread
    that issues it), and a collective stuck on a missing rank cannot keep the process from exiting."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="hf_tpu-collectives", daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._queue.put((fn, future))
        return future

    def _serve(self) -> None:
        while True:
            fn, future = self._queue.get()
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to the waiting caller
                future.set_exception(error)


@functools.cache
def _in_order() -> _InOrder:
    return _InOrder()


class TpuWork(dist.Work):
    """One issued collective: ``wait()`` waits for its results, for at most its ``timeout`` (the group's by default),
    and then writes them into the output tensors."""

    def __init__(self, future: Future, outputs: Sequence[torch.Tensor], timeout: datetime.timedelta, what: str,
                 ranks: Sequence[int]) -> None:
        super().__init__()
        self._future, self._outputs, self._timeout, self._what, self._ranks = future, outputs, timeout, what, ranks
        self._completed = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._completed:
            return True
        limit = timeout or self._timeout
        try:
            results = self._future.result(limit.total_seconds())
        except TimeoutError:
            raise RuntimeError(
                f"tpu_dist: {self._what} over ranks {list(self._ranks)} did not finish within {limit}: a rank of "
                "the group has not joined it (every rank must call the same collectives in the same order). "
                f"Raise {'the timeout given to this wait' if timeout else 'init_process_group(timeout=...)'} if a "
                "rank is just slow.") from None
        for result, output in zip(results, self._outputs):
            output.detach().copy_(storage.wrap(result, output.dtype, output.device.index).reshape(output.shape))
        self._completed = True
        return True

    def is_completed(self) -> bool:
        return self._completed

    def is_success(self) -> bool:
        return self._completed

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self.wait()
        future.set_result(self._outputs)
        return future


def _device_type(tensors: Sequence[torch.Tensor], what: str) -> str:
    kinds = sorted({t.device.type for t in tensors})
    if len(kinds) != 1 or kinds[0] not in ("tpu", "cpu"):
        raise ValueError(f"tpu_dist: {what} got tensors on {', '.join(kinds)}; one collective takes tensors on one "
                         "device type, tpu (run by JAX) or cpu (run by Gloo): move them with .to('tpu') first.")
    if kinds == ["tpu"] and len({t.device.index for t in tensors}) != 1:
        raise ValueError(f"tpu_dist: {what} got tensors on several chips ({sorted({str(t.device) for t in tensors})})"
                         "; each process runs a collective on one of its chips: move them to one.")
    return kinds[0]


class TpuProcessGroup(dist.ProcessGroup):
    """A group of processes, one chip each; see the module docstring."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks: Sequence[int]) -> None:
        super().__init__(rank, size)
        self._timeout = timeout
        self._ranks = tuple(global_ranks) or tuple(range(size))
        self._gloo = ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        # torch's C++ kernels of the dispatcher's collective ops find it there for CPU tensors.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)

    def name(self) -> str:
        return "tpu_dist"

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The longest a collective of this group (and one of its CPU tensors, through Gloo) is waited for."""
        super().set_timeout(timeout)
        self._gloo.set_timeout(timeout)
        self._timeout = timeout

    @property
    def group_name(self) -> str:
        """The name torch registered the group under, which functional collectives and Dynamo pass around
        (torch keeps a group's name on its C++ backends, and a Python group has none)."""
        return dist.distributed_c10d._get_process_group_name(self)

    @functools.cache
    def _mesh(self, chips: Any) -> Any:
        """The mesh of a collective on tensors on this process's ``chips`` (a mesh of them): those chips of every
        process of the group, axis ``ranks`` first (the group's rank order), then ``chips``' own axes."""
        from jax.sharding import Mesh

        devices = runtime.chips_of_processes(self._ranks, [storage.chip_index(d) for d in chips.devices.flat])
        return Mesh(devices.reshape(len(self._ranks), *chips.devices.shape), (collectives.AXIS, *chips.axis_names))

    def _issue(self, what: str, kind: str, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
               static: Any = None, prepare: Callable[[Any], Any] | None = None,
               finish: Callable[[Any], list[Any]] | None = None) -> TpuWork:
        """Issues collective ``kind`` on each tensor's values (read now, then ``prepare``d); its results (each
        turned into several by ``finish``) go into ``outputs`` when the Work is waited for."""
        import jax

        arrays = [storage.read(t.detach()) for t in tensors]

        def compute() -> list[Any]:
            results = [collectives.run(kind, self._mesh, prepare(a) if prepare else a, static) for a in arrays]
            if finish is not None:
                results = [piece for result in results for piece in finish(result)]
            return jax.block_until_ready(results)

        return TpuWork(_in_order().submit(compute), outputs, self._timeout, what, self._ranks)

    def _per_rank(self, result: Any) -> list[Any]:
        return [result[k] for k in range(self.size())]

    def _on_cpu(self, what: str, tensors: Sequence[torch.Tensor]) -> bool:
        return _device_type(tensors, what) == "cpu"

    # The ProcessGroup API, as torch.distributed's functions call it.

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllreduceOptions()
        if self._on_cpu("all_reduce", tensors):
            return self._gloo.allreduce(tensors, opts)
        op, prepare = _reduction(opts.reduceOp)
        if op == "avg" and not tensors[0].is_floating_point():
            raise ValueError("tpu_dist: all_reduce with ReduceOp.AVG needs a floating-point tensor; use SUM and "
                             "divide, or convert the tensor with .float() first.")
        if op in ("band", "bor", "bxor") and (tensors[0].is_floating_point() or tensors[0].is_complex()):
            raise ValueError(f"tpu_dist: all_reduce with ReduceOp.{op.upper()} needs an integer or bool tensor.")
        return self._issue("all_reduce", "all_reduce", tensors, tensors, op, prepare)

    def allgather(self, output_lists: list[list[torch.Tensor]], tensors: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        opts = opts or AllgatherOptions()
        (outputs,), (tensor,) = output_lists, tensors
        if self._on_cpu("all_gather", [tensor, *outputs]):
            return self._gloo.allgather(output_lists, tensors, opts)
        self._check_count("all_gather", len(outputs))
        return self._issue("all_gather", "all_gather", tensors, outputs, finish=self._per_rank)

    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts or AllgatherOptions()
        if self._on_cpu("all_gather_into_tensor", [output, tensor]):
            return self._gloo._allgather_base(output, tensor, opts)
        self._check_numel("all_gather_into_tensor", output, tensor.numel() * self.size())
        return self._issue("all_gather_into_tensor", "all_gather", [tensor], [output])

    def gather(self, output_lists: list[list[torch.Tensor]], tensors: list[torch.Tensor],
               opts: Any = None) -> dist.Work:
        opts = opts or dist.GatherOptions()
        outputs = output_lists[0] if output_lists else []
        if self._on_cpu("gather", [*tensors, *outputs]):
            return self._gloo.gather(output_lists, tensors, opts)
        if self.rank() == opts.rootRank:
            self._check_count("gather", len(outputs))
        return self._issue("gather", "all_gather", tensors, outputs, finish=self._per_rank)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        (output,), (inputs,) = outputs, input_lists
        if self._on_cpu("reduce_scatter", [output, *inputs]):
            return self._gloo.reduce_scatter(outputs, input_lists, opts)
        self._check_count("reduce_scatter", len(inputs))
        return self.reduce_scatter_single(output, torch.stack(list(inputs)), opts)

    def reduce_scatter_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        if self._on_cpu("reduce_scatter_tensor", [output, tensor]):
            return self._gloo._reduce_scatter_base(output, tensor, opts)
        self._check_numel("reduce_scatter_tensor", tensor, output.numel() * self.size())
        rows = tensor.reshape(self.size(), output.numel())
        op, prepare = _reduction(opts.reduceOp)
        return self._issue("reduce_scatter_tensor", "reduce_scatter", [rows], [output], op, prepare)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceOptions()
        if self._on_cpu("reduce", tensors):
            return self._gloo.reduce(tensors, opts)
        outputs = tensors if self.rank() == opts.rootRank else []
        op, prepare = _reduction(opts.reduceOp)
        return self._issue("reduce", "all_reduce", tensors, outputs, op, prepare)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.BroadcastOptions()
        if self._on_cpu("broadcast", tensors):
            return self._gloo.broadcast(tensors, opts)
        return self._issue("broadcast", "broadcast", tensors, tensors, opts.rootRank)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        opts = opts or dist.ScatterOptions()
        (output,) = outputs
        inputs = input_lists[0] if input_lists else []
        if self._on_cpu("scatter", [output, *inputs]):
            return self._gloo.scatter(outputs, input_lists, opts)
        if self.rank() == opts.rootRank:
            self._check_count("scatter", len(inputs))
            stacked = torch.stack(list(inputs))
        else:  # only the root's values count; the others pass zeros of the same shape
            stacked = torch.zeros((self.size(), *output.shape), dtype=output.dtype, device=output.device)
        return self._issue("scatter", "scatter", [stacked], [output], opts.rootRank)

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllToAllOptions()
        if self._on_cpu("all_to_all_single", [output, tensor]):
            return self._gloo.alltoall_base(output, tensor, output_splits, input_splits, opts)
        sends = self._splits("input", list(input_splits), len(tensor))
        receives = self._splits("output", list(output_splits), len(output))
        if not input_splits and not output_splits:  # even blocks, of one size on every rank
            return self._issue("all_to_all_single", "all_to_all", [tensor], [output])
        width = self._agreed_max(max(sends + receives))  # every rank's blocks padded to the widest
        return self._issue("all_to_all_single", "all_to_all", [tensor], [output],
                           prepare=functools.partial(collectives.pad_blocks, sizes=sends, width=width),
                           finish=lambda result: [collectives.unpad_blocks(result, receives, width)])

    def _splits(self, which: str, splits: list[int], rows: int) -> list[int]:
        """The split sizes of dim 0 (even ones when none are given)."""
        if not splits:
            if rows % self.size():
                raise ValueError(f"tpu_dist: all_to_all_single without {which} split sizes needs dim 0 ({rows}) "
                                 f"divisible by the group size ({self.size()}); pass {which}_split_sizes.")
            return [rows // self.size()] * self.size()
        if len(splits) != self.size() or sum(splits) != rows or min(splits) < 0:
            raise ValueError(f"tpu_dist: all_to_all_single {which}_split_sizes {splits} must be {self.size()} "
                             f"non-negative sizes summing to the {which}'s dim 0 ({rows}).")
        return splits

    def _agreed_max(self, value: int) -> int:
        """The largest ``value`` over the group's ranks (a tiny Gloo all-reduce of the host's numbers)."""
        largest, opts = torch.tensor([value]), dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._gloo.allreduce([largest], opts).wait()
        return int(largest)

    def barrier(self, opts: Any = None) -> dist.Work:
        token = torch.zeros(1, dtype=torch.int32, device="tpu")
        work = self._issue("barrier", "all_reduce", [token], [], "sum")
        work.wait()
        return work

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._point_to_point("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._point_to_point("recv", tensors, src, tag)

    def _point_to_point(self, what: str, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        if self._on_cpu(what, tensors):
            return getattr(self._gloo, what)(tensors, peer, tag)
        raise NotImplementedError(f"tpu_dist: {what} of tpu tensors is not supported yet; use a collective "
                                  "(broadcast, all_gather, all_to_all_single), or move the tensor to cpu for it.")

    def _check_count(self, what: str, count: int) -> None:
        if count != self.size():
            raise ValueError(f"tpu_dist: {what} needs one tensor per rank ({self.size()}), got {count}.")

    def _check_numel(self, what: str, tensor: torch.Tensor, numel: int) -> None:
        if tensor.numel() != numel:
            raise ValueError(f"tpu_dist: {what} needs a tensor of {numel} elements (group size x the other "
                             f"tensor's), got {tensor.numel()} ({tuple(tensor.shape)}).")
