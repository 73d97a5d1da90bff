"""Collectives in graph mode: an ATen graph with ``_c10d_functional`` nodes runs as the rank's one XLA program.

Under ``tpu_dist`` (one process per chip, :mod:`hf_tpu.distributed`) Dynamo turns ``dist.all_reduce`` and the
functional collectives (``torch.distributed._functional_collectives``) into ``_c10d_functional.*`` nodes, each
followed by ``wait_tensor``. Such a graph is lowered whole as the body of a ``jax.shard_map`` over the mesh of
the processes its collectives span (:class:`Grid`: one axis for one group, as the group's eager collectives run; for
several groups, as the sub-meshes of a 2-D DeviceMesh make, a grid of the ranks in which each group is some of its
axes):

- each local input becomes this rank's block of a global array, blocked along dim 0 (no copy; a 0-d value is
  lifted to one element), and the body sees exactly the local values;
- each collective node is the lax collective of :mod:`hf_tpu.distributed.collectives` (the eager programs' math)
  over its group's axes, and ``wait_tensor`` is the identity: the program orders its own communication;
- results come back as this rank's blocks, so the caller gets local tensors as in eager mode.

Every rank must run the graph with the same shapes (one SPMD program). The program runs on the collectives'
thread, in program order with eager collectives, and waiting for it is bounded by the groups' timeout. Groups
that are not the axes of one grid, and collectives the program cannot express, raise ``NotImplementedError``, which
makes the graph run eagerly after the usual warning.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import math
from collections.abc import Iterable
from typing import Any, Callable

import jax
import torch
import torch.distributed as dist
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from torch import fx

from ..backend import storage
from ..distributed import collectives, dispatcher_ops, process_group, runtime
from .graph_lowering import CompiledGraph
from .graph_ops import graph_lowering

_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_REDUCE_OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor")


def _is_collective(node: fx.Node) -> bool:
    """A node that communicates over a group (``wait_tensor`` has none: a graph with it alone needs no mesh)."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace in _NAMESPACES
            and any(argument.name == "group_name" for argument in node.target._schema.arguments))


def has_collectives(graph_module: fx.GraphModule) -> bool:
    """Whether the graph communicates (a ``_c10d_functional`` or ``_c10d_functional_autograd`` collective)."""
    return any(_is_collective(node) for node in graph_module.graph.nodes)


# --- lowerings: the schema's parameters, every non-tensor one a constant; a group is some of the mesh's axes ---

_GROUP_AXES: contextvars.ContextVar[dict[str, collectives.Axis]] = contextvars.ContextVar("group_axes")


def _axes(group_name: str) -> collectives.Axis:
    """The mesh axes of the group named ``group_name`` in the graph being traced (see :class:`Grid`)."""
    return _GROUP_AXES.get()[group_name]


@graph_lowering("_c10d_functional::wait_tensor")
def wait_tensor(tensor):
    return tensor


@graph_lowering("_c10d_functional::all_reduce")
def all_reduce(input, reduce_op, group_name):
    return collectives.all_reduce(input, reduce_op, _axes(group_name))


@graph_lowering("_c10d_functional::all_reduce_coalesced")
def all_reduce_coalesced(inputs, reduce_op, group_name):
    return [collectives.all_reduce(x, reduce_op, _axes(group_name)) for x in inputs]


@graph_lowering("_c10d_functional::all_gather_into_tensor", "_c10d_functional_autograd::all_gather_into_tensor")
def all_gather_into_tensor(input, group_size, group_name):
    return collectives.all_gather(input, _axes(group_name)).reshape((-1, *input.shape[1:]))


@graph_lowering("_c10d_functional::all_gather_into_tensor_coalesced")
def all_gather_into_tensor_coalesced(inputs, group_size, group_name):
    return [all_gather_into_tensor(x, group_size, group_name) for x in inputs]


