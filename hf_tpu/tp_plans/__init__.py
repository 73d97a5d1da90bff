"""Tensor parallelism for the ``tpu`` device (not implemented yet).

This package will hold the tensor-parallel plans that spread a model over several chips: how each
layer of a transformers model (``tp_plan="auto"`` style: colwise, rowwise, replicated) maps onto a
JAX device mesh, the sharded arrays that back parameters split across ``tpu:0`` .. ``tpu:N-1``, and
the collectives (all-reduce, all-gather, reduce-scatter) that those layers need, lowered to JAX.

Until then, each tensor lives whole on one chip (see :mod:`hf_tpu.backend.storage`).
"""
