"""torch.optim on tpu against CPU (foreach and per-tensor paths), and the fused ``_foreach_*`` ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import COMPILED, check_against_cpu, counting_jax_events
from hf_tpu.backend import fused

torch.manual_seed(0)
INPUTS = torch.randn(16, 8)
TARGETS = torch.randn(16, 4)
INITIAL = nn.Linear(8, 4).state_dict()

OPTIMIZERS = {
    "sgd_momentum": lambda p, foreach: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=foreach),
    "sgd_nesterov_wd": lambda p, foreach: torch.optim.SGD(
        p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01, foreach=foreach
    ),
    "adamw": lambda p, foreach: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=foreach),
    "adam_amsgrad": lambda p, foreach: torch.optim.Adam(p, lr=0.01, amsgrad=True, foreach=foreach),
}


def train(device: str, make_optimizer, foreach: bool, steps: int = 5) -> list[torch.Tensor]:
    model = nn.Linear(8, 4)
    model.load_state_dict(INITIAL)
    model.to(device)
    optimizer = make_optimizer(model.parameters(), foreach)
    inputs, targets = INPUTS.to(device), TARGETS.to(device)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_training_matches_cpu(name, foreach):
    expected = train("cpu", OPTIMIZERS[name], foreach)
    actual = train("tpu", OPTIMIZERS[name], foreach)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert not torch.equal(expected[0], INITIAL["weight"])  # the steps did move the weights


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("eager_steps", [0, 1], ids=["compiled_from_the_start", "after_an_eager_step"])
def test_a_compiled_optimizer_step_gives_cpus_weights(eager_steps):
    """``torch.compile(optimizer.step)``: Dynamo makes a tpu optimizer capturable, its step counts on the chip, as it
    does a cuda one (compiled from the start; after an eager step, which made them on the CPU, Dynamo moves them).
    The weights are CPU's."""
    results = []
    for device in ("cpu", "tpu"):
        model = nn.Linear(8, 4)
        model.load_state_dict(INITIAL)
        model.to(device)
        optimizer = OPTIMIZERS["adamw"](model.parameters(), True)
        step = torch.compile(optimizer.step, backend="tpu" if device == "tpu" else "eager")
        inputs, targets = INPUTS.to(device), TARGETS.to(device)
        for index in range(3):
            optimizer.zero_grad()
            F.mse_loss(model(inputs), targets).backward()
            optimizer.step() if index < eager_steps else step()
        counts = [state["step"] for state in optimizer.state.values()]
        assert all(float(count) == 3.0 for count in counts)
        if device == "tpu":
            assert {count.device.type for count in counts} == {"tpu"}
        results.append([p.detach().cpu() for p in model.parameters()])
    for a, e in zip(*reversed(results)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


# --- the fused ops ------------------------------------------------------------------------------

SHAPES = [(3, 4), (5,), (2, 2, 2)]


def tensors(seed: int, positive: bool = False) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=generator) for s in SHAPES]
    return [v.abs() + 0.5 for v in values] if positive else values


A, B, C, POSITIVE = tensors(1), tensors(2), tensors(3), tensors(4, positive=True)


def inplace(op_name, *args, **kwargs):
    """The in-place op run on clones of the first list; returns that list."""

    def run(first, *rest):
        first = [t.clone() for t in first]
        getattr(torch, op_name)(first, *rest, *args, **kwargs)
        return first

    return run


