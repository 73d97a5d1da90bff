"""``tpu_dist``: torch.distributed on tpu tensors, one process per chip, on JAX's multi-process runtime.

Launch with ``torchrun --nproc-per-node N script.py``; ``torch.distributed.init_process_group()`` (no backend
argument: ``tpu_dist`` is tpu's default), ``init_process_group("tpu_dist")`` or
``init_process_group("cpu:gloo,tpu:tpu_dist")`` then starts JAX's runtime (:mod:`.runtime`) and returns a
:class:`~.process_group.TpuProcessGroup`: collectives on tpu tensors run as JAX programs, on CPU tensors on Gloo.
Call it before the first tpu tensor is made.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from . import dispatcher_ops

BACKEND = "tpu_dist"


def _create(options: Any, backend_options: Any) -> Any:
    """c10d's creator for ``tpu_dist`` (extended API: ``options`` is a ``_DistributedBackendOptions``)."""
    from ..backend import devices
    from . import data_parallel, runtime
    from .process_group import TpuProcessGroup

    if not dist.is_initialized():  # the default group: this process joins the world
        runtime.start(options.store, options.group_rank, options.group_size, options.timeout)
        data_parallel.install()
        # The process's chips are known now. DeviceMesh would otherwise pick chip LOCAL_RANK of an uninitialized
        # device, while each process drives its own chip as tpu:0.
        devices.device_count()
    return TpuProcessGroup(options.store, options.group_rank, options.group_size, options.timeout,
                           options.global_ranks_in_group)


def register() -> None:
    """Registers the ``tpu_dist`` c10d backend for device ``tpu``, as its default, and the tpu kernels of the
    dispatcher's collective ops (:mod:`.dispatcher_ops`); JAX-free, idempotent."""
    if dist.is_available() and BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["tpu"])
        dispatcher_ops.register()


__all__ = ["BACKEND", "register"]
