"""Tensor-parallel plans: which dim of each parameter to split over the chips of a ``tp`` mesh axis.

A plan is data, in transformers' vocabulary (``base_model_tp_plan``): module or parameter name pattern ->
style, ``*`` standing for a layer number (``"model.layers.*.self_attn.q_proj": "colwise"``). Names are full
names in the model (``model.named_modules()``); a parameter's own entry wins over its module's. What each
style splits, Megatron's layout (a colwise -> rowwise pair needs one all-reduce):

- ``colwise`` (``colwise_rep``, ``colwise_gather_output``, ``packed_colwise``): output features, weight and
  bias (a Linear's ``[out, in]`` weight on dim 0, a GPT-2 ``Conv1D``'s ``[in, out]`` on dim 1, a convolution's
  output channels, stacked experts ``[experts, out, in]`` on dim 1).
- ``rowwise`` (``rowwise_rep``, ``rowwise_split_input``, ``packed_rowwise``): input features of the weight;
  the bias stays whole (added once, after the all-reduce).
- ``embedding_rowwise``: an embedding's vocabulary (dim 0); ``embedding_colwise``: its vectors (dim 1).
- ``grouped_gemm``: stacked experts on the expert dim (dim 0), as transformers' expert-parallel plans.
- ``replicate``, ``replicated_with_grad_allreduce``, ``sequence_parallel``, ``moe_tp_experts`` (a module-level
  entry: its parameters have their own), ``ep_dispatch_experts``, ...: kept whole on every chip.

The styles' input and output layouts are the multi-process path's business: in one process, XLA's SPMD
partitioner places activations and inserts the collectives, so only the parameters' splits matter here.
Packed tensors (``packed_colwise``: gate and up, or value and gate, one after the other) are split into
contiguous blocks, as every JAX sharding is; the unpacking ``chunk`` then moves activations between chips
(memory per chip is as in the multi-process path, communication is higher).

Plans come from the model itself where it has one (transformers' ``model.tp_plan``: its config's
``base_model_tp_plan`` plus its head's ``_tp_plan``; diffusers' ``_tp_plan``), else from the plans shipped
here, one module per model family (:data:`PLANS`), else from the user (a dict, validated). A transformers MoE
model's experts that its tensor-parallel plan leaves out (transformers 5.25 splits experts only in its
expert-parallel plan, ``model.ep_plan``) take that plan's entries: one process splits them by expert over the same
axis, rather than holding every expert on every chip.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from typing import Mapping, Union

import torch
from jax.sharding import PartitionSpec

from . import bert, gpt2, pixart_transformer, sd3_transformer, t5, unet_2d_condition

Plan = Mapping[str, object]
PlanArg = Union[str, Plan]

# What a style does to a tensor of the module (or the parameter) its entry names.
_OUT, _IN, _ROWS, _COLS, _EXPERTS, _WHOLE = "output features", "input features", "dim 0", "dim 1", "experts", "whole"

STYLES: dict[str, str] = {
    **dict.fromkeys(("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"), _OUT),
    **dict.fromkeys(("rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise"), _IN),
    "embedding_rowwise": _ROWS,
    "embedding_colwise": _COLS,
    "grouped_gemm": _EXPERTS,
    **dict.fromkeys(("replicate", "replicated_with_grad_allreduce", "sequence_parallel", "all_reduce",
                     "moe_tp_experts", "moe_identity_expert", "local_params", "mla_kv_a_proj",
                     "ep_dispatch_experts"), _WHOLE),
    # the names of transformers 4.5x, for plans written for it
    "local_colwise": _OUT, "local_rowwise": _IN, "local_packed_rowwise": _IN, "replicated": _WHOLE,
    "ep_router": _WHOLE,
}
"""Every style a plan may name, with what it splits (see the module docstring)."""

PLANS: dict[str, dict[str, str]] = {
    "gpt2": gpt2.TP_PLAN, "bert": bert.TP_PLAN, "t5": t5.TP_PLAN,
    "UNet2DConditionModel": unet_2d_condition.TP_PLAN, "SD3Transformer2DModel": sd3_transformer.TP_PLAN,
    "PixArtTransformer2DModel": pixart_transformer.TP_PLAN,
}
"""The shipped plans, for models with none upstream: transformers ``model_type`` or diffusers class name ->
plan relative to the base model (``model.base_model``; the model itself for diffusers)."""

# diffusers writes its packed styles as objects (with the packed blocks' sizes)
_DIFFUSERS_STYLES = {"PackedColwiseParallel": "packed_colwise", "PackedRowwiseParallel": "packed_rowwise"}

# Config numbers a tp size must divide for Megatron's layout (heads and features whole on each chip), and
# whether each counts heads (a split dim of count x head_dim) or features (a split dim of count).
_CONFIG_COUNTS = (("num_attention_heads", "attention heads", True), ("num_key_value_heads", "key/value heads", True),
                  ("intermediate_size", "MLP's intermediate size", False), ("d_ff", "feed-forward size", False),
                  ("moe_intermediate_size", "experts' intermediate size", False))
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
_HEAD_DIMS = ("head_dim", "d_kv", "attention_head_dim")


def plan_for(model: torch.nn.Module) -> dict[str, str]:
    """The model's own plan with full names (transformers' ``model.tp_plan``, with its ``ep_plan``'s entries
    for what the former leaves out; diffusers' ``_tp_plan``), else the shipped plan of its family
    (:data:`PLANS`) under its base model's name. Raises if there is neither."""
    upstream = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if upstream:
        experts = {key: style for key, style in (getattr(model, "ep_plan", None) or {}).items() if key not in upstream}
        return {key: _style_name(key, style) for key, style in {**upstream, **experts}.items()}
    family = _family(model)
    if family not in PLANS:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan, upstream or shipped in "
                         f"hf_tpu.tp_plans (shipped: {', '.join(PLANS)}): pass plan={{'<module name>': 'colwise', "
                         "...}} with full module names and * for layer numbers")
    return _under_base_model(model, PLANS[family])


