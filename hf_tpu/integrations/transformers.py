"""transformers: the hooks its "tpu" code paths need, for every supported release (5.x).

- Loading onto tpu reads each weight from the safetensors file into a new host buffer that goes to the
  device as is (:class:`SafetensorsReader`). transformers' default reader maps the whole file, so every
  page read stays in the process's resident memory until loading ends (on JAX's CPU platform, next to
  the device copy); with this reader peak host memory stays near the checkpoint size.
- ``from_pretrained(..., device_map="tpu", distributed_config=DistributedConfig(tp_size=N))`` in a process that
  torchrun did not start loads into shards over this host's first N chips, one process (:func:`_from_pretrained`):
  each weight is read once and goes from the host straight onto its shards, and the model ends as
  ``hf_tpu.shard(model, N)`` makes it. Under torchrun (or with a process group) transformers' own path runs.
- ``testing_utils``' backend tables get the tpu memory functions (5.24 binds only seed, count and
  synchronize).
- Releases without ``PreTrainedModel._default_compile_config`` compile generate's decode step with
  ``CompileConfig()``'s inductor, which cannot run tpu tensors: there the default becomes the "tpu"
  Dynamo backend with static shapes, as later releases do.
- A pipeline built from a model on tpu (``pipeline(task, model=model)``, no ``device``) runs where the model
  is: transformers' default would move it to the CPU (it knows no tpu device index), and a model with sharded
  weights must not be moved at all.
- Under torchrun, a ``DistributedConfig(tp_size=N)`` that does not divide the model's heads, key/value heads,
  intermediate sizes or experts is refused before any weight is split, saying which and the sizes that work
  (transformers would split them unevenly and compute wrong values).
- Under torchrun, ``Trainer`` asks ``DistributedDataParallel`` to find unused parameters unless told otherwise
  (``ddp_find_unused_parameters=None``: a guess made for activation checkpointing), which torch's reducer cannot
  do for tpu parameters (see ``hf_tpu.distributed.data_parallel``): on tpu that default is False.
- ``masking_utils._ignore_causal_mask_sdpa`` (transformers/masking_utils.py) reads a padding mask on the host to
  decide whether SDPA can drop it for ``is_causal``: a host wait at every step of a generate with a mask (5.17
  always passes one). On tpu the mask is kept instead; the result is the same.
- Releases whose ``_can_use_grouped_mm`` has no tpu branch send compiled float32 experts to a Python loop
  of matmuls; tpu lowers ``aten::_grouped_mm`` for every dtype, eager and compiled, so it is always used
  (5.24 has the branch: nothing is patched there, and the patch elsewhere is traced by Dynamo).
- A compiled forward reads which outputs its model can record from the model itself, not from
  ``utils/output_capturing.py``'s registry of every model class the process has made: Dynamo guarded the
  registry's length and its keys by position, so making a model of another class recompiled every compiled
  forward (Dynamo traced it again), and a saved compile (torch's caching precompile, on where tpu is used) was
  refused by a process that had made other models, or made them in another order. The value is the same (the
  registry holds each class's ``_can_record_outputs``), on every device: Dynamo now sees the registry as an object
  guarded by its type, where the original lookup would break the graph.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import struct
import threading
import types
from typing import Any, Callable

import torch

from . import sharded_loading, traced_by_dynamo, when_imported

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class _Slice:
    """One tensor of a :class:`SafetensorsReader`, read when indexed (as safetensors' ``PySafeSlice``)."""

    def __init__(self, reader: SafetensorsReader, entry: dict) -> None:
        self._reader = reader
        self._entry = entry

    def get_shape(self) -> list[int]:
        return list(self._entry["shape"])

    def get_dtype(self) -> str:
        return self._entry["dtype"]

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._reader.read(self._entry)
        return tensor if index is Ellipsis else tensor[index].clone()


class SafetensorsReader:
    """Reads a safetensors file with ``pread`` into new host buffers, one per tensor, each handed over
    to the device copy (:func:`hf_tpu.backend.ops.memory.hand_over`). The subset of ``safe_open``'s
    interface transformers' loader uses; safe to read from several threads."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        header = json.loads(os.pread(self._fd, length, 8))
        self._metadata = header.pop("__metadata__", None)
        self._entries = header
        self._start = 8 + length

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def keys(self) -> list[str]:
        return list(self._entries)

    def metadata(self) -> dict | None:
        return self._metadata

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self, self._entries[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.read(self._entries[name])

    def read(self, entry: dict) -> torch.Tensor:
        from ..backend.ops.memory import hand_over

        begin, end = entry["data_offsets"]
        buffer = torch.empty(end - begin, dtype=torch.uint8)
        view, done = memoryview(buffer.numpy()), 0
        while done < len(view):
            read = os.preadv(self._fd, [view[done:]], self._start + begin + done)
            if read == 0:
                raise OSError(f"safetensors file ends before tensor data at byte {self._start + end}")
            done += read
        return hand_over(buffer.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"]))


_loading = threading.local()


def _targets_only_tpu(load_config: Any) -> bool:
    device_map = getattr(load_config, "device_map", None)
    if not device_map or getattr(load_config, "disable_mmap", False):
        return False
    return all(d != "disk" and torch.device(d).type == "tpu" for d in device_map.values())


def _load_pretrained_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        load_config = kwargs.get("load_config", args[3] if len(args) > 3 else None)
        outer = getattr(_loading, "to_tpu", False)
        _loading.to_tpu = _targets_only_tpu(load_config)
        try:
            return original(*args, **kwargs)
        finally:
            _loading.to_tpu = outer

    return staticmethod(load)


def _safe_open(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def safe_open(filename: Any, framework: str, device: Any = "cpu", **kwargs: Any) -> Any:
        if getattr(_loading, "to_tpu", False) and framework == "pt" and device == "cpu":
            return SafetensorsReader(filename)
        return original(filename, framework, device=device, **kwargs)

    return safe_open


def _single_process_tp(kwargs: dict) -> sharded_loading.ShardedLoad | None:
    """The :class:`~hf_tpu.integrations.sharded_loading.ShardedLoad` a ``from_pretrained`` call asks for when it is
    tensor parallel over this host's tpu chips in one process (its tp arguments are then taken out of
    ``kwargs``), ``None`` when transformers' own path applies: no tensor parallelism, or torchrun's."""
    from transformers.distributed import DistributedConfig

    config, tp_size, tp_plan = (kwargs.get(key) for key in ("distributed_config", "tp_size", "tp_plan"))
    if (config is None and tp_size is None and tp_plan is None) or sharded_loading.under_torchrun():
        return None
    if config is not None and (tp_size is not None or tp_plan is not None):
        return None  # transformers says to pass one or the other
    if config is None:
        config = DistributedConfig(tp_size=tp_size, tp_plan=tp_plan)
    elif isinstance(config, dict):
        config = DistributedConfig.from_dict(config)
    others = {name: getattr(config, name) for name in ("fsdp_size", "dp_replicate_size", "pp_size", "ep_size")}
    if config.tp_size == 1 and all(size == 1 for size in others.values()):
        return None  # nothing to distribute: an ordinary load
    if any(size != 1 for size in others.values()):
        raise ValueError(f"DistributedConfig with {others}: in one process (no torchrun) hf_tpu splits a model by "
                         "tensor parallelism only; pass DistributedConfig(tp_size=N) alone, or launch one process "
                         "per chip with torchrun for FSDP, pipeline or expert parallelism")
    if not sharded_loading.is_first_tpu(kwargs.get("device_map")):
        raise sharded_loading.needs_tpu_device_map(f"tp_size={config.tp_size}", kwargs.get("device_map"))
    load = sharded_loading.ShardedLoad(config.tp_size, config.tp_plan)
    for key in ("distributed_config", "tp_size", "tp_plan"):
        kwargs.pop(key, None)
    return load


def _from_pretrained(original: Callable[..., Any]) -> classmethod:
    """transformers 5.24 ``PreTrainedModel.from_pretrained`` (modeling_utils.py l.4169-4249) hands any
    ``distributed_config``/``tp_size`` to ``prepare_distribute_model`` (distributed/mixin.py l.168-191), which
    refuses a ``device_map`` and then needs torchrun's environment (distributed/utils.py l.113-143). Outside
    torchrun, on tpu, it is an ordinary ``device_map="tpu"`` load into shards instead
    (:mod:`hf_tpu.integrations.sharded_loading`; :func:`_spawn_materialize`, :func:`_set_param_for_module`)."""
    return sharded_loading.into_shards(original, _single_process_tp)


def _spawn_materialize(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers 5.24 ``core_model_loading.spawn_materialize`` (l.1469-1494) reads each checkpoint tensor on
    a thread pool and copies it to its device. Loading into shards, each is read only when its parameter is
    converted, and stays on the host until :func:`_set_param_for_module` puts it on its shards: one weight at a
    time on the host, and none whole on any chip."""

    @functools.wraps(original)
    def spawn_materialize(thread_pool: Any, tensor: Any, device: Any = None, dtype: Any = None,
                          sharding_op: Any = None, tensor_idx: Any = None) -> Any:
        if sharded_loading.active() is not None and sharding_op is None:
            return original(None, tensor, "cpu", dtype, sharding_op=None, tensor_idx=tensor_idx)
        return original(thread_pool, tensor, device, dtype, sharding_op=sharding_op, tensor_idx=tensor_idx)

    return spawn_materialize


