"""transformers' Trainer on tpu: the same few steps give the same losses as on the CPU.

Also the fused Adam/AdamW step that the Trainer's default optimizer (``adamw_torch_fused``) runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_llama
from tiny_models import Tokens

# --- the fused optimizer step -------------------------------------------------------------------

torch.manual_seed(0)
INPUTS = torch.randn(16, 8)
TARGETS = torch.randn(16, 4)
INITIAL = nn.Linear(8, 4).state_dict()

FUSED_CASES = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01)),
    "adamw_amsgrad_wd": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    "adam_maximize_wd": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, maximize=True)),
    "adam_tensor_lr": (torch.optim.Adam, dict(lr="tensor")),
}


def fused_training(device: str, optimizer_class, settings: dict) -> list[torch.Tensor]:
    model = nn.Linear(8, 4)
    model.load_state_dict(INITIAL)
    model.to(device)
    if settings.get("lr") == "tensor":  # the scheduler below updates a tensor lr in place: one per run
        settings = {**settings, "lr": torch.tensor(0.01)}
    optimizer = optimizer_class(model.parameters(), fused=True, **settings)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 10)
    for _ in range(5):
        optimizer.zero_grad()
        F.mse_loss(model(INPUTS.to(device)), TARGETS.to(device)).backward()
        optimizer.step()
        schedule.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_adam_matches_cpu(case):
    optimizer_class, settings = FUSED_CASES[case]
    expected = fused_training("cpu", optimizer_class, settings)
    actual = fused_training("tpu", optimizer_class, settings)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    assert not torch.equal(expected[0], INITIAL["weight"])


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_fused_adamw_grad_scale_and_found_inf(found_inf):
    """The AMP arguments: grads are unscaled in place, and a step with ``found_inf`` set changes nothing."""
    generator = torch.Generator().manual_seed(1)
    shapes = [(3, 4), (5,)]

    def step(device: str) -> list[torch.Tensor]:
        tensors = [[torch.randn(s, generator=generator).abs().to(device) for s in shapes] for _ in range(4)]
        params, grads, exp_avgs, exp_avg_sqs = tensors
        steps = [torch.tensor(3.0, device=device) for _ in shapes]
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.01,
            eps=1e-8, amsgrad=False, maximize=False, grad_scale=torch.tensor(4.0, device=device),
            found_inf=torch.tensor(found_inf, device=device),
        )
        return [t.cpu() for group in tensors for t in group]

    expected = step("cpu")
    generator.manual_seed(1)
    actual = step("tpu")
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


# --- Trainer --------------------------------------------------------------------------------------

STEPS = 5
# Losses of the same run on two backends. float32: XLA may fuse and reorder reductions. bf16 mixed
# precision (autocast): matmuls round to bfloat16 (8 bits of mantissa) on both, in different orders.
# bf16 model: parameters, their updates and every activation are bfloat16 (one ulp of a loss near 4 is 0.016).
LOSS_TOLERANCE = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "bf16_autocast": dict(rtol=0, atol=2e-3),
    "bf16_model": dict(rtol=0, atol=1e-2),
}


def train(tmp_path, use_cpu: bool, precision: str):
    """``STEPS`` steps of transformers' Trainer with its defaults (fused AdamW, linear schedule), then an
    evaluation; returns the trainer and the losses, the evaluation's last."""
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    if precision == "bf16_model":
        model.to(torch.bfloat16)
    arguments = TrainingArguments(
        output_dir=str(tmp_path / ("cpu" if use_cpu else "tpu")),
        use_cpu=use_cpu,
        bf16=precision == "bf16_autocast",
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=Tokens())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, torch.tensor(losses + [trainer.evaluate(Tokens())["eval_loss"]])


@pytest.mark.parametrize("precision", LOSS_TOLERANCE)
def test_trainer_losses_match_cpu(tmp_path, precision):
    _, expected = train(tmp_path, use_cpu=True, precision=precision)
    trainer, actual = train(tmp_path, use_cpu=False, precision=precision)

    assert trainer.args.device.type == "tpu"
    assert trainer.accelerator.device.type == "tpu"
    parameter = next(trainer.model.parameters())
    assert parameter.device.type == "tpu"
    assert parameter.dtype == (torch.bfloat16 if precision == "bf16_model" else torch.float32)
    assert trainer.optimizer.optimizer.defaults["fused"]  # transformers' default: adamw_torch_fused
    assert len(actual) == STEPS + 1
    torch.testing.assert_close(actual, expected, **LOSS_TOLERANCE[precision])
    assert expected[-1] < expected[0]  # the steps did train
