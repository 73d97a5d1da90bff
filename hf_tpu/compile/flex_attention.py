"""FlexAttention in graph mode: its operators expanded into the ATen ops of torch's own implementation.

A compiled ``flex_attention`` reaches graph mode as the higher-order operators ``flex_attention`` (forward) and
``flex_attention_backward``, with ``score_mod`` and the block mask's ``mask_mod`` as graphs of their own. torch
implements both operators for any device in ATen ops (``sdpa_dense`` and ``sdpa_dense_backward``: every query
against every key, ``score_mod`` applied to the scores, ``mask_mod`` masking them). :func:`expand` traces that
implementation, with the node's own ``score_mod`` and ``mask_mod`` graphs, into ATen ops and puts them in place of
the node, so that the graph lowers to one XLA program with the mask and the score modification in it (XLA fuses
them into the score computation). A graph with symbolic sizes (Dynamo's recompile after a new batch size) is
traced with them: its integer inputs are the expansion's too. Expanded so, the block mask's sparsity is not used:
masked blocks are computed and masked.

Where Pallas kernels are used (TPU chips; ``HF_TPU_PALLAS=1``), an operator without a score modification (or with
soft-capping only), in float32 or bfloat16, is expanded instead into its mask (``mask_mod`` over every query and
key, once for each example or head only where it reads them) and JAX's splash-attention kernel
(:mod:`.masked_attention`'s ops), which skips the 128 x 128 blocks the mask allows nothing in: the forward keeps its
logsumexp for the backward, whose kernels do not compute the forward again.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree

from ..backend import runtime
from . import masked_attention  # noqa: F401  (defines the ops the kernel's expansion makes)


def _implementations() -> dict[Any, tuple[Any, Any, bool]]:
    """Each operator's dense implementation (torch's), the masked-attention kernel's, and whether it is the
    forward."""
    flex = importlib.import_module("torch._higher_order_ops.flex_attention")  # the package exports the operator
    return {flex.flex_attention: (flex.sdpa_dense, _masked_forward, True),
            flex.flex_attention_backward: (flex.sdpa_dense_backward, _masked_backward, False)}


def _replace_uses(node: fx.Node, value: Any, graph: fx.Graph) -> None:
    """Points the users of ``node`` (an operator's result, maybe a tuple taken apart by ``getitem``) at ``value``
    (``None`` for a result nothing uses)."""
    if value is None:
        if node.users:
            raise NotImplementedError(f"tpu graph mode: {node} uses a FlexAttention result not computed")
        return
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


def _mask(query: torch.Tensor, key: torch.Tensor, block_mask: tuple, buffers: tuple) -> torch.Tensor:
    """``mask_mod`` at every query and key, ``[B | 1, Hq | 1, Q, K]``: one example or head where it reads none."""
    vmap_for_bhqkv = importlib.import_module("torch.nn.attention.flex_attention")._vmap_for_bhqkv
    get_item_to_index = importlib.import_module("torch._dynamo._trace_wrapped_higher_order_op").TransformGetItemToIndex
    mask_mod = block_mask[-1]
    example, head = [node for node in mask_mod.graph.nodes if node.op == "placeholder"][:2]
    sizes = (query.size(0) if example.users else 1, query.size(1) if head.users else 1, query.size(2), key.size(2))
    indices = [torch.arange(size, device=query.device) for size in sizes]
    with get_item_to_index():
        return vmap_for_bhqkv(mask_mod, prefix=(), suffix=(None,) * len(buffers))(*indices, *buffers)


def _kernel_score_modification(score_mod: fx.GraphModule) -> tuple[bool, float | None]:
    """Whether the kernel computes the score modification ``score_mod`` (a graph of ATen ops), and its soft cap:
    none for the score itself, ``c`` for ``c * tanh(score / c)`` (Gemma 2's soft-capping, as transformers writes
    it)."""
    score = next(node for node in score_mod.graph.nodes if node.op == "placeholder")
    result = next(node for node in score_mod.graph.nodes if node.op == "output").args[0]
    if result is score:
        return True, None
    if not (isinstance(result, fx.Node) and result.target is torch.ops.aten.mul.Tensor):
        return False, None
    tanh, cap = result.args if isinstance(result.args[1], float) else result.args[::-1]
    if not (isinstance(cap, float) and isinstance(tanh, fx.Node) and tanh.target is torch.ops.aten.tanh.default):
        return False, None
    inner = tanh.args[0]
    capped = (isinstance(inner, fx.Node) and inner.target is torch.ops.aten.div.Tensor and inner.args[0] is score
              and inner.args[1] == cap)
    return capped, cap if capped else None


def _masked_forward(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers=(),
                    mask_mod_other_buffers=()) -> tuple:
    """``sdpa_dense``'s signature and results, less the row maxima (no user: :func:`_kernel_serves`)."""
    mask = _mask(query, key, block_mask, mask_mod_other_buffers)
    soft_cap = _kernel_score_modification(score_mod)[1]
    out, logsumexp = torch.ops.hf_tpu.masked_attention(query, key, value, mask, scale, soft_cap)
    return out, logsumexp, None


def _masked_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph, block_mask,
                     scale, kernel_options, score_mod_other_buffers, mask_mod_other_buffers) -> tuple:
    """``sdpa_dense_backward``'s signature and results (a score modification the kernel computes has no buffers,
    so no gradients of them)."""
    mask = _mask(query, key, block_mask, mask_mod_other_buffers)
    soft_cap = _kernel_score_modification(fw_graph)[1]
    gradients = torch.ops.hf_tpu.masked_attention_backward(query, key, value, out, logsumexp, grad_out, mask, scale,
                                                           soft_cap)
    return (*gradients, ())


def _kernel_serves(graph_module: fx.GraphModule, node: fx.Node, forward: bool) -> bool:
    """Whether the masked-attention kernel computes this FlexAttention node: Pallas kernels in use, no score
    modification but soft-capping, float32 or bfloat16 inputs of one batch size, and none of the results it lacks
    used (the forward's row maxima, the backward's gradient of the logsumexp)."""
    if not runtime.pallas_kernels():
        return False
    score_mod = graph_module.get_submodule(node.args[3 if forward else 7].target)
    if not _kernel_score_modification(score_mod)[0]:
        return False
    query, key, value = (node.args[index].meta["val"] for index in range(3))
    if query.dtype not in (torch.float32, torch.bfloat16) or not query.dtype == key.dtype == value.dtype:
        return False
    if not statically_known_true(query.size(0) == key.size(0)):
        return False
    if forward:
        return not any(user.args[1] == 2 and user.users for user in node.users)
    return node.args[6] is None


def expand(graph_module: fx.GraphModule, decompositions: dict) -> int:
    """Expands, in place, each FlexAttention operator of the graph (see the module docstring) into ATen ops (and the
    masked-attention kernel's, where it serves), with ``decompositions`` for those graph mode does not lower; returns
    how many."""
    implementations = _implementations()
    nodes = [node for node in graph_module.graph.nodes
             if node.op == "call_function" and node.target in implementations]
    for node in nodes:
        dense, kernel, forward = implementations[node.target]
        implementation = kernel if _kernel_serves(graph_module, node, forward) else dense
        try:
            _expand_node(graph_module, node, implementation, decompositions)
        except NotImplementedError:
            raise
        except Exception as error:  # tracing torch's implementation failed: the graph runs op by op
            raise NotImplementedError(f"tpu graph mode: FlexAttention not expanded ({type(error).__name__}: "
                                      f"{error})") from error
    if nodes:
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
    return len(nodes)
