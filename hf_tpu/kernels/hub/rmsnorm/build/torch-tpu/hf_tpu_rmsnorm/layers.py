"""Layers for ``kernels``' layer mapping: stateless, reading the replaced module's state."""

import torch

from hf_tpu.kernels.hub.ops import rms_norm


class RMSNorm(torch.nn.Module):
    """``LlamaRMSNorm.forward``: ``weight * (x * rsqrt(mean(x**2, -1) + eps)).to(x.dtype)``, statistics in
    float32. Replaces the forward of transformers' ``@use_kernel_forward_from_hub("RMSNorm")`` classes."""

    weight: torch.Tensor
    variance_epsilon: float

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)
