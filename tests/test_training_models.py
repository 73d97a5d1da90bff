"""One training step of every model the project tests, on tpu against the CPU: forward, loss, backward and
one AdamW step, in float32 eager, under ``torch.compile(backend="tpu")`` (backward lowered whole), under
bfloat16 autocast, and with gradient checkpointing.

The models are the tiny ones of test_transformers_models.py and test_diffusers_pipelines.py (plus Gemma3
with its SigLIP vision tower), with dropout off so that the CPU and tpu runs compute the same function.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import transformers

from conftest import to_tpu
from hf_tpu.compile import compile_stats
from test_diffusers_pipelines import tiny_flux_transformer, tiny_sd3_transformer, tiny_unet
from test_transformers_models import _QWEN3, MODELS, VOCAB, inputs

Batch = dict[str, torch.Tensor]

NO_DROPOUT = {
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "t5": dict(dropout_rate=0.0),
}
IMAGE_TOKEN = 3


@dataclass
class Case:
    build: Callable[[], torch.nn.Module]
    batch: Callable[[], Batch]
    loss: Callable[[Callable, Batch], torch.Tensor]


def _transformers_model(name: str) -> torch.nn.Module:
    model_class, config_class, settings = MODELS[name]
    return model_class(config_class(**settings, **NO_DROPOUT.get(name, {})))


def _labelled(name: str) -> Batch:
    """The batch of test_transformers_models.py with labels: the tokens (padding ignored), decoder targets
    for T5, classes for ViT."""
    batch = inputs(name, "cpu")
    if name == "vit":
        return dict(batch, labels=torch.tensor([1, 3]))
    if name == "t5":
        return dict(batch, labels=torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(3)))
    return dict(batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))


def _gemma3_with_vision() -> torch.nn.Module:
    """Gemma3 with a SigLIP tower on 16x16 images (4x4 patches), average-pooled to 4 image tokens."""
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, image_size=16, patch_size=4)
    config = transformers.Gemma3Config(text_config=dict(_QWEN3, sliding_window=4), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=4,
                                       eoi_token_index=5)
    model = transformers.Gemma3ForConditionalGeneration(config)
    # Initialised to zeros, the projection would pass no gradient back to the tower.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)
    return model


def _gemma3_image_batch() -> Batch:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(6, VOCAB, (2, 8), generator=generator)
    ids[:, 2:6] = IMAGE_TOKEN
    image_tokens = ids == IMAGE_TOKEN
    return dict(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=generator),
                token_type_ids=image_tokens.long(), labels=ids.masked_fill(image_tokens, -100))


def _lm_loss(run: Callable, batch: Batch) -> torch.Tensor:
    return run(**batch).loss


def _mse_loss(run: Callable, batch: Batch) -> torch.Tensor:
    """Mean squared error of the denoiser's output against the batch's ``target``."""
    arguments = {key: value for key, value in batch.items() if key != "target"}
    return torch.nn.functional.mse_loss(run(**arguments).sample, batch["target"])


def _unet_batch() -> Batch:
    generator = torch.Generator().manual_seed(1)
    return dict(sample=torch.randn(2, 4, 16, 16, generator=generator), timestep=torch.tensor([10, 500]),
                encoder_hidden_states=torch.randn(2, 16, 32, generator=generator),
                target=torch.randn(2, 4, 16, 16, generator=generator))


def _sd3_batch() -> Batch:
    generator = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(2, 4, 8, 8, generator=generator), timestep=torch.tensor([10.0, 500.0]),
                encoder_hidden_states=torch.randn(2, 6, 32, generator=generator),
                pooled_projections=torch.randn(2, 64, generator=generator),
                target=torch.randn(2, 4, 8, 8, generator=generator))


def flux_batch() -> Batch:
    """An 8x8 latent packed into 64 tokens, 6 text tokens, with Flux's (0, row, column) position ids."""
    generator = torch.Generator().manual_seed(1)
    rows, columns = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    image_ids = torch.stack([torch.zeros(8, 8), rows, columns], dim=-1).reshape(64, 3)
    return dict(hidden_states=torch.randn(2, 64, 4, generator=generator), timestep=torch.tensor([0.01, 0.5]),
                encoder_hidden_states=torch.randn(2, 6, 32, generator=generator),
                pooled_projections=torch.randn(2, 32, generator=generator), img_ids=image_ids,
                txt_ids=torch.zeros(6, 3), target=torch.randn(2, 64, 4, generator=generator))


CASES: dict[str, Case] = {
    **{name: Case(lambda name=name: _transformers_model(name), lambda name=name: _labelled(name), _lm_loss)
       for name in MODELS},
    "gemma3_vision": Case(_gemma3_with_vision, _gemma3_image_batch, _lm_loss),
    "unet": Case(tiny_unet, _unet_batch, _mse_loss),
    "sd3": Case(tiny_sd3_transformer, _sd3_batch, _mse_loss),
    "flux": Case(tiny_flux_transformer, flux_batch, _mse_loss),
}


@dataclass
class Step:
    loss: torch.Tensor
    gradients: dict[str, torch.Tensor]
    parameters: dict[str, torch.Tensor]


