"""JAX and Pallas functions as PyTorch ops on tpu tensors: :func:`jax_op`, :func:`to_jax`, :func:`from_jax`.

``jax_op(name, fn)`` turns an annotated JAX function into a ``torch.library`` custom op (TorchTPU's
``torch.tpu.pallas.jax_op``). Its tpu kernel passes each input storage's JAX array to ``jax.jit(fn)``
and makes each result array the storage of a new tensor (no copies); its fake kernel comes from
``jax.eval_shape``; its gradient is a second op computing ``jax.vjp(fn)``; and graph mode lowers both
ops inline into the graph's one XLA program. Off TPU chips, ``fn`` is traced in Pallas' TPU interpret
mode, so a Pallas kernel written for TPUs runs unchanged on a CPU host.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..backend import dispatch, dtypes, runtime, storage, tpu_lowering
from ..backend.forks import check_not_forked
from ..backend.out_of_memory import raise_if_out_of_memory
from ..compile import graph_ops

DEFAULT_NAMESPACE = "hf_tpu_jax"
_TENSOR, _OPTIONAL_TENSOR, _TENSOR_LIST, _STATIC = "Tensor", "Tensor?", "Tensor[]", "static"
_SUPPORTED = (
    "annotate tensors as jax.Array (or torch.Tensor, Optional[...], Sequence[...]/list[...] of them) and static "
    "values as int, float, bool, str, a str or int Enum, Literal, torch.dtype/jnp.dtype or torch.device"
)


@dataclass(frozen=True)
class _Parameter:
    name: str
    kind: str  # _TENSOR, _OPTIONAL_TENSOR, _TENSOR_LIST or _STATIC
    schema_type: str
    default: Any = inspect.Parameter.empty
    to_fn_value: Callable[[Any], Any] | None = None  # what fn receives for the op's static argument

    def schema(self) -> str:
        text = f"{self.schema_type} {self.name}"
        return text if self.default is inspect.Parameter.empty else f"{text}={_schema_literal(self.default)}"


def _schema_literal(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value).replace("'", '"')
    raise TypeError(f"a default of {value!r} cannot be part of an op schema: give it no default or a number/str/None")


def _is_tensor_type(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, (jax.Array, torch.Tensor))


def _static(name: str, annotation: Any) -> tuple[str, Callable[[Any], Any] | None]:
    """The schema type of a static parameter and the conversion of the op's value to what fn expects."""
    if annotation in (bool, int, float, str):
        return annotation.__name__, None
    if typing.get_origin(annotation) is typing.Literal:
        kinds = {type(choice) for choice in typing.get_args(annotation)}
        if len(kinds) == 1 and next(iter(kinds)) in (bool, int, str):
            return next(iter(kinds)).__name__, None
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        for base in (str, int):  # the dispatcher carries str and int; members travel as their values
            if issubclass(annotation, base) or all(isinstance(member.value, base) for member in annotation):
                return base.__name__, annotation
    if annotation is torch.dtype:
        return "ScalarType", None
    if annotation is np.dtype:
        return "ScalarType", dtypes.to_jax
    if annotation is torch.device:
        return "Device", None
    raise TypeError(f"jax_op: parameter {name!r} is annotated {annotation!r}, which jax_op does not support: "
                    f"{_SUPPORTED}")


def _parameter(parameter: inspect.Parameter, annotation: Any) -> _Parameter:
    name, default = parameter.name, parameter.default
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2
    inner = next(a for a in args if a is not type(None)) if optional else annotation
    inner_origin, inner_args = typing.get_origin(inner), typing.get_args(inner)
    if _is_tensor_type(inner):
        return _Parameter(name, _OPTIONAL_TENSOR if optional else _TENSOR, "Tensor?" if optional else "Tensor",
                          default)
    is_sequence = isinstance(inner_origin, type) and issubclass(inner_origin, Sequence)
    if is_sequence and inner_args and _is_tensor_type(inner_args[0]) and inner_args[-1] in (inner_args[0], ...):
        if optional:
            raise TypeError(f"jax_op: parameter {name!r}: an optional list of tensors is not supported; "
                            "pass an empty list instead")
        return _Parameter(name, _TENSOR_LIST, "Tensor[]", default)
    schema_type, convert = _static(name, inner)
    return _Parameter(name, _STATIC, schema_type + "?" * optional, default, convert)


