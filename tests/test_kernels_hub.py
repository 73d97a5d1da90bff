"""The ``kernels`` library's own Hub loader on tpu, offline, with kernel repositories written here.

``get_kernel`` / ``get_local_kernel`` / ``LayerRepository`` / ``LocalLayerRepository`` / ``LOCAL_KERNELS`` and
``kernelize(model, device="tpu", mode=...)`` load ``build/torch-tpu`` kernels written for TorchTPU (``from
torch_tpu._internal.pallas import jax_op``, Pallas kernels with no ``interpret=``); every kernel result is
compared with the same computation on CPU. Hub repositories are put in a local Hub cache laid out as
huggingface_hub writes one, so kernels resolves them exactly as after a download: offline, and (for
``trust_remote_code``) online against a stand-in Hub answering from that cache. The errors a user can
meet are checked for a message that says what to do (some worded by :mod:`hf_tpu.integrations.kernels`,
installed when kernels is imported).

Where kernels and huggingface_hub read their settings: huggingface_hub reads ``HF_HOME`` / ``HF_HUB_CACHE`` /
``HF_HUB_OFFLINE`` into ``huggingface_hub.constants`` when it is imported, and kernels reads those constants
at each call; kernels 0.17 reads ``KERNELS_CACHE`` once when imported (the snapshot directory) but again at each
call for ``version=`` lookups (0.18 on: always at each call), and ``LOCAL_KERNELS`` at each call. Tests therefore
patch the constants (and the environment, for what reads it later) and leave ``KERNELS_CACHE`` unset.

kernels 0.19 moved its modules under ``kernels._internals``; the tests reach them through
:func:`hf_tpu.integrations.kernels.internal_module`, and run against 0.17.2, 0.18.3 and 0.19.1.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from huggingface_hub import constants, hf_hub_download, scan_cache_dir, snapshot_download
from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision, _create_symlink, repo_folder_name
from huggingface_hub.hf_api import RepoFolder
from huggingface_hub.utils.sha import git_hash
from packaging.version import Version
from torch import nn

import kernels
from kernels import (
    KernelizeFallback,
    LayerRepository,
    LocalLayerRepository,
    Mode,
    get_kernel,
    get_local_kernel,
    kernelize,
    use_kernel_forward_from_hub,
    use_kernel_mapping,
)

from hf_tpu.integrations import kernels as kernels_integration
from hf_tpu.integrations.kernels import internal_module

KERNELS = Version(kernels.__version__)

# --- Fixture kernel sources ------------------------------------------------------------------------------
# kernels imports a repository's package under its metadata id, which every written repository gets anew, so
# the ops' namespace (the package name) is new too and no op is registered twice.

_RELU_OPS = '''
"""A Pallas ReLU written for TPUs, as in kernels-test/relu-tpu: TorchTPU's jax_op and no interpret flag."""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from torch_tpu._internal.pallas import jax_op


def _relu_kernel(x_ref, out_ref):
    out_ref[...] = jnp.maximum(x_ref[...], jnp.zeros((), x_ref.dtype))


