"""Shared test helpers: run the same thing on "cpu" and "tpu" and compare."""

from __future__ import annotations

import contextlib
import importlib
import os
import uuid
from pathlib import Path
from typing import Any, Callable

# Dynamo keeps its profile of which sizes vary on disk, by job id (hf_tpu keeps one, for a second process's warm
# start): each run of the suite, and the processes its tests start, keep their own, so that no test compiles with
# sizes that an earlier run's tests varied.
os.environ.setdefault("TORCH_COMPILE_JOB_ID", f"hf_tpu-tests-{uuid.uuid4().hex[:12]}")

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_tpu  # noqa: F401,E402  (registers the device even where autoload is off)


ROOT = Path(__file__).resolve().parent.parent
MAX_WORKERS = 8
"""``-n auto`` starts one worker per core up to this: each worker holds torch, JAX and the models of its tests, and
a multi-process test starts up to four processes more. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` sets the number instead."""


def pytest_xdist_auto_num_workers(config) -> int:
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    return int(chosen) if chosen else min(len(os.sched_getaffinity(0)), MAX_WORKERS)


LONGEST_FIRST = ["test_torchtitan.py", "test_tpu_lowering.py", "test_fused_eager_suites.py",
                 "test_continuous_batching.py", "test_dynamo_precompile.py", "test_tpu_dist_transformers.py",
                 "test_notebooks.py", "test_opinfo.py", "test_serving.py", "test_sharded_models.py"]
"""The files that take longest, started first. ``--dist loadfile`` hands whole files to the workers in collection
order (pyproject sets ``--no-loadscope-reorder``; xdist's own order is by number of tests, which puts the files of a
few long tests last): a long file started last keeps one worker busy while the other has nothing left to run."""


SURVEYED_FOR_TPU_LOWERING = ["tests/test_transformers_models.py", "tests/test_transformers_moe.py",
                             "tests/test_diffusers_models.py", "tests/test_diffusers_pipelines.py"]
"""The model tests that tests/test_tpu_lowering.py runs in a pytest of its own with every program also lowered for TPU
chips, failing if any of them fails. A run of the whole suite leaves them to it rather than run them twice; named
on the command line (or under ``HF_TPU_CHECK_TPU_LOWERING``, as the survey runs them), they run as any file does."""


_SURVEYED_PATHS = frozenset((ROOT / name).resolve() for name in SURVEYED_FOR_TPU_LOWERING)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    path = collection_path.resolve()
    if path not in _SURVEYED_PATHS or os.environ.get("HF_TPU_CHECK_TPU_LOWERING"):
        return None
    named = {Path(arg.split("::")[0]).resolve() for arg in config.args}
    return path not in named or None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


def to_tpu(value: Any) -> Any:
    """Moves tensors (in nested lists/tuples/dicts) to tpu, keeping requires_grad leaves as leaves."""
    if isinstance(value, torch.Tensor):
        moved = value.detach().to("tpu")
        return moved.requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(to_tpu(v) for v in value)
    if isinstance(value, dict):
        return {k: to_tpu(v) for k, v in value.items()}
    return value


