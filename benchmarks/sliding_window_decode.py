"""Greedy decoding and beam search of a model with sliding-window layers: tpu's one program against transformers'
loop on tpu and against the CPU, in one process.

Gemma2ForCausalLM of decode.py's size (hidden 512, 4 layers alternating sliding-window and full attention, 8
heads, 2 kv heads, intermediate 1376, vocab 8192, float32), a window of 32 positions, built from a config (random
weights, no downloads); a 32-token prompt and 64 new tokens, so the window fills during the prefill and slides
at every decode step. Variants, each warmed up once (compiling what it compiles), then timed as the best of
``--repeats`` runs, alternated:

- ``torch cpu eager``, ``torch cpu static``: ``generate`` on the CPU with the default (dynamic) cache and with
  ``cache_implementation="static"``;
- ``tpu``: static cache, every decode step in one program (:mod:`hf_tpu.compile.sliding_window`);
- ``tpu stepwise``: ``HF_TPU_STEPWISE_DECODE=1``, transformers' own loop, a compiled step per token (fused mode);
- ``torch cpu beams``, ``tpu beams``, ``tpu beams stepwise``: the same with 4 beams.

    python benchmarks/sliding_window_decode.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy

import torch
from decode import BEAMS, NEW_TOKENS, decoding_model, hf_generate, in_eager_mode, stepwise, timed_together
from transformers import Gemma2Config, Gemma2ForCausalLM

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report

WINDOW = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model = decoding_model(Gemma2ForCausalLM, Gemma2Config(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1376, vocab_size=8192, max_position_embeddings=256, sliding_window=WINDOW,
    ))
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    tpu_model, tpu_prompt = copy.deepcopy(model).to("tpu"), prompt.to("tpu")
    static = dict(cache_implementation="static")
    runs = {
        "torch cpu eager": lambda: hf_generate(model, prompt),
        "torch cpu static": lambda: hf_generate(model, prompt, disable_compile=True, **static),
        "tpu": in_eager_mode("strict", lambda: hf_generate(tpu_model, tpu_prompt, **static)),
        "tpu stepwise": stepwise(in_eager_mode("fused", lambda: hf_generate(tpu_model, tpu_prompt, **static))),
        "torch cpu beams": lambda: hf_generate(model, prompt, **BEAMS),
        "tpu beams": in_eager_mode("strict", lambda: hf_generate(tpu_model, tpu_prompt, **static, **BEAMS)),
        "tpu beams stepwise": stepwise(in_eager_mode(
            "fused", lambda: hf_generate(tpu_model, tpu_prompt, **static, **BEAMS))),
    }
    loops = torch.tpu.compile_stats()["decode_loops"]
    results = timed_together(runs, args.repeats)
    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}")
    print(f"Decode of a Gemma 2 with a window of {WINDOW} (hidden 512, 4 layers), prompt 32, {NEW_TOKENS} new tokens "
          f"(best of {args.repeats})\n")
    print(f"{'variant':<19} {'tokens/s':>9} {'same tokens*':>13}")
    for name, (seconds, tokens) in results.items():
        reference = results["torch cpu beams" if "beams" in name else "torch cpu eager"][1]
        print(f"{name:<19} {NEW_TOKENS / seconds:9.1f} {str(tokens == reference):>13}")
    print("* as cpu eager's; the beam runs' as cpu beams'\n")
    rate = {name: NEW_TOKENS / seconds for name, (seconds, _) in results.items()}
    best_cpu = max(rate["torch cpu eager"], rate["torch cpu static"])
    figures = [("tpu / tpu stepwise", rate["tpu"] / rate["tpu stepwise"], "transformers' loop on tpu"),
               ("tpu / best torch cpu path", rate["tpu"] / best_cpu, "fastest torch CPU generate"),
               ("tpu beams / tpu beams stepwise", rate["tpu beams"] / rate["tpu beams stepwise"],
                "transformers' beam search loop on tpu"),
               ("tpu beams / torch cpu beams", rate["tpu beams"] / rate["torch cpu beams"], "beam search on torch CPU")]
    for name, value, compared_with in figures:
        print(f"sliding-window decode tokens/s, {name}: {value:.2f}x")
        report(f"sliding-window decode tokens/s, {name}", value, "x", compared_with)
    print(f"one-program runs: {torch.tpu.compile_stats()['decode_loops'] - loops}")


if __name__ == "__main__":
    main()