@jax_op(__name__.rpartition(".")[0] + "::relu")
def relu(x: jax.Array) -> jax.Array:
    return pl.pallas_call(_relu_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
'''

_RELU_LAYERS = '''
import torch
from torch import nn

from ._ops import relu


class ReLU(nn.Module):
    can_torch_compile = True
    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu(x)
'''

_NORM_OPS = '''
"""RMSNorm (plain JAX: gradients from jax.vjp) and a Pallas SiluAndMul (forward only), written for TorchTPU."""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from torch_tpu._internal.pallas import jax_op

_NAMESPACE = __name__.rpartition(".")[0]


@jax_op(_NAMESPACE + "::rms_norm")
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    hidden = x.astype(jnp.float32)
    variance = jnp.mean(hidden * hidden, axis=-1, keepdims=True)
    return weight * (hidden * jax.lax.rsqrt(variance + jnp.float32(eps))).astype(x.dtype)


def _silu_and_mul_kernel(gate_ref, up_ref, out_ref):
    gate = gate_ref[...]
    out_ref[...] = gate * jax.nn.sigmoid(gate) * up_ref[...]


@jax_op(_NAMESPACE + "::silu_and_mul")
def silu_and_mul(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (half,), x.dtype)
    return pl.pallas_call(_silu_and_mul_kernel, out_shape=out)(x[..., :half], x[..., half:])
'''

_NORM_LAYERS = '''
import torch
from torch import nn

from ._ops import rms_norm, silu_and_mul


class RMSNorm(nn.Module):
    weight: torch.Tensor
    variance_epsilon: float
    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class SiluAndMul(nn.Module):
    can_torch_compile = True
    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class EagerSiluAndMul(nn.Module):
    """Differentiable, but not declared compilable (can_torch_compile defaults to False)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]
'''

_CPU_RELU_OPS = """
import torch


def relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)
"""

_INIT = "from . import layers\nfrom ._ops import *  # noqa: F401,F403\n"


def write_kernel_repo(root: Path, name: str, ops: str, layers: str, *, variant: str = "torch-tpu",
                      backend: str = "tpu", python_depends: tuple[str, ...] = ()) -> Path:
    """Writes ``root/build/<variant>/{metadata.json, <package>/...}`` (kernel-builder's layout) with a fresh
    metadata id; returns ``root``. Several variants can be written into one root."""
    build = root / "build" / variant
    package = build / name.replace("-", "_")
    package.mkdir(parents=True)
    metadata = {"id": f"_{name.replace('-', '_')}_{uuid.uuid4().hex[:10]}", "name": name, "version": 1,
                "license": "Apache-2.0", "backend": {"type": backend}, "python-depends": list(python_depends)}
    (build / "metadata.json").write_text(json.dumps(metadata))
    for filename, source in (("__init__.py", _INIT), ("_ops.py", ops), ("layers.py", layers)):
        (package / filename).write_text(source)
    return root


def new_commit() -> str:
    return uuid.uuid4().hex + uuid.uuid4().hex[:8]


def put_in_hub_cache(cache: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Stores ``source``'s files as commit ``commit`` of kernel repository ``repo_id`` the way a huggingface_hub
    download leaves them: under ``kernels--<org>--<name>`` (kernels downloads with ``repo_type="kernel"``),
    content-addressed blobs (git blob ids), a snapshot of relative symlinks to them, ``refs/<ref>`` files
    naming the commit and the commit's cached tree listing. Returns the snapshot."""
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="kernel")
    snapshot = storage / "snapshots" / commit
    listing = {}
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        relative, data = path.relative_to(source).as_posix(), path.read_bytes()
        blob = storage / "blobs" / git_hash(data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / relative).parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(snapshot / relative), new_blob=True)
        listing[relative] = TreeCacheEntry(size=len(data), blob_id=git_hash(data))
    for ref in refs:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)
    write_tree_cache(str(storage), commit, listing)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty local Hub cache in offline mode, with kernels' per-process layer cache emptied."""
    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    for name, value in (("HF_HOME", home), ("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("KERNELS_CACHE", raising=False)
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    resolver = internal_module(kernels, "resolver")
    if hasattr(resolver, "CACHE_DIR"):  # kernels 0.17: KERNELS_CACHE as read at import
        monkeypatch.setattr(resolver, "CACHE_DIR", None)
    monkeypatch.setattr(internal_module(kernels, "layer.layer"), "_CACHED_LAYER", {})
    return cache


@pytest.fixture
def sources(tmp_path):
    """Fixture repositories, written for each test: a metadata id, and so an op namespace, is imported once
    per process, and a test may import a repository from its directory or from a Hub cache copy of it."""
    root = tmp_path / "sources"
    cpu_and_cuda = write_kernel_repo(root / "cpu-cuda", "relu-tpu", _CPU_RELU_OPS, _RELU_LAYERS, variant="torch-cpu",
                                     backend="cpu")
    write_kernel_repo(cpu_and_cuda, "relu-tpu", _CPU_RELU_OPS, _RELU_LAYERS,
                      variant="torch213-cxx11-cu126-x86_64-linux", backend="cuda")
    return {"relu": write_kernel_repo(root / "relu", "relu-tpu", _RELU_OPS, _RELU_LAYERS),
            "norm": write_kernel_repo(root / "norm", "tiny-layers", _NORM_OPS, _NORM_LAYERS),
            "cpu_and_cuda": cpu_and_cuda}


# --- Host modules (the classes a library would decorate) ------------------------------------------------


@use_kernel_forward_from_hub("RMSNorm")
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(hidden_states.dtype)


@use_kernel_forward_from_hub("SiluAndMul")
class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class TinyMLP(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.act = SiluAndMul()
        self.down = nn.Linear(hidden, hidden)
        self.norm = RMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(self.act(self.up(x))))


def cpu_and_tpu_models() -> tuple[TinyMLP, TinyMLP]:
    torch.manual_seed(0)
    model = TinyMLP()
    return model, copy.deepcopy(model).to("tpu")


def layer_mapping(repository_for: dict, modes: dict | None = None) -> dict:
    """``{"RMSNorm": {"tpu": repo}, ...}``; with ``modes``, each repo registered for ``modes[name]``."""
    modes = modes or {}
    return {name: {"tpu": {modes[name]: repo} if name in modes else repo} for name, repo in repository_for.items()}


def uses_kernel(module: nn.Module, qualname: str) -> bool:
    """Whether kernelize gave ``module`` the forward of the kernel layer ``qualname`` instead of its class's."""
    forward = module.forward.__func__
    return forward is not type(module).forward and forward.__qualname__ == qualname


# --- Loading -----------------------------------------------------------------------------------------------


def test_get_kernel_resolves_the_hub_cache_offline(hub_cache, sources):
    commit = new_commit()
    snapshot = put_in_hub_cache(hub_cache, "hf-tpu-test/relu-tpu", sources["relu"], commit, refs=("main", "v1"))
    (cached,) = scan_cache_dir(hub_cache).repos  # huggingface_hub reads the layout back
    assert (cached.repo_id, cached.repo_type) == ("hf-tpu-test/relu-tpu", "kernel")
    assert [(r.commit_hash, r.refs) for r in cached.revisions] == [(commit, frozenset({"main", "v1"}))]
    assert snapshot_download("hf-tpu-test/relu-tpu", repo_type="kernel", local_files_only=True) == str(snapshot)

    assert kernels.has_kernel("hf-tpu-test/relu-tpu", revision="main")
    relu = get_kernel("hf-tpu-test/relu-tpu", revision="main")
    assert Path(relu.__file__) == snapshot / "build" / "torch-tpu" / "relu_tpu" / "__init__.py"
    assert get_kernel("hf-tpu-test/relu-tpu", revision=commit) is relu
    assert get_kernel("hf-tpu-test/relu-tpu", version=1) is relu

    x = torch.randn(16, 128)
    out = relu.relu(x.to("tpu"))
    assert out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), torch.relu(x))
    compiled = torch.compile(lambda a: relu.relu(a * 2) + 1, backend="tpu", fullgraph=True)
    torch.testing.assert_close(compiled(x.to("tpu")).cpu(), torch.relu(x * 2) + 1)


