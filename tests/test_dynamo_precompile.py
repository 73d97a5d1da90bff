"""torch's caching precompile (``TORCH_CACHING_PRECOMPILE=1``) for tpu models (hf_tpu/integrations/dynamo.py): a
second process installs what Dynamo made of an HF model's forward instead of tracing it, and every guard Dynamo
made is kept: in the compiling process as it is, in the package as a check of the object its source finds.

Each multi-process case is a fresh process sharing one cache directory: a tiny Llama built from a config, compiled
for tpu, reports its logits or greedy tokens, the same computed on the CPU, how many frames Dynamo traced and how
many saved packages it loaded.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import pickle
import subprocess
import sys
import types
import warnings
from typing import Any

import pytest
import torch

_CHILD = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=64)
torch.manual_seed(0)
reference = LlamaForCausalLM(config).eval()
model = LlamaForCausalLM(config).eval().to("tpu")
model.load_state_dict(reference.state_dict())
results = []
for task in sys.argv[1:]:
    ids = torch.randint(0, config.vocab_size, (1, 8 if task == "generate" else int(task)))
    traced = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        if task == "generate":
            options = dict(max_new_tokens=4, do_sample=False)
            result = {"tokens": model.generate(ids.to("tpu"), cache_implementation="static", **options).tolist(),
                      "expected": reference.generate(ids, **options).tolist()}
        else:
            compiled = torch.compile(model, backend="tpu")
            result = {"logits": compiled(ids.to("tpu")).logits.cpu().tolist(),
                      "expected": reference(ids).logits.tolist()}
    results.append({**result, "traced": counters["stats"]["unique_graphs"] - traced})
print(json.dumps({"results": results, "loaded": counters["dynamo_cache"]["dynamo_cache_hit"]}))
"""


def _process(child: str, cache: str, *args: str, **settings: str) -> dict:
    """The JSON that a fresh Python process running ``child`` prints last, with the caches under ``cache``
    (torch's caching precompile as hf_tpu sets it unless ``settings`` say otherwise)."""
    environment = {**os.environ, "HF_TPU_CACHE_DIR": os.path.join(cache, "xla"), "HF_HUB_OFFLINE": "1",
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "torch")}
    environment.pop("TORCH_CACHING_PRECOMPILE", None)
    environment.update(settings)
    completed = subprocess.run([sys.executable, "-c", child, *args], env=environment, capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _run(cache: str, *tasks: str, **settings: str) -> dict:
    """One process running ``tasks`` (a sequence length: a compiled forward; ``generate``: static-cache greedy
    decoding), each checked against the CPU, with torch's caching precompile on and the caches under ``cache``
    (and the environment ``settings``)."""
    outcome = _process(_CHILD, cache, *tasks, **settings)
    for result in outcome["results"]:
        if "tokens" in result:
            assert result["tokens"] == result["expected"]
        else:
            torch.testing.assert_close(torch.tensor(result["logits"]), torch.tensor(result["expected"]),
                                       rtol=1e-4, atol=1e-4)
    return outcome


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A cache filled by one process's compiled forward, and what that process computed."""
    cache = str(tmp_path_factory.mktemp("precompile"))
    outcome = _run(cache, "8")
    assert outcome["results"][0]["traced"] == 1 and outcome["loaded"] == 0
    assert os.listdir(os.path.join(cache, "torch", "dynamo")), "no package was written"
    return cache, outcome["results"][0]


def test_second_process_skips_dynamo_computes_the_same_and_traces_a_new_shape(cold: tuple[str, dict]) -> None:
    cache, cold_result = cold
    same, new_shape = _run(cache, "8", "12")["results"]
    assert same["traced"] == 0
    assert same["logits"] == cold_result["logits"]
    assert new_shape["traced"] == 1  # the loaded guards reject the new length; the same module is traced again


def test_generate_decode_steps_are_loaded_by_the_next_process(cold: tuple[str, dict]) -> None:
    """transformers' loop (``HF_TPU_STEPWISE_DECODE``), whose decode step generate compiles with Dynamo."""
    cache, _ = cold
    first = _run(cache, "generate", HF_TPU_STEPWISE_DECODE="1")["results"][0]
    assert first["traced"] >= 1
    second = _run(cache, "generate", HF_TPU_STEPWISE_DECODE="1")
    assert second["results"][0]["traced"] == 0 and second["loaded"] == 1
    assert second["results"][0]["tokens"] == first["tokens"]


_HELPERS = """
def act(x):
    return x * 2


def model(x):
    return act(x) + 1
"""

_PATCHING_CHILD = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[1])
import helpers
if sys.argv[2] == "patched":
    helpers.act = lambda x: x * 3
