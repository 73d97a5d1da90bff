"""Every path an op can take on tpu gives CPU's answer.

An op that hf_tpu lowers itself can reach the device by more than one road: scaled_dot_product_attention takes its
fused lowering, or torch's math decomposition under ``sdpa_kernel`` choices without the overrideable backend, with
dropout, under ``torch.func`` transforms and forward-mode AD; norms, losses, embedding bags and softmaxes run their
own lowerings in autograd and inference mode but torch's decompositions and batching rules under ``vmap`` and
forward-mode AD. A bug on one road (a boolean mask left unconverted on the math path) is invisible from the others,
so each op here runs down every road, on CPU and on tpu, and the two are compared.

The roads (:data:`PATHS`): autograd (output and gradients), inference mode, ``torch.func.vmap``, ``torch.func.grad``,
``torch.func.jvp`` and ``torch.autograd.forward_ad``. Attention also runs under each ``sdpa_kernel`` choice, with
every mask kind (none, boolean, per-head boolean, float, causal, rows with every key masked) and with grouped and
ungrouped heads; with dropout, where CPU's random numbers differ, a masked key must change nothing. Where CPU
refuses a path (forward-mode AD of an embedding bag, which torch does not define), tpu must refuse it too.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import assert_same, to_tpu

PATHS = ("autograd", "inference_mode", "vmap", "grad", "jvp", "forward_ad")


@dataclass
class Case:
    """``fn(*args)``; ``differentiable`` indexes the args that gradients and tangents are taken for, ``in_dims`` is
    what ``vmap`` maps over (dim 0 of the first arg by default), ``cpu_context`` wraps the CPU reference."""

    fn: Callable[..., torch.Tensor]
    args: tuple
    differentiable: tuple[int, ...] = (0,)
    in_dims: tuple = (0,)
    tolerance: float = 1e-5
    cpu_context: Callable[[], Any] = contextlib.nullcontext

    def vmap_dims(self) -> tuple:
        return self.in_dims + (None,) * (len(self.args) - len(self.in_dims))


def _cotangent(out: torch.Tensor) -> torch.Tensor:
    """A fixed, non-uniform weighting of ``out``'s elements (so gradients are not of a plain sum)."""
    return torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape).to(out.device)


def _tangents(case: Case, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(case.args[i].shape, generator=generator, dtype=case.args[i].dtype).to(device)
            for i in case.differentiable]


def _with(args: tuple, replacements: dict[int, Any]) -> list:
    return [replacements.get(i, arg) for i, arg in enumerate(args)]


def run_path(case: Case, path: str, device: str) -> Any:
    """The case's results along ``path`` on ``device``: outputs, and gradients or tangents where the path has them."""
    args = to_tpu(case.args) if device == "tpu" else case.args
    fn = case.fn
    if path == "autograd":
        leaves = {i: args[i].detach().clone().requires_grad_() for i in case.differentiable}
        out = fn(*_with(args, leaves))
        (out * _cotangent(out)).sum().backward()
        return out.detach(), [leaves[i].grad for i in case.differentiable]
    if path == "inference_mode":
        with torch.inference_mode():
            return fn(*args)
    if path == "vmap":
        return torch.func.vmap(fn, in_dims=case.vmap_dims())(*args)
    if path == "grad":
        def weighted(*chosen):
            out = fn(*_with(args, dict(zip(case.differentiable, chosen))))
            return (out * _cotangent(out)).sum()

        return torch.func.grad(weighted, argnums=tuple(range(len(case.differentiable))))(
            *(args[i] for i in case.differentiable))
    tangents = _tangents(case, device)
    if path == "jvp":
        def of_chosen(*chosen):
            return fn(*_with(args, dict(zip(case.differentiable, chosen))))

        return torch.func.jvp(of_chosen, tuple(args[i] for i in case.differentiable), tuple(tangents))
    assert path == "forward_ad", path
    with forward_ad.dual_level():
        duals = {i: forward_ad.make_dual(args[i], t) for i, t in zip(case.differentiable, tangents)}
        primal, tangent = forward_ad.unpack_dual(fn(*_with(args, duals)))
        return primal, tangent


def check_path(case: Case, path: str) -> None:
    """The path on tpu gives what it gives on CPU: the same values (NaN where CPU's is NaN, as for a sample whose
    only target is ignored), or the same error."""
    try:
        with case.cpu_context():
            expected = run_path(case, path, "cpu")
    except RuntimeError as cpu_error:
        with pytest.raises(type(cpu_error)):
            run_path(case, path, "tpu")
        return
    actual = run_path(case, path, "tpu")
    assert_same(actual, expected, atol=case.tolerance, rtol=case.tolerance, equal_nan=True)


# --- scaled_dot_product_attention ------------------------------------------------------------------

