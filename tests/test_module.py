"""nn.Module moves: Parameters stay Parameters (same objects), ties stay tied, buffers and grads move."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_same


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        self.register_buffer("positions", torch.arange(5))


MOVES = {
    "to_str": lambda m: m.to("tpu"),
    "to_device": lambda m: m.to(torch.device("tpu", 0)),
    "to_with_dtype": lambda m: m.to("tpu", torch.bfloat16),
    "tpu": lambda m: m.tpu(),
    "tpu_index": lambda m: m.tpu(0),
}


def _check_structure(model: TiedModel, device_type: str, parameters_before: dict) -> None:
    for name, parameter in model.named_parameters(remove_duplicate=False):
        assert type(parameter) is nn.Parameter, name
        assert parameter.device.type == device_type, name
        assert parameter.is_leaf, name
    for name, buffer in model.named_buffers():
        assert buffer.device.type == device_type, name
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.requires_grad and not model.frozen.requires_grad
    for name, parameter in model.named_parameters():
        assert parameter is parameters_before[name], f"{name} was replaced by a new object"


@pytest.mark.parametrize("move", MOVES.values(), ids=MOVES.keys())
def test_move_to_tpu_and_back_keeps_parameters_and_ties(move):
    model = TiedModel()
    reference = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    parameters = dict(model.named_parameters())
    assert move(model) is model
    _check_structure(model, "tpu", parameters)
    assert model.positions.dtype == torch.int64  # integer buffers keep their dtype under .to(dtype)
    assert model.to("cpu") is model
    _check_structure(model, "cpu", parameters)
    for name, tensor in model.state_dict().items():
        expected = reference[name].to(tensor.dtype)
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)


def test_parameter_and_grad_attributes_survive_moves():
    model = nn.Linear(3, 2)
    model.weight._is_hf_initialized = True
    model.weight.grad = torch.zeros(2, 3)
    model.weight.grad.marker = "grad"
    for move in (lambda m: m.to("tpu"), lambda m: m.half(), lambda m: m.cpu()):
        move(model)
        assert model.weight._is_hf_initialized is True
        assert model.weight.grad.marker == "grad"


def test_cpu_method_and_dtype_changes_on_device_keep_ties():
    model = TiedModel().tpu()
    parameters = dict(model.named_parameters())
    model.half()
    assert model.embed.weight.dtype == torch.float16
    _check_structure(model, "tpu", parameters)
    model.to(torch.float32)
    _check_structure(model, "tpu", parameters)
    model.cpu()
    _check_structure(model, "cpu", parameters)


def test_gradients_move_with_parameters():
    model = nn.Linear(3, 2)
    model.weight.grad = torch.full((2, 3), 0.5)
    model.tpu()
    assert model.weight.grad.device.type == "tpu"
    assert model.weight.grad.cpu().eq(0.5).all()
    assert model.bias.grad is None


def test_optimizer_built_before_move_sees_moved_parameters():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.tpu()
    assert all(p.device.type == "tpu" for group in optimizer.param_groups for p in group["params"])


def test_load_state_dict_from_host_keeps_device():
    source = TiedModel()
    model = TiedModel().tpu()
    model.load_state_dict(source.state_dict())
    assert model.embed.weight.device.type == "tpu"
    assert model.head.weight is model.embed.weight
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor.cpu(), source.state_dict()[name], rtol=0, atol=0, msg=name)


def test_to_empty_from_meta():
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    model.to_empty(device="tpu")
    assert model.weight.device.type == "tpu" and type(model.weight) is nn.Parameter
    assert model.weight.shape == (3, 4)


def test_modules_built_under_tpu_default_device():
    with torch.device("tpu"):
        model = nn.Linear(4, 3)
    assert model.weight.device.type == "tpu" and model.bias.device.type == "tpu"
    assert model.weight.cpu().abs().max() <= 0.5  # kaiming_uniform_ bound for fan_in=4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_mlp_forward_backward_matches_cpu():
    inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))

    def run(model, x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss, [p.grad for p in model.parameters()]

    expected = run(_mlp(), inputs, target)
    actual = run(_mlp().tpu(), inputs.tpu(), target.tpu())
    assert_same(actual, expected, rtol=1e-5, atol=1e-6)


def test_move_back_to_cpu_while_an_autograd_graph_holds_parameters():
    """As torch does when ``.data`` cannot serve: a parameter the graph holds is left to the graph and the
    module gets a new Parameter; the graph's backward still runs, into the objects it used."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to("tpu")
    used = list(model.parameters())
    out = model(torch.randn(2, 4).to("tpu"))
    model.cpu()
    assert all(p.device.type == "cpu" and type(p) is nn.Parameter for p in model.parameters())
    out.sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "tpu" for p in used)
    expected = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    expected.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(torch.ones(1, 4)), expected(torch.ones(1, 4)))
    model.to("tpu")  # and forth again
    assert_same(model(torch.ones(1, 4, device="tpu")), expected(torch.ones(1, 4)))


def test_tied_parameters_held_by_a_graph_stay_tied_when_moved():
    model = TiedModel().to("tpu")
    out = model.head(model.embed(torch.tensor([1, 2], device="tpu")))
    model.cpu()
    assert model.head.weight is model.embed.weight
    assert model.head.weight.device.type == "cpu"
    del out


def test_dtype_change_between_forward_and_backward_works_as_on_cpu():
    """diffusers' layerwise casting stores weights in low precision between forward and backward."""
    results = {}
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        layer = nn.Linear(8, 8).to(device)
        weight = layer.weight
        out = layer(torch.ones(2, 8, device=device))
        layer.to(dtype=torch.float16)
        out.sum().backward()
        assert layer.weight is weight and layer.weight.dtype == torch.float16
        results[device] = (layer.weight.grad, layer.bias.grad)
    for cpu, tpu in zip(results["cpu"], results["tpu"]):
        assert tpu.dtype == cpu.dtype
        assert_same(tpu, cpu)
