"""kernels (the Hugging Face kernels library, checked against 0.17.2, 0.18.3 and 0.19.1): errors that say what to
do where the tpu device meets them, ``LOCAL_KERNELS`` for versioned layer repositories, and names for function
modules.

kernels 0.19 moved its modules under ``kernels._internals`` (``kernels/resolver.py`` became
``kernels/_internals/resolver.py``, and so on); :func:`internal_module` finds them in either place. Files named
below are relative to that package.

:func:`install` wraps some of kernels' internal functions (looked up at call time). Each error wrapper runs the
original unchanged and, only when it fails in one of the cases below, raises the same exception type (so
``KernelizeFallback`` and callers' ``except`` clauses behave as before) with a message saying what to do,
chained to kernels' own:

- a kernel that is not in the local Hub cache while kernels only reads the cache (``HF_HUB_OFFLINE=1``;
  ``resolver.py``, ``resolve_hub_cache_kernel``): kernels says so but not where it looked nor how to get the
  kernel there. From 0.18 a branch or tag name that the cache has no ref for fails before, in ``_versions.py``
  (``_resolve_ref``), with a message that says to download the kernel while online: left alone;
- a repository without a build for the tpu backend (``resolve_hub_kernel``, ``resolve_local_kernel``):
  kernels lists the builds it rejected, not the ones the tpu device loads;
- ``python-depends`` naming JAX or libtpu (``python_deps.py``, ``validate_dependencies``, called through the
  name ``validate.py`` imports): kernels calls them "unsupported" although they are installed, because its
  dependency list (``python_depends.json``) has no tpu entries;
- a kernel layer whose ``has_backward`` / ``can_torch_compile`` rules out the mode asked of ``kernelize``
  (``layer/layer.py``, ``_conditionally_replace_forward``): before 0.19 kernels' "Available kernel does not
  support mode" names neither the layer nor the reason. 0.19 names both ("Function/layer from repo ... does not
  support backward, needed for mode ..."), and that message is left alone;
- the same, for a layer registered for a mode it does not support (``layer/layer.py``,
  ``_validate_layer_has_mode``, before 0.19): kernels raises even where ``use_fallback`` allows its fallback.
  0.19 removed that check: such a layer falls back as ``use_fallback`` says, or raises the message above.

Errors kernels already words well are left alone: ``version=`` missing from an offline cache, publishers
that are not trusted (``trust_remote_code``), optional dependencies that are not installed.

It also makes ``LayerRepository`` with ``version=`` honour ``LOCAL_KERNELS`` as ``get_kernel(version=)`` does
in kernels 0.17 (``layer/layer.py``, ``select_revision_or_version``, and ``load.py``): kernels looks the version
up on the Hub (or, offline, in the cache: "Version 1 ... is not available in the local cache") before reaching
the override that makes the lookup moot. From 0.18 ``LayerRepository.load`` passes ``version=`` to
``get_kernel``, whose ``LOCAL_KERNELS`` resolver comes first, and the function is gone.

And it gives the module class that ``use_kernel_forward_from_hub`` makes of a decorated function
(``layer/layer.py``, ``_create_func_module``: a class defined inside that function, in 0.19 too) a name in the
module of that function, so that torch's caching precompile can save guards on it (Dynamo refuses classes
"defined in local scope", and transformers decorates ``apply_rotary_pos_emb`` so). The class stays in that
module, where kernels 0.18 on put it (``__module__``; their instances pickle by the function's name there);
0.17 leaves it in ``layer/layer.py``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
from types import ModuleType
from typing import Any, Callable

from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError

_WRAPPED = "_hf_tpu_bridge"
_NO_VARIANT = "Cannot find a build variant"  # how kernels' resolvers start that message
_UNSUPPORTED_MODE = "Available kernel does not support mode"  # before 0.19; 0.19 names the layer and the reason
_JAX_STACK = ("jax", "jaxlib", "libtpu")


def internal_module(kernels_module: ModuleType, name: str) -> ModuleType:
    """kernels' internal module ``name`` (``"resolver"``, ``"layer.layer"``, ...): ``kernels._internals.<name>``
    from kernels 0.19 on, ``kernels.<name>`` before."""
    package = kernels_module.__name__
    if importlib.util.find_spec(f"{package}._internals") is not None:
        package = f"{package}._internals"
    return importlib.import_module(f"{package}.{name}")


def install(kernels_module: ModuleType) -> None:
    """Applies the changes listed in this module's docstring to ``kernels_module`` (the imported ``kernels``
    package). Idempotent; other errors and all other calls are unchanged."""
    resolver, validate, layer = (internal_module(kernels_module, name)
                                 for name in ("resolver", "validate", "layer.layer"))
    patches = [
        (resolver, "resolve_hub_cache_kernel", _explain_cache_lookup),
        (resolver, "resolve_hub_kernel", _explain_missing_variant),
        (resolver, "resolve_local_kernel", _explain_missing_variant),
        (validate, "validate_dependencies", _explain_dependencies),
        (layer, "_conditionally_replace_forward", _explain_requested_mode),
    ]
    if hasattr(layer, "_validate_layer_has_mode"):  # before 0.19
        patches.append((layer, "_validate_layer_has_mode", _explain_registered_mode))
    for module, name, explain in patches:
        _wrap(module, name, functools.partial(explain, kernels_module))
    if hasattr(layer, "select_revision_or_version"):  # 0.17
        _skip_version_lookup_for_local_kernels(layer, internal_module(kernels_module, "load"))
    _name_function_modules(layer)


def _wrap(module: ModuleType, name: str, explain: Callable[[Exception, dict[str, Any]], Exception | None]) -> None:
    """Replaces ``module.name`` (looked up there at call time by kernels) with a wrapper raising
    ``explain(error, arguments)`` from the original's error, where that gives an exception."""
    original = getattr(module, name)
    if getattr(original, _WRAPPED, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except (FileNotFoundError, ValueError) as error:
            clearer = explain(error, signature.bind(*args, **kwargs).arguments)
            if clearer is None:
                raise
            raise clearer from error

    setattr(wrapper, _WRAPPED, True)
    setattr(module, name, wrapper)


def _skip_version_lookup_for_local_kernels(module: ModuleType, load: ModuleType) -> None:
    """Makes ``module.select_revision_or_version`` answer the version's branch name (``v<N>``, kernels' naming)
    without a lookup for a repository that ``LOCAL_KERNELS`` maps to a directory, which ignores revisions."""
    original = module.select_revision_or_version
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def select_revision_or_version(repo_id: str, *, revision: str | None, version: int | None,
                                   local_files_only: bool) -> str:
        if revision is None and version is not None and repo_id in _local_kernels(load):
            return f"v{version}"
        return original(repo_id, revision=revision, version=version, local_files_only=local_files_only)

    setattr(select_revision_or_version, _WRAPPED, True)
    module.select_revision_or_version = select_revision_or_version


def _name_function_modules(module: ModuleType) -> None:
    """Makes ``module._create_func_module(func)`` return its class under a name in ``func``'s module derived from
    ``func``'s qualified name (the same in every process that imports ``func``)."""
    original = module._create_func_module
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def _create_func_module(func: Callable) -> type:
        cls = original(func)
        home = sys.modules.get(func.__module__)
        if "<locals>" in cls.__qualname__ and home is not None:
            cls.__name__ = cls.__qualname__ = re.sub(r"\W", "_", f"_hf_tpu_Func_{func.__qualname__}")
            cls.__module__ = func.__module__
            setattr(home, cls.__name__, cls)
        return cls

    setattr(_create_func_module, _WRAPPED, True)
    module._create_func_module = _create_func_module


def _local_kernels(load: ModuleType) -> dict[str, Any]:
    """``LOCAL_KERNELS`` as kernels parses it at each call (repository id -> directory)."""
    overrides = os.environ.get("LOCAL_KERNELS")
    return load._parse_local_kernel_overrides(overrides) if overrides else {}


def _is_tpu(kernels_module: ModuleType, backend: Any) -> bool:
    """Whether kernels resolves for the tpu backend (``backend``: None, a name, or a kernels Backend)."""
    if backend is None or isinstance(backend, str):
        backend = internal_module(kernels_module, "backends")._select_backend(backend)
    return backend.name == "tpu"


def _explain_cache_lookup(kernels_module: ModuleType, error: Exception, call: dict[str, Any]) -> Exception | None:
    if isinstance(error, FileNotFoundError) and isinstance(error.__cause__, LocalEntryNotFoundError):
        resolver = internal_module(kernels_module, "resolver")
        read_at_import = hasattr(resolver, "CACHE_DIR")  # KERNELS_CACHE: read once in 0.17, at each call from 0.18
        cache = (resolver.CACHE_DIR if read_at_import else resolver._get_cache_dir()) or constants.HF_HUB_CACHE
        repo_id = call["repo_id"]
        return FileNotFoundError(
            f"Kernel repository '{repo_id}' (revision: {call['revision']}) is not in the local Hub cache {cache}, "
            "and this lookup does not download (HF_HUB_OFFLINE=1, or load_kernel). Run the same call once with "
            "network access (HF_HUB_OFFLINE unset) to download it; or point HF_HUB_CACHE (or KERNELS_CACHE"
            f"{', set before kernels is imported' if read_at_import else ''}) at the cache that holds it; or load a "
            f'local copy with LOCAL_KERNELS="{repo_id}=/path/to/repo" or get_local_kernel(path).'
        )
    return _explain_missing_variant(kernels_module, error, call)


def _explain_missing_variant(kernels_module: ModuleType, error: Exception, call: dict[str, Any]) -> Exception | None:
    if not (isinstance(error, FileNotFoundError) and str(error).startswith(_NO_VARIANT)):
        return None
    if not _is_tpu(kernels_module, call["backend"]):
        return None
    return FileNotFoundError(
        f"{error}\n\nThe tpu device loads `build/torch-tpu` builds (also arch-specific `torch<version>-tpu-...` "
        "ones, or a legacy `torch-universal`), and this kernel has none. Use a "
        'revision or repository with a TPU build (kernel-builder: `backends = ["tpu"]`), or load its CPU build '
        'with `backend="cpu"` and call it on CPU tensors.'
    )


def _explain_dependencies(kernels_module: ModuleType, error: Exception, call: dict[str, Any]) -> Exception | None:
    provided = [name for name in call["dependencies"] if name in _JAX_STACK]
    if not (isinstance(error, ValueError) and provided and _is_tpu(kernels_module, call["backend"])):
        return None
    listed = ", ".join(f"`{name}`" for name in provided)
    return ValueError(
        f"Kernel `{call['kernel_module_name']}` lists {listed} in `python-depends`, which kernels "
        f"{kernels_module.__version__} rejects for the tpu backend (its dependency list has no tpu entries). "
        "The tpu device runs on JAX, so a TPU kernel imports jax without declaring it: remove "
        f"{listed} from `python-depends` in the kernel's build/<variant>/metadata.json (or ask its author to), "
        'and meanwhile load a copy fixed that way with get_local_kernel(path) or LOCAL_KERNELS="org/name=/path".'
    )


def _unsupported(kernels_module: ModuleType, layer: type, mode: Any) -> list[str]:
    """What ``layer`` lacks for ``mode``, by the two flags kernels reads (same defaults as kernels)."""
    mode_enum = kernels_module.Mode
    missing = []
    if mode_enum.TRAINING in mode and not getattr(layer, "has_backward", True):
        missing.append("has no backward (has_backward=False), which Mode.TRAINING needs")
    if mode_enum.TORCH_COMPILE in mode and not getattr(layer, "can_torch_compile", False):
        missing.append("cannot be compiled (can_torch_compile is not True), which Mode.TORCH_COMPILE needs")
    return missing


def _explain_registered_mode(kernels_module: ModuleType, error: Exception, call: dict[str, Any]) -> Exception | None:
    layer, mode = call["module"], call["repo_mode"]
    missing = _unsupported(kernels_module, layer, mode)
    if not (isinstance(error, ValueError) and missing):
        return None
    return ValueError(
        f"Kernel layer `{layer.__name__}` from {call['repo']} is registered for `{call['layer_name']}` with "
        f"mode {mode}, but it {' and '.join(missing)}. Register it only for the modes it supports (for a layer "
        'without backward: {"tpu": {Mode.INFERENCE: repository}}), or map a kernel layer that supports this mode.'
    )


def _explain_requested_mode(kernels_module: ModuleType, error: Exception, call: dict[str, Any]) -> Exception | None:
    host, layer, mode = type(call["module"]), call["layer"], call["mode"]
    missing = _unsupported(kernels_module, layer, mode)
    if not (isinstance(error, ValueError) and str(error).startswith(_UNSUPPORTED_MODE) and missing):
        return None
    return ValueError(
        f"kernelize(mode={mode}) cannot give `{host.__name__}` (kernel layer name "
        f"`{getattr(host, 'kernel_layer_name', '?')}`) the forward of kernel layer `{layer.__name__}`: it "
        f"{' and '.join(missing)}. Kernelize with a mode it supports (e.g. Mode.INFERENCE), map a kernel layer "
        f"that supports this mode, or pass use_fallback=True to keep `{host.__name__}`'s own forward in this mode."
    )