x = torch.ones(2).to("tpu")  # the device used before torch.compile: its package is kept
value = torch.compile(helpers.model)(x).cpu().tolist()
print(json.dumps({"value": value, "traced": counters["stats"]["unique_graphs"],
                  "loaded": counters["dynamo_cache"]["dynamo_cache_hit"]}))
"""


def _value_traced_loaded(child: str, tmp_path: pathlib.Path, variant: str) -> tuple[Any, int, int]:
    """What a fresh process running ``child`` over the modules in ``tmp_path`` computed, how many graphs it
    traced and how many packages it loaded (its caches in ``tmp_path/cache``)."""
    outcome = _process(child, str(tmp_path / "cache"), str(tmp_path), variant)
    return outcome["value"], outcome["traced"], outcome["loaded"]


def test_a_function_patched_before_a_process_compiles_is_traced_again_and_the_saved_compile_is_kept(
        tmp_path: pathlib.Path) -> None:
    (tmp_path / "helpers.py").write_text(_HELPERS)
    run = functools.partial(_value_traced_loaded, _PATCHING_CHILD, tmp_path)

    assert run("plain") == ([3.0, 3.0], 1, 0)
    assert run("plain") == ([3.0, 3.0], 0, 1)
    # the loaded guard finds a lambda where act was: traced; its guard over a lambda cannot be saved
    assert run("patched") == ([4.0, 4.0], 1, 1)
    assert run("plain") == ([3.0, 3.0], 0, 1)  # the first compile is still in the package


_GLOBAL_DICT = """
CHOICES = {"one": 1, "two": 2, "three": 3}


def pick(x):
    return x * CHOICES["three"]
"""

_GUARD_ERRORS = r"""
import logging
guard_errors = []
logging.getLogger("torch").addHandler(logging.Handler(logging.ERROR))
logging.getLogger("torch").handlers[-1].emit = lambda record: guard_errors.append(record.getMessage())
"""

_GLOBAL_DICT_CHILD = _GUARD_ERRORS + r"""
import json, sys
import torch
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[1])
import helpers
if sys.argv[2] == "unbuildable":  # the saved guard on CHOICES fails as one on a global that changed shape can
    from torch._dynamo.guards import GuardBuilder
    build_constant_guard, failed = GuardBuilder.CONSTANT_MATCH, []
    def failing_for_choices(self, guard):  # the loaded guard; the guard of the trace that follows is built
        if "CHOICES" in guard.name and not failed:
            failed.append(guard.name)
            raise IndexError("list index out of range")
        return build_constant_guard(self, guard)
    GuardBuilder.CONSTANT_MATCH = failing_for_choices
x = torch.ones(2).to("tpu")  # the device used before torch.compile: its package is kept
value = torch.compile(helpers.pick)(x).cpu().tolist()
assert not guard_errors, guard_errors
print(json.dumps({"value": value, "traced": counters["stats"]["unique_graphs"],
                  "loaded": counters["dynamo_cache"]["dynamo_cache_hit"]}))
"""


def test_a_saved_guard_that_cannot_be_built_in_a_process_is_a_quiet_cache_miss(tmp_path: pathlib.Path) -> None:
    """torch logged an error with its traceback (a guard on transformers' registry of the outputs each model class
    can record, saved by a process that had made more models) before the install failed."""
    (tmp_path / "helpers.py").write_text(_GLOBAL_DICT)
    run = functools.partial(_value_traced_loaded, _GLOBAL_DICT_CHILD, tmp_path)

    assert run("plain") == ([3.0, 3.0], 1, 0)
    assert run("unbuildable") == ([3.0, 3.0], 1, 1)  # the package is loaded, cannot be installed: traced


_INLINED_HELPER = """
def factor():
    return {factor}


def scaled(x):
    return x * factor()
"""

_SOURCE_CHANGE_CHILD = r"""
import json, logging, sys
import torch
from torch._dynamo.utils import counters
warnings = []
for name in ("torch", "torch._dynamo"):  # torch._dynamo's records stop at its own handler
    logging.getLogger(name).addHandler(logging.Handler(logging.WARNING))
    logging.getLogger(name).handlers[-1].emit = lambda record: warnings.append(record.getMessage())