def parameter_specs(model: torch.nn.Module, tp_size: int, plan: PlanArg = "auto",
                    axis: str = "tp") -> dict[str, PartitionSpec]:
    """Per parameter and buffer name of ``model`` (tied tensors under each of their names), the
    ``PartitionSpec`` that splits it over mesh axis ``axis`` of ``tp_size`` chips as ``plan`` says:
    ``"auto"`` (:func:`plan_for`), a family of :data:`PLANS` (relative to the base model), or a dict of
    full names -> styles (each entry must match a module or parameter). Tensors no entry names are whole
    (``PartitionSpec()``). Raises ``ValueError`` saying what to change when ``tp_size`` does not divide the
    heads, key/value heads, intermediate sizes, experts or a split dim, or the plan is malformed."""
    dims = _checked_split_dims(model, tp_size, plan)
    return {name: PartitionSpec(*[None] * dim, axis) if dim is not None else PartitionSpec()
            for name, (dim, _keys) in dims.items()}


def check_tp_size(model: torch.nn.Module, tp_size: int, plan: PlanArg = "auto") -> None:
    """Raises the ``ValueError`` of :func:`parameter_specs` if ``plan`` cannot split ``model`` ``tp_size`` ways
    (also for the multi-process path, where transformers or diffusers split the weights)."""
    _checked_split_dims(model, tp_size, plan)


def _checked_split_dims(model: torch.nn.Module, tp_size: int,
                        plan: PlanArg) -> dict[str, tuple[int | None, tuple[str, ...]]]:
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int (the number of chips to split over), got {tp_size!r}")
    entries = _entries(model, plan)
    dims = _split_dims(model, entries)
    if tp_size > 1:
        _check_divisible(model, entries, dims, tp_size)
    return dims


