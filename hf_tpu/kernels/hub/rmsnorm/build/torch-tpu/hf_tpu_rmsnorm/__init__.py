"""hf_tpu's RMSNorm kernel repository (tpu build): transformers' ``LlamaRMSNorm`` on the Pallas ``rms_norm``
kernel. Needs hf_tpu (the op, and the ``tpu`` device it runs on)."""

from hf_tpu.kernels.hub.ops import rms_norm

from . import layers

__all__ = ["layers", "rms_norm"]