def test_layer_repository_with_pinned_revision_kernelizes_for_tpu(hub_cache, sources):
    commit = new_commit()
    put_in_hub_cache(hub_cache, "hf-tpu-test/tiny-layers", sources["norm"], commit)
    repos = {name: LayerRepository("hf-tpu-test/tiny-layers", layer_name=name, revision=commit)
             for name in ("RMSNorm", "SiluAndMul")}
    reference, model = cpu_and_tpu_models()
    with use_kernel_mapping(layer_mapping(repos), inherit_mapping=False):
        assert kernelize(model, device="tpu", mode=Mode.INFERENCE) is model
    assert uses_kernel(model.norm, "RMSNorm.forward") and uses_kernel(model.act, "SiluAndMul.forward")
    x = torch.randn(8, 128)
    with torch.no_grad():
        torch.testing.assert_close(model(x.to("tpu")).cpu(), reference(x), atol=1e-5, rtol=1e-5)


def test_kernelize_without_device_uses_the_tpu_of_the_parameters(hub_cache, sources):
    assert hasattr(torch.backends, "tpu") and internal_module(kernels, "backends")._backend().name == "tpu"
    repos = {"RMSNorm": LocalLayerRepository(repo_path=sources["norm"], layer_name="RMSNorm")}
    reference, model = cpu_and_tpu_models()
    with use_kernel_mapping(layer_mapping(repos), inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE)
    assert uses_kernel(model.norm, "RMSNorm.forward")
    assert not uses_kernel(model.act, "SiluAndMul.forward")  # no mapping: its own forward stays
    x = torch.randn(8, 128)
    with torch.no_grad():
        torch.testing.assert_close(model(x.to("tpu")).cpu(), reference(x), atol=1e-5, rtol=1e-5)


