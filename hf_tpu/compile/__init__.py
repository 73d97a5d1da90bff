"""Graph mode: ``torch.compile(model, backend="tpu")`` runs each Dynamo graph as one XLA program.

The Dynamo backend ``"tpu"`` is found through the ``torch_dynamo_backends`` entry point (see
``pyproject.toml``), so neither ``import torch`` nor ``import hf_tpu`` imports Dynamo or JAX for it.
:func:`tpu_backend` is the backend itself; AOTAutograd turns each Dynamo graph into forward and
backward ATen graphs, and :mod:`.graph_lowering` lowers each to one ``jax.jit`` with the op table
eager mode uses (plus the graph-mode lowerings of :mod:`.graph_ops` for views, factories and copies).
"""

from __future__ import annotations

import collections.abc
import functools
import importlib.util
import os
from typing import Any

import torch

from .stats import compile_stats, reset_compile_stats


def tpu_backend(graph_module: Any, example_inputs: list) -> Any:
    """The ``"tpu"`` Dynamo backend: ``torch.compile(fn, backend="tpu")`` (imports JAX when first called)."""
    from . import frozen_heap
    from .backend import compile_graph

    frozen_heap.register()  # again after a torch._dynamo.reset(), which clears Dynamo's callbacks
    return compile_graph(graph_module, example_inputs)


def _on_tpu(model: Any, inputs: list) -> bool:
    """Whether a Dynamo graph computes on tpu: its tensor inputs are there, or, with none (a graph that makes its
    tensors, such as ``create_block_mask``'s), its values are."""
    tensors = [value for value in inputs if isinstance(value, torch.Tensor)]
    if tensors:
        return any(value.device.type == "tpu" for value in tensors)
    values = (node.meta.get("example_value") for node in getattr(getattr(model, "graph", None), "nodes", ()))
    return any(isinstance(value, torch.Tensor) and value.device.type == "tpu" for value in values)


def install() -> None:
    """Graph mode's hooks into torch, applied at device registration (without importing Dynamo)."""
    from .._import_hooks import when_imported

    from . import frozen_heap

    _install_default_backend()
    when_imported("torch._dynamo.callback", lambda _: frozen_heap.register())
    when_imported("torch._dynamo.trace_rules", _skip_in_dynamo)
    when_imported("torch._subclasses.fake_impls", _fake_grouped_mm_for_every_dtype)


def _skip_in_dynamo(trace_rules: Any) -> None:
    """Dynamo runs hf_tpu's and JAX's frames without tracing them. The device's Python kernels run
    inside user frames Dynamo watches (eager code between graph breaks, e.g. ``.item()``, or a frame
    Dynamo gave up on), and a kernel's first call traces its lowering with JAX: neither is user code,
    and Dynamo's emulation of them fails (JAX's ``isinstance`` checks on tracers). Model code is traced:
    the kernel repositories in ``hf_tpu/kernels/hub``, as any Hub kernel's layers are, and the attention
    and experts functions the kernel wirings register with transformers and diffusers (they call the
    kernels' torch ops, which graphs hold as they are)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    kernels = os.path.join(package, "kernels")
    hub = os.path.join(kernels, "hub")
    traced = {os.path.join(hub, name) for name in os.listdir(hub) if os.path.isdir(os.path.join(hub, name, "build"))}
    traced |= {os.path.join(kernels, name) for name in ("transformers_wiring.py", "diffusers_wiring.py")}
    jax = [location for name in ("jax", "jaxlib") if (spec := importlib.util.find_spec(name)) is not None
           for location in spec.submodule_search_locations or ()]
    trace_rules.SKIP_DIRS.extend(path.replace(os.sep, "/") + ("/" if os.path.isdir(path) else "")
                                 for path in _paths_besides(package, traced) + jax)
    trace_rules._recompile_re()


def _paths_besides(root: str, kept: set[str]) -> list[str]:
    """The entries under directory ``root`` that cover all of it but the ``kept`` paths."""
    paths = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if any(kept_path.startswith(path + os.sep) for kept_path in kept):
            paths += _paths_besides(path, kept)
        elif path not in kept:
            paths.append(path)
    return paths


def _fake_grouped_mm_for_every_dtype(fake_impls: Any) -> None:
    """torch's meta kernel of ``aten::_grouped_mm`` takes only bfloat16 (CUDA's kernel), so Dynamo could not
    trace float32 experts, which tpu lowers (transformers sends tpu experts there in every dtype): for tpu
    fake tensors the result is shaped by torch's own rule, in the input's dtype (or ``out_dtype``)."""
    import torch._meta_registrations as meta

    op = torch.ops.aten._grouped_mm.default
    output = getattr(meta, "_create_grouped_mm_output_tensor", None)  # private: absent, leave torch's kernel
    if output is None or op in fake_impls.op_implementations_dict:
        return

    @fake_impls.register_op_impl(op)
    def grouped_mm(fake_mode: Any, func: Any, mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None,
                   out_dtype: Any = None) -> Any:
        if mat_a.device.type != "tpu":
            return NotImplemented
        with fake_mode:
            return output(mat_a, mat_b, offs, out_dtype)


def _install_default_backend() -> None:
    """Makes ``torch.compile(fn)`` without a backend (that is, Inductor) compile graphs whose inputs
    are on tpu with :func:`tpu_backend`; graphs on CPU or CUDA inputs still go to Inductor."""
    inductor = torch._TorchCompileInductorWrapper
    if getattr(inductor.__call__, "_hf_tpu", False):
        return
    compile_with_inductor = inductor.__call__

    def compile_graph(self: Any, model: Any, inputs: list, **kwargs: Any) -> Any:
        if _on_tpu(model, inputs):
            return tpu_backend(model, inputs)
        return compile_with_inductor(self, model, inputs, **kwargs)

    compile_graph._hf_tpu = True
    inductor.__call__ = compile_graph
    inductor.get_compiler_config = lambda wrapper: _InductorConfig(wrapper.config)


class _InductorConfig(collections.abc.Mapping):
    """What ``get_compiler_config()`` of a default ``torch.compile`` gives (Inductor's configuration with its
    options), read when first looked at: reading it imports Inductor's compiler, 2 s of a new process's first
    ``torch.compile`` on a small host, which a model on tpu never uses (``torch/__init__.py``,
    ``_TorchCompileInductorWrapper.get_compiler_config``, called by every ``torch.compile``)."""

    def __init__(self, patches: dict) -> None:
        self._patches = dict(patches)

    @functools.cached_property
    def _config(self) -> dict:
        from torch._inductor.compile_fx import get_patched_config_dict

        return get_patched_config_dict(config_patches=self._patches)

    def __getitem__(self, key: str) -> Any:
        return self._config[key]

    def __iter__(self) -> Any:
        return iter(self._config)

    def __len__(self) -> int:
        return len(self._config)

    def __reduce__(self) -> tuple:
        return dict, (self._config,)


__all__ = ["compile_stats", "install", "reset_compile_stats", "tpu_backend"]
