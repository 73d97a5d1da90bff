"""transformers models with weights sharded over 2 and 4 chips (one process, SPMD) against the same model on one
chip: logits, greedy generate (dynamic and compiled static cache, decoded step by step and as one program),
sampling as one program, pipelines, Trainer steps and data parallel.

The weights are sharded here by a small Megatron-style helper (:func:`_shard`); how a model is split does not
change its results, only where its work runs. The cases run once, together, in a subprocess with
HF_TPU_NUM_DEVICES=4 (virtual chips): this file is also that subprocess's script (``case_*`` functions, each
reported by name), as in test_sharded_tensors.py.
"""

from __future__ import annotations

import copy
import gc
import itertools
import os
import tempfile
from pathlib import Path

import four_chips
import pytest
import torch

import hf_tpu
from hf_tpu.compile import compile_stats, reset_compile_stats
from hf_tpu.sharding import split_batch, view_spec
from tiny_models import Tokens

TP_SIZES = (2, 4)
COLWISE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}  # output features split
ROWWISE = {"o_proj", "down_proj"}  # input features split: the matmul ends in an all-reduce
NEW_TOKENS = 6
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
PROMPT = torch.tensor([[5, 9, 17, 4, 12], [7, 7, 20, 11, 6]])  # within the tiny tokenizer's 22 words
LOGITS = dict(atol=1e-4, rtol=1e-4)


def _chips(count: int) -> tuple[torch.device, ...]:
    return tuple(torch.device("tpu", k) for k in range(count))


def _tp_mesh(tp: int):
    return hf_tpu.mesh(_chips(tp), axis_names=("tp",))


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Shards ``model``'s parameters in place over the mesh axis "tp": attention and MLP projections colwise or
    rowwise, MoE experts by expert, everything else (embeddings, norms, the router) replicated."""
    for name, parameter in model.named_parameters():
        owner = name.rpartition(".")[0].rpartition(".")[2]
        spec = ("tp", None) if owner in COLWISE else (None, "tp") if owner in ROWWISE else (
            ("tp",) if owner == "experts" else None)
        parameter.data = hf_tpu.distribute(parameter.data, mesh, spec)
    return model


def _on_one_chip_and_sharded(reference: torch.nn.Module, mesh) -> tuple[torch.nn.Module, torch.nn.Module]:
    return copy.deepcopy(reference).to("tpu"), _shard(copy.deepcopy(reference).to("tpu"), mesh)


_LLAMA_DIR: list[Path] = []


def _llama_dir() -> Path:
    """A tiny Llama (4 heads, 2 KV heads) with an offline word-level tokenizer, saved once per process."""
    from tiny_models import save_tiny_llama

    if not _LLAMA_DIR:
        _LLAMA_DIR.append(save_tiny_llama(Path(tempfile.mkdtemp(prefix="sharded_llama_"))))
    return _LLAMA_DIR[0]


def _llama() -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(_llama_dir()).eval()


def _greedy_tokens(model: torch.nn.Module, **options) -> list[list[int]]:
    tokens = model.generate(PROMPT.to("tpu"), **options).cpu()
    assert len(set(tokens[:, -NEW_TOKENS:].flatten().tolist())) > 1, tokens  # not one token over and over
    return tokens.tolist()


def _generate(model: torch.nn.Module, expected: list[list[int]], **options):
    """``model``'s generate output (with its cache), after checking its greedy tokens are ``expected``."""
    result = model.generate(PROMPT.to("tpu"), **options, return_dict_in_generate=True)
    assert result.sequences.cpu().tolist() == expected
    return result


def _check_logits(reference: torch.nn.Module, tp: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    one_chip, sharded = _on_one_chip_and_sharded(reference, _tp_mesh(tp))
    assert hf_tpu.placement(sharded.lm_head.weight) == _chips(tp)
    with torch.no_grad():
        expected = one_chip(PROMPT.to("tpu")).logits
        actual = sharded(PROMPT.to("tpu")).logits
    assert actual.device == torch.device("tpu:0")
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **LOGITS)
    return one_chip, sharded