def _family(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return model_type if isinstance(model_type, str) and model_type else type(model).__name__


def _under_base_model(model: torch.nn.Module, plan: Plan) -> dict[str, str]:
    base = getattr(model, "base_model", model)
    prefix = next(name for name, module in model.named_modules() if module is base)
    return {f"{prefix}.{key}" if prefix else key: style for key, style in plan.items()}


def _style_name(key: str, style: object) -> str:
    name = _DIFFUSERS_STYLES.get(type(style).__name__, style)
    if not isinstance(name, str) or name not in STYLES:
        close = difflib.get_close_matches(str(name), STYLES, n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(f"plan entry {key!r}: unknown style {style!r}{hint}; the styles are transformers': "
                         f"{', '.join(sorted(STYLES))}")
    return name


def _entries(model: torch.nn.Module, plan: PlanArg) -> list[tuple[str, re.Pattern, str]]:
    if isinstance(plan, str):
        if plan == "auto":
            resolved, strict = plan_for(model), False
        elif plan in PLANS:
            resolved, strict = _under_base_model(model, PLANS[plan]), False
        else:
            raise ValueError(f"plan={plan!r}: pass 'auto', a shipped family ({', '.join(PLANS)}) or a dict of "
                             "module name pattern -> style")
    elif isinstance(plan, Mapping):
        resolved, strict = plan, True
    else:
        raise TypeError(f"plan must be 'auto', a family name or a dict of module pattern -> style, "
                        f"not {type(plan).__name__}")
    entries = []
    for key, style in resolved.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"plan keys are module or parameter names (str), got {key!r}")
        pattern = re.compile(r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in key.split(".")))
        entries.append((key, pattern, _style_name(key, style)))
    if strict:
        _check_every_entry_matches(model, entries)
    return entries


def _check_every_entry_matches(model: torch.nn.Module, entries: list[tuple[str, re.Pattern, str]]) -> None:
    names = [name for name, _ in model.named_modules(remove_duplicate=False) if name]
    names += [name for name, _ in model.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in model.named_buffers(remove_duplicate=False)]
    for key, pattern, _ in entries:
        if not any(pattern.fullmatch(name) for name in names):
            generic = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in names})
            close = difflib.get_close_matches(key, generic, n=3, cutoff=0.5)
            hint = f"; close names: {', '.join(repr(c) for c in close)}" if close else ""
            raise ValueError(f"plan entry {key!r} matches no module or parameter of {type(model).__name__}{hint} "
                             "(keys are full names as in model.named_modules(), with * for layer numbers)")


