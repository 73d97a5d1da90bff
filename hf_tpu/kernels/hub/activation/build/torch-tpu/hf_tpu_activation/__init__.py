"""hf_tpu's activation kernel repository (tpu build): transformers' hub-kernel activations as one elementwise
JAX op. Needs hf_tpu (the op, and the ``tpu`` device it runs on)."""

from hf_tpu.kernels.hub.ops import activation

from . import layers

__all__ = ["activation", "layers"]