def test_local_kernels_override_the_hub(hub_cache, sources, monkeypatch):
    monkeypatch.setenv("LOCAL_KERNELS", f"hf-tpu-test/not-in-cache={sources['relu']}")
    relu = get_kernel("hf-tpu-test/not-in-cache", revision="main")
    assert Path(relu.__file__).is_relative_to(sources["relu"])
    assert get_local_kernel(sources["relu"]) is relu  # the same build directory: imported once
    x = torch.randn(8, 128)
    torch.testing.assert_close(relu.relu(x.to("tpu")).cpu(), torch.relu(x))

    @use_kernel_forward_from_hub("ReLU")
    class HostReLU(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x)

    model = nn.Sequential(nn.Linear(128, 128), HostReLU())
    tpu_model = copy.deepcopy(model).to("tpu")
    # kernels itself would look version 1 up in the (empty) offline cache first; hf_tpu skips that
    repo = LayerRepository("hf-tpu-test/not-in-cache", layer_name="ReLU", version=1)
    with use_kernel_mapping({"ReLU": {"tpu": repo}}, inherit_mapping=False):
        kernelize(tpu_model, device="tpu", mode=Mode.INFERENCE)
    assert uses_kernel(tpu_model[1], "ReLU.forward")
    with torch.no_grad():
        torch.testing.assert_close(tpu_model(x.to("tpu")).cpu(), model(x))


def test_torch_compile_mode_kernels_stay_in_the_compiled_program(hub_cache, sources):
    repos = {name: LocalLayerRepository(repo_path=sources["norm"], layer_name=name)
             for name in ("RMSNorm", "SiluAndMul")}
    reference, model = cpu_and_tpu_models()
    with use_kernel_mapping(layer_mapping(repos), inherit_mapping=False):
        kernelize(model, device="tpu", mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
    kernel_ops = {f"{get_local_kernel(sources['norm']).__name__}.{op}.default" for op in ("rms_norm", "silu_and_mul")}
    x = torch.randn(8, 128)
    torch._dynamo.reset()
    torch.tpu.reset_compile_stats()
    compiled = torch.compile(model, backend="tpu", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x.to("tpu")).cpu(), reference(x), atol=1e-5, rtol=1e-5)
        stats = torch.tpu.compile_stats()
        assert stats["graphs"] == 1 and stats["fallbacks"] == 0
        explained = torch._dynamo.explain(model)(x.to("tpu"))
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    targets = {str(node.target) for node in explained.graphs[0].graph.nodes}
    assert kernel_ops <= targets, targets


