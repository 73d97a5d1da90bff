"""Lowers an ATen FX graph (from AOTAutograd) to one cached ``jax.jit``.

The jitted function interprets the graph node by node with the op table eager mode uses
(:data:`..backend.dispatch.LOWERINGS`) and the graph-mode lowerings of :mod:`.graph_ops`. Every
non-tensor argument of an op is a compile-time constant; Scalars the op table traces in eager mode
(``alpha`` of ``add``) become constant arrays, so each lowering sees what it sees in eager mode.
Integer graph inputs (symbolic sizes) are static arguments of the jit, except positions: an integer input whose
value no shape in the graph depends on (a slice's start, a select's index, a cache position Dynamo made dynamic)
is an argument of the program, so one program serves every value. If a lowering cannot take it traced (it needs
the number itself), the graph is traced again with it static. Input mutations (``copy_`` into a graph input) come
out of the program as extra results and are written to the caller's tensors.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import fx
from torch._decomp import decomposition_table
from torch._library.fake_class_registry import FakeScriptObject
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from ..backend import checks, dispatch, dtypes, random_state, runtime, storage, tpu_lowering
from ..backend.ops.memory import to_device
from ..backend.forks import check_not_forked
from ..backend.positions import is_traced
from ..backend.out_of_memory import raise_if_out_of_memory
from .graph_ops import GRAPH_LOWERINGS
from . import fast_call, flex_attention, recompiles, row_updates
from .output_views import InputViews
from .graph_random import RANDOM_LOWERINGS
from .stats import count

_SCALAR_TYPES = ("number", "Optional[number]", "List[number]")


@functools.cache
def _eager_lowerings() -> dict[torch._ops.OpOverload, dispatch.Lowering]:
    from ..backend import ops  # noqa: F401  (importing the op modules fills LOWERINGS)

    return {dispatch.resolve(name): entry for name, entry in dispatch.LOWERINGS.items()}


def lowered_ops() -> frozenset[torch._ops.OpOverload]:
    """The ATen overloads graph mode can lower."""
    return frozenset(GRAPH_LOWERINGS) | frozenset(RANDOM_LOWERINGS) | frozenset(_eager_lowerings())


@functools.cache
def decompositions() -> dict[Any, Callable]:
    """torch's decompositions of the ops that have no lowering, as eager mode's fallback uses them."""
    lowered = lowered_ops()
    return {op: fn for op, fn in decomposition_table.items()
            if isinstance(op, torch._ops.OpOverload) and op not in lowered}


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _bound_arguments(node: fx.Node) -> list[tuple[torch._C.Argument, Any]]:
    """The node's arguments for each input of its op's schema, in order, defaults filled in."""
    op, bound = node.target, []
    inputs = [a for a in op._schema.arguments if not (a.kwarg_only and a.alias_info and a.alias_info.is_write)]
    for slot, argument in enumerate(inputs):
        if slot < len(node.args):
            value = node.args[slot]
        elif argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        elif argument.has_default_value():
            value = dispatch.schema_default(argument)
        else:
            raise TypeError(f"{op.name()}: missing argument {argument.name!r}")
        bound.append((argument, _frozen(value)))
    return bound


def _is_traced_scalar(argument: torch._C.Argument, value: Any, static: frozenset[str],
                      specialized: dict[str, frozenset]) -> bool:
    """Whether eager mode passes this Scalar to the lowering as an array (not at its default, not a value the
    lowering specializes, not static: :func:`dispatch.fixed_scalar`)."""
    if argument.name in static or str(argument.type) not in _SCALAR_TYPES or value is None:
        return False
    if isinstance(value, fx.Node):  # a symbolic size: a Python number at trace time
        return False
    return dispatch.fixed_scalar(value, dispatch.schema_default(argument), specialized.get(argument.name, ())) is False


class _Step:
    """One op node: its lowering and its arguments bound to the schema's inputs, in order.

    ``static`` names the parameters the lowering takes as Python values; ``None`` means all of them.
    """

    __slots__ = ("node", "fn", "arguments", "scalar_slots", "dtype_slot", "keywords")

    def __init__(self, node: fx.Node, fn: Callable, static: frozenset[str] | None, sees_layout: bool = False,
                 specialized: dict[str, frozenset] | None = None) -> None:
        bound = _bound_arguments(node)
        self.node, self.fn = node, fn
        self.arguments = [value for _, value in bound]
        self.dtype_slot = next((slot for slot, (argument, _) in enumerate(bound) if argument.name == "dtype"), None)
        self.scalar_slots = [] if static is None else [
            slot for slot, (argument, value) in enumerate(bound)
            if _is_traced_scalar(argument, value, static, specialized or {})
        ]
        self.keywords = {"contiguous": _contiguity(bound)} if sees_layout else {}
        if getattr(fn, "sees_result", False):
            self.keywords["result"] = node.meta["val"]

    def run(self, env: dict) -> Any:
        call = [_materialize(value, env) for value in self.arguments]
        if self.scalar_slots:
            wide = dtypes.needs_wide_scalars(call, None if self.dtype_slot is None else call[self.dtype_slot])
            for slot in self.scalar_slots:
                value = call[slot]
                call[slot] = (tuple(dtypes.scalar_operand(v, wide) for v in value) if isinstance(value, tuple)
                              else dtypes.scalar_operand(value, wide))
        try:
            return self.fn(*call, **self.keywords)
        except (TypeError, ValueError) as error:
            raise RuntimeError(f"{self.node.target.name()}: {error}") from error


def _contiguity(bound: list[tuple[torch._C.Argument, Any]]) -> tuple[bool | None, ...]:
    """Whether each tensor argument is contiguous, from the traced values (``sees_layout`` lowerings)."""
    flags = []
    for argument, value in bound:
        if str(argument.type) in ("Tensor", "Optional[Tensor]"):
            flags.append(None if value is None else value.meta["val"].is_contiguous())
    return tuple(flags)


def _materialize(value: Any, env: dict) -> Any:
    if isinstance(value, fx.Node):
        return env[value]
    if isinstance(value, tuple):
        return tuple(_materialize(v, env) for v in value)
    return value


_SIZE_FUNCTIONS = frozenset(
    {torch.sym_sum, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_float, torch.sym_int, torch.sym_ite}
)


def _is_size_arithmetic(target: Any) -> bool:
    """Python functions a graph applies to sizes and tuples: ``operator``/``math`` functions and
    torch's ``sym_*`` helpers (Dynamo's automatic dynamic shapes emit ``sym_sum``)."""
    return getattr(target, "__module__", None) in ("_operator", "math") or target in _SIZE_FUNCTIONS


class _PythonStep:
    """A Python function on graph values (``operator.getitem`` of a split, arithmetic on sizes)."""

    __slots__ = ("node",)

    def __init__(self, node: fx.Node) -> None:
        self.node = node

    def run(self, env: dict) -> Any:
        args = _materialize(_frozen(self.node.args), env)
        return self.node.target(*args, **{k: _materialize(_frozen(v), env) for k, v in self.node.kwargs.items()})


class _RandomStep(_Step):
    """A random op node: its lowering also takes the ``[seed, offset]`` pair at ``slot`` of the graph's
    RNG input (see :mod:`.graph_random`) and the dtype of its result."""

    __slots__ = ("slot", "dtype")

    def __init__(self, node: fx.Node, fn: Callable, slot: int) -> None:
        super().__init__(node, fn, None)
        self.slot = slot
        value = node.meta["val"]
        self.dtype = dtypes.to_jax((value[0] if isinstance(value, (tuple, list)) else value).dtype)

    def run(self, env: dict) -> Any:
        call = [_materialize(value, env) for value in self.arguments]
        return self.fn(env[_RNG][self.slot], self.dtype, *call)


_RNG = "rng"  # the env entry of the RNG input: one [seed, offset] row per random node


# Composite aliases that can survive into graphs with symbolic sizes, and the op each one is.
_ALIASES = {
    torch.ops.aten.true_divide.Tensor: torch.ops.aten.div.Tensor,
    torch.ops.aten.true_divide.Scalar: torch.ops.aten.div.Scalar,
}


def _step(node: fx.Node, random_nodes: list[fx.Node]) -> _Step | _PythonStep:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        if _is_size_arithmetic(target):
            return _PythonStep(node)
        raise NotImplementedError(f"tpu graph mode: no lowering for {target}")
    if target in GRAPH_LOWERINGS:
        return _Step(node, GRAPH_LOWERINGS[target], None)
    if target in RANDOM_LOWERINGS:
        random_nodes.append(node)
        return _RandomStep(node, RANDOM_LOWERINGS[target], len(random_nodes) - 1)
    entry = _eager_lowerings().get(_ALIASES.get(target, target))
    if entry is None:
        raise NotImplementedError(f"tpu graph mode: no lowering for the operator {target.name()}")
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
    if mutates:
        raise NotImplementedError(f"tpu graph mode: in-place operator {target.name()} in a functional graph")
    return _Step(node, entry.fn, entry.static, entry.sees_layout, entry.specialized)


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _is_opaque(node: fx.Node) -> bool:
    """An opaque object (a DTensor's DeviceMesh): a non-tensor input, handed through to the results as it is."""
    return isinstance(node.meta.get("val"), (torch.ScriptObject, FakeScriptObject))


def _is_size(node: fx.Node) -> bool:
    """A size or other number computed from sizes, or an opaque object: a Python value when the graph is traced."""
    return (isinstance(node.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))
            or _is_opaque(node))