@graph_lowering("_c10d_functional::reduce_scatter_tensor", "_c10d_functional_autograd::reduce_scatter_tensor")
def reduce_scatter_tensor(input, reduce_op, group_size, group_name):
    return collectives.reduce_scatter(input, reduce_op, _axes(group_name))


@graph_lowering("_c10d_functional::reduce_scatter_tensor_coalesced")
def reduce_scatter_tensor_coalesced(inputs, reduce_op, group_size, group_name):
    return [collectives.reduce_scatter(x, reduce_op, _axes(group_name)) for x in inputs]


@graph_lowering("_c10d_functional::all_to_all_single", "_c10d_functional_autograd::all_to_all_single")
def all_to_all_single(input, output_split_sizes, input_split_sizes, group_name):
    return collectives.all_to_all(input, _axes(group_name))  # even splits only (checked when the graph is lowered)


@graph_lowering("_c10d_functional::broadcast")
def broadcast(input, src, group_name):
    return collectives.broadcast(input, src, _axes(group_name))  # src: the root's rank in the group (c10d's rootRank)


# --- checks when the graph is lowered (a NotImplementedError there makes the graph run eagerly) -------------


def _argument(node: fx.Node, name: str) -> Any:
    """The node's argument for parameter ``name`` of its schema (``None`` if the schema has none)."""
    index = next((i for i, argument in enumerate(node.target._schema.arguments) if argument.name == name), None)
    if index is None:
        return None
    return node.args[index] if index < len(node.args) else node.kwargs[name]


def _check_node(node: fx.Node, size: int) -> None:
    """Raises ``NotImplementedError`` for a collective the program cannot express."""
    what = f"tpu graph mode: {node.target.name()}"
    op = _argument(node, "reduce_op")
    if op is not None and op not in _REDUCE_OPS:
        raise NotImplementedError(f"{what} with reduce op {op!r}; use one of {', '.join(_REDUCE_OPS)}")
    if op in ("avg", "band", "bor", "bxor"):
        tensors = node.args[0]  # every collective's first parameter: its input, or its list of inputs
        floating = [n.meta["val"].is_floating_point() for n in (tensors if isinstance(tensors, list) else [tensors])]
        if op == "avg" and not all(floating):
            raise NotImplementedError(f"{what} with reduce op 'avg' needs floating-point tensors")
        if op != "avg" and any(floating):
            raise NotImplementedError(f"{what} with reduce op {op!r} needs integer or bool tensors")
    if node.target.name().endswith("all_to_all_single"):
        rows = _argument(node, "input").meta["val"].shape[0]
        splits = [list(_argument(node, name)) for name in ("output_split_sizes", "input_split_sizes")]
        if not _even(rows, size, splits):
            raise NotImplementedError(f"{what} with split sizes {splits[0]} (output) and {splits[1]} (input) of "
                                      f"{rows} rows: only even splits over the {size} ranks are compiled")


