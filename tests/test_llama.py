"""A tiny transformers LlamaForCausalLM: forward, loss, backward and an AdamW step on tpu vs CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import tiny_llama

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def test_to_tpu_keeps_parameters_and_ties():
    model = tiny_llama()
    model.to("tpu")
    assert all(type(p) is nn.Parameter and p.device.type == "tpu" for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_train_step_matches_cpu(attn_implementation):
    cpu_model = tiny_llama(attn_implementation=attn_implementation)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    torch.manual_seed(1)
    input_ids = torch.randint(0, 128, (2, 12))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding in the second sequence
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    results = {}
    for name, model, device in (("cpu", cpu_model, "cpu"), ("tpu", tpu_model, "tpu")):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        output = model(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), labels=labels.to(device)
        )
        output.loss.backward()
        grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
        optimizer.step()
        results[name] = (output.logits.detach().cpu(), output.loss.detach().cpu(), grads,
                         {n: p.detach().cpu() for n, p in model.named_parameters()})

    (logits, loss, grads, params), (tpu_logits, tpu_loss, tpu_grads, tpu_params) = results["cpu"], results["tpu"]
    torch.testing.assert_close(tpu_logits, logits, **TOLERANCE)
    torch.testing.assert_close(tpu_loss, loss, **TOLERANCE)
    assert grads.keys() == tpu_grads.keys()
    for name in grads:
        torch.testing.assert_close(tpu_grads[name], grads[name], **TOLERANCE, msg=f"gradient of {name}")
        torch.testing.assert_close(tpu_params[name], params[name], **TOLERANCE, msg=f"updated {name}")
    assert tpu_model.lm_head.weight is tpu_model.model.embed_tokens.weight
