"""torch._dynamo (checked against torch 2.13): what its caching precompile (``TORCH_CACHING_PRECOMPILE=1``) needs
to keep an HF model's compiled forward across processes, so that a new process skips Dynamo's tracing.

With that switch on, torch keeps what Dynamo made of a compiled function (its bytecode, guards and the backend's
AOTAutograd entries) in ``TORCHINDUCTOR_CACHE_DIR/dynamo``, keyed by the function's qualified name and first line,
and installs it when ``torch.compile`` wraps the same function in a new process. For an HF model it fails four
ways, each changed here where the failure is (a no-op for everything else), plus when to write:

- **Decorated functions in guards** (``torch/_dynamo/guards.py``, ``GuardsStatePickler.reducer_override``): a
  function that cannot be found again by its module and qualified name is saved as a placeholder, so loading a
  guard over it fails. The function a ``functools.wraps`` decorator wraps is such a function (the wrapper holds
  its name), and transformers' ``deprecate_kwarg`` reads its ``__name__`` ("'_Missing' object has no attribute
  '__name__'"). Such a function is saved here as the object it is: the ``__wrapped__`` of what its name finds
  (:func:`_wrapped`).
- **The module of the compiled code** (``torch/_dynamo/package.py``, ``CompilePackage._add_function``): the
  function's globals are taken to be those of the module ``fn.__module__`` names, but a decorated ``forward``'s
  wrapper runs in its decorator's module, so the loaded bytecode's imports are installed where it does not look
  (``NameError``). Here the module whose globals the code runs in.
- **Modules that generated code loads** (``torch/_dynamo/codegen.py``, ``PyCodegen.create_load_python_module``): a
  module that is not a global of the frame (``collections``, to rebuild a model output) is installed under an
  id-based name that the saved package does not list among its imports (``NameError`` when loaded). Recorded here.
- **Names of installed globals** (``torch/_dynamo/output_graph.py``, ``OutputGraph.install_global``): a loaded
  package puts its globals (``__builtins_dict___0``) in the module, and a frame traced afterwards in the same
  module (a recompile for another input shape) draws the same name from a counter that starts again in each
  process ("Name '__builtins_dict___0' already exists in scope"). Names already in the module are skipped here.
- **When to write**: torch writes packages only when asked (``torch.compiler.save_cache_artifacts()``); a package
  holding a tpu graph is written as soon as Dynamo records it (``DynamoCache.record_package``), unless
  ``HF_TPU_CACHE_DIR=off``, so the next process finds it without a call.

Caching precompile is torch's opt-in: it drops guards it cannot save (on closures and object identities; torch
logs each), so a compiled function whose closures or attention registry change between calls is not traced
again. hf_tpu leaves the choice to the user and does not turn it on.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
import warnings
from typing import Any, Callable

_PATCHED = "_hf_tpu_precompile"


def install(dynamo: types.ModuleType) -> None:
    """Applies the changes of this module's docstring to ``torch._dynamo``. Idempotent."""
    guards = importlib.import_module("torch._dynamo.guards")
    package = importlib.import_module("torch._dynamo.package")
    codegen = importlib.import_module("torch._dynamo.codegen")
    output_graph = importlib.import_module("torch._dynamo.output_graph")
    _patch(guards.GuardsStatePickler, "reducer_override", _saving_wrapped_functions_by_name)
    _patch(package.CompilePackage, "_add_function", _in_the_module_it_runs_in)
    _patch(codegen.PyCodegen, "create_load_python_module", _recording_the_import)
    _patch(output_graph.OutputGraph, "install_global", _skipping_names_in_use)
    _patch(package.DynamoCache, "record_package", _written_when_recorded)


def _patch(owner: Any, name: str, change: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return
    patched = functools.wraps(original)(change(original))
    setattr(patched, _PATCHED, True)
    setattr(owner, name, patched)


def _named(module: Any, qualname: str) -> Any:
    """What ``qualname`` names in ``module`` (``None`` where a part is missing)."""
    for part in qualname.split("."):
        module = getattr(module, part, None)
    return module


def _wrapped(module: str, qualname: str, depth: int) -> Callable:
    """The function ``depth`` steps down the ``__wrapped__`` chain of what ``module.qualname`` names."""
    function = _named(importlib.import_module(module), qualname)
    for _ in range(depth):
        function = function.__wrapped__
    return function


def _depth_below_its_name(function: types.FunctionType) -> int | None:
    """How many ``__wrapped__`` steps lead from what ``function``'s module and qualified name find to it."""
    found = _named(sys.modules.get(function.__module__), function.__qualname__)
    for depth in range(8):
        if found is function:
            return depth
        found = getattr(found, "__wrapped__", None)
    return None


def _saving_wrapped_functions_by_name(original: Callable) -> Callable:
    def reducer_override(self: Any, obj: Any) -> Any:
        if inspect.isfunction(obj) and id(obj) not in self.missing_values and id(obj) not in self.empty_values:
            depth = _depth_below_its_name(obj)
            if depth:
                return _wrapped, (obj.__module__, obj.__qualname__, depth)
        return original(self, obj)
    return reducer_override


def _in_the_module_it_runs_in(original: Callable) -> Callable:
    def _add_function(self: Any, python_code: types.CodeType, python_module: str, *args: Any, **kwargs: Any) -> Any:
        function = getattr(self._innermost_fn, "__func__", self._innermost_fn)
        if python_code is getattr(function, "__code__", None):
            python_module = function.__globals__.get("__name__", python_module)
        return original(self, python_code, python_module, *args, **kwargs)
    return _add_function


def _recording_the_import(original: Callable) -> Callable:
    def create_load_python_module(self: Any, mod: types.ModuleType) -> Any:
        instruction = original(self, mod)
        package = getattr(self.tx, "package", None)
        if package is not None and instruction.argval != mod.__name__.rpartition(".")[2]:
            package.add_import_source(instruction.argval, mod.__name__)
        return instruction
    return create_load_python_module


def _skipping_names_in_use(original: Callable) -> Callable:
    from torch._dynamo.bytecode_transformation import unique_id

    def install_global(self: Any, prefix: str, value: Any) -> str:
        name = unique_id(prefix)
        while name in self.global_scope:
            name = unique_id(prefix)
        self.install_global_unsafe(name, value)
        return name
    return install_global


def _written_when_recorded(original: Callable) -> Callable:
    def record_package(package: Any) -> None:
        original(package)
        from ..backend import runtime

        if package.cache_entry().device_type != "tpu" or runtime.compilation_cache_dir() is None:
            return
        from torch._dynamo.precompile_context import PrecompileContext

        try:
            PrecompileContext.save_to_dynamo_cache()
        except Exception as error:  # the compiled function runs on; only the next process traces it again
            warnings.warn(f"hf_tpu: torch's caching precompile could not save {package.cache_entry().fn_name} "
                          f"({type(error).__name__}: {error}); the next process traces it again.", stacklevel=2)
    return record_package
