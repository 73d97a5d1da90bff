"""``transformers serve`` on tpu, as a real HTTP server on localhost (hf_tpu/integrations/serving.py): a tpu server
and a CPU server of the same tiny chat model answer the same concurrent requests (half streamed, prompts of mixed
lengths, greedy) with the same text, through the ``openai`` client; bad requests get the server's error and the
server keeps serving."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tiny_models import WORDS, save_tiny_llama
from torchrun_cases import _free_port

START_TIMEOUT_S, REQUEST_TIMEOUT_S = 180, 120
REQUESTS, CLIENTS, NEW_TOKENS = 12, 6, 12


def _chat_model(folder: Path) -> Path:
    from transformers import AutoTokenizer

    path = save_tiny_llama(folder)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    return path


def _start(model: Path, device: str, log: Path) -> tuple[subprocess.Popen, str]:
    """``device`` "tpu+cb" starts a tpu server with continuous batching."""
    port = _free_port()
    device, _, batching = device.partition("+")
    command = [shutil.which("transformers") or "transformers", "serve", str(model), "--device", device,
               "--host", "127.0.0.1", "--port", str(port), *(["--continuous-batching"] if batching else [])]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment)
    return server, f"http://127.0.0.1:{port}"


def _wait_until_serving(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:  # not listening yet (URLError is an OSError)
            pass
        time.sleep(0.5)
    pytest.fail(f"the server did not answer within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=20)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A tpu server, a tpu server with continuous batching and a CPU server of the same model, started together:
    ``{device: (url, model name)}``."""
    folder = tmp_path_factory.mktemp("serving")
    model = _chat_model(folder / "model")
    started = {device: _start(model, device, folder / f"{device}.log") for device in ("tpu", "tpu+cb", "cpu")}
    try:
        for device, (server, url) in started.items():
            _wait_until_serving(server, url, folder / f"{device}.log")
        yield {device: url for device, (_, url) in started.items()}, str(model)
    finally:
        for server, _ in started.values():
            _stop(server)


def _prompt(index: int) -> str:
    generator = random.Random(index)
    return " ".join(generator.choice(WORDS) for _ in range(2 + index % 13))


def _ask(url: str, model: str, index: int) -> tuple[str, str | None]:
    """Request ``index``'s answer and finish reason: streamed for even indices."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    request = dict(model=model, messages=[{"role": "user", "content": _prompt(index)}], max_tokens=NEW_TOKENS,
                   temperature=0)
    if index % 2:
        choice = client.chat.completions.create(**request).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


def _answers(url: str, model: str) -> list[tuple[str, str | None]]:
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as clients:
        return list(clients.map(lambda index: _ask(url, model, index), range(REQUESTS)))


def test_concurrent_requests_get_the_cpu_servers_answers(servers):
    urls, model = servers
    on_tpu, on_cpu = _answers(urls["tpu"], model), _answers(urls["cpu"], model)
    assert on_tpu == on_cpu
    assert all(reason in ("stop", "length") for _, reason in on_tpu)
    assert sum(bool(text) for text, _ in on_tpu) >= REQUESTS // 2  # answers, not empty strings
    assert len({text for text, _ in on_tpu}) > 2


def test_continuous_batching_on_tpu_gives_the_cpu_servers_answers(servers):
    urls, model = servers
    assert _answers(urls["tpu+cb"], model) == _answers(urls["cpu"], model)


def _post(url: str, body: bytes) -> tuple[int, str]:
    """The status and body of a POST of JSON ``body``, an error status included."""
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_bad_requests_get_the_servers_error_and_it_keeps_serving(servers):
    urls, model = servers
    url = urls["tpu"]
    chat = f"{url}/v1/chat/completions"
    status, detail = _post(chat, json.dumps({"model": "no/such-model",
                                             "messages": [{"role": "user", "content": "a"}]}).encode())
    assert status == 400 and "pinned" in detail
    status, _ = _post(chat, b'{"model": "m", "messages": [{')
    assert status == 422
    status, detail = _post(chat, json.dumps({"model": model, "max_tokens": 4, "messages": [
        {"role": "user", "content": " ".join(WORDS * 20)}]}).encode())
    assert status == 400 and "at most" in detail
    assert _ask(url, model, 3) == _ask(urls["cpu"], model, 3)


@pytest.mark.parametrize("device", ["tpu", "cpu"])
def test_a_tpu_models_requests_generate_with_a_static_cache_unless_one_is_chosen(device):
    """On tpu a dynamic cache gives every length a new program; serve's runner asks for a static one there, as
    it does under ``--compile``, unless the request or the model's generation config chose a cache."""
    from transformers.cli.serving import utils

    from conftest import tiny_llama
    from hf_tpu.integrations.serving import request_settings

    assert utils.GenerateRunner.generate._hf_tpu  # installed when serve's module is imported
    model = tiny_llama().to(device)
    static = {"cache_implementation": "static"} if device == "tpu" else {}
    assert request_settings(model, {"max_new_tokens": 4}) == {"max_new_tokens": 4, **static}
    assert request_settings(model, {"cache_implementation": "dynamic"}) == {"cache_implementation": "dynamic"}
    model.generation_config.cache_implementation = "dynamic"
    assert request_settings(model, {}) == {}


def test_a_tpu_models_prompts_are_padded_on_the_left_to_a_bucket_unless_a_setting_reads_them():
    """A prompt of 5 tokens becomes one of 64 (the pad token under a mask of zeros), so that prompts of many lengths
    share generate's programs; settings that read the prompt's tokens, or count lengths from its start, keep it."""
    import torch

    from conftest import tiny_llama
    from hf_tpu.integrations.serving import padded_prompt

    model = tiny_llama().to("tpu")
    model.generation_config.pad_token_id = 0
    prompt = torch.arange(1, 6)[None]
    greedy = {"max_new_tokens": 4, "do_sample": False, "temperature": 0.0, "min_new_tokens": 4}
    padded = padded_prompt(model, {"input_ids": prompt}, greedy)
    assert torch.equal(padded["input_ids"], torch.cat([torch.zeros(1, 59, dtype=torch.long), prompt], dim=1))
    assert torch.equal(padded["attention_mask"], torch.cat([torch.zeros(1, 59), torch.ones(1, 5)], dim=1).long())
    for reads_the_prompt in ({"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}, {"min_length": 9}):
        inputs = {"input_ids": prompt}
        assert padded_prompt(model, inputs, {**greedy, **reads_the_prompt}) is inputs
    inputs = {"input_ids": torch.arange(64)[None]}
    assert padded_prompt(model, inputs, greedy) is inputs  # a bucket's length already
    inputs = {"input_ids": prompt}
    assert padded_prompt(model.cpu(), inputs, greedy) is inputs
