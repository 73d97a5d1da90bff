"""diffusers: tpu among the devices without float64.

diffusers computes positional embeddings (2-D sin-cos, Flux's and others' rotary frequencies) in
float64, except on devices it lists as lacking float64 (``mps``, ``npu``, ``neuron``), where
``maybe_adjust_dtype_for_device`` gives float32. TPU chips have no float64 units either, so tpu joins
that list: the embeddings are computed in float32 on tpu whatever JAX platform backs it, so that what
runs on a CPU host is what a TPU runs (images stay within 1e-3 of the CPU pipeline's).

Patches ``_FP64_UNSUPPORTED_DEVICES`` and ``_DTYPE_UNSUPPORTED_DEVICES`` of
``diffusers/utils/torch_utils.py``; a no-op where diffusers already lists tpu.

``from_pretrained(..., device_map="tpu", parallel_config=TensorParallelConfig(tp_degree=N))`` without an
initialized process group loads into shards over this host's first N chips, one process
(:func:`_from_pretrained`, :mod:`hf_tpu.integrations.sharded_loading`), reading each weight of a safetensors
checkpoint when it is placed (:func:`_load_state_dict`), so the host holds about one weight. Under torchrun (one
process per chip), diffusers' own tensor parallelism runs on ``tpu_dist`` unchanged; :func:`_checked_tp_degree`
only makes ``enable_parallelism`` name the tp degrees that split the model (``hf_tpu.tp_plans.check_tp_size``).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Iterator, MutableMapping
from typing import Any, Callable

import torch

from . import sharded_loading, when_imported


def _single_process_tp(kwargs: dict) -> sharded_loading.ShardedLoad | None:
    """The load into shards a ``from_pretrained`` call asks for with a ``TensorParallelConfig`` (alone or in a
    ``ParallelConfig``) and no process group (``parallel_config`` is then taken out of ``kwargs``), ``None``
    where diffusers' own path applies."""
    from diffusers.models._modeling_parallel import TensorParallelConfig

    config = kwargs.get("parallel_config")
    tp = config if isinstance(config, TensorParallelConfig) else getattr(config, "tensor_parallel_config", None)
    if tp is None or tp.mesh is not None or tp.tp_degree == 1 or sharded_loading.under_torchrun():
        return None
    if not sharded_loading.is_first_tpu(kwargs.get("device_map")):
        raise sharded_loading.needs_tpu_device_map(f"TensorParallelConfig(tp_degree={tp.tp_degree})",
                                                   kwargs.get("device_map"))
    load = sharded_loading.ShardedLoad(tp.tp_degree)
    kwargs.pop("parallel_config")
    return load


def _from_pretrained(original: Callable[..., Any]) -> classmethod:
    """diffusers 0.42 ``ModelMixin.from_pretrained`` (models/modeling_utils.py l.1235-1249, 1383-1396) shards a
    ``TensorParallelConfig`` load over a process group that must be initialized (``_resolve_parallel_config``,
    l.1697-1708). Without one, on tpu, it is an ordinary ``device_map="tpu"`` load whose weights
    :func:`_set_module_tensor_to_device` puts on their shards."""
    return sharded_loading.into_shards(original, _single_process_tp)


def _set_module_tensor_to_device(original: Callable[..., Any]) -> Callable[..., Any]:
    """accelerate's ``set_module_tensor_to_device``, as diffusers 0.42's ``load_model_dict_into_meta`` calls it
    for each weight (models/model_loading_utils.py l.301): loading into shards, a host weight goes onto its
    shards first."""

    @functools.wraps(original)
    def set_module_tensor_to_device(module: torch.nn.Module, tensor_name: str, device: Any,
                                    value: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        load = sharded_loading.active()
        if load is not None and value is not None:
            value = load.place(module, tensor_name, value)
        return original(module, tensor_name, device, value, *args, **kwargs)

    return set_module_tensor_to_device


class _WeightsOnRead(MutableMapping):
    """A safetensors checkpoint as a state dict whose tensors are read when looked up, and not kept (a
    ``SafetensorsReader``, as transformers' loads use). What is stored into it (diffusers renaming the weights of
    deprecated attention blocks, ``_fix_state_dict_keys_on_load``) is kept as given."""

    def __init__(self, path: str) -> None:
        from .transformers import SafetensorsReader

        self._reader = SafetensorsReader(path)
        self._names = dict.fromkeys(self._reader.keys())
        self._stored: dict[str, torch.Tensor] = {}
        weakref.finalize(self, self._reader.__exit__)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._stored:
            return self._stored[name]
        if name not in self._names:
            raise KeyError(name)
        return self._reader.get_tensor(name)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._names[name] = None
        self._stored[name] = tensor

    def __delitem__(self, name: str) -> None:
        del self._names[name]
        self._stored.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)


