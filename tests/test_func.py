"""torch.func and higher-order autograd on tpu tensors, each result compared with the same computation on CPU.

The transforms reach the device through functorch's batching rules (vmap, jacrev, per-sample gradients), the
forward-AD formulas (jvp, jacfwd, hessian, ``forward_ad`` dual tensors) and the derivatives of backward ops
(double backward, gradient penalties): op combinations that plain training never dispatches.

Tolerances are float32's defaults, except for the double-backward penalties (rtol 1e-4): they chain three
float32 matmul or convolution kernels whose summation order differs between ATen and XLA, and their entries reach
the hundreds, so tpu and CPU differ by up to ~2e-5 relative (each is as close as the other to a float64 reference).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import (
    functional_call,
    functionalize,
    grad,
    grad_and_value,
    hessian,
    jacfwd,
    jacrev,
    jvp,
    linearize,
    stack_module_state,
    vjp,
    vmap,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import check_against_cpu

PENALTY_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
BATCH = 3


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + len(shape)))


def compare(fn: Callable, *args, **tolerances) -> None:
    check_against_cpu(fn, *args, **tolerances)


@dataclass(frozen=True)
class Case:
    """``fn`` of CPU ``inputs``: floating-point inputs are differentiated and batched, integer ones are constants."""

    fn: Callable
    inputs: tuple


LABELS = torch.tensor([0, 3, 1])
X, Y = randn(2, 4), randn(2, 4).flip(0)  # the common small inputs
CASES = {
    # pointwise
    "exp_log_pow": Case(lambda x: x.exp() * (x * x + 1).log() + x.pow(3) - x.abs().sqrt(), (X,)),
    "where_clamp_div": Case(lambda x, y: torch.where(x > 0, x, 0.5 * y).clamp(-1, 1) / (y * y + 1), (X, Y)),
    "relu_tanh_sigmoid_gelu_silu": Case(
        lambda x: F.relu(x) + torch.tanh(x) * torch.sigmoid(x) + F.gelu(x) + F.gelu(x, approximate="tanh") * F.silu(x),
        (X,)),
    "elu_softplus_glu": Case(lambda x: F.elu(F.leaky_relu(x, 0.1)) + F.softplus(x) + F.glu(x).repeat(1, 2), (X,)),
    # reductions
    "sum_mean_cumsum_prod": Case(lambda x: x.sum(0) * x.mean(-1, keepdim=True) + x.cumsum(-1) * x.prod(0), (X,)),
    "var_std_norm": Case(lambda x: x.var(-1) + x.std(0).sum() + torch.linalg.vector_norm(x, dim=-1), (X,)),
    "amax_logsumexp": Case(lambda x: x.amax(-1) + x.logsumexp(-1) + x.min(0).values.sum(), (X,)),
    # matrix products
    "matmul_linear": Case(lambda x, w, b: x @ w.t() + F.linear(x, w, b), (X, randn(3, 4), randn(3))),
    "bmm_einsum": Case(lambda x, y: torch.bmm(x, y) + torch.einsum("bij,bjk->bik", x, y).tanh(),
                       (randn(2, 2, 3), randn(2, 3, 2))),
    # convolutions
    "conv2d": Case(lambda x, w, b: F.conv2d(x, w, b, padding=1), (randn(1, 2, 4, 4), randn(3, 2, 3, 3), randn(3))),
    "conv_transpose_strided": Case(lambda x, w: F.conv_transpose2d(x, w, stride=2),
                                   (randn(1, 2, 3, 3), randn(2, 3, 2, 2))),
    # normalization
    "layer_norm": Case(lambda x, w, b: F.layer_norm(x, (4,), w, b), (X, randn(4), randn(4).flip(0))),
    "group_norm": Case(lambda x, w, b: F.group_norm(x, 2, w, b), (randn(2, 4, 3), randn(4), randn(4).flip(0))),
    "batch_norm_training": Case(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                                (randn(3, 4), randn(4), randn(4).flip(0))),
    # indexing
    "gather_index_select": Case(lambda x, i: x.gather(1, i) + x.index_select(1, i[0]) + x[:, i[1]],
                                (X, torch.tensor([[0, 2, 3], [3, 3, 0]]))),
    "scatter_add_index_put": Case(lambda x, i: x.new_zeros(2, 5).scatter_add(1, i, x)
                                  @ x.new_zeros(5, 3).index_put((i[1],), x.t() @ x, accumulate=True),
                                  (randn(2, 3), torch.tensor([[0, 2, 0], [4, 1, 1]]))),
    "cat_slice_flip": Case(lambda x: torch.cat([x[:, 1:], x[:, :1] * 2], 1).flip(0).t().reshape(-1), (X,)),
    "embedding": Case(lambda w, i: F.embedding(i, w), (randn(5, 3), torch.tensor([[0, 4], [2, 2]]))),
    # softmax
    "softmax_log_softmax": Case(lambda x: F.softmax(x, -1) + F.log_softmax(x, 0), (X,)),
    # losses
    "mse_l1_smooth_l1": Case(lambda x, y: F.mse_loss(x, y) + F.l1_loss(x, y) + F.smooth_l1_loss(x, y), (X, Y)),
    "cross_entropy": Case(lambda x, t: F.cross_entropy(x, t) + F.cross_entropy(x, t, label_smoothing=0.1),
                          (randn(3, 4), LABELS)),
    "nll_kl_div": Case(lambda x, t: F.nll_loss(F.log_softmax(x, -1), t)
                       + F.kl_div(F.log_softmax(x, -1), F.softmax(x.flip(0), -1), reduction="batchmean"),
                       (randn(3, 4), LABELS)),
    "bce_with_logits": Case(lambda x, y: F.binary_cross_entropy_with_logits(x, y),
                            (X, torch.rand(2, 4, generator=torch.Generator().manual_seed(0)))),
}


def differentiable(args: tuple) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(args) if a.is_floating_point())


def readout(fn: Callable) -> Callable:
    """A scalar, non-linear function of ``fn``'s result, so that gradients and Hessians are not trivial."""
    return lambda *args: fn(*args).sin().sum()