def _split_dims(model: torch.nn.Module, entries: list[tuple[str, re.Pattern, str]]
                ) -> dict[str, tuple[int | None, tuple[str, ...]]]:
    """Per tensor name: the dim its plan entries split (``None``: whole) and those entries' keys. A tied
    tensor gets one split under all its names: the one its split names agree on."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    own: dict[str, tuple[int | None, str | None]] = {}
    for name, tensor in named:
        owner_name = name.rpartition(".")[0]
        key, style = _entry_for(name, owner_name, entries)
        own[name] = (None, None) if style is None else (_dim(STYLES[style], model.get_submodule(owner_name), tensor),
                                                        key)
    groups: dict[int, list[str]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(name)
    dims = {}
    for names in groups.values():
        splits = {own[name][0] for name in names} - {None}
        keys = tuple(dict.fromkeys(own[name][1] for name in names if own[name][0] is not None))
        if len(splits) > 1:
            raise ValueError(f"{', '.join(names)} are one (tied) tensor, but plan entries {list(keys)} split it on "
                             "different dims: give its names styles that agree")
        dims.update(dict.fromkeys(names, (next(iter(splits), None), keys)))
    return dims


def _entry_for(name: str, owner_name: str, entries: list[tuple[str, re.Pattern, str]]
               ) -> tuple[str | None, str | None]:
    for target in (name, owner_name):
        for key, pattern, style in entries:
            if target and pattern.fullmatch(target):
                return key, style
    return None, None


def _dim(kind: str, owner: torch.nn.Module, tensor: torch.Tensor) -> int | None:
    if kind == _WHOLE or tensor.ndim == 0:
        return None
    if kind in (_ROWS, _EXPERTS):
        return 0
    if kind == _COLS:
        return 1 if tensor.ndim > 1 else None
    out_dim, in_dim = _feature_dims(owner, tensor.ndim)
    return out_dim if kind == _OUT else in_dim


def _feature_dims(owner: torch.nn.Module, ndim: int) -> tuple[int, int | None]:
    """The (output features, input features) dims of a tensor of ``owner`` with ``ndim`` dims."""
    if ndim == 1:
        return 0, None  # a bias: with the outputs; whole where the inputs are split
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if conv1d is not None and isinstance(owner, conv1d):
        return 1, 0
    if isinstance(owner, torch.nn.modules.conv._ConvNd):
        return (1, 0) if owner.transposed else (0, 1)
    return ndim - 2, ndim - 1  # Linear [out, in], stacked experts [experts, out, in]


def _check_divisible(model: torch.nn.Module, entries: list[tuple[str, re.Pattern, str]],
                     dims: dict[str, tuple[int | None, tuple[str, ...]]], tp_size: int) -> None:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    split = {name: dim for name, (dim, _) in dims.items() if dim is not None}
    if not split:
        return
    sizes = {name: tensors[name].shape[dim] for name, dim in split.items()}
    counts = _structural_counts(model, entries, sizes)
    valid = _divisors(math.gcd(*counts.values(), *sizes.values()))
    failing = [what for what, count in counts.items() if count % tp_size]
    if failing:
        raise ValueError(f"tp_size={tp_size} does not divide {', '.join(failing)} of {type(model).__name__}: "
                         f"use a tp size that splits them evenly ({', '.join(map(str, valid))}), or a plan "
                         "that keeps those layers whole")
    for name, size in sizes.items():
        if size % tp_size:
            keys = dims[name][1]
            whole = ", ".join(f"{key!r}: 'replicate'" for key in keys)
            raise ValueError(f"{name} (shape {tuple(tensors[name].shape)}) is split on dim {split[name]} by plan "
                             f"entries {', '.join(map(repr, keys))}, but tp_size={tp_size} does not divide its size "
                             f"{size}: use a tp size of {', '.join(map(str, valid))}, or keep it whole with "
                             f"plan={{**hf_tpu.tp_plans.plan_for(model), {whole}}}")


def _structural_counts(model: torch.nn.Module, entries: list[tuple[str, re.Pattern, str]],
                       sizes: dict[str, int]) -> dict[str, int]:
    """What Megatron's layout keeps whole on each chip, where the plan splits it: heads (from the config, or
    diffusers' attention modules' ``heads``), intermediate sizes, and experts when a ``grouped_gemm`` entry
    splits the expert dim. ``sizes``: the size of each split tensor's split dim."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    head_dim = next((_config_count(config, name) for name in _HEAD_DIMS if _config_count(config, name)), None)
    heads, hidden = _config_count(config, "num_attention_heads"), _config_count(config, "hidden_size")
    head_dim = head_dim or (hidden // heads if heads and hidden else None)
    counts = {}
    for attribute, what, per_head in _CONFIG_COUNTS:
        value = _config_count(config, attribute)
        unit = head_dim if per_head else 1
        if value and unit and value * unit in sizes.values() and value not in counts.values():
            counts[f"the {what} ({attribute}={value})"] = value
    if any(STYLES[style] == _EXPERTS for _, _, style in entries):
        for attribute in _EXPERT_COUNTS:
            if (value := _config_count(config, attribute)) and value not in counts.values():
                counts[f"the experts ({attribute}={value})"] = value
    for name, module in model.named_modules():
        count = getattr(module, "heads", None)
        if isinstance(count, int) and count > 0 and count not in counts.values() and any(
                key.startswith(f"{name}.") for key in sizes):
            counts[f"the attention heads of {name} (heads={count})"] = count
    return counts


def _config_count(config: object, attribute: str) -> int | None:
    value = config.get(attribute) if isinstance(config, Mapping) else getattr(config, attribute, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


__all__ = ["PLANS", "STYLES", "check_tp_size", "parameter_specs", "plan_for"]
