"""torch._inductor's ahead-of-time entry points: a clear error for programs on tpu.

AOTInductor compiles for CPU and CUDA only: ``torch._inductor.aoti_compile_and_package`` (and
``torch._inductor.aot_compile``, which it calls) on a program whose tensors are on tpu ends deep inside
Inductor with "Device tpu not supported". This wraps both functions of ``torch/_inductor/__init__.py``
so that such a program fails at once with an error naming the tpu way to package it,
``hf_tpu.export.save`` and ``hf_tpu.export.load``; programs on other devices go to Inductor unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree


def _tensors(*values: Any) -> Iterable[torch.Tensor]:
    return (leaf for leaf in pytree.tree_leaves(values) if isinstance(leaf, torch.Tensor))


def _program_tensors(exported_program: Any, *args: Any, **kwargs: Any) -> Iterable[torch.Tensor]:
    """``aoti_compile_and_package(exported_program, ...)``: its weights, constants and example inputs."""
    return _tensors(*(getattr(exported_program, name, None) for name in ("state_dict", "constants", "example_inputs")))


def _graph_tensors(gm: Any, args: Any = (), kwargs: Any = None, **options: Any) -> Iterable[torch.Tensor]:
    """``aot_compile(gm, args, kwargs)``: the graph module's parameters and buffers, and the inputs."""
    weights = list(gm.parameters()) + list(gm.buffers()) if isinstance(gm, torch.nn.Module) else []
    return _tensors(weights, args, kwargs)


def _refusing_tpu(original: Callable, tensors_of: Callable[..., Iterable[torch.Tensor]]) -> Callable:
    @functools.wraps(original)
    def compile_ahead_of_time(*args: Any, **kwargs: Any) -> Any:
        if any(tensor.device.type == "tpu" for tensor in tensors_of(*args, **kwargs)):
            raise RuntimeError(
                f"torch._inductor.{original.__name__}: the program's tensors are on tpu, which AOTInductor does not "
                "compile for. Write an ahead-of-time package for tpu with hf_tpu.export.save(exported_program, path) "
                "and run it with hf_tpu.export.load(path)(*args, **kwargs).")
        return original(*args, **kwargs)

    compile_ahead_of_time._hf_tpu = True
    return compile_ahead_of_time


def install(inductor: Any) -> None:
    for name, tensors_of in (("aoti_compile_and_package", _program_tensors), ("aot_compile", _graph_tensors)):
        original = getattr(inductor, name, None)
        if original is not None and not getattr(original, "_hf_tpu", False):
            setattr(inductor, name, _refusing_tpu(original, tensors_of))