sys.path.insert(0, sys.argv[1])
import inlined
x = torch.ones(2).to("tpu")
value = torch.compile(inlined.scaled)(x).cpu().tolist()
assert not warnings, warnings
print(json.dumps({"value": value, "traced": counters["stats"]["unique_graphs"],
                  "loaded": counters["dynamo_cache"]["dynamo_cache_hit"]}))
"""


def test_a_package_saved_from_other_sources_is_a_quiet_cache_miss(tmp_path: pathlib.Path) -> None:
    """torch logged a warning with its traceback ("Failed to load entry from dynamo cache": "Source code changes
    detected") where a function the saved compile inlined has changed since, as after an upgrade of the library
    that holds it."""
    run = functools.partial(_value_traced_loaded, _SOURCE_CHANGE_CHILD, tmp_path)
    (tmp_path / "inlined.py").write_text(_INLINED_HELPER.format(factor="3.0"))
    assert run("") == ([3.0, 3.0], 1, 0)
    (tmp_path / "inlined.py").write_text(_INLINED_HELPER.format(factor="2.0"))
    assert run("") == ([2.0, 2.0], 1, 1)  # the package is loaded, its sources are not these: traced


_OTHER_MODELS_CHILD = _GUARD_ERRORS + r"""
import json, sys
import torch
from torch._dynamo.utils import counters
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, LlamaConfig, LlamaForCausalLM
if sys.argv[1] == "another model first":
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37))
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, vocab_size=64)).eval().to("tpu")
compiled = torch.compile(model, backend="tpu")
ids = torch.arange(8).view(1, 8).to("tpu")
with torch.no_grad():
    logits = compiled(ids).logits.cpu()
    GPT2Model(GPT2Config(n_embd=32, n_layer=1, n_head=2))  # a model of a class the process had not made
    again = compiled(ids).logits.cpu()
assert torch.equal(logits, again) and not guard_errors, guard_errors
print(json.dumps({"logits": logits.tolist(), "traced": counters["stats"]["unique_graphs"],
                  "loaded": counters["dynamo_cache"]["dynamo_cache_hit"]}))
"""


def test_a_compiled_forward_does_not_depend_on_the_other_models_a_process_made(tmp_path: pathlib.Path) -> None:
    """transformers' registry of the outputs each model class can record, read in every forward, was guarded by
    Dynamo as a dict (its length, its keys by position): a model of a new class made after the compile traced
    the forward again, and a process that made other models first, or none, refused the saved compile."""
    first = _process(_OTHER_MODELS_CHILD, str(tmp_path), "another model first")
    assert first["traced"] == 1 and first["loaded"] == 0
    second = _process(_OTHER_MODELS_CHILD, str(tmp_path), "this model only")
    assert second["traced"] == 0 and second["loaded"] == 1
    assert second["logits"] == first["logits"]


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _uses_a_global(x: torch.Tensor) -> torch.Tensor:
    return _doubled(x) + 1


def test_the_compiling_process_keeps_the_guards_torch_would_drop(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # where this compile's package goes
    x = torch.ones(2).to("tpu")
    with torch._dynamo.config.patch(caching_precompile=True):
        compiled = torch.compile(_uses_a_global, backend="tpu")
        assert compiled(x).cpu().tolist() == [3.0, 3.0]
        monkeypatch.setattr(sys.modules[__name__], "_doubled", lambda x: x * 3)
        assert compiled(x).cpu().tolist() == [4.0, 4.0]  # torch's precompile drops this guard: 3.0


def test_a_saved_identity_guard_does_not_take_another_object_of_the_same_name() -> None:
    from hf_tpu.integrations import dynamo

    def act(x: torch.Tensor) -> torch.Tensor:
        return x

    stand_in = functools.wraps(_doubled)(lambda x: x * 3)
    assert dynamo._fingerprint(_doubled) == dynamo._fingerprint(_doubled)
    assert dynamo._fingerprint(stand_in) != dynamo._fingerprint(_doubled)  # same name, other code
    assert dynamo._fingerprint(act.__code__) != dynamo._fingerprint(_doubled.__code__)
    assert dynamo._fingerprint(torch.cat) != dynamo._fingerprint(torch.stack)
    assert dynamo._fingerprint(torch.nn) == ("module", "torch.nn")


def test_kernels_function_modules_are_saved_by_name() -> None:
    pytest.importorskip("kernels")
    from transformers.models.llama import modeling_llama

    module_class = type(modeling_llama.apply_rotary_pos_emb)
    assert isinstance(modeling_llama.apply_rotary_pos_emb, torch.nn.Module)
    assert "<locals>" not in module_class.__qualname__
    assert pickle.loads(pickle.dumps(module_class)) is module_class


class _Package:
    def __init__(self, device_type: str) -> None:
        self.entry = types.SimpleNamespace(device_type=device_type, fn_name="Model.forward")
        self.source_id = "model-forward"

    def cache_entry(self) -> types.SimpleNamespace:
        return self.entry


def test_tpu_packages_are_written_when_recorded_unless_the_cache_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo import package
    from torch._dynamo.precompile_context import PrecompileContext

    from hf_tpu.backend import runtime

    writes = []
    monkeypatch.setattr(PrecompileContext, "record_dynamo_cache_entry", lambda **_: None)
    monkeypatch.setattr(package.PrecompileCacheEntry, "from_cache_entry", lambda entry, backends: entry)
    monkeypatch.setattr(package.DynamoCache, "write", lambda entry, key: writes.append((entry.fn_name, key)))
    package.DynamoCache.record_package(_Package("cpu"))
    assert writes == []
    package.DynamoCache.record_package(_Package("tpu"))
    assert writes == [("Model.forward", "model-forward")]  # this package only
    monkeypatch.setattr(runtime, "compilation_cache_dir", lambda: None)
    package.DynamoCache.record_package(_Package("tpu"))
    assert len(writes) == 1


def test_a_package_that_cannot_be_written_warns_and_the_compile_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo import package
    from torch._dynamo.precompile_context import PrecompileContext

    def fail() -> None:
        raise OSError("disk full")

    monkeypatch.setattr(PrecompileContext, "record_dynamo_cache_entry", lambda **_: None)
    monkeypatch.setattr(package.PrecompileCacheEntry, "from_cache_entry", lambda entry, backends: entry)
    monkeypatch.setattr(package.DynamoCache, "write", lambda entry, key: fail())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        package.DynamoCache.record_package(_Package("tpu"))
    assert any("could not save Model.forward" in str(warning.message) and "disk full" in str(warning.message)
               for warning in caught)


_POSITIONS_CHILD = r"""
import json
import torch
from torch._dynamo.utils import counters
x = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)


