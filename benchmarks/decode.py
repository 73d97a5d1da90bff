"""Greedy decoding of a small Llama: tpu (static cache, generate's auto-compile) next to the CPU
paths and a hand-written pure-JAX decoder, in one process; and sampling on tpu.

LlamaForCausalLM (hidden 512, 4 layers, 8 heads, 2 kv heads, intermediate 1376, vocab 8192, float32),
built from a config (random weights, no downloads); a 32-token prompt and 64 new tokens, greedy.
Each variant is warmed up once (compiling what it compiles), then timed as the best of
``--repeats`` runs (the pure-JAX and tpu runs alternated, so that their ratios see one load); tokens/s
counts the 64 new tokens over the whole ``generate`` call (prefill included). Variants:

- ``torch cpu eager``: ``generate`` with the default (dynamic) cache;
- ``torch cpu static``: ``cache_implementation="static"``, eager;
- ``torch cpu inductor``: static cache with the decode step compiled by Inductor;
- ``pure jax``: the same weights in a hand-written JAX decoder (layers under ``lax.scan``, donated
  cache, one jitted prefill and one jitted decode step), the bar our lowering should reach;
- ``tpu``: the model on the tpu device, ``cache_implementation="static"``: the prefill eager (strict mode),
  then every decode step in one program (:mod:`hf_tpu.compile.decode_loop`);
- ``tpu fused``: the same in fused eager mode (``torch.tpu.set_eager_mode("fused")``);
- ``tpu stepwise``: ``HF_TPU_STEPWISE_DECODE=1``, transformers' own loop: each decode step compiled by
  generate through the ``"tpu"`` backend, generate's eager ops between steps (fused mode);
- ``tpu sampled`` and ``tpu sampled stepwise``: the ``tpu`` and ``tpu stepwise`` runs sampling instead
  with Qwen2.5-Instruct's generation settings (``do_sample=True, top_k=20, top_p=0.8, temperature=0.7,
  repetition_penalty=1.05``, seed 0): their tokens are compared with each other's (the same draws), not with
  the CPU's.

A tpu run's clock stops once all the work it queued is done (``torch.tpu.synchronize()``), so that none of it
runs into the next variant's time.

After the table, the main thread's CPU time per new token of the pure-JAX and tpu runs: the host's own work
per token, which the device hides here (XLA's CPU code takes longer per step) but which bounds tokens/s on
a chip whose step is shorter than it.

``--profile`` adds a per-token breakdown of a tpu stepwise run (strict mode) from cProfile, in the main
thread's CPU time (less noisy than wall time on a loaded machine): the XLA program's launch, graph mode's
Python around it, Dynamo and AOTAutograd around that, the eager tpu ops (the prefill's and generate's
bookkeeping), host reads, and the rest of generate's Python.

    python benchmarks/decode.py [--repeats 3] [--skip-inductor] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import os
import pstats
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report

NEW_TOKENS = 64


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1376, vocab_size=8192, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # random weights: always decode all 64 tokens
    model.generation_config.pad_token_id = 0
    return model


def timed(run, repeats: int) -> tuple[float, list[int]]:
    """(best seconds, tokens) of ``run()`` after one warm-up call."""
    tokens = run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        best = min(best, time.perf_counter() - start)
    return best, tokens


def host_milliseconds_per_token(run) -> float:
    """The calling thread's CPU milliseconds per new token of one ``run()`` (waits for the device excluded)."""
    start = time.thread_time()
    run()
    return (time.thread_time() - start) * 1e3 / NEW_TOKENS


def timed_together(runs: dict, repeats: int) -> dict[str, tuple[float, list[int]]]:
    """:func:`timed` for several runs, alternated (after one warm-up call of each)."""
    results = {name: [float("inf"), run()] for name, run in runs.items()}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            results[name][1] = run()
            results[name][0] = min(results[name][0], time.perf_counter() - start)
    return {name: tuple(result) for name, result in results.items()}


def stepwise(run):
    """``run`` with ``HF_TPU_STEPWISE_DECODE=1``: transformers' decoding loop, a compiled step per token."""

    def run_stepwise():
        os.environ["HF_TPU_STEPWISE_DECODE"] = "1"
        try:
            return run()
        finally:
            del os.environ["HF_TPU_STEPWISE_DECODE"]

    return run_stepwise


def in_eager_mode(mode: str, run):
    """``run`` with tpu eager ops in ``mode`` (strict or fused), the mode set back after it."""

    def run_in_mode():
        torch.tpu.set_eager_mode(mode)
        try:
            return run()
        finally:
            torch.tpu.set_eager_mode("strict")

    return run_in_mode


SAMPLING = dict(do_sample=True, top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.05)


