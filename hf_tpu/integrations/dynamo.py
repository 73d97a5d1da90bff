"""torch._dynamo (checked against torch 2.13): its caching precompile, on in every process that uses the device,
so that a new process skips Dynamo's tracing of an HF model's compiled forward, without losing a guard.

With ``torch._dynamo.config.caching_precompile`` on, torch keeps what Dynamo made of a compiled function (its
bytecode, guards and the backend's AOTAutograd entries) in ``TORCHINDUCTOR_CACHE_DIR/dynamo``, keyed by the
function's qualified name and first line, and installs it when ``torch.compile`` wraps the same function, in a
new process or again in this one (the sources of the functions it inlined are checked first: an edited one drops
the package).

- **On by default where the device is used**: torch leaves it off unless ``TORCH_CACHING_PRECOMPILE=1``; it is turned
  on when the process first uses the device, so a ``torch.compile`` made after that keeps its package (a process that
  never uses tpu is left as torch has it), in every thread (:func:`_set_default`). ``TORCH_CACHING_PRECOMPILE=0``,
  ``HF_TPU_CACHE_DIR=off`` or torch's ``force_disable_caches`` leave it off, and so does a torchrun launch
  (``WORLD_SIZE`` set). Only a compile whose backend reaches hf_tpu (``eval_frame._optimize``: ``"tpu"``, or Inductor)
  and that is not ``fullgraph=True`` keeps a package: a package stands in for the backend in later compiles of the
  function, and torch 2.13 raises "found no compiled frames" when a loaded entry serves a ``fullgraph`` call.
- **Dynamo's profile kept with it** (``torch/_dynamo/pgo.py``, ``get_cache_key``): torch keeps which inputs changed
  between calls only under a job id; hf_tpu names one (``hf_tpu``) when the user has not, so that a process that
  installs a package also knows which int inputs were dynamic (see :func:`_on_in_processes_using_tpu`).
- **A package made from other sources** (``CompilePackage.initialize``): a function the saved compile inlined
  that has changed since (an upgrade of the library that holds it), another torch, or a module a saved source
  check names that this process lacks (kernels' generated ones): torch logged a warning with its traceback ("Failed
  to load entry from dynamo cache"), or raised ``ModuleNotFoundError`` from ``torch.compile``. It is a cache
  miss, logged at info: the package starts empty, as torch's recovery makes it, and the function is traced.
- **Every guard kept** (``torch/_dynamo/guards.py``, ``CheckFunctionManager.__init__``): torch drops the guards
  it cannot save while precompile is on (identity guards: on globals, closures, classes, modules), in the
  compiling process too, so a function patched after the first call was not traced again. Here the compiling
  process keeps them all, as without precompile.
- **Identity guards saved by fingerprint** (``CheckFunctionManager.serialize_guards``): an identity guard over a
  module, class, builtin, enum member, function without a closure (a function's code, for torch's closure
  guard) or an instance that its class's module holds by name (the module kernels makes of
  ``apply_rotary_pos_emb``, which kernels 0.18 on guard by identity) is saved as :func:`_is_the_same_object`:
  when the package is loaded, the object the guard's source finds in the new process must have the saved
  :func:`_fingerprint` (module, qualified name, code's file name and first line; for an instance its class's
  and the name), and the loaded guard is identity with it. A function patched in before the new process
  compiles has another fingerprint: that entry never runs, and Dynamo traces. A compile with any other guard
  torch cannot save (on an arbitrary object's identity, a dict's version) is left out of the package (``_NOT_SAVED``;
  ``CompilePackage.add_guarded_code``): torch's own bypass asserts in 2.13 and would drop the function's other
  entries, in later processes too. A package that cannot be installed (a saved value missing, or a guard that
  cannot be built in this process, say) is undone and fails as torch's recovery expects
  (``CompilePackage.install``: a ``RuntimeError``, after which torch starts the package again, empty), so the
  function is traced; a cache miss, logged at info (torch logged the guard as an error, with its traceback).
- **Functions a package cannot name** (``CompilePackage._add_user_function``): a frame Dynamo compiles on its own
  (after a graph break) whose function torch cannot find by name, a property's getter such as transformers'
  ``loss_function``, failed the compile (``PackageError``). It is compiled and left out of the package, which
  then traces it in the next process.
- **Names a package installs** (``CompilePackage._install_global``): a loaded package puts its resume functions
  in their module under the names the saving process drew (``__resume_at_60_2``), and a frame of that module
  traced afterwards drew the same name from this process's counter ("Name '__resume_at_60_2' already exists
  in scope"): the counter moves past each loaded name here. A name installed twice in a module (an import two
  of the package's functions share) was listed twice, so undoing a failed install removed it twice
  (``KeyError``) and left the package half installed; and undoing it removed a name that was there before
  (an import that code traced in this process uses: ``NameError``). A name is listed here only when the
  package put it there, once; a name that holds another function already fails the install (it is undone and
  the function traced) rather than replace that function under its callers; and an undone install
  also removes what it gave the package's nested functions (torch resets only the compiled function's own code,
  so the next call of a nested function ran a loaded entry whose globals were gone: ``NameError``).

Apart from precompile:

- **A compiled optimizer step keeps its step counts on the chip** (``torch/_dynamo/variables/optimizer.py``,
  ``OptimizerVariable._set_capturable``): Dynamo makes an optimizer whose parameters are on cuda or xpu
  capturable when it compiles its step (before the optimizer's state exists), so that the step counts are device
  tensors; a tpu optimizer kept them on the CPU, and every compiled step read each to the chip and copied it back
  (a host sync each: 14 ms of a 45 ms AdamW training step of a 4-layer Llama). Parameters all on tpu count too.

For an HF model it fails in more ways, each changed here where the failure is (a no-op for everything else),
plus when to write:

- **Decorated functions in guards** (``torch/_dynamo/guards.py``, ``GuardsStatePickler.reducer_override``): a
  function that cannot be found again by its module and qualified name is saved as a placeholder, so loading a
  guard over it fails. The function a ``functools.wraps`` decorator wraps is such a function (the wrapper holds
  its name), and transformers' ``deprecate_kwarg`` reads its ``__name__`` ("'_Missing' object has no attribute
  '__name__'"). Such a function is saved here as the object it is: the ``__wrapped__`` of what its name finds
  (:func:`_wrapped`).
- **Tensors marked static or dynamic** (the same ``reducer_override``): a saved guard's tensor is rebuilt without
  the markings of ``torch._dynamo.mark_static`` / ``mark_dynamic`` (attributes of the tensor), and its guard then
  refuses every tensor that has them ("_has_dynamo_dim_marking is present on runtime tensor but was absent at
  compile time": continuous batching's cache, marked static, was traced again in every process). The markings
  are saved with the tensor here (:func:`_marked`).
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
- **The device of a graph with symbolic sizes** (``CompilePackage.update_device_type``): torch takes a package's
  device from the first value of its graph, which for a graph compiled with ``dynamic=True`` is a size (a
  ``SymInt``, taken for "cpu"): a tpu package (continuous batching's steps) was never written. Here it is the
  device of the graph's first tensor.
- **When to write**: torch writes packages only when asked (``torch.compiler.save_cache_artifacts()``, every
  package recorded so far); a package holding a tpu graph is written as soon as Dynamo records it
  (``DynamoCache.record_package``), that package alone, unless ``HF_TPU_CACHE_DIR=off``, so the next process
  finds it without a call.

One change is not about precompile: **tpu_dist groups in traced code on torch 2.11**
(``torch/_dynamo/variables/distributed.py``, ``ProcessGroupVariable.is_process_group``): torch 2.11 takes a value
for a process group only if its type is ``ProcessGroup`` itself, so a ``tpu_dist`` group (a subclass) was traced as
a plain object, and a functional collective over it broke the graph at its ``group_name`` ("Attempted to call
function marked as skipped"). Any ``ProcessGroup`` is one here. torch 2.13 has no such check (a no-op there).
"""


