"""Sharded tpu tensors (hf_tpu.distribute, hf_tpu.placement): every result against the same computation on CPU.

The cases that need several chips run once, together, in a subprocess with HF_TPU_NUM_DEVICES=4 (virtual
chips): this file is also that subprocess's script (``case_*`` functions, each reported by name).
"""

from __future__ import annotations

import os

import four_chips
import pytest
import torch

import hf_tpu

COLS, ROWS = (None, "chips"), ("chips", None)


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device.type == "tpu", actual.device
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-5, rtol=1e-5)


def _all_chips() -> tuple[torch.device, ...]:
    return tuple(torch.device("tpu", k) for k in range(4))


def _spec(tensor: torch.Tensor) -> tuple:
    return tuple(hf_tpu.sharding_of(tensor).spec)


def case_distribute_and_placement():
    x = torch.randn(8, 4)
    t = hf_tpu.distribute(x, spec=ROWS)
    assert t.device == torch.device("tpu:0") and hf_tpu.placement(t) == _all_chips()
    assert _spec(t) == ROWS
    _same(t, x)
    pair = hf_tpu.distribute(x.to("tpu:2"), devices=["tpu:2", "tpu:3"], spec=COLS)
    assert pair.device == torch.device("tpu:2")
    assert hf_tpu.placement(pair) == (torch.device("tpu:2"), torch.device("tpu:3"))
    _same(pair, x)
    grid = hf_tpu.mesh(shape=(2, 2), axis_names=("dp", "tp"))
    both = hf_tpu.distribute(x, grid, spec=("dp", "tp"))
    assert hf_tpu.placement(both) == _all_chips() and _spec(both) == ("dp", "tp")
    _same(both, x)
    one = hf_tpu.distribute(t, devices=["tpu:1"])  # a one-chip mesh: an ordinary tensor on that chip
    assert hf_tpu.placement(one) == (torch.device("tpu:1"),) and hf_tpu.sharding_of(one) is None
    _same(one, x)
    leaf = hf_tpu.distribute(x.requires_grad_(), spec=ROWS)
    assert leaf.is_leaf and leaf.requires_grad
    assert hf_tpu.placement(torch.ones(2, device="tpu:3")) == (torch.device("tpu:3"),)
    assert hf_tpu.placement(x) == (torch.device("cpu"),)


def case_zeros_are_made_on_their_shards():
    from hf_tpu.sharding import zeros

    torch.tpu.synchronize()
    before = [torch.tpu.memory_allocated(chip) for chip in range(4)]
    for chip in range(4):
        torch.tpu.reset_peak_memory_stats(chip)
    t = zeros((8, 4), torch.bfloat16, spec=ROWS)
    assert t.dtype == torch.bfloat16 and t.shape == (8, 4) and _spec(t) == ROWS
    assert hf_tpu.placement(t) == _all_chips()
    _same(t, torch.zeros(8, 4, dtype=torch.bfloat16))
    share = 8 * 4 * 2 // 4  # bytes per chip: a quarter, and never more on any chip
    assert [torch.tpu.max_memory_allocated(chip) - before[chip] for chip in range(4)] == [share] * 4
    one = zeros((3,), torch.float32, devices=["tpu:2"])
    assert hf_tpu.placement(one) == (torch.device("tpu:2"),) and one.cpu().eq(0).all()


def case_indivisible_dim_says_what_to_do():
    try:
        hf_tpu.distribute(torch.ones(5, 2), spec=ROWS)
    except ValueError as error:
        assert "dim 0 of size 5 cannot be split evenly over 4 chips" in str(error), error
    else:
        raise AssertionError("an indivisible dim was accepted")


def case_elementwise():
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    a, b = hf_tpu.distribute(x, spec=ROWS), hf_tpu.distribute(y, spec=COLS)
    result = torch.sin(a) * 2 + a * b - 1.5
    _same(result, torch.sin(x) * 2 + x * y - 1.5)
    assert hf_tpu.placement(result) == _all_chips()
    _same(torch.softmax(a, dim=-1), torch.softmax(x, dim=-1))
    _same(a.sum(0), x.sum(0))
    _same(torch.where(a > 0, a, b), torch.where(x > 0, x, y))


def case_matmul_colwise_and_rowwise():
    x, w = torch.randn(4, 8), torch.randn(8, 12)
    colwise = hf_tpu.distribute(w, spec=COLS)  # output features split: no collective needed
    out = x.to("tpu") @ colwise
    _same(out, x @ w)
    assert _spec(out) == COLS
    rowwise = hf_tpu.distribute(w, spec=ROWS)  # contraction dim split: XLA sums the partial products
    out = hf_tpu.distribute(x, spec=COLS) @ rowwise
    _same(out, x @ w)
    assert hf_tpu.placement(out) == _all_chips() and _spec(out) == ()  # all-reduced: whole on each chip
    _same(torch.nn.functional.linear(x.to("tpu"), hf_tpu.distribute(w.t(), spec=ROWS)), x @ w)


