"""``hf_tpu.shard``: a model's parameters and buffers split over several local chips by its tensor-parallel
plan (:mod:`hf_tpu.tp_plans`), in one process (see :mod:`hf_tpu.sharding`)."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from .. import sharding, tp_plans
from ..backend.devices import device_count, index_of


def shard(model: torch.nn.Module, tp_size: int | None = None, plan: tp_plans.PlanArg = "auto",
          devices: Sequence[torch.device | str | int] | None = None, dp_size: int = 1) -> torch.nn.Module:
    """Splits ``model``'s parameters and buffers in place over ``tp_size`` tpu chips (``devices``, default
    the first ``tp_size``; ``tp_size`` defaults to ``len(devices)``, else every chip) as ``plan`` says
    (see :func:`hf_tpu.tp_plans.parameter_specs`), and returns ``model``.

    The model may be on the CPU or on one chip. Parameters stay the same ``Parameter`` objects (with their
    attributes and hooks), so tied weights stay tied; buffers are replaced, in every module that shares one.
    Feed inputs on the first chip (``"tpu"``); outputs are tpu tensors on it, split over the chips as XLA's
    partitioner chose (``.cpu()`` gathers them; see :func:`hf_tpu.placement`).

    ``dp_size > 1`` adds data parallelism on the same mesh: ``dp_size x tp_size`` chips in a ``("dp", "tp")``
    mesh, the weights split over "tp" (whole over "dp"), and each tensor argument of the model's forward
    whose first dim ``dp_size`` divides split over "dp" (:func:`hf_tpu.sharding.split_batch`); XLA's
    partitioner sums the gradients over "dp".
    """
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int (data-parallel replicas of the model), got {dp_size!r}")
    chips = local_chips(None if tp_size is None else tp_size * dp_size, devices, dp_size)
    tp = len(chips) // dp_size
    grid = (sharding.mesh(chips, shape=(dp_size, tp), axis_names=("dp", "tp")) if dp_size > 1
            else sharding.mesh(chips, axis_names=("tp",)))
    specs = tp_plans.parameter_specs(model, tp, plan, axis="tp")
    for name, parameter in model.named_parameters():  # a tied parameter once
        parameter.data = sharding.distribute(parameter.detach(), grid, specs[name])  # hf_tpu allows any device
    split = {id(buffer): (buffer, sharding.distribute(buffer, grid, specs[name]))  # the old kept alive for the ids
             for name, buffer in model.named_buffers()}
    for module in model.modules():
        for leaf, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[leaf] = split[id(buffer)][1]
    if dp_size > 1:
        model.register_forward_pre_hook(functools.partial(_split_batch, grid, dp_size), with_kwargs=True)
    return model


def _split_batch(grid: Any, dp_size: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The forward's tensor arguments whose first dim ``dp_size`` divides, split over "dp"."""
    def split(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.size(0) % dp_size == 0:
            return sharding.split_batch(value, grid)
        return value

    return tuple(split(value) for value in args), {key: split(value) for key, value in kwargs.items()}


def local_chips(count: int | None, devices: Sequence[torch.device | str | int] | None,
                dp_size: int = 1) -> list[torch.device]:
    """``count`` tpu chips of this process (tp_size x dp_size; None: all of them, or ``devices``), in ``dp_size``
    equal groups; an error saying what to change if there are not that many."""
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ValueError(f"tp_size must be a positive int (the number of chips to split over), got {count!r}")
    available = device_count()
    asked = "tp_size" if dp_size == 1 else "tp_size x dp_size"
    if devices is None:
        wanted = available if count is None else count
        if wanted > available:
            raise ValueError(f"{asked}={wanted} asks for more chips than exist: there are {available} tpu chips "
                             f"(torch.tpu.device_count()); use {asked} <= {available} (without TPU chips, "
                             "HF_TPU_NUM_DEVICES=N before importing torch gives N virtual chips)")
        chips = [torch.device("tpu", index) for index in range(wanted)]
    else:
        chips = [torch.device("tpu", index_of(device)) for device in devices]
        if count is not None and count != len(chips):
            raise ValueError(f"{asked}={count} but {len(chips)} devices were given: pass as many devices, or "
                             "only one of the two")
    if len(chips) % dp_size:
        raise ValueError(f"dp_size={dp_size} does not divide the {len(chips)} chips: use a dp_size dividing "
                         f"{len(chips)}, or give tp_size")
    return chips
