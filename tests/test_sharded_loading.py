"""from_pretrained(device_map="tpu", distributed_config=DistributedConfig(tp_size=N)) without torchrun: the weights
load straight into shards over N chips of one process, against the same checkpoint loaded on one chip.

The cases run once, together, in a subprocess with HF_TPU_NUM_DEVICES=4 (virtual chips): this file is also that
subprocess's script (``case_*`` functions, each reported by name), as in test_sharded_tensors.py (tests/four_chips.py).
"""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path
from typing import Callable

import four_chips
import pytest
import torch

import hf_tpu

TP_SIZES = (2, 4)
PROMPT = torch.tensor([[5, 9, 17, 33, 2, 8], [7, 7, 20, 11, 6, 40]])
GREEDY = dict(max_new_tokens=5, do_sample=False)
LOGITS = dict(atol=1e-4, rtol=1e-4)
# 8 heads, 4 KV heads: every size in TP_SIZES divides them
HEADS = dict(num_attention_heads=8, num_key_value_heads=4, initializer_range=0.5)

_SAVED: dict[str, Path] = {}


def _saved(family: str) -> Path:
    """A tiny model of ``family`` saved with save_pretrained, once per process."""
    if family not in _SAVED:
        import transformers
        from conftest import tiny_llama

        if family == "llama":
            model = tiny_llama(**HEADS)
        else:
            torch.manual_seed(0)
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                max_position_embeddings=64, tie_word_embeddings=False, **HEADS))
        _SAVED[family] = Path(tempfile.mkdtemp(prefix=f"sharded_{family}_"))
        model.save_pretrained(_SAVED[family])
    return _SAVED[family]


def _load(family: str, **options) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(_saved(family), device_map="tpu", **options)


def _tp(size: int, **options):
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=size, **options)


def _chips(count: int) -> tuple[torch.device, ...]:
    return tuple(torch.device("tpu", k) for k in range(count))


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _layout(tensor: torch.Tensor) -> tuple:
    sharding = hf_tpu.sharding_of(tensor)
    return hf_tpu.placement(tensor), None if sharding is None else tuple(sharding.spec)


def _allocated() -> list[int]:
    gc.collect()
    torch.tpu.synchronize()
    return [torch.tpu.memory_allocated(k) for k in range(4)]


def _per_chip_bytes(model: torch.nn.Module, tp: int) -> int:
    """What one chip holds of ``model``'s tensors: a 1/tp slice of each split tensor, a whole copy of the rest."""
    total = 0
    for tensor in _tensors(model).values():  # a tied tensor once
        spec = hf_tpu.sharding_of(tensor).spec
        total += tensor.numel() * tensor.element_size() // (tp if any(entry for entry in spec) else 1)
    return total


