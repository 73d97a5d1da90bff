"""Ahead-of-time packages: a ``torch.export`` program of a tpu model in one file, run without the model's code.

::

    exported = torch.export.export(model, args, kwargs)   # the model and the inputs on tpu
    hf_tpu.export.save(exported, "model.hftpu")
    program = hf_tpu.export.load("model.hftpu")             # any process: no model code, no tracing
    outputs = program(*args, **kwargs)

:func:`save` decomposes the program with graph mode's decompositions, lowers its graph with graph mode's
lowering (:mod:`hf_tpu.compile.graph_lowering`) to one JAX function of the weights and the inputs, and
exports that with ``jax.export`` for the platform behind the device (or the platforms asked for). The
package is a zip file of three members: ``program.jax`` (the serialized ``jax.export.Exported``),
``weights.safetensors`` (the parameters, buffers and constants the program takes as inputs) and
``manifest.json`` (the platforms, how the caller's inputs and outputs map to the program's, and the
messages of the program's index checks).
:func:`load` deserializes it, puts the weights on the device once and returns a :class:`LoadedProgram`.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import json
import os
import sys
import zipfile
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import jax
import safetensors.torch
import torch
from torch.utils import _pytree as pytree

from .backend import checks, dtypes, runtime, storage

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from .compile.graph_lowering import CompiledGraph

_FORMAT, _VERSION = "hf_tpu.export", 1
_MANIFEST, _PROGRAM, _WEIGHTS = "manifest.json", "program.jax", "weights.safetensors"
_WEIGHT_KINDS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")


class PackageError(ValueError):
    """A file that is not a readable package of :func:`save`, or inputs the package does not take."""


def save(exported: ExportedProgram, path: str | os.PathLike, *, platforms: Sequence[str] | None = None) -> None:
    """Writes ``exported`` (``torch.export.export`` of a model on tpu) and its weights as one package file.

    The program is lowered once, with static shapes: a package takes inputs of exactly the shapes and
    dtypes it was exported with, and the same values of non-tensor inputs. A program exported with
    ``dynamic_shapes`` (or with sizes read from tensor values) is refused: export it with static shapes,
    once per shape you need. So are random ops (dropout in train mode): export the model in eval mode.
    The package holds a copy of the weights as they are now. Updates of buffers (batch-norm statistics in
    train mode) and in-place updates of inputs are kept: they update the loaded weights and the caller's tensors.

    ``platforms`` are the JAX platforms the package is for (``"tpu"``, ``"cpu"``, ``"cuda"``), by default the
    one behind the tpu device now; a CPU host can write a package for TPU chips with ``platforms=["tpu"]``.
    """
    from .compile.backend import lower  # save only: loading needs neither graph mode nor torch.export

    _check_static(exported)
    decomposed = exported.run_decompositions(_decomposition_table())
    try:
        graph = lower(decomposed.graph_module)
        weights, inputs, program_inputs, static_values = _classify_inputs(decomposed)
        pure = graph.pure_function(tuple(static_values))
    except NotImplementedError as error:
        raise NotImplementedError(f"hf_tpu.export.save: {error}") from error

    def run(weight_arrays: tuple, input_arrays: tuple) -> tuple:
        sources = {"weight": weight_arrays, "input": input_arrays}
        # an exported program is functional: its updates of buffers and inputs are among its outputs
        outputs, _, check = pure(*(sources[kind][index] for kind, index in program_inputs))
        return outputs, check

    arguments = [tuple(_abstract(node) for node in nodes) for nodes in (weights.values(), _tensors(inputs))]
    platforms = [platform.lower() for platform in platforms] if platforms is not None else [_current_platform()]
    for_chips = runtime.lowering_for_tpu_chips() if platforms == ["tpu"] else contextlib.nullcontext()
    with for_chips:  # Pallas kernels (jax_op, Hub kernels) lowered by Mosaic for the chips, not interpreted
        jax_program = jax.export.export(jax.jit(run), platforms=platforms)(*arguments)
    outputs, updates = _describe_outputs(decomposed, graph, inputs, list(weights))
    manifest = {
        "format": _FORMAT, "version": _VERSION, "platforms": platforms,
        "in_spec": _encode_spec(decomposed.call_spec.in_spec), "inputs": [_describe_input(node) for node in inputs],
        "out_spec": _encode_spec(decomposed.call_spec.out_spec), "outputs": outputs, "updates": updates,
        "weights": _weight_keys(decomposed, weights),
        "messages": [[error.__name__, message] for error, message in checks.messages()],
    }
    tensors = _unique_weights(decomposed, weights)
    with zipfile.ZipFile(path, "w") as package:
        package.writestr(_MANIFEST, json.dumps(manifest, indent=1), zipfile.ZIP_DEFLATED)
        package.writestr(_PROGRAM, bytes(jax_program.serialize()), zipfile.ZIP_DEFLATED)
        package.writestr(_WEIGHTS, safetensors.torch.save(tensors))


def load(path: str | os.PathLike, device: torch.device | str = "tpu") -> LoadedProgram:
    """Reads a package written by :func:`save` and puts its weights on ``device``, ready to call.

    Raises :class:`PackageError` for a file that is not such a package, and ``RuntimeError`` if the
    package was exported for another platform than the one behind the tpu device.
    """
    return LoadedProgram(path, device)


class LoadedProgram:
    """A package's program with its weights on the device: ``program(*args, **kwargs)``.

    It takes the structure of inputs the program was exported with, tensors on tpu (or on the CPU:
    they are moved) of the same shapes and dtypes, and returns tpu tensors in the structure of the
    program's outputs. Tuples, lists and dicts come back as such; an output class (transformers'
    ``ModelOutput``, diffusers' ``BaseOutput``, a namedtuple) comes back as itself if its module is
    already imported in this process, else as a dict of its fields (nothing is imported to rebuild it).
    """

    def __init__(self, path: str | os.PathLike, device: torch.device | str = "tpu") -> None:
        self.path = os.fspath(path)
        self.device = torch.device(device)
        if self.device.type != "tpu":
            raise ValueError(f"hf_tpu.export.load: device {self.device} is not a tpu device")
        if self.device.index is None:
            self.device = torch.device("tpu", torch.tpu.current_device())
        manifest, jax_program, weights = _read_package(self.path)
        self._manifest = manifest
        current = _current_platform()
        if current not in jax_program.platforms:
            raise RuntimeError(
                f"{self.path} was exported for the {', '.join(jax_program.platforms)} platform, but the tpu device "
                f"runs on {current} here: export it again on a {current} host, or pass platforms=[{current!r}] (or "
                "several) to hf_tpu.export.save")
        on_device = {key: tensor.to(self.device) for key, tensor in weights.items()}
        self._weights = [on_device[key] for key in manifest["weights"]]
        # Check codes are numbered per process: the package's become this process's (0: nothing failed). The
        # table is an argument, not a constant, so that every process compiles (or loads) the same program.
        codes = [0] + [checks.code(getattr(builtins, error, RuntimeError), message)
                       for error, message in manifest["messages"][1:]]
        self._codes = torch.tensor(codes, device=self.device)
        self._run = jax.jit(functools.partial(_run_renumbering_checks, jax_program))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = self._flatten(args, kwargs)
        arrays = tuple(self._input_array(leaf, entry) for leaf, entry in zip(leaves, self._manifest["inputs"]))
        outputs, check = self._run(tuple(storage.read(weight) for weight in self._weights),
                                   tuple(array for array in arrays if array is not None), storage.read(self._codes))
        index = self.device.index
        if check is not None and checks.mode() != "off":
            checks.defer(check, index)
        for update in self._manifest["updates"]:
            value = outputs[update["result"]]
            if "weight" in update:
                storage.write(self._weights[update["weight"]], value)
            else:
                leaves[update["input"]].copy_(storage.wrap(value, dtypes.to_torch(value.dtype), index))
        results = [entry["constant"] if "constant" in entry else _wrap(outputs[entry["result"]], entry, index)
                   for entry in self._manifest["outputs"]]
        return _rebuild(self._manifest["out_spec"], iter(results))

    def _flatten(self, args: tuple, kwargs: dict) -> list:
        expected = self._manifest["in_spec"]["children"][1]["keys"]
        if set(kwargs) != set(expected):
            raise PackageError(f"{self.path}: the program takes the keyword arguments {sorted(expected)}, "
                               f"not {sorted(kwargs)}")
        leaves, spec = pytree.tree_flatten((args, {name: kwargs[name] for name in expected}))
        if _encode_spec(spec) != self._manifest["in_spec"]:
            raise PackageError(f"{self.path}: the arguments do not have the structure the program was exported "
                               f"with ({pytree.treespec_pprint(spec)})")
        return leaves

    def _input_array(self, leaf: Any, entry: dict) -> Any:
        """The input's array on the program's chip, or ``None`` for a non-tensor input (its value is checked)."""
        name = entry["name"]
        if "constant" in entry:
            if leaf != entry["constant"]:
                raise PackageError(f"{self.path}: the program was exported with {name}={entry['constant']!r}, not "
                                   f"{leaf!r}; export one with this value")
            return None
        if not isinstance(leaf, torch.Tensor):
            raise PackageError(f"{self.path}: input {name!r} must be a tensor, not {type(leaf).__name__}")
        shape, dtype = tuple(entry["shape"]), getattr(torch, entry["dtype"])
        if tuple(leaf.shape) != shape or leaf.dtype != dtype:
            raise PackageError(
                f"{self.path}: input {name!r} has shape {tuple(leaf.shape)} and dtype {leaf.dtype}, but the program "
                f"was exported for shape {shape} and dtype {dtype}; packages have static shapes: export one for "
                "these inputs")
        return storage.read(leaf.to(self.device))


def _check_static(exported: ExportedProgram) -> None:
    if exported.range_constraints:
        symbols = ", ".join(sorted(str(symbol) for symbol in exported.range_constraints))
        raise ValueError(
            f"hf_tpu.export.save: the program has symbolic sizes ({symbols}), from dynamic_shapes or sizes read from "
            "tensor values; packages hold static shapes only: export with static shapes (no dynamic_shapes), once "
            "per shape you need")


def _decomposition_table() -> dict:
    """torch.export's default table (every CompositeImplicitAutograd op decomposed, as autograd does when
    graph mode traces) without the ops graph mode lowers, plus graph mode's decompositions."""
    from .compile import backend, graph_lowering

    table = torch.export.default_decompositions()
    for op in graph_lowering.lowered_ops():
        if op in table:
            del table[op]
    table.update(backend.decompositions())
    return table


