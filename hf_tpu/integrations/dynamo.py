"""torch._dynamo (checked against torch 2.13): what its caching precompile (``TORCH_CACHING_PRECOMPILE=1``) needs
to keep an HF model's compiled forward across processes without losing a guard, so that a new process skips
Dynamo's tracing.

With that switch on, torch keeps what Dynamo made of a compiled function (its bytecode, guards and the
backend's AOTAutograd entries) in ``TORCHINDUCTOR_CACHE_DIR/dynamo``, keyed by the function's qualified name and
first line, and installs it when ``torch.compile`` wraps the same function in a new process (the sources of the
functions it inlined are checked first: an edited one drops the package).

- **Every guard kept** (``torch/_dynamo/guards.py``, ``CheckFunctionManager.__init__``): torch drops the guards
  it cannot save while precompile is on (identity guards: on globals, closures, classes, modules), in the
  compiling process too, so a function patched after the first call was not traced again. Here the compiling
  process keeps them all, as without precompile.
- **Identity guards saved by fingerprint** (``CheckFunctionManager.serialize_guards``): an identity guard over a
  module, class, builtin, enum member or function without a closure (a function's code, for torch's closure
  guard) is saved as :func:`_is_the_same_object`: when the package is loaded, the object the guard's source finds
  in the new process must have the saved :func:`_fingerprint` (module, qualified name, code's file name and first
  line), and the loaded guard is identity with it. A function patched in before the new process compiles has
  another fingerprint: that entry never runs, and Dynamo traces. A compile with any other guard torch cannot
  save (on an arbitrary object's identity, a dict's version) is left out of the package (``_NOT_SAVED``;
  ``CompilePackage.add_guarded_code``): torch's own bypass asserts in 2.13 and would drop the function's other
  entries, in later processes too. A package that cannot be installed (a saved value missing, say) is undone
  and fails as torch's recovery expects (``CompilePackage.install``: a ``RuntimeError``, after which torch
  starts the package again, empty), so the function is traced.

It stays the user's switch: turned on in every process using tpu, it failed 41 of the test suite's 2,859 tests
(saved values torch 2.13 cannot rebuild: a tensor's gradient, transformers' output recorders, kernels' generated
modules, process groups; tests expecting a second ``torch.compile`` of a function to call the backend).

For an HF model it fails four more ways, each changed here where the failure is (a no-op for everything else),
plus when to write:

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
"""


from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import inspect
import logging
import os
import pickle
import sys
import types
import warnings
from typing import Any, Callable

_PATCHED = "_hf_tpu_precompile"
_log = logging.getLogger(__name__)


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
    _patch(guards.CheckFunctionManager, "__init__", _keeping_every_guard)
    _patch(package.CompilePackage, "install", _undone_when_it_fails)
    _patch(package.CompilePackage, "add_guarded_code", _leaving_out_unsaved_compiles)
    _patch(guards.CheckFunctionManager, "serialize_guards", _saving_identity_guards_by_fingerprint)


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


def _keeping_every_guard(original: Callable) -> Callable:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = importlib.import_module("torch._dynamo.config")
        if not config.caching_precompile:
            return original(self, *args, **kwargs)
        with config.patch(caching_precompile=False):  # its only effect here: the guard filter
            return original(self, *args, **kwargs)
    return __init__


_IDENTITY_GUARDS = frozenset({"ID_MATCH", "CLASS_MATCH", "MODULE_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH"})


def _saving_identity_guards_by_fingerprint(original: Callable) -> Callable:
    def serialize_guards(self: Any, builder: Any, sorted_guards: list, output_graph: Any) -> bytes:
        from torch._dynamo.exc import PackageError
        from torch._dynamo.source import DictGetItemSource

        for guard in sorted_guards:  # builtins guarded by identity stay in the saved builtins, as BUILTIN_MATCH's
            if guard.create_fn_name() in _IDENTITY_GUARDS and isinstance(guard.originating_source, DictGetItemSource):
                self.used_builtin_vars.add(guard.originating_source.index)
        try:
            return original(self, builder, [_saved_form(builder, guard) for guard in sorted_guards], output_graph)
        except (PackageError, pickle.PicklingError, TypeError, AttributeError) as error:
            if importlib.import_module("torch._dynamo.config").strict_precompile:
                raise
            _log.info("hf_tpu: a compile is left out of its package: a guard cannot be saved (%s)", error)
            return _NOT_SAVED
    return serialize_guards


_NOT_SAVED = b""
"""The guard state of a compile whose guards cannot be saved: its package entry is left out, the package's
other entries for the same code are kept (torch's own bypass would drop them, in later processes too)."""