def case_llama_logits_and_dynamic_cache_generate():
    reference = _llama()
    for tp in TP_SIZES:
        one_chip, sharded = _check_logits(reference, tp)
        result = _generate(sharded, _greedy_tokens(one_chip, **GREEDY), **GREEDY)
        keys = result.past_key_values.layers[0].keys  # built by torch.cat of sharded keys: on the mesh
        assert hf_tpu.placement(keys) == _chips(tp), (tp, hf_tpu.placement(keys))


def _allocated() -> list[int]:
    gc.collect()
    torch.tpu.synchronize()
    return [torch.tpu.memory_allocated(k) for k in range(4)]


def _check_static_cache_generate(reference: torch.nn.Module, tp: int, stepwise: bool) -> None:
    static = dict(GREEDY, cache_implementation="static")
    one_chip, sharded = _on_one_chip_and_sharded(reference, _tp_mesh(tp))
    expected = _greedy_tokens(one_chip, **static)
    before = _allocated()
    for chip in range(4):
        torch.tpu.reset_peak_memory_stats(chip)
    reset_compile_stats()
    result = _generate(sharded, expected, **static)
    peaks = [torch.tpu.max_memory_allocated(chip) - then for chip, then in enumerate(before)]
    stats = compile_stats()
    assert stats["fallbacks"] == 0, stats
    # the prefill runs eagerly; then all decode steps run as one program on the mesh, or, in transformers'
    # loop, each as one compiled program, built once, for these shardings
    if stepwise:
        assert stats["calls"] == NEW_TOKENS - 1 and stats["compilations"] == 1, stats
    else:
        assert stats["decode_loops"] == 1 and stats["calls"] == 0, stats
    layers = result.past_key_values.layers
    whole = sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes() for layer in layers)
    grown = [after - earlier for after, earlier in zip(_allocated(), before)]
    assert grown[tp:] == [0] * (4 - tp), grown  # nothing on the chips outside the mesh
    for layer in layers:
        assert hf_tpu.placement(layer.keys) == _chips(tp)
    if tp == 2:  # 2 KV heads, one per chip (at tp 4 each chip projects half a head: the cache is replicated)
        for layer in layers:
            for cache in (layer.keys, layer.values):  # views of the bucketed storage: its sharding
                assert tuple(hf_tpu.sharding_of(cache).spec) == (None, "tp", None, None)
        # each chip holds its half of the cache (and the tokens), not a whole copy
        assert all(whole / tp <= share < whole / tp + 1024 for share in grown[:tp]), (grown, whole)
        # and never held more: the cache is made on its shards (not zeros on tpu:0, then split, which would add
        # the whole cache there); tpu:0 holds the prompt's and the prefill's one-chip values (its mask, over the
        # prompt padded to 64 positions) besides
        assert peaks[0] - peaks[1] < whole, (peaks, whole)


def case_llama_static_cache_generate_is_compiled_once_and_sharded():
    reference = _llama()
    try:
        for tp, stepwise in itertools.product(TP_SIZES, (False, True)):
            os.environ["HF_TPU_STEPWISE_DECODE"] = "1" if stepwise else "0"
            _check_static_cache_generate(reference, tp, stepwise)
    finally:
        del os.environ["HF_TPU_STEPWISE_DECODE"]


def case_llama_sampling_on_a_mesh_draws_what_one_chip_draws():
    """Sampling runs as one program on the mesh, each token drawn with the key transformers' loop on one chip
    draws it with."""
    one_chip, sharded = _on_one_chip_and_sharded(_llama(), _tp_mesh(2))
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=8, temperature=0.7, cache_implementation="static")
    runs = []
    for model, stepwise in ((one_chip, "1"), (sharded, "0")):
        os.environ["HF_TPU_STEPWISE_DECODE"] = stepwise
        reset_compile_stats()
        torch.manual_seed(1)
        try:
            tokens = model.generate(PROMPT.to("tpu"), **options).cpu().tolist()
            runs.append((tokens, torch.tpu.get_rng_state().tolist()))
        finally:
            del os.environ["HF_TPU_STEPWISE_DECODE"]
    assert runs[0] == runs[1]
    assert compile_stats()["decode_loops"] == 1