class _Position:
    """In the static values of a program's key, an integer input the program takes as an argument."""

    def __repr__(self) -> str:
        return "<position>"


_POSITION = _Position()


def _symbols(value: Any) -> set:
    return set(value.node.expr.free_symbols) if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) \
        else set()


# The operators and arguments that take a position, whose lowerings accept a traced one; any other use of an integer
# input (a Scalar an op specializes on, ``pow(x, n)``) keeps it a constant of the program.
_POSITION_ARGUMENTS = {
    "aten::slice.Tensor": (2, 3), "aten::slice_scatter": (3, 4), "aten::select.int": (2,),
    "aten::select_scatter": (3,), "aten::slice_backward": (3, 4), "aten::as_strided": (3,), "aten::roll": (1,),
    "hf_tpu::row_scatter": (4,), "hf_tpu::row_gather": (3,),
}


def _used_as_position(node: fx.Node) -> bool:
    """Whether every use of ``node`` is a position argument (:data:`_POSITION_ARGUMENTS`), directly or through size
    arithmetic, or a result of the graph."""
    for user in node.users:
        if user.op == "output" or (user.op == "call_function" and _is_size_arithmetic(user.target)
                                   and _used_as_position(user)):
            continue
        slots = _POSITION_ARGUMENTS.get(user.target.name()) if isinstance(user.target, torch._ops.OpOverload) \
            else None
        if slots is None or any(arg is node or (isinstance(arg, (list, tuple)) and node in arg)
                                for index, arg in enumerate(user.args) if index not in slots) \
                or any(value is node for value in user.kwargs.values()):
            return False
    return True