def _classify_inputs(program: ExportedProgram) -> tuple[dict, list, list, list]:
    """The weight placeholders (by state-dict key), the user-input placeholders, where each tensor
    placeholder comes from in the JAX function's (weights, inputs), and the non-tensor inputs' values."""
    weights, inputs, program_inputs, static_values = {}, [], [], []
    placeholders = [node for node in program.graph.nodes if node.op == "placeholder"]
    for node, spec in zip(placeholders, program.graph_signature.input_specs):
        kind = spec.kind.name
        if kind in _WEIGHT_KINDS:
            program_inputs.append(("weight", len(weights)))
            weights[spec.target] = node
        elif kind != "USER_INPUT":
            raise NotImplementedError(f"program inputs of kind {kind} ({node.name}) are not supported")
        elif isinstance(node.meta.get("val"), torch.Tensor):
            program_inputs.append(("input", len(_tensors(inputs))))
            inputs.append(node)
        else:
            static_values.append(spec.arg.value)
            inputs.append(node)
    return weights, inputs, program_inputs, static_values


def _tensors(nodes: list) -> list:
    """The nodes whose values are tensors."""
    return [node for node in nodes if isinstance(node.meta.get("val"), torch.Tensor)]


def _abstract(node: Any) -> jax.ShapeDtypeStruct:
    value = node.meta["val"]
    return jax.ShapeDtypeStruct(tuple(value.shape), dtypes.to_jax(value.dtype))