torch.manual_seed(0)
_Q = torch.randn(2, 4, 5, 8)
_KV = {"mha": (torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)),
       "gqa": (torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8))}
_ATTEND = torch.rand(5, 6) > 0.4
_ATTEND[:, 0] = True
_ATTEND_PER_HEAD = torch.rand(2, 4, 5, 6) > 0.4
_ATTEND_PER_HEAD[..., 1] = True
_ROWS_ALL_MASKED = _ATTEND.clone()
_ROWS_ALL_MASKED[2] = False

MASKS = {
    "none": dict(),
    "bool": dict(attn_mask=_ATTEND),
    "bool_per_head": dict(attn_mask=_ATTEND_PER_HEAD),
    "float": dict(attn_mask=torch.randn(2, 1, 5, 6)),
    "causal": dict(is_causal=True),
    "rows_all_masked": dict(attn_mask=_ROWS_ALL_MASKED),
}

CONTEXTS = {
    "default": None,
    "math": [SDPBackend.MATH],
    "without_overrideable": [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "overrideable_first": [SDPBackend.OVERRIDEABLE, SDPBackend.MATH],
}


def attention_case(mask: str, heads: str, context: str = "default") -> Case:
    """CPU's reference is its math path (the definition; CPU has no overrideable backend, and its flash kernel
    differs from the math path on rows with every key masked)."""
    options = dict(MASKS[mask], enable_gqa=heads == "gqa")
    mask_tensor = options.pop("attn_mask", None)
    backends = CONTEXTS[context]

    def attention(q, k, v, attn_mask=None):
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **options)

    args = (_Q, *_KV[heads]) + (() if mask_tensor is None else (mask_tensor,))
    per_sample_mask = mask_tensor is not None and mask_tensor.dim() == 4
    in_dims = (0, 0, 0, 0 if per_sample_mask else None)[:len(args)]
    return Case(attention, args, differentiable=(0, 1, 2), in_dims=in_dims,
                cpu_context=lambda: sdpa_kernel([SDPBackend.MATH]))


@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("context", CONTEXTS)
def test_attention_under_each_backend_choice(context, mask, heads):
    check_path(attention_case(mask, heads, context), "autograd")


@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("path", [p for p in PATHS if p != "autograd"])
def test_attention_along_each_path(path, mask, heads):
    check_path(attention_case(mask, heads), path)


def test_attention_with_heads_that_do_not_group_raises_as_on_cpu():
    k, v = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    check_path(Case(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), (_Q, k, v)),
               "autograd")


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_dropout_ignores_masked_keys(mask_kind):
    """With dropout (the math path, random numbers CPU does not share) keys a padding mask removes change nothing:
    new values there leave the output and the other keys' gradients as they were, and get no gradient."""
    padding = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    padding[0, ..., 4:] = False
    padding[1, ..., 2:] = False
    mask = padding if mask_kind == "bool" else torch.zeros(padding.shape).masked_fill(~padding, float("-inf"))
    k, v = _KV["mha"]
    noise = torch.randn(k.shape) * 10 * ~padding.transpose(-1, -2)

    def attend(k, v, dropout_p=0.4):
        leaves = [t.to("tpu").requires_grad_() for t in (_Q, k, v)]
        torch.manual_seed(7)
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask.to("tpu"), dropout_p=dropout_p)
        (out * _cotangent(out)).sum().backward()
        return out.detach().cpu(), [t.grad.cpu() for t in leaves]

    out, grads = attend(k, v)
    noisy_out, noisy_grads = attend(k + noise, v + noise)
    torch.testing.assert_close(noisy_out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(noisy_grads[0], grads[0], atol=1e-4, rtol=1e-4)
    kept = padding.transpose(-1, -2).expand_as(k)
    for grad in grads[1:]:
        assert torch.all(grad[~kept] == 0)
        assert grad[kept].abs().sum() > 0
    assert not torch.allclose(out, attend(k, v, dropout_p=0.0)[0]), "dropout dropped nothing"


def test_dropout_with_a_boolean_mask_equals_the_float_mask():
    q, k, v = to_tpu((_Q, *_KV["mha"]))
    additive = torch.zeros(_ATTEND.shape).masked_fill(~_ATTEND, float("-inf"))
    results = []
    for mask in (_ATTEND, additive):
        torch.manual_seed(3)
        results.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to("tpu"), dropout_p=0.3).cpu())
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)


def test_compiled_attention_with_a_boolean_mask_on_the_math_path():
    """Graph mode traces the math path's decomposition, boolean mask converted, forward and backward."""
    torch._dynamo.reset()
    case = attention_case("bool", "mha")

    def math_attention(q, k, v, attn_mask):
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    expected = run_path(Case(math_attention, case.args, (0, 1, 2)), "autograd", "cpu")
    actual = run_path(Case(torch.compile(math_attention, backend="tpu"), case.args, (0, 1, 2)), "autograd", "tpu")
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)


