"""Rows written and read through a view of a graph input, without the view.

A compiled step that writes into a view of a buffer (``k_cache.index_copy_(0, rows, keys)``, where ``k_cache``
is a slice of one large paged cache, as transformers' continuous batching does) reaches graph mode
functionalized: the whole view is read, the rows written into that copy, and the copy scattered back over the
buffer (``as_strided_scatter``). XLA then copies the view twice, the size of the cache, at each step. Reading
rows of such a view (``index_select``) likewise slices the whole view first.

:func:`fold` rewrites those patterns, for a view of whole contiguous rows at any offset, into the two ops below,
which touch only the rows named: a scatter into, and a gather from, the buffer itself (updated in place when
it is donated).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import torch
from torch import fx

from .graph_ops import graph_lowering

_LIBRARY = torch.library.Library("hf_tpu", "DEF")
_LIBRARY.define("row_scatter(Tensor base, Tensor index, Tensor source, SymInt row_numel, SymInt offset) -> Tensor")
_LIBRARY.define("row_gather(Tensor base, Tensor index, SymInt[] row_shape, SymInt offset) -> Tensor")

aten = torch.ops.aten


def _positions(index: torch.Tensor, row_numel: int, offset: int) -> torch.Tensor:
    return (offset + index[:, None] * row_numel + torch.arange(row_numel, device=index.device)).reshape(-1)


def _row_scatter_by_ops(base, index, source, row_numel, offset):
    flat = base.reshape(-1).clone()
    flat[_positions(index, row_numel, offset)] = source.reshape(-1).to(flat.dtype)
    return flat.view(base.shape)


def _row_gather_by_ops(base, index, row_shape, offset):
    return base.reshape(-1)[_positions(index, math.prod(row_shape), offset)].view(index.shape[0], *row_shape)


# torch ops, so that a graph holding them still runs op by op (a graph that falls back to eager mode) and traces
_LIBRARY.impl("row_scatter", _row_scatter_by_ops, "CompositeExplicitAutograd")
_LIBRARY.impl("row_gather", _row_gather_by_ops, "CompositeExplicitAutograd")


def _row_positions(index: Any, row_numel: int, offset: Any) -> Any:
    return (offset + index.astype(jnp.int64)[:, None] * row_numel + jnp.arange(row_numel)).reshape(-1)


@graph_lowering("hf_tpu::row_scatter")
def row_scatter(base, index, source, row_numel, offset):
    """``base`` (its elements in order) with the rows of ``row_numel`` elements that start at
    ``offset + index[i] * row_numel`` set to ``source[i]``."""
    flat = base.reshape(-1)
    written = source.reshape(-1).astype(flat.dtype)
    return flat.at[_row_positions(index, row_numel, offset)].set(written).reshape(base.shape)


@graph_lowering("hf_tpu::row_gather")
def row_gather(base, index, row_shape, offset):
    """The rows of shape ``row_shape`` that start at ``offset + index[i] * numel(row_shape)`` in ``base``'s
    elements, stacked."""
    row_numel = math.prod(row_shape)
    values = base.reshape(-1)[_row_positions(index, row_numel, offset)]
    return values.reshape(index.shape[0], *row_shape)


def _strided(node: fx.Node, first: int) -> tuple:
    """(size, stride, storage offset) of an ``as_strided`` (``first`` = 1) or ``as_strided_scatter`` (2) node."""
    size, stride = node.args[first:first + 2]
    offset = node.args[first + 2] if len(node.args) > first + 2 else node.kwargs.get("storage_offset", 0)
    return list(size), list(stride), 0 if offset is None else offset


def _row_view(node: Any) -> tuple | None:
    """(base, row shape, offset) when ``node`` is ``as_strided`` of whole contiguous rows of constant shape."""
    if not isinstance(node, fx.Node) or node.target is not aten.as_strided.default:
        return None
    size, stride, offset = _strided(node, 1)
    rows = size[1:]
    if not all(isinstance(n, int) for n in [*rows, *stride]):
        return None
    contiguous = [math.prod(rows[i:]) for i in range(len(size))]
    if any(n != 1 and s != c for n, s, c in zip([None, *rows], stride, contiguous)):
        return None
    return node.args[0], rows, offset


def _replace(graph: fx.Graph, node: fx.Node, target: Any, args: tuple) -> None:
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _erase_unused(graph: fx.Graph, *nodes: fx.Node) -> None:
    for node in nodes:
        if not node.users:
            graph.erase_node(node)


def fold(graph_module: fx.GraphModule) -> tuple[int, int]:
    """Rewrites, in place, row writes and reads through views of whole rows (see the module docstring); returns
    how many writes and reads it rewrote."""
    graph, writes, reads = graph_module.graph, 0, 0
    for node in list(graph.nodes):
        if node.target is aten.as_strided_scatter.default:
            written = node.args[1]
            if not (isinstance(written, fx.Node) and written.target is aten.index_copy.default
                    and written.args[1] == 0 and len(written.users) == 1):
                continue
            viewed = written.args[0]
            view = _row_view(viewed)
            if view is None or view[0] is not node.args[0] or _strided(viewed, 1) != _strided(node, 2):
                continue
            base, rows, offset = view
            _replace(graph, node, torch.ops.hf_tpu.row_scatter.default,
                     (base, written.args[2], written.args[3], math.prod(rows), offset))
            _erase_unused(graph, written, viewed)
            writes += 1
        elif node.target is aten.index_select.default and node.args[1] == 0:
            viewed = node.args[0]
            view = _row_view(viewed)
            if view is not None:
                base, rows, offset = view
                _replace(graph, node, torch.ops.hf_tpu.row_gather.default, (base, node.args[2], rows, offset))
                _erase_unused(graph, viewed)
                reads += 1
    if writes or reads:
        graph_module.recompile()
    return writes, reads
