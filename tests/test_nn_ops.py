"""nn building blocks on tpu against CPU: forward values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import assert_same, check_against_cpu, to_tpu

torch.manual_seed(0)
X = torch.randn(2, 5, 8)  # one activation shape reused across tests (fewer compilations)


def with_grads(fn):
    """``fn`` plus a backward pass: returns fn's output and the gradients of its tensor arguments."""

    def run(*args):
        out = fn(*args)
        cotangent = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).to(out.device) / out.numel()
        (out * cotangent).sum().backward()
        return out, [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    return run


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def check_module(module: nn.Module, *inputs: torch.Tensor, **tolerances) -> None:
    """Runs forward + backward on a CPU module and on a tpu copy; compares outputs and all grads."""
    moved = copy.deepcopy(module).to("tpu")
    actual_inputs = to_tpu(inputs)
    out = with_grads(module)(*inputs)
    out_tpu = with_grads(moved)(*actual_inputs)
    assert_same(out_tpu, out, **tolerances)
    for (name, p), p_tpu in zip(module.named_parameters(), moved.parameters()):
        assert_same(p_tpu.grad, p.grad, **tolerances), name


@pytest.mark.parametrize("shape", [(5, 8), (2, 5, 8)])
def test_linear(shape):
    check_module(nn.Linear(8, 6), leaf(X.reshape(-1, 8)[: shape[0]] if len(shape) == 2 else X))


def test_linear_without_bias_bfloat16():
    weight = torch.randn(6, 8, dtype=torch.bfloat16)
    check_against_cpu(F.linear, X.to(torch.bfloat16), weight, atol=2e-2, rtol=2e-2)


def test_matrix_products():
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    batch1, batch2, batched = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(2, 3, 5)
    v = torch.randn(4)
    check_against_cpu(torch.mm, a, b)
    check_against_cpu(lambda *t: torch.addmm(*t, beta=0.5, alpha=2), c, a, b)
    check_against_cpu(torch.bmm, batch1, batch2)
    check_against_cpu(lambda *t: torch.baddbmm(*t, alpha=0.5), batched, batch1, batch2)
    check_against_cpu(torch.addbmm, c, batch1, batch2)
    check_against_cpu(torch.mv, a, v)
    check_against_cpu(torch.addmv, torch.randn(3), a, v)
    check_against_cpu(torch.dot, v, v)
    check_against_cpu(torch.matmul, batch1, b)
    check_against_cpu(torch.mm, a.long(), b.long())


def test_addmm_beta_zero_ignores_nan():
    nan = torch.full((3, 5), float("nan"))
    check_against_cpu(lambda *t: torch.addmm(*t, beta=0), nan, torch.randn(3, 4), torch.randn(4, 5))


def test_embedding():
    indices = torch.tensor([[1, 3, 0, 3], [2, 2, 9, 0]])
    check_module(nn.Embedding(10, 8, padding_idx=0), indices)
    weight = leaf(torch.randn(10, 8))
    check_against_cpu(with_grads(lambda w, i: F.embedding(i, w, scale_grad_by_freq=True)), weight, indices)

    def renormed(w, i):
        w = w.clone()
        return F.embedding(i, w, max_norm=1.5), w

    check_against_cpu(renormed, torch.randn(10, 8), indices)


def test_layer_norm():
    check_module(nn.LayerNorm(8), leaf(X), atol=1e-5, rtol=1e-4)
    check_module(nn.LayerNorm((5, 8), elementwise_affine=False), leaf(X), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("affine", [True, False])
def test_group_norm(affine):
    module = nn.GroupNorm(2, 4, affine=affine)
    if affine:
        nn.init.normal_(module.weight), nn.init.normal_(module.bias)
    check_module(module, leaf(torch.randn(2, 4, 3, 5)), atol=1e-5, rtol=1e-5)


def test_group_norm_bfloat16_with_float32_statistics():
    x, weight = torch.randn(2, 4, 6, dtype=torch.bfloat16), torch.randn(4)
    check_against_cpu(lambda *t: torch.ops.aten.native_group_norm(*t, 2, 4, 6, 2, 1e-5), x, weight, weight,
                      atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("options", [
    dict(mode="nearest", scale_factor=2.0), dict(mode="nearest", size=(7, 3)), dict(mode="nearest-exact", size=(7, 8)),
    dict(mode="bilinear", scale_factor=2.0), dict(mode="bilinear", size=(7, 3), align_corners=True),
    dict(mode="bilinear", scale_factor=1.7, recompute_scale_factor=False),
])
def test_upsample_with_gradients(options):
    image = leaf(torch.randn(1, 2, 4, 5))
    check_against_cpu(with_grads(lambda x: F.interpolate(x, **options)), image, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode, shape", [("linear", (1, 2, 5)), ("trilinear", (1, 2, 3, 4, 5)), ("nearest", (1, 2, 5))])
def test_upsample_1d_and_3d(mode, shape):
    check_against_cpu(with_grads(lambda x: F.interpolate(x, scale_factor=2.0, mode=mode)), leaf(torch.randn(shape)),
                      atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool, shape, options", [
    (F.max_pool1d, (2, 3, 11), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    (F.max_pool2d, (2, 3, 9, 11), dict(kernel_size=3, stride=2, padding=1)),
    (F.max_pool2d, (2, 3, 9, 11), dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1),
                                       ceil_mode=True)),
    (F.max_pool2d, (3, 8, 8), dict(kernel_size=2)),
    (F.max_pool3d, (2, 2, 6, 7, 5), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
], ids=["1d", "2d", "2d-dilated-ceil", "2d-unbatched", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_max_pool_values_indices_and_gradients(pool, shape, options, dtype):
    """Max pooling's own lowering (torch 2.11 has no decomposition to fall back on): CPU's values and indices,
    ties (the first maximum), infinities and NaN (a window holding NaNs gives the last one's index)."""
    x = torch.randn(shape).to(dtype)
    x[..., 1] = float("nan")
    x[..., 2] = float("nan")
    x[..., 0] = float("inf")
    x[..., 3] = x[..., 4]
    values, indices = pool(x, return_indices=True, **options)
    tpu_values, tpu_indices = pool(x.to("tpu"), return_indices=True, **options)
    assert torch.equal(tpu_indices.cpu(), indices)
    assert torch.equal(tpu_values.cpu().isnan(), values.isnan())
    assert torch.equal(tpu_values.cpu().nan_to_num(), values.nan_to_num())
    finite = leaf(torch.randn(shape).to(dtype))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # CPU sums overlapping windows' gradients in bfloat16
    check_against_cpu(with_grads(lambda t: pool(t, **options)), finite, atol=tolerance, rtol=tolerance)


def test_upsample_bfloat16():
    image = torch.randn(1, 2, 4, 5, dtype=torch.bfloat16)
    check_against_cpu(lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear"), image, atol=2e-2, rtol=2e-2)


def test_rms_norm():
    check_module(nn.RMSNorm(8, eps=1e-6), leaf(X), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    check_module(nn.GELU(approximate), leaf(X))


def test_silu():
    check_module(nn.SiLU(), leaf(X))


def test_relu_backward():
    check_module(nn.ReLU(), leaf(X))


@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax])
def test_softmax(fn):
    check_against_cpu(with_grads(lambda x: fn(x, dim=-1)), leaf(X), atol=1e-6, rtol=1e-5)
    check_against_cpu(with_grads(lambda x: fn(x, dim=1)), leaf(X), atol=1e-6, rtol=1e-5)


def test_softmax_half_to_float():
    x = X.to(torch.bfloat16)
    check_against_cpu(lambda t: F.softmax(t, dim=-1, dtype=torch.float32), x)
    check_against_cpu(lambda t: F.softmax(t, dim=-1), x, atol=1e-2, rtol=1e-2)


Q, K, V = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)


@pytest.mark.parametrize("mask", ["causal", "bool", "float", "fully_masked_row"])
def test_scaled_dot_product_attention(mask):
    attn_mask, causal = None, mask == "causal"
    if mask == "bool":
        attn_mask = torch.rand(5, 5) > 0.3
        attn_mask[:, 0] = True
    elif mask == "float":
        attn_mask = torch.randn(2, 1, 5, 5)
    elif mask == "fully_masked_row":
        attn_mask = torch.ones(5, 5, dtype=torch.bool).tril()
        attn_mask[2] = False

    def attention(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)

    check_against_cpu(with_grads(attention), leaf(Q), leaf(K), leaf(V), attn_mask, atol=1e-5, rtol=1e-4)


def test_scaled_dot_product_attention_gqa():
    k, v = leaf(K[:, :2]), leaf(V[:, :2])

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)

    check_against_cpu(with_grads(attention), leaf(Q), k, v, atol=1e-5, rtol=1e-4)


LOGITS = torch.randn(10, 7)
TARGET = torch.tensor([0, 6, 3, -100, 2, 2, 5, -100, 1, 4])


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"reduction": "sum"},
        {"reduction": "none"},
        {"label_smoothing": 0.1},
        {"weight": torch.rand(7) + 0.5},
        {"weight": torch.rand(7) + 0.5, "label_smoothing": 0.2, "ignore_index": 3},
    ],
)
def test_cross_entropy(options):
    ignore_index = options.get("ignore_index", -100)
    target = TARGET.masked_fill(TARGET == -100, ignore_index)

    def loss(logits, target, weight):
        return F.cross_entropy(logits, target, weight=weight, **{k: v for k, v in options.items() if k != "weight"})

    check_against_cpu(with_grads(loss), leaf(LOGITS), target, options.get("weight"), atol=1e-6, rtol=1e-5)


