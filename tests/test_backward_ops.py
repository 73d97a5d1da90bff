"""Backward lowerings against the CPU, eager and under ``torch.compile(backend="tpu")`` with the backward
graph lowered whole: the ones written as the JAX VJP of a forward (pooling, padding, upsampling, grid
sampling, margin losses) and the ones that follow CPU's own formula or layout (distances, embedding bags,
segment reductions, shrinkage, logit, det/slogdet, CTC, complex ``abs``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import to_tpu
from hf_tpu.compile import compile_stats


def _embedding_bag(x, w):
    indices = torch.tensor([0, 2, 2, 4, 1, 3], device=x.device)
    offsets = torch.tensor([0, 2, 2, 5], device=x.device)
    return F.embedding_bag(indices, w, offsets, mode="mean", per_sample_weights=None) * x.sum()


def _segment_max(x, w):
    lengths = torch.tensor([2, 0, 3, 1], device=x.device)
    return torch.segment_reduce(x.reshape(-1)[:6] * w[0, 0], "max", lengths=lengths)


CASES = {
    "avg_pool2d": lambda x, w: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True),
    "adaptive_avg_pool2d": lambda x, w: F.adaptive_avg_pool2d(x, (3, 2)),
    "local_response_norm": lambda x, w: F.local_response_norm(x, 2),
    "reflect_pad": lambda x, w: F.pad(x, (2, 1, 1, 2), mode="reflect"),
    "replicate_pad": lambda x, w: F.pad(x, (3, -1, 2, 0), mode="replicate"),
    "bicubic": lambda x, w: F.interpolate(x, scale_factor=1.7, mode="bicubic", align_corners=False),
    "area": lambda x, w: F.interpolate(x, size=(3, 4), mode="area"),
    "grid_sample_bilinear": lambda x, w: F.grid_sample(x, w[:2, :12].reshape(2, 3, 2, 2).tanh(), align_corners=False),
    "grid_sample_bicubic": lambda x, w: F.grid_sample(x, w[:2, :12].reshape(2, 3, 2, 2).tanh(), mode="bicubic",
                                                      padding_mode="reflection", align_corners=True),
    "cdist": lambda x, w: torch.cdist(x.reshape(2, 18, 6), w[:2, :24].reshape(2, 4, 6)),
    "pdist": lambda x, w: F.pdist(x.reshape(24, 9)),
    "multi_margin_loss": lambda x, w: F.multi_margin_loss(x.reshape(24, 9), torch.arange(24, device=x.device) % 9,
                                                          p=2, weight=w[0, :9].detach().abs()),
    "multilabel_margin_loss": lambda x, w: F.multilabel_margin_loss(
        x.reshape(24, 9), (torch.arange(216, device=x.device).reshape(24, 9) % 5) - 1),
    "softshrink": lambda x, w: F.softshrink(x, 0.5) * F.hardshrink(w.sum() * x, 0.3),
    "logit": lambda x, w: torch.logit(x.sigmoid(), eps=0.2),
    "embedding_bag": _embedding_bag,
    "segment_max": _segment_max,
    "slogdet": lambda x, w: torch.linalg.slogdet(x.reshape(8, 3, 3, 3)[:, 0].mT)[1],
    "det": lambda x, w: torch.linalg.det(x[0, :, :3, :3]) * torch.linalg.det(w[:5, :5]),
}


# torch's AOTAutograd replaces multilabel_margin_loss_forward by torch's own decomposition before any
# backend sees the graph (aot_function does so on CPU tensors too), and that decomposition counts the
# classes after a row's first -1 as targets: compiled, the loss is torch's wrong one on every backend.
TORCH_DECOMPOSES_WRONGLY = {("multilabel_margin_loss", True)}


def _cases():
    for name in CASES:
        for compiled in (False, True):
            marks = [pytest.mark.xfail(strict=True, reason="torch's decomposition of multilabel_margin_loss_forward")
                     ] if (name, compiled) in TORCH_DECOMPOSES_WRONGLY else []
            yield pytest.param(name, compiled, id=f"{name}-{'compiled' if compiled else 'eager'}", marks=marks)


@pytest.mark.parametrize("name, compiled", _cases())
def test_gradient_matches_cpu(name, compiled, monkeypatch, fresh_dynamo):
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")
    fn = CASES[name]
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 6, 6, requires_grad=True), torch.randn(6, 32, requires_grad=True)
    tpu_x, tpu_w = (t.detach().to("tpu").requires_grad_() for t in (x, w))
    expected = fn(x, w)
    cotangent = torch.randn(expected.shape)
    expected.backward(cotangent)
    run = torch.compile(fn, backend="tpu", fullgraph=True) if compiled else fn
    actual = run(tpu_x, tpu_w)
    actual.backward(cotangent.to("tpu"))
    torch.testing.assert_close(actual.detach().cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    for tpu_leaf, cpu_leaf in ((tpu_x, x), (tpu_w, w)):
        if cpu_leaf.grad is None:
            assert tpu_leaf.grad is None
        else:
            torch.testing.assert_close(tpu_leaf.grad.cpu(), cpu_leaf.grad, atol=1e-5, rtol=1e-5)
    if compiled:
        assert compile_stats()["fallbacks"] == 0


def test_det_backward_follows_the_inputs_layout():
    """CPU factors A^T for a contiguous A and its backward solves accordingly; a transposed A is factored as is."""
    torch.manual_seed(0)
    a = torch.randn(4, 4)
    for make in (lambda t: t, lambda t: t.mT, lambda t: t.expand(2, 4, 4)):
        cpu, tpu = a.clone().requires_grad_(), a.to("tpu").requires_grad_()
        torch.linalg.det(make(cpu)).sum().backward()
        torch.linalg.det(make(tpu)).sum().backward()
        torch.testing.assert_close(tpu.grad.cpu(), cpu.grad)


def test_complex_abs_gradient_is_the_direction():
    z = torch.tensor([3 + 4j, -1 + 0.5j, 0j, -2j], dtype=torch.complex64)
    torch.testing.assert_close(torch.sgn(z.to("tpu")).cpu(), torch.sgn(z))  # a GPU differs by an ulp
    cpu, tpu = z.clone().requires_grad_(), z.to("tpu").requires_grad_()
    cpu.abs().sum().backward()
    tpu.abs().sum().backward()
    torch.testing.assert_close(tpu.grad.cpu(), cpu.grad)


def test_ctc_loss_gradient_matches_cpu():
    torch.manual_seed(0)
    log_probs = torch.randn(30, 3, 6).log_softmax(2).requires_grad_()
    targets = torch.randint(1, 6, (3, 8))
    input_lengths, target_lengths = torch.tensor([30, 25, 18]), torch.tensor([8, 5, 0])
    tpu_log_probs = log_probs.detach().to("tpu").requires_grad_()
    F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="sum").backward()
    F.ctc_loss(tpu_log_probs, *to_tpu((targets, input_lengths, target_lengths)), reduction="sum").backward()
    torch.testing.assert_close(tpu_log_probs.grad.cpu(), log_probs.grad, atol=2e-5, rtol=1e-5)


def test_sparse_embedding_bag_gradient_names_the_alternative():
    weight = torch.randn(5, 3, device="tpu", requires_grad=True)
    out = F.embedding_bag(torch.tensor([0, 1, 4], device="tpu"), weight, torch.tensor([0, 1], device="tpu"),
                          sparse=True)
    with pytest.raises(NotImplementedError, match="sparse=False"):
        out.sum().backward()


@pytest.mark.parametrize("sizes, dim, start, end, step", [
    ((5, 7), 1, 0, 3, 1), ((5, 7), 1, -3, 2**63 - 1, 1), ((5, 7), 0, 1, 5, 2), ((5, 7), -1, 2, 100, 3),
    ((5, 7), 1, 4, 2, 1), ((4,), 0, -100, -1, 2)])
def test_slice_backward_is_the_gradient_at_the_sliced_positions(sizes, dim, start, end, step):
    """slice_backward (a padding on tpu) equals CPU's zeros-and-copy for negative, clamped, strided and empty slices."""
    taken = len(range(*slice(start, end, step).indices(sizes[dim])))
    shape = list(sizes)
    shape[dim] = taken
    grad = torch.randn(shape)
    expected = torch.ops.aten.slice_backward(grad, sizes, dim, start, end, step)
    assert torch.equal(torch.ops.aten.slice_backward(grad.to("tpu"), sizes, dim, start, end, step).cpu(), expected)
