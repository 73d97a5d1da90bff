"""FlexAttention in graph mode: its operators expanded into the ATen ops of torch's own implementation.

A compiled ``flex_attention`` reaches graph mode as the higher-order operators ``flex_attention`` (forward) and
``flex_attention_backward``, with ``score_mod`` and the block mask's ``mask_mod`` as graphs of their own. torch
implements both operators for any device in ATen ops (``sdpa_dense`` and ``sdpa_dense_backward``: every query
against every key, ``score_mod`` applied to the scores, ``mask_mod`` masking them). :func:`expand` traces that
implementation, with the node's own ``score_mod`` and ``mask_mod`` graphs, into ATen ops and puts them in place of
the node, so that the graph lowers to one XLA program with the mask and the score modification in it (XLA fuses
them into the score computation). A graph with symbolic sizes (Dynamo's recompile after a new batch size) is
traced with them: its integer inputs are the expansion's too. The block mask's sparsity is not used: masked blocks
are computed and masked.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree


def _implementations() -> dict[Any, Any]:
    flex = importlib.import_module("torch._higher_order_ops.flex_attention")  # the package exports the operator
    return {flex.flex_attention: flex.sdpa_dense, flex.flex_attention_backward: flex.sdpa_dense_backward}


def _replace_uses(node: fx.Node, value: Any, graph: fx.Graph) -> None:
    """Points the users of ``node`` (an operator's result, maybe a tuple taken apart by ``getitem``) at ``value``."""
    if isinstance(value, fx.Node):
        node.replace_all_uses_with(value)
        return
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise NotImplementedError(f"tpu graph mode: {user} uses FlexAttention's results as a whole")
        _replace_uses(user, value[user.args[1]], graph)
        graph.erase_node(user)


def _expand_node(graph_module: fx.GraphModule, node: fx.Node, implementation: Any, decompositions: dict) -> None:
    graph = graph_module.graph
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    inputs = [index for index, leaf in enumerate(leaves) if isinstance(leaf, fx.Node) and leaf.op != "get_attr"]
    values = [getattr(graph_module, leaf.target) if isinstance(leaf, fx.Node) and leaf.op == "get_attr" else leaf
              for leaf in leaves]

    def run(*tensors: torch.Tensor) -> Any:
        for index, tensor in zip(inputs, tensors):
            values[index] = tensor
        args, kwargs = pytree.tree_unflatten(values, spec)
        return implementation(*args, **kwargs)

    fakes = [leaves[index].meta["val"] for index in inputs]
    with detect_fake_mode(fakes):
        traced = make_fx(run, decomposition_table=decompositions)(*fakes)
    mapping: dict[fx.Node, Any] = {}
    placeholders = iter(leaves[index] for index in inputs)
    with graph.inserting_before(node):
        for inner in traced.graph.nodes:
            if inner.op == "placeholder":
                mapping[inner] = next(placeholders)
            elif inner.op == "get_attr":
                name = f"_flex_attention_{len(graph_module._buffers)}_{inner.target}"
                graph_module.register_buffer(name, getattr(traced, inner.target))
                mapping[inner] = graph.get_attr(name)
                mapping[inner].meta = dict(inner.meta)
            elif inner.op == "output":
                results = pytree.tree_map(lambda value: mapping.get(value, value) if isinstance(value, fx.Node)
                                          else value, inner.args[0])
            else:
                mapping[inner] = graph.node_copy(inner, lambda value: mapping[value])
    _replace_uses(node, results, graph)
    graph.erase_node(node)


def expand(graph_module: fx.GraphModule, decompositions: dict) -> int:
    """Expands, in place, each FlexAttention operator of the graph (see the module docstring) into ATen ops, with
    ``decompositions`` for those graph mode does not lower; returns how many."""
    implementations = _implementations()
    nodes = [node for node in graph_module.graph.nodes
             if node.op == "call_function" and node.target in implementations]
    for node in nodes:
        try:
            _expand_node(graph_module, node, implementations[node.target], decompositions)
        except NotImplementedError:
            raise
        except Exception as error:  # tracing torch's implementation failed: the graph runs op by op
            raise NotImplementedError(f"tpu graph mode: FlexAttention not expanded ({type(error).__name__}: "
                                      f"{error})") from error
    if nodes:
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
    return len(nodes)
