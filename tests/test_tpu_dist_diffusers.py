"""diffusers' tensor parallelism under torchrun with ``tpu_dist``: ``from_pretrained(path,
parallel_config=TensorParallelConfig(tp_degree=N))`` and ``enable_parallelism`` in N processes against the same
Flux transformer unsharded on the CPU in the same worker, and a whole Flux pipeline run with the sharded transformer.

Each case saves a tiny Flux transformer (rank 0, on the CPU, built from a config), shards it with diffusers' own
tensor-parallel path (DTensor weights, collectives on tpu_dist) and compares the outputs (float32, 1e-4) or the
images (1e-4) with one process, and measures how much of the weights each rank holds. One launch of 2 processes
runs every case (the model splits 4 ways too: its 4 heads; a 4-process launch is left out to keep this file fast).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import hf_tpu  # noqa: F401  (registers the device even where autoload is off)
import torchrun_cases
from test_tpu_dist_transformers import _local_bytes, _saved  # rank 0 saves; the bytes a rank holds

OUTPUTS = dict(atol=1e-4, rtol=1e-4)
IMAGES = 1e-4  # max abs difference, images in [0, 1] (3e-7 measured: float32 rounding of the split matmuls)


def _flux(num_attention_heads: int = 4) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=num_attention_heads, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[2, 2, 4]).eval()


def _inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 4, generator=generator),
            "encoder_hidden_states": torch.randn(1, 6, 32, generator=generator),
            "pooled_projections": torch.randn(1, 32, generator=generator), "timestep": torch.tensor([0.5]),
            "img_ids": torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                                  indexing="ij"), -1).reshape(16, 3),
            "txt_ids": torch.zeros(6, 3)}


def _check(model: torch.nn.Module, reference: torch.nn.Module) -> dict:
    """``model``'s outputs against ``reference``'s (on the CPU); returns the weight bytes this rank holds against
    the whole model's."""
    world = dist.get_world_size()
    parameters = dict(model.named_parameters())
    assert {p.device for p in parameters.values()} == {torch.device("tpu", 0)}
    split = {key: p for key, p in parameters.items() if type(p).__name__ == "DTensor"
             and any(placement.is_shard() for placement in p.placements)}
    assert split, "no weight was split"
    split_whole = sum(p.numel() * p.element_size() for p in split.values())
    assert sum(_local_bytes(p) for p in split.values()) == split_whole // world  # 1/N of each split weight
    inputs = _inputs()
    with torch.no_grad():
        expected = reference(**inputs).sample
        actual = model(**{key: value.to("tpu") for key, value in inputs.items()}).sample
    assert actual.device.type == "tpu"
    torch.testing.assert_close(actual.cpu(), expected, **OUTPUTS)
    whole = sum(p.numel() * p.element_size() for p in parameters.values())
    return {"rank_bytes": sum(_local_bytes(p) for p in parameters.values()), "model_bytes": whole,
            "split_fraction": split_whole / whole}


def _tensor_parallel() -> Any:
    import diffusers

    return diffusers.TensorParallelConfig(tp_degree=dist.get_world_size())


def case_from_pretrained_parallel_config():
    import diffusers

    path, reference = _saved("flux", _flux)
    model = diffusers.FluxTransformer2DModel.from_pretrained(path, parallel_config=_tensor_parallel())
    return _check(model, reference)


def case_enable_parallelism():
    import diffusers

    path, reference = _saved("flux_enable", _flux)
    model = diffusers.FluxTransformer2DModel.from_pretrained(path).to("tpu")
    model.enable_parallelism(config=diffusers.ParallelConfig(tensor_parallel_config=_tensor_parallel()))
    return _check(model, reference)


def case_pipeline_with_the_sharded_transformer():
    """tests/test_diffusers_pipelines.py's tiny Flux pipeline with this transformer, unsharded on the CPU and then
    with the sharded transformer on tpu (a CPU generator: the same initial latents)."""
    import diffusers
    import test_diffusers_pipelines as pipelines

    path, reference = _saved("flux_pipeline", _flux)
    pipe = pipelines.build("flux")
    pipe.transformer = reference
    expected = pipelines.generate(pipe, "flux")
    sharded = diffusers.FluxTransformer2DModel.from_pretrained(path, parallel_config=_tensor_parallel())
    pipe = diffusers.FluxPipeline(**{**pipe.to("tpu").components, "transformer": sharded})
    pipe.set_progress_bar_config(disable=True)
    actual = pipelines.generate(pipe, "flux")
    assert actual.device.type == "tpu" and actual.shape == expected.shape
    difference = (actual.cpu() - expected).abs().max().item()
    assert difference <= IMAGES, f"max abs difference {difference}"
    return difference


def case_tp_degree_not_dividing_the_heads_says_so():
    import diffusers

    path, model = _saved("flux_three_heads", lambda: _flux(num_attention_heads=3))
    with pytest.raises(ValueError, match=r"must divide the number of attention heads \(3\)"):  # diffusers' own
        diffusers.FluxTransformer2DModel.from_pretrained(path, parallel_config=_tensor_parallel())
    with pytest.raises(ValueError, match=r"does not divide the attention heads .* use a tp size that splits them "
                                         r"evenly \(1, 3\)"):
        model.to("tpu").enable_parallelism(config=_tensor_parallel())
    assert model._parallel_config is None  # refused before anything changed


def case_tp_degree_beyond_the_world_says_so():
    import diffusers

    world = dist.get_world_size()
    path, _ = _saved("flux_beyond", _flux)
    with pytest.raises(RuntimeError, match=f"Mesh should not be bigger than default world size {world}"):  # torch's
        diffusers.FluxTransformer2DModel.from_pretrained(
            path, parallel_config=diffusers.TensorParallelConfig(tp_degree=2 * world))


reports = torchrun_cases.report_fixture(__file__, world=2, timeout=300)


@pytest.mark.parametrize("case", torchrun_cases.cases(globals()))
@pytest.mark.parametrize("rank", range(2))
def test_two_processes(reports, rank, case):
    assert reports[rank][case] == "ok", reports[rank][case]


def test_each_rank_holds_its_share_of_the_weights(reports):
    for rank in range(2):
        for case in ("case_from_pretrained_parallel_config", "case_enable_parallelism"):
            value = reports[rank][f"{case}:value"]
            expected = value["model_bytes"] * (1 - value["split_fraction"] / 2)
            assert value["rank_bytes"] == pytest.approx(expected, rel=1e-6), (rank, case, value)
            assert value["split_fraction"] > 0.5, value


if __name__ == "__main__":
    torchrun_cases.main(globals(), worker_timeout=280)