def _leaving_out_unsaved_compiles(original: Callable) -> Callable:
    def add_guarded_code(self: Any, guards_state: bytes, dynamo_code: types.CodeType) -> None:
        if guards_state != _NOT_SAVED:
            original(self, guards_state, dynamo_code)
    return add_guarded_code


def _saved_form(builder: Any, guard: Any) -> Any:
    """``guard`` as a package saves it: an identity guard over a module, class, builtin, function without a
    closure or enum member, and a guard over a function's code, become :func:`_is_the_same_object` (checked
    against this process's object when the package is loaded); any other guard is left as it is (torch refuses
    to save the identity guards left, and the frame is then not saved)."""
    kind = guard.create_fn_name()
    if kind not in _IDENTITY_GUARDS and kind not in ("CLOSURE_MATCH", "CONSTANT_MATCH"):
        return guard
    from torch._dynamo.source import AttrSource, GlobalSource, LocalSource

    value, source = builder.get(guard), guard.originating_source
    if kind == "CLOSURE_MATCH" and isinstance(value, types.FunctionType):
        if isinstance(source, (GlobalSource, LocalSource)) and not _pickled_as_itself(value):
            return guard  # the package would keep the function as missing: its guard could not be rebuilt
        value, source = value.__code__, AttrSource(source, "__code__")  # what torch's live guard compares
    elif kind == "CONSTANT_MATCH" and not isinstance(value, types.CodeType):
        return guard
    elif kind != "CONSTANT_MATCH" and not _kept_by_fingerprint(value):
        return guard
    return dataclasses.replace(guard, originating_source=source, guard_types=None, code_list=None, _hash=None,
                               create_fn=functools.partial(_is_the_same_object, _fingerprint(value)))


def _kept_by_fingerprint(value: Any) -> bool:
    """Whether another process's object with ``value``'s fingerprint is the same object: a module, class,
    builtin, enum member or function without a closure (whose code the package's source checks cover)."""
    if isinstance(value, types.FunctionType):
        return value.__closure__ is None
    return (inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value)
            or isinstance(value, enum.Enum))


def _pickled_as_itself(function: types.FunctionType) -> bool:
    """Whether a package keeps ``function`` itself (``GuardsStatePickler``: a nested function by value, one its
    name or a decorator's ``__wrapped__`` finds by name), not as missing."""
    return "<locals>" in function.__qualname__ or _depth_below_its_name(function) is not None


def _fingerprint(value: Any) -> tuple:
    """What makes an object in another process the one a guard saw: its module, qualified name and, for code,
    its file name and first line, so that another object put in its place (a patch) is not taken for it."""
    if inspect.ismodule(value):
        return ("module", value.__name__)
    if isinstance(value, types.CodeType):
        return ("code", os.path.basename(value.co_filename), value.co_qualname, value.co_firstlineno)
    if isinstance(value, enum.Enum):
        return ("enum", _fingerprint(type(value)), value.name)
    code = getattr(value, "__code__", None)
    return (type(value).__name__, getattr(value, "__module__", None), getattr(value, "__qualname__", None),
            _fingerprint(code) if isinstance(code, types.CodeType) else None)


_NOTHING_SAVED = object()
"""What a loaded identity guard compares with when another object has taken the saved one's place: no guarded
value is it, so the entry never runs and Dynamo traces the frame again."""


def _is_the_same_object(fingerprint: tuple, builder: Any, guard: Any) -> None:
    """Builds a loaded package's identity guard: the value is the object the guard's source finds in this
    process when the package is loaded, provided that object has the ``fingerprint`` the saved one had."""
    from torch._dynamo.guards import get_verbose_code_parts

    expected = builder.get(guard)
    if _fingerprint(expected) != fingerprint:
        expected = _NOTHING_SAVED
    code = f"___check_obj_id({builder.arg_ref(guard)}, {builder.id_ref(expected, guard.name)})"
    builder._set_guard_export_info(guard, [code], provided_func_name="ID_MATCH")
    builder.get_guard_manager(guard).add_id_match_guard(id(expected), get_verbose_code_parts(code, guard),
                                                        guard.user_stack)


def _undone_when_it_fails(original: Callable) -> Callable:
    def install(self: Any, backends: dict) -> None:
        try:
            original(self, backends)
        except Exception as error:  # a saved value missing here, say: Dynamo traces the function instead
            self.uninstall()
            self._initialized = False  # torch's recovery initializes the package again, empty
            raise RuntimeError(f"hf_tpu: a saved Dynamo package cannot be installed in this process "
                               f"({type(error).__name__}: {error})") from error
    return install