def _describe_input(node: Any) -> dict:
    value = node.meta["val"]
    if not isinstance(value, torch.Tensor):
        _check_json(value, f"input {node.name!r}")
        return {"name": node.name, "constant": value}
    return {"name": node.name, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}


def _describe_outputs(program: ExportedProgram, graph: CompiledGraph, inputs: list,
                      weight_keys: list) -> tuple[list, list]:
    """The caller's outputs (a program result with its layout, or a constant) and the updates of weights
    and inputs (mutated buffers and inputs) by program result."""
    results = iter(range(len(graph.output_layouts)))
    outputs, updates = [], []
    output_node = next(node for node in program.graph.nodes if node.op == "output")
    for value, spec in zip(output_node.args[0], program.graph_signature.output_specs):
        kind = spec.kind.name
        if not isinstance(value, torch.fx.Node):
            _check_json(value, "an output")
            outputs.append({"constant": value})
            continue
        if not isinstance(value.meta.get("val"), torch.Tensor):
            raise NotImplementedError(f"hf_tpu.export.save: output {value.name} is not a tensor")
        result = next(results)
        if kind == "USER_OUTPUT":
            entry = {"result": result}
            if graph.output_layouts[result] is not None:  # returned in its memory order: keep its strides
                entry.update(shape=list(value.meta["val"].shape), stride=list(value.meta["val"].stride()))
            outputs.append(entry)
        elif kind == "BUFFER_MUTATION":
            updates.append({"result": result, "weight": weight_keys.index(spec.target)})
        elif kind == "USER_INPUT_MUTATION":
            updates.append({"result": result, "input": [node.name for node in inputs].index(spec.target)})
        else:
            raise NotImplementedError(f"hf_tpu.export.save: program outputs of kind {kind} are not supported")
    return outputs, updates


def _weight_keys(program: ExportedProgram, weights: dict) -> list[str]:
    """Per weight of the program, its key in the package's safetensors (tied weights share one)."""
    first_key: dict[int, str] = {}
    return [first_key.setdefault(id(_weight(program, key)), key) for key in weights]


