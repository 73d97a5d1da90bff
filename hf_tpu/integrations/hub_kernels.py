"""transformers' hub kernels (``transformers/integrations/hub_kernels.py``): its kernels layer mapping for tpu
models, with the installed ``kernels`` release. Line numbers are transformers 5.25.0's.

Four patches, each a no-op where upstream already does the right thing:

1. **Version gate** (``transformers/utils/import_utils.py``: ``KERNELS_MIN_VERSION``/``KERNELS_MAX_VERSION``
   at lines 177-178, ``is_kernels_available`` at 805-814). transformers 5.24 accepts ``kernels>=0.18.2,<0.19``,
   5.25 ``kernels>=0.19.1,<0.20``; with an older kernels every ``@use_kernel_forward_from_hub`` is a stub
   (``hub_kernels.py:103, 288-330``), ``from_pretrained(use_kernels=True)`` raises "Kernels are not available"
   (``modeling_utils.py:3890``) and ``hub_kernels.kernelize`` raises ``ImportError`` (``hub_kernels.py:503``).
   Everything ``hub_kernels.py`` imports from kernels (lines 104-119) exists in 0.17.2 and 0.18.3 with the
   signatures it calls (``get_kernel(user_agent=, trust_remote_code=)``, ``kernelize(device=, mode=,
   use_fallback=)``, ``KernelizeFallback.ALL``, ``Device(properties=CUDAProperties(...))``,
   ``use_kernelized_func(*functions)``). So, when the installed kernels is at least
   :data:`OLDEST_CHECKED_KERNELS` but below transformers' minimum, ``is_kernels_available`` becomes the same
   check from :data:`OLDEST_CHECKED_KERNELS` (bound in ``import_utils`` and ``transformers.utils``). With a
   kernels release transformers accepts (0.19.1 with 5.25), a newer one, or none, nothing changes.
   The patch runs when ``import_utils`` has just executed, before ``transformers.utils`` binds the name
   and before ``hub_kernels`` is imported (``transformers.modeling_utils`` and ``transformers.activations``
   import it, and both import torch, hence hf_tpu, first; when ``hub_kernels``' own import is what imports
   torch, its binding of the name is replaced too). Registered after ``hub_kernels`` has defined its
   decorators, hf_tpu leaves the gate closed and warns: they are stubs by then.
   Then transformers behaves as with a compatible kernels installed: decorated classes get a
   ``kernel_layer_name``, decorated functions (``apply_rotary_pos_emb``) become small modules calling them,
   kept in ``_kernel_funcs`` by ``@use_kernelized_func`` classes, and code asking for a Hub kernel (a
   ``flash_attention_2`` request without flash-attn, some quantizers) tries to load one instead of raising.
   A model that does not set ``use_kernels`` computes as before, on every device.
2. **tpu mapping** (``transformers/integrations/hub_kernels.py:129-273``: ``_build_kernel_mapping`` has no
   "tpu" entries). Its result gets :func:`hf_tpu.kernels.hub.tpu_mapping` (RMSNorm and the activations:
   hf_tpu's kernel repositories, through ``kernels.LocalLayerRepository``) for each layer name without a
   tpu entry of its own, so ``from_pretrained(..., use_kernels=True, device_map="tpu")``,
   ``model.set_use_kernels(True)`` and ``model.use_kernels = True`` swap them in on tpu. Only where hf_tpu's
   Pallas kernels run (:func:`hf_tpu.backend.runtime.pallas_kernels`: on TPU chips; elsewhere with
   ``HF_TPU_PALLAS=1``, interpreted): transformers 5.25 kernelizes every ``from_pretrained`` model by default
   (``modeling_utils.py:4415-4422``, ``use_kernels=None`` becomes ``True``), and off TPU chips the interpreted
   kernels are far slower than XLA's own ops (inside a multi-process tensor-parallel graph they hung).
3. **RMSNorm formulas** (``hub_kernels.py:104-116``, ``use_kernel_forward_from_hub``, kernels' own):
   transformers 5.24 marks 139 classes "RMSNorm", and some compute another formula (Olmo2 and GptOss scale
   before the final cast, DeepseekV4 keeps float32 weights). hf_tpu's ``RMSNorm`` layer computes
   ``LlamaRMSNorm``'s; the classes it decorates get a ``kernel_condition`` under which a module on tpu whose
   class's ``forward`` is not ``LlamaRMSNorm``'s (the same code, as transformers copies it per model) keeps its
   own forward. Modules on other devices are decided as before. transformers 5.25 no longer marks those three:
   its 132 "RMSNorm" classes all compute ``LlamaRMSNorm``'s formula, so the condition holds for each of them.
4. **``KernelConfig(use_local_kernel=True)``** (``transformers/utils/kernel_config.py:73-89``):
   ``register_kernel_replacements_and_fusions`` (``hub_kernels.py:705-717, 755, 815``) rewrites the
   config's mapping values as ``(path:layer, metadata)`` tuples, and ``add_to_mapping_local`` then calls
   ``.split`` on them (``kernel_config.py:80``, called at 318). The wrapped ``add_to_mapping_local`` takes a
   tuple's string; strings pass through unchanged.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable

from . import when_imported

OLDEST_CHECKED_KERNELS = "0.17.2"
"""The oldest kernels release checked to provide everything transformers' ``hub_kernels`` uses (0.18.3 too)."""


