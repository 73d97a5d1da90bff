"""Warm start (hf_tpu/compile/warm_start.py): a second process loads AOTAutograd's result for its tpu graphs.

Each case is a fresh process sharing one cache directory with the others: a tiny Llama built from a config
runs an inference forward and a training step (forward and backward) under ``torch.compile(backend="tpu")``,
and reports its logits and gradients, the same computed eagerly on the CPU, and how many ATen graphs it
loaded instead of traced (``compile_stats()["warm_starts"]``), with torch's caching precompile off (its package,
on by default, would skip this layer: ``test_dynamo_precompile.py``).
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from hf_tpu.compile import compile_stats, warm_start

_CHILD = r"""
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_tpu.compile.warm_start as warm_start
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=64)
torch.manual_seed(0)
reference = LlamaForCausalLM(config)
model = LlamaForCausalLM(config).to("tpu")
model.load_state_dict(reference.state_dict())


def run(length, train):
    # one static-shape compilation: the inference forward, and with train a training step (forward, backward)
    before = torch.tpu.compile_stats()["warm_starts"]
    ids = torch.randint(0, config.vocab_size, (1, length))
    compiled = torch.compile(model, backend="tpu", dynamic=False)
    with torch.no_grad():
        result = {"logits": compiled(ids.to("tpu")).logits.cpu().tolist(), "expected": reference(ids).logits.tolist()}
    if train:
        model.zero_grad()
        reference.zero_grad()
        compiled(ids.to("tpu"), labels=ids.to("tpu")).loss.backward()
        reference(ids, labels=ids).loss.backward()
        result.update(grad=model.model.embed_tokens.weight.grad.cpu().tolist(),
                      expected_grad=reference.model.embed_tokens.weight.grad.tolist())
    return {**result, "warm_starts": torch.tpu.compile_stats()["warm_starts"] - before}


results = {"first": run(8, train=True)}
if sys.argv[1] == "misses":
    results["shape"] = run(12, train=False)
    torch._dynamo.reset()  # the same Dynamo graph again, as another hf_tpu, JAX or jaxlib version makes it
    warm_start.cache_tag = lambda: "hf_tpu-another-version"
    results["version"] = run(8, train=False)
print(json.dumps(results))
"""

_GRAPHS = 3  # the inference forward, the training forward and its backward


def _run(cache: str, misses: bool = False) -> dict:
    """One process's results (each checked against the CPU), with its caches under ``cache``; with ``misses``,
    also a new shape and, after ``torch._dynamo.reset()``, the same graph under another version tag."""
    environment = {**os.environ, "HF_TPU_CACHE_DIR": os.path.join(cache, "xla"), "HF_HUB_OFFLINE": "1",
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "torch"),
                   "TORCH_CACHING_PRECOMPILE": "0"}  # the layer below torch's package, which would skip it
    completed = subprocess.run([sys.executable, "-c", _CHILD, "misses" if misses else ""], env=environment,
                               capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    for result in results.values():
        torch.testing.assert_close(torch.tensor(result["logits"]), torch.tensor(result["expected"]),
                                   rtol=1e-4, atol=1e-4)
        if "grad" in result:
            torch.testing.assert_close(torch.tensor(result["grad"]), torch.tensor(result["expected_grad"]),
                                       rtol=1e-4, atol=1e-5)
    return results


def _entries(cache: str) -> list[str]:
    return glob.glob(os.path.join(cache, "torch", "aotautograd", "atpu*", "*"))


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A cache filled by one process, and what that process computed."""
    cache = str(tmp_path_factory.mktemp("warm_start"))
    result = _run(cache)["first"]
    assert result["warm_starts"] == 0
    assert len(_entries(cache)) == 2  # inference graph; training forward and backward in one entry
    return cache, result


def _assert_identical(result: dict, cold_result: dict) -> None:
    assert result["logits"] == cold_result["logits"]
    assert result["grad"] == cold_result["grad"]


