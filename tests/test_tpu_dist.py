"""The ``tpu_dist`` c10d backend (hf_tpu.distributed): collectives on tpu tensors across real processes.

One torchrun launch of 2 processes (tests/torchrun_cases.py) runs every ``case_*`` function of this file (the workers'
script); each case compares the collective on tpu tensors (run by JAX) with the same collective on CPU tensors
(run by Gloo, in the same group) or with the expected values, and each rank reports each case by name.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import hf_tpu  # noqa: F401  (registers the device even where autoload is off)
import torchrun_cases
from hf_tpu.backend import runtime
from hf_tpu.distributed import runtime as distributed_runtime

WORLD = 2
LAUNCH_TIMEOUT_S, WORKER_TIMEOUT_S = 120, 100
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT}


def _values(rank: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Different values on each rank (exact in every dtype used here)."""
    numel = torch.Size(shape).numel()
    return (torch.arange(numel, dtype=torch.float32).reshape(shape) * (rank + 2) - 3 * rank).to(dtype)


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device.type == "tpu", actual.device
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.cpu(), expected)


def _both(rank: int, *shape: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    host = _values(rank, *shape, dtype=dtype)
    return host.to("tpu"), host.clone()


def case_default_backend_is_tpu_dist():
    assert dist.get_world_size() == WORLD
    assert type(dist.group.WORLD).__name__ == "TpuProcessGroup"
    assert dist.Backend.default_device_backend_map["tpu"] == "tpu_dist"
    assert dist.group.WORLD.name() == "tpu_dist"


def case_a_device_counted_and_set_before_init_process_group_is_the_processs_own_chip():
    """As CUDA scripts do (TorchTitan's), the worker counted the devices and set ``tpu:LOCAL_RANK`` before
    ``init_process_group`` (see the end of this file): that name is this process's chip, ``tpu:0``."""
    assert COUNTED_BEFORE_INIT == torch.tpu.device_count() == 1
    assert torch.tpu.current_device() == 0
    local = torch.device("tpu", int(os.environ["LOCAL_RANK"]))
    values = torch.full((3,), dist.get_rank() + 1.0, device=local)
    dist.all_reduce(values)
    assert values.device == torch.device("tpu", 0)
    _same(values, torch.full((3,), 3.0))
    _same(torch.ones(2).to(local) + torch.ones(2, device="tpu"), torch.full((2,), 2.0))


def case_all_reduce_matches_gloo():
    rank = dist.get_rank()
    for dtype in (torch.float32, torch.int64):
        for name, op in OPS.items():
            device, host = _both(rank, 2, 3, dtype=dtype)
            dist.all_reduce(device, op=op)
            dist.all_reduce(host, op=op)
            _same(device, host)


def case_all_reduce_avg():
    rank = dist.get_rank()
    device, _ = _both(rank, 5)
    dist.all_reduce(device, op=dist.ReduceOp.AVG)
    _same(device, (_values(0, 5) + _values(1, 5)) / 2)


def case_async_all_reduce_returns_a_work():
    rank = dist.get_rank()
    device, host = _both(rank, 4, 2)
    work = dist.all_reduce(device, async_op=True)
    assert work.wait() is True and work.is_completed()
    dist.all_reduce(host)
    _same(device, host)


def case_set_timeout_sets_the_groups_timeout():
    """``torch.distributed.set_timeout`` (which TorchTitan calls; torch 2.13 lacks it, hf_tpu adds it)."""
    import datetime

    group = dist.distributed_c10d._get_default_group()
    before = group._timeout
    dist.set_timeout(datetime.timedelta(seconds=77))
    try:
        assert group._timeout == datetime.timedelta(seconds=77)
        device, host = _both(dist.get_rank(), 3)
        dist.all_reduce(device)
        dist.all_reduce(host)
        _same(device, host)
    finally:
        dist.set_timeout(before)


def case_all_gather_matches_gloo():
    rank = dist.get_rank()
    device, host = _both(rank, 3, 2)
    gathered = [torch.empty(3, 2, device="tpu") for _ in range(WORLD)]
    expected = [torch.empty(3, 2) for _ in range(WORLD)]
    dist.all_gather(gathered, device)
    dist.all_gather(expected, host)
    for actual, wanted in zip(gathered, expected):
        _same(actual, wanted)
    into, into_expected = torch.empty(WORLD * 3, 2, device="tpu"), torch.empty(WORLD * 3, 2)
    work = dist.all_gather_into_tensor(into, device, async_op=True)
    work.wait()
    dist.all_gather_into_tensor(into_expected, host)
    _same(into, into_expected)


def case_reduce_scatter_matches_gloo():
    rank = dist.get_rank()
    for name in ("sum", "max"):
        device, host = _both(rank, WORLD * 2, 3)
        out, expected = torch.empty(2, 3, device="tpu"), torch.empty(2, 3)
        dist.reduce_scatter_tensor(out, device, op=OPS[name])
        dist.reduce_scatter_tensor(expected, host, op=OPS[name])
        _same(out, expected)
        listed = list(device.chunk(WORLD))
        out_list = torch.empty(2, 3, device="tpu")
        dist.reduce_scatter(out_list, listed, op=OPS[name])
        _same(out_list, expected)


def case_broadcast_from_each_root():
    rank = dist.get_rank()
    for root in range(WORLD):
        for dtype in (torch.float32, torch.int64, torch.bool):
            device, host = _both(rank, 3, dtype=dtype)
            dist.broadcast(device, src=root)
            dist.broadcast(host, src=root)
            _same(device, host)


def case_all_reduce_bitwise_matches_gloo():
    rank = dist.get_rank()
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        device, host = _both(rank, 2, 3, dtype=torch.int64)
        dist.all_reduce(device, op=op)
        dist.all_reduce(host, op=op)
        _same(device, host)
    with pytest.raises(ValueError, match="BAND needs an integer or bool tensor"):
        dist.all_reduce(torch.ones(2, device="tpu"), op=dist.ReduceOp.BAND)


def case_premul_sum_and_avg_in_every_reduction():
    """FSDP's gradient divide factor: each rank's values times the factor (a number or a tensor), then summed."""
    rank = dist.get_rank()
    expected = (_values(0, 4, 2) + _values(1, 4, 2)) * 0.25
    for factor in (0.25, torch.tensor([0.25])):
        device, _ = _both(rank, 4, 2)
        dist.all_reduce(device, op=dist._make_nccl_premul_sum(factor))
        _same(device, expected)
        out = torch.empty(2, 2, device="tpu")
        dist.reduce_scatter_tensor(out, _values(rank, 4, 2).to("tpu"), op=dist._make_nccl_premul_sum(factor))
        _same(out, expected.chunk(WORLD)[rank])
        device, _ = _both(rank, 4, 2)
        dist.reduce(device, dst=0, op=dist._make_nccl_premul_sum(factor))
        if rank == 0:
            _same(device, expected)
    out = torch.empty(2, 2, device="tpu")
    dist.reduce_scatter_tensor(out, _values(rank, 4, 2).to("tpu"), op=dist.ReduceOp.AVG)
    _same(out, (expected * 2).chunk(WORLD)[rank])


def case_barrier_and_reduce():
    dist.barrier()
    rank = dist.get_rank()
    device, host = _both(rank, 4)
    before = device.cpu()
    dist.reduce(device, dst=1)
    dist.reduce(host, dst=1)
    _same(device, host if rank == 1 else before)


def case_scatter_and_gather():
    rank = dist.get_rank()
    chunks = [_values(k, 2, 2) for k in range(WORLD)]
    out = torch.empty(2, 2, device="tpu")
    dist.scatter(out, [c.to("tpu") for c in chunks] if rank == 0 else None, src=0)
    _same(out, chunks[rank])
    device, _ = _both(rank, 3)
    gathered = [torch.empty(3, device="tpu") for _ in range(WORLD)] if rank == 1 else None
    dist.gather(device, gathered, dst=1)
    if rank == 1:
        for k in range(WORLD):
            _same(gathered[k], _values(k, 3))


def case_all_to_all_single_matches_gloo():
    rank = dist.get_rank()
    device, host = _both(rank, WORLD * 2, 3)
    out, expected = torch.empty_like(device), torch.empty_like(host)
    dist.all_to_all_single(out, device)
    dist.all_to_all_single(expected, host)
    _same(out, expected)
    sends, receives = ([1, 2], [1, 3]) if rank == 0 else ([3, 1], [2, 1])  # uneven, as MoE token routing is
    device, host = _both(rank, sum(sends), 2)
    out, expected = torch.empty(sum(receives), 2, device="tpu"), torch.empty(sum(receives), 2)
    dist.all_to_all_single(out, device, receives, sends)
    dist.all_to_all_single(expected, host, receives, sends)
    _same(out, expected)


def case_object_collectives():
    rank = dist.get_rank()
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, {"rank": rank, "name": f"r{rank}"})
    assert everyone == [{"rank": k, "name": f"r{k}"} for k in range(WORLD)]
    objects = [("from", rank), 7] if rank == 1 else [None, None]
    dist.broadcast_object_list(objects, src=1)
    assert objects == [("from", 1), 7]