from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import inspect
import itertools
import logging
import os
import pickle
import sys
import threading
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
    _patch(guards.GuardsStatePickler, "reducer_override", _saving_wrapped_functions_and_dim_markings)
    _patch(package.CompilePackage, "_add_function", _in_the_module_it_runs_in)
    _patch(codegen.PyCodegen, "create_load_python_module", _recording_the_import)
    _patch(output_graph.OutputGraph, "install_global", _skipping_names_in_use)
    _patch(package.DynamoCache, "record_package", _written_when_recorded)
    _patch(package.CompilePackage, "update_device_type", _from_the_first_tensor)
    _patch(guards.CheckFunctionManager, "__init__", _keeping_every_guard)
    _patch(package.CompilePackage, "install", _undone_when_it_fails)
    _patch(package.CompilePackage, "initialize", _empty_when_it_fails)
    _patch(package.CompilePackage, "add_guarded_code", _leaving_out_unsaved_compiles)
    _patch(guards.CheckFunctionManager, "serialize_guards", _saving_identity_guards_by_fingerprint)
    _patch(package.CompilePackage, "_add_user_function", _leaving_out_functions_it_cannot_name)
    _patch(package.CompilePackage, "_install_global", _listing_each_name_once_past_the_counter)
    _patch(importlib.import_module("torch._dynamo.eval_frame"), "_optimize", _only_for_backends_that_run_on_tpu)
    _accept_process_group_subclasses(importlib.import_module("torch._dynamo.variables.distributed"))
    _patch(importlib.import_module("torch._dynamo.variables.optimizer").OptimizerVariable, "_set_capturable",
           _capturable_on_tpu)
    from ..backend import runtime

    runtime.when_first_used(_on_in_processes_using_tpu)