class _Positions:
    """Which integer inputs of a graph are positions, the program's arguments: inputs whose symbols are in no
    tensor's shape. A size the graph returns (a forward saves its slice bounds for the backward) is worked out
    from the call's positions when its symbols are all theirs; otherwise its symbols are the program's constants.
    """

    def __init__(self, graph_module: fx.GraphModule, static_nodes: list[fx.Node], size_outputs: list[fx.Node]) \
            -> None:
        shaped = set()
        for node in graph_module.graph.nodes:
            for value in pytree.tree_leaves(node.meta.get("val")):
                if isinstance(value, torch.Tensor):
                    for size in value.shape:
                        shaped |= _symbols(size)
        returned = [node for node in size_outputs if node.op != "placeholder" and _symbols(node.meta.get("val"))]
        while True:
            slots = [slot for slot, node in enumerate(static_nodes)
                     if isinstance(node.meta.get("val"), torch.SymInt) and not _symbols(node.meta["val"]) & shaped
                     and _used_as_position(node)]
            named = {static_nodes[slot].meta["val"].node.expr: slot for slot in slots
                     if static_nodes[slot].meta["val"].node.expr.is_Symbol}
            unknown = [node for node in returned
                       if _symbols(node.meta["val"]) - shaped and not _symbols(node.meta["val"]) <= named.keys()]
            if not unknown:
                break
            for node in unknown:
                shaped |= _symbols(node.meta["val"])
        self.slots = tuple(slots)
        self._named = named
        self.computed = {node: node.meta["val"].node.expr for node in returned
                         if _symbols(node.meta["val"]) <= named.keys()}

    def sizes(self, call_values: tuple) -> dict[fx.Node, int]:
        """The returned sizes worked out from the positions of a call."""
        values = {symbol: call_values[slot] for symbol, slot in self._named.items()}
        return {node: int(expression.xreplace(values)) for node, expression in self.computed.items()}