FOREACH_CASES = {
    "add_List": (inplace("_foreach_add_", alpha=-0.5), A, B),
    "add_Scalar": (inplace("_foreach_add_", 1.5), A),
    "add_ScalarList": (inplace("_foreach_add_", [0.1, -2, 3.5]), A),
    "add_Tensor": (inplace("_foreach_add_", alpha=2), A, torch.tensor(1.5)),
    "sub_List": (inplace("_foreach_sub_", alpha=3), A, B),
    "sub_Scalar": (inplace("_foreach_sub_", 1), A),
    "sub_ScalarList": (inplace("_foreach_sub_", [1, 2, 3]), A),
    "mul_List": (inplace("_foreach_mul_"), A, B),
    "mul_Scalar": (inplace("_foreach_mul_", 0.9), A),
    "mul_ScalarList": (inplace("_foreach_mul_", [0.5, 2.0, -1.0]), A),
    "mul_Tensor": (inplace("_foreach_mul_"), A, torch.tensor(-0.25)),
    "div_List": (inplace("_foreach_div_"), A, POSITIVE),
    "div_Scalar": (inplace("_foreach_div_", 3.0), A),
    "div_ScalarList": (inplace("_foreach_div_", [0.5, 2.0, 4.0]), A),
    "div_Tensor": (inplace("_foreach_div_"), A, torch.tensor(3.0)),
    "lerp_Scalar": (inplace("_foreach_lerp_", 0.1), A, B),
    "lerp_List": (inplace("_foreach_lerp_"), A, B, C),
    "addcmul_Scalar": (inplace("_foreach_addcmul_", value=0.001), A, B, C),
    "addcmul_ScalarList": (inplace("_foreach_addcmul_", [0.1, 0.2, 0.3]), A, B, C),
    "addcmul_Tensor": (inplace("_foreach_addcmul_", torch.tensor([0.1, 0.2, 0.3])), A, B, C),
    "addcdiv_Scalar": (inplace("_foreach_addcdiv_", value=-0.01), A, B, POSITIVE),
    "addcdiv_ScalarList": (inplace("_foreach_addcdiv_", [-0.1, 0.2, 0.3]), A, B, POSITIVE),
    "addcdiv_Tensor": (inplace("_foreach_addcdiv_", torch.tensor([0.1, -0.2, 0.3])), A, B, POSITIVE),
    "sqrt_": (inplace("_foreach_sqrt_"), POSITIVE),
    "neg_": (inplace("_foreach_neg_"), A),
    "reciprocal_": (inplace("_foreach_reciprocal_"), A),
    "maximum_": (inplace("_foreach_maximum_"), A, B),
    "zero_": (inplace("_foreach_zero_"), A),
    "copy_": (inplace("_foreach_copy_"), A, B),
    "clamp_min_": (inplace("_foreach_clamp_min_", 0.1), A),
    "add": (lambda a, b: torch._foreach_add(a, b, alpha=0.5), A, B),
    "mul": (lambda a: torch._foreach_mul(a, 0.9), A),
    "sqrt": (torch._foreach_sqrt, POSITIVE),
    "neg": (torch._foreach_neg, A),
    "pow_ScalarAndTensor": (lambda a: torch._foreach_pow(0.9, a), A),
    "pow_Scalar": (lambda a: torch._foreach_pow(a, 2.5), POSITIVE),
    "norm": (torch._foreach_norm, A),
    "norm_inf": (lambda a: torch._foreach_norm(a, float("inf")), A),
    "max": (torch._foreach_max, A),
    "addcdiv": (lambda a, b, c: torch._foreach_addcdiv(a, b, c, [0.1, 0.2, 0.3]), A, B, POSITIVE),
}


@pytest.mark.parametrize("case", FOREACH_CASES)
def test_foreach_ops(case):
    fn, *args = FOREACH_CASES[case]
    check_against_cpu(fn, *args)


def test_foreach_copy_from_host_and_across_dtypes():
    def run(a, b):
        targets = [t.clone() for t in a]
        torch._foreach_copy_(targets, b)
        halves = [torch.zeros(t.shape, dtype=torch.bfloat16, device=t.device) for t in a]
        torch._foreach_copy_(halves, a)
        return targets, halves

    check_against_cpu(run, A, B)
    targets = [t.to("tpu") for t in A]
    torch._foreach_copy_(targets, B)  # sources on the host
    for t, b in zip(targets, B):
        torch.testing.assert_close(t.cpu(), b)


def test_foreach_with_mixed_dtypes():
    check_against_cpu(lambda a: torch._foreach_add(a, 1), [t.bfloat16() for t in A] + [torch.arange(4)])
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch._foreach_add_([torch.arange(3, device="tpu")], 0.5)


def test_foreach_through_views():
    def run(a):
        base = torch.zeros(4, 6, device=a[0].device)
        views = [base[0], base[1:, :2], base[1:, 2:].t()]
        torch._foreach_add_(views, a, alpha=2)
        torch._foreach_mul_(views, 0.5)
        return base

    check_against_cpu(run, [torch.randn(6), torch.randn(3, 2), torch.randn(4, 3)])


def test_one_program_per_call_and_no_recompile_for_new_scalars():
    shapes = [(7, 3), (11,), (2, 5, 3), (13, 1)]
    params, others, denominators = ([torch.randn(s).to("tpu") for s in shapes] for _ in range(3))
    with counting_jax_events(COMPILED) as compiled:
        torch._foreach_addcdiv_(params, others, denominators, [0.1, 0.2, 0.3, 0.4])
        torch._foreach_lerp_(params, others, 0.3)
        torch.tpu.synchronize()  # in fused eager mode the chain of both calls runs here
    # one program per call (in fused eager mode, one for the chain of both), whatever the number of tensors
    assert len(compiled) == (1 if fused.ON else 2)
    with counting_jax_events(COMPILED) as compiled:
        torch._foreach_addcdiv_(params, others, denominators, [0.5, 0.6, 0.7, 0.8])
        torch._foreach_lerp_(params, others, 0.7)
        torch.tpu.synchronize()
    assert not compiled  # new learning rates and bias corrections reuse the programs