_PROFILE_JOB = "hf_tpu"


def _on_in_processes_using_tpu() -> None:
    """Turns torch's caching precompile on once the process uses the device, unless the user chose
    (``TORCH_CACHING_PRECOMPILE`` set, either way), turned disk caches off (``HF_TPU_CACHE_DIR=off``, torch's
    ``force_disable_caches``) or the process is one of a torchrun launch (``WORLD_SIZE``: its warm runs crashed in
    ``init_device_mesh``, not understood yet).

    With it, Dynamo's profile of which inputs changed between calls (``torch._dynamo.pgo``'s local profile) is kept
    too, under the job id ``hf_tpu`` unless the user set ``torch.compiler.config.job_id``: a new process installs
    the saved frames of a function, and without the profile it traced each new value of an int input (a slice's
    position) as a constant again, adding one frame per value and process, where the first process had made the
    input dynamic at its second value."""
    from ..backend import runtime

    compiler_config = importlib.import_module("torch.compiler.config")
    if ("TORCH_CACHING_PRECOMPILE" in os.environ or "WORLD_SIZE" in os.environ
            or runtime.compilation_cache_dir() is None or compiler_config.force_disable_caches):
        return
    _set_default(importlib.import_module("torch._dynamo.config"), "caching_precompile", True)
    if compiler_config.job_id is None:
        _set_default(compiler_config, "job_id", _PROFILE_JOB)


def _set_default(config: types.ModuleType, name: str, value: Any) -> None:
    """Sets a torch config's default, for every thread: since torch 2.13 a value set on a config module is the
    setting thread's only (a context variable), and a compile in another thread (continuous batching's
    generation loop, a server's request threads) saw torch's default. A value a thread sets keeps precedence."""
    entry = getattr(config, "_config", {}).get(name)
    if entry is None or not hasattr(config, "_hash_dirty_var"):  # before torch 2.13: one value for every thread
        setattr(config, name, value)
        return
    entry.default = value
    config._hash_dirty_var.set(True)
    config._mark_get_dict_dirty(name)