def _set_param_for_module(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers 5.24 ``core_model_loading.set_param_for_module`` (l.1568-1613) sets a loaded weight on its
    module. Loading into shards, a host weight goes onto its shards first."""

    @functools.wraps(original)
    def set_param_for_module(model: Any, target_name: str, param_value: torch.Tensor, *args: Any,
                             **kwargs: Any) -> Any:
        load = sharded_loading.active()
        if load is not None:
            param_value = load.place(model, target_name, param_value)
        return original(model, target_name, param_value, *args, **kwargs)

    return set_param_for_module


def _install_sharded_loading(modeling_utils: Any) -> None:
    model_class = modeling_utils.PreTrainedModel
    loading = importlib.import_module("transformers.core_model_loading")  # modeling_utils imported it
    if getattr(model_class.from_pretrained, "_hf_tpu", False) or not all(
            hasattr(loading, name) for name in ("spawn_materialize", "set_param_for_module")):
        return
    model_class.from_pretrained = _from_pretrained(model_class.__dict__["from_pretrained"].__func__)
    loading.spawn_materialize = _spawn_materialize(loading.spawn_materialize)
    loading.set_param_for_module = _set_param_for_module(loading.set_param_for_module)


def _fill_testing_tables(testing_utils: Any) -> None:
    """Adds the tpu memory functions to ``testing_utils``' backend tables where a release left them out."""
    if getattr(testing_utils, "torch_device", None) is None or not torch.tpu.is_available():
        return
    for table, function in (
        ("BACKEND_EMPTY_CACHE", torch.tpu.empty_cache),
        ("BACKEND_RESET_MAX_MEMORY_ALLOCATED", torch.tpu.reset_max_memory_allocated),
        ("BACKEND_RESET_PEAK_MEMORY_STATS", torch.tpu.reset_peak_memory_stats),
        ("BACKEND_MAX_MEMORY_ALLOCATED", torch.tpu.max_memory_allocated),
        ("BACKEND_MEMORY_ALLOCATED", torch.tpu.memory_allocated),
        ("BACKEND_SYNCHRONIZE", torch.tpu.synchronize),
    ):
        entries = getattr(testing_utils, table, None)
        if isinstance(entries, dict):
            entries.setdefault("tpu", function)


def _install_compile_default(modeling_utils: Any) -> None:
    """For releases whose ``get_compiled_call`` builds ``CompileConfig()`` itself: on tpu, an unset config
    means the "tpu" backend."""
    model_class = modeling_utils.PreTrainedModel
    if hasattr(model_class, "_default_compile_config") or not hasattr(model_class, "get_compiled_call"):
        return
    original = model_class.get_compiled_call

    @functools.wraps(original)
    def get_compiled_call(self: Any, compile_config: Any) -> Callable:
        if compile_config is None and self.device.type == "tpu":
            from transformers.generation.configuration_utils import CompileConfig

            compile_config = CompileConfig(backend="tpu", dynamic=False, mode="default")
        return original(self, compile_config)

    model_class.get_compiled_call = get_compiled_call


def _has_tpu_branch(can_use_grouped_mm: Callable) -> bool:
    """Whether transformers' ``_can_use_grouped_mm`` already accepts tpu weights (5.24 does, first thing)."""
    probe = types.SimpleNamespace(device=torch.device("tpu"), dtype=torch.float32)
    try:
        return can_use_grouped_mm(probe, probe, probe) is True
    except Exception:  # noqa: BLE001 (a release without the branch reads more than the probe has)
        return False


def _install_grouped_mm(moe: Any) -> None:
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None or getattr(original, "__wrapped__", None) is not None or _has_tpu_branch(original):
        return

    @traced_by_dynamo  # hf_tpu's files are skipped: a skipped call in every experts layer breaks the graph
    @functools.wraps(original)
    def can_use_grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        if weight.device.type == "tpu":
            return True
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use_grouped_mm


def _install_output_capturing_lookup(output_capturing: Any) -> None:
    registry_class = getattr(output_capturing, "_CanRecordRegistry", None)
    if registry_class is None or getattr(registry_class.get, "__wrapped__", None) is not None:
        return
    original = registry_class.get

    @traced_by_dynamo  # runs inside every compiled forward
    @functools.wraps(original)
    def get(self: Any, model: Any) -> dict:
        if torch.compiler.is_compiling():
            return getattr(model, "_can_record_outputs", None) or {}
        return original(self, model)

    registry_class.get = get
    # Dynamo reads an instance of a dict subclass whose __new__ is dict's as a dict, guarding its length and key
    # order wherever it is read (torch/_dynamo/variables/builder.py); with a __new__ of its own, the registry is
    # an object to Dynamo, guarded by its type
    registry_class.__new__ = staticmethod(_new_registry)


def _new_registry(cls: type, *args: Any, **kwargs: Any) -> dict:
    return dict.__new__(cls, *args, **kwargs)


def _install_pipeline_device(pipelines_base: Any) -> None:
    pipeline_class = pipelines_base.Pipeline
    original = pipeline_class.__init__
    if getattr(original, "_hf_tpu", False):
        return
    device_position = list(inspect.signature(original).parameters).index("device") - 2  # in args: after model

    @functools.wraps(original)
    def __init__(self: Any, model: Any, *args: Any, **kwargs: Any) -> None:
        device = getattr(model, "device", None)
        if (kwargs.get("device") is None and len(args) <= device_position and isinstance(device, torch.device)
                and device.type == "tpu" and getattr(model, "hf_device_map", None) is None):
            kwargs["device"] = device
        original(self, model, *args, **kwargs)

    __init__._hf_tpu = True
    pipeline_class.__init__ = __init__


def _install_loading(modeling_utils: Any) -> None:
    model_class = modeling_utils.PreTrainedModel
    if getattr(model_class._load_pretrained_model, "__wrapped__", None) is not None:
        return
    if not hasattr(modeling_utils, "safe_open"):
        return
    model_class._load_pretrained_model = _load_pretrained_model(model_class._load_pretrained_model)
    modeling_utils.safe_open = _safe_open(modeling_utils.safe_open)


def _tpu_ddp_default(original: Callable[..., dict]) -> Callable[..., dict]:
    """``Trainer._build_accelerator_args`` (``transformers/trainer.py``) with ``find_unused_parameters=False``
    for a tpu run whose arguments leave it unset (see the module docstring)."""

    @functools.wraps(original)
    def build_accelerator_args(self: Any, **kwargs: Any) -> dict:
        arguments = original(self, **kwargs)
        if self.args.ddp_find_unused_parameters is None and self.args.device.type == "tpu":
            for handler in arguments.get("kwargs_handlers", []):
                if hasattr(handler, "find_unused_parameters"):
                    handler.find_unused_parameters = False
        return arguments

    return build_accelerator_args


def _checked_tp_size(original: Callable[..., Any]) -> classmethod:
    """``maybe_distribute_model`` (``transformers/distributed/mixin.py``) on a tpu mesh, after
    :func:`hf_tpu.tp_plans.check_tp_size` of the model's own plan."""
    function = original.__func__

    @functools.wraps(function)
    def maybe_distribute_model(cls: type, model: Any, distributed_config: Any, mesh_manager: Any) -> Any:
        # 5.2x passes its mesh manager, earlier releases torch's DeviceMesh
        tp_mesh = mesh_manager.get_mesh("tp") if hasattr(mesh_manager, "get_mesh") else mesh_manager
        if tp_mesh is not None and distributed_config.tp_size > 1 and getattr(
                model, "tp_plan", None) and tp_mesh.device_type == "tpu":
            from ..tp_plans import check_tp_size

            check_tp_size(model, distributed_config.tp_size)
        return function(cls, model, distributed_config, mesh_manager)

    return classmethod(maybe_distribute_model)


def _install_tp_size_check(modeling_utils: Any) -> None:
    model_class = modeling_utils.PreTrainedModel
    current = inspect.getattr_static(model_class, "maybe_distribute_model", None)
    if isinstance(current, classmethod) and getattr(current.__func__, "__wrapped__", None) is None:
        model_class.maybe_distribute_model = _checked_tp_size(current)


def _install_trainer(trainer: Any) -> None:
    trainer_class = trainer.Trainer
    build = getattr(trainer_class, "_build_accelerator_args", None)
    if build is not None and getattr(build, "__wrapped__", None) is None:
        trainer_class._build_accelerator_args = _tpu_ddp_default(build)


def _mask_kept_without_a_read(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def ignore_causal_mask_sdpa(padding_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> bool:
        """False for a padding mask on tpu: SDPA gets the mask, which gives the causal path's result, rather
        than the host waiting for the device to learn whether the mask holds any padding (upstream's
        ``fast_all(padding_mask)``, at every decode step that has a mask)."""
        if padding_mask is not None and padding_mask.device.type == "tpu":
            return False
        return original(padding_mask, *args, **kwargs)

    return ignore_causal_mask_sdpa


def _install_mask_without_reads(masking_utils: Any) -> None:
    current = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if current is not None and getattr(current, "__wrapped__", None) is None:
        # traced by Dynamo, which skips hf_tpu's files (hf_tpu.compile), as the upstream function it wraps is:
        # a compiled forward keeps it in its graph (upstream reads nothing there)
        import torch._dynamo

        masking_utils._ignore_causal_mask_sdpa = torch._dynamo.dont_skip_tracing(_mask_kept_without_a_read(current))


def install(transformers: Any) -> None:
    """Registers the hooks above to run when the transformers modules they patch are imported."""
    when_imported("transformers.modeling_utils", _install_loading)
    when_imported("transformers.modeling_utils", _install_sharded_loading)
    when_imported("transformers.modeling_utils", _install_compile_default)
    when_imported("transformers.modeling_utils", _install_tp_size_check)
    when_imported("transformers.testing_utils", _fill_testing_tables)
    when_imported("transformers.integrations.moe", _install_grouped_mm)
    when_imported("transformers.pipelines.base", _install_pipeline_device)
    when_imported("transformers.trainer", _install_trainer)
    when_imported("transformers.masking_utils", _install_mask_without_reads)
    when_imported("transformers.utils.output_capturing", _install_output_capturing_lookup)
