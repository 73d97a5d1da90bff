"""Training under torchrun with ``tpu_dist``: 2 processes give the losses and gradients of one process.

One 2-process launch (tests/torchrun_cases.py) trains a tiny Llama with DistributedDataParallel and with FSDP2
(``fully_shard``), each rank on its half of every batch, and with transformers' tensor parallelism (DTensor
weights, the whole batch), against the same steps on the whole batches on the CPU in the same worker; and
transformers' ``Trainer`` with DDP and with FSDP2 through accelerate, against the same Trainer run in one
process here.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import hf_tpu  # noqa: F401  (registers the device even where autoload is off)
import torchrun_cases
from conftest import tiny_llama
from tiny_models import Tokens

WORLD = 2
STEPS = 3
LOSS_TOLERANCE = dict(rtol=1e-4, atol=0)


def _batches() -> list[torch.Tensor]:
    """One batch, ``STEPS`` times: its loss falls step by step."""
    return [torch.randint(0, 128, (2 * WORLD, 8), generator=torch.Generator().manual_seed(1))] * STEPS


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a tensor, a DTensor (FSDP2's parameters and gradients) gathered whole."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu()


def _train(model: torch.nn.Module, batches: list[torch.Tensor], device: str,
           **adamw: object) -> tuple[list[float], dict]:
    """AdamW steps; returns each step's loss, the mean over the whole batch (all ranks' halves: equal token
    counts), and the first step's gradients (after DDP's or FSDP's reduction)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **adamw)
    losses, first_gradients = [], None
    for batch in batches:
        ids = batch.to(device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        if first_gradients is None:
            first_gradients = {name: _whole(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if dist.is_initialized() and device == "tpu":
            dist.all_reduce(mean, dist.ReduceOp.AVG)
        losses.append(mean.item())
    return losses, first_gradients


def _my_halves() -> list[torch.Tensor]:
    rank = dist.get_rank()
    return [batch[2 * rank:2 * rank + 2] for batch in _batches()]


def _same_as_one_process(losses: list[float], gradients: dict[str, torch.Tensor]) -> None:
    """Losses within 1e-4 relative of one process, and the same reduced gradients. (AdamW's updates are not
    compared: it divides by the gradients' magnitude, so the last bits of near-zero gradients, summed in
    another order over the ranks, move weights by up to the learning rate.)"""
    expected_losses, expected = _train(tiny_llama(), _batches(), "cpu")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **LOSS_TOLERANCE)
    assert expected_losses[-1] < expected_losses[0]  # the steps did train
    assert gradients.keys() == expected.keys()
    for name, value in gradients.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def case_ddp_matches_one_process():
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_llama().to("tpu"))
    losses, gradients = _train(model, _my_halves(), "tpu")
    _same_as_one_process(losses, {name.removeprefix("module."): grad for name, grad in gradients.items()})


def case_ddp_find_unused_parameters_says_what_to_do():
    from torch.nn.parallel import DistributedDataParallel

    with pytest.raises(ValueError, match=r"find_unused_parameters=True\) is not supported.*Pass "
                                         r"find_unused_parameters=False"):
        DistributedDataParallel(torch.nn.Linear(2, 2).to("tpu"), find_unused_parameters=True)


def case_fsdp2_matches_one_process():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama().to("tpu")
    mesh = init_device_mesh("tpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    whole = sum(p.numel() for p in model.parameters())  # DTensors: their global sizes
    mine = sum(p.to_local().numel() for p in model.parameters())
    assert mine <= whole // WORLD + 64, (mine, whole)  # each rank holds about half (dim 0 padded to even)
    _same_as_one_process(*_train(model, _my_halves(), "tpu"))


def case_tensor_parallel_matches_one_process():
    """transformers' tensor parallelism (DTensor weights, every rank the whole batch): forward, backward and
    AdamW."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    path = os.path.join(os.environ["TORCHRUN_CASES_REPORTS"], "llama")
    if dist.get_rank() == 0:
        tiny_llama().save_pretrained(path)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=WORLD))
    assert any(type(p).__name__ == "DTensor" and p.placements[0].is_shard() for p in model.parameters())
    model.train()
    # transformers leaves the weights it does not split (the norms) plain tensors, which torch's multi-tensor
    # AdamW cannot mix with DTensors (on every device): one tensor at a time.
    _same_as_one_process(*_train(model, _batches(), "tpu", foreach=False))


def trainer_run(output_dir: str, per_device_batch: int, use_cpu: bool = False, **fsdp: object) -> tuple:
    """A Trainer's 4 steps; returns the trainer and its logged losses (averaged over the ranks)."""
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    arguments = TrainingArguments(output_dir=output_dir, use_cpu=use_cpu, max_steps=4, learning_rate=1e-2,
                                  per_device_train_batch_size=per_device_batch, logging_steps=1,
                                  save_strategy="no", report_to=[], disable_tqdm=True, seed=0, **fsdp)
    # 4 sequences: at 2 per rank (or 4 in one process) every step trains on all four, in any order
    trainer = Trainer(model=model, args=arguments, train_dataset=Tokens(count=4))
    trainer.train()
    assert trainer.args.device.type == ("cpu" if use_cpu else "tpu")
    return trainer, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    os.environ.pop("ACCELERATE_USE_FSDP", None)


def case_trainer_ddp():
    from torch.nn.parallel import DistributedDataParallel

    trainer, losses = trainer_run(os.environ["TORCHRUN_CASES_REPORTS"], per_device_batch=2)
    assert trainer.accelerator.state.backend == "tpu_dist"
    assert isinstance(trainer.model_wrapped, DistributedDataParallel)
    _reset_accelerate()
    return losses


def case_trainer_fsdp2():
    from accelerate.state import AcceleratorState

    trainer, losses = trainer_run(os.environ["TORCHRUN_CASES_REPORTS"], per_device_batch=2, fsdp="full_shard",
                                  fsdp_config={"version": 2})
    assert trainer.is_fsdp_enabled and AcceleratorState().fsdp_plugin.fsdp_version == 2
    assert type(next(trainer.model.parameters())).__name__ == "DTensor"
    _reset_accelerate()
    return losses


reports = torchrun_cases.report_fixture(__file__, world=WORLD, timeout=300)


@pytest.mark.parametrize("case", torchrun_cases.cases(globals()))
@pytest.mark.parametrize("rank", range(WORLD))
def test_two_processes(reports, rank, case):
    assert reports[rank][case] == "ok", reports[rank][case]


@pytest.fixture(scope="module")
def trainer_one_process(tmp_path_factory):
    """The same Trainer run in this one process, on the CPU, 4 sequences per step."""
    return trainer_run(str(tmp_path_factory.mktemp("trainer")), per_device_batch=4, use_cpu=True)[1]


@pytest.mark.parametrize("case", ["case_trainer_ddp", "case_trainer_fsdp2"])
def test_trainer_losses_match_one_process(reports, trainer_one_process, case):
    for rank in range(WORLD):
        assert reports[rank][case] == "ok", reports[rank][case]
        losses = reports[rank][f"{case}:value"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(trainer_one_process), **LOSS_TOLERANCE)
    assert trainer_one_process[-1] < trainer_one_process[0]


if __name__ == "__main__":
    torchrun_cases.main(globals(), worker_timeout=280)