def case_text_generation_pipeline():
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(_llama_dir())
    prompts = ["the cat sat on the", "a big dog"]  # different lengths: left-padded
    one_chip, sharded = _on_one_chip_and_sharded(_llama(), _tp_mesh(2))
    outputs = []
    for model in (one_chip, sharded):
        generator = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
        assert generator.device == torch.device("tpu:0"), generator.device  # where the model is, not the CPU
        outputs.append(generator(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, return_full_text=False))
    up = sharded.model.layers[0].mlp.up_proj.weight
    assert hf_tpu.placement(up) == _chips(2)  # the pipeline left it where it was
    transformers.pipeline("text-generation", model=sharded, tokenizer=tokenizer, device="tpu")  # .to("tpu"): a no-op
    assert hf_tpu.placement(up) == _chips(2)
    assert outputs[1] == outputs[0]
    words = [result[0]["generated_text"].split() for result in outputs[0]]
    assert any(len(set(line)) > 1 for line in words), words


def _trainer_steps(model: torch.nn.Module, directory: str):
    """Two steps of transformers' Trainer with its defaults (fused AdamW, gradient clipping, linear schedule).
    A small learning rate: Adam moves an element whose gradient is near zero by up to the learning rate,
    whatever the gradient's last bits, which another order of summation changes."""
    from transformers import Trainer, TrainingArguments

    arguments = TrainingArguments(
        output_dir=directory, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=Tokens(low=4, high=22))
    trainer.train()
    return trainer, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _same_parameters(model: torch.nn.Module, expected: torch.nn.Module) -> None:
    for (name, parameter), reference in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(parameter.detach().cpu(), reference.detach().cpu(), atol=1e-4, rtol=1e-4,
                                   msg=lambda message, name=name: f"{name}: {message}")


def case_trainer_steps_match_one_chip():
    one_chip, sharded = _on_one_chip_and_sharded(_llama().train(), _tp_mesh(2))
    with tempfile.TemporaryDirectory() as directory:
        _, expected = _trainer_steps(one_chip, directory)
        trainer, losses = _trainer_steps(sharded, directory)
    assert len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    _same_parameters(trainer.model, one_chip)
    optimizer = trainer.optimizer.optimizer
    for parameter in trainer.model.parameters():  # the AdamW states live with their parameters' shards
        assert hf_tpu.sharding_of(optimizer.state[parameter]["exp_avg"]) == hf_tpu.sharding_of(parameter)
    assert tuple(hf_tpu.sharding_of(trainer.model.model.layers[0].mlp.down_proj.weight).spec) == (None, "tp")


def _adamw_steps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    # eps as large as lr: a gradient element near zero moves its parameter by about the gradient, not by lr
    # times its sign, which float noise in the gradient (2e-5 here, as between one chip and CPU) could flip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-2)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().cpu())
    return losses, optimizer


def case_data_parallel_and_tensor_parallel_training():
    """A (dp 2, tp 2) mesh: weights split over "tp", the batch over "dp"; XLA sums the gradients over "dp"."""
    mesh = hf_tpu.mesh(shape=(2, 2), axis_names=("dp", "tp"))
    one_chip, sharded = _on_one_chip_and_sharded(_llama().train(), mesh)
    ids = Tokens(low=4, high=22).ids[:4]
    expected, _ = _adamw_steps(one_chip, {"input_ids": ids.to("tpu"), "labels": ids.to("tpu")})
    batch = split_batch({"input_ids": ids, "labels": ids.to("tpu"), "return_dict": True}, mesh)
    assert tuple(hf_tpu.sharding_of(batch["input_ids"]).spec) == ("dp",) and batch["return_dict"] is True
    assert hf_tpu.placement(batch["labels"]) == _chips(4)
    try:
        split_batch(torch.ones(3, 2), mesh)
    except ValueError as error:
        assert "dim 0 of size 3 cannot be split evenly over 2 chips (mesh axes ('dp',))" in str(error), error
    else:
        raise AssertionError("a batch of 3 was split over 2 chips")
    losses, optimizer = _adamw_steps(sharded, batch)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), atol=1e-5, rtol=1e-5)
    _same_parameters(sharded, one_chip)
    for parameter in sharded.parameters():
        assert hf_tpu.sharding_of(optimizer.state[parameter]["exp_avg"]) == hf_tpu.sharding_of(parameter)
    weight = sharded.model.layers[0].self_attn.q_proj.weight
    assert tuple(hf_tpu.sharding_of(weight).spec) == ("tp", None) and hf_tpu.placement(weight) == _chips(4)


