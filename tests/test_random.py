"""Random ops on tpu: reproducibility under seeds, and roughly right distributions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

N = 20_000  # one sample size for all moment checks (one compilation per op and dtype)


def draw(seed_fn=torch.manual_seed, seed=1234):
    seed_fn(seed)
    return torch.randn(N, device="tpu").cpu()


def test_manual_seed_reproduces():
    first, second = draw(), draw()
    assert torch.equal(first, second)
    assert torch.equal(draw(torch.tpu.manual_seed), first)
    assert not torch.equal(draw(seed=4321), first)


def test_consecutive_draws_differ():
    torch.manual_seed(0)
    a, b = torch.rand(N, device="tpu").cpu(), torch.rand(N, device="tpu").cpu()
    assert not torch.equal(a, b)


def test_rng_state_round_trip():
    torch.manual_seed(7)
    state = torch.tpu.get_rng_state()
    first = torch.rand(N, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.rand(N, device="tpu").cpu(), first)


def test_cpu_generator_argument():
    generator = torch.Generator().manual_seed(3)
    first = torch.randn(N, device="tpu", generator=generator).cpu()
    second = torch.randn(N, device="tpu", generator=generator).cpu()
    generator.manual_seed(3)
    assert torch.equal(torch.randn(N, device="tpu", generator=generator).cpu(), first)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normal_moments(dtype):
    torch.manual_seed(0)
    x = torch.empty(N, device="tpu", dtype=dtype).normal_(2.0, 3.0).float().cpu()
    assert x.dtype == torch.float32
    assert abs(x.mean().item() - 2.0) < 0.1
    assert abs(x.std().item() - 3.0) < 0.1
    y = torch.normal(torch.full((N,), -1.0, device="tpu"), 0.5).cpu()
    assert abs(y.mean().item() + 1.0) < 0.05 and abs(y.std().item() - 0.5) < 0.05
    z = torch.normal(0.0, torch.full((N,), 2.0, device="tpu")).cpu()
    assert abs(z.mean().item()) < 0.1 and abs(z.std().item() - 2.0) < 0.1


def test_uniform_and_rand():
    torch.manual_seed(0)
    x = torch.empty(N, device="tpu").uniform_(-2.0, 4.0).cpu()
    assert x.min().item() >= -2.0 and x.max().item() < 4.0
    assert abs(x.mean().item() - 1.0) < 0.1
    r = torch.rand(N, device="tpu", dtype=torch.float64).cpu()
    assert r.dtype == torch.float64 and 0 <= r.min().item() and r.max().item() < 1
    assert abs(r.var().item() - 1 / 12) < 0.01


def test_bernoulli():
    torch.manual_seed(0)
    x = torch.empty(N, device="tpu").bernoulli_(0.3).cpu()
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    assert abs(x.mean().item() - 0.3) < 0.02
    p = torch.linspace(0, 1, N, device="tpu")
    y = torch.bernoulli(p).cpu()
    assert y[: N // 10].mean().item() < 0.1 and y[-N // 10 :].mean().item() > 0.9
    z = torch.zeros(N, device="tpu", dtype=torch.bool).bernoulli_(p).cpu()
    assert abs(z.float().mean().item() - 0.5) < 0.02


def test_integers():
    torch.manual_seed(0)
    x = torch.randint(3, 10, (N,), device="tpu").cpu()
    assert x.dtype == torch.int64 and x.min().item() == 3 and x.max().item() == 9
    assert abs(x.float().mean().item() - 6.0) < 0.1
    y = torch.empty(N, device="tpu", dtype=torch.uint8).random_().cpu()
    assert y.min().item() == 0 and y.max().item() == 255
    z = torch.empty(N, device="tpu").random_(-5, 5).cpu()
    assert z.min().item() == -5 and z.max().item() == 4 and torch.equal(z, z.round())
    w = torch.empty(N, device="tpu", dtype=torch.int64).random_().cpu()
    assert w.min().item() >= 0 and w.float().mean().item() > 2**61
    with pytest.raises(RuntimeError, match="from"):
        torch.empty(3, device="tpu").random_(5, 5)


def test_exponential():
    torch.manual_seed(0)
    x = torch.empty(N, device="tpu").exponential_(2.0).cpu()
    assert x.min().item() >= 0 and abs(x.mean().item() - 0.5) < 0.02


def test_poisson():
    torch.manual_seed(0)
    x = torch.poisson(torch.full((N,), 4.0, device="tpu")).cpu()
    assert torch.equal(x, x.round()) and abs(x.mean().item() - 4.0) < 0.1 and abs(x.var().item() - 4.0) < 0.3


def test_multinomial():
    torch.manual_seed(0)
    probabilities = torch.tensor([[0.1, 0.0, 0.6, 0.3], [1.0, 1.0, 0.0, 2.0]], device="tpu")
    samples = torch.multinomial(probabilities, N, replacement=True).cpu()
    assert samples.shape == (2, N) and samples.dtype == torch.int64
    frequencies = torch.stack([torch.bincount(row, minlength=4) for row in samples]).float() / N
    expected = probabilities.cpu() / probabilities.cpu().sum(1, keepdim=True)
    torch.testing.assert_close(frequencies, expected, atol=0.02, rtol=0)
    picks = torch.multinomial(probabilities, 3).cpu()
    for row, nonzero in zip(picks, ([0, 2, 3], [0, 1, 3])):
        assert sorted(row.tolist()) == nonzero


def test_randperm():
    torch.manual_seed(0)
    p = torch.randperm(50, device="tpu").cpu()
    assert p.dtype == torch.int64 and sorted(p.tolist()) == list(range(50))
    assert not torch.equal(p, torch.arange(50))
    q = torch.randperm(10, device="tpu", dtype=torch.int32).cpu()
    assert q.dtype == torch.int32 and sorted(q.tolist()) == list(range(10))


def test_dropout_reproducible():
    x = torch.ones(N, device="tpu")
    torch.manual_seed(5)
    first = F.dropout(x, 0.5).cpu()
    torch.manual_seed(5)
    assert torch.equal(F.dropout(x, 0.5).cpu(), first)
    assert abs((first == 0).float().mean().item() - 0.5) < 0.02
