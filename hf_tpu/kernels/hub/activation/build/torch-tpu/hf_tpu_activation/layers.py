"""Layers for ``kernels``' layer mapping, one per activation that transformers decorates with
``@use_kernel_forward_from_hub`` (named after its layer name), each computing that module's formula."""

import torch

from hf_tpu.kernels.hub.ops import activation


class SiLU(torch.nn.Module):
    """``SiLUActivation``: ``x * sigmoid(x)``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return activation(input, "silu")


class GeLU(torch.nn.Module):
    """``GELUActivation``: ``0.5 * x * (1 + erf(x / sqrt(2)))``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return activation(input, "gelu")


class GeluTanh(torch.nn.Module):
    """``GELUTanh``: ``gelu(x, approximate="tanh")``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return activation(input, "gelu_tanh")


class NewGELU(torch.nn.Module):
    """``NewGELUActivation``: ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return activation(input, "gelu_tanh")


class FastGELU(torch.nn.Module):
    """``FastGELUActivation``: ``0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x**2)))``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return activation(input, "fast_gelu")


class QuickGELU(torch.nn.Module):
    """``QuickGELUActivation``: ``x * sigmoid(1.702 * x)``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return activation(input, "quick_gelu")
