"""Moving modules to and from tpu: ``Module.to`` / ``.cpu()`` / ``.tpu()`` keep parameters the same objects.

Between two devices of the same kind (CPU and CUDA, or two tpu chips, or a dtype change on tpu) torch
replaces a parameter's contents with ``param.data = moved``. A tpu ``TensorImpl`` and a CPU one are
not "shallow-copy compatible" for torch, so ``.data`` cannot cross between them, and torch's fallback
would make new ``Parameter`` objects, untying tied weights (``lm_head``/``embed_tokens``). Instead
these patches swap the Python objects' contents (``torch.utils.swap_tensors``), keeping identity and
ties. A swap needs the parameter's ``TensorImpl`` to be referenced by nothing else; one that a live
autograd graph still holds (a forward ran, its output is alive) is left with that graph untouched, and
the module gets a new ``Parameter`` instead, as torch does when neither ``.data`` nor a swap applies.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_module_to = torch.nn.Module.to
_module_cpu = torch.nn.Module.cpu
_swap_tensors = torch.utils.swap_tensors


def _holds_tpu_tensors(module: torch.nn.Module) -> bool:
    return any(t.device.type == "tpu" for t in module.parameters()) or any(
        t.device.type == "tpu" for t in module.buffers()
    )


def _replace_contents(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """What ``Module._apply`` calls as ``torch.utils.swap_tensors`` during a tpu conversion: ``.data``
    where torch allows it (the CUDA behaviour: autograd graphs that saved the tensor stay valid), a swap
    that keeps the Python attributes (``param.data = ...`` keeps them on CUDA) otherwise."""
    if torch._has_compatible_shallow_copy_type(t1, t2):
        t1.data = t2
        return
    for name, value in vars(t1).items():
        vars(t2).setdefault(name, value)
    _swap_tensors(t1, t2)


def _swappable(tensor: torch.Tensor) -> bool:
    """Whether nothing but the Python object refers to the ``TensorImpl`` (an autograd graph that
    uses a parameter holds it through its AccumulateGrad node or a saved tensor)."""
    return tensor._use_count() == 1


def _new_parameter(param: torch.nn.Parameter) -> torch.nn.Parameter:
    fresh = torch.nn.Parameter(param.detach(), requires_grad=param.requires_grad)
    vars(fresh).update(vars(param))
    if param.grad is not None:
        fresh.grad = param.grad.detach()
    return fresh


def _release_graph_held_parameters(module: torch.nn.Module, device: torch.device | None) -> None:
    """Gives a new ``Parameter`` (one per old one, so ties stay) to every module whose parameter is
    about to move between tpu and another kind of device but is held by an autograd graph, which then
    keeps the old object."""
    if device is None:  # a dtype change: ``.data`` serves it
        return
    replacements: dict[int, torch.nn.Parameter] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is None or (param.device.type == "tpu") == (device.type == "tpu"):
                continue
            if id(param) not in replacements:
                if _swappable(param):
                    continue
                replacements[id(param)] = _new_parameter(param)
            owner._parameters[name] = replacements[id(param)]


@contextlib.contextmanager
def _converting(module: torch.nn.Module, device: torch.device | None):
    _release_graph_held_parameters(module, device)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    torch.utils.swap_tensors = _replace_contents
    try:
        yield
    finally:
        torch.utils.swap_tensors = _swap_tensors
        torch.__future__.set_swap_module_params_on_conversion(previous)


def install() -> None:
    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if (device is not None and device.type == "tpu") or _holds_tpu_tensors(self):
            with _converting(self, device):
                return _module_to(self, *args, **kwargs)
        return _module_to(self, *args, **kwargs)

    def cpu(self: torch.nn.Module) -> torch.nn.Module:
        if _holds_tpu_tensors(self):
            with _converting(self, torch.device("cpu")):
                return _module_cpu(self)
        return _module_cpu(self)

    def tpu(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        return to(self, torch.device("tpu", device) if isinstance(device, int) else device or "tpu")

    to.__doc__ = _module_to.__doc__
    torch.nn.Module.to = to
    torch.nn.Module.cpu = cpu
    torch.nn.Module.tpu = tpu