def _returns(fn_name: str, annotation: Any) -> tuple[str, int | None]:
    """The schema of fn's results and how many there are (``None``: a list)."""
    if _is_tensor_type(annotation):
        return "Tensor", 1
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple and args and all(_is_tensor_type(a) for a in args):
        return "(" + ", ".join(["Tensor"] * len(args)) + ")", len(args)
    is_sequence = isinstance(origin, type) and issubclass(origin, Sequence)
    if is_sequence and args and _is_tensor_type(args[0]) and args[-1] in (args[0], ...):
        return "Tensor[]", None
    raise TypeError(f"jax_op: {fn_name} must be annotated to return jax.Array, tuple[jax.Array, ...] (fixed or "
                    f"variadic) or list[jax.Array], not {annotation!r}")


class _Signature:
    """fn's parameters as an op schema, and the split of the op's arguments into tensors and statics."""

    def __init__(self, fn: Callable) -> None:
        fn_name = getattr(fn, "__qualname__", repr(fn))
        try:
            hints = typing.get_type_hints(fn)
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError, NameError) as error:
            raise TypeError(f"jax_op: cannot read the annotations of {fn_name} ({error}): pass a plain function whose "
                            f"parameters and result are annotated") from error
        self.parameters: list[_Parameter] = []
        for parameter in parameters:
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                raise TypeError(f"jax_op: {fn_name} has *{parameter.name}: list each parameter with an annotation")
            if parameter.name not in hints:
                raise TypeError(f"jax_op: parameter {parameter.name!r} of {fn_name} has no annotation: {_SUPPORTED}")
            self.parameters.append(_parameter(parameter, hints[parameter.name]))
        if "return" not in hints:
            raise TypeError(f"jax_op: {fn_name} has no return annotation: annotate it -> jax.Array (or a tuple or "
                            "list of them)")
        self.returns, self.result_count = _returns(fn_name, hints["return"])
        self.tensor_parameters = [p for p in self.parameters if p.kind != _STATIC]
        if not self.tensor_parameters:
            raise TypeError(f"jax_op: {fn_name} takes no tensor: the op runs on the chip of its tensor arguments")
        self.static_parameters = [p for p in self.parameters if p.kind == _STATIC]
        self.binder = inspect.Signature([
            inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default)
            for p in self.parameters
        ])

    def schema(self, extra: str = "", returns: str | None = None) -> str:
        arguments = [p.schema() for p in self.parameters] + ([extra] if extra else [])
        return f"({', '.join(arguments)}) -> {returns or self.returns}"

    def split(self, args: tuple, kwargs: dict) -> tuple[list, tuple]:
        """The op's arguments as (tensor arguments in order, static values in order, hashable)."""
        bound = self.binder.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        statics = tuple(values[p.name] for p in self.static_parameters)
        return [values[p.name] for p in self.tensor_parameters], statics

    def call(self, fn: Callable, tensors: Sequence, statics: tuple) -> Any:
        kwargs = {p.name: value for p, value in zip(self.tensor_parameters, tensors)}
        for p, value in zip(self.static_parameters, statics):
            kwargs[p.name] = value if p.to_fn_value is None or value is None else p.to_fn_value(value)
        return fn(**kwargs)


def _pallas_mode() -> contextlib.AbstractContextManager:
    """The context fn is traced in: Pallas' TPU interpret mode off TPU chips, where Mosaic cannot compile
    (a ``pallas_call`` reads the mode when it is traced)."""
    if not runtime.pallas_interpreted():
        return contextlib.nullcontext()
    from jax.experimental.pallas import tpu as pltpu

    runtime.interpreted_kernel_traces += 1  # fn may hold a kernel: its programs wait (runtime.waiting)
    return pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())


def _leaves(item: Any) -> list:
    return [] if item is None else list(item) if isinstance(item, (list, tuple)) else [item]