_NOT_CONSTANT = object()


def _on_host(node: fx.Node) -> bool:
    return all(value.device.type == "cpu" for value in pytree.tree_leaves(node.meta.get("val"))
               if isinstance(value, torch.Tensor))


def _from_constants(graph_module: fx.GraphModule, node: Any, values: dict) -> Any:
    """The value of ``node`` if it is computed on the host from the graph's constants alone (no input, no tensor
    on tpu), else ``_NOT_CONSTANT``; ``values`` holds those already worked out."""
    if not isinstance(node, fx.Node):
        return node
    if node not in values:
        if node.op == "get_attr":
            values[node] = getattr(graph_module, node.target)
        elif node.op == "call_function" and _on_host(node):
            args, kwargs = pytree.tree_map_only(fx.Node, lambda n: _from_constants(graph_module, n, values),
                                                (node.args, node.kwargs))
            constant = all(leaf is not _NOT_CONSTANT for leaf in pytree.tree_leaves((args, kwargs)))
            values[node] = node.target(*args, **kwargs) if constant else _NOT_CONSTANT
        else:
            values[node] = _NOT_CONSTANT
    return values[node]


def _host_outputs(graph_module: fx.GraphModule, outputs: list[fx.Node]) -> dict[fx.Node, torch.Tensor]:
    """The tensor outputs on the host computed from the graph's constants alone: a tensor the traced code made on
    the host (transformers' Gemma scales its embeddings by ``torch.tensor(hidden_size ** 0.5)``) and returns to the
    code after a graph break. Worked out once; each call returns a copy."""
    host, values = {}, {}
    for node in outputs:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            with unset_fake_temporarily():  # graphs are lowered while Dynamo's fake mode is on
                value = _from_constants(graph_module, node, values)
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    host[node] = value.detach().clone()
    return host


def _check_on_device(node: fx.Node) -> None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise NotImplementedError(f"tpu graph mode: graph output {node.name} is not a tensor ({type(value)})")
    if value.device.type != "tpu":
        raise NotImplementedError(f"tpu graph mode: graph output {node.name} is on {value.device}, not tpu")


