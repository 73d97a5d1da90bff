"""Rows written and read through a view of a graph input, without the view.

A compiled step that writes into a view of a buffer (``k_cache.index_copy_(0, rows, keys)``, where ``k_cache``
is a slice of one large paged cache, as transformers' continuous batching does) reaches graph mode
functionalized: the whole view is read, the rows written into that copy, and the copy scattered back over the
buffer (``as_strided_scatter``). XLA then copies the view twice, the size of the cache, at each step. Reading
rows of such a view (``index_select``) likewise slices the whole view first.

:func:`fold` rewrites those patterns, for a view of whole contiguous rows at any offset (or a reshape of one, as
a paged cache's pages seen as tokens), into the two ops below, which touch only the rows named: a scatter into,
and a gather from, the buffer itself (updated in place when it is donated).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
from jax import lax
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .graph_ops import graph_lowering

_LIBRARY = torch.library.Library("hf_tpu", "FRAGMENT")  # masked_attention defines ops of this namespace too
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


def _row_starts(index: Any, row_numel: int, offset: Any) -> Any:
    return (offset + index.astype(jnp.int64) * row_numel)[:, None]


@graph_lowering("hf_tpu::row_scatter")
def row_scatter(base, index, source, row_numel, offset):
    """``base`` (its elements in order) with the rows of ``row_numel`` elements that start at
    ``offset + index[i] * row_numel`` set to ``source[i]``."""
    rows = source.reshape(index.shape[0], row_numel).astype(base.dtype)
    numbers = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(),
                                          scatter_dims_to_operand_dims=(0,))
    written = lax.scatter(base.reshape(-1), _row_starts(index, row_numel, offset), rows, numbers,
                          mode=lax.GatherScatterMode.FILL_OR_DROP)
    return written.reshape(base.shape)


@graph_lowering("hf_tpu::row_gather")
def row_gather(base, index, row_shape, offset):
    """The rows of shape ``row_shape`` that start at ``offset + index[i] * numel(row_shape)`` in ``base``'s
    elements, stacked."""
    row_numel = math.prod(row_shape)
    numbers = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,))
    rows = lax.gather(base.reshape(-1), _row_starts(index, row_numel, offset), numbers, (row_numel,),
                      mode=lax.GatherScatterMode.CLIP)
    return rows.reshape(index.shape[0], *row_shape)


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


def _rows_viewed(node: Any) -> tuple | None:
    """(base, row shape, offset, the ``as_strided`` node) when ``node`` is such a view of whole contiguous rows
    (:func:`_row_view`), or a reshape of one (a paged cache's pages seen as tokens): its rows are then its
    trailing dimensions, at the same offset."""
    if not (isinstance(node, fx.Node) and node.target in (aten.view.default, aten._unsafe_view.default)):
        view = _row_view(node)
        return None if view is None else (*view, node)
    strided, rows = node.args[0], list(node.meta["val"].shape[1:])
    if not (isinstance(strided, fx.Node) and strided.target is aten.as_strided.default
            and all(isinstance(n, int) for n in rows) and statically_known_true(strided.meta["val"].is_contiguous())):
        return None  # the pages' sizes may be symbolic (a page as long as another size): their rows' are not
    return strided.args[0], rows, _strided(strided, 1)[2], strided


def _replace(graph: fx.Graph, node: fx.Node, target: Any, args: tuple) -> None:
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _erase_unused(graph: fx.Graph, *nodes: fx.Node) -> None:
    for node in dict.fromkeys(nodes):
        if not node.users:
            graph.erase_node(node)


def fold(graph_module: fx.GraphModule) -> tuple[int, int]:
    """Rewrites, in place, row writes and reads through views of whole rows (see the module docstring); returns
    how many writes and reads it rewrote."""
    graph, writes, reads = graph_module.graph, 0, 0
    for node in list(graph.nodes):
        if node.target is aten.as_strided_scatter.default:
            written = node.args[1]
            reshaped = isinstance(written, fx.Node) and written.target in (aten.view.default, aten._unsafe_view.default)
            copied = written.args[0] if reshaped else written
            if not (isinstance(copied, fx.Node) and copied.target is aten.index_copy.default
                    and copied.args[1] == 0 and len(copied.users) == 1):
                continue
            view = _rows_viewed(copied.args[0])
            if view is None or view[0] is not node.args[0] or _strided(view[3], 1) != _strided(node, 2):
                continue
            base, rows, offset, strided = view
            _replace(graph, node, torch.ops.hf_tpu.row_scatter.default,
                     (base, copied.args[2], copied.args[3], math.prod(rows), offset))
            _erase_unused(graph, *([written] if reshaped else []), copied, copied.args[0], strided)
            writes += 1
        elif node.target is aten.index_select.default and node.args[1] == 0:
            viewed = node.args[0]
            view = _rows_viewed(viewed)
            if view is not None:
                base, rows, offset, strided = view
                _replace(graph, node, torch.ops.hf_tpu.row_gather.default, (base, node.args[2], rows, offset))
                _erase_unused(graph, viewed, strided)
                reads += 1
    if writes or reads:
        graph_module.recompile()
    return writes, reads