def batched(args: tuple) -> tuple:
    """BATCH scaled copies of each floating input (scaling keeps probabilities in [0, 1]); integer inputs stay."""
    return tuple(torch.stack([a * (1 - 0.2 * i) for i in range(BATCH)]) if a.is_floating_point() else a for a in args)


def batch_dims(args: tuple) -> tuple:
    return tuple(0 if a.is_floating_point() else None for a in args)


def of_primals(fn: Callable, args: tuple) -> tuple[Callable, tuple, tuple]:
    """``fn`` as a function of its floating inputs only, those inputs, and tangents for them."""
    slots = differentiable(args)

    def function(*primals):
        full = list(args)
        for slot, primal in zip(slots, primals):
            full[slot] = primal
        return fn(*full)

    primals = tuple(args[slot] for slot in slots)
    return function, primals, tuple(p.cos() for p in primals)


def t_grad(fn, args):
    return grad(readout(fn), argnums=differentiable(args))(*args)


def t_vmap(fn, args):
    return vmap(fn, in_dims=batch_dims(args))(*batched(args))


def t_jacrev(fn, args):
    return jacrev(fn, argnums=differentiable(args))(*args)


def t_jvp(fn, args):
    return jvp(*of_primals(fn, args))


def t_forward_ad(fn, args):
    """Dual tensors of ``torch.autograd.forward_ad``, outside functorch."""
    function, primals, tangents = of_primals(fn, args)
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(function(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents))))
        return primal, tangent


def t_hessian(fn, args):
    """Forward over reverse: the forward-AD formulas of the backward ops."""
    return hessian(readout(fn), argnums=differentiable(args))(*args)


def t_double_backward(fn, args):
    """torch.autograd.grad of a gradient penalty built with create_graph=True."""
    leaves = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
    inputs = [a for a in leaves if a.requires_grad]
    grads = torch.autograd.grad(readout(fn)(*leaves), inputs, create_graph=True)
    penalty = sum(g.pow(2).sum() for g in grads)
    return torch.autograd.grad(penalty, inputs, materialize_grads=True)


