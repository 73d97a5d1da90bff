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
- ``torch cpu beams``, ``tpu beams`` and ``tpu beams stepwise``: beam search (``BEAMS``: 4 beams), on the CPU
  (dynamic cache, eager), on tpu from a static cache with every step after the first token in one program
  (:mod:`hf_tpu.compile.beam_loop`), and on tpu through transformers' own loop; ``torch cpu beams scores`` and
  ``tpu beams scores`` the same with each step's scores returned (``BEAM_SCORES``: ``output_scores=True``);
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
import jax_llama
from _report import report

NEW_TOKENS = 64


def decoding_model(model_class: type, config) -> torch.nn.Module:
    """``model_class(config)`` from seed 0, set to decode all ``NEW_TOKENS`` of every call."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.generation_config.eos_token_id = None  # random weights: always decode all 64 tokens
    model.generation_config.pad_token_id = 0
    return model


def build_model() -> LlamaForCausalLM:
    return decoding_model(LlamaForCausalLM, LlamaConfig(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1376, vocab_size=8192, max_position_embeddings=256, tie_word_embeddings=False,
    ))


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
BEAMS = dict(num_beams=4)
BEAM_SCORES = dict(BEAMS, return_dict_in_generate=True, output_scores=True)
# greedy decoding with the settings that read the tokens so far and their count
SETTINGS = dict(min_new_tokens=NEW_TOKENS, no_repeat_ngram_size=3, repetition_penalty=1.1)


def hf_generate(model, prompt: torch.Tensor, **options) -> list[int]:
    """The new tokens of a greedy ``generate`` (with ``SAMPLING`` among ``options``: sampled, from seed 0)."""
    if options.get("do_sample"):
        torch.manual_seed(0)
    with torch.no_grad():
        output = model.generate(prompt, max_new_tokens=NEW_TOKENS, **{"do_sample": False, **options})
    if options.get("return_dict_in_generate"):
        output = output.sequences
    tokens = output[0, prompt.shape[1]:].cpu().tolist()
    if prompt.device.type == "tpu":  # all the work generate queued is done before the clock stops (or JAX's run starts)
        torch.tpu.synchronize()
    return tokens


# --- the pure-JAX reference decoder ----------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(3, 4))
def jax_forward(config: tuple, weights: dict, tokens, cache_k, cache_v, start):
    """Logits of the last position and the updated caches, for ``tokens`` at positions ``start``..."""
    positions = start + jnp.arange(tokens.shape[1])
    cos, sin = jax_llama.rotary(config, positions)
    visible = jnp.arange(cache_k.shape[3])[None, :] <= positions[:, None]

    def layer(x, inputs):
        w, layer_k, layer_v = inputs
        return jax_llama.layer(config, w, x, cos, sin, visible, (layer_k, layer_v), start)

    x, (cache_k, cache_v) = jax.lax.scan(layer, weights["embed"][tokens], (weights["layers"], cache_k, cache_v))
    logits = jax_llama.rms_norm(x[:, -1], weights["norm"], config[3]) @ weights["lm_head"]
    return logits, cache_k, cache_v


def jax_generate(model: LlamaForCausalLM, weights: dict, prompt: np.ndarray) -> list[int]:
    config = model.config
    static = jax_llama.config_of(model)
    head_dim = static[2]
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
    results["torch cpu beams"] = timed(lambda: hf_generate(model, prompt, **BEAMS), args.repeats)
    results["torch cpu beams scores"] = timed(lambda: hf_generate(model, prompt, **BEAM_SCORES), args.repeats)
    if not args.skip_inductor:
        inductor = CompileConfig(backend="inductor", mode="default", dynamic=False)
        inductor._compile_all_devices = True
        results["torch cpu inductor"] = timed(
            lambda: hf_generate(model, prompt, cache_implementation="static", compile_config=inductor), args.repeats
        )
    weights = jax_llama.weights_of(model)
    tpu_model = copy.deepcopy(model).to("tpu")
    tpu_prompt = prompt.to("tpu")
    # alternated, so that all see the same load on a shared machine: their ratios are the figures that matter
    run_jax = functools.partial(jax_generate, model, weights, prompt.numpy())
    run_tpu = functools.partial(hf_generate, tpu_model, tpu_prompt, cache_implementation="static")
    run_sampled = functools.partial(run_tpu, **SAMPLING)
    run_settings = functools.partial(run_tpu, **SETTINGS)
    run_beams = functools.partial(run_tpu, **BEAMS)
    alternated = {"pure jax": run_jax, "tpu": in_eager_mode("strict", run_tpu),
                  "tpu fused": in_eager_mode("fused", run_tpu),
                  "tpu stepwise": stepwise(in_eager_mode("fused", run_tpu)),
                  "tpu sampled": in_eager_mode("strict", run_sampled),
                  "tpu sampled stepwise": stepwise(in_eager_mode("fused", run_sampled)),
                  "tpu settings": in_eager_mode("strict", run_settings),
                  "tpu settings stepwise": stepwise(in_eager_mode("fused", run_settings)),
                  "tpu beams": in_eager_mode("strict", run_beams),
                  "tpu beams scores": in_eager_mode("strict", functools.partial(run_tpu, **BEAM_SCORES)),
                  "tpu beams stepwise": stepwise(in_eager_mode("fused", run_beams))}
    results.update(timed_together(alternated, args.repeats))
    host = {name: host_milliseconds_per_token(run) for name, run in alternated.items()}

    reference_tokens = results["torch cpu eager"][1]
    settings_tokens = hf_generate(model, prompt, **SETTINGS)
    cpu_eager_rate = NEW_TOKENS / results["torch cpu eager"][0]
    best_cpu = max(NEW_TOKENS / results[name][0] for name in results
                   if name.startswith("torch cpu") and "beams" not in name)
    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}")
    print(f"Decode (greedy; sampled where named), hidden 512, 4 layers, prompt 32, {NEW_TOKENS} new tokens "
          f"(best of {args.repeats})\n")
    print(f"{'variant':<21} {'tokens/s':>9} {'/ cpu eager':>12} {'same tokens*':>13}")
    for name, (seconds, tokens) in results.items():
        rate = NEW_TOKENS / seconds
        reference = results["tpu sampled stepwise"][1] if name.startswith("tpu sampled") else \
            settings_tokens if name.startswith("tpu settings") else \
            results["torch cpu beams"][1] if "beams" in name else reference_tokens
        print(f"{name:<21} {rate:9.1f} {rate / cpu_eager_rate:11.2f}x {str(tokens == reference):>13}")
    print("* as cpu eager's; the sampled runs' as tpu sampled stepwise's; the settings runs' as cpu eager's with "
          "them; the beam runs' as cpu beams'\n")
    for name in ("tpu", "tpu fused", "tpu stepwise", "tpu sampled", "tpu sampled stepwise", "tpu settings",
                 "tpu settings stepwise"):
        rate = NEW_TOKENS / results[name][0]
        versus_jax = rate * results["pure jax"][0] / NEW_TOKENS
        print(f"{name} / best torch cpu path: {rate / best_cpu:.2f}x; {name} / pure jax: {versus_jax:.2f}x")
        report(f"tokens/s, {name} / pure jax", versus_jax, "x", "hand-written JAX decoder (goal >= 0.9x)")
        report(f"tokens/s, {name} / best torch cpu path", rate / best_cpu, "x", "fastest torch CPU generate")
    settings_rate = results["tpu"][0] / results["tpu settings"][0]
    print(f"tpu settings / tpu plain greedy: {settings_rate:.2f}x")
    report("tokens/s, tpu settings / tpu plain greedy", settings_rate, "x",
           "greedy with min_new_tokens, no_repeat_ngram_size and repetition_penalty (goal: 1x)")
    beams = {name: NEW_TOKENS / results[name][0] for name in ("torch cpu beams", "tpu beams", "tpu beams stepwise")}
    print(f"beam search (4 beams): tpu one program / cpu {beams['tpu beams'] / beams['torch cpu beams']:.2f}x, "
          f"/ tpu stepwise {beams['tpu beams'] / beams['tpu beams stepwise']:.2f}x")
    report("tokens/s, tpu beams / torch cpu beams", beams["tpu beams"] / beams["torch cpu beams"], "x",
           "beam search (4 beams) on torch CPU, eager")
    report("tokens/s, tpu beams / tpu beams stepwise", beams["tpu beams"] / beams["tpu beams stepwise"], "x",
           "transformers' beam search loop on tpu, a compiled step per token")
    scored = results["torch cpu beams scores"][0] / results["tpu beams scores"][0]
    print(f"beam search with output_scores: tpu one program / cpu {scored:.2f}x")
    report("tokens/s, tpu beams scores / torch cpu beams scores", scored, "x",
           "beam search (4 beams) with output_scores on torch CPU, eager")
    print("host CPU per new token (main thread): " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in host.items()))
    print(f"graph mode: {torch.tpu.compile_stats()}")
    if args.profile:
        print("\ncProfile of one tpu stepwise generate, CPU ms of the main thread per new token (profiling inflates "
              "Python):")
        for name, milliseconds in profile_breakdown(stepwise(run_tpu)).items():
            print(f"  {name:<28} {milliseconds:7.2f}")


if __name__ == "__main__":
    main()