def _one_chip_logits_and_tokens(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    reference = _load(family)
    with torch.no_grad():
        logits = reference(PROMPT.to("tpu")).logits.cpu()
    return logits, reference.generate(PROMPT.to("tpu"), **GREEDY).cpu()


def _sharded_like_one_chip(family: str, tp: int, expected: torch.Tensor, tokens: torch.Tensor):
    """The model loaded into shards over ``tp`` chips, after checking its logits and greedy tokens, with the
    bytes each chip gained in loading it and the highest chip 0 reached on the way."""
    before = _allocated()
    for k in range(4):
        torch.tpu.reset_peak_memory_stats(k)
    sharded = _load(family, distributed_config=_tp(tp))
    grown = [now - then for now, then in zip(_allocated(), before)]
    peak = torch.tpu.max_memory_allocated(0) - before[0]
    with torch.no_grad():
        actual = sharded(PROMPT.to("tpu")).logits
    assert actual.device == torch.device("tpu:0")
    torch.testing.assert_close(actual.cpu(), expected, **LOGITS)
    assert torch.equal(sharded.generate(PROMPT.to("tpu"), **GREEDY).cpu(), tokens)
    return sharded, grown, peak


def _check_family(family: str) -> None:
    from hf_tpu.tp_plans import parameter_specs

    expected, tokens = _one_chip_logits_and_tokens(family)
    for tp in TP_SIZES:
        sharded, grown, peak = _sharded_like_one_chip(family, tp, expected, tokens)
        specs = parameter_specs(sharded, tp, axis="tp")
        for name, tensor in _tensors(sharded).items():  # as the plan says, on the first tp chips
            assert _layout(tensor) == (_chips(tp), tuple(specs[name])), (tp, name, _layout(tensor))
        assert hf_tpu.sharding_of(sharded.model.layers[0].self_attn.q_proj.weight).spec[0] == "tp"
        per_chip = _per_chip_bytes(sharded, tp)
        assert grown == [per_chip] * tp + [0] * (4 - tp), (tp, grown, per_chip)
        largest = max(t.numel() * t.element_size() for t in _tensors(sharded).values())
        whole = sum(t.numel() * t.element_size() for t in _tensors(sharded).values())
        assert per_chip < whole / 1.5  # the split weights dominate: far less than the model on each chip
        assert peak <= per_chip + largest, (tp, peak, per_chip)  # at most one tensor whole on chip 0, never the model


def case_llama_loads_into_shards_as_the_plan_says():
    _check_family("llama")


def case_qwen3_loads_into_shards_as_the_plan_says():
    _check_family("qwen3")


def case_the_result_is_what_hf_tpu_shard_makes():
    loaded = _load("llama", distributed_config=_tp(2))
    sharded = hf_tpu.shard(_load("llama"), 2)
    expected = {name: _layout(tensor) for name, tensor in _tensors(sharded).items()}
    assert {name: _layout(tensor) for name, tensor in _tensors(loaded).items()} == expected
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    for name, tensor in _tensors(loaded).items():
        assert torch.equal(tensor.cpu(), _tensors(sharded)[name].cpu()), name


def _read_and_placed(load: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, list[str]]:
    """What ``load`` did, in order: each tensor read from a safetensors file, each host tensor put on shards."""
    from hf_tpu import sharding
    from hf_tpu.integrations import transformers as integration

    events: list[str] = []
    read, distribute = integration.SafetensorsReader.read, sharding.distribute

    def reading(self, entry):
        events.append("read")
        return read(self, entry)

    def placing(tensor, *args, **kwargs):
        if tensor.device.type == "cpu":
            events.append("placed")
        return distribute(tensor, *args, **kwargs)

    integration.SafetensorsReader.read, sharding.distribute = reading, placing
    try:
        return load(), events
    finally:
        integration.SafetensorsReader.read, sharding.distribute = read, distribute


def _stored(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as checkpoint:
        return len(checkpoint.keys())


def case_each_weight_is_read_once_and_placed_before_the_next_is_read():
    model, events = _read_and_placed(lambda: _load("qwen3", distributed_config=_tp(2)))
    stored = _stored(_saved("qwen3") / "model.safetensors")
    assert events.count("read") == stored == len(dict(model.named_parameters()))
    assert events == ["read", "placed"] * stored  # one weight at a time on the host


def case_a_user_plan_overrides_the_model_rules():
    model = _load("llama", distributed_config=_tp(2, tp_plan={"model.layers.*.mlp.down_proj": "replicate"}))
    assert _layout(model.model.layers[1].mlp.down_proj.weight) == (_chips(2), ())
    assert _layout(model.model.layers[1].mlp.up_proj.weight) == (_chips(2), ("tp",))


def case_standalone_tp_size_argument():
    model = _load("llama", tp_size=2)
    assert _layout(model.model.layers[0].self_attn.o_proj.weight) == (_chips(2), (None, "tp"))


def _error(action) -> str:
    try:
        action()
    except ValueError as error:
        return str(error)
    raise AssertionError("no error was raised")


def case_bad_input_says_what_to_do():
    import transformers

    message = _error(lambda: _load("llama", distributed_config=_tp(8)))
    assert "tp_size=8 asks for more chips than exist: there are 4 tpu chips" in message, message
    for device_map in ("cpu", "auto", None, "tpu:1"):
        message = _error(lambda: transformers.AutoModelForCausalLM.from_pretrained(
            _saved("llama"), device_map=device_map, distributed_config=_tp(2)))
        assert "needs device_map='tpu'" in message and "torchrun" in message, (device_map, message)
    message = _error(lambda: _load("llama", distributed_config=_tp(2, fsdp_size=2)))
    assert "tensor parallelism only" in message and "torchrun" in message, message
    many_kv = tempfile.mkdtemp(prefix="sharded_llama_kv2_")
    from conftest import tiny_llama

    tiny_llama().save_pretrained(many_kv)  # 2 KV heads
    message = _error(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        many_kv, device_map="tpu", distributed_config=_tp(4)))
    assert "tp_size=4 does not divide the key/value heads (num_key_value_heads=2)" in message, message


def case_torchrun_environment_is_left_to_transformers():
    import transformers
    from transformers import PreTrainedModel

    class MultiProcessPath(Exception):
        pass

    def prepare(cls, distributed_config, device_map=None):
        raise MultiProcessPath(distributed_config.tp_size, device_map)

    PreTrainedModel.prepare_distribute_model = classmethod(prepare)  # shadows DistributedMixin's
    os.environ.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    try:
        transformers.AutoModelForCausalLM.from_pretrained(_saved("llama"), distributed_config=_tp(2))
    except MultiProcessPath as reached:
        assert reached.args == (2, None), reached.args
    else:
        raise AssertionError("a torchrun environment did not reach transformers' multi-process path")
    finally:
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            del os.environ[key]
        del PreTrainedModel.prepare_distribute_model


def _sd3_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(2, 4, 8, 8, generator=generator),
            "encoder_hidden_states": torch.randn(2, 5, 32, generator=generator),
            "pooled_projections": torch.randn(2, 64, generator=generator), "timestep": torch.tensor([3, 500])}