def t_per_sample_grad(fn, args):
    return vmap(grad(readout(fn), argnums=differentiable(args)), in_dims=batch_dims(args))(*batched(args))


TRANSFORMS = {f.__name__[2:]: f for f in (t_grad, t_vmap, t_jacrev, t_jvp, t_forward_ad, t_hessian, t_double_backward,
                                          t_per_sample_grad)}
# Forward over reverse compiles the most programs per case: one case per op family keeps the file's time down.
HESSIAN_CASES = ("exp_log_pow", "relu_tanh_sigmoid_gelu_silu", "elu_softplus_glu", "var_std_norm", "matmul_linear",
                 "conv2d", "layer_norm", "gather_index_select", "softmax_log_softmax", "cross_entropy")


@pytest.mark.parametrize("transform, case", [(t, c) for t in TRANSFORMS for c in CASES
                                             if t != "hessian" or c in HESSIAN_CASES])
def test_op_under_transform(transform, case):
    tolerances = PENALTY_TOLERANCE if transform == "double_backward" else {}
    compare(lambda *args: TRANSFORMS[transform](CASES[case].fn, args), *CASES[case].inputs, **tolerances)


# --- vmap: dims, nesting, chunks, in-place ops, factories, randomness ---------------------------------------------


def test_vmap_in_dims_and_out_dims():
    compare(vmap(lambda r: r.softmax(-1) @ r.T, in_dims=1), randn(3, 4, 5))
    compare(vmap(lambda r: (r.sum(0), r * 2), in_dims=-1, out_dims=(1, 0)), randn(3, 4, 5))
    compare(lambda x, w: vmap(torch.mv, in_dims=(None, 0), out_dims=1)(w, x), randn(4, 5), randn(3, 5))
    compare(lambda a, b: vmap(lambda d: d["a"] @ d["b"], in_dims=({"a": 0, "b": None},))({"a": a, "b": b}),
            randn(3, 4, 5), randn(5, 2))


def test_nested_vmap_and_chunk_size():
    compare(vmap(vmap(lambda a, b: torch.dot(a, b).exp())), randn(2, 3, 4), randn(2, 3, 4))
    compare(vmap(vmap(lambda a, b: a @ b, in_dims=(0, None)), in_dims=(None, 0)), randn(3, 4), randn(2, 4, 5))
    compare(vmap(lambda r: r.exp().sum(), chunk_size=2), randn(5, 3))


def test_vmap_of_in_place_ops_and_factories():
    compare(vmap(lambda r: r.clone().mul_(2).add_(1).clamp_(max=1.5)), randn(3, 4))
    compare(vmap(lambda r, i: r.clone().index_put_((i,), torch.tensor(0.0, device=r.device))),
            randn(3, 4), torch.tensor([[0, 1], [3, 3], [2, 0]]))
    compare(vmap(lambda r: torch.zeros_like(r) + r.new_ones(4) + torch.arange(4, device=r.device) * r.sum()),
            randn(3, 4))


def test_vmap_with_batched_weights():
    """Both operands batched: per-sample convolution kernels and normalization weights."""
    compare(vmap(lambda x, w: F.conv2d(x, w, padding=1)), randn(2, 1, 2, 4, 4), randn(2, 3, 2, 3, 3))
    compare(vmap(lambda x, w: F.layer_norm(x, (5,), w)), randn(3, 4, 5), randn(3, 5))
    compare(vmap(lambda w, i: F.embedding(i, w)), randn(3, 6, 2), torch.tensor([[0, 5], [1, 1], [4, 2]]))