def test_training_mode_compiled_gradients_match_cpu(hub_cache, sources):
    norm = LocalLayerRepository(repo_path=sources["norm"], layer_name="RMSNorm")
    act = LocalLayerRepository(repo_path=sources["norm"], layer_name="SiluAndMul")  # forward only
    mapping = layer_mapping({"RMSNorm": norm, "SiluAndMul": act},
                            {"RMSNorm": Mode.TRAINING | Mode.TORCH_COMPILE, "SiluAndMul": Mode.INFERENCE})
    reference, model = cpu_and_tpu_models()
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, device="tpu", mode=Mode.TRAINING | Mode.TORCH_COMPILE)
    assert uses_kernel(model.norm, "RMSNorm.forward")
    assert not uses_kernel(model.act, "SiluAndMul.forward")  # registered for inference only: falls back
    x = torch.randn(8, 128)
    reference(x).square().mean().backward()
    compiled = torch.compile(model, backend="tpu", fullgraph=True)
    compiled(x.to("tpu")).square().mean().backward()
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(actual.grad.cpu(), expected.grad, atol=1e-5, rtol=1e-4, msg=name)


_FRESH_PROCESS = """
import torch
from kernels import get_kernel
relu = get_kernel("hf-tpu-test/relu-tpu", revision="main")
x = torch.randn(8, 128)
torch.testing.assert_close(relu.relu(x.to("tpu")).cpu(), torch.relu(x))
print(relu.__file__)
"""


def test_environment_variables_set_before_import(tmp_path, sources):
    cache = tmp_path / "home" / "hub"
    snapshot = put_in_hub_cache(cache, "hf-tpu-test/relu-tpu", sources["relu"], new_commit())
    env = {key: value for key, value in os.environ.items() if key not in ("KERNELS_CACHE", "LOCAL_KERNELS")}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.strip().splitlines()[-1]).is_relative_to(snapshot)


# --- Errors ------------------------------------------------------------------------------------------------


def test_missing_repository_offline(hub_cache):
    commit = new_commit()
    assert not kernels.has_kernel("hf-tpu-test/missing", revision=commit)
    with pytest.raises(FileNotFoundError) as raised:
        get_kernel("hf-tpu-test/missing", revision=commit)
    message = str(raised.value)
    for part in (f"'hf-tpu-test/missing' (revision: {commit}) is not in the local Hub cache", str(hub_cache),
                 "HF_HUB_OFFLINE unset", 'LOCAL_KERNELS="hf-tpu-test/missing=/path/to/repo"'):
        assert part in message, message
    # kernels' own message for a version that the offline cache has no ref for is already clear
    with pytest.raises(ValueError, match="not available in the local cache.*Download the kernel while online"):
        get_kernel("hf-tpu-test/missing", version=1)
    # a branch name: kernels 0.17 looks the snapshot up under it (hf_tpu's message), 0.18 on first resolves the
    # name to a commit from the cache's refs, and says so as clearly as for a version
    if KERNELS < Version("0.18"):
        with pytest.raises(FileNotFoundError, match="'hf-tpu-test/missing' .revision: main. is not in the local"):
            get_kernel("hf-tpu-test/missing", revision="main")
    else:
        with pytest.raises(ValueError, match="Cannot resolve revision 'main'.*Download the kernel while online"):
            get_kernel("hf-tpu-test/missing", revision="main")

    _, model = cpu_and_tpu_models()
    repo = LayerRepository("hf-tpu-test/missing", layer_name="RMSNorm", revision=commit)
    with use_kernel_mapping({"RMSNorm": {"tpu": repo}}, inherit_mapping=False):
        with pytest.raises(FileNotFoundError, match="not in the local Hub cache"):
            kernelize(model, device="tpu", mode=Mode.INFERENCE)
        kernelize(model, device="tpu", mode=Mode.INFERENCE, use_fallback=KernelizeFallback.ALL)
    assert not uses_kernel(model.norm, "RMSNorm.forward")


