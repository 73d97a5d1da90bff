"""JAX's multi-process runtime under torchrun: one process per chip, started by the first ``tpu_dist`` group.

``jax.distributed.initialize`` must run before JAX creates a backend, i.e. before the first tpu tensor
(:func:`hf_tpu.backend.runtime.devices` creates them lazily). Rank 0 serves JAX's coordinator on a free port
of ``MASTER_ADDR`` and publishes the address in torch's store, so it never clashes with the store's own port.
After it, JAX sees every process's devices (``jax.devices()``) and each process drives its local ones. On a TPU
host running several processes, each first tells libtpu which chip is its own (:func:`tpu_chip_split`).
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..backend import runtime

_COORDINATOR_KEY = "hf_tpu_jax_coordinator"
_TPU_ADDRESS_KEY = "hf_tpu_libtpu_address"
_PROCESS_BOUNDS = {1: "1,1,1", 4: "2,2,1", 8: "4,2,1"}
"""libtpu's grid of the processes of one host, one chip each, by the host's chip count: what JAX's own
multi-process test launcher passes (jax/_src/test_multiprocess.py; its 8-chip grid is v6e's 2x4)."""
_LAUNCH_HINT = (
    "launch the script with torchrun (`torchrun --nproc-per-node N script.py`, or `python -m torch.distributed.run "
    "--nproc-per-node N script.py`), which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; "
    "or set those variables yourself in each process"
)
_started: tuple[int, int] | None = None  # (rank, world size) of the JAX runtime started here


def _environment(rank: int, world_size: int) -> tuple[str, int]:
    """MASTER_ADDR and LOCAL_RANK, checked against the group's rank and size."""
    missing = [name for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE") if not os.environ.get(name)]
    if missing:
        raise RuntimeError(f"tpu_dist with {world_size} processes needs torchrun's environment, and "
                           f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: {_LAUNCH_HINT}.")
    if (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) != (rank, world_size):
        raise RuntimeError(f"tpu_dist: init_process_group got rank {rank} of {world_size} but the environment says "
                           f"RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']}: pass the same values, "
                           "or leave rank and world_size out.")
    return os.environ["MASTER_ADDR"], int(os.environ.get("LOCAL_RANK", "0"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _coordinator(store: dist.Store, rank: int, host: str) -> str:
    if rank == 0:
        store.set(_COORDINATOR_KEY, f"{host}:{_free_port()}")
    return store.get(_COORDINATOR_KEY).decode()


def _local_device_ids(local_rank: int) -> list[int] | None:
    """One chip per process on TPU and GPU hosts; on a CPU host each process has its own CPU devices."""
    return None if runtime.requested_platform() == "cpu" else [local_rank]


def tpu_chip_split(rank: int, local_rank: int, addresses: list[str], chips: int,
                   bounds: str | None = None) -> dict[str, str]:
    """libtpu's variables giving process ``rank`` (``local_rank`` on its host) of ``len(addresses)`` processes
    (each one's ``host:port``, by rank), one per chip of hosts with ``chips`` chips, its own chip, as JAX's
    multi-process launcher sets them. ``bounds``: libtpu's process grid (``TPU_PROCESS_BOUNDS``, ``x,y,z``), which
    the launcher gives for several hosts; one host's is known."""
    if bounds is None:
        bounds = _PROCESS_BOUNDS.get(len(addresses))
        if len(addresses) != chips or bounds is None:
            raise RuntimeError(f"tpu_dist: {len(addresses)} processes on a TPU host with {chips} chips; hf_tpu gives "
                               f"each process one chip of a host with {', '.join(map(str, _PROCESS_BOUNDS))} chips: "
                               "run one process per chip (`hf-tpu launch script.py`), or one process driving all of "
                               "them (`hf-tpu launch --nproc-per-node 1 script.py`), or set libtpu's "
                               "TPU_VISIBLE_CHIPS, TPU_CHIPS_PER_PROCESS_BOUNDS, TPU_PROCESS_BOUNDS, "
                               "TPU_PROCESS_ADDRESSES and TPU_PROCESS_PORT in each process yourself.")
    grid = bounds.split(",")
    if len(grid) != 3 or not all(n.isdigit() for n in grid) or math.prod(map(int, grid)) != len(addresses):
        raise RuntimeError(f"tpu_dist: TPU_PROCESS_BOUNDS={bounds!r} must be libtpu's grid of the {len(addresses)} "
                           "processes, one per chip: three counts x,y,z whose product is the number of processes "
                           "(e.g. 2,2,2 for 8 processes on two hosts of 4 chips of a 2x2x2 slice).")
    return {"TPU_VISIBLE_CHIPS": str(local_rank), "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": bounds, "TPU_PROCESS_ADDRESSES": ",".join(addresses),
            "TPU_PROCESS_PORT": addresses[rank].rpartition(":")[2], "CLOUD_TPU_TASK_ID": str(rank),
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def _address_towards(host: str) -> str:
    """This host's address on the network that reaches ``host`` (the rendezvous host; no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.getfqdn()


def _split_tpu_chips(store: dist.Store, rank: int, world_size: int, local_rank: int) -> None:
    """On a TPU host running several processes, tells libtpu which chip is each one's (before JAX starts; every
    torchrun worker has the same environment, and libtpu would open every chip in each). A split set by the user
    (``TPU_VISIBLE_CHIPS``) is kept. Across several hosts, each process's address is the one that reaches the
    rendezvous host, and the process grid is the launcher's ``TPU_PROCESS_BOUNDS``."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world == 1 or "TPU_VISIBLE_CHIPS" in os.environ:
        return
    chips = runtime.tpu_chips()
    if not chips:
        return
    bounds = os.environ.get("TPU_PROCESS_BOUNDS")
    one_host = local_world == world_size
    if not one_host and (bounds is None or local_world != chips):
        raise RuntimeError(f"tpu_dist: {local_world} processes on each of several TPU hosts of {chips} chips; one "
                           "process per chip across hosts needs libtpu's process grid: set TPU_PROCESS_BOUNDS=x,y,z "
                           "(processes along each axis of the slice) in every process and hf_tpu sets the rest, with "
                           "--nproc-per-node the hosts' chip count; or run one process per host "
                           "(`hf-tpu launch --nproc-per-node 1 ...`), which drives all of its chips.")
    host = "localhost" if one_host else _address_towards(os.environ["MASTER_ADDR"])
    store.set(f"{_TPU_ADDRESS_KEY}/{rank}", f"{host}:{_free_port()}")
    addresses = [store.get(f"{_TPU_ADDRESS_KEY}/{peer}").decode() for peer in range(world_size)]
    os.environ.update(tpu_chip_split(rank, local_rank, addresses, chips, bounds))


def start(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Starts JAX's multi-process runtime for ``world_size`` processes (this one is ``rank``), once per process;
    a single process needs none. Raises if JAX already created its backends (a tpu tensor came first)."""
    global _started
    if world_size == 1 or _started == (rank, world_size):
        return
    if _started is not None:
        raise RuntimeError(f"tpu_dist: JAX's runtime already runs as rank {_started[0]} of {_started[1]}; one "
                           f"process joins one world: rank {rank} of {world_size} needs a new process.")
    host, local_rank = _environment(rank, world_size)
    _split_tpu_chips(store, rank, world_size, local_rank)
    jax = runtime.jax_module()
    if runtime.backends_started():
        raise RuntimeError("tpu_dist: the tpu device (JAX) was used before init_process_group; call "
                           "torch.distributed.init_process_group() before creating the first tpu tensor.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=_coordinator(store, rank, host), num_processes=world_size,
                               process_id=rank, local_device_ids=_local_device_ids(local_rank),
                               initialization_timeout=max(1, int(timeout.total_seconds())))
    _started = (rank, world_size)


def chips_of_processes(ranks: Sequence[int], chips: Sequence[int]) -> Any:
    """The JAX devices of local chips ``chips`` (``tpu:k`` indices) of each process of ``ranks`` (global ranks): an
    array of ``(len(ranks), len(chips))``, for a mesh over them."""
    import numpy as np

    return np.array([[process_devices(rank)[chip] for chip in chips] for rank in ranks], dtype=object)


def process_devices(process: int) -> list[Any]:
    """The JAX devices of process ``process`` (a global rank), in local index order (``tpu:0`` first)."""
    jax = runtime.jax_module()
    platform = runtime.backing_platform()
    return sorted((d for d in jax.devices(platform) if d.process_index == process), key=lambda d: d.id)
