"""``hf_tpu.shard``: a model's parameters and buffers split over several local chips by its tensor-parallel
plan (:mod:`hf_tpu.tp_plans`), in one process (see :mod:`hf_tpu.sharding`)."""

from __future__ import annotations

from typing import Sequence

import torch

from .. import sharding, tp_plans
from ..backend import device_module


def shard(model: torch.nn.Module, tp_size: int | None = None, plan: tp_plans.PlanArg = "auto",
          devices: Sequence[torch.device | str | int] | None = None) -> torch.nn.Module:
    """Splits ``model``'s parameters and buffers in place over ``tp_size`` tpu chips (``devices``, default
    the first ``tp_size``; ``tp_size`` defaults to ``len(devices)``, else every chip) as ``plan`` says
    (see :func:`hf_tpu.tp_plans.parameter_specs`), and returns ``model``.

    The model may be on the CPU or on one chip. Parameters stay the same ``Parameter`` objects (with their
    attributes and hooks), so tied weights stay tied; buffers are replaced, in every module that shares one.
    Feed inputs on the first chip (``"tpu"``); outputs are tpu tensors on it, split over the chips as XLA's
    partitioner chose (``.cpu()`` gathers them; see :func:`hf_tpu.placement`).
    """
    chips = _chips(tp_size, devices)
    grid = sharding.mesh(chips, axis_names=("tp",))
    specs = tp_plans.parameter_specs(model, len(chips), plan, axis="tp")
    for name, parameter in model.named_parameters():  # a tied parameter once
        parameter.data = sharding.distribute(parameter.detach(), grid, specs[name])  # hf_tpu allows any device
    split = {id(buffer): (buffer, sharding.distribute(buffer, grid, specs[name]))  # the old kept alive for the ids
             for name, buffer in model.named_buffers()}
    for module in model.modules():
        for leaf, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[leaf] = split[id(buffer)][1]
    return model


def _chips(tp_size: int | None, devices: Sequence[torch.device | str | int] | None) -> list[torch.device]:
    if tp_size is not None and (not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1):
        raise ValueError(f"tp_size must be a positive int (the number of chips to split over), got {tp_size!r}")
    available = device_module.device_count()
    if devices is None:
        wanted = available if tp_size is None else tp_size
        if wanted > available:
            raise ValueError(f"tp_size={wanted} asks for more chips than exist: there are {available} tpu chips "
                             f"(torch.tpu.device_count()); use tp_size <= {available} (without TPU chips, "
                             "HF_TPU_NUM_DEVICES=N before importing torch gives N virtual chips)")
        return [torch.device("tpu", index) for index in range(wanted)]
    chips = [torch.device("tpu", device_module._index(device)) for device in devices]
    if tp_size is not None and tp_size != len(chips):
        raise ValueError(f"tp_size={tp_size} but {len(chips)} devices were given: pass as many devices as tp_size, "
                         "or only one of the two")
    return chips