def case_mixing_with_one_chip_of_the_mesh():
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    sharded = hf_tpu.distribute(x, spec=ROWS)
    _same(sharded @ w.to("tpu:0"), x @ w)
    _same(w.t().to("tpu:0") @ sharded.t(), w.t() @ x.t())  # the one-chip tensor first, and views
    _same(sharded + x.to("tpu:2"), x + x)  # a chip of the mesh that is not its first
    _same(torch.cat([sharded, x.to("tpu:1")]), torch.cat([x, x]))  # tensor lists
    _same(sharded * torch.tensor(3.0), x * 3)  # a zero-dim CPU tensor joins as a scalar, as before
    compiled = torch.compile(lambda a, b: torch.relu(a @ b) + 1, backend="tpu", fullgraph=True)
    _same(compiled(sharded, w.to("tpu:0")), torch.relu(x @ w) + 1)
    _same(compiled(x.to("tpu:0"), w.to("tpu:0")), torch.relu(x @ w) + 1)  # the same graph, one chip
    assert hf_tpu.placement(compiled(x.to("tpu:0"), w.to("tpu:0"))) == (torch.device("tpu:0"),)


def _mismatch(action) -> str:
    try:
        action()
    except RuntimeError as error:
        return str(error)
    raise AssertionError("no device error")


def case_chip_outside_the_mesh_is_the_usual_error():
    pair = hf_tpu.distribute(torch.ones(4, 2), devices=["tpu:0", "tpu:1"], spec=ROWS)
    prefix = "Expected all tensors to be on the same device, but found at least two devices, "
    assert _mismatch(lambda: pair + torch.ones(4, 2, device="tpu:2")) == (
        prefix + "tpu:0 (sharded over tpu:0, tpu:1) and tpu:2!")
    assert _mismatch(lambda: torch.ones(4, 2, device="tpu:3") * pair) == (
        prefix + "tpu:0 (sharded over tpu:0, tpu:1) and tpu:3!")
    every = hf_tpu.distribute(torch.ones(4, 2), spec=ROWS)
    assert _mismatch(lambda: pair + every) == (
        prefix + "tpu:0 (sharded over tpu:0, tpu:1) and tpu:0 (sharded over tpu:0, tpu:1, tpu:2, tpu:3)!")
    assert _mismatch(lambda: torch.ones(2, device="tpu:0") + torch.ones(2, device="tpu:1")) == (
        prefix + "tpu:0 and tpu:1!")
    compiled = torch.compile(lambda a, b: a + b, backend="tpu", fullgraph=True)
    # Dynamo sees the devices (tpu:0 and tpu:2) and says so; meshes that start on one chip are told apart at run
    assert prefix + "tpu:0 and tpu:2!" in _mismatch(lambda: compiled(pair, torch.ones(4, 2, device="tpu:2")))
    assert _mismatch(lambda: compiled(pair, every)) == (
        prefix + "tpu:0 (sharded over tpu:0, tpu:1) and tpu:0 (sharded over tpu:0, tpu:1, tpu:2, tpu:3)!")
    factory = torch.arange(3, device="tpu:1")  # no tensor inputs: unaffected
    assert hf_tpu.placement(factory) == (torch.device("tpu:1"),)


def case_views_keep_values_and_sharding():
    x = torch.randn(8, 4)
    t = hf_tpu.distribute(x, spec=ROWS)
    for view, expected in ((t.t(), x.t()), (t[2:6], x[2:6]), (t.view(-1), x.view(-1)), (t[:, 1], x[:, 1]),
                           (t.unsqueeze(0).expand(2, 8, 4), x.unsqueeze(0).expand(2, 8, 4))):
        _same(view, expected)
        _same(view * 2, expected * 2)
        assert hf_tpu.sharding_of(view) == hf_tpu.sharding_of(t)  # a view shares its base's storage
    for copy, expected in ((t.clone(), x), (t.t().contiguous(), x.t().contiguous()),
                           (torch.empty(8, 4, device="tpu").copy_(t), x)):  # a new storage takes its first contents'
        _same(copy, expected)
        assert hf_tpu.placement(copy) == _all_chips()


