"""transformers' tensor parallelism under torchrun with ``tpu_dist``: ``from_pretrained(path,
distributed_config=DistributedConfig(tp_size=N))`` in N processes against the same model in one process.

Each case saves a tiny model (rank 0, on the CPU), loads it with transformers' own tensor-parallel path (DTensor
weights, collectives on tpu_dist) and compares logits and greedy tokens, dynamic and static cache (its decode
steps compiled), with the unsharded model on the CPU in the same worker, and measures how much of the weights
each rank holds. One launch of 2 processes runs every case; one of 4 processes runs the ones whose models split
4 ways.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_tpu  # noqa: F401  (registers the device even where autoload is off)
import torchrun_cases
from hf_tpu.compile import compile_stats, reset_compile_stats

PROMPT = torch.tensor([[5, 9, 17, 4, 12], [7, 7, 20, 11, 6]])
GREEDY = dict(max_new_tokens=6, do_sample=False)
LOGITS = dict(atol=1e-4, rtol=1e-4)


def _llama() -> torch.nn.Module:
    from conftest import tiny_llama

    return tiny_llama(num_key_value_heads=4)  # 4 query and KV heads: splits 2 and 4 ways


def _qwen3() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False))


def _qwen3_moe() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=64))


def _saved(name: str, build) -> tuple[Path, torch.nn.Module]:
    """The model saved by rank 0 in the launch's folder; returns its path and this rank's CPU copy."""
    path = Path(os.environ["TORCHRUN_CASES_REPORTS"]) / name
    model = build().eval()
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    return path, model


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _check(name: str, build, **distributed) -> dict:
    """Loads ``name`` split over the world's ranks; checks logits and greedy tokens against one process and
    returns the weight bytes this rank holds against the whole model's."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    world = dist.get_world_size()
    path, reference = _saved(f"{name}_{world}", build)
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=world,
                                                                                            **distributed))
    parameters = dict(model.named_parameters())
    assert next(iter(parameters.values())).device == torch.device("tpu", 0)
    split = {key: p for key, p in parameters.items() if type(p).__name__ == "DTensor"
             and any(placement.is_shard() for placement in p.placements)}
    assert split, "no weight was split"
    whole = sum(p.numel() * p.element_size() for p in parameters.values())
    mine = sum(_local_bytes(p) for p in parameters.values())
    split_whole = sum(p.numel() * p.element_size() for p in split.values())
    assert sum(_local_bytes(p) for p in split.values()) == split_whole // world  # 1/N of each split weight
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT.to("tpu")).logits.cpu(), reference(PROMPT).logits, **LOGITS)
    expected = reference.generate(PROMPT, **GREEDY)
    for cache in ("dynamic", "static"):
        reset_compile_stats()
        tokens = model.generate(PROMPT.to("tpu"), cache_implementation=cache, **GREEDY)
        assert torch.equal(tokens.cpu(), expected), (cache, tokens, expected)
    stats = compile_stats()  # the static cache's decode steps: compiled, collectives inside, no fallback
    assert stats["calls"] >= GREEDY["max_new_tokens"] - 1 and stats["fallbacks"] == 0, stats
    experts = {key: p for key, p in parameters.items() if ".experts." in key}
    return {"rank_bytes": mine, "model_bytes": whole, "split_fraction": split_whole / whole,
            "rank_expert_bytes": sum(_local_bytes(p) for p in experts.values()),
            "expert_bytes": sum(p.numel() * p.element_size() for p in experts.values())}


def case_llama():
    return _check("llama", _llama)


def case_qwen3():
    return _check("qwen3", _qwen3)


def case_qwen3_moe():
    return _check("qwen3_moe", _qwen3_moe)


def case_qwen3_moe_expert_parallel():
    return _check("qwen3_moe_ep", _qwen3_moe, ep_size=dist.get_world_size())


def case_heads_not_divisible_says_so():
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from conftest import tiny_llama

    path, _ = _saved("three_heads", lambda: tiny_llama(num_attention_heads=3, num_key_value_heads=3,
                                                       hidden_size=48))
    with pytest.raises(Exception, match=r"(?i)divisible|divide"):
        AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))


reports = torchrun_cases.report_fixture(__file__, world=2, timeout=300)
four_reports = torchrun_cases.report_fixture(__file__, world=4, timeout=300,
                                             only=["case_llama", "case_qwen3_moe_expert_parallel"])


@pytest.mark.parametrize("case", torchrun_cases.cases(globals()))
@pytest.mark.parametrize("rank", range(2))
def test_two_processes(reports, rank, case):
    assert reports[rank][case] == "ok", reports[rank][case]


@pytest.mark.parametrize("case", ["case_llama", "case_qwen3_moe_expert_parallel"])
@pytest.mark.parametrize("rank", range(4))
def test_four_processes(four_reports, rank, case):
    assert four_reports[rank][case] == "ok", four_reports[rank][case]


def test_each_rank_holds_its_share_of_the_weights(reports, four_reports):
    for world, launch in ((2, reports), (4, four_reports)):
        for rank in range(world):
            value = launch[rank]["case_llama:value"]
            expected = value["model_bytes"] * (1 - value["split_fraction"] * (1 - 1 / world))
            assert value["rank_bytes"] == pytest.approx(expected, rel=1e-6), (world, rank, value)
            assert value["split_fraction"] > 0.5, value


def test_expert_parallelism_gives_each_rank_its_share_of_the_experts(reports, four_reports):
    """Qwen3-MoE with ep_size=N: each rank holds 1/N of the experts' bytes (N of its experts), and of the whole
    model what the split weights leave whole (attention and norms split by tensor parallelism, or replicated)."""
    for world, launch in ((2, reports), (4, four_reports)):
        for rank in range(world):
            value = launch[rank]["case_qwen3_moe_expert_parallel:value"]
            assert value["expert_bytes"] > 0.5 * value["model_bytes"], value
            assert value["rank_expert_bytes"] == value["expert_bytes"] // world, (world, rank, value)
            assert value["rank_bytes"] < value["model_bytes"] * (1 / world + 0.25), (world, rank, value)


if __name__ == "__main__":
    torchrun_cases.main(globals(), worker_timeout=280)