def case_subgroups():
    rank = dist.get_rank()
    pair = dist.new_group([0, 1], backend="cpu:gloo,tpu:tpu_dist")
    device, host = _both(rank, 3)
    dist.all_reduce(device, group=pair)
    dist.all_reduce(host, group=pair)
    _same(device, host)
    alone = dist.new_group([1])
    if rank == 1:
        device, _ = _both(rank, 3)
        dist.all_reduce(device, group=alone)
        _same(device, _values(1, 3))


def _raises(error: type, message: str, action) -> None:
    with pytest.raises(error, match=message):
        action()


def case_bad_input_says_what_to_do():
    rank = dist.get_rank()
    tpu, cpu = torch.ones(2, device="tpu"), torch.ones(2)
    _raises(ValueError, r"one device type.*\.to\('tpu'\)", lambda: dist.all_gather([cpu, cpu], tpu))
    _raises(NotImplementedError, "send of tpu tensors is not supported yet", lambda: dist.send(tpu, 1 - rank))
    _raises(NotImplementedError, "recv of tpu tensors is not supported yet", lambda: dist.recv(tpu, 1 - rank))
    _raises(ValueError, "AVG needs a floating-point tensor",
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64, device="tpu"), op=dist.ReduceOp.AVG))
    _raises(ValueError, r"input_split_sizes \[2, 2\] must be 2 non-negative sizes summing to the input's dim 0",
            lambda: dist.all_to_all_single(torch.empty(3, device="tpu"), torch.ones(3, device="tpu"), [1, 2], [2, 2]))
    _raises(ValueError, "needs dim 0 .3. divisible by the group size",
            lambda: dist.all_to_all_single(torch.empty(3, device="tpu"), torch.ones(3, device="tpu")))
    dist.barrier()  # every rank still joins the next collective


