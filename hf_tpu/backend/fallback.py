"""The PrivateUse1 fallback: what happens to an op with no tpu kernel.

In order: the first op installs the op table (and JAX with it) and is dispatched again; an op with
a decomposition in torch's table (``torch._decomp``) runs as that decomposition, whose pieces have
lowerings; with ``HF_TPU_CPU_FALLBACK=1`` any other op runs on the CPU, with a one-time warning
naming it; otherwise ``NotImplementedError`` names the op and that switch.

Kept free of JAX so that registering the device during ``import torch`` stays cheap.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_map

_library: torch.library.Library | None = None
_local = threading.local()
_warned: set[str] = set()


def cpu_fallback_enabled() -> bool:
    from .runtime import flag

    return flag("HF_TPU_CPU_FALLBACK")


def _in_progress() -> set[str]:
    if not hasattr(_local, "ops"):
        _local.ops = set()
    return _local.ops


def _fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    from .op_table import TABLE

    TABLE.install()
    name = op.name()
    running = _in_progress()
    if name in running:  # re-entered: a decomposition reached the op it decomposes
        return _last_resort(op, args, kwargs)
    running.add(name)
    try:
        if name in TABLE.installed:  # the op reached us before its kernel was installed: call it again
            return op(*args, **kwargs)
        decomposition = torch._decomp.decomposition_table.get(op)
        if decomposition is None:
            return _last_resort(op, args, kwargs)
        try:
            return _into_out_arguments(op, kwargs, decomposition(*args, **kwargs))
        except NotImplementedError:
            if not cpu_fallback_enabled():
                raise
            return _on_cpu(op, args, kwargs)
    finally:
        running.discard(name)


def _into_out_arguments(op: torch._ops.OpOverload, kwargs: dict, result: Any) -> Any:
    """Makes an ``out=`` overload's result land in its ``out`` tensors: some decompositions (those that
    compute in a wider dtype, e.g. bfloat16 padding) return a new tensor and leave ``out`` untouched."""
    names = [a.name for a in op._schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write]
    if not names:
        return result
    outs = [kwargs[name] for name in names]
    results = result if isinstance(result, (tuple, list)) else (result,)
    for out, value in zip(outs, results):
        if value is not out:
            if out.shape != value.shape:
                out.resize_(value.shape)
            out.copy_(value)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _last_resort(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    if cpu_fallback_enabled():
        return _on_cpu(op, args, kwargs)
    raise _missing(op)


def _missing(op: torch._ops.OpOverload) -> NotImplementedError:
    return NotImplementedError(
        f"The operator '{op.name()}' ({op._schema.overload_name or 'default'} overload) has no lowering "
        "for the tpu device (hf_tpu). Set HF_TPU_CPU_FALLBACK=1 to run such operators on the CPU, and "
        "please open an issue naming this operator."
    )


def _on_cpu(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Runs ``op`` on CPU copies of its tpu tensors; mutated arguments and results come back."""
    if op.name() not in _warned:
        _warned.add(op.name())
        warnings.warn(
            f"hf_tpu: {op.name()} has no tpu lowering; running it on the CPU (HF_TPU_CPU_FALLBACK=1). "
            "This copies its tensors to the host and back.",
            stacklevel=2,
        )
    from .dispatch import cpu_copies

    cpu_args, cpu_kwargs, devices = cpu_copies(args, kwargs)
    result = op(*cpu_args, **cpu_kwargs)
    device = devices[0] if devices else torch.device("tpu", 0)
    mutated = list(_mutated(op, args, kwargs, cpu_args, cpu_kwargs))
    for original, copy in mutated:
        if original.shape != copy.shape:
            original.resize_(copy.shape)
        original.copy_(copy)
    returned = {id(copy): original for original, copy in mutated}
    return tree_map(
        lambda value: returned.get(id(value), value.to(device)) if isinstance(value, torch.Tensor) else value,
        result,
    )


def _mutated(op, args, kwargs, cpu_args, cpu_kwargs):
    """(tpu tensor, its CPU copy) for each tensor of an argument the schema marks as written."""
    for index, argument in enumerate(op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if index < len(args) and not argument.kwarg_only:
            original, copy = args[index], cpu_args[index]
        elif argument.name in kwargs:
            original, copy = kwargs[argument.name], cpu_kwargs[argument.name]
        else:
            continue
        pairs = zip(original, copy) if isinstance(original, (list, tuple)) else [(original, copy)]
        for tpu_tensor, cpu_tensor in pairs:
            if isinstance(tpu_tensor, torch.Tensor) and tpu_tensor.device.type == "tpu":
                yield tpu_tensor, cpu_tensor


def install() -> None:
    global _library
    if _library is None:
        _library = torch.library.Library("_", "IMPL")
        _library.fallback(_fallback, "PrivateUse1")
