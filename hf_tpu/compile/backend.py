"""The ``"tpu"`` Dynamo backend: AOTAutograd, then each ATen graph lowered to one ``jax.jit``."""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._functorch.aot_autograd import make_boxed_func

from ..backend import runtime
from . import graph_lowering, recompiles, warm_start
from .graph_lowering import decompositions
from .stats import count

_warned: set[str] = set()


def lower(graph_module: torch.fx.GraphModule) -> graph_lowering.CompiledGraph:
    """Lowers an ATen graph; raises ``NotImplementedError`` naming the first op without a lowering. A graph
    with collectives (``tpu_dist``) runs as one program over its group's mesh (:mod:`.graph_collectives`)."""
    from . import graph_collectives  # torch.distributed, imported by the first graph

    if graph_collectives.has_collectives(graph_module):
        return graph_collectives.CollectiveGraph(graph_module)
    return graph_lowering.CompiledGraph(graph_module)


def _lower(graph_module: torch.fx.GraphModule) -> Callable:
    """One XLA program for the graph, or, if an operator has no graph-mode lowering, the graph run
    eagerly op by op (each op still on the device) after a one-time warning naming the operator."""
    try:
        return lower(graph_module)
    except NotImplementedError as error:
        if runtime.flag("HF_TPU_STRICT_COMPILE"):
            raise
        if str(error) not in _warned:
            _warned.add(str(error))
            warnings.warn(f"{error}; this graph runs in eager mode (HF_TPU_STRICT_COMPILE=1 makes this an error)")
        count("fallbacks")
        return make_boxed_func(graph_module)


def _without_erased_nodes(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph module with a copy of its graph holding only its live nodes: fx keeps every node a graph ever
    had (erased ones too, with their traced values) in its names, thousands after AOTAutograd's passes, and
    the module lives as long as its compiled program."""
    graph, copies = torch.fx.Graph(), {}
    graph.set_codegen(graph_module.graph._codegen)
    for node in graph_module.graph.nodes:  # the output node too, with its metadata
        copies[node] = graph.node_copy(node, copies.__getitem__)
    graph_module.graph = graph
    return graph_module


def _compile(graph_module: torch.fx.GraphModule, example_inputs: list) -> warm_start.TpuOutputCode:
    return warm_start.TpuOutputCode(_without_erased_nodes(graph_module), _lower)


def _compiler() -> SerializableAOTDispatchCompiler:
    """A compiler AOTAutograd can cache the result of; a new one per use, since torch wraps a backward
    compiler's function in place."""
    return SerializableAOTDispatchCompiler(warm_start.TpuOutputCode, _compile)


def compile_graph(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Compiles a Dynamo graph: forward and backward ATen graphs, each run as one XLA program.

    Input mutations stay in the inference graph (``keep_inference_input_mutations``, e.g. a
    StaticCache's ``index_copy_``) and are written back to the caller's tensors after each run.
    AOTAutograd's result is kept on disk for the next process (:mod:`.warm_start`).
    """
    recompiles.enable_dynamo_log()
    backend = aot_autograd(
        fw_compiler=_compiler(),
        bw_compiler=_compiler(),
        decompositions=decompositions(),
        keep_inference_input_mutations=True,
    )
    with warm_start.caching():
        return backend(graph_module, example_inputs)