@functools.cache
def _initial(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return CASES[name].build().train()


def build(name: str) -> torch.nn.Module:
    """A copy of the model with its seed-0 weights, in training mode, on CPU."""
    return copy.deepcopy(_initial(name))


def training_step(model: torch.nn.Module, batch: Batch, name: str, run: Callable | None = None) -> Step:
    """Loss, backward and one AdamW step of ``model`` (called through ``run``, e.g. its compiled form),
    with every result copied to the CPU."""
    # Adam's first update is lr * g / (|g| + eps): with the default eps (1e-8) a gradient within rounding of zero
    # moves its parameter by anything up to lr, whichever way the rounding went; eps 1e-6 keeps such a
    # gradient's step within atol of the CPU's.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    loss = CASES[name].loss(model if run is None else run, batch)
    loss.backward()
    gradients = {key: p.grad.cpu() for key, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return Step(loss.detach().cpu(), gradients, {key: p.detach().cpu() for key, p in model.named_parameters()})


def assert_steps_close(actual: Step, expected: Step, rtol: float, atol: float,
                       parameter_atol: float | None = None) -> None:
    """Loss, every gradient and every updated parameter close (parameters to ``parameter_atol`` if given)."""
    torch.testing.assert_close(actual.loss, expected.loss, rtol=rtol, atol=atol)
    assert actual.gradients.keys() == expected.gradients.keys()
    for key, gradient in expected.gradients.items():
        torch.testing.assert_close(actual.gradients[key], gradient, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
    for key, parameter in expected.parameters.items():
        torch.testing.assert_close(actual.parameters[key], parameter, rtol=rtol,
                                   atol=atol if parameter_atol is None else parameter_atol, msg=lambda m: f"{key}: {m}")


@pytest.fixture(scope="module")
def cpu_step() -> Callable[[str], Step]:
    """``cpu_step(name)``: the float32 CPU eager step of that model, computed once for the eager and compiled tests."""
    steps: dict[str, Step] = {}

    def get(name: str) -> Step:
        if name not in steps:
            steps[name] = training_step(build(name), CASES[name].batch(), name)
        return steps[name]

    return get


@pytest.mark.parametrize("name", CASES)
def test_eager_training_step_matches_cpu(cpu_step, name):
    actual = training_step(build(name).to("tpu"), to_tpu(CASES[name].batch()), name)
    assert_steps_close(actual, cpu_step(name), rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", CASES)
def test_compiled_training_step_matches_cpu_eager(cpu_step, name, monkeypatch):
    """Strict compile: a graph with an operator graph mode cannot lower raises instead of running eagerly."""
    monkeypatch.setenv("HF_TPU_STRICT_COMPILE", "1")
    model = build(name).to("tpu")
    actual = training_step(model, to_tpu(CASES[name].batch()), name, run=torch.compile(model, backend="tpu"))
    stats = compile_stats()
    assert stats["graphs"] >= 2 and stats["fallbacks"] == 0, stats  # forward and backward graphs, all lowered
    assert_steps_close(actual, cpu_step(name), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_bfloat16_autocast_training_step_matches_cpu(name):
    model = build(name)
    tpu_model = copy.deepcopy(model).to("tpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = training_step(model, CASES[name].batch(), name)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        actual = training_step(tpu_model, to_tpu(CASES[name].batch()), name)
    # bfloat16 keeps 8 bits of mantissa and CPU and XLA round intermediate results at different places: over a
    # forward and a backward that adds up to a few percent of a gradient, or up to 5e-3 (measured) for gradients
    # near zero (the largest are about 1). AdamW's first step moves a parameter by about lr (1e-3) in the
    # direction of its gradient, so one whose gradient is within rounding of zero can move either way: 2 * lr.
    assert_steps_close(actual, expected, rtol=5e-2, atol=1e-2, parameter_atol=2.5e-3)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """transformers 5 renamed ``gradient_checkpointing_enable`` (now a deprecated alias) to this."""
    if isinstance(model, transformers.PreTrainedModel):
        model.activation_checkpointing_enable()
    else:
        model.enable_gradient_checkpointing()


def step_counting_forwards(model: torch.nn.Module, batch: Batch, name: str) -> tuple[Step, int]:
    """The training step and the number of module forward calls it made (recomputation included)."""
    calls = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: calls.append(module))
    try:
        return training_step(model, batch, name), len(calls)
    finally:
        handle.remove()


@pytest.mark.parametrize("name", CASES)
def test_gradient_checkpointing_gives_the_same_gradients(name):
    plain = build(name).to("tpu")
    checkpointed = build(name).to("tpu")
    enable_checkpointing(checkpointed)
    batch = to_tpu(CASES[name].batch())
    expected, plain_calls = step_counting_forwards(plain, batch, name)
    actual, checkpointed_calls = step_counting_forwards(checkpointed, batch, name)
    assert checkpointed_calls > plain_calls  # the checkpointed layers ran again in the backward
    assert_steps_close(actual, expected, rtol=1e-5, atol=1e-6)