def case_shard_with_dp_size_splits_the_forward_batch():
    """hf_tpu.shard(tp_size=2, dp_size=2): a ("dp", "tp") mesh; a batch passed to the model is split over "dp" by the
    model itself; two AdamW steps match one chip."""
    reference = _llama().train()
    one_chip, sharded = copy.deepcopy(reference).to("tpu"), hf_tpu.shard(copy.deepcopy(reference), 2, dp_size=2)
    weight = sharded.model.layers[0].self_attn.q_proj.weight
    assert tuple(hf_tpu.sharding_of(weight).spec)[:1] == ("tp",) and hf_tpu.placement(weight) == _chips(4)
    seen = []
    sharded.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"]),
                                            with_kwargs=True)
    ids = Tokens(low=4, high=22).ids[:4].to("tpu")
    expected, _ = _adamw_steps(one_chip, {"input_ids": ids, "labels": ids})
    losses, _ = _adamw_steps(sharded, {"input_ids": ids, "labels": ids})
    assert tuple(hf_tpu.sharding_of(seen[0]).spec) == ("dp",)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), atol=1e-5, rtol=1e-5)
    _same_parameters(sharded, one_chip)


def case_qwen3_moe_logits_and_generate():
    from test_transformers_moe import tiny_qwen3_moe

    reference = tiny_qwen3_moe(torch.float32)
    for tp in TP_SIZES:  # 4 experts: 2 or 1 per chip
        one_chip, sharded = _check_logits(reference, tp)
        assert tuple(hf_tpu.sharding_of(sharded.model.layers[0].mlp.experts.down_proj).spec) == ("tp",)
        if tp == 2:
            _generate(sharded, _greedy_tokens(one_chip, **GREEDY), **GREEDY)


def case_view_spec_follows_the_view():
    rows = hf_tpu.distribute(torch.randn(8, 4), _tp_mesh(4), ("tp", None))
    assert tuple(view_spec(rows)) == ("tp", None)
    assert tuple(view_spec(rows.t())) == (None, "tp")
    assert tuple(view_spec(rows.view(4, 2, 4))) == ("tp", None, None)  # a split dim: its outer part
    assert view_spec(rows.view(2, 4, 4)) is None  # split off the shard boundaries
    assert view_spec(rows[:4]) is None  # a part of its storage
    projected = hf_tpu.distribute(torch.randn(2, 5, 32), _tp_mesh(2), (None, None, "tp"))
    states = projected.view(2, 5, 2, 16).transpose(1, 2)  # as attention's (batch, heads, length, head_dim)
    assert tuple(view_spec(states)) == (None, "tp", None, None)
    assert view_spec(torch.ones(2, device="tpu:0")) is None


four_chip_report = four_chips.report_fixture(__file__, timeout=600)


@pytest.mark.parametrize("case", four_chips.cases(globals()))
def test_on_four_chips(four_chip_report, case):
    assert four_chip_report[case] == "ok", four_chip_report[case]


@pytest.mark.parametrize(
    "batch, message",
    [
        (torch.tensor(3.0), r"splits the first dim.*0-dim tensor"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.tensor(1)}, r"0-dim tensor"),
    ],
    ids=["zero_dim", "zero_dim_in_dict"],
)
def test_split_batch_refuses_a_zero_dim_tensor(batch, message):
    with pytest.raises(ValueError, match=message):
        split_batch(batch, hf_tpu.mesh(["tpu:0"], axis_names=("dp",)))


def test_split_batch_names_the_mesh_axes():
    with pytest.raises(ValueError, match=r"names mesh axes \['dp'\].*its axes are \('tp',\)"):
        split_batch(torch.ones(2, 3), hf_tpu.mesh(["tpu:0"], axis_names=("tp",)))


if __name__ == "__main__":
    four_chips.main(globals())
