"""The built-in Pallas flash-attention kernel in diffusers models on tpu: :func:`enable`.

diffusers computes attention in *processors*, one per attention module. Two hooks could reach them:

- the attention-backend registry behind ``dispatch_attention_fn``: only the newer processors (Flux, Wan,
  QwenImage, ... on ``AttentionModuleMixin``) dispatch through it, and its keys, like the names
  ``set_attention_backend`` accepts, are members of the closed Enum ``AttentionBackendName``: a backend of
  our own cannot be registered without rewriting that Enum;
- ``torch.nn.functional.scaled_dot_product_attention`` (SDPA): the older processors (``AttnProcessor2_0``
  of the UNets, VAEs and PixArt, ``JointAttnProcessor2_0`` of SD3, the IP-Adapter ones, ...) call it
  themselves, and the newer ones reach it through the default "native" backend.

So :func:`enable` hooks SDPA, per processor: each attention module gets a copy of its processor whose class
is a subclass of the original (``Pallas<Name>``, so diffusers' ``isinstance`` checks and the keyword
filtering by ``__call__``'s signature in ``Attention.forward`` still hold) and whose ``__call__`` runs the
original under a ``TorchFunctionMode`` that computes the SDPA calls on the kernel, through the same op as
the transformers wiring (:func:`hf_tpu.kernels.transformers_wiring.attention`, with its gradient).

SDPA calls the kernel cannot compute exactly fall back to hf_tpu's own SDPA lowering, with a warning naming
the reason: an additive (float) mask, as the UNets make from ``encoder_attention_mask``; ``dropout_p > 0``;
inputs off tpu or in mixed dtypes. Calls the kernel would compute differently from SDPA (not 4-D, differing
head dimensions, fewer key heads without ``enable_gqa``, a mask with ``is_causal``) also take that path,
where SDPA computes them or raises its own error. A model keeps working wherever some of its attention
calls cannot use the kernel, which is why nothing here raises for them. A processor that computes no SDPA
at all (``AttnProcessor``, sliced or xformers processors, a non-native backend, context parallelism) is
left to itself, with a warning the first time it runs.

Off TPU chips the kernel runs in TPU interpret mode: correct, slow, for testing.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Callable, Optional, TypeVar

import diffusers
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .transformers_wiring import attention

ModelOrPipeline = TypeVar("ModelOrPipeline", torch.nn.Module, diffusers.DiffusionPipeline)


class PallasProcessor:
    """Base of the processor classes :func:`enable` makes, each a subclass of a diffusers processor class."""


def _why_not_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
    dropout_p: float, is_causal: bool, enable_gqa: bool,
) -> Optional[str]:
    """Why the kernel does not compute this SDPA call, or None where it computes it as SDPA does."""
    tensors = [t for t in (query, key, value, attn_mask) if t is not None]
    if any(t.device.type != "tpu" for t in tensors):
        return "inputs that are not on tpu"
    if dropout_p:
        return "dropout_p > 0 (the kernel has no dropout)"
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        return "a float (additive) attn_mask (the kernel takes boolean masks)"
    if len({query.dtype, key.dtype, value.dtype}) > 1:
        return "query, key and value of different dtypes"
    if not query.dim() == key.dim() == value.dim() == 4 or len({query.shape[-1], key.shape[-1], value.shape[-1]}) > 1:
        return "inputs that are not [batch, heads, length, head_dim] with one head_dim"
    if key.shape[1] != query.shape[1] and not enable_gqa:
        return "fewer key/value heads than query heads without enable_gqa"
    if attn_mask is not None and is_causal:
        return "both attn_mask and is_causal"
    return None


def _sdpa_on_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on the Pallas kernel where it can compute it, else SDPA itself."""
    reason = _why_not_kernel(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        warnings.warn(f"hf_tpu.kernels: scaled_dot_product_attention with {reason} runs on hf_tpu's SDPA "
                      "lowering, not on the Pallas kernel", stacklevel=3)
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return attention(query, key, value, attn_mask, is_causal, scale).transpose(1, 2)


class _SdpaOnKernel(TorchFunctionMode):
    """Computes the SDPA calls made inside it with :func:`_sdpa_on_kernel`."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.saw_sdpa()
        return _sdpa_on_kernel(*args, **kwargs)

    def saw_sdpa(self) -> None:
        pass


class _CountingSdpaOnKernel(_SdpaOnKernel):
    """:class:`_SdpaOnKernel`, counting the calls (eager only: Dynamo does not follow a mode's state)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def saw_sdpa(self) -> None:
        self.calls += 1


@functools.cache
def _warn_no_sdpa(processor_class: type) -> None:
    warnings.warn(f"hf_tpu.kernels: {processor_class.__name__} computes attention without "
                  "scaled_dot_product_attention, so not on the Pallas kernel; give its modules an SDPA processor "
                  "(model.set_attn_processor(AttnProcessor2_0()) for Attention modules, the native attention "
                  "backend for the others) before enabling the kernel", stacklevel=3)


@functools.cache
def _pallas_class(processor_class: type) -> type:
    """The subclass of ``processor_class`` whose ``__call__`` computes SDPA on the kernel."""
    original = processor_class.__call__

    @functools.wraps(original)  # the signature: attention modules pass only the keyword arguments it names
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            with _SdpaOnKernel():
                return original(self, *args, **kwargs)
        with _CountingSdpaOnKernel() as mode:
            out = original(self, *args, **kwargs)
        if not mode.calls:
            _warn_no_sdpa(processor_class)
        return out

    return type(f"Pallas{processor_class.__name__}", (PallasProcessor, processor_class),
                {"__call__": __call__, "__module__": __name__})


def _pallas_processor(processor: Any) -> Any:
    if isinstance(processor, PallasProcessor):
        return processor
    pallas = copy.copy(processor)  # processors are often shared, between models too: leave the original alone
    pallas.__class__ = _pallas_class(type(processor))
    return pallas


def _models(model_or_pipeline: Any) -> list[torch.nn.Module]:
    if isinstance(model_or_pipeline, torch.nn.Module):
        return [model_or_pipeline]
    if isinstance(model_or_pipeline, diffusers.DiffusionPipeline):
        return [c for c in model_or_pipeline.components.values() if isinstance(c, diffusers.ModelMixin)]
    raise TypeError("hf_tpu.kernels.diffusers_wiring.enable takes a diffusers model (or any module holding diffusers "
                    f"attention modules) or a DiffusionPipeline, not {type(model_or_pipeline).__name__}")


def enable(model_or_pipeline: ModelOrPipeline) -> ModelOrPipeline:
    """Computes the attention of a diffusers model on tpu (or of any module holding diffusers attention modules),
    or of every diffusers model of a pipeline (UNet or transformer, VAE; not the transformers text encoders: see
    :func:`hf_tpu.kernels.enable` for those), on the Pallas flash-attention kernel. ``hf_tpu.kernels.enable``
    calls it for diffusers models and pipelines.

    Gives every attention module (each module with ``set_processor``) a copy of its processor that sends its
    ``scaled_dot_product_attention`` calls to the kernel (see the module docstring for the calls that stay on
    hf_tpu's SDPA lowering). Changes the models in place and returns the argument. Idempotent;
    ``set_attn_processor`` undoes it (``set_default_attn_processor`` refuses processor classes it does not know).
    """
    models = _models(model_or_pipeline)
    for model in models:
        elsewhere = sorted({str(p.device) for p in model.parameters() if p.device.type != "tpu"})
        if elsewhere:
            raise ValueError(f"hf_tpu.kernels.diffusers_wiring.enable: {type(model).__name__} has parameters on "
                             f"{', '.join(elsewhere)}; the kernel runs on tpu tensors: move it with .to('tpu') first")
    modules = [m for model in models for m in model.modules()
               if hasattr(m, "set_processor") and getattr(m, "processor", None) is not None]
    if not modules:
        names = ", ".join(type(model).__name__ for model in models) or "no diffusers model"
        raise ValueError(f"hf_tpu.kernels.diffusers_wiring.enable: {names} has no diffusers attention modules to run "
                         "on the Pallas kernel (for a transformers model use hf_tpu.kernels.enable)")
    for module in modules:
        module.set_processor(_pallas_processor(module.processor))
    return model_or_pipeline


__all__ = ["PallasProcessor", "enable"]
