"""Graph outputs that are views of graph inputs with symbolic sizes, returned as views of those inputs.

AOTAutograd rebuilds a graph output that aliases a graph input from that input. When the view's sizes, strides
or offset are symbolic, it takes them from the tensor the compiled graph returned (Inductor returns a view of the
input's buffer). A program's result is a new array at offset 0, so the rebuilt view read other elements:
``t[n:]`` compiled with dynamic shapes gave ``t``'s first elements, and writes through it went there too.
:class:`InputViews` returns each such output as the view of the call's input, its sizes, strides and offset
worked out from the call's sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.SymInt) and not isinstance(value.node.maybe_as_int(), int)


def _geometry(value: torch.Tensor) -> tuple:
    return (*value.shape, *value.stride(), value.storage_offset())


class InputViews:
    """Which tensor outputs of a graph are views of which tensor inputs, where the view's geometry is symbolic, and
    where a call's values of the symbols in that geometry are found (static inputs, input sizes)."""

    def __init__(self, tensor_nodes: list[fx.Node], static_nodes: list[fx.Node], tensor_outputs: list[fx.Node]) \
            -> None:
        inputs = {StorageWeakRef(node.meta["val"].untyped_storage()): position
                  for position, node in enumerate(tensor_nodes) if isinstance(node.meta.get("val"), torch.Tensor)}
        self._outputs = {}
        for index, node in enumerate(tensor_outputs):
            value = node.meta["val"]
            position = inputs.get(StorageWeakRef(value.untyped_storage()))
            if position is not None and any(map(_symbolic, _geometry(value))):
                self._outputs[index] = (position, _geometry(value), len(value.shape))
        self._static_symbols = [(slot, node.meta["val"].node.expr) for slot, node in enumerate(static_nodes)
                                if self._outputs and _symbolic(node.meta.get("val"))
                                and node.meta["val"].node.expr.is_Symbol]
        self._size_symbols = [(position, index, size.node.expr) for position, node in enumerate(tensor_nodes)
                              if self._outputs and isinstance(node.meta.get("val"), torch.Tensor)
                              for index, size in enumerate(_geometry(node.meta["val"]))
                              if _symbolic(size) and size.node.expr.is_Symbol]

    def __bool__(self) -> bool:
        return bool(self._outputs)

    def replace(self, results: list[torch.Tensor], tensors: list[torch.Tensor], static_values: tuple) -> None:
        """Replaces, in ``results`` (the graph's tensor outputs), each such output with its view of ``tensors``."""
        symbols = {symbol: static_values[slot] for slot, symbol in self._static_symbols}
        symbols.update((symbol, _geometry(tensors[position])[index]) for position, index, symbol in self._size_symbols)
        for index, (position, geometry, dims) in self._outputs.items():
            sizes = [int(n.node.expr.xreplace(symbols)) if _symbolic(n) else int(n) for n in geometry]
            results[index] = tensors[position].as_strided(sizes[:dims], sizes[dims:2 * dims], sizes[-1])
