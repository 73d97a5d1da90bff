"""JAX's multi-process runtime under torchrun: one process per chip, started by the first ``tpu_dist`` group.

``jax.distributed.initialize`` must run before JAX creates a backend, i.e. before the first tpu tensor
(:func:`hf_tpu.backend.runtime.devices` creates them lazily). Rank 0 serves JAX's coordinator on a free port
of ``MASTER_ADDR`` and publishes the address in torch's store, so it never clashes with the store's own port.
After it, JAX sees every process's devices (``jax.devices()``) and each process drives its local ones.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch.distributed as dist

from ..backend import runtime

_COORDINATOR_KEY = "hf_tpu_jax_coordinator"
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
    jax = runtime.jax_module()
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("tpu_dist: the tpu device (JAX) was used before init_process_group; call "
                           "torch.distributed.init_process_group() before creating the first tpu tensor.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=_coordinator(store, rank, host), num_processes=world_size,
                               process_id=rank, local_device_ids=_local_device_ids(local_rank),
                               initialization_timeout=max(1, int(timeout.total_seconds())))
    _started = (rank, world_size)


def process_devices(process: int) -> list[Any]:
    """The JAX devices of process ``process`` (a global rank), in local index order (``tpu:0`` first)."""
    jax = runtime.jax_module()
    platform = runtime.backing_platform()
    return sorted((d for d in jax.devices(platform) if d.process_index == process), key=lambda d: d.id)
