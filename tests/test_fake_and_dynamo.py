"""FakeTensor and Dynamo see tpu tensors as ordinary device tensors (graph mode builds on this)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import to_tpu


def test_fake_tensor_mode_keeps_the_tpu_device_and_propagates_shapes():
    x = torch.randn(4, 8).to("tpu")
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        result = fake @ fake.t() + 1
    assert fake.device == x.device and result.device == x.device
    assert result.shape == (4, 4)


def _layer(x, weight):
    return F.gelu(x @ weight.t()).sum(-1).softmax(0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dynamo_traces_tpu_tensors_forward_and_backward(backend):
    torch._dynamo.reset()
    x, weight = torch.randn(4, 8), torch.randn(6, 8, requires_grad=True)
    expected = _layer(x, weight)
    expected.sum().backward()
    x_tpu, weight_tpu = to_tpu((x, weight))
    compiled = torch.compile(_layer, backend=backend, fullgraph=True)
    result = compiled(x_tpu, weight_tpu)
    result.sum().backward()
    torch.testing.assert_close(result.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight_tpu.grad.cpu(), weight.grad, rtol=1e-5, atol=1e-5)