def case_zz_a_rank_that_never_joins_times_out():
    """Rank 0's wait gives up after its timeout; rank 1 then joins, the collective completes, and a second
    wait gets its result."""
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    device = torch.ones(2, device="tpu")
    if rank == 0:
        work = dist.all_reduce(device, async_op=True)
        _raises(RuntimeError, r"all_reduce over ranks \[0, 1\] did not finish within .*has not joined",
                lambda: work.wait(datetime.timedelta(seconds=1)))
        store.set("timed_out", "1")
    else:
        store.wait(["timed_out"])
        dist.all_reduce(device)
    dist.barrier()
    if rank == 0:
        work.wait()
    _same(device, torch.full((2,), 2.0))


def case_zz_a_calls_own_timeout_bounds_its_wait():
    """A c10d op's timeout (allreduce_coalesced's options, which tpu_dist runs through the dispatcher op) bounds its
    wait instead of the group's (30 minutes here); the group still works after."""
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    if rank == 0:
        options = dist.AllreduceCoalescedOptions()
        options.timeout = datetime.timedelta(seconds=1)
        start = time.monotonic()
        _raises(RuntimeError, r"all_reduce over ranks \[0, 1\] did not finish within 0:00:01.*Raise the timeout given",
                lambda: dist.group.WORLD.allreduce_coalesced([torch.ones(2, device="tpu")], options))
        assert time.monotonic() - start < 30
        store.set("coalesced_timed_out", "1")
    else:
        store.wait(["coalesced_timed_out"])
        dist.all_reduce(torch.ones(2, device="tpu"))  # joins the collective rank 0 stopped waiting for
    device = torch.full((2,), float(rank), device="tpu")
    dist.all_reduce(device)
    _same(device, torch.full((2,), 1.0))