def _even(rows: Any, size: int, splits: list[list[Any]]) -> bool:
    """Whether both split lists cut the ``rows`` into ``size`` equal blocks (empty lists: even ones). A symbolic
    split (a graph node, with ``dynamic=True``) counts as even when it is the one split of both lists."""
    given = [split for split in splits if split]
    blocks = {id(block) if isinstance(block, fx.Node) else block for split in given for block in split}
    if any(len(split) != size for split in given) or len(blocks) > 1:
        return False
    return not (isinstance(rows, int) and (rows % size or blocks - {rows // size}))


def _group(node: fx.Node) -> process_group.TpuProcessGroup:
    try:
        return dispatcher_ops._group(_argument(node, "group_name"), node.target.name())
    except ValueError as error:  # not a tpu_dist group: the eager kernel says what to do
        raise NotImplementedError(f"tpu graph mode: {error}") from error


@dataclasses.dataclass(frozen=True)
class Grid:
    """The processes a graph's collectives span, as one mesh: their global ``ranks`` in mesh order, the mesh's
    ``shape`` and axis ``names`` (slowest first), and per group (its global ranks) the axes it runs over, whose
    row-major order is the group's rank order."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    names: tuple[str, ...]
    axes: dict[tuple[int, ...], tuple[str, ...]]


def grid(groups: Iterable[tuple[int, ...]], rank: int, world: int) -> Grid:
    """The grid of the processes that collectives over ``groups`` span, seen from global rank ``rank`` (in every
    group) of a world of ``world`` processes.

    A group of several ranks must be an arithmetic progression, ``stride`` apart: the ranks varying along the axes
    between ``stride`` and ``stride * len(group)`` of a mixed-radix numbering of the ranks (the row and column groups
    of a 2-D DeviceMesh are, as is the world). The axes are cut where any group starts or ends, each must divide the
    next, and those no group runs over are this rank's fixed coordinates. Groups of one rank share an axis of size 1.
    Raises ``NotImplementedError`` for groups that are not so. One group (any ranks) is one axis of its own."""
    groups = sorted(set(groups))
    if len(groups) == 1:
        return Grid(groups[0], (len(groups[0]),), (collectives.AXIS,), {groups[0]: (collectives.AXIS,)})
    spans = {}
    for ranks in groups:
        if len(ranks) == 1:
            continue
        stride = ranks[1] - ranks[0]
        end = stride * len(ranks)
        if stride <= 0 or ranks != tuple(range(ranks[0], ranks[0] + end, stride)) or ranks[0] % end >= stride:
            raise _not_a_grid(groups, f"ranks {list(ranks)} are not one axis of a grid of the ranks")
        spans[ranks] = (stride, end)
    bounds = sorted({bound for span in spans.values() for bound in span})
    if any(high % low for low, high in zip(bounds, bounds[1:])):
        raise _not_a_grid(groups, "their sizes do not nest")
    steps = [(low, high) for low, high in zip(bounds, bounds[1:])
             if any(start <= low < end for start, end in spans.values())][::-1]  # slowest axis first
    names = [f"ranks{i}" for i in range(len(steps))]
    axes = {ranks: tuple(name for name, (low, high) in zip(names, steps) if start <= low < end)
            for ranks, (start, end) in spans.items()}
    shape = [high // low for low, high in steps]
    if len(spans) < len(groups):
        names, shape = [*names, "alone"], [*shape, 1]
        axes.update({ranks: ("alone",) for ranks in groups if len(ranks) == 1})
    base = rank - sum((rank // low) % (high // low) * low for low, high in steps)
    ranks = tuple(base + sum(digit * low for digit, (low, _) in zip(digits, steps))
                  for digits in itertools.product(*(range(high // low) for low, high in steps)))
    if ranks[-1] >= world:
        raise _not_a_grid(groups, f"their grid needs rank {ranks[-1]}, of a world of {world}")
    return Grid(ranks, tuple(shape), tuple(names), axes)


def _not_a_grid(groups: list[tuple[int, ...]], why: str) -> NotImplementedError:
    return NotImplementedError(
        f"tpu graph mode: a graph with collectives over process groups of ranks "
        f"{' and '.join(str(list(ranks)) for ranks in groups)}, which are not the axes of one grid of the ranks "
        f"({why}); groups made by a DeviceMesh are, or put torch._dynamo.graph_break() between the collectives of "
        "different groups")


def graph_groups(graph_module: fx.GraphModule) -> dict[str, process_group.TpuProcessGroup]:
    """The ``tpu_dist`` groups the graph's collectives run over, by name, each collective checked; raises
    ``NotImplementedError`` for a collective the program cannot express."""
    groups = {}
    for node in graph_module.graph.nodes:
        if _is_collective(node):
            group = groups[_argument(node, "group_name")] = _group(node)
            _check_node(node, group.size())
    return groups


# --- the program -----------------------------------------------------------------------------------------


def _lift(value: Any) -> Any:
    """A 0-d value as one element (a block along dim 0 needs a dim 0)."""
    return value.reshape(1) if value.ndim == 0 else value


def _chips(arrays: list) -> Mesh | None:
    """The mesh of this process's chips the inputs are split or copied over (all of them are on it, as
    graph_lowering's ``_on_one_mesh`` puts them), or ``None`` for inputs on one chip."""
    sharding = next((a.sharding for a in arrays if storage.is_spread(a)), None)
    return None if sharding is None else collectives.chip_mesh(sharding)


def _block(mesh: Mesh, grid: Grid, local: Any) -> Any:
    """This rank's ``local`` array as its block, along dim 0, of a global array over ``mesh``: the grid's axes,
    then (for an array split or copied over this process's chips) those chips' axes, over which the global array
    is split as ``local`` is (dim 0 within each rank's block)."""
    local = _lift(local)
    shape = (math.prod(grid.shape) * local.shape[0], *local.shape[1:])
    spec = PartitionSpec(grid.names)
    if mesh.axis_names != grid.names:
        split = local.sharding.spec if isinstance(local.sharding, NamedSharding) else PartitionSpec()
        head = split[0] if split else None
        rest = tuple(split[1:])
        spec = PartitionSpec((*grid.names, *((head,) if isinstance(head, str) else head or ())), *rest)
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, spec),
                                                    [shard.data for shard in local.addressable_shards])


def _blocked(grid: Grid) -> PartitionSpec:
    """Dim 0 split over all of the grid's axes: block i is the i-th rank of the grid's."""
    return PartitionSpec(grid.names)


def _local(value: Any, scalar: bool, mesh: Mesh, grid: Grid, chips: Mesh | None) -> Any:
    """This rank's block of a global result over ``mesh``: on its chip, or split over its ``chips`` as the program
    left it."""
    if chips is None:
        block = value.addressable_shards[0].data
        return block.reshape(()) if scalar else block
    spec = value.sharding.spec if isinstance(value.sharding, NamedSharding) else None
    head = () if not spec or spec[0] is None else (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    if spec is None or head[:len(grid.names)] != grid.names:  # not blocked rank-major: each chip a whole block
        value = jax.device_put(value, NamedSharding(mesh, _blocked(grid)))
        spec, head = _blocked(grid), grid.names
    inner = head[len(grid.names):]
    mine = PartitionSpec(inner or None, *spec[1:])
    shape = (value.shape[0] // math.prod(grid.shape), *value.shape[1:])
    block = jax.make_array_from_single_device_arrays(shape, NamedSharding(chips, mine),
                                                     [shard.data for shard in value.addressable_shards])
    return block.reshape(()) if scalar else block


def _is_scalar(node: fx.Node) -> bool:
    return node.meta["val"].ndim == 0


class CollectiveGraph(CompiledGraph):
    """A :class:`CompiledGraph` with collectives: the graph is the body of one ``shard_map`` over the mesh of the
    processes its collectives span (see the module docstring); it is called, and returns, like any compiled
    graph."""

    def __init__(self, graph_module: fx.GraphModule) -> None:
        groups = graph_groups(graph_module)  # before the base class counts the graph
        self._grid = grid((group._ranks for group in groups.values()), dist.get_rank(), dist.get_world_size())
        self._axes = {name: self._grid.axes[group._ranks] for name, group in groups.items()}
        self._timeout = max(group._timeout for group in groups.values())
        self._meshes: dict[int | Mesh, Mesh] = {}
        super().__init__(graph_module)
        self._scalar_outputs = [_is_scalar(node) for node in self._tensor_outputs]
        self._scalar_written = [_is_scalar(node) for node in self._mutation_nodes]

    def pure_function(self, static_values: tuple = ()) -> Callable[..., tuple]:
        raise NotImplementedError("a graph with collectives cannot be saved ahead of time: it runs as one program "
                                  "per process of a tpu_dist group; export the model without torch.distributed")

    def _executable(self, donated: tuple[int, ...], static_values: tuple, rng: Any, arrays: list,
                    views: tuple) -> tuple:
        """The base class's executable for the global arrays of these blocks, wrapped to take and return local
        arrays, run on the collectives' thread and waited for with the group's timeout."""
        chips = _chips(arrays)
        where = chips if chips is not None else storage.chip_index(next(iter(arrays[0].devices()))) if arrays else 0
        mesh = self._mesh(where)
        shapes = tuple(a.shape for a in arrays)
        blocks = [_block(mesh, self._grid, a) for a in arrays]
        executable, sizes = super()._executable(donated, (static_values, shapes, where),
                                                _block_or_none(mesh, self._grid, rng), blocks, views)
        return self._run_in_order(executable, mesh, chips), sizes

    def _run_in_order(self, executable: Callable, mesh: Mesh, chips: Mesh | None) -> Callable:
        """``executable`` as a function of local arrays, run after the collectives issued before it (on the
        collectives' thread, see :class:`~hf_tpu.distributed.process_group.TpuProcessGroup`)."""
        grid = self._grid

        def run(rng: Any, *arrays: Any) -> tuple:
            blocks = [_block(mesh, grid, a) for a in arrays]
            rng = _block_or_none(mesh, grid, rng)
            future = process_group._in_order().submit(lambda: jax.block_until_ready(executable(rng, *blocks)))
            process_group.TpuWork(future, [], self._timeout, f"compiled {self.name}", grid.ranks).wait()
            outputs, written, check = future.result()
            local = functools.partial(_local, mesh=mesh, grid=grid, chips=chips)
            return ([local(v, s) for v, s in zip(outputs, self._scalar_outputs)],
                    [local(v, s) for v, s in zip(written, self._scalar_written)],
                    None if check is None else local(check, False))

        return run

    def _trace(self, static: tuple, rng: Any, *blocks: Any, views: tuple = ()) -> tuple[tuple, tuple, Any]:
        """The graph over the global arrays: the base class's trace of the local blocks (each process's views of
        them taken there), inside a shard_map that is manual over the grid's axes (the processes) and leaves the
        axes of each process's chips to XLA's partitioner, as a graph of one process with sharded inputs does."""
        static_values, shapes, where = static
        trace = super()._trace

        def per_rank(rng: Any, *blocks: Any) -> tuple:
            arrays = [block.reshape(shape) for block, shape in zip(blocks, shapes)]
            axes = _GROUP_AXES.set(self._axes)
            try:
                return jax.tree.map(_lift, trace(static_values, rng, *arrays, views=views))
            finally:
                _GROUP_AXES.reset(axes)

        # check_vma=False: a graph may call kernels (Pallas, jax_op) whose output types do not say how they vary
        # over the mesh, which JAX's check requires; every output is this rank's own block anyway.
        return jax.shard_map(per_rank, mesh=self._mesh(where), in_specs=_blocked(self._grid),
                             out_specs=_blocked(self._grid), axis_names=frozenset(self._grid.names),
                             check_vma=False)(rng, *blocks)

    def _mesh(self, where: int | Mesh) -> Mesh:
        """The grid's mesh of each process's chip ``where``, or of each process's ``where`` chips (a mesh of them:
        the grid's axes, then theirs)."""
        if where not in self._meshes:
            local = [storage.chip_index(d) for d in where.devices.flat] if isinstance(where, Mesh) else [where]
            shape, names = self._grid.shape, self._grid.names
            if isinstance(where, Mesh):
                shape, names = (*shape, *where.devices.shape), (*names, *where.axis_names)
            devices = runtime.chips_of_processes(self._grid.ranks, local)
            self._meshes[where] = Mesh(devices.reshape(shape), names)
        return self._meshes[where]


def _block_or_none(mesh: Mesh, grid: Grid, rng: Any) -> Any:
    return None if rng is None else _block(mesh, grid, rng)