def _sd3(tp: int = 1, **options) -> torch.nn.Module:
    import diffusers

    if "sd3" not in _SAVED:
        torch.manual_seed(0)
        model = diffusers.SD3Transformer2DModel(  # positional table of 8 x 8 patches: the weights dominate
            sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64,
            pos_embed_max_size=8)
        _SAVED["sd3"] = Path(tempfile.mkdtemp(prefix="sharded_sd3_"))
        model.save_pretrained(_SAVED["sd3"])
    if tp > 1:
        options["parallel_config"] = diffusers.TensorParallelConfig(tp_degree=tp)
    return diffusers.SD3Transformer2DModel.from_pretrained(_SAVED["sd3"], **{"device_map": "tpu", **options})


def case_diffusers_tensor_parallel_config_loads_into_shards():
    from hf_tpu.tp_plans import parameter_specs

    inputs = {key: value.to("tpu") for key, value in _sd3_inputs().items()}
    with torch.no_grad():
        expected = _sd3()(**inputs).sample.cpu()
    for tp in TP_SIZES:
        before = _allocated()
        torch.tpu.reset_peak_memory_stats(0)
        sharded = _sd3(tp)
        grown = [now - then for now, then in zip(_allocated(), before)]
        peak = torch.tpu.max_memory_allocated(0) - before[0]
        specs = parameter_specs(sharded, tp, axis="tp")
        for name, tensor in _tensors(sharded).items():
            assert _layout(tensor) == (_chips(tp), tuple(specs[name])), (tp, name, _layout(tensor))
        assert hf_tpu.sharding_of(sharded.transformer_blocks[0].attn.to_q.weight).spec[0] == "tp"
        per_chip = _per_chip_bytes(sharded, tp)
        assert grown == [per_chip] * tp + [0] * (4 - tp), (tp, grown, per_chip)
        largest = max(t.numel() * t.element_size() for t in _tensors(sharded).values())
        assert peak <= per_chip + largest, (tp, peak, per_chip)
        with torch.no_grad():
            actual = sharded(**inputs).sample
        torch.testing.assert_close(actual.cpu(), expected, **LOGITS)
        del sharded, actual  # before measuring the next load


def case_diffusers_reads_each_weight_once_and_places_it_before_the_next():
    model, events = _read_and_placed(lambda: _sd3(2))
    stored = _stored(_SAVED["sd3"] / "diffusion_pytorch_model.safetensors")
    assert events.count("read") == stored == len(model.state_dict())  # the parameters and the positional table
    assert events == ["read", "placed"] * stored  # one weight at a time on the host, not the whole file first


def case_diffusers_parallel_config_and_bad_input():
    import diffusers

    message = _error(lambda: _sd3(8))
    assert "tp_size=8 asks for more chips than exist" in message, message
    for device_map in ("cpu", None):
        message = _error(lambda: _sd3(2, device_map=device_map))
        assert "TensorParallelConfig(tp_degree=2)" in message and "needs device_map='tpu'" in message, message
    in_parallel_config = _sd3(parallel_config=diffusers.ParallelConfig(
        tensor_parallel_config=diffusers.TensorParallelConfig(tp_degree=2)))
    assert _layout(in_parallel_config.transformer_blocks[0].attn.to_q.weight) == (_chips(2), ("tp",))
    os.environ["WORLD_SIZE"] = "2"  # torchrun's: diffusers' own path, which knows no plan for SD3
    try:
        message = _error(lambda: _sd3(2))
    finally:
        del os.environ["WORLD_SIZE"]
    assert "`_tp_plan` must be set on the model class" in message, message


four_chip_report = four_chips.report_fixture(__file__, timeout=300)


@pytest.mark.parametrize("case", four_chips.cases(globals()))
def test_on_four_chips(four_chip_report, case):
    assert four_chip_report[case] == "ok", four_chip_report[case]


if __name__ == "__main__":
    four_chips.main(globals())
