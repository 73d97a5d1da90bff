"""A Llama written by hand in JAX: the reference the decode and training-step benchmarks hold the tpu device to.

The weights are a transformers ``LlamaForCausalLM``'s (its layers stacked, for ``jax.lax.scan``); the layer is
Llama's (RMSNorm, rotary embedding, grouped-query attention, SwiGLU), in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from transformers import LlamaForCausalLM


def weights_of(model: LlamaForCausalLM) -> dict:
    def array(tensor: torch.Tensor) -> jax.Array:
        return jnp.asarray(tensor.detach().numpy())

    layers = model.model.layers
    stacked = {
        name: jnp.stack([array(getter(block)) for block in layers])
        for name, getter in {
            "input_norm": lambda layer: layer.input_layernorm.weight,
            "q": lambda layer: layer.self_attn.q_proj.weight.T,
            "k": lambda layer: layer.self_attn.k_proj.weight.T,
            "v": lambda layer: layer.self_attn.v_proj.weight.T,
            "o": lambda layer: layer.self_attn.o_proj.weight.T,
            "post_norm": lambda layer: layer.post_attention_layernorm.weight,
            "gate": lambda layer: layer.mlp.gate_proj.weight.T,
            "up": lambda layer: layer.mlp.up_proj.weight.T,
            "down": lambda layer: layer.mlp.down_proj.weight.T,
        }.items()
    }
    return {
        "embed": array(model.model.embed_tokens.weight), "layers": stacked,
        "norm": array(model.model.norm.weight), "lm_head": array(model.lm_head.weight.T),
    }


def config_of(model: LlamaForCausalLM) -> tuple:
    """The static settings the functions here take: heads, key-value heads, head size, RMSNorm epsilon, RoPE
    theta."""
    config = model.config
    return (config.num_attention_heads, config.num_key_value_heads, config.hidden_size // config.num_attention_heads,
            config.rms_norm_eps, config.rope_parameters["rope_theta"])


def rms_norm(x, weight, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rotary(config: tuple, positions):
    """The cos and sin of the rotary embedding at ``positions``."""
    _, _, head_dim, _, theta = config
    inverse = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions[:, None].astype(jnp.float32) * inverse[None, :]
    return tuple(jnp.concatenate([f(angles)] * 2, axis=-1) for f in (jnp.cos, jnp.sin))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def layer(config: tuple, w: dict, x, cos, sin, visible, cache: tuple | None = None, start=0):
    """One decoder layer on ``x`` (batch, length, hidden): its output, and its keys and values (``cache``'s, with
    this call's written at ``start``, if given). ``visible[t, s]``: whether position ``t`` attends to ``s``."""
    heads, kv_heads, head_dim, eps, _ = config
    batch, length, _ = x.shape
    h = rms_norm(x, w["input_norm"], eps)
    q = (h @ w["q"]).reshape(batch, length, heads, head_dim).transpose(0, 2, 1, 3)
    k = (h @ w["k"]).reshape(batch, length, kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = (h @ w["v"]).reshape(batch, length, kv_heads, head_dim).transpose(0, 2, 1, 3)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if cache is not None:
        k = jax.lax.dynamic_update_slice(cache[0], k, (0, 0, start, 0))
        v = jax.lax.dynamic_update_slice(cache[1], v, (0, 0, start, 0))
    q = q.reshape(batch, kv_heads, heads // kv_heads, length, head_dim)
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
    scores = jnp.where(visible, scores, -jnp.inf)
    attended = jnp.einsum("bkgts,bksd->bkgtd", jax.nn.softmax(scores, axis=-1), v)
    attended = attended.reshape(batch, heads, length, head_dim).transpose(0, 2, 1, 3)
    x = x + attended.reshape(batch, length, heads * head_dim) @ w["o"]
    h = rms_norm(x, w["post_norm"], eps)
    x = x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
    return x, (k, v)