def test_second_process_loads_graphs_and_computes_the_same_and_changes_miss(cold: tuple[str, dict]) -> None:
    cache, cold_result = cold
    results = _run(cache, misses=True)
    assert results["first"]["warm_starts"] == _GRAPHS
    _assert_identical(results["first"], cold_result)
    assert results["shape"]["warm_starts"] == 0
    assert results["version"]["warm_starts"] == 0


def test_corrupt_entries_are_recomputed(cold: tuple[str, dict]) -> None:
    cache, cold_result = cold
    for path in _entries(cache):
        with open(path, "rb") as file:
            entry = pickle.load(file)
        if entry.compiled_bw is None:  # the inference graph's entry: an unreadable file
            corrupt = b"not a cache entry"
        else:  # the training graphs' entry: readable, but its forward graph cannot be rebuilt
            entry.compiled_fw.result._serialized = b"not a graph"
            corrupt = pickle.dumps(entry)
        with open(path, "wb") as file:
            file.write(corrupt)
    result = _run(cache)["first"]
    assert result["warm_starts"] == 0
    _assert_identical(result, cold_result)


def test_cache_tag_follows_jax_version(monkeypatch: pytest.MonkeyPatch) -> None:
    tag = warm_start.cache_tag()
    versions = {"jax": "0.0.1", "jaxlib": importlib.metadata.version("jaxlib")}
    monkeypatch.setattr(warm_start.importlib.metadata, "version", versions.__getitem__)
    warm_start.cache_tag.cache_clear()
    try:
        assert warm_start.cache_tag() != tag
    finally:
        warm_start.cache_tag.cache_clear()


def _compile_and_run(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()  # Dynamo traces again, as a new process does
    with torch.no_grad():
        return torch.compile(lambda t: torch.nn.functional.gelu(t) * 3 + t.sum(), backend="tpu")(x).cpu()


def test_entries_are_kept_unless_the_cache_is_off(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 3)
    expected = torch.nn.functional.gelu(x) * 3 + x.sum()
    monkeypatch.setenv("HF_TPU_CACHE_DIR", "off")
    start = compile_stats()["warm_starts"]
    torch.testing.assert_close(_compile_and_run(x.to("tpu")), expected)
    assert not os.path.exists(tmp_path / "aotautograd")
    monkeypatch.setenv("HF_TPU_CACHE_DIR", str(tmp_path / "xla"))
    first = _compile_and_run(x.to("tpu"))
    assert compile_stats()["warm_starts"] == start and len(os.listdir(tmp_path / "aotautograd")) == 1
    assert torch.equal(_compile_and_run(x.to("tpu")), first)
    assert compile_stats()["warm_starts"] == start + 1
    torch.testing.assert_close(first, expected)


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_saved_graphs_keep_each_node_value_shape_strides_and_dtype(tracing_mode: str) -> None:
    """Values are saved as their layout (symbolic sizes as torch's GraphPickler saves them) and made again as
    empty fake tensors; a value of a size read from a tensor (``nonzero``'s) the way torch saves it."""
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import Options
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        data_dependent = (x.nonzero(),) if tracing_mode == "symbolic" else ()
        return (x.t() * 2).sum(0), x[1:], x.t().contiguous().to(torch.float64), *data_dependent

    saved = make_fx(f, tracing_mode=tracing_mode)(torch.randn(4, 3))
    options = Options(ops_filter=None, node_metadata_key_filter={"val"}.__contains__)
    pickled = warm_start._pickler().dumps(saved, options)
    loaded = warm_start._pickler().loads(pickled, FakeTensorMode(shape_env=ShapeEnv()))
    values = [(node.meta["val"], other.meta["val"]) for node, other in zip(saved.graph.nodes, loaded.graph.nodes)
              if isinstance(node.meta.get("val"), torch.Tensor)]
    assert len(values) >= 6
    for value, other in values:
        assert isinstance(other, torch._subclasses.FakeTensor)
        assert (str(other.shape), str(other.stride()), other.dtype, other.device) == \
            (str(value.shape), str(value.stride()), value.dtype, value.device)