def _is_differentiable(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


class _JaxOp:
    """The two custom ops of one ``jax_op`` (forward and its VJP), their kernels and lowerings."""

    def __init__(self, name: str, fn: Callable, donate_argnums: Sequence[int] | None, mesh: Any,
                 input_partition_specs: Sequence | None, output_partition_specs: Any) -> None:
        self.name, self.fn = name, fn
        self.signature = signature = _Signature(fn)
        if any(p.name == "cotangents" for p in signature.parameters):
            raise TypeError(f"jax_op {name}: rename the parameter 'cotangents': the gradient op takes an argument of "
                            "that name")
        self.donate_argnums = tuple(donate_argnums or ())
        count = len(signature.tensor_parameters)
        if any(not 0 <= i < count for i in self.donate_argnums):
            raise ValueError(f"jax_op {name}: donate_argnums {self.donate_argnums} must index the {count} tensor "
                             "parameters (statics are not counted)")
        self.mesh = mesh
        self.input_shardings = self.output_shardings = None
        if mesh is not None:
            specs = input_partition_specs or [jax.sharding.PartitionSpec()] * count
            if len(specs) != count:
                raise ValueError(f"jax_op {name}: input_partition_specs has {len(specs)} specs for {count} tensor "
                                 "parameters")
            self.input_shardings = tuple(jax.sharding.NamedSharding(mesh, spec) for spec in specs)
            if output_partition_specs is not None:
                self.output_shardings = jax.tree.map(lambda spec: jax.sharding.NamedSharding(mesh, spec),
                                                     output_partition_specs,
                                                     is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        elif input_partition_specs is not None or output_partition_specs is not None:
            raise ValueError(f"jax_op {name}: partition specs need a mesh")

        self.op = torch.library.custom_op(name, self._forward_kernel, mutates_args=(), schema=signature.schema())
        self.op.register_fake(self._forward_fake)
        self.vjp_op = torch.library.custom_op(f"{name}_vjp", self._vjp_kernel, mutates_args=(),
                                              schema=signature.schema("Tensor?[] cotangents", "Tensor[]"))
        self.vjp_op.register_fake(self._vjp_fake)
        self.op.register_autograd(self._backward, setup_context=self._setup_context)
        graph_ops.GRAPH_LOWERINGS[self.op._opoverload] = self._forward_lowering
        graph_ops.GRAPH_LOWERINGS[self.vjp_op._opoverload] = self._vjp_lowering

    # --- JAX functions of the arrays, per static values ---------------------------------------------

    def _forward_body(self, statics: tuple) -> Callable[..., Any]:
        def forward(*tensors: Any) -> Any:
            with _pallas_mode():
                return self.signature.call(self.fn, tensors, statics)

        return forward

    def _vjp_body(self, statics: tuple) -> Callable[..., list]:
        """Gradients for the differentiable (floating) tensors, in order, from ``jax.vjp`` of fn (which
        respects a ``jax.custom_vjp`` inside it); the forward is recomputed in the same program."""

        def vjp(*tensors_and_cotangents: Any) -> list:
            *tensors, cotangents = tensors_and_cotangents
            leaves, structure = jax.tree.flatten(list(tensors))
            wanted = [i for i, leaf in enumerate(leaves) if _is_differentiable(leaf.dtype)]

            def primal(*differentiable: Any) -> Any:
                values = list(leaves)
                for i, value in zip(wanted, differentiable):
                    values[i] = value
                with _pallas_mode():
                    return self.signature.call(self.fn, jax.tree.unflatten(structure, values), statics)

            results, pullback = jax.vjp(primal, *[leaves[i] for i in wanted])
            outputs, output_structure = jax.tree.flatten(results)
            seeds = [
                jnp.zeros(out.shape, out.dtype) if seed is None else seed.astype(out.dtype)
                if _is_differentiable(out.dtype) else np.zeros(out.shape, jax.dtypes.float0)
                for out, seed in zip(outputs, cotangents)
            ]
            with _pallas_mode():  # a custom_vjp's backward (maybe a Pallas kernel) is traced here, not in jax.vjp
                return list(pullback(jax.tree.unflatten(output_structure, seeds)))

        return vjp

    @functools.lru_cache(maxsize=storage.PROGRAMS_PER_CACHE)
    def _program(self, statics: tuple, donated: tuple[int, ...]) -> Callable[..., Any]:
        """The jitted forward for these static values (JAX itself caches per shape and dtype)."""
        sharded = {} if self.output_shardings is None else {"out_shardings": self.output_shardings}
        program = jax.jit(self._forward_body(statics), donate_argnums=donated, **sharded)
        return runtime.waiting(tpu_lowering.checked(self.name, program))  # off chips fn is always interpreted

    @functools.lru_cache(maxsize=storage.PROGRAMS_PER_CACHE)
    def _vjp_program(self, statics: tuple) -> Callable[..., Any]:
        program = jax.jit(self._vjp_body(statics))
        return runtime.waiting(tpu_lowering.checked(f"{self.name}_vjp", program))

    # --- eager kernels ------------------------------------------------------------------------------

    def _forward_kernel(self, *args: Any, **kwargs: Any) -> Any:
        tensors, statics = self.signature.split(args, kwargs)
        device_index = self._device_of(tensors)
        leaves = [leaf for item in tensors for leaf in _leaves(item)]
        arrays = [storage.read(leaf) for leaf in leaves]
        donated = self._donatable(tensors, leaves, arrays)  # before `arrays` is nested: that holds them twice
        return self._run(self._program(statics, donated), _nested(tensors, arrays), device_index,
                         self.signature.result_count is None)

    def _vjp_kernel(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        arguments, cotangents = _split_cotangents(args, kwargs)
        tensors, statics = self.signature.split(arguments, kwargs)
        device_index = self._device_of(tensors)
        values = _nested(tensors, [storage.read(leaf) for item in tensors for leaf in _leaves(item)])
        values.append([None if c is None else storage.read(c) for c in cotangents])
        return self._run(self._vjp_program(statics), values, device_index, True)

    def _run(self, program: Callable, values: list, device_index: int, as_list: bool) -> Any:
        check_not_forked()
        try:
            if self.mesh is not None:  # committed to their shardings, the inputs make the program run on the mesh
                replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
                shardings = self.input_shardings + (replicated,) * (len(values) - len(self.input_shardings))
                values = [jax.device_put(value, sharding) for value, sharding in zip(values, shardings)]
            results = program(*values)
            if self.mesh is not None:  # a tpu tensor lives on one chip (no sharded tensors yet): gather
                results = jax.device_put(results, runtime.device(device_index))
        except Exception as error:
            raise_if_out_of_memory(error, device_index)
            raise
        if isinstance(results, (list, tuple)):
            wrapped = [storage.wrap(r, dtypes.to_torch(r.dtype), device_index) for r in results]
            return wrapped if as_list else tuple(wrapped)
        return storage.wrap(results, dtypes.to_torch(results.dtype), device_index)

    def _device_of(self, tensors: list) -> int:
        """The chip of the tensor arguments (all on one chip; CPU tensors are refused)."""
        index = None
        for parameter, item in zip(self.signature.tensor_parameters, tensors):
            for tensor in _leaves(item):
                if not isinstance(tensor, torch.Tensor) or tensor.device.type != "tpu":
                    where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                    raise RuntimeError(f"{self.name}: argument {parameter.name!r} is on {where}; jax_op ops run on "
                                       "tpu tensors: move it with .to('tpu')")
                chip = storage.buffer_of(tensor).device_index
                if index is not None and chip != index:
                    raise dispatch.device_mismatch(f"tpu:{index}", f"tpu:{chip}")
                index = chip
        return 0 if index is None else index

    def _donatable(self, tensors: list, leaves: list, arrays: list) -> tuple[int, ...]:
        """The donated parameters whose arrays can really be given away: each a whole storage array that
        no other tensor (a view) or holder (``to_jax``) shares, and not needed by autograd."""
        starts = [0]
        for item in tensors:
            starts.append(starts[-1] + len(_leaves(item)))
        donated, passed = [], storage.occurrences(arrays)
        for position in self.donate_argnums:
            donatable = True
            for index in range(starts[position], starts[position + 1]):
                tensor = leaves[index]
                donatable = donatable and not tensor.requires_grad and _storage_users(tensor) <= _SOLE_USER and (
                    storage.donatable(tensor, arrays, index, passed))
            if donatable:
                donated.append(position)
        return tuple(donated)

    # --- fake kernels, autograd ---------------------------------------------------------------------

    def _forward_fake(self, *args: Any, **kwargs: Any) -> Any:
        tensors, statics = self.signature.split(args, kwargs)
        like = next(leaf for item in tensors for leaf in _leaves(item))
        shapes = [jax.tree.map(_placeholder, item) for item in tensors]
        results = jax.eval_shape(self._forward_body(statics), *shapes)
        if isinstance(results, (list, tuple)):
            made = [like.new_empty(r.shape, dtype=dtypes.to_torch(r.dtype)) for r in results]
            return made if self.signature.result_count is None else tuple(made)
        return like.new_empty(results.shape, dtype=dtypes.to_torch(results.dtype))

    def _vjp_fake(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        arguments, _ = _split_cotangents(args, kwargs)
        tensors, _ = self.signature.split(arguments, kwargs)
        return [leaf.new_empty(leaf.shape) for item in tensors for leaf in _leaves(item) if _differentiable(leaf)]

    def _setup_context(self, ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.inputs = list(inputs)
        positions = [i for i, p in enumerate(self.signature.parameters) if p.kind != _STATIC]
        leaves = [leaf for i in positions for leaf in _leaves(inputs[i])]
        ctx.save_for_backward(*leaves)
        for i in positions:
            ctx.inputs[i] = None if inputs[i] is None else len(inputs[i]) if isinstance(inputs[i], list) else -1
        ctx.tensor_positions = positions

    def _backward(self, ctx: Any, *grads: Any) -> tuple:
        saved = iter(ctx.saved_tensors)
        arguments = list(ctx.inputs)
        for i in ctx.tensor_positions:  # put the saved tensors back in their places
            length = arguments[i]
            arguments[i] = None if length is None else next(saved) if length == -1 else [
                next(saved) for _ in range(length)]
        cotangents = [g for grad in grads for g in (grad if isinstance(grad, (list, tuple)) else [grad])]
        gradients = iter(self.vjp_op(*arguments, cotangents))
        result = [None] * len(arguments)
        for i in ctx.tensor_positions:
            item = arguments[i]
            if isinstance(item, list):
                result[i] = [next(gradients) if _differentiable(t) else None for t in item]
            elif item is not None and _differentiable(item):
                result[i] = next(gradients)
        return tuple(result[:len(ctx.needs_input_grad)])  # one per argument passed: defaults left out get none

    # --- graph mode ---------------------------------------------------------------------------------

    def _graph_split(self, args: tuple) -> tuple[list, tuple]:
        if self.mesh is not None and self.mesh.devices.size > 1:
            raise NotImplementedError(f"tpu graph mode: jax_op {self.name} has a mesh of {self.mesh.devices.size} "
                                      "chips, and a graph runs on one chip (no sharded tpu tensors yet)")
        return self.signature.split(args, {})

    def _forward_lowering(self, *args: Any) -> Any:
        tensors, statics = self._graph_split(args)
        return self._forward_body(statics)(*tensors)

    def _vjp_lowering(self, *args: Any) -> list:
        tensors, statics = self._graph_split(args[:-1])
        return self._vjp_body(statics)(*tensors, list(args[-1]))


# Users of a storage with a single tensor over it: that tensor's TensorImpl and the storage's Python object.
_SOLE_USER = 2


def _split_cotangents(args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """The VJP op's arguments: fn's, then the cotangents (last, or by keyword)."""
    if "cotangents" in kwargs:
        return args, kwargs.pop("cotangents")
    return args[:-1], args[-1]


def _storage_users(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _nested(tensors: list, arrays: list) -> list:
    """The arrays of the tensor arguments' leaves, grouped back as the arguments (None, one, or a list)."""
    leaves = iter(arrays)
    return [None if item is None else [next(leaves) for _ in item] if isinstance(item, (list, tuple))
            else next(leaves) for item in tensors]


def _placeholder(tensor: torch.Tensor) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(n) for n in tensor.shape), dtypes.to_jax(tensor.dtype))


def _qualified(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"jax_op: the op name must be a str such as 'mylib::my_kernel', not {name!r}")
    return name if "::" in name else f"{DEFAULT_NAMESPACE}::{name}"


def jax_op(
    name: str,
    fn: Callable[..., Any] | None = None,
    /,
    *,
    donate_argnums: Sequence[int] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    input_partition_specs: Sequence[jax.sharding.PartitionSpec] | None = None,
    output_partition_specs: Any = None,
) -> Any:
    """A PyTorch custom op (``torch.library.CustomOpDef``) running the JAX function ``fn`` on tpu tensors.

    ``fn``'s annotations define the op: ``jax.Array`` parameters (also ``Optional[...]`` and
    ``Sequence[...]``/``list[...]`` of them) are tensors, ``int``/``float``/``bool``/``str``, str or int
    ``Enum``s, ``Literal``s, ``torch.dtype``/``jnp.dtype`` and ``torch.device`` are static (one trace per
    value); the result is ``jax.Array``, a fixed ``tuple[jax.Array, jax.Array]`` or ``list[jax.Array]`` (also
    ``tuple[jax.Array, ...]``: returned as a list). ``name`` is
    ``"namespace::op"`` (``hf_tpu_jax`` without a namespace). Use it as ``jax_op(name, fn)`` or as the
    decorator ``@jax_op(name)``. Gradients come from ``jax.vjp(fn)`` (a ``jax.custom_vjp`` in ``fn`` is
    used); under ``torch.compile(backend="tpu")`` the op is part of the graph's one XLA program.

    ``donate_argnums`` (positions among the tensor parameters) gives those inputs' arrays to XLA: a donated
    tensor must not be used afterwards (its array is deleted: reading it raises "Array has been deleted");
    copy a result into it if it should stay. An input whose storage is shared (a view, another tensor,
    ``to_jax``) or that requires grad is not donated, and graph mode ignores donation.

    ``mesh`` with ``input_partition_specs`` (one per tensor parameter) and ``output_partition_specs``:
    ``fn`` is jitted with those ``NamedSharding``s, so a kernel using ``jax.shard_map`` over ``mesh`` runs
    per shard. Until tpu tensors can be sharded, each tensor is the global array on one chip: the inputs
    are scattered to the mesh and the results gathered back (copies, for a mesh of several chips), and
    graph mode lowers only ops whose mesh is one chip.
    """
    qualified = _qualified(name)

    def make(function: Callable[..., Any]) -> Any:
        return _JaxOp(qualified, function, donate_argnums, mesh, input_partition_specs, output_partition_specs).op

    return make if fn is None else make(fn)


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """The tpu tensor's values as a JAX array: its storage's own array when the tensor is all of it, in the
    array's shape (no copy; JAX arrays are immutable, so later writes to the tensor do not change it), else
    its values computed from the storage (a view, or a reshape of the storage: a new array)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "tpu":
        where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"to_jax takes a tpu tensor, not one on {where}: move it with .to('tpu') first")
    return storage.read(tensor.detach())


def from_jax(array: jax.Array) -> torch.Tensor:
    """A tpu tensor that owns ``array`` (no copy), on the chip the array lives on."""
    if not isinstance(array, jax.Array):
        raise TypeError(f"from_jax takes a jax.Array, not {type(array).__name__}: jnp.asarray(...) it first")
    devices = array.devices()
    chips = runtime.devices()
    if len(devices) != 1:
        raise ValueError(f"from_jax: the array is sharded over {len(devices)} devices, and tpu tensors live on one "
                         "chip (no sharded tpu tensors yet): jax.device_put it to one chip first")
    (device,) = devices
    if device not in chips:
        raise ValueError(f"from_jax: the array is on {device}, which is not a tpu chip (those are "
                         f"{', '.join(map(str, chips))}): jax.device_put it to one of them first")
    return storage.wrap(array, dtypes.to_torch(array.dtype), chips.index(device))


__all__ = ["DEFAULT_NAMESPACE", "from_jax", "jax_op", "to_jax"]