# --- norms, losses, embedding bags, softmaxes, rotary ---------------------------------------------

torch.manual_seed(1)
_X = torch.randn(3, 4, 8)
_LOGITS = torch.randn(6, 5)
_CLASSES = torch.tensor([0, 4, 2, -100, 1, 3])
_WEIGHT = torch.rand(5) + 0.5
_TABLE = torch.randn(10, 4)
_BAGS = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]])


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotary(q, k):
    """transformers' ``apply_rotary_pos_emb`` (Llama) at positions 0..L-1."""
    inverse = 1.0 / (10000 ** (torch.arange(0, q.size(-1), 2, dtype=torch.float32, device=q.device) / q.size(-1)))
    angles = torch.outer(torch.arange(q.size(-2), dtype=torch.float32, device=q.device), inverse)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    return torch.cat((q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin), dim=-1)


def _bag(weight, indices, **options):
    """``F.embedding_bag`` of a (bags, size) index matrix, or of one bag (a vector, as ``vmap`` hands each)."""
    offsets = None if indices.dim() == 2 else torch.zeros(1, dtype=torch.long, device=indices.device)
    return F.embedding_bag(indices, weight, offsets, **options)


def _rows_of_minus_inf(x):
    return x.masked_fill(torch.arange(x.size(-2), device=x.device)[:, None] == 1, float("-inf"))


OP_CASES = {
    "layer_norm": Case(lambda x, w, b: F.layer_norm(x, (8,), w, b), (_X, torch.randn(8), torch.randn(8)), (0, 1, 2)),
    "layer_norm_no_affine": Case(lambda x: F.layer_norm(x, (4, 8)), (_X,)),
    "rms_norm": Case(lambda x, w: F.rms_norm(x, (8,), w, eps=1e-6), (_X, torch.randn(8)), (0, 1)),
    "group_norm": Case(lambda x, w, b: F.group_norm(x, 2, w, b), (_X[..., :4], torch.randn(4), torch.randn(4)),
                       (0, 1, 2)),
    "cross_entropy": Case(lambda x, t: F.cross_entropy(x, t), (_LOGITS, _CLASSES), in_dims=(0, 0)),
    "cross_entropy_weighted": Case(lambda x, t, w: F.cross_entropy(x, t, weight=w), (_LOGITS, _CLASSES, _WEIGHT),
                                   in_dims=(0, 0)),
    "cross_entropy_label_smoothing": Case(
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1, reduction="none"),
        (_LOGITS, _CLASSES.clamp(min=0)), in_dims=(0, 0)),
    "cross_entropy_probabilities": Case(lambda x, p: F.cross_entropy(x, p.softmax(-1)), (_LOGITS, torch.randn(6, 5)),
                                        (0, 1), in_dims=(0, 0)),
    "nll_loss_sum": Case(lambda x, t: F.nll_loss(x.log_softmax(-1), t, reduction="sum"), (_LOGITS, _CLASSES),
                         in_dims=(0, 0)),
    "embedding_bag_sum": Case(lambda w, i: _bag(w, i, mode="sum"), (_TABLE, _BAGS), in_dims=(None, 0)),
    "embedding_bag_mean_padding": Case(lambda w, i: _bag(w, i, mode="mean", padding_idx=4), (_TABLE, _BAGS),
                                       in_dims=(None, 0)),
    "embedding_bag_max": Case(lambda w, i: _bag(w, i, mode="max"), (_TABLE, _BAGS), in_dims=(None, 0)),
    "embedding_bag_per_sample_weights": Case(lambda w, i, s: _bag(w, i, mode="sum", per_sample_weights=s),
                                             (_TABLE, _BAGS, torch.rand(2, 4)), (0, 2), in_dims=(None, 0, 0)),
    "softmax": Case(lambda x: F.softmax(x, -1), (_X,)),
    "log_softmax": Case(lambda x: F.log_softmax(x, 1), (_X,)),
    "softmax_to_float64": Case(lambda x: F.softmax(x, -1, dtype=torch.float64), (_X,)),
    "softmin": Case(lambda x: F.softmin(x, 0), (_X,)),
    "softmax_half_to_float": Case(lambda x: torch._softmax(x.bfloat16(), -1, False).float(), (_X,), tolerance=1e-2),
    "safe_softmax_rows_of_minus_inf": Case(lambda x: torch._safe_softmax(_rows_of_minus_inf(x), -1), (_X,)),
    "rotary": Case(_rotary, (torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)), (0, 1), in_dims=(0, 0)),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", OP_CASES)
def test_op_along_each_path(op, path):
    check_path(OP_CASES[op], path)