def _patch(owner: Any, name: str, change: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return
    patched = functools.wraps(original)(change(original))
    setattr(patched, _PATCHED, True)
    setattr(owner, name, patched)


def _capturable_on_tpu(set_capturable: Callable) -> Callable:
    """``OptimizerVariable._set_capturable`` making a group of tpu parameters capturable, as Dynamo makes a group
    of cuda ones (see the docstring)."""
    def set_capturable_on_tpu(self: Any, tx: Any) -> None:
        optimizer = self.value
        for group in optimizer.param_groups:
            params = group.get("params", [])
            if ("capturable" in group and params and all(param.device.type == "tpu" for param in params)
                    and not any(param in optimizer.state for param in params)):
                group["capturable"] = True
        set_capturable(self, tx)

    return set_capturable_on_tpu


def _accept_process_group_subclasses(distributed: types.ModuleType) -> None:
    """torch 2.11's ``ProcessGroupVariable.is_process_group`` taking any ``ProcessGroup`` (see the docstring)."""
    variable = getattr(distributed, "ProcessGroupVariable", None)
    original = getattr(variable, "is_process_group", None)
    if original is None or getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def is_process_group(value: object) -> bool:
        import torch.distributed as dist

        return original(value) or (dist.is_available() and isinstance(value, dist.ProcessGroup))

    setattr(is_process_group, _PATCHED, True)
    variable.is_process_group = staticmethod(is_process_group)


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


def _saving_wrapped_functions_and_dim_markings(original: Callable) -> Callable:
    def reducer_override(self: Any, obj: Any) -> Any:
        if inspect.isfunction(obj) and id(obj) not in self.missing_values and id(obj) not in self.empty_values:
            depth = _depth_below_its_name(obj)
            if depth:
                return _wrapped, (obj.__module__, obj.__qualname__, depth)
        reduced = original(self, obj)
        if isinstance(reduced, tuple) and getattr(obj, "_has_dynamo_dim_marking", False):
            # what torch._dynamo.mark_static / mark_dynamic / mark_unbacked set on the tensor: its attributes named
            # _dynamo_* and the _has_dynamo_dim_marking flag
            markings = {name: value for name, value in vars(obj).items() if name.startswith(_MARKING_PREFIXES)}
            return _marked, (reduced[0], reduced[1], markings)
        return reduced
    return reducer_override


_MARKING_PREFIXES = ("_dynamo_", "_has_dynamo_")


def _marked(rebuild: Callable, args: tuple, markings: dict[str, Any]) -> Any:
    """A saved guard's tensor, rebuilt with the dimension markings it had (see the docstring)."""
    tensor = rebuild(*args)
    for name, value in markings.items():
        setattr(tensor, name, value)
    return tensor


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

        entry = package.cache_entry()
        if entry.device_type != "tpu" or runtime.compilation_cache_dir() is None:
            return
        from torch._dynamo import package as packages
        from torch._dynamo.precompile_context import PrecompileContext

        try:  # this package only: torch's save_to_dynamo_cache writes every package recorded so far, each time
            saved = packages.PrecompileCacheEntry.from_cache_entry(entry, PrecompileContext._backend_artifacts_by_key)
            packages.DynamoCache.write(saved, package.source_id)
        except Exception as error:  # the compiled function runs on; only the next process traces it again
            warnings.warn(f"hf_tpu: torch's caching precompile could not save {entry.fn_name} "
                          f"({type(error).__name__}: {error}); the next process traces it again.", stacklevel=2)
    return record_package


def _from_the_first_tensor(original: Callable) -> Callable:
    def update_device_type(self: Any, graph: Any) -> None:
        import torch

        original(self, graph)
        for node in () if graph is None else graph.nodes:
            value = node.meta.get("example_value", node.meta.get("val"))
            if isinstance(value, torch.Tensor):
                self._device_type = value.device.type
                return
    return update_device_type


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


def _only_for_backends_that_run_on_tpu(original: Callable) -> Callable:
    def _optimize(rebuild_ctx: Any, backend: Any = "inductor", *args: Any, **kwargs: Any) -> Any:
        config = importlib.import_module("torch._dynamo.config")
        if (config.caching_precompile and "TORCH_CACHING_PRECOMPILE" not in os.environ
                and (kwargs.get("nopython") or not _runs_on_tpu(backend))):
            with config.patch(caching_precompile=False):
                return original(rebuild_ctx, backend, *args, **kwargs)
        return original(rebuild_ctx, backend, *args, **kwargs)
    return _optimize


def _runs_on_tpu(backend: Any) -> bool:
    """Whether ``torch.compile``'s ``backend`` sends tpu graphs to hf_tpu: ``"tpu"``, or Inductor (which hands
    them on); a package made with any other backend would stand in for it in later compiles."""
    from ..compile import tpu_backend

    name = backend if isinstance(backend, str) else getattr(backend, "compiler_name", None)
    return name in ("tpu", "inductor") or getattr(backend, "compiler_fn", backend) is tpu_backend


def _leaving_out_functions_it_cannot_name(original: Callable) -> Callable:
    def _add_user_function(self: Any, code: types.CodeType) -> None:
        from torch._dynamo.exc import PackageError

        try:
            original(self, code)
        except PackageError as error:  # a property's getter, say: compiled, but left out of the package
            _log.info("hf_tpu: a function is left out of its package (%s)", error)
            module = inspect.getmodule(code) or sys.modules[self._innermost_fn.__module__]
            self._add_function(code, module.__name__)
            self._codes[code].bypassed = True
    return _add_user_function


def _listing_each_name_once_past_the_counter(original: Callable) -> Callable:
    def _install_global(self: Any, module: types.ModuleType, name: str, value: Any) -> None:
        if name in self._installed_globals.get(module, ()):
            module.__dict__[name] = value
        elif name in module.__dict__:  # not listed as this package's: undoing the install leaves the name
            if _another_function(module.__dict__[name], value):
                raise RuntimeError(f"{module.__name__}.{name} is another function in this process")
            module.__dict__[name] = value
        else:
            original(self, module, name, value)
        _draw_later_names_past(name)
    return _install_global


def _another_function(existing: Any, value: Any) -> bool:
    """Whether a name a package installs holds another function already (a resume function this process drew
    the same name for before loading the package): the package is then not installed, rather than have that
    function's callers run the package's."""
    return (isinstance(existing, types.FunctionType) and isinstance(value, types.FunctionType)
            and existing.__code__ != value.__code__)


def _draw_later_names_past(name: str) -> None:
    """Moves the counter of Dynamo's generated names (``unique_id``) past a loaded name's number, so that a frame
    this process traces does not draw the name a package put in the same module (``__resume_at_60_2``)."""
    number = name.rpartition("_")[2]
    if number.isdigit():
        names = importlib.import_module("torch._dynamo.bytecode_transformation")
        names._unique_id_counter = itertools.count(max(next(names._unique_id_counter), int(number) + 1))


def _saved_form(builder: Any, guard: Any) -> Any:
    """``guard`` as a package saves it: an identity guard over a module, class, builtin, function without a
    closure, enum member or module-level instance, and a guard over a function's code, become
    :func:`_is_the_same_object` (checked against this process's object when the package is loaded); any other
    guard is left as it is (torch refuses to save the identity guards left, and the frame is then not saved)."""
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
    builtin, enum member, function without a closure (whose code the package's source checks cover), or an
    instance that its class's module holds by name."""
    if isinstance(value, types.FunctionType):
        return value.__closure__ is None
    return (inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value)
            or isinstance(value, enum.Enum) or _module_level_name(value) is not None)


def _module_level_name(value: Any) -> str | None:
    """The name under which the module of ``value``'s class holds ``value`` itself (an instance made when the
    module is imported, such as the module kernels makes of a decorated function), else None."""
    module = sys.modules.get(getattr(type(value), "__module__", None) or "")
    return next((name for name, held in list(vars(module).items()) if held is value), None) if module else None


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
    if not (inspect.isclass(value) or inspect.isroutine(value)):
        return ("instance", _fingerprint(type(value)), _module_level_name(value))
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


class _NotFromThisThread(logging.Filter):
    """Drops the records the thread that made it logs."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


def _undone_when_it_fails(original: Callable) -> Callable:
    def install(self: Any, backends: dict) -> None:
        if self.__dict__.pop("_hf_tpu_nothing_to_install", False):
            return
        # a saved guard that cannot be built here (a global list shorter in this process, say) is logged by torch
        # as an error with its traceback before the install fails: here it is the cache miss logged below
        guard_errors = logging.getLogger("torch._guards")
        quiet = _NotFromThisThread()
        guard_errors.addFilter(quiet)
        try:
            original(self, backends)
        except Exception as error:  # a saved value missing here, say: Dynamo traces the function instead
            self.uninstall()
            _forget_entries_of_every_code(self)
            # torch's own recovery (initializing the package again, empty) after logging the error as a warning
            # with its traceback, for what is a cache miss
            self._initialized = False
            self.initialize(self._innermost_fn, None, ignore_inlined_sources=False)
            _log.info("hf_tpu: a saved Dynamo package of %s cannot be installed in this process (%s: %s); "
                      "Dynamo traces it", getattr(self._innermost_fn, "__qualname__", "?"), type(error).__name__, error)
        finally:
            guard_errors.removeFilter(quiet)
    return install


def _empty_when_it_fails(original: Callable) -> Callable:
    def initialize(self: Any, fn: Any, dynamo: Any = None, *args: Any, **kwargs: Any) -> None:
        if dynamo is None:
            return original(self, fn, dynamo, *args, **kwargs)
        try:
            original(self, fn, dynamo, *args, **kwargs)
        except Exception as error:  # changed sources, another torch, a module gone (kernels' generated ones)
            _log.info("hf_tpu: a saved Dynamo package of %s was made from other sources than this process has "
                      "(%s: %s); Dynamo traces it", getattr(fn, "__qualname__", "?"), type(error).__name__, error)
            original(self, fn, None, *args, **kwargs)  # torch's own recovery, after a warning with a traceback
            self._hf_tpu_nothing_to_install = True  # as after torch's recovery, which installs nothing
    return initialize


def _forget_entries_of_every_code(package: Any) -> None:
    """Removes what a failed install gave each of the package's functions (torch's ``uninstall`` resets only the
    compiled function's own code, so a nested function kept entries that call globals it removed)."""
    from torch._C._dynamo.eval_frame import _reset_precompile_entries
    from torch._dynamo.package import _lookup_code

    for code, entry in package._codes.items():
        _reset_precompile_entries(code)
        if entry.code_source:
            try:
                _reset_precompile_entries(_lookup_code(entry))
            except (AttributeError, KeyError, AssertionError):  # the function is not there: nothing was installed
                pass