def test_cross_entropy_spatial_and_probabilities():
    logits, target = leaf(torch.randn(2, 7, 3)), torch.randint(0, 7, (2, 3))
    check_against_cpu(with_grads(lambda x, t: F.cross_entropy(x, t)), logits, target, atol=1e-6, rtol=1e-5)
    probabilities = torch.softmax(torch.randn(10, 7), dim=1)
    check_against_cpu(with_grads(lambda x, p: F.cross_entropy(x, p)), leaf(LOGITS), probabilities, atol=1e-6, rtol=1e-5)


def test_nll_loss_unbatched():
    check_against_cpu(with_grads(lambda x, t: F.nll_loss(x, t)), leaf(LOGITS[0]), TARGET[1], atol=1e-6, rtol=1e-5)


def test_mse_loss():
    for reduction in ("mean", "sum", "none"):
        check_against_cpu(with_grads(lambda a, b: F.mse_loss(a, b, reduction=reduction)), leaf(X), X.flip(0))


def test_dropout():
    x = leaf(torch.ones(64, 64, device="tpu"))
    out = F.dropout(x, p=0.25, training=True)
    kept = out != 0
    assert 0.7 < kept.float().mean().item() < 0.8
    assert torch.equal(out[kept].cpu(), torch.full((int(kept.sum().item()),), 1 / 0.75))
    out.sum().backward()
    assert torch.equal(x.grad.cpu(), out.detach().cpu())
    assert torch.equal(F.dropout(x, p=0.25, training=False).cpu(), x.detach().cpu())


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([[1.5, -2.0, float("nan")], [0.0, float("inf"), 3.25]]),
        torch.arange(6).reshape(2, 3),
        torch.tensor([True, False]),
        torch.tensor(2.5),
        torch.randn(40, 40),  # summarized with "..."
        X.to(torch.bfloat16),
    ],
)
def test_print(tensor):
    text = repr(tensor.to("tpu"))
    assert "device='tpu:0'" in text
    assert text.replace(", device='tpu:0'", "") == repr(tensor)


def test_convolution_shape_errors_match_cpu():
    x, weight = torch.randn(1, 4, 5, 5), torch.randn(2, 3, 3, 3)
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match=r"expected input\[1, 4, 5, 5\] to have 3 channels, but got 4"):
            F.conv2d(x.to(device), weight.to(device))
