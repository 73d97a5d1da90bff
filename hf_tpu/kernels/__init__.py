"""Custom kernels for the ``tpu`` device (not implemented yet).

This package will hold Pallas kernels (attention, RMSNorm, rotary embeddings, fused optimizers)
written with ``jax.experimental.pallas`` for TPUs, exposed as PyTorch ops on tpu tensors, and the
loader that lets the Hugging Face ``kernels`` library find TPU builds of Hub kernels for this device
(``kernels`` picks TPU builds when ``torch.backends.tpu`` exists, which hf_tpu sets).
"""