def test_repository_without_tpu_build(hub_cache, sources):
    put_in_hub_cache(hub_cache, "hf-tpu-test/cpu-cuda", sources["cpu_and_cuda"], new_commit())
    assert not kernels.has_kernel("hf-tpu-test/cpu-cuda", revision="main")
    loaders = (lambda: get_kernel("hf-tpu-test/cpu-cuda", revision="main"),
               lambda: get_local_kernel(sources["cpu_and_cuda"]))
    for load in loaders:
        with pytest.raises(FileNotFoundError) as raised:
            load()
        message = str(raised.value)
        for part in ("torch-cpu: backend (cpu) does not match system backend (tpu)",
                     "backend (cu126) does not match selected backend (tpu)",
                     "The tpu device loads `build/torch-tpu` builds", 'backend="cpu"'):
            assert part in message, message
    # The way out the message names: the CPU build, on CPU tensors.
    cpu_build = get_kernel("hf-tpu-test/cpu-cuda", revision="main", backend="cpu")
    assert "torch-cpu" in Path(cpu_build.__file__).parts
    x = torch.randn(8, 128)
    torch.testing.assert_close(cpu_build.relu(x), torch.relu(x))


@pytest.mark.parametrize("mode, registered, flag", [
    (Mode.TRAINING, Mode.TRAINING, "has_backward=False"),
    (Mode.TRAINING, None, "has_backward=False"),
    (Mode.INFERENCE | Mode.TORCH_COMPILE, None, "can_torch_compile is not True"),
])
def test_kernel_layer_that_does_not_support_the_mode(hub_cache, sources, mode, registered, flag):
    """Before kernels 0.19 kernelize's refusal names neither the layer nor the reason (hf_tpu's message does), and a
    layer registered for a mode it lacks is refused even with use_fallback=True (hf_tpu's message says how to
    register it). kernels 0.19 names both itself, and falls back for the registered layer as use_fallback says."""
    layer_name = "EagerSiluAndMul" if Mode.TORCH_COMPILE in mode else "SiluAndMul"
    repos = {"SiluAndMul": LocalLayerRepository(repo_path=sources["norm"], layer_name=layer_name)}
    reference, model = cpu_and_tpu_models()
    with use_kernel_mapping(layer_mapping(repos, {"SiluAndMul": registered} if registered else None),
                            inherit_mapping=False):
        if KERNELS >= Version("0.19") and registered:
            kernelize(model, device="tpu", mode=mode, use_fallback=True)
            assert not uses_kernel(model.act, "SiluAndMul.forward")
        elif KERNELS >= Version("0.19"):
            reason = "backward" if Mode.TRAINING in mode else "torch.compile"
            with pytest.raises(ValueError, match=f"does not support {reason}, needed for mode") as raised:
                kernelize(model, device="tpu", mode=mode, use_fallback=False)
            assert f"layer `{layer_name}`" in str(raised.value) and raised.value.__cause__ is None  # kernels' own
        else:
            expected = "Register it only for the modes it supports" if registered else "use_fallback=True"
            with pytest.raises(ValueError, match=expected) as raised:
                kernelize(model, device="tpu", mode=mode, use_fallback=registered is not None)
            assert flag in str(raised.value) and f"`{layer_name}`" in str(raised.value)
        if registered is None:  # by default kernels keeps the module's own forward in that mode
            kernelize(model, device="tpu", mode=mode)
            assert not uses_kernel(model.act, "SiluAndMul.forward")
    x = torch.randn(8, 128)
    with torch.no_grad():
        torch.testing.assert_close(model(x.to("tpu")).cpu(), reference(x), atol=1e-5, rtol=1e-5)


