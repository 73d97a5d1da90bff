"""Loading straight into shards, one process: what transformers' and diffusers' tensor-parallel ``from_pretrained``
hooks share (``integrations/transformers.py``, ``integrations/diffusers.py``).

Outside torchrun, a tensor-parallel ``from_pretrained`` onto tpu runs as an ordinary ``device_map="tpu"`` load
inside :func:`loading`, whose :class:`ShardedLoad` the library's weight-setting step asks to :meth:`place` each
weight read on the host: it goes from the host straight onto its shards (``hf_tpu.distribute`` of a CPU tensor),
with the ``PartitionSpec`` the model's plan gives it (:func:`hf_tpu.tp_plans.parameter_specs`). :meth:`finish`
then ``hf_tpu.shard``\\ s the model, which splits what no checkpoint tensor filled (buffers, missing weights) and
leaves the placed weights where they are.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Callable, Iterator

import torch

_state = threading.local()


class ShardedLoad:
    """Where one single-process tensor-parallel load puts each weight: the mesh ``tp`` of its first ``tp_size``
    chips and, once the model exists, the spec of each of its tensors. ``plan``: ``"auto"`` or ``None`` (the
    model's plan, see :func:`hf_tpu.tp_plans.plan_for`), or a dict of rules that override the model's
    (transformers' ``DistributedConfig.tp_plan``: an empty dict applies none)."""

    def __init__(self, tp_size: int, plan: Any = "auto") -> None:
        from ..sharding import mesh
        from ..tp_plans.apply import local_chips

        self.chips = local_chips(tp_size, None, dp_size=1)  # refuses more chips than exist
        self.mesh = mesh(self.chips, axis_names=("tp",))
        self._plan = plan
        self._model: Any = None
        self._specs: dict[str, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def plan(self, model: torch.nn.Module) -> Any:
        """The plan as ``hf_tpu.shard`` takes it, for ``model``."""
        if self._plan is None or self._plan == "auto":
            return "auto"
        if isinstance(self._plan, dict) and self._plan:
            from ..tp_plans import plan_for

            return {**plan_for(model), **self._plan}
        return self._plan

    def place(self, model: torch.nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` for ``model``'s tensor ``name``: a host tensor goes onto its shards; anything else, and a
        name or shape the model does not have (the library reports those), is returned as it is."""
        if value.device.type != "cpu":
            return value
        if model is not self._model:
            from ..tp_plans import parameter_specs

            self._specs = parameter_specs(model, len(self.chips), self.plan(model), axis="tp")
            tensors = {**dict(model.named_parameters(remove_duplicate=False)),
                       **dict(model.named_buffers(remove_duplicate=False))}
            self._shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
            self._model = model
        if name not in self._specs or self._shapes[name] != tuple(value.shape):
            return value
        from ..sharding import distribute

        return distribute(value, self.mesh, self._specs[name])

    def finish(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (loaded) as ``hf_tpu.shard`` makes it: every tensor on the mesh, as the plan says."""
        from ..tp_plans.apply import shard

        return shard(model, plan=self.plan(model), devices=self.chips)


def active() -> ShardedLoad | None:
    """The load into shards this thread is in, if any."""
    return getattr(_state, "load", None)


@contextlib.contextmanager
def loading(load: ShardedLoad) -> Iterator[ShardedLoad]:
    """Makes ``load`` :func:`active` in this thread for the ``with`` block."""
    outer = active()
    _state.load = load
    try:
        yield load
    finally:
        _state.load = outer


def under_torchrun() -> bool:
    """Whether this process is one of several (torchrun's environment, or an initialized process group): then the
    libraries' own multi-process tensor parallelism applies, not this."""
    return "WORLD_SIZE" in os.environ or (torch.distributed.is_available() and torch.distributed.is_initialized())


def is_first_tpu(device_map: Any) -> bool:
    """Whether a ``device_map`` names the first tpu chip ("tpu", "tpu:0", or that ``torch.device``)."""
    try:
        device = torch.device(device_map) if isinstance(device_map, (str, torch.device)) else None
    except RuntimeError:  # "auto", "balanced", ...
        return False
    return device is not None and device.type == "tpu" and device.index in (None, 0)


def needs_tpu_device_map(what: str, device_map: Any) -> ValueError:
    """The error for a single-process tensor-parallel load whose ``device_map`` is not the tpu chips."""
    return ValueError(f"{what} without torchrun shards the model over this host's tpu chips in one process, which "
                      f"needs device_map='tpu' (got device_map={device_map!r}); for another device, or one process "
                      "per chip, launch with torchrun and pass no device_map")


def into_shards(original: Callable[..., Any], single_process_tp: Callable[[dict], ShardedLoad | None]) -> classmethod:
    """A library's ``from_pretrained`` (the function under the classmethod) that, where ``single_process_tp``
    finds a single-process tensor-parallel load in its keyword arguments (and takes them out), runs the load
    :func:`loading` it and finishes the model (the result, or its first item: diffusers can return a tuple)."""

    @functools.wraps(original)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        load = single_process_tp(kwargs)
        if load is None:
            return original(cls, *args, **kwargs)
        with loading(load):
            result = original(cls, *args, **kwargs)
        load.finish(result[0] if isinstance(result, tuple) else result)
        return result

    from_pretrained._hf_tpu = True
    return classmethod(from_pretrained)