def columns(x, p):
    return (x[:, p:p + 4] * 2).sum(1)


compiled = torch.compile(columns, backend="tpu")
traced = []
for position in range(1, 7):
    before = counters["stats"]["unique_graphs"]
    assert torch.equal(compiled(x.to("tpu"), position).cpu(), columns(x, position))
    traced.append(counters["stats"]["unique_graphs"] - before)
print(json.dumps(traced))
"""


def test_a_process_that_loads_a_function_knows_which_int_inputs_were_dynamic(tmp_path: pathlib.Path) -> None:
    assert _process(_POSITIONS_CHILD, str(tmp_path)) == [1, 1, 0, 0, 0, 0]  # static at 1, then dynamic
    for _ in range(2):  # without the profile, each process traced one more position as a constant
        assert sum(_process(_POSITIONS_CHILD, str(tmp_path))) <= 1


_DEFAULT_CHILD = r"""
import json, threading
import torch
config = torch._dynamo.config
before = config.caching_precompile
torch.ones(1).to("tpu")
seen = {}
thread = threading.Thread(target=lambda: seen.update(on=config.caching_precompile, job=torch.compiler.config.job_id))
thread.start()
thread.join()
print(json.dumps({"before": before, "after": config.caching_precompile, "thread": seen["on"],
                  "same job": seen["job"] == torch.compiler.config.job_id}))
"""


@pytest.mark.parametrize("setting, expected", [({}, True), ({"TORCH_CACHING_PRECOMPILE": "0"}, False),
                                               ({"HF_TPU_CACHE_DIR": "off"}, False)])
def test_on_once_the_device_is_used_unless_turned_off(tmp_path: pathlib.Path, setting: dict, expected: bool) -> None:
    """In every thread: torch 2.13's config values set by a thread are that thread's own."""
    assert _process(_DEFAULT_CHILD, str(tmp_path), **setting) == {
        "before": False, "after": expected, "thread": expected, "same job": True}


_MODULES = """
import torch


class Doubling(torch.nn.Module):
    @property
    def finish(self):
        torch._dynamo.graph_break()  # the getter is then compiled as a frame of its own
        return torch.neg

    def forward(self, x):
        return self.finish(x * 2)


def inner(x):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def outer(x):
    return inner(x) - 1