def case_in_place_updates_keep_placement():
    x = torch.randn(8, 4)
    t = hf_tpu.distribute(x, spec=ROWS)
    sharding = hf_tpu.sharding_of(t)
    expected = x.clone()
    t.add_(1), expected.add_(1)
    t[2:4].mul_(0), expected[2:4].mul_(0)
    t.view(-1)[::3].sub_(5), expected.view(-1)[::3].sub_(5)
    t.t()[1].fill_(7), expected.t()[1].fill_(7)
    index = torch.tensor([0, 5])
    t[index.to("tpu")] = torch.ones(4, device="tpu") * 9
    expected[index] = torch.ones(4) * 9
    t.index_put_((index.to("tpu:1"),), torch.full((4,), 3.0, device="tpu:1"), accumulate=True)
    expected.index_put_((index,), torch.full((4,), 3.0), accumulate=True)
    _same(t, expected)
    assert hf_tpu.sharding_of(t) == sharding
    t.copy_(x), t[0].copy_(torch.arange(4.0, device="tpu:3"))
    expected.copy_(x), expected[0].copy_(torch.arange(4.0))
    _same(t, expected)
    assert hf_tpu.sharding_of(t) == sharding
    one_chip = torch.zeros(8, 4, device="tpu:0")
    one_chip.copy_(t)  # the destination keeps its placement: gathered onto its chip
    _same(one_chip, expected)
    assert hf_tpu.placement(one_chip) == (torch.device("tpu:0"),)
    one_chip.add_(t)
    _same(one_chip, expected * 2)
    assert hf_tpu.placement(one_chip) == (torch.device("tpu:0"),)


def case_factories_like_a_sharded_tensor_are_sharded_alike():
    x = torch.randn(8, 4)
    t = hf_tpu.distribute(x, spec=ROWS)
    for made, expected in ((torch.zeros_like(t), torch.zeros_like(x)), (torch.ones_like(t), torch.ones_like(x)),
                           (torch.full_like(t, 2.5, dtype=torch.half), torch.full_like(x, 2.5, dtype=torch.half)),
                           (torch.empty_like(t).copy_(t), x)):
        _same(made, expected)
        assert _spec(made) == ROWS
    torch.manual_seed(3)
    sampled = torch.randn_like(t)
    torch.manual_seed(3)
    _same(sampled, torch.randn_like(x.to("tpu")).cpu())  # the same numbers as on one chip
    assert _spec(sampled) == ROWS
    torch.manual_seed(4)
    dropped = torch.nn.functional.dropout(t, 0.5, training=True)
    torch.manual_seed(4)
    _same(dropped, torch.nn.functional.dropout(x.to("tpu"), 0.5, training=True).cpu())
    assert hf_tpu.placement(dropped) == _all_chips()
    assert hf_tpu.placement(torch.zeros_like(x.to("tpu:1"))) == (torch.device("tpu:1"),)


def case_sampling_from_a_sharded_tensor_draws_what_one_chip_draws():
    probabilities = torch.rand(8, 4) + 0.1
    draws = {"multinomial": lambda p: torch.multinomial(p, 2), "poisson": lambda p: torch.poisson(p * 3),
             "bernoulli": torch.bernoulli, "normal": lambda p: torch.normal(p, 0.5)}
    for name, draw in draws.items():
        torch.manual_seed(5)
        sharded = draw(hf_tpu.distribute(probabilities, spec=ROWS))
        torch.manual_seed(5)
        _same(sharded, draw(probabilities.to("tpu")).cpu())


def case_moving_and_gathering():
    x = torch.randn(8, 4)
    t = hf_tpu.distribute(x, spec=ROWS)
    assert torch.equal(t.cpu(), x) and torch.equal(t.t().cpu(), x.t())  # gathers the whole tensor
    assert t.to("tpu:0") is t  # torch's `to` of the tensor's own device returns it
    on_chip_2 = t.to("tpu:2")
    assert hf_tpu.placement(on_chip_2) == (torch.device("tpu:2"),)
    _same(on_chip_2, x)
    half = t.to(torch.bfloat16)
    assert hf_tpu.sharding_of(half) == hf_tpu.sharding_of(t)
    _same(half, x.to(torch.bfloat16))
    assert t[1, 2].item() == x[1, 2].item()


def case_state_dict_saves_whole_tensors():
    import io
    import tempfile

    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model = _sharded_copy(reference)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.safetensors")
        save_file(model.state_dict(), path)
        loaded = load_file(path)
    assert set(loaded) == set(reference.state_dict())
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded[name], value), name
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    saved.seek(0)
    for name, value in torch.load(saved).items():
        _same(value, reference.state_dict()[name])
    restored = _sharded_copy(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)))
    restored.load_state_dict(loaded)  # copy_ from the host into the sharded parameters
    assert hf_tpu.sharding_of(restored[0].weight) == hf_tpu.sharding_of(model[0].weight)
    for name, value in restored.state_dict().items():
        _same(value, reference.state_dict()[name])