def test_python_depends_that_cannot_be_met(tmp_path, hub_cache, monkeypatch):
    jax_listed = write_kernel_repo(tmp_path / "jax", "lists-jax", _RELU_OPS, _RELU_LAYERS, python_depends=("jax",))
    with pytest.raises(ValueError) as raised:
        get_local_kernel(jax_listed)
    message = str(raised.value)
    assert isinstance(raised.value.__cause__, ValueError)  # kernels' own "unsupported kernel dependency: jax"
    for part in ("`lists_jax` lists `jax` in `python-depends`", "rejects for the tpu backend",
                 "remove `jax` from `python-depends`", "LOCAL_KERNELS"):
        assert part in message, message

    # An allowed dependency that is not installed: kernels' own message says what to install.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "einops"
                        else find_spec(name, *args))
    einops_listed = write_kernel_repo(tmp_path / "einops", "lists-einops", _RELU_OPS, _RELU_LAYERS,
                                      python_depends=("einops",))
    with pytest.raises(ImportError, match="requires Python dependency `einops`. Please install with: pip install"):
        get_local_kernel(einops_listed)


class CachedHub:
    """Stands in for the Hub, online, for kernels: answers from the local Hub cache (as left by a download), and
    says the publisher is not trusted."""

    def __init__(self) -> None:
        self.publisher_lookups: list[str] = []

    def get_organization_overview(self, name: str) -> object:
        self.publisher_lookups.append(name)
        return SimpleNamespace(trustedKernelPublisher=False)

    def list_repo_tree(self, repo_id: str, *, path_in_repo: str, repo_type: str, revision: str) -> list:
        snapshot = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, local_files_only=True))
        return [RepoFolder(path=f"{path_in_repo}/{entry.name}", oid="0" * 40)
                for entry in (snapshot / path_in_repo).iterdir() if entry.is_dir()]

    def hf_hub_download(self, repo_id: str, *, local_files_only: bool, **kwargs) -> str:
        return hf_hub_download(repo_id, local_files_only=True, **kwargs)

    def snapshot_download(self, repo_id: str, *, local_files_only: bool, **kwargs) -> str:
        return snapshot_download(repo_id, local_files_only=True, **kwargs)


def test_trust_remote_code(hub_cache, sources, monkeypatch, caplog):
    commit = new_commit()
    put_in_hub_cache(hub_cache, "untrusted-org/tiny-layers", sources["norm"], commit)
    # Offline, kernels cannot ask the Hub about the publisher: it loads the cached kernel and says so.
    with caplog.at_level(logging.WARNING, logger=internal_module(kernels, "hf_hub").__name__):
        get_kernel("untrusted-org/tiny-layers", revision="main")
    assert "Skipping publisher trust check for 'untrusted-org/tiny-layers'" in caplog.text

    # Online, a publisher the Hub does not mark trusted is refused before anything is downloaded ...
    hub = CachedHub()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for module in ("hf_hub", "load"):
        monkeypatch.setattr(internal_module(kernels, module), "_get_hf_api", lambda *args, **kwargs: hub)
    with pytest.raises(ValueError, match="not from a trusted publisher. Set trust_remote_code=True or add the"):
        get_kernel("untrusted-org/tiny-layers", revision=commit)
    _, model = cpu_and_tpu_models()
    refused = LayerRepository("untrusted-org/tiny-layers", layer_name="RMSNorm", revision=commit)
    with use_kernel_mapping({"RMSNorm": {"tpu": refused}}, inherit_mapping=False):
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            kernelize(model, device="tpu", mode=Mode.INFERENCE)
    assert hub.publisher_lookups == ["untrusted-org", "untrusted-org"]

    # ... unless the caller opts in, for all repositories or for this one; the Hub's listing of builds then
    # resolves to build/torch-tpu.
    allowed = get_kernel("untrusted-org/tiny-layers", revision=commit, trust_remote_code=["untrusted-org/tiny-layers"])
    assert "torch-tpu" in Path(allowed.__file__).parts
    reference, model = cpu_and_tpu_models()
    trusted = LayerRepository("untrusted-org/tiny-layers", layer_name="RMSNorm", revision=commit,
                              trust_remote_code=True)
    with use_kernel_mapping({"RMSNorm": {"tpu": trusted}}, inherit_mapping=False):
        kernelize(model, device="tpu", mode=Mode.INFERENCE)
    assert uses_kernel(model.norm, "RMSNorm.forward") and len(hub.publisher_lookups) == 2
    x = torch.randn(8, 128)
    with torch.no_grad():
        torch.testing.assert_close(model(x.to("tpu")).cpu(), reference(x), atol=1e-5, rtol=1e-5)