def _bridge_version_gate(import_utils: Any) -> None:
    original = getattr(import_utils, "is_kernels_available", None)
    maximum = getattr(import_utils, "KERNELS_MAX_VERSION", None)
    if original is None or maximum is None or getattr(original, "_hf_tpu_bridge", False):
        return
    if original() or not original(OLDEST_CHECKED_KERNELS, maximum):
        return  # a release transformers accepts, or none we checked
    hub_kernels = sys.modules.get("transformers.integrations.hub_kernels")
    if hub_kernels is not None and "use_kernel_forward_from_hub" in vars(hub_kernels):  # stubs already
        warnings.warn("hf_tpu was registered after transformers imported its hub kernels while the installed "
                      "kernels is older than transformers accepts: use_kernels and kernelize stay unavailable in "
                      "this process; register hf_tpu (import torch, or hf_tpu.register() with autoload off) before "
                      "importing transformers' models",
                      stacklevel=2)
        return

    @functools.wraps(original)  # keeps _dynamo_marked_constant: a trace-time constant, as upstream's
    def is_kernels_available(MIN_VERSION: str = OLDEST_CHECKED_KERNELS, MAX_VERSION: str = maximum) -> bool:
        return original(MIN_VERSION, MAX_VERSION)

    is_kernels_available._hf_tpu_bridge = True
    import_utils.is_kernels_available = is_kernels_available
    # transformers.utils, and hub_kernels when its import is what imported torch, may have bound the name already
    for module in (sys.modules.get("transformers.utils"), hub_kernels):
        if getattr(module, "is_kernels_available", None) is original:
            module.is_kernels_available = is_kernels_available


def _has_tpu_entry(devices: dict) -> bool:
    return any(getattr(device, "type", device) == "tpu" for device in devices)


def _pallas_kernels() -> bool:
    """Whether hf_tpu's kernel layers join transformers' mapping (see patch 2 in the module's docstring)."""
    from ..backend import runtime

    return runtime.pallas_kernels()


def _add_tpu_mapping(hub_kernels: Any) -> None:
    build = getattr(hub_kernels, "_build_kernel_mapping", None)  # absent while kernels is unavailable
    if build is None or getattr(build, "_hf_tpu_bridge", False):
        return

    @functools.wraps(build)
    def build_kernel_mapping() -> dict:
        from hf_tpu.kernels.hub import tpu_mapping

        mapping = build()
        if not _pallas_kernels():
            return mapping
        for name, devices in tpu_mapping().items():
            if not _has_tpu_entry(mapping.setdefault(name, {})):
                mapping[name].update(devices)
        return mapping

    build_kernel_mapping._hf_tpu_bridge = True
    hub_kernels._build_kernel_mapping = build_kernel_mapping


def _computes_llama_rms_norm_unless_off_tpu(module: Any) -> bool:
    parameter = next(module.parameters(), None)
    if parameter is None or parameter.device.type != "tpu":
        return True
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    code, reference = type(module).forward.__code__, LlamaRMSNorm.forward.__code__
    return all(getattr(code, part) == getattr(reference, part) for part in ("co_code", "co_consts", "co_names"))


def _keep_other_rms_norm_formulas(hub_kernels: Any) -> None:
    original = getattr(hub_kernels, "use_kernel_forward_from_hub", None)
    if original is None or getattr(original, "_hf_tpu_bridge", False):
        return

    @functools.wraps(original)
    def use_kernel_forward_from_hub(layer_name: str) -> Callable:
        decorate = original(layer_name)
        if layer_name != "RMSNorm":
            return decorate

        def decorator(cls: type) -> type:
            cls = decorate(cls)
            condition = getattr(cls, "kernel_condition", None)
            if condition is not None:
                cls.kernel_condition = staticmethod(
                    lambda module: condition(module) and _computes_llama_rms_norm_unless_off_tpu(module))
            return cls

        return decorator

    use_kernel_forward_from_hub._hf_tpu_bridge = True
    hub_kernels.use_kernel_forward_from_hub = use_kernel_forward_from_hub


def _accept_local_repo_tuples(kernel_config: Any) -> None:
    original: Callable | None = getattr(kernel_config, "add_to_mapping_local", None)
    if original is None or getattr(original, "_hf_tpu_bridge", False):
        return

    @functools.wraps(original)
    def add_to_mapping_local(layer_name: str, device: str, repo_name: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(repo_name, tuple):  # (path:layer, metadata) from register_kernel_replacements_and_fusions
            repo_name = repo_name[0]
        original(layer_name, device, repo_name, *args, **kwargs)

    add_to_mapping_local._hf_tpu_bridge = True
    kernel_config.add_to_mapping_local = add_to_mapping_local


def install(import_utils: Any) -> None:
    """Bridges the version gate now (``transformers.utils.import_utils`` has just executed) and registers the
    other patches for when their modules are imported."""
    _bridge_version_gate(import_utils)
    when_imported("transformers.integrations.hub_kernels", _add_tpu_mapping)
    when_imported("transformers.integrations.hub_kernels", _keep_other_rms_norm_formulas)
    when_imported("transformers.utils.kernel_config", _accept_local_repo_tuples)
