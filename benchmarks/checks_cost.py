"""What checked indices and integer division cost: tpu with checks on (``HF_TPU_CHECKS=1``, the default)
against checks off (``HF_TPU_CHECKS=0``), side by side in one process, on a tiny Llama eager forward
and on compiled static-cache greedy decode.

Programs are traced per checks mode, so both variants keep their own compiled programs; the variants
alternate (on, off, on, off, ...) and each keeps its best time, so both see the same machine state.
Models are those of ``llama_forward.py`` (hidden 256, 4 layers, seq 64) and ``decode.py`` (hidden 512,
4 layers, 32-token prompt, 64 new tokens). Goal: at most 3% slower with checks on (issue 13).

    python benchmarks/checks_cost.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from hf_tpu.backend import checks

from _report import report
from decode import NEW_TOKENS, build_model, hf_generate


def forward_seconds(model, ids) -> float:
    with torch.no_grad():
        start = time.perf_counter()
        model(ids).logits.cpu()
        return time.perf_counter() - start


def decode_seconds(model, prompt) -> tuple[float, list[int]]:
    start = time.perf_counter()
    tokens = hf_generate(model, prompt, cache_implementation="static")
    return time.perf_counter() - start, tokens


def embedding_microseconds(mode: str, calls: int = 2000) -> float:
    """One checked op on its own: ``F.embedding`` of (1, 64) ids into a (1024, 256) table, per call."""
    checks.set_mode(mode)
    weight = torch.randn(1024, 256, device="tpu")
    ids = torch.randint(0, 1024, (1, 64), device="tpu")
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            torch.nn.functional.embedding(ids, weight)
        torch.tpu.synchronize()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="decode rounds (forwards: 10x as many)")
    args = parser.parse_args()

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1024)
    torch.manual_seed(0)
    forward_model = LlamaForCausalLM(config).eval().to("tpu")
    ids = torch.randint(0, config.vocab_size, (1, 64)).to("tpu")
    decode_model = copy.deepcopy(build_model()).to("tpu")
    prompt = torch.randint(0, decode_model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to("tpu")

    modes = ("deferred", "off")
    forward = {mode: float("inf") for mode in modes}
    decode = {mode: float("inf") for mode in modes}
    tokens = {}
    for mode in modes:  # warm-up: each mode traces and compiles its own programs
        checks.set_mode(mode)
        forward_seconds(forward_model, ids)
        decode_seconds(decode_model, prompt)
    for _ in range(10 * args.rounds):
        for mode in modes:
            checks.set_mode(mode)
            forward[mode] = min(forward[mode], forward_seconds(forward_model, ids))
    for _ in range(args.rounds):
        for mode in modes:
            checks.set_mode(mode)
            seconds, tokens[mode] = decode_seconds(decode_model, prompt)
            decode[mode] = min(decode[mode], seconds)
    embedding = {mode: embedding_microseconds(mode) for mode in modes}
    checks.set_mode("deferred")

    on_rate, off_rate = NEW_TOKENS / decode["deferred"], NEW_TOKENS / decode["off"]
    print(f"tpu device backed by: {torch.tpu.get_device_name()}")
    print(f"Checks on vs off, best of {args.rounds} alternating rounds\n")
    print(f"{'measure':<34} {'on':>9} {'off':>9} {'cost':>8}")
    print(f"{'tiny Llama eager forward (ms)':<34} {forward['deferred'] * 1e3:9.2f} {forward['off'] * 1e3:9.2f} "
          f"{forward['deferred'] / forward['off'] - 1:+8.1%}")
    print(f"{'compiled static decode (tokens/s)':<34} {on_rate:9.1f} {off_rate:9.1f} {off_rate / on_rate - 1:+8.1%}")
    print(f"{'one F.embedding, (1, 64) ids (us)':<34} {embedding['deferred']:9.1f} {embedding['off']:9.1f} "
          f"{embedding['deferred'] - embedding['off']:+7.1f}us")
    print(f"same tokens: {tokens['deferred'] == tokens['off']}")
    report("tiny Llama eager forward, checks on / off time", forward["deferred"] / forward["off"], "x",
           "HF_TPU_CHECKS=0 (goal <= 1.03x)")
    report("compiled static decode, checks on / off time", off_rate / on_rate, "x", "HF_TPU_CHECKS=0 (goal <= 1.03x)")
    report("one F.embedding, checks on - off", embedding["deferred"] - embedding["off"], "us", "HF_TPU_CHECKS=0")


if __name__ == "__main__":
    main()