reports = torchrun_cases.report_fixture(__file__, world=WORLD, timeout=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("case", torchrun_cases.cases(globals()))
@pytest.mark.parametrize("rank", range(WORLD))
def test_two_processes(reports, rank, case):
    assert reports[rank][case] == "ok", reports[rank][case]


def test_without_torchrun_environment_says_how_to_launch(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"needs torchrun's environment.*torchrun --nproc-per-node N"):
        dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=2)
    assert not dist.is_initialized()


def test_tpu_tensor_before_init_process_group_says_to_init_first(monkeypatch):
    torch.ones(1, device="tpu").cpu()  # JAX's backends exist now
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="before creating the first tpu tensor"):
        dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=2)


def test_counting_and_setting_the_device_under_torchrun_starts_no_jax(tmp_path):
    """Under a launcher of several processes, ``device_count()`` and ``set_device(tpu:LOCAL_RANK)`` before
    ``init_process_group`` leave JAX unstarted; ``tpu:LOCAL_RANK`` then names the process's own chip, and an index
    that is neither raises CPU-style."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import sys, torch, pytest\n"
        "from hf_tpu.backend import runtime\n"
        "assert torch.tpu.device_count() == 1 and torch.tpu.is_available()\n"
        "torch.tpu.set_device('tpu:1')\n"
        "assert not runtime.backends_started()\n"
        "assert torch.tpu.current_device() == 0\n"
        "assert torch.ones(2, device='tpu:1').device == torch.device('tpu', 0)\n"
        "assert runtime.backends_started()\n"
        "with pytest.raises(RuntimeError, match='Invalid device index tpu:2'):\n"
        "    torch.ones(2, device='tpu:2')\n"
        "print('ok')\n")
    environment = {**os.environ, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "HF_TPU_PLATFORM": "cpu"}
    environment.pop("HF_TPU_NUM_DEVICES", None)
    result = subprocess.run([sys.executable, str(script)], env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


_LIBTPU_SPLIT = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES",
                 "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID", "ALLOW_MULTIPLE_LIBTPU_LOAD")


def _split_on_a_tpu_host(monkeypatch, chips: int, local_world: int, world: int, rank: int, **environment: str):
    """What ``_split_tpu_chips`` sets for ``rank`` on a host of ``chips`` TPU chips (the other ranks' addresses in
    the store already: on one host localhost, else host<n> for the host of rank n), every libtpu variable put back
    afterwards."""
    for name in _LIBTPU_SPLIT:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": "127.0.0.1", **environment}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(runtime, "tpu_chips", lambda: chips)
    store = dist.HashStore()
    for peer in range(world):
        if peer != rank:
            host = "localhost" if local_world == world else f"host{peer // local_world}"
            store.set(f"hf_tpu_libtpu_address/{peer}", f"{host}:{9000 + peer}")
    distributed_runtime._split_tpu_chips(store, rank, world, rank % local_world)
    return {name: os.environ[name] for name in _LIBTPU_SPLIT if name in os.environ}


def test_each_process_on_a_tpu_host_is_given_its_own_chip(monkeypatch):
    split = _split_on_a_tpu_host(monkeypatch, chips=4, local_world=4, world=4, rank=2)
    port = split.pop("TPU_PROCESS_PORT")
    assert split == {"TPU_VISIBLE_CHIPS": "2", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "2,2,1",
                     "TPU_PROCESS_ADDRESSES": f"localhost:9000,localhost:9001,localhost:{port},localhost:9003",
                     "CLOUD_TPU_TASK_ID": "2", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    one_host = [f"localhost:{port}" for port in range(8)]
    assert distributed_runtime.tpu_chip_split(0, 0, one_host, 8)["TPU_PROCESS_BOUNDS"] == "4,2,1"


def test_one_process_per_chip_across_hosts_on_the_launchers_process_grid(monkeypatch):
    """Two hosts of 4 chips (a 2x2x2 slice), 8 processes: the launcher gives the grid, hf_tpu the rest."""
    split = _split_on_a_tpu_host(monkeypatch, chips=4, local_world=4, world=8, rank=6, TPU_PROCESS_BOUNDS="2,2,2")
    address = split["TPU_PROCESS_ADDRESSES"].split(",")[6]
    assert address.rpartition(":")[0] == "127.0.0.1"  # this process's address towards the rendezvous host
    assert split == {"TPU_VISIBLE_CHIPS": "2", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "2,2,2",
                     "TPU_PROCESS_ADDRESSES": ",".join([*(f"host{rank // 4}:{9000 + rank}" for rank in range(6)),
                                                        address, "host1:9007"]),
                     "TPU_PROCESS_PORT": address.rpartition(":")[2], "CLOUD_TPU_TASK_ID": "6",
                     "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def test_no_chip_split_on_cpu_hosts_one_process_per_host_or_the_users_own(monkeypatch):
    from jax._src import hardware_utils

    assert runtime.tpu_chips() == 0  # this host has no TPU chips on its PCI bus
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, None))
    assert runtime.tpu_chips() == 4  # where it had some
    monkeypatch.setenv("HF_TPU_PLATFORM", "cpu")
    assert runtime.tpu_chips() == 0  # but JAX is to run on the CPU
    assert _split_on_a_tpu_host(monkeypatch, chips=0, local_world=2, world=2, rank=1) == {}
    assert _split_on_a_tpu_host(monkeypatch, chips=4, local_world=1, world=4, rank=1) == {}  # one per host
    assert _split_on_a_tpu_host(monkeypatch, chips=4, local_world=4, world=4, rank=1,
                                TPU_VISIBLE_CHIPS="3") == {"TPU_VISIBLE_CHIPS": "3"}


@pytest.mark.parametrize("chips, local_world, world, message", [
    (4, 2, 2, r"2 processes on a TPU host with 4 chips; .*one process per chip \(`hf-tpu launch script.py`\)"),
    (2, 2, 2, r"2 processes on a TPU host with 2 chips; hf_tpu gives each process one chip of a host with 1, 4, 8"),
    (4, 4, 8, r"4 processes on each of several TPU hosts of 4 chips; .*TPU_PROCESS_BOUNDS=x,y,z.*--nproc-per-node 1"),
])
def test_a_chip_split_hf_tpu_cannot_make_says_what_to_run(monkeypatch, chips, local_world, world, message):
    with pytest.raises(RuntimeError, match=message):
        _split_on_a_tpu_host(monkeypatch, chips=chips, local_world=local_world, world=world, rank=0)


def test_a_process_grid_that_is_not_one_process_per_chip_is_refused(monkeypatch):
    with pytest.raises(RuntimeError, match=r"TPU_PROCESS_BOUNDS='2,2,1' must be libtpu's grid of the 8 processes"):
        _split_on_a_tpu_host(monkeypatch, chips=4, local_world=4, world=8, rank=0, TPU_PROCESS_BOUNDS="2,2,1")


if __name__ == "__main__":
    COUNTED_BEFORE_INIT = torch.tpu.device_count()  # before init_process_group, as CUDA scripts may
    torch.tpu.set_device(f"tpu:{os.environ['LOCAL_RANK']}")
    torchrun_cases.main(globals(), worker_timeout=WORKER_TIMEOUT_S)
