"""TorchTitan 0.3.0 (PyTorch's reference pre-training trainer, from PyPI, unpatched) trains its stock Llama 3 debug
model on tpu: FlexAttention, selective activation checkpointing, ``torch.compile`` with no eager fallback
(``HF_TPU_STRICT_COMPILE=1``), FSDP2 and tensor parallelism over two ``tpu_dist`` processes, distributed checkpoints
saved and resumed, and FSDP2 with tensor parallelism over four.
The losses of every run equal one process's, and a run resumed from its checkpoint continues the same curve. Within
what tolerance: after two AdamW updates, equally valid float32 orders of reductions (one process compiled against
eager) move the loss by up to about 1e-3, depending on the initial weights; a resume that loses the optimizer's
state moves step 4's loss by 0.39. Runs are launched by tests/torchtitan_runs.py, on assets
(tokenizer, dataset, seed checkpoint) the test makes itself.
"""

from __future__ import annotations

import pytest

from torchtitan_runs import assets, options, seed_checkpoint, train

STEPS, SEQ_LEN, TOLERANCE = 4, 64, 5e-3
LAUNCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("torchtitan")
    assets(folder, SEQ_LEN)
    seed_checkpoint(folder, options(STEPS, SEQ_LEN, checkpoint_interval=2), timeout=LAUNCH_TIMEOUT_S)
    return folder


def _losses(steps: dict) -> dict[int, float]:
    return {step: values[0] for step, values in steps.items()}


def test_one_compiled_process_and_two_fsdp2_processes_resumed_from_a_checkpoint_give_one_curve(folder):
    one = _losses(train(folder, "one", 1, 2, ("--compile.enable",), options(STEPS, SEQ_LEN, 2), LAUNCH_TIMEOUT_S))
    assert list(one) == list(range(1, STEPS + 1)), one
    assert one[STEPS] < one[1] - 1, one  # it learns
    first = _losses(train(folder, "fsdp2", 2, 1, (), options(2, SEQ_LEN, 2), LAUNCH_TIMEOUT_S))
    resumed = _losses(train(folder, "fsdp2", 2, 1, (), options(STEPS, SEQ_LEN, 2), LAUNCH_TIMEOUT_S))
    assert list(first) == [1, 2] and list(resumed) == [3, 4], (first, resumed)  # step 2's checkpoint, then 3 and 4
    assert {**first, **resumed} == pytest.approx(one, abs=TOLERANCE)


@pytest.fixture(scope="module")
def two_steps_of_one_process(folder):
    return _losses(train(folder, "one_short", 1, 2, (), options(2, SEQ_LEN, 2), LAUNCH_TIMEOUT_S))


def test_tensor_parallelism_over_two_processes_gives_one_process_curve(folder, two_steps_of_one_process):
    tensor_parallel = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
    split = _losses(train(folder, "tp2", 2, 2, tensor_parallel, options(2, SEQ_LEN, 2), LAUNCH_TIMEOUT_S))
    assert list(split) == [1, 2] and split == pytest.approx(two_steps_of_one_process, abs=TOLERANCE), split


def test_fsdp2_and_tensor_parallelism_over_four_processes_give_one_process_curve(folder, two_steps_of_one_process):
    """A 2 x 2 mesh: FSDP2 over the data-parallel pairs, each pair's ranks splitting every layer; one sample a rank."""
    parallelism = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2")
    split = _losses(train(folder, "fsdp2_tp2", 4, 1, parallelism, options(2, SEQ_LEN, 2), LAUNCH_TIMEOUT_S))
    assert list(split) == [1, 2] and split == pytest.approx(two_steps_of_one_process, abs=TOLERANCE), split
