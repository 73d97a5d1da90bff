"""Warm start: what AOTAutograd makes of a Dynamo graph, kept on disk for the next process.

torch's AOTAutogradCache stores, per Dynamo graph, AOTAutograd's result: the forward and backward
ATen graphs with the runtime metadata its wrappers need (input mutations, aliased outputs, which
inputs need gradients). It serves any backend whose compilers return an ``OutputCode`` that can be
pickled (the "bundled" entries): :class:`TpuOutputCode` is graph mode's, holding the ATen graph
(pickled with its fake-tensor metadata by torch's ``GraphPickler``) and lowering it again when loaded.
A second process then skips AOTAutograd's tracing, partitioning and decompositions.

The key is torch's hash (its pickler) of the Dynamo graph's code, the inputs' shapes, strides, dtypes,
devices and gradient flags and AOTAutograd's options, with grad mode, autocast, torch's version,
hf_tpu's environment variables, the platform and :func:`cache_tag` (hf_tpu's sources, JAX's and jaxlib's
versions): a change to any of them misses. An entry that cannot be read or lowered is ignored by torch
(the graph is traced again); nothing is read or written when ``HF_TPU_CACHE_DIR=off``.
Entries live in torch's cache directory (``TORCHINDUCTOR_CACHE_DIR``, by default
``/tmp/torchinductor_$USER``) under ``aotautograd``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import os
import sys
from typing import Any, Callable, Iterator, Sequence

import torch
import torch._functorch.config
from torch._functorch._aot_autograd import autograd_cache
from torch._inductor.output_code import OutputCode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._mode_utils import no_dispatch

from ..backend import runtime
from .stats import count

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def cache_tag() -> str:
    """What beyond torch's own key decides an entry: a hash of hf_tpu's Python sources (every lowering
    and decomposition choice is there) and the versions of JAX and jaxlib."""
    digest = hashlib.sha256()
    for directory, folders, files in sorted(os.walk(_PACKAGE)):
        folders.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                digest.update(os.path.relpath(path, _PACKAGE).encode())
                with open(path, "rb") as source:
                    digest.update(source.read())
    for package in ("jax", "jaxlib"):
        digest.update(f"{package}={importlib.metadata.version(package)}".encode())
    return "hf_tpu-" + digest.hexdigest()[:32]


def enabled() -> bool:
    """Whether compiled graphs are kept across processes (off with ``HF_TPU_CACHE_DIR=off``)."""
    return runtime.compilation_cache_dir() is not None


@contextlib.contextmanager
def caching() -> Iterator[None]:
    """Around AOTAutograd for a tpu graph: bundled AOTAutogradCache entries (the whole result in the
    entry, as :class:`TpuOutputCode` needs) under graph mode's key (:func:`cache_key`).

    torch's own key also hashes Inductor's configuration, which first imports every Inductor code
    generator (about a second in a new process): a tpu graph never reaches Inductor. Dynamo compiles
    one frame at a time (under its compile lock), so the key function is swapped for this call only.
    The backward graph is lowered with the forward (lowering only prepares the graph; XLA compiles it at
    its first run), so that the entry, saved when both are compiled, is saved before this call returns.
    """
    if not enabled():
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield
        return
    original = autograd_cache.autograd_cache_key
    autograd_cache.autograd_cache_key = cache_key
    try:
        with torch._functorch.config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True):
            yield
    finally:
        autograd_cache.autograd_cache_key = original


class _KeyDetails:
    """Everything an entry depends on besides the Dynamo graph and its inputs' metadata, for hashing."""

    def __init__(self, graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any], aot_config: Any) -> None:
        self.graph_module, self.example_inputs, self.aot_config = graph_module, list(example_inputs), aot_config
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = {device: torch.get_autocast_dtype(device) for device in torch._C._autocast_supported_devices()
                         if torch.is_autocast_enabled(device)}
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.default_dtype = torch.get_default_dtype()
        self.functorch_config = torch._functorch.config.save_config()
        self.user_tag = torch.compiler.config.cache_key_tag
        self.sac_hashes = autograd_cache._collect_context_fn_hashes(graph_module)
        self.hook_hashes = _saved_tensors_hooks_hashes(graph_module)
        self.versions = (sys.version, torch.__version__, torch.version.git_version, cache_tag())
        # the chips and hf_tpu's switches (kernel choices, checks, platform) may shape the traced graph
        self.device = (runtime.backing_platform(), len(runtime.devices()))
        self.environment = {name: os.environ.get(name) for name in runtime.VARIABLES if name != "HF_TPU_CACHE_DIR"}


def _saved_tensors_hooks_hashes(graph_module: torch.fx.GraphModule) -> tuple[list[str], ...]:
    """The cache hashes of the user's wrapped saved-tensors hooks, pack and unpack, as torch keys them (torch 2.13
    has a helper for this; 2.11 computes it inside Inductor's key)."""
    hooks = (getattr(graph_module, f"saved_tensors_hooks_{kind}_0", None) for kind in ("pack", "unpack"))
    return tuple([node.meta["user_cache_hash"] for node in hook.graph.nodes if node.meta.get("is_wrapped", False)]
                 if hook is not None else [] for hook in hooks)