class CompiledGraph:
    """A boxed callable (``fn(list_of_inputs)``) that runs one ATen graph as one jitted XLA program.

    Sizes among the results (a forward graph with symbolic sizes saves them for its backward) depend only
    on the static inputs and the input shapes: they are taken from the trace and kept with the executable.

    Mutated graph inputs that are whole device arrays nobody else holds are donated to the program,
    so XLA updates them in place (a StaticCache's layers, optimizer state) instead of keeping a copy.
    """

    def __init__(self, graph_module: fx.GraphModule) -> None:
        flex_attention.expand(graph_module, decompositions())
        row_updates.fold(graph_module)
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        self._tensor_positions = [i for i, n in enumerate(placeholders) if _is_tensor(n)]
        self._static_positions = [i for i, n in enumerate(placeholders) if not _is_tensor(n)]
        self._tensor_nodes = [placeholders[i] for i in self._tensor_positions]
        self._static_nodes = [placeholders[i] for i in self._static_positions]
        constants = [n for n in graph_module.graph.nodes if n.op == "get_attr"]
        self._constant_nodes = constants
        self._constants = [getattr(graph_module, n.target) for n in constants]
        self._random_nodes: list[fx.Node] = []
        self._steps = [_step(n, self._random_nodes) for n in graph_module.graph.nodes if n.op == "call_function"]
        mutated = {}
        for node in graph_module.graph.nodes:
            if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder":
                mutated[self._tensor_nodes.index(node.args[0])] = node
        self._mutated_inputs, self._mutation_nodes = list(mutated), list(mutated.values())
        self._mutated_positions = frozenset(mutated)
        output = next(n for n in graph_module.graph.nodes if n.op == "output")
        self._outputs = list(output.args[0])
        self._size_outputs = [n for n in self._outputs if isinstance(n, fx.Node) and _is_size(n)]
        tensor_outputs = [n for n in self._outputs if isinstance(n, fx.Node) and not _is_size(n)]
        self._host_outputs = _host_outputs(graph_module, tensor_outputs)
        self._tensor_outputs = [n for n in tensor_outputs if n not in self._host_outputs]
        self._traced_sizes: tuple = ()
        self._size_inputs = {node: slot for slot, node in enumerate(self._static_nodes) if node in self._size_outputs}
        self._positions = _Positions(graph_module, self._static_nodes, self._size_outputs)
        self._position_slots = self._positions.slots
        for node in self._tensor_outputs:
            _check_on_device(node)
        for node in self._size_outputs:
            if not _is_opaque(node) and free_unbacked_symbols(node.meta["val"]):
                raise NotImplementedError(f"tpu graph mode: graph output {node.name} is a number read from a tensor")
        self._layouts = [_dense_layout(node.meta["val"]) for node in self._tensor_outputs]
        self._input_views = InputViews(self._tensor_nodes, self._static_nodes, self._tensor_outputs)
        self._executables: collections.OrderedDict[tuple, tuple[Callable, tuple]] = collections.OrderedDict()
        self._signature: tuple | None = None
        self._plan: fast_call.CallPlan | None = None  # see __call__
        self.name = f"graph {next(_graph_numbers)}"
        self._boxed_call = True  # in the instance dict, so that the wrappers Dynamo adds copy it
        count("graphs")

    @property
    def output_layouts(self) -> list[tuple[int, ...] | None]:
        """Per tensor output, the memory order (dims from outermost to innermost) in which the program
        returns it when it is dense but not contiguous, else ``None``."""
        return self._layouts

    @property
    def constants(self) -> list[torch.Tensor]:
        """The tensors the graph holds (its ``get_attr`` nodes' values)."""
        return self._constants

    def pure_function(self, static_values: tuple = (), fold_constants: bool = True,
                      draws: int = 0) -> Callable[..., tuple]:
        """For programs built around the graph (:mod:`hf_tpu.export`, :mod:`.decode_loop`): the graph as a JAX
        function of its tensor inputs, given its non-tensor inputs, returning (tensor outputs as
        :attr:`output_layouts` says, new values of mutated inputs, combined check or ``None``). The graph's
        :attr:`constants` are folded in, or with ``fold_constants=False`` taken as arrays after the inputs. With
        ``draws``, the graph's random ops (that many) take their ``[seed, offset]`` rows from an array that comes
        first, which the caller draws from the device's random stream.

        Raises ``NotImplementedError`` if the graph has another number of random ops than ``draws``: a program
        saved ahead of time cannot draw from the device's random stream at each run.
        """
        if len(self._random_nodes) != draws:
            names = ", ".join(sorted({node.target.name() for node in self._random_nodes})) or "none"
            raise NotImplementedError(
                f"random operators ({names}) cannot be part of a program saved ahead of time: they draw from the "
                "device's random stream at each run; export the model in eval mode (model.eval()) so that dropout "
                "is off")
        constants = [_read(constant, 0) for constant in self._constants] if fold_constants else []
        if draws:
            return lambda rng, *arrays: self._trace(static_values, rng, *arrays, *constants)
        return lambda *arrays: self._trace(static_values, None, *arrays, *constants)

    def _executable(self, donated: tuple[int, ...], static_values: tuple, rng: Any, arrays: list,
                    views: tuple) -> tuple:
        """The XLA executable for these inputs (``views``: the view each input takes of its array inside the
        program, see :func:`storage.read_for_program`), and the sizes among the results: built once per input
        signature and donation pattern.

        Executables are shared between graphs through a fingerprint of their program: when Dynamo
        recompiles a function as a graph with symbolic sizes, sizes met before reuse their programs.
        """
        start, loads = time.perf_counter(), recompiles.disk_cache_hits()
        donate = tuple(2 + position for position in donated)
        trace = functools.partial(self._trace, views=views) if views else self._trace
        if tpu_lowering.MODE != "off":
            tpu_lowering.check(f"compiled {self.name}", jax.jit(trace, static_argnums=0),
                               (static_values, rng, *arrays))
        traces = runtime.interpreted_kernel_traces
        lowered = jax.jit(trace, static_argnums=0, donate_argnums=donate).lower(static_values, rng, *arrays)
        interpreted = runtime.interpreted_kernel_traces != traces
        placement = tuple(a.sharding for a in arrays)  # the chips, and how sharded inputs are spread over them
        # the inputs' shapes too: an input the program does not use is not in its text, but the executable takes it
        signature = tuple((a.shape, a.dtype) for a in arrays), None if rng is None else (rng.shape, rng.dtype)
        fingerprint = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), placement, signature)
        executable = _lookup(_EXECUTABLES, fingerprint)
        if executable is None:
            executable = _store(_EXECUTABLES, fingerprint, lowered.compile(), _SHARED_EXECUTABLES)
            count("compilations")
            count("disk_cache_hits", recompiles.disk_cache_hits() - loads)
        else:
            count("cache_hits")
        count("compile_seconds", time.perf_counter() - start)
        return (runtime.waiting(executable) if interpreted else executable), self._traced_sizes

    def _trace(self, static_values: tuple, rng: Any, *arrays: Any, views: tuple = ()) -> tuple[tuple, tuple, Any]:
        """The graph's outputs for these inputs; positions marked in ``static_values`` come in an array after the
        tensor inputs and constants. ``views``: per input, the view the graph reads of its array, or ``None``."""
        if views:
            arrays = [*(a if view is None else storage.view_of(a, view) for a, view in zip(arrays, views)),
                      *arrays[len(views):]]
        signature = (static_values, tuple((a.shape, a.dtype) for a in arrays))
        if self._signature is not None:
            recompiles.log_retrace(self.name, self._signature, signature)
        self._signature = signature
        if _POSITION in static_values:
            *arrays, positions = arrays
            traced = (dtypes.weak_integer(position) for position in positions)
            static_values = tuple(next(traced) if value is _POSITION else value for value in static_values)
        env = dict(zip(self._static_nodes, static_values))
        env.update(zip(self._tensor_nodes + self._constant_nodes, arrays))
        env[_RNG] = rng
        with checks.collecting() as collected:
            for step in self._steps:
                env[step.node] = step.run(env)
        self._traced_sizes = tuple(None if is_traced(env[node]) else env[node] for node in self._size_outputs)
        outputs = tuple(
            env[node] if order is None else jnp.transpose(env[node], order)
            for node, order in zip(self._tensor_outputs, self._layouts)
        )
        return outputs, tuple(env[n] for n in self._mutation_nodes), checks.combined(collected)

    def __call__(self, args: list) -> list:
        check_not_forked()
        tensors = [args[i] for i in self._tensor_positions]
        static_values = tuple(args[i] for i in self._static_positions)
        args.clear()  # boxed convention: inputs (saved activations in backward) may die early
        try:
            return self._run(tensors, static_values)
        except _NeedsNumbers:
            self._position_slots = ()  # a lowering needs the positions' values: from now on they are constants
            return self._run(tensors, static_values)

    def _run(self, tensors: list[torch.Tensor], call_values: tuple) -> list:
        inputs = tensors + self._constants
        static_values = tuple(_POSITION if slot in self._position_slots else value
                              for slot, value in enumerate(call_values))
        plan = self._plan
        arrays = plan.read(inputs, static_values) if plan is not None else None
        fast = arrays is not None
        if fast:  # called like the last time (a decode step): no placement to work out
            device_index, shardings, views = plan.device_index, None, plan.views
        else:
            for position in self._mutated_inputs:
                if tensors[position].device.type == "tpu":
                    storage.adopt_dtype(tensors[position])
            device_index = next((storage.buffer_of(t).device_index for t in tensors if t.device.type == "tpu"), 0)
            arrays, views = self._read_inputs(inputs, device_index)
            shardings = None
            if any(type(a.sharding) is not storage.ONE_CHIP for a in arrays):  # sharded tensors among the inputs
                arrays, device_index, shardings = _on_one_mesh(inputs, arrays, device_index)
        donated = self._donatable(tensors, arrays)
        rng = _rng_parts(len(self._random_nodes), device_index) if self._random_nodes else None
        if rng is not None and shardings is not None:
            rng = jax.device_put(rng, storage.replicated(shardings[0]))  # every input is on the mesh now
        if self._position_slots:
            positions = np.array([call_values[slot] for slot in self._position_slots], np.int64)
            arrays = [*arrays, jax.device_put(positions, runtime.device(device_index) if shardings is None
                                              else storage.replicated(shardings[0]))]
        if fast and donated == plan.donated:
            compiled = plan.compiled
            count("cache_hits")
            count("fast_calls")
        else:
            try:
                compiled = self._compiled(donated, static_values, rng, arrays, shardings, views)
            except Exception as error:
                if self._position_slots:
                    raise _NeedsNumbers from error
                raise
            self._plan = fast_call.CallPlan(inputs, arrays[:len(inputs)], views, device_index, static_values,
                                            self._mutated_positions, donated, compiled) \
                if inputs and shardings is None and all(type(a.sharding) is storage.ONE_CHIP for a in arrays) \
                else None
        executable, sizes = compiled
        try:
            outputs, written, check = executable(rng, *arrays)
        except Exception as error:
            raise_if_out_of_memory(error, device_index)
            raise
        count("calls")
        if check is not None:
            dispatch.defer_check(check, device_index)
        del arrays
        if fast:
            plan.write(tensors, self._mutated_inputs, written)
        else:
            for position, value in zip(self._mutated_inputs, written):
                storage.write_input(tensors[position], value, device_index)
        if not tensors and not self._constants:  # factories only: results go to the chip, not JAX's default
            outputs = jax.device_put(outputs, runtime.device(device_index))
        results = [_wrap(*result, device_index) for result in zip(outputs, self._tensor_outputs, self._layouts)]
        if self._input_views:
            self._input_views.replace(results, tensors, call_values)
        results = iter(results)
        values = dict(zip(self._size_outputs, sizes))
        values.update((node, call_values[slot]) for node, slot in self._size_inputs.items())
        values.update((node, value.clone()) for node, value in self._host_outputs.items())
        if self._position_slots and self._positions.computed:
            values.update(self._positions.sizes(call_values))
        return [values[o] if o in values else next(results) if isinstance(o, fx.Node) else o for o in self._outputs]

    def _compiled(self, donated: tuple[int, ...], static_values: tuple, rng: Any, arrays: list,
                  shardings: tuple | None, views: tuple) -> tuple:
        """The executable for these inputs and the sizes among its results, built on first use."""
        key = (donated, static_values, tuple([(a.shape, a.dtype) for a in arrays]), checks.MODE, shardings, views)
        compiled = _lookup(self._executables, key)
        if compiled is None:
            return _store(self._executables, key, self._executable(donated, static_values, rng, arrays, views),
                          _EXECUTABLES_PER_GRAPH)
        count("cache_hits")
        return compiled

    def _read_inputs(self, inputs: list[torch.Tensor], device_index: int) -> tuple[list[Any], tuple]:
        """The arrays to pass for ``inputs`` (the tensor inputs, then the constants), and the view the program takes
        of each (``()`` if none does). A mutated input is read as its values: its array must be its own to donate."""
        arrays, views = [], []
        for position, tensor in enumerate(inputs):
            if tensor.device.type == "tpu" and position not in self._mutated_positions:
                array, view = storage.read_for_program(tensor)
            else:
                array, view = _read(tensor, device_index), None
            arrays.append(array)
            views.append(view)
        return arrays, tuple(views) if any(view is not None for view in views) else ()

    def _donatable(self, tensors: list[torch.Tensor], arrays: list[Any]) -> tuple[int, ...]:
        """The mutated inputs whose array can be given to the program: the storage's whole array, held
        by nothing but its storage (and the newest-array record), passed to the program only once."""
        passed = storage.occurrences(arrays)
        return tuple(position for position in self._mutated_inputs
                     if storage.donatable(tensors[position], arrays, position, passed))