def case_transformers_model_with_sharded_weights():
    """A tiny Llama whose every parameter is split by rows: logits as on CPU; save_pretrained writes whole tensors."""
    import tempfile

    import transformers
    from conftest import tiny_llama

    reference = tiny_llama().eval()
    model = tiny_llama().eval().to("tpu")
    for parameter in model.parameters():
        parameter.data = hf_tpu.distribute(parameter.data, spec=("chips",))
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        _same(model(ids.to("tpu")).logits, reference(ids).logits)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def case_memory_allocated_per_chip():
    import gc

    gc.collect()  # nothing left from the cases before may be freed while this one counts
    torch.tpu.synchronize()
    before = [torch.tpu.memory_allocated(k) for k in range(4)]

    def grown() -> list[int]:
        return [torch.tpu.memory_allocated(k) - before[k] for k in range(4)]

    rows = hf_tpu.distribute(torch.zeros(16, 4), spec=ROWS)  # 256 bytes: 64 on each chip
    assert grown() == [64] * 4, grown()
    replicated = hf_tpu.distribute(torch.zeros(16, 4))  # a whole copy on each chip
    assert grown() == [64 + 256] * 4, grown()
    pair = hf_tpu.distribute(torch.zeros(16, 4), devices=["tpu:2", "tpu:3"], spec=COLS)
    assert grown() == [320, 320, 448, 448], grown()
    del rows, replicated, pair
    assert grown() == [0] * 4, grown()


def case_synchronize_waits_for_sharded_work():
    from hf_tpu.backend import completion, storage

    t = hf_tpu.distribute(torch.randn(64, 64), spec=ROWS)
    result = t @ t @ t
    array = storage.buffer_of(result).array
    for chip in range(4):
        assert any(newest is array for newest in completion.newest(chip)), chip
    torch.tpu.synchronize(3)
    assert array.is_ready()


def _sharded_copy(reference: torch.nn.Sequential) -> torch.nn.Sequential:
    """A tpu copy of a Linear stack: colwise first layer (weight and bias split by output feature), rowwise
    second layer (weight split by input feature, bias whole): the usual tensor-parallel MLP."""
    import copy

    model = copy.deepcopy(reference).to("tpu")
    first, second = model[0], model[-1]
    first.weight.data = hf_tpu.distribute(first.weight.data, spec=ROWS)
    first.bias.data = hf_tpu.distribute(first.bias.data, spec=("chips",))
    second.weight.data = hf_tpu.distribute(second.weight.data, spec=COLS)
    second.bias.data = hf_tpu.distribute(second.bias.data)
    return model


def _train_steps(model: torch.nn.Module, step, x: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = step(model, x, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    if x.device.type == "tpu":  # the optimizer's states are sharded like their parameters
        for parameter in model.parameters():
            state = optimizer.state[parameter]["exp_avg"]
            assert hf_tpu.sharding_of(state) == hf_tpu.sharding_of(parameter)
    return losses


def _loss(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), target)


def _linear_stack_matches(step) -> None:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Dropout(0.0),
                                    torch.nn.Linear(8, 4))
    x, target = torch.randn(6, 4), torch.randn(6, 4)
    model = _sharded_copy(reference)
    losses = _train_steps(model, step, x.to("tpu"), target.to("tpu"))
    expected = _train_steps(reference, _loss, x, target)
    for loss, reference_loss in zip(losses, expected):
        _same(loss, reference_loss)
    for parameter, reference_parameter in zip(model.parameters(), reference.parameters()):
        _same(parameter, reference_parameter.detach())
        _same(parameter.grad, reference_parameter.grad)
    assert _spec(model[0].weight) == ROWS and _spec(model[-1].weight) == COLS  # the AdamW steps kept them
    assert hf_tpu.placement(model[0].weight.grad) == _all_chips()


def case_linear_stack_trains_like_cpu_eager():
    _linear_stack_matches(_loss)


def case_linear_stack_trains_like_cpu_compiled():
    before = torch.tpu.compile_stats()
    _linear_stack_matches(torch.compile(_loss, backend="tpu", fullgraph=True))
    after = torch.tpu.compile_stats()
    assert after["fallbacks"] == before["fallbacks"] and after["calls"] >= before["calls"] + 4  # fwd + bwd, twice