def assert_same(actual: Any, expected: Any, **tolerances: Any) -> None:
    """Compares a tpu result with the CPU result: same dtype and shape, values close."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual)}"
        assert actual.device.type == "tpu", f"result is on {actual.device}, expected tpu"
        assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
        torch.testing.assert_close(actual.cpu(), expected, **tolerances)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e, **tolerances)
    else:
        assert actual == expected


def check_against_cpu(fn: Callable[..., Any], *args: Any, **tolerances: Any) -> Any:
    """Runs ``fn(*args)`` on CPU tensors and on tpu copies of them and compares the results."""
    expected = fn(*args)
    actual = fn(*to_tpu(args))
    assert_same(actual, expected, **tolerances)
    return actual


TRACED = "/jax/core/compile/jaxpr_trace_duration"  # JAX traced a program (a new one, or an old one for new shapes)
COMPILED = "/jax/core/compile/backend_compile_duration"  # XLA compiled one


@contextlib.contextmanager
def counting_jax_events(event: str):
    """Collects the durations of JAX's monitoring events named ``event`` (:data:`TRACED`, :data:`COMPILED`) inside
    the block."""
    import jax

    durations = []

    def listener(name: str, duration: float, **kwargs: Any) -> None:
        if name == event:
            durations.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield durations
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def tiny_llama(**overrides: Any) -> torch.nn.Module:
    """A tiny LlamaForCausalLM built from a config on CPU (hidden 64, 2 layers, GQA; no downloads)."""
    import transformers

    settings = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **overrides})).float()


def generation_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Llama for generate tests (untied embeddings, pad token 0, eval mode) on CPU, and a copy on tpu."""
    import copy

    cpu_model = tiny_llama(tie_word_embeddings=False).eval()
    cpu_model.generation_config.pad_token_id = 0
    return cpu_model, copy.deepcopy(cpu_model).to("tpu")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A tiny Llama and its offline tokenizer saved with save_pretrained (see tiny_models.py)."""
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    """A tiny BERT and its offline tokenizer saved with save_pretrained (see tiny_models.py)."""
    from tiny_models import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


_RESIDENT_LIMIT = 3 << 30


@pytest.fixture(autouse=True, scope="module")
def compiled_programs_dropped_past_a_limit():
    """After a test module, a process holding more than 3 GiB drops JAX's compiled programs (every op's and graph's
    executables are built again when next used) and hands the freed heap back to the system: a worker that runs
    many modules would otherwise grow by every program compiled, to 8-10 GiB over the suite, and leave the
    processes that later tests start short of memory on a 24 GiB machine."""
    yield
    if int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") > _RESIDENT_LIMIT:
        import ctypes
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):  # glibc's; elsewhere the heap is left as it is
            ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="module")
def tpu_kernel_mapping():
    """hf_tpu's kernel layers in transformers' default mapping, as on TPU chips (here they run interpreted; see
    ``hf_tpu.integrations.hub_kernels``), for one test module; transformers' cached mapping is built again."""
    from transformers.integrations import hub_kernels

    from hf_tpu.integrations import hub_kernels as bridge

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bridge, "_pallas_kernels", lambda: True)
        patch.setattr(hub_kernels, "_KERNEL_MAPPING_CACHE", None)
        yield


@pytest.fixture
def fresh_dynamo(tmp_path, monkeypatch):
    """Dynamo's caches and hf_tpu's compile counters start empty and are cleared afterwards; Dynamo's saved
    packages (torch's caching precompile, on once a process uses tpu) go to the test's own directory, so that a
    function compiled by an earlier test (``Sequential.forward``, say) is traced, not loaded."""
    from torch._dynamo import package

    from hf_tpu.compile import reset_compile_stats

    monkeypatch.setattr(package.DynamoCache, "path_prefix", lambda: str(tmp_path / "dynamo"))

    torch._dynamo.reset()
    reset_compile_stats()
    yield
    _import_what_inductor_resets_with()
    torch._dynamo.reset()


def _import_what_inductor_resets_with() -> None:
    """torch's reset of an Inductor backend with CUDA graphs (``mode="reduce-overhead"``, transformers' default
    ``CompileConfig``) first imports ``torch._inductor.cudagraph_trees``, whose import registers a backend in the
    dict ``torch._dynamo.reset`` is iterating ("dictionary changed size during iteration"); imported before, it
    registers nothing then."""
    from torch._dynamo import eval_frame

    if any(isinstance(backend, torch._TorchCompileInductorWrapper) for backend in eval_frame.cached_backends.values()):
        importlib.import_module("torch._inductor.cudagraph_trees")


@pytest.fixture
def cpu_and_tpu():
    return check_against_cpu