class _NeedsNumbers(Exception):
    """Tracing a graph with its positions as arguments failed: a lowering needs them as numbers."""


_graph_numbers = itertools.count(1)
# program fingerprint and devices -> executable; both caches keep the most recently used only
_EXECUTABLES: collections.OrderedDict[tuple[str, str], Callable] = collections.OrderedDict()
_SHARED_EXECUTABLES = 256
_EXECUTABLES_PER_GRAPH = 64


def _lookup(cache: collections.OrderedDict, key: Any) -> Any:
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
    return value


def _store(cache: collections.OrderedDict, key: Any, value: Any, bound: int) -> Any:
    cache[key] = value
    if len(cache) > bound:
        cache.popitem(last=False)
    return value


def _rng_parts(count: int, device_index: int) -> Any:
    """``count`` consecutive ``[seed, offset]`` pairs of the device's random stream, on the device."""
    parts = [random_state.next_key_parts(device_index) for _ in range(count)]
    return jax.device_put(np.array(parts, np.uint64), runtime.device(device_index))


def _on_one_mesh(tensors: list[torch.Tensor], arrays: list[Any], device_index: int) -> tuple[list, int, tuple | None]:
    """The inputs of a graph called with sharded tensors on one mesh (:func:`dispatch.on_one_mesh`), the chip its
    results report, and the inputs' shardings (part of the executable's key) if some are spread."""
    chips = [storage.buffer_of(t).device_index if t.device.type == "tpu" else device_index for t in tensors]
    together = dispatch.on_one_mesh(arrays, chips)
    if together is None:
        return arrays, device_index, None
    arrays, device_index = together
    return arrays, device_index, tuple(a.sharding for a in arrays)