"""

_MODULES_CHILD = r"""
import json, logging, sys
import torch
from torch._dynamo import package
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[1])
import modules
if sys.argv[2] == "failing install":  # the package's last guards cannot be rebuilt, after its others were installed
    load = package.load_guard_manager
    def failing_for_inners_resume(state, code, *args):
        if code.co_name.startswith("torch_dynamo_resume_in_inner"):
            raise IndexError("list index out of range")
        return load(state, code, *args)
    package.load_guard_manager = failing_for_inners_resume
warnings = []
logging.getLogger("torch._dynamo").addHandler(logging.Handler())
logging.getLogger("torch._dynamo").handlers[-1].emit = lambda record: warnings.append(record.getMessage())
x = torch.arange(3.0).to("tpu")
value = {"property": torch.compile(modules.Doubling(), backend="tpu")(x).cpu().tolist(),
         "nested": [torch.compile(modules.outer, backend="tpu")(x).cpu().tolist() for _ in range(2)]}
assert not [w for w in warnings if "dynamo cache" in w], warnings  # a package that cannot be used is a cache miss
print(json.dumps({"value": value, "traced": counters["stats"]["unique_graphs"],
                  "loaded": counters["dynamo_cache"]["dynamo_cache_hit"]}))
"""


def test_a_property_compiled_on_its_own_and_a_package_that_fails_to_install_leave_compiles_working(
        tmp_path: pathlib.Path) -> None:
    (tmp_path / "modules.py").write_text(_MODULES)
    run = functools.partial(_value_traced_loaded, _MODULES_CHILD, tmp_path)
    expected = {"property": [-0.0, -2.0, -4.0], "nested": [[0.0, 2.0, 4.0]] * 2}

    values, traced, loaded = run("plain")
    assert values == expected and traced > 0 and loaded == 1  # outer's second compile loads what its first saved
    values, traced, loaded = run("plain")
    assert values == expected and traced == 0 and loaded >= 2  # the packages loaded: nothing traced
    values, traced, loaded = run("failing install")  # the nested function's install undone with its package's
    assert values == expected and traced > 0


_COUNTING_CHILD = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import modules
calls = []
def counting(graph_module, inputs):
    calls.append(1)
    return graph_module
x = torch.arange(3.0).to("tpu")
value = torch.compile(modules.inner, backend=counting if sys.argv[2] == "counting" else "tpu")(x).cpu().tolist()
print(json.dumps({"value": value, "backend_calls": len(calls)}))
"""


def test_only_compiles_for_tpu_keep_a_package_by_default(tmp_path: pathlib.Path) -> None:
    """A package stands in for the backend in later compiles of the same function: another backend's (a debugging
    or counting one) is not saved, and a tpu package is not loaded for it."""
    (tmp_path / "modules.py").write_text(_MODULES)
    cache = str(tmp_path / "cache")
    for backend in ("counting", "tpu", "counting"):
        outcome = _process(_COUNTING_CHILD, cache, str(tmp_path), backend)
        assert outcome["value"] == [1.0, 3.0, 5.0]
        assert outcome["backend_calls"] == (2 if backend == "counting" else 0)
    assert os.listdir(os.path.join(cache, "torch", "dynamo"))


_CONTINUOUS_BATCHING_CHILD = r"""
import json
import torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=64, eos_token_id=-1, pad_token_id=0)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval().to("tpu")
prompts = [[3 + (7 * i + j) % 60 for j in range(4 + 5 * i)] for i in range(4)]
outputs = model.generate_batch(prompts, GenerationConfig(max_new_tokens=6, do_sample=False),
                               continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64))
tokens = [outputs[name].generated_tokens for name in sorted(outputs, key=lambda name: int(name.split("_")[-1]))]
print(json.dumps({"tokens": tokens, "traced": counters["stats"]["unique_graphs"],
                  "loaded": counters["dynamo_cache"]["dynamo_cache_hit"]}))
"""


def test_continuous_batching_steps_are_loaded_by_the_next_process(tmp_path: pathlib.Path) -> None:
    """Its generation thread compiles the prefill and decode steps (``dynamic=True``, the paged cache marked
    static, its ``update`` a method guarded by Dynamo): a second process runs them from the package."""
    first = _process(_CONTINUOUS_BATCHING_CHILD, str(tmp_path))
    assert first["traced"] == 2 and first["loaded"] == 0  # a prefill step and a decode step
    second = _process(_CONTINUOUS_BATCHING_CHILD, str(tmp_path))
    assert second["traced"] == 0 and second["loaded"] == 1
    assert second["tokens"] == first["tokens"] and all(len(tokens) == 6 for tokens in first["tokens"])