def test_vmap_randomness():
    """Random draws follow vmap's ``randomness``: one mask per sample, or one shared (tpu only: the streams differ)."""
    ones = torch.ones(4, 256, device="tpu")
    different = vmap(lambda r: F.dropout(r, 0.5), randomness="different")(ones).cpu() == 0
    same = vmap(lambda r: F.dropout(r, 0.5), randomness="same")(ones).cpu() == 0
    assert not all(torch.equal(different[0], row) for row in different[1:])
    assert all(torch.equal(same[0], row) for row in same[1:])
    assert 0.3 < different.float().mean() < 0.7


# --- gradients and Jacobians -----------------------------------------------------------------------------------


def test_grad_and_value_with_aux():
    def loss(x, w):
        out = torch.tanh(x @ w)
        return out.pow(2).mean(), out

    compare(grad_and_value(loss, argnums=(0, 1), has_aux=True), randn(3, 4), randn(4, 2))


def test_grad_of_grad():
    compare(grad(grad(lambda x: x.sin() * x.exp())), torch.tensor(0.3))


def test_jacobians_with_chunks_and_aux():
    compare(jacrev(lambda r: r.tanh().cumsum(0), chunk_size=3), randn(5))
    compare(jacrev(lambda a, b: ((a * b).sin(), a.sum()), argnums=(0, 1), has_aux=True), randn(4), randn(4))
    compare(jacfwd(lambda x, w: F.gelu(x @ w).cumsum(-1), argnums=(0, 1)), randn(2, 3), randn(3, 2))


def test_vjp_linearize_and_jvp_of_jvp():
    compare(lambda x, v: vjp(lambda x: F.log_softmax(x, -1) * x, x)[1](v), randn(3, 4), randn(3, 4))
    compare(lambda x, t: linearize(lambda x: torch.sin(x) @ x.T, x)[1](t), randn(3, 4), randn(3, 4))
    compare(lambda x: jvp(lambda x: jvp(torch.sin, (x,), (x.cos(),))[1], (x,), (torch.ones_like(x),)), randn(3, 4))


def test_forward_ad_through_in_place_ops_and_views():
    def tangents(x, t):
        with fwAD.dual_level():
            dual = fwAD.make_dual(x.clone(), t)
            y = dual.clone()
            y.mul_(dual).add_(1)
            y[0].sin_()
            z = torch.empty(3, 4, device=x.device)
            z.copy_(dual.t().t())
            return [fwAD.unpack_dual(v).tangent for v in (y.t()[1:].exp(), y, z)]

    compare(tangents, randn(3, 4), randn(3, 4))


def test_autograd_functional():
    """torch.autograd.functional: vectorized Jacobians (vmap over the backward) and Hessian-vector products."""
    from torch.autograd import functional

    compare(lambda x: functional.jacobian(lambda x: F.gelu(x).cumsum(1), x, vectorize=True), randn(3, 4))
    compare(lambda x, v: functional.hvp(lambda x: F.log_softmax(x, -1).sum() * x.pow(2).sum(), x, v),
            randn(3, 4), randn(3, 4))


def test_functionalize():
    def mutating(x):
        z = x.clone()
        z.add_(1)
        z[0].mul_(2)
        return z.relu_()

    compare(functionalize(mutating), randn(3, 4))
    compare(vmap(functionalize(mutating)), randn(2, 3, 4))


# --- modules: functional_call, per-sample gradients, ensembles, gradient penalties --------------------------------


