"""``torch.autocast("tpu")``: CUDA's autocast op policies on the AutocastPrivateUse1 dispatch key.

torch registers autocast kernels for CUDA, CPU, XPU and MPS in C++ but nothing for PrivateUse1, so
without this every op under ``torch.autocast("tpu")`` fails with "Could not run ... 'Autocasttpu'".
Ops not named here fall through to the next key, as on CUDA. Like CUDA: float64 tensors are never
cast, ``lower`` ops run in the autocast dtype, ``fp32`` ops in float32, ``fp32_unless_dtype`` ops get
``dtype=float32`` unless the caller passed one, ``promote`` ops run in the widest input type.
The default autocast dtype is bfloat16 (TPUs' native low precision) instead of CUDA's float16.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_KEYS = torch._C.DispatchKeySet(_KEY)

LOWER = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    "norm.Scalar", "norm.ScalarOpt_dim",
)
FP32_UNLESS_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "scatter_add", "tensordot", "cat", "stack",
)
BANNED = ("binary_cross_entropy",)


def _eligible(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "tpu"
        and value.is_floating_point()
        and value.dtype != torch.float64
    )


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _eligible(value) and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, (list, tuple)) and any(_eligible(v) for v in value):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _tensors(args: tuple, kwargs: dict):
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from (v for v in value if _eligible(v))
        elif _eligible(value):
            yield value


def _run(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    with torch._C._ExcludeDispatchKeyGuard(_KEYS):
        return op(*args, **kwargs)


def _casting_kernel(op: torch._ops.OpOverload, target: Callable[[tuple, dict], torch.dtype | None]):
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = target(args, kwargs)
        if dtype is not None:
            args = tuple(_cast(a, dtype) for a in args)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        return _run(op, args, kwargs)

    return kernel


def _lower(args: tuple, kwargs: dict) -> torch.dtype:
    return torch.get_autocast_dtype("tpu")


def _fp32(args: tuple, kwargs: dict) -> torch.dtype:
    return torch.float32


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    widest = None
    for tensor in _tensors(args, kwargs):
        widest = tensor.dtype if widest is None else torch.promote_types(widest, tensor.dtype)
    return widest


def _fp32_unless_dtype_kernel(op: torch._ops.OpOverload):
    position = [a.name for a in op._schema.arguments].index("dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        given = kwargs.get("dtype", args[position] if len(args) > position else None)
        if given is None and any(True for _ in _tensors(args[:1], {})):
            if len(args) > position:
                args = (*args[:position], torch.float32, *args[position + 1:])
            else:
                kwargs = {**kwargs, "dtype": torch.float32}
        return _run(op, args, kwargs)

    return kernel


def _banned_kernel(op: torch._ops.OpOverload):
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{op.name()} and torch.nn.BCELoss are unsafe to autocast. Many models use a sigmoid layer right "
            "before the binary cross entropy layer. In this case, combine the two layers using "
            "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss instead, "
            "which are safe to autocast."
        )

    return kernel


def _resolve(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


_libraries: list[torch.library.Library] = []


def install() -> None:
    """Registers the fallthrough and the per-op policies (once, from :func:`registration.register`)."""
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    library = torch.library.Library("aten", "IMPL")
    for names, make in (
        (LOWER, lambda op: _casting_kernel(op, _lower)),
        (FP32, lambda op: _casting_kernel(op, _fp32)),
        (PROMOTE, lambda op: _casting_kernel(op, _widest)),
        (FP32_UNLESS_DTYPE, _fp32_unless_dtype_kernel),
        (BANNED, _banned_kernel),
    ):
        for name in names:
            op = _resolve(name)
            library.impl(op, make(op), "AutocastPrivateUse1")
    _libraries.extend((fallthrough, library))
    _default_to_bfloat16()


_chosen = threading.local()


def _default_to_bfloat16() -> None:
    """Makes bfloat16 the tpu autocast dtype in every thread, not just the importing one.

    torch keeps the autocast dtype per thread, starting at float16 for PrivateUse1; a thread that
    never chose one (``torch.set_autocast_dtype``, or ``torch.autocast(dtype=...)``) gets bfloat16.
    """
    get_dtype, set_dtype = torch.get_autocast_dtype, torch.set_autocast_dtype

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        if device_type == "tpu" and not getattr(_chosen, "tpu", False):
            return torch.bfloat16
        return get_dtype(device_type)

    def set_autocast_dtype(device_type: str, dtype: torch.dtype) -> None:
        if device_type == "tpu":
            _chosen.tpu = True
        set_dtype(device_type, dtype)

    get_autocast_dtype.__doc__, set_autocast_dtype.__doc__ = get_dtype.__doc__, set_dtype.__doc__
    torch.get_autocast_dtype, torch.set_autocast_dtype = get_autocast_dtype, set_autocast_dtype
