"""The ``hf-tpu`` command: demo, generate, embed and info print what the CPU computes, and bad input ends
with one line on stderr and exit status 2."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from hf_tpu.cli import main
from test_packaging import SUBPROCESS_TIMEOUT, _environment, hf_tpu_command
from tiny_models import minilm_path

DEMO_SENTENCES = ["A man is playing a guitar.", "Someone is playing an instrument.", "The stock market fell."]
TEXTS = ["the cat sat on the mat", "a dog ran to the park", "the big red dog"]


@pytest.fixture(autouse=True)
def _restore_transformers_logging(monkeypatch):
    """The commands silence transformers' logging and progress bars process-wide; other tests need them back."""
    from transformers.utils import logging

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    yield
    logging.set_verbosity(verbosity)
    if bars:
        logging.enable_progress_bar()


def run_command(*arguments: str) -> subprocess.CompletedProcess:
    """The installed ``hf-tpu`` console script, in a fresh process."""
    return subprocess.run([hf_tpu_command(), *arguments], env=_environment(autoload=True), capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT)


def cpu_similarities(path, texts) -> torch.Tensor:
    """Cosine similarities of mean-pooled, normalised token states, computed on the CPU here."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=1)
    return pooled @ pooled.T


def printed_similarities(stdout: str, count: int) -> torch.Tensor:
    """The similarity matrix the command printed (rows ``[n]  v v v``)."""
    rows = re.findall(r"^\s+\[\d+\]((?:\s+-?\d+\.\d{3}){%d})\s*$" % count, stdout, re.MULTILINE)
    assert len(rows) == count, stdout
    return torch.tensor([[float(value) for value in row.split()] for row in rows])


def test_demo_matches_cpu(capsys):
    status = main(["demo", *DEMO_SENTENCES])
    captured = capsys.readouterr()
    out = captured.out
    assert status == 0, f"stdout:\n{out}\nstderr:\n{captured.err}"
    expected = cpu_similarities(minilm_path(), DEMO_SENTENCES)
    torch.testing.assert_close(printed_similarities(out, 3), expected, rtol=0, atol=1.5e-3)  # printed to 3 places
    differences = [float(d) for d in re.findall(r"max \|tpu - cpu\| = (\S+)", out)]
    assert len(differences) == 2 and max(differences) <= 1e-3, out  # eager and compiled
    assert re.search(r"tpu eager [\d.]+ ms, tpu compiled [\d.]+ ms", out), out
    assert "ran op by op" not in out  # the whole model compiled to XLA programs
    assert "RANDOM weights" in out and "Same tokens as on the CPU." in out
    assert re.search(r"\d+ new tokens: .* = [\d.]+ tokens/s", out), out
    assert "Generating" in captured.err  # the progress bar
    assert out.rstrip().endswith("OK: tpu and cpu agree.")


def test_generate_prints_what_the_cpu_generates(llama_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "the cat sat on"
    assert main(["generate", str(llama_dir), "--prompt", prompt, "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    inputs = tokenizer(prompt, return_tensors="pt", return_token_type_ids=False)
    tokens = model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=0)[0, inputs.input_ids.shape[1]:]
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    assert expected and f"Generated: {expected}\n" in out, out
    assert re.search(r"tokens/s", out), out


def test_generate_samples_from_a_seed_as_transformers_loop_does(llama_dir, capsys, monkeypatch):
    """``--sample``: the model's generation settings, each run from ``--seed``; the one-program loop draws what
    transformers' loop draws."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "the cat sat on"
    arguments = ["generate", str(llama_dir), "--prompt", prompt, "--max-new-tokens", "6", "--sample", "--seed", "7"]
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert "sampled from seed 7" in out, out

    monkeypatch.setenv("HF_TPU_STEPWISE_DECODE", "1")
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu").eval()
    inputs = tokenizer(prompt, return_tensors="pt", return_token_type_ids=False).to("tpu")
    torch.manual_seed(7)
    tokens = model.generate(**inputs, max_new_tokens=6, do_sample=True, pad_token_id=0,
                            cache_implementation="static")[0, inputs.input_ids.shape[1]:].cpu()
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    assert expected and f"Generated: {expected}\n" in out, out


def test_embed_prints_the_cpu_similarities(bert_dir, capsys):
    assert main(["embed", str(bert_dir), *TEXTS]) == 0
    out = capsys.readouterr().out
    printed = printed_similarities(out, len(TEXTS))
    torch.testing.assert_close(printed, cpu_similarities(bert_dir, TEXTS), rtol=0, atol=1.5e-3)
    assert printed.min() < 0.99  # different texts: a real comparison, not a matrix of ones


def test_info_lists_platform_chips_memory_and_versions(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^device count\s+\d+$", out, re.MULTILINE), out
    assert re.search(r"^platform\s+\w+$", out, re.MULTILINE), out
    assert re.search(r"^tpu:0 memory\s+[\d.]+ GiB total, [\d.]+ GiB free$", out, re.MULTILINE), out
    for package in ("torch", "jax", "transformers"):
        assert re.search(rf"^{package}\s+\d+\.\d+", out, re.MULTILINE), out


def bad_model_dir(case: str, tmp_path, llama_dir):
    """A path that is not a usable model directory, and what the error line must say about it."""
    if case == "missing":
        return tmp_path / "nowhere", "does not exist"
    if case == "file":
        (tmp_path / "weights.bin").write_text("")
        return tmp_path / "weights.bin", "is not a directory"
    if case == "no_config":
        return tmp_path, "has no config.json"
    if case == "unknown_type":
        (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
        return tmp_path, "cannot read the model config"
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())  # a model without tokenizer
    return tmp_path, "cannot load a tokenizer"


@pytest.mark.parametrize("command", ["generate", "embed"])
@pytest.mark.parametrize("case", ["missing", "file", "no_config", "unknown_type", "no_tokenizer"])
def test_bad_model_dir_is_one_line_and_exit_2(case, command, tmp_path, llama_dir, capsys):
    path, message = bad_model_dir(case, tmp_path, llama_dir)
    arguments = ["--prompt", "hi"] if command == "generate" else ["hi"]
    assert main([command, str(path), *arguments]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hf-tpu {command}: ") and message in err and "\n" not in err, err


def test_generate_refuses_a_model_that_cannot_generate(tmp_path, capsys):
    from transformers import T5Config

    T5Config(d_model=8, num_layers=1, num_heads=1, d_kv=8, d_ff=8, vocab_size=10).save_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hf-tpu generate: {tmp_path} holds a 't5' model, which transformers cannot load "
                   "for text generation (AutoModelForCausalLM)."), err


def test_console_script_error_has_no_traceback(tmp_path):
    completed = run_command("embed", str(tmp_path / "nowhere"), "some text")
    assert completed.returncode == 2
    lines = [line for line in completed.stderr.splitlines() if line.startswith("hf-tpu ")]
    assert lines == [f"hf-tpu embed: {tmp_path / 'nowhere'} does not exist."], completed.stderr
    assert "Traceback" not in completed.stderr and completed.stdout == ""