# --- torch.nn's inference fast path ----------------------------------------------------------------
# nn.MultiheadAttention and nn.TransformerEncoderLayer in eval mode call fused ops (_native_multi_head_attention,
# _transformer_encoder_layer_fwd) under inference mode, and their decomposed forward with autograd on.

torch.manual_seed(2)
_TOKENS = torch.randn(2, 5, 16)
_PADDING = torch.zeros(2, 5, dtype=torch.bool)
_PADDING[0, 3:] = True
_CAUSAL = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
_ALL_PADDED = _PADDING.clone()
_ALL_PADDED[1] = True

NN_MASKS = {"none": {}, "padding": dict(key_padding_mask=_PADDING), "attn_mask": dict(attn_mask=_CAUSAL),
            "both": dict(attn_mask=_CAUSAL, key_padding_mask=_PADDING),
            "all_padded_row": dict(key_padding_mask=_ALL_PADDED)}


def _on(device, options):
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in options.items()}


@pytest.mark.parametrize("weights", ["averaged", "per_head", "none"])
@pytest.mark.parametrize("mask", NN_MASKS)
def test_multihead_attention_fast_path(mask, weights):
    """Masks (key padding, boolean attention, both, a row with every key padded: NaN, as on CPU) and each kind
    of returned weights, in inference mode (the fused op) and with autograd (output and gradients)."""
    options = dict(NN_MASKS[mask], need_weights=weights != "none", average_attn_weights=weights == "averaged")
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    tpu_module = copy.deepcopy(module).to("tpu")

    def attend(this, x, device):
        return this(x, x, x, **_on(device, options))

    with torch.inference_mode():
        expected = attend(module, _TOKENS, "cpu")
        actual = attend(tpu_module, _TOKENS.to("tpu"), "tpu")
    assert_same(actual, expected, atol=1e-5, rtol=1e-5, equal_nan=True)
    if mask != "all_padded_row":  # NaN rows have NaN gradients everywhere
        check_path(Case(lambda x: attend(tpu_module if x.device.type == "tpu" else module, x, x.device.type)[0],
                        (_TOKENS,)), "autograd")


@pytest.mark.parametrize("mask", ["none", "padding", "attn_mask"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["norm_after", "norm_first"])
def test_transformer_encoder_layer_fast_path(norm_first, activation, mask):
    options = {("src_key_padding_mask" if name == "key_padding_mask" else "src_mask"): value
               for name, value in NN_MASKS[mask].items()}
    torch.manual_seed(0)
    module = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation=activation, batch_first=True,
                                              norm_first=norm_first).eval()
    tpu_module = copy.deepcopy(module).to("tpu")
    with torch.inference_mode():
        expected = module(_TOKENS, **options)
        actual = tpu_module(_TOKENS.to("tpu"), **_on("tpu", options))
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)
    check_path(Case(lambda x: (tpu_module if x.device.type == "tpu" else module)(x, **_on(x.device.type, options)),
                    (_TOKENS,)), "autograd")


def test_inference_mode_takes_the_fused_ops():
    """What the tests above compare in inference mode is the fused ops, on tpu as on CPU."""
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval().to("tpu")
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval().to("tpu")
    x = _TOKENS.to("tpu")
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        attention(x, x, x)
        layer(x)
    names = {event.name for event in profile.events()}
    assert {"aten::_native_multi_head_attention", "aten::_transformer_encoder_layer_fwd"} <= names


def test_transformer_encoder_nested_tensor_fast_path_says_what_to_do():
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2).eval()
    with torch.inference_mode(), pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
        encoder.to("tpu")(_TOKENS.to("tpu"), src_key_padding_mask=_PADDING.to("tpu"))
    torch.manual_seed(0)
    plain = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
                                        enable_nested_tensor=False).eval()
    tpu_plain = copy.deepcopy(plain).to("tpu")
    with torch.inference_mode():
        expected = plain(_TOKENS, src_key_padding_mask=_PADDING)
        actual = tpu_plain(_TOKENS.to("tpu"), src_key_padding_mask=_PADDING.to("tpu"))
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)


def test_compiled_fast_path_ops_are_lowered():
    """Graph mode lowers both fused ops (no eager fallback) with CPU's results."""
    from hf_tpu.compile import compile_stats, reset_compile_stats

    torch._dynamo.reset()
    reset_compile_stats()
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()

    def both(attention, layer, x, padding):
        return attention(x, x, x, key_padding_mask=padding)[0], layer(x, src_key_padding_mask=padding)

    with torch.inference_mode():
        expected = both(attention, layer, _TOKENS, _PADDING)
        compiled = torch.compile(both, backend="tpu")
        actual = compiled(attention.to("tpu"), layer.to("tpu"), _TOKENS.to("tpu"), _PADDING.to("tpu"))
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)
    assert compile_stats()["fallbacks"] == 0
