"""Moving tensors and modules to and from tpu while keeping their Python objects.

``tensor.data = other`` works between tpu and another kind of device, as between CUDA and CPU;
``Module.to`` / ``.cpu()`` / ``.tpu()`` keep parameters the same objects.

Between two devices of the same kind (CPU and CUDA, or two tpu chips, or a dtype change) torch
replaces a tensor's contents in place with ``tensor.data = moved``. A tpu ``TensorImpl`` and a CPU one
are not "shallow-copy compatible" for torch, so it refuses ``.data`` between them, and ``Module._apply``
would make new ``Parameter`` objects, untying tied weights (``lm_head``/``embed_tokens``). Here
``Tensor.data``'s setter gives the Python object a new ``TensorImpl`` over the moved storage instead
(``torch._C._swap_tensor_impl``), keeping identity, ties, hooks and attributes, and ``Module.to`` uses
it. That needs the old ``TensorImpl`` to be referenced by nothing else; a parameter that a live
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
_tensor_data = torch._C.TensorBase.data


def _get_data(self: torch.Tensor) -> torch.Tensor:
    return _tensor_data.__get__(self)


def _copied_with_autograd(tensor: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``new`` is ``tensor.to(...)`` made with autograd on (FSDP2's ``tensor.data = tensor.to(device)``):
    ``new``'s own graph then holds ``tensor`` once, and that graph dies with ``new``."""
    function = new.grad_fn
    return function is not None and any(getattr(edge, "variable", None) is tensor for edge, _ in
                                        function.next_functions)


def _set_data(self: torch.Tensor, new: torch.Tensor) -> None:
    """``self.data = new``. torch replaces the contents of ``self``'s ``TensorImpl`` in place, which it
    refuses between a tpu and a CPU ``TensorImpl``; there ``self``'s Python object is given a new
    ``TensorImpl`` over ``new``'s storage instead, keeping the object, its ``requires_grad``, its hooks,
    its attributes and its gradient (moved and cast along), which is what ``.data`` keeps on CUDA."""
    if (
        not isinstance(new, torch.Tensor)
        or torch._has_compatible_shallow_copy_type(self, new)
        or "tpu" not in (self.device.type, new.device.type)
    ):
        _tensor_data.__set__(self, new)
        return
    if self.grad_fn is not None:
        raise RuntimeError(
            f"Cannot set .data of a non-leaf tensor across devices ({self.device} to {new.device}): "
            "move a leaf tensor instead, or use .to() to make a new tensor."
        )
    if self._use_count() != 1 + _copied_with_autograd(self, new):
        raise RuntimeError(
            f"Cannot move .data from {self.device} to {new.device} while an autograd graph still uses this "
            "tensor: torch cannot change a tensor's device in place, and the graph would accumulate its gradient "
            "into the old one. Run the forward under torch.no_grad(), or move the tensor before the forward or "
            "after the backward."
        )
    replacement = new.detach()
    grad, hooks, post_hooks = self.grad, self._backward_hooks, self._post_accumulate_grad_hooks
    replacement.requires_grad_(self.requires_grad)
    torch._C._swap_tensor_impl(self, replacement)
    if grad is not None:
        self.grad = grad.to(new.device, new.dtype)
    if hooks is not None:
        self._backward_hooks = hooks  # registers them with the new TensorImpl
    if post_hooks is not None:
        self._post_accumulate_grad_hooks = post_hooks


def _holds_tpu_tensors(module: torch.nn.Module) -> bool:
    return any(t.device.type == "tpu" for t in module.parameters()) or any(
        t.device.type == "tpu" for t in module.buffers()
    )


def _replace_contents(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """What ``Module._apply`` calls as ``torch.utils.swap_tensors`` during a tpu conversion: ``.data``,
    which across devices keeps the parameter object too (:func:`_set_data`)."""
    t1.data = t2


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
    torch.Tensor.data = property(_get_data, _set_data, doc=_tensor_data.__doc__)

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