def _read(tensor: torch.Tensor, device_index: int) -> Any:
    if tensor.device.type == "tpu":
        return storage.read(tensor)
    return to_device(tensor, tensor.dtype, device_index)  # e.g. a zero-dim CPU tensor operand


def _wrap(array: Any, node: fx.Node, order: tuple[int, ...] | None, device_index: int) -> torch.Tensor:
    """The result tensor: contiguous, or with the output's strides when ``order`` (its dims from
    outermost to innermost in memory) says the program returned it in that physical order."""
    dtype = dtypes.to_torch(array.dtype)
    if order is None:
        return storage.wrap(array, dtype, device_index)
    value = node.meta["val"]
    return storage.wrap_strided(array, dtype, device_index, tuple(value.shape), tuple(value.stride()))


def _dense_layout(value: torch.Tensor) -> tuple[int, ...] | None:
    """The memory order of a non-contiguous but dense output (e.g. a transposed result), so the
    caller gets the strides it gets on CPU; ``None`` for contiguous or not plainly dense outputs."""
    shape, stride = value.shape, value.stride()
    if not all(isinstance(n, int) for n in (*shape, *stride)) or value.is_contiguous() or value.numel() <= 1:
        return None
    order = tuple(sorted(range(len(shape)), key=lambda d: (-stride[d], d)))
    expected = 1
    for dim in reversed(order):
        if shape[dim] != 1 and stride[dim] != expected:
            return None
        expected *= shape[dim]
    return order