four_chip_report = four_chips.report_fixture(__file__, timeout=300)


@pytest.mark.parametrize("case", four_chips.cases(globals()))
def test_on_four_chips(four_chip_report, case):
    assert four_chip_report[case] == "ok", four_chip_report[case]


def test_one_chip_mesh_gives_an_ordinary_tensor():
    x = torch.randn(3, 2)
    t = hf_tpu.distribute(x, devices=["tpu:0"], spec=("chips", None))
    assert hf_tpu.placement(t) == (torch.device("tpu:0"),) and hf_tpu.sharding_of(t) is None
    torch.testing.assert_close((t * 2).cpu(), x * 2)


@pytest.mark.parametrize(
    "action, error, message",
    [
        (lambda: hf_tpu.distribute(torch.ones(4), spec=("tp",)), ValueError,
         r"mesh axes \['tp'\].*axes are \('chips',\)"),
        (lambda: hf_tpu.distribute(torch.ones(4), spec=("chips", None)), ValueError, r"at most one entry per dim"),
        (lambda: hf_tpu.distribute(torch.ones(4), spec="chips"), TypeError, r"one entry per dim"),
        (lambda: hf_tpu.distribute(torch.ones(4, 4), spec=("chips", "chips")), ValueError, r"axis twice"),
        (lambda: hf_tpu.distribute([1.0]), TypeError, r"takes a torch.Tensor"),
        (lambda: hf_tpu.mesh(["tpu:0", "tpu:0"]), ValueError, r"each chip once"),
        (lambda: hf_tpu.mesh(shape=(3,)), ValueError, r"pass a shape whose product"),
        (lambda: hf_tpu.mesh(axis_names=("a", "b")), ValueError, r"needs 1 axis names"),
        (lambda: hf_tpu.mesh([]), ValueError, r"at least one tpu device"),
        (lambda: hf_tpu.mesh(["tpu:9"]), RuntimeError, r"Invalid device index tpu:9"),
        (lambda: hf_tpu.placement(3), TypeError, r"takes a torch.Tensor"),
        (lambda: hf_tpu.sharding_of(torch.ones(2)), TypeError, r"takes a tpu tensor"),
    ],
    ids=["unknown_axis", "too_many_entries", "string_spec", "axis_twice", "not_a_tensor",
         "repeated_chip", "mesh_shape", "axis_names", "no_devices", "bad_index", "placement_type", "sharding_of_cpu"],
)
def test_bad_input_says_what_to_do(action, error, message):
    with pytest.raises(error, match=message):
        action()


_LAYOUTS = {
    "contiguous": lambda device: torch.ones(2, 3, device=device),
    "transposed": lambda device: torch.ones(2, 3, device=device).t(),
    "channels_last": lambda device: torch.ones(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last),
    "expanded": lambda device: torch.ones(3, 1, device=device).expand(3, 4),
    "step_slice": lambda device: torch.ones(4, 6, device=device)[:, ::2],
    "channels_last_slice": lambda device: torch.ones(2, 3, 4, 6, device=device).to(
        memory_format=torch.channels_last)[..., ::2],
    "empty": lambda device: torch.ones(0, 3, device=device),
}


@pytest.mark.parametrize("memory_format", [torch.preserve_format, torch.contiguous_format])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_empty_like_and_to_give_cpu_layouts(layout, memory_format):
    """empty_like (hf_tpu's own kernel, for sharded tensors) and .to() lay results out as CPU does."""
    host, device = _LAYOUTS[layout]("cpu"), _LAYOUTS[layout]("tpu")
    for made, expected in ((torch.empty_like(device, memory_format=memory_format),
                            torch.empty_like(host, memory_format=memory_format)),
                           (torch.zeros_like(device, dtype=torch.int8, memory_format=memory_format),
                            torch.zeros_like(host, dtype=torch.int8, memory_format=memory_format)),
                           (device.to(torch.float16, memory_format=memory_format),
                            host.to(torch.float16, memory_format=memory_format))):
        assert made.device.type == "tpu" and made.dtype == expected.dtype
        assert made.shape == expected.shape and made.stride() == expected.stride()
    torch.testing.assert_close(torch.ones_like(device, dtype=torch.int8).cpu(), torch.ones_like(host, dtype=torch.int8))
    assert torch.empty_like(device, device="cpu").device.type == "cpu"


def test_a_device_that_is_not_a_chip_is_refused():
    from hf_tpu.backend import storage

    with pytest.raises(ValueError, match=r"is not one of the tpu chips"):
        storage.chip_index(object())


if __name__ == "__main__":
    four_chips.main(globals())
