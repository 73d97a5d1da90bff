"""A training step of a tiny Llama: torch CPU eager, tpu eager, tpu compiled and a hand-written JAX step, side by side.

LlamaForCausalLM (hidden 256, 4 layers, 4 heads, intermediate 688, vocab 1024), built from a config
(no downloads), a batch of (1, 64) tokens that are also the labels. A step is the forward with the LM
loss, the backward and one ``torch.optim.AdamW`` step; every variant starts from the same weights and
trains its own copy. Each timing is the best of several steps after a warm-up (which compiles: every op
once in eager mode, the forward and backward graphs once with ``torch.compile(backend="tpu")``, and in the
last tpu variant ``optimizer.step`` too; in the others it runs eagerly), and ends with the loss on the host
and the device idle, so queued work (the parameter updates) is counted. The JAX step (jax_llama.py's model,
``jax.value_and_grad`` and AdamW with torch's settings, one ``jax.jit`` with the state donated) is the engine's
own ceiling: the issue's goal for the compiled tpu step is at least 0.9x its speed.

    python benchmarks/training_step.py [--repeats 10]
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import torch
from tiny_llama import best_milliseconds, print_table, repeats_from_command_line, tiny_llama

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
import jax_llama
from _report import report


def step_milliseconds(model: torch.nn.Module, run: Callable, input_ids: torch.Tensor, repeats: int,
                      compiled_optimizer: bool = False) -> float:
    """The fastest of ``repeats`` training steps of ``model`` (called through ``run``; the optimizer's step
    compiled too if ``compiled_optimizer``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer_step = torch.compile(optimizer.step, backend="tpu") if compiled_optimizer else optimizer.step

    def step() -> None:
        loss = run(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer_step()
        optimizer.zero_grad()
        loss.item()
        if input_ids.device.type == "tpu":
            torch.tpu.synchronize()

    return best_milliseconds(step, repeats)


# torch.optim.AdamW's defaults, and the benchmark's learning rate
LEARNING_RATE, BETAS, EPSILON, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 1e-2


def jax_loss(config: tuple, params: dict, tokens):
    """The causal LM loss of ``tokens`` (its own labels), as transformers computes it."""
    positions = jnp.arange(tokens.shape[1])
    cos, sin = jax_llama.rotary(config, positions)
    causal = positions[None, :] <= positions[:, None]

    def layer(x, w):
        return jax_llama.layer(config, w, x, cos, sin, causal)[0], None

    x, _ = jax.lax.scan(layer, params["embed"][tokens], params["layers"])
    logits = jax_llama.rms_norm(x, params["norm"], config[3]) @ params["lm_head"]
    log_probabilities = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probabilities, tokens[:, 1:, None], axis=-1))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2, 3))
def jax_training_step(config: tuple, params: dict, first_moments: dict, second_moments: dict, count, tokens):
    """The loss, then AdamW's update of the parameters and moments, as ``torch.optim.AdamW`` makes it."""
    loss, grads = jax.value_and_grad(functools.partial(jax_loss, config))(params, tokens)
    count = count + 1
    (beta1, beta2), tree = BETAS, jax.tree_util.tree_map
    first_moments = tree(lambda m, g: beta1 * m + (1 - beta1) * g, first_moments, grads)
    second_moments = tree(lambda v, g: beta2 * v + (1 - beta2) * g * g, second_moments, grads)
    step_size, correction = LEARNING_RATE / (1 - beta1 ** count), jnp.sqrt(1 - beta2 ** count)

    def update(p, m, v):
        return p * (1 - LEARNING_RATE * WEIGHT_DECAY) - step_size * m / (jnp.sqrt(v) / correction + EPSILON)

    params = tree(update, params, first_moments, second_moments)
    return params, first_moments, second_moments, count, loss


def jax_step_milliseconds(model: torch.nn.Module, input_ids: torch.Tensor, repeats: int) -> tuple[float, float]:
    """The fastest of ``repeats`` JAX training steps of ``model``'s weights, and its first step's loss."""
    config, params = jax_llama.config_of(model), jax_llama.weights_of(model)
    zeros = functools.partial(jax.tree_util.tree_map, jnp.zeros_like)
    state = [params, zeros(params), zeros(params), jnp.zeros((), jnp.float32)]
    tokens, losses = jnp.asarray(input_ids.numpy()), []

    def step() -> None:
        *state[:], loss = jax_training_step(config, *state, tokens)
        losses.append(float(loss))

    return best_milliseconds(step, repeats), losses[0]


def main() -> None:
    repeats = repeats_from_command_line(__doc__.splitlines()[0])
    model, input_ids = tiny_llama()
    model.train()
    model_at_start = copy.deepcopy(model)
    with torch.no_grad():
        first_loss = float(model(input_ids, labels=input_ids).loss)
    tpu_ids = input_ids.to("tpu")
    eager_model = copy.deepcopy(model).to("tpu")
    compiled_model = copy.deepcopy(model).to("tpu")
    all_compiled_model = copy.deepcopy(model).to("tpu")

    cpu = step_milliseconds(model, model, input_ids, repeats)
    eager = step_milliseconds(eager_model, eager_model, tpu_ids, repeats)
    compiled = step_milliseconds(compiled_model, torch.compile(compiled_model, backend="tpu"), tpu_ids, repeats)
    all_compiled = step_milliseconds(all_compiled_model, torch.compile(all_compiled_model, backend="tpu"), tpu_ids,
                                     repeats, compiled_optimizer=True)
    hand_written, jax_first_loss = jax_step_milliseconds(model_at_start, input_ids, repeats)
    print(f"first step's loss: torch cpu {first_loss:.6f}, jax {jax_first_loss:.6f}")
    print_table("Tiny Llama training step (forward, backward, AdamW; hidden 256, 4 layers, seq 64)", "step",
                [("torch cpu eager", cpu), ("tpu eager", eager), ("tpu compiled", compiled),
                 ("+ compiled AdamW", all_compiled), ("pure jax", hand_written)])
    for name, milliseconds in (("tpu compiled", compiled), ("tpu compiled, compiled AdamW", all_compiled)):
        print(f"{name} / pure jax speed: {hand_written / milliseconds:.2f}x (goal >= 0.9x)")
        report(f"training step speed, {name} / pure jax", hand_written / milliseconds, "x",
               "a hand-written jax.jit step (goal >= 0.9x)")


if __name__ == "__main__":
    main()