def cache_key(graph_module: Any, example_inputs: Sequence[Any], aot_config: Any,
              compiler_config_extra: Any = None) -> tuple[str, list[str]]:
    """The AOTAutogradCache key of a tpu graph: torch's hash of the Dynamo graph's code, its inputs'
    shapes, strides, dtypes, devices and gradient flags and AOTAutograd's options, with :class:`_KeyDetails`
    (grad mode, autocast, torch's and hf_tpu's versions, the platform, hf_tpu's environment variables) in
    place of Inductor's configuration."""
    gm = graph_module.gm if isinstance(graph_module, torch._dynamo.utils.GmWrapper) else graph_module
    with autograd_cache.sanitize_gm_for_cache(gm):
        autograd_cache.check_cacheable(gm)
        details = _KeyDetails(gm, example_inputs, aot_config)
        return _KEY_PREFIX + autograd_cache.AOTAutogradCachePickler(gm).get_hash(details), []


_LOWERING_METADATA = frozenset({"val"})  # what graph_lowering reads of a node's metadata: its traced value
_KEY_PREFIX = "atpu"  # apart from Inductor's entries ("a...")


class TpuOutputCode(OutputCode):
    """One ATen graph of AOTAutograd's result, run by graph mode (boxed: ``fn(list_of_inputs)``).

    ``lower`` turns the graph into the callable; it runs when the graph is compiled and again when the
    entry is loaded in another process, so a loaded graph runs exactly what a freshly compiled one does.
    """

    def __init__(self, graph_module: torch.fx.GraphModule, lower: Callable[[torch.fx.GraphModule], Callable]) -> None:
        self._graph_module: torch.fx.GraphModule | None = graph_module
        self._serialized: bytes | None = None
        self._lower = lower
        self._run: Callable | None = lower(graph_module)
        self._boxed_call = True

    def __call__(self, inputs: Sequence[Any]) -> Any:
        return self._run(inputs)

    def prepare_for_serialization(self) -> None:
        """Called on a copy before it is pickled: keeps the graph as bytes, drops what is not picklable."""
        from torch.fx._graph_pickler import Options

        options = Options(ops_filter=None, node_metadata_key_filter=_LOWERING_METADATA.__contains__)
        self._serialized = _pickler().dumps(self._graph_module, options)
        self._graph_module = self._run = None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        """Called when an entry is loaded: rebuilds the graph under the current fake mode and lowers it."""
        if self._run is not None:
            return
        from torch._guards import detect_fake_mode
        from torch._subclasses import FakeTensorMode

        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
        self._graph_module = _pickler().loads(self._serialized, fake_mode)
        self._graph_module.recompile()  # its Python code, which a graph run eagerly (a fallback) needs
        self._run = self._lower(self._graph_module)
        count("warm_starts")

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass  # no Triton kernels on tpu


@functools.cache
def _pickler() -> type:
    """torch's ``GraphPickler`` (fake tensors, ops, symbolic sizes), with the graph's tpu constants kept
    as host copies that go back to their chip when loaded (a tpu storage has no host memory to pickle)."""
    from torch.fx._graph_pickler import GraphPickler

    class Pickler(GraphPickler):
        def reducer_override(self, obj: object) -> Any:
            if isinstance(obj, FakeTensor) and _described_by_layout(obj):
                return _fake_tensor, (tuple(obj.shape), obj.stride(), obj.dtype, str(obj.device), obj.requires_grad,
                                      self._unpickle_state)
            if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.device.type == "tpu":
                with unset_fake_temporarily():
                    return _to_device, (obj.detach().cpu(), str(obj.device), obj.requires_grad)
            return super().reducer_override(obj)

    return Pickler


def _described_by_layout(fake: FakeTensor) -> bool:
    """Whether a node's value is all graph mode reads of it, its shape, strides and dtype: then it is kept as those
    (a symbolic size as torch's pickler keeps one, its expression in the loader's shape environment) and made again
    as an empty fake tensor (:func:`_fake_tensor`). torch's own description of a fake tensor (views, bases) takes
    about a millisecond per node to rebuild, most of a loaded entry's time (0.75-0.99 s of a restarted
    ``benchmarks/continuous_batching.py`` run's two symbolic-size graphs, 0.35-0.37 s as layouts). A size read
    from a tensor (an unbacked symbol) keeps torch's description."""
    sizes = (*fake.shape, *fake.stride())
    return fake.layout == torch.strided and all(isinstance(n, (int, torch.SymInt)) for n in sizes) \
        and not free_unbacked_symbols(fake)


def _fake_tensor(shape: tuple, stride: tuple, dtype: torch.dtype, device: str, requires_grad: bool,
                 state: Any) -> FakeTensor:
    with no_dispatch():  # as torch's GraphPickler makes its fake tensors: a meta tensor under the loader's mode
        fake = FakeTensor(state.fake_mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"),
                          torch.device(device))
    return fake.requires_grad_(requires_grad) if requires_grad else fake


def _to_device(host: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    with unset_fake_temporarily():  # entries are saved and loaded while AOTAutograd's fake mode is on
        return host.to(device).requires_grad_(requires_grad)