@use_kernel_forward_from_hub("Doubled")
def doubled(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def test_function_modules_are_named_in_the_module_of_their_function():
    """kernels defines the module class it makes of a function inside a function; hf_tpu names it in the
    function's module, so that the class pickles and torch's caching precompile can save guards on it. The
    instance pickles by the function's name (kernels 0.18 on), and an identity guard on it (kernels 0.18 on
    take one in use_kernelized_func's forward) is saved by that name."""
    from hf_tpu.integrations import dynamo

    module_class = type(doubled)
    assert (module_class.__module__, module_class.__qualname__) == (__name__, "_hf_tpu_Func_doubled")
    assert getattr(sys.modules[__name__], module_class.__qualname__) is module_class
    assert pickle.loads(pickle.dumps(module_class)) is module_class
    if KERNELS >= Version("0.18"):
        assert pickle.loads(pickle.dumps(doubled)) is doubled
    assert dynamo._kept_by_fingerprint(doubled) and dynamo._fingerprint(doubled)[2] == "doubled"
    assert not dynamo._kept_by_fingerprint(module_class())  # another instance: no name holds it
    torch.testing.assert_close(doubled(torch.ones(2, device="tpu")).cpu(), torch.full((2,), 2.0))


def test_installed_with_kernels_and_idempotent():
    resolver = internal_module(kernels, "resolver")
    wrapped = resolver.resolve_hub_cache_kernel
    assert getattr(wrapped, "_hf_tpu_bridge", False)  # by the integration, when kernels was imported
    kernels_integration.install(kernels)
    assert resolver.resolve_hub_cache_kernel is wrapped
    assert wrapped.__wrapped__.__module__ == resolver.__name__
    # what later releases removed is wrapped where it exists: the mode check before 0.19, the version lookup in 0.17
    layer = internal_module(kernels, "layer.layer")
    assert hasattr(layer, "_validate_layer_has_mode") == (KERNELS < Version("0.19"))
    assert hasattr(layer, "select_revision_or_version") == (KERNELS < Version("0.18"))
    for name in ("_validate_layer_has_mode", "select_revision_or_version", "_conditionally_replace_forward",
                 "_create_func_module"):
        if hasattr(layer, name):
            assert getattr(getattr(layer, name), "_hf_tpu_bridge", False), name


def test_transformers_default_mapping_has_tpu_layers_only_where_pallas_kernels_run(monkeypatch):
    """transformers 5.25 kernelizes every from_pretrained model by default: off TPU chips, where hf_tpu's Pallas
    kernels run interpreted (far slower than XLA's ops), its mapping gets no tpu entries, unless HF_TPU_PALLAS=1."""
    from transformers.integrations import hub_kernels

    from hf_tpu.integrations.hub_kernels import _has_tpu_entry

    monkeypatch.setattr(hub_kernels, "_KERNEL_MAPPING_CACHE", None)
    assert not any(_has_tpu_entry(devices) for devices in hub_kernels.get_kernel_mapping_transformers().values())
    monkeypatch.setenv("HF_TPU_PALLAS", "1")
    monkeypatch.setattr(hub_kernels, "_KERNEL_MAPPING_CACHE", None)
    mapping = hub_kernels.get_kernel_mapping_transformers()
    assert _has_tpu_entry(mapping["RMSNorm"]) and _has_tpu_entry(mapping["SiLU"])