def hf_generate(model, prompt: torch.Tensor, **options) -> list[int]:
    """The new tokens of a greedy ``generate`` (with ``SAMPLING`` among ``options``: sampled, from seed 0)."""
    if options.get("do_sample"):
        torch.manual_seed(0)
    with torch.no_grad():
        output = model.generate(prompt, max_new_tokens=NEW_TOKENS, **{"do_sample": False, **options})
    tokens = output[0, prompt.shape[1]:].cpu().tolist()
    if prompt.device.type == "tpu":  # all the work generate queued is done before the clock stops (or JAX's run starts)
        torch.tpu.synchronize()
    return tokens


# --- the pure-JAX reference decoder ----------------------------------------------------------------


def jax_weights(model: LlamaForCausalLM) -> dict:
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


def _rms_norm(x, weight, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(3, 4))
def jax_forward(config: tuple, weights: dict, tokens, cache_k, cache_v, start):
    """Logits of the last position and the updated caches, for ``tokens`` at positions ``start``..."""
    heads, kv_heads, head_dim, eps, theta = config
    batch, length = tokens.shape
    positions = start + jnp.arange(length)
    inverse = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions[:, None].astype(jnp.float32) * inverse[None, :]
    cos, sin = (jnp.concatenate([f(angles)] * 2, axis=-1) for f in (jnp.cos, jnp.sin))
    visible = jnp.arange(cache_k.shape[3])[None, :] <= positions[:, None]
    x = weights["embed"][tokens]

    def layer(x, inputs):
        w, layer_k, layer_v = inputs
        h = _rms_norm(x, w["input_norm"], eps)
        q = (h @ w["q"]).reshape(batch, length, heads, head_dim).transpose(0, 2, 1, 3)
        k = (h @ w["k"]).reshape(batch, length, kv_heads, head_dim).transpose(0, 2, 1, 3)
        v = (h @ w["v"]).reshape(batch, length, kv_heads, head_dim).transpose(0, 2, 1, 3)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        layer_k = jax.lax.dynamic_update_slice(layer_k, k, (0, 0, start, 0))
        layer_v = jax.lax.dynamic_update_slice(layer_v, v, (0, 0, start, 0))
        q = q.reshape(batch, kv_heads, heads // kv_heads, length, head_dim)
        scores = jnp.einsum("bkgtd,bksd->bkgts", q, layer_k) / jnp.sqrt(head_dim).astype(q.dtype)
        scores = jnp.where(visible, scores, -jnp.inf)
        attended = jnp.einsum("bkgts,bksd->bkgtd", jax.nn.softmax(scores, axis=-1), layer_v)
        attended = attended.reshape(batch, heads, length, head_dim).transpose(0, 2, 1, 3)
        x = x + attended.reshape(batch, length, heads * head_dim) @ w["o"]
        h = _rms_norm(x, w["post_norm"], eps)
        x = x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
        return x, (layer_k, layer_v)

    x, (cache_k, cache_v) = jax.lax.scan(layer, x, (weights["layers"], cache_k, cache_v))
    logits = _rms_norm(x[:, -1], weights["norm"], eps) @ weights["lm_head"]
    return logits, cache_k, cache_v


def jax_generate(model: LlamaForCausalLM, weights: dict, prompt: np.ndarray) -> list[int]:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    static = (config.num_attention_heads, config.num_key_value_heads, head_dim, config.rms_norm_eps,
              config.rope_parameters["rope_theta"])
    shape = (config.num_hidden_layers, 1, config.num_key_value_heads, prompt.shape[1] + NEW_TOKENS, head_dim)
    cache_k, cache_v = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
    logits, cache_k, cache_v = jax_forward(static, weights, jnp.asarray(prompt), cache_k, cache_v, 0)
    tokens = [jnp.argmax(logits, axis=-1)]
    for step in range(NEW_TOKENS - 1):
        logits, cache_k, cache_v = jax_forward(
            static, weights, tokens[-1][:, None], cache_k, cache_v, prompt.shape[1] + step
        )
        tokens.append(jnp.argmax(logits, axis=-1))
    return [int(t[0]) for t in tokens]


# cProfile entries (file suffix, function) whose cumulative time makes up each part of a decode step
_PARTS = {
    "XLA program": [("jax/_src/stages.py", "__call__")],
    "graph mode (CompiledGraph)": [("hf_tpu/compile/graph_lowering.py", "__call__")],
    "Dynamo + AOTAutograd": [("torch/_dynamo/eval_frame.py", "compile_wrapper")],
    # the op table's kernels and the hand-written ones
    "eager tpu ops (prefill too)": [("hf_tpu/backend/dispatch.py", "run"), ("hf_tpu/backend/guard.py", "kernel")],
    "host reads": [("~", "<built-in method numpy.asarray>")],
    "generate": [("transformers/generation/utils.py", "generate")],
}
# the part each part runs inside of, whose share is its own less the nested part's
_NESTED = {"graph mode (CompiledGraph)": "XLA program", "Dynamo + AOTAutograd": "graph mode (CompiledGraph)",
           "eager tpu ops (prefill too)": "host reads"}


def _cumulative(stats: dict, entries: list[tuple[str, str]]) -> float:
    """Seconds spent in the given functions, counting a call among them from another one of them once."""
    chosen = [key for key in stats if any(key[0].endswith(suffix) and key[2] == fn for suffix, fn in entries)]
    return sum(ct for key in chosen for caller, (_, _, _, ct) in stats[key][4].items() if caller not in chosen)


def profile_breakdown(run) -> dict[str, float]:
    """Milliseconds per new token in each part of one ``run()`` under cProfile (see ``_PARTS``), in CPU time of
    this thread: what other processes take of a loaded machine and waits for the device are left out."""
    profile = cProfile.Profile(time.thread_time)
    profile.enable()
    run()
    profile.disable()
    stats = pstats.Stats(profile).stats
    cumulative = {name: _cumulative(stats, entries) for name, entries in _PARTS.items()}
    parts = {name: cumulative[name] - cumulative.get(_NESTED.get(name), 0.0) for name in _PARTS}
    parts["generate"] -= cumulative["Dynamo + AOTAutograd"] + cumulative["eager tpu ops (prefill too)"]
    parts["total"] = cumulative["generate"]
    return {name: seconds * 1e3 / NEW_TOKENS for name, seconds in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-inductor", action="store_true", help="leave out the (slow to compile) Inductor run")
    parser.add_argument("--profile", action="store_true", help="add a cProfile breakdown of a tpu decode per token")
    args = parser.parse_args()

    model = build_model()
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    results = {}
    results["torch cpu eager"] = timed(lambda: hf_generate(model, prompt), args.repeats)
    results["torch cpu static"] = timed(
        lambda: hf_generate(model, prompt, cache_implementation="static", disable_compile=True), args.repeats
    )
    if not args.skip_inductor:
        inductor = CompileConfig(backend="inductor", mode="default", dynamic=False)
        inductor._compile_all_devices = True
        results["torch cpu inductor"] = timed(
            lambda: hf_generate(model, prompt, cache_implementation="static", compile_config=inductor), args.repeats
        )
    weights = jax_weights(model)
    tpu_model = copy.deepcopy(model).to("tpu")
    tpu_prompt = prompt.to("tpu")
    # alternated, so that all see the same load on a shared machine: their ratios are the figures that matter
    run_jax = functools.partial(jax_generate, model, weights, prompt.numpy())
    run_tpu = functools.partial(hf_generate, tpu_model, tpu_prompt, cache_implementation="static")
    run_sampled = functools.partial(run_tpu, **SAMPLING)
    alternated = {"pure jax": run_jax, "tpu": in_eager_mode("strict", run_tpu),
                  "tpu fused": in_eager_mode("fused", run_tpu),
                  "tpu stepwise": stepwise(in_eager_mode("fused", run_tpu)),
                  "tpu sampled": in_eager_mode("strict", run_sampled),
                  "tpu sampled stepwise": stepwise(in_eager_mode("fused", run_sampled))}
    results.update(timed_together(alternated, args.repeats))
    host = {name: host_milliseconds_per_token(run) for name, run in alternated.items()}

    reference_tokens = results["torch cpu eager"][1]
    cpu_eager_rate = NEW_TOKENS / results["torch cpu eager"][0]
    best_cpu = max(NEW_TOKENS / results[name][0] for name in results if name.startswith("torch cpu"))
    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}")
    print(f"Decode (greedy; sampled where named), hidden 512, 4 layers, prompt 32, {NEW_TOKENS} new tokens "
          f"(best of {args.repeats})\n")
    print(f"{'variant':<21} {'tokens/s':>9} {'/ cpu eager':>12} {'same tokens*':>13}")
    for name, (seconds, tokens) in results.items():
        rate = NEW_TOKENS / seconds
        reference = results["tpu sampled stepwise"][1] if name.startswith("tpu sampled") else reference_tokens
        print(f"{name:<21} {rate:9.1f} {rate / cpu_eager_rate:11.2f}x {str(tokens == reference):>13}")
    print("* as cpu eager's; the sampled runs' as tpu sampled stepwise's\n")
    for name in ("tpu", "tpu fused", "tpu stepwise", "tpu sampled", "tpu sampled stepwise"):
        rate = NEW_TOKENS / results[name][0]
        versus_jax = rate * results["pure jax"][0] / NEW_TOKENS
        print(f"{name} / best torch cpu path: {rate / best_cpu:.2f}x; {name} / pure jax: {versus_jax:.2f}x")
        report(f"tokens/s, {name} / pure jax", versus_jax, "x", "hand-written JAX decoder (goal >= 0.9x)")
        report(f"tokens/s, {name} / best torch cpu path", rate / best_cpu, "x", "fastest torch CPU generate")
    print("host CPU per new token (main thread): " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in host.items()))
    print(f"graph mode: {torch.tpu.compile_stats()}")
    if args.profile:
        print("\ncProfile of one tpu stepwise generate, CPU ms of the main thread per new token (profiling inflates "
              "Python):")
        for name, milliseconds in profile_breakdown(stepwise(run_tpu)).items():
            print(f"  {name:<28} {milliseconds:7.2f}")


if __name__ == "__main__":
    main()