def _unique_weights(program: ExportedProgram, weights: dict) -> dict[str, torch.Tensor]:
    """The weights to store, on the CPU, once each."""
    keys = dict.fromkeys(_weight_keys(program, weights))
    return {key: _weight(program, key).detach().cpu().contiguous() for key in keys}


def _weight(program: ExportedProgram, key: str) -> torch.Tensor:
    return program.state_dict[key] if key in program.state_dict else program.constants[key]


def _check_json(value: Any, what: str) -> None:
    try:
        json.dumps(value)
    except TypeError:
        raise NotImplementedError(f"hf_tpu.export.save: {what} is a {type(value).__name__} constant, which a package "
                                  "cannot hold (only numbers, strings, booleans and None)") from None


def _current_platform() -> str:
    platform = runtime.backing_platform()
    # JAX calls a GPU platform "cuda" or "rocm" in exports; its default backend is that GPU
    return jax.export.default_export_platform() if platform == "gpu" else platform


def _run_renumbering_checks(jax_program: Any, weights: tuple, inputs: tuple, codes: Any) -> tuple:
    outputs, check = jax_program.call(weights, inputs)
    return outputs, None if check is None else check.at[0].set(codes[check[0]])


def _wrap(array: Any, entry: dict, device_index: int) -> torch.Tensor:
    dtype = dtypes.to_torch(array.dtype)
    if "stride" in entry:
        return storage.wrap_strided(array, dtype, device_index, tuple(entry["shape"]), tuple(entry["stride"]))
    return storage.wrap(array, dtype, device_index)


def _read_package(path: str) -> tuple[dict, Any, dict[str, torch.Tensor]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"hf_tpu.export.load: no package file at {path}")
    try:
        with zipfile.ZipFile(path) as package:
            manifest = json.loads(package.read(_MANIFEST))
            if manifest.get("format") != _FORMAT:
                raise PackageError(f"{path} is not a package of hf_tpu.export.save (its manifest has another format)")
            if manifest.get("version") != _VERSION:
                raise PackageError(f"{path} is a package of format version {manifest.get('version')}; this hf_tpu "
                                   f"reads version {_VERSION}: export it again with this hf_tpu")
            program = jax.export.deserialize(bytearray(package.read(_PROGRAM)))
            weights = safetensors.torch.load(package.read(_WEIGHTS))
    except PackageError:
        raise
    except Exception as error:  # a damaged member fails in zipfile, json, flatbuffers or safetensors
        raise PackageError(f"{path} is not a readable package of hf_tpu.export.save ({type(error).__name__}: "
                           f"{error}); write it again with hf_tpu.export.save") from error
    return manifest, program, weights


# --- pytree structures as JSON ------------------------------------------------------------------------


def _encode_spec(spec: pytree.TreeSpec) -> dict | None:
    """A pytree structure as JSON (``None`` is a leaf), rebuilt by :func:`_rebuild` without the classes' code."""
    if spec.is_leaf():
        return None
    cls = spec.type
    node = {"type": [cls.__module__, cls.__qualname__], "children": [_encode_spec(child) for child in spec.children()]}
    if _is_namedtuple(cls):
        node["keys"] = list(cls._fields)
    elif issubclass(cls, dict):  # dict, OrderedDict, transformers' ModelOutput, diffusers' BaseOutput
        node["keys"] = list(spec.context)
    elif cls not in (tuple, list, type(None)):
        raise NotImplementedError(f"hf_tpu.export: a {cls.__qualname__} among the inputs or outputs cannot be rebuilt "
                                  "without its code; use tuples, lists or dicts")
    return node


_SEQUENCES = {"tuple": tuple, "list": list, "NoneType": lambda children: None}


def _rebuild(node: dict | None, leaves: Iterator) -> Any:
    if node is None:
        return next(leaves)
    children = [_rebuild(child, leaves) for child in node["children"]]
    if "keys" not in node:  # a builtin tuple, list or None (see _encode_spec)
        return _SEQUENCES[node["type"][1]](children)
    cls = _imported_class(*node["type"])
    fields = dict(zip(node["keys"], children))
    if cls is None or cls is dict:
        return fields
    return cls(*children) if _is_namedtuple(cls) else cls(**fields)


def _imported_class(module: str, qualname: str) -> type | None:
    """The class if its module is imported already (nothing is imported to rebuild an output)."""
    found: Any = sys.modules.get(module)
    for name in qualname.split("."):
        found = getattr(found, name, None)
    return found if isinstance(found, type) else None


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


__all__ = ["LoadedProgram", "PackageError", "load", "save"]