def _load_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers 0.42's ``load_state_dict`` (models/model_loading_utils.py l.152), which ``from_pretrained``
    (models/modeling_utils.py l.1442, one file) and ``_load_shard_file`` (each file) call: loading into shards,
    a safetensors file becomes a :class:`_WeightsOnRead`, so ``load_model_dict_into_meta`` (l.229, one weight at
    a time) reads each weight just before placing it on its shards instead of the whole file first."""

    @functools.wraps(original)
    def load_state_dict(checkpoint_file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(checkpoint_file, _WeightsOnRead):  # from_pretrained passes on the one file's state dict
            return checkpoint_file
        if sharded_loading.active() is not None and str(checkpoint_file).endswith(".safetensors"):
            return _WeightsOnRead(str(checkpoint_file))
        return original(checkpoint_file, *args, **kwargs)

    return load_state_dict


def _checked_tp_degree(original: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers 0.42's ``_check_tp_supported`` (hooks/tensor_parallel.py l.371-450), which both tensor-parallel
    entry points run first: given the model (``enable_parallelism``), on tpu, :func:`hf_tpu.tp_plans.check_tp_size`
    runs before it, so a degree that does not split the heads (or any planned weight) is refused with the degrees
    that do. ``from_pretrained`` runs it before the model exists (and before any file is fetched), so there
    diffusers' own check of the heads applies."""

    @functools.wraps(original)
    def _check_tp_supported(model_name: str, tp_plan: Any, num_heads: Any, tp_config: Any, *args: Any,
                            **kwargs: Any) -> None:
        from diffusers.hooks.tensor_parallel import _tp_degree

        model = kwargs.get("model")
        degree = _tp_degree(tp_config)
        if model is not None and tp_plan is not None and degree > 1 and _mesh_device_type(tp_config) == "tpu":
            from ..tp_plans import check_tp_size

            check_tp_size(model, degree)
        return original(model_name, tp_plan, num_heads, tp_config, *args, **kwargs)

    return _check_tp_supported


def _mesh_device_type(tp_config: Any) -> str:
    """The device type of the mesh diffusers builds for ``tp_config`` (``_resolve_parallel_config``: the
    accelerator's, unless the config brings a mesh)."""
    return tp_config.mesh.device_type if tp_config.mesh is not None else torch._C._get_accelerator().type


def _install_tp_degree_check(tensor_parallel: Any) -> None:
    check = getattr(tensor_parallel, "_check_tp_supported", None)
    if check is not None and getattr(check, "__wrapped__", None) is None:
        tensor_parallel._check_tp_supported = _checked_tp_degree(check)


def _install_sharded_loading(modeling_utils: Any) -> None:
    model_class = modeling_utils.ModelMixin
    loading = sys.modules.get("diffusers.models.model_loading_utils")
    if getattr(model_class.from_pretrained, "_hf_tpu", False) or not hasattr(loading, "set_module_tensor_to_device"):
        return
    model_class.from_pretrained = _from_pretrained(model_class.__dict__["from_pretrained"].__func__)
    loading.set_module_tensor_to_device = _set_module_tensor_to_device(loading.set_module_tensor_to_device)
    loading.load_state_dict = modeling_utils.load_state_dict = _load_state_dict(loading.load_state_dict)


def install(torch_utils: Any) -> None:
    when_imported("diffusers.models.modeling_utils", _install_sharded_loading)
    when_imported("diffusers.hooks.tensor_parallel", _install_tp_degree_check)
    unsupported = getattr(torch_utils, "_FP64_UNSUPPORTED_DEVICES", None)
    if unsupported is None or "tpu" in unsupported:
        return
    without_float64 = frozenset(unsupported) | {"tpu"}
    torch_utils._FP64_UNSUPPORTED_DEVICES = without_float64
    by_dtype = getattr(torch_utils, "_DTYPE_UNSUPPORTED_DEVICES", None)
    if isinstance(by_dtype, dict):
        by_dtype[torch.float64] = without_float64