class TinyNet(nn.Module):
    """Conv2d, GELU, LayerNorm, Linear and softmax: the layers of a small vision classifier."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.LayerNorm(64)
        self.fc = nn.Linear(64, 5)

    def forward(self, x):
        return F.softmax(self.fc(self.norm(F.gelu(self.conv(x)).flatten(1))), -1)


def on_both(test: Callable[[nn.Module, torch.Tensor, torch.Tensor], object], module: nn.Module) -> None:
    """``test(module, x, y)`` with the module and data on CPU, then with both on tpu: same results."""
    x, y = randn(3, 2, 4, 4), LABELS
    expected = test(module, x, y)
    actual = test(module.to("tpu"), x.to("tpu"), y.to("tpu"))
    torch.utils._pytree.tree_map(lambda a, e: torch.testing.assert_close(a.cpu(), e), actual, expected)
    assert all(a.device.type == "tpu" for a in torch.utils._pytree.tree_leaves(actual))


def tiny_net() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet()


def nll(module, params, x, y):
    return F.nll_loss(functional_call(module, params, (x,)).log(), y)


def detached(module) -> dict:
    return {name: p.detach() for name, p in module.named_parameters()}


def test_functional_call_grad_and_value():
    on_both(lambda net, x, y: grad_and_value(nll, argnums=1)(net, detached(net), x, y), tiny_net())


def test_per_sample_gradients():
    def per_sample(net, x, y):
        def loss(params, sample, label):
            return nll(net, params, sample[None], label[None])

        return vmap(grad(loss), in_dims=(None, 0, 0))(detached(net), x, y)

    on_both(per_sample, tiny_net())


def test_model_ensemble_with_stack_module_state():
    def ensemble(net, x, y):
        members = [copy.deepcopy(net) for _ in range(2)]
        with torch.no_grad():
            for p in members[1].parameters():
                p.mul_(1.1)
        params, buffers = stack_module_state(members)
        return vmap(lambda p, b: functional_call(net, (p, b), (x,)))(params, buffers)

    on_both(ensemble, tiny_net())


def test_jvp_and_jacobians_of_a_module():
    def forward_mode(net, x, y):
        params = detached(net)
        tangents = {name: p.cos() * 0.01 for name, p in params.items()}
        return jvp(lambda p: functional_call(net, p, (x,)), (params,), (tangents,))

    def input_jacobian(net, x, y):
        return jacfwd(net)(x[:1])

    on_both(forward_mode, tiny_net())
    on_both(input_jacobian, tiny_net())


def test_wgan_gradient_penalty():
    """WGAN-GP: the critic's input-gradient norm penalised toward 1, differentiated w.r.t. the critic's weights."""

    def penalty_grads(critic, real, _):
        fake = real.flip(0) * 0.5
        alpha = torch.linspace(0, 1, real.shape[0], device=real.device)[:, None, None, None]
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_()
        scores = critic(mixed)
        (input_grads,) = torch.autograd.grad(scores.sum(), mixed, create_graph=True)
        penalty = ((input_grads.flatten(1).norm(dim=1) - 1) ** 2).mean()
        loss = scores.mean() - critic(fake).mean() + 10 * penalty
        return torch.autograd.grad(loss, list(critic.parameters()))

    torch.manual_seed(0)
    critic = nn.Sequential(nn.Flatten(), nn.Linear(32, 16), nn.SiLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    on_both(penalty_grads, critic)


# --- scaled_dot_product_attention -------------------------------------------------------------------------------
# 3-d inputs with a float mask: CPU takes its math path, whose ops support every transform; tpu takes its fused
# kernel, or the math path where a transform needs it (vmap, forward AD).

ATTENTION = (randn(2, 3, 4), randn(2, 5, 4), randn(2, 5, 4), randn(3, 5))


def attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("transform", ["grad", "vmap", "jacrev", "jvp", "forward_ad", "per_sample_grad"])
def test_attention_under_transform(transform):
    compare(lambda *args: TRANSFORMS[transform](attention, args), *ATTENTION)


def test_attention_grad_of_grad():
    """Nested torch.func.grad: the math path, since torch defines no derivative for the fused backward op."""

    def penalty(*args):
        return grad(readout(attention))(*args).pow(2).sum()

    compare(grad(penalty), *ATTENTION)


def test_attention_double_backward_on_the_math_backend():
    with sdpa_kernel(SDPBackend.MATH):
        compare(lambda *args: t_double_backward(attention, args), *ATTENTION)


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
    "torch defines no derivative for _scaled_dot_product_fused_attention_overrideable_backward (as for the CPU and "
    "CUDA fused kernels): double backward through attention needs sdpa_kernel(SDPBackend.MATH)"))
def test_attention_double_backward_through_the_fused_kernel():
    t_double_backward(attention, tuple(t.to("tpu") for t in ATTENTION))
