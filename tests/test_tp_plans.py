"""Tensor-parallel plans (hf_tpu.tp_plans) and hf_tpu.shard: the specs each plan gives, sharded tiny models
against the same model on one chip (logits within 1e-4 in float32, greedy tokens identical), per-chip memory,
and the errors that say what to change.

The cases that need several chips run once, together, in a subprocess with HF_TPU_NUM_DEVICES=4 (virtual
chips): this file is also that subprocess's script (``case_*`` functions, each reported by name).
"""

from __future__ import annotations

import copy
import gc

import diffusers
import four_chips
import pytest
import torch
import transformers
from conftest import tiny_llama
from jax.sharding import PartitionSpec as P

import hf_tpu

WHOLE, ROWS, COLS = P(), P("tp"), P(None, "tp")  # whole, dim 0 split, dim 1 split


def tiny_qwen3() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=64)).eval()


def tiny_qwen3_moe(**overrides) -> torch.nn.Module:
    settings = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_experts=4,
                    num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**settings, **overrides})).eval()


def gqa_llama(**overrides) -> torch.nn.Module:
    return tiny_llama(**{"num_attention_heads": 8, "num_key_value_heads": 4, **overrides}).eval()


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)).eval()


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32)).eval()


def tiny_t5() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0)).eval()


def tiny_unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=4, attention_head_dim=4).eval()


def tiny_sd3() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64).eval()


def tiny_pixart() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.PixArtTransformer2DModel(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=4, caption_channels=32,
        in_channels=4, cross_attention_dim=32, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6).eval()


# Per shipped plan: the tiny model, its inputs (CPU tensors) and what its output to compare is, and some specs
# the plan must give (Megatron's layout: colwise splits output features, rowwise input features).
SHIPPED = {
    "gpt2": (tiny_gpt2, lambda: {"input_ids": torch.randint(0, 128, (2, 7))}, lambda out: out.logits, {
        "transformer.h.0.attn.c_attn.weight": COLS,  # Conv1D: [in, out]
        "transformer.h.0.attn.c_attn.bias": ROWS,
        "transformer.h.0.attn.c_proj.weight": ROWS,
        "transformer.h.0.attn.c_proj.bias": WHOLE,
        "transformer.h.1.mlp.c_fc.weight": COLS,
        "transformer.h.1.mlp.c_proj.weight": ROWS,
        "transformer.wte.weight": WHOLE, "lm_head.weight": WHOLE}),
    "bert": (tiny_bert, lambda: {"input_ids": torch.randint(0, 128, (2, 7))}, lambda out: out.last_hidden_state, {
        "encoder.layer.0.attention.self.query.weight": ROWS,
        "encoder.layer.0.attention.self.value.bias": ROWS,
        "encoder.layer.0.attention.output.dense.weight": COLS,
        "encoder.layer.0.attention.output.dense.bias": WHOLE,
        "encoder.layer.1.intermediate.dense.weight": ROWS,
        "encoder.layer.1.output.dense.weight": COLS,
        "embeddings.word_embeddings.weight": WHOLE}),
    "t5": (tiny_t5, lambda: {"input_ids": torch.randint(0, 64, (2, 7)),
                             "decoder_input_ids": torch.randint(0, 64, (2, 5))}, lambda out: out.logits, {
        "encoder.block.0.layer.0.SelfAttention.q.weight": ROWS,
        "encoder.block.0.layer.0.SelfAttention.o.weight": COLS,
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": COLS,  # [buckets, heads]
        "encoder.block.0.layer.1.DenseReluDense.wi_0.weight": ROWS,
        "decoder.block.0.layer.1.EncDecAttention.k.weight": ROWS,
        "decoder.block.0.layer.2.DenseReluDense.wo.weight": COLS,
        "shared.weight": WHOLE, "lm_head.weight": WHOLE}),
    "UNet2DConditionModel": (tiny_unet, lambda: {
        "sample": torch.randn(2, 4, 8, 8), "timestep": torch.tensor(10),
        "encoder_hidden_states": torch.randn(2, 5, 32)}, lambda out: out.sample, {
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight": ROWS,
        "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight": ROWS,
        "up_blocks.0.attentions.1.transformer_blocks.0.attn2.to_out.0.weight": COLS,
        "mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj.weight": ROWS,  # GEGLU, packed
        "mid_block.attentions.0.transformer_blocks.0.ff.net.2.weight": COLS,
        "down_blocks.0.resnets.0.conv1.weight": ROWS,  # [out, in, kh, kw]
        "down_blocks.0.resnets.0.time_emb_proj.bias": ROWS,
        "down_blocks.0.resnets.0.conv2.weight": COLS,
        "down_blocks.0.resnets.0.conv2.bias": WHOLE,
        "conv_in.weight": WHOLE}),
    "SD3Transformer2DModel": (tiny_sd3, lambda: {
        "hidden_states": torch.randn(2, 4, 8, 8), "encoder_hidden_states": torch.randn(2, 5, 32),
        "pooled_projections": torch.randn(2, 64), "timestep": torch.tensor([10, 20])}, lambda out: out.sample, {
        "transformer_blocks.0.attn.to_q.weight": ROWS,
        "transformer_blocks.0.attn.add_k_proj.weight": ROWS,
        "transformer_blocks.0.attn.to_out.0.weight": COLS,
        "transformer_blocks.0.attn.to_add_out.weight": COLS,
        "transformer_blocks.0.ff_context.net.2.weight": COLS,
        "transformer_blocks.1.ff.net.0.proj.weight": ROWS,
        "transformer_blocks.0.norm1.linear.weight": WHOLE, "proj_out.weight": WHOLE}),
    "PixArtTransformer2DModel": (tiny_pixart, lambda: {
        "hidden_states": torch.randn(2, 4, 8, 8), "encoder_hidden_states": torch.randn(2, 5, 32),
        "timestep": torch.tensor([10, 20]), "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}},
        lambda out: out.sample, {
        "transformer_blocks.0.attn1.to_v.weight": ROWS,
        "transformer_blocks.0.attn2.to_k.bias": ROWS,
        "transformer_blocks.1.attn2.to_out.0.weight": COLS,
        "transformer_blocks.1.ff.net.0.proj.weight": ROWS,
        "transformer_blocks.1.ff.net.2.bias": WHOLE,
        "adaln_single.linear.weight": WHOLE, "caption_projection.linear_1.weight": WHOLE}),
}


def _on_tpu(value):
    if isinstance(value, torch.Tensor):
        return value.to("tpu")
    if isinstance(value, dict):
        return {key: _on_tpu(item) for key, item in value.items()}
    return value


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device == torch.device("tpu:0"), actual.device
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=1e-4, rtol=1e-4)


def _one_chip_and_sharded(make, tp_size: int, plan="auto") -> tuple[torch.nn.Module, torch.nn.Module]:
    reference = make()
    return copy.deepcopy(reference).to("tpu"), hf_tpu.shard(reference, tp_size=tp_size, plan=plan)


def _check_placed_as_specs(model: torch.nn.Module, tp_size: int, plan="auto") -> None:
    chips = tuple(torch.device("tpu", k) for k in range(tp_size))
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    for name, spec in hf_tpu.tp_plans.parameter_specs(model, tp_size, plan).items():
        tensor = tensors[name]
        assert hf_tpu.placement(tensor) == chips, name
        assert hf_tpu.sharding_of(tensor).spec == spec, (name, hf_tpu.sharding_of(tensor).spec, spec)


def _causal_lm_matches(make, tp_size: int) -> None:
    one_chip, sharded = _one_chip_and_sharded(make, tp_size)
    _check_placed_as_specs(sharded, tp_size)
    ids = torch.randint(0, 128, (2, 7)).to("tpu")
    with torch.no_grad():
        logits = sharded(ids).logits
        _close(logits, one_chip(ids).logits)
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    tokens = sharded.generate(ids, attention_mask=torch.ones_like(ids), **settings)
    expected = one_chip.generate(ids, attention_mask=torch.ones_like(ids), **settings)
    assert tokens.device == torch.device("tpu:0") and torch.equal(tokens.cpu(), expected.cpu())


def case_llama_tp2():
    _causal_lm_matches(gqa_llama, 2)


def case_llama_tp4_tied_embeddings_stay_tied():
    _causal_lm_matches(gqa_llama, 4)
    model = hf_tpu.shard(gqa_llama(), tp_size=4)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert hf_tpu.sharding_of(model.lm_head.weight).spec == ROWS  # vocab-parallel, both as embedding and head


def case_qwen3_tp2():
    _causal_lm_matches(tiny_qwen3, 2)


def case_qwen3_tp4():
    _causal_lm_matches(tiny_qwen3, 4)


def case_qwen3_moe_tp2():
    _causal_lm_matches(tiny_qwen3_moe, 2)


def case_qwen3_moe_tp4():
    _causal_lm_matches(tiny_qwen3_moe, 4)


def case_shard_keeps_the_parameter_objects():
    for model in (gqa_llama(), gqa_llama().to("tpu")):  # on the CPU and on one chip
        model.model.norm.weight.marker = "kept"
        before = {name: id(parameter) for name, parameter in model.named_parameters()}
        hf_tpu.shard(model, tp_size=2)
        assert before == {name: id(parameter) for name, parameter in model.named_parameters()}
        assert model.model.norm.weight.marker == "kept"
        pair = (torch.device("tpu:0"), torch.device("tpu:1"))
        assert hf_tpu.placement(model.model.layers[0].mlp.down_proj.weight) == pair
        assert hf_tpu.placement(model.model.rotary_emb.inv_freq) == pair  # buffers too (whole on each chip)


def case_devices_pick_the_chips():
    model = hf_tpu.shard(gqa_llama(), devices=["tpu:2", "tpu:3"])
    weight = model.model.layers[1].self_attn.o_proj.weight
    assert hf_tpu.placement(weight) == (torch.device("tpu:2"), torch.device("tpu:3")) and weight.device.index == 2
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        _close_on(model(ids.to("tpu:2")).logits, gqa_llama()(ids).logits, chip=2)


def _close_on(actual: torch.Tensor, expected: torch.Tensor, chip: int) -> None:
    assert actual.device == torch.device("tpu", chip), actual.device
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


def case_memory_per_chip_drops_with_tp():
    for tp_size in (1, 2, 4):
        gc.collect()
        torch.tpu.synchronize()
        before = [torch.tpu.memory_allocated(k) for k in range(4)]
        model = hf_tpu.shard(tiny_qwen3_moe(), tp_size=tp_size)
        grown = [torch.tpu.memory_allocated(k) - before[k] for k in range(4)]
        specs = hf_tpu.tp_plans.parameter_specs(model, tp_size)
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        whole = sum(tensor.nbytes for tensor in tensors.values())
        per_chip = sum(tensor.nbytes // (tp_size if specs[name] != WHOLE else 1) for name, tensor in tensors.items())
        assert grown == [per_chip] * tp_size + [0] * (4 - tp_size), (tp_size, grown, per_chip)
        if tp_size == 1:
            assert per_chip == whole
        else:  # all but the norms, router and rotary buffers is split
            assert per_chip < whole / tp_size * 1.2, (tp_size, per_chip, whole)
        del model


def case_user_plan_on_a_plain_module():
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    plan = {"0": "colwise", "2": "rowwise"}
    specs = hf_tpu.tp_plans.parameter_specs(reference, 4, plan)
    assert specs == {"0.weight": ROWS, "0.bias": ROWS, "2.weight": COLS, "2.bias": WHOLE}
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = reference(x)
        model = hf_tpu.shard(reference, tp_size=4, plan=plan)
        _close(model(x.to("tpu")), expected)
        hidden = model[1](model[0](x.to("tpu")))
        assert hf_tpu.sharding_of(hidden).spec == COLS  # colwise: features split, no collective yet
        assert hf_tpu.sharding_of(model[2](hidden)).spec == WHOLE  # rowwise: the one all-reduce


def _shipped_matches(family: str, tp_size: int) -> None:
    make, inputs, output, _ = SHIPPED[family]
    one_chip, sharded = _one_chip_and_sharded(make, tp_size)
    _check_placed_as_specs(sharded, tp_size)
    torch.manual_seed(1)
    arguments = _on_tpu(inputs())
    with torch.no_grad():
        _close(output(sharded(**arguments)), output(one_chip(**arguments)))


def case_gpt2_plan_tp2_and_tp4():
    _shipped_matches("gpt2", 2)
    _shipped_matches("gpt2", 4)


def case_bert_plan_tp2_and_tp4():
    _shipped_matches("bert", 2)
    _shipped_matches("bert", 4)


def case_t5_plan_tp2_and_tp4():
    _shipped_matches("t5", 2)
    _shipped_matches("t5", 4)


def case_unet_plan_tp2_and_tp4():
    _shipped_matches("UNet2DConditionModel", 2)
    _shipped_matches("UNet2DConditionModel", 4)


def case_sd3_plan_tp2_and_tp4():
    _shipped_matches("SD3Transformer2DModel", 2)
    _shipped_matches("SD3Transformer2DModel", 4)


def case_pixart_plan_tp2_and_tp4():
    _shipped_matches("PixArtTransformer2DModel", 2)
    _shipped_matches("PixArtTransformer2DModel", 4)


four_chip_report = four_chips.report_fixture(__file__, timeout=400)


@pytest.mark.parametrize("case", four_chips.cases(globals()))
def test_on_four_chips(four_chip_report, case):
    assert four_chip_report[case] == "ok", four_chip_report[case]


@pytest.mark.parametrize("family", list(SHIPPED))
def test_shipped_plan_gives_megatron_specs(family):
    make, _, _, expected = SHIPPED[family]
    model = make()
    assert not (getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None))  # none upstream
    specs = hf_tpu.tp_plans.parameter_specs(model, 2)
    assert {name: specs[name] for name in expected} == expected
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    assert set(specs) == names


def test_upstream_plans_are_used():
    llama = gqa_llama()
    assert hf_tpu.tp_plans.plan_for(llama) == llama.tp_plan
    moe = tiny_qwen3_moe()
    specs = hf_tpu.tp_plans.parameter_specs(moe, 4)
    if "model.layers.*.mlp.experts.gate_up_proj" in moe.tp_plan:  # transformers < 5.25 splits the experts' matrices
        assert specs["model.layers.0.mlp.experts.gate_up_proj"] == COLS  # packed_colwise on [experts, 2 x inter, hidden]
        assert specs["model.layers.0.mlp.experts.down_proj"] == P(None, None, "tp")  # rowwise on [experts, hidden, inter]
    else:  # 5.25 splits experts in its expert-parallel plan only (grouped_gemm): by expert, over the same axis
        assert moe.ep_plan["model.layers.*.mlp.experts.gate_up_proj"] == "grouped_gemm"
        assert specs["model.layers.0.mlp.experts.gate_up_proj"] == specs["model.layers.0.mlp.experts.down_proj"] == ROWS
    assert specs["model.layers.0.mlp.gate.weight"] == WHOLE  # the router
    assert specs["model.layers.0.self_attn.q_norm.weight"] == WHOLE
    assert specs["model.layers.1.self_attn.k_proj.weight"] == ROWS and specs["lm_head.weight"] == ROWS
    flux = diffusers.FluxTransformer2DModel(  # diffusers' own plan, with a packed style written as an object
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    specs = hf_tpu.tp_plans.parameter_specs(flux, 2)
    assert specs["single_transformer_blocks.0.proj_out.weight"] == COLS  # packed_rowwise: input features
    assert specs["single_transformer_blocks.0.proj_out.bias"] == WHOLE
    assert specs["transformer_blocks.0.attn.add_q_proj.weight"] == ROWS


def test_plans_in_diffusers_and_older_transformers_vocabulary():
    from diffusers.hooks.tensor_parallel import PackedColwiseParallel

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8),
                                torch.nn.Embedding(8, 4))
    plan = {"0": PackedColwiseParallel(blocks=[1, 1]), "1": "local_rowwise", "2.weight": "replicated",
            "3": "embedding_rowwise"}
    assert hf_tpu.tp_plans.parameter_specs(model, 2, plan) == {
        "0.weight": ROWS, "0.bias": ROWS, "1.weight": COLS, "1.bias": WHOLE, "2.weight": WHOLE, "2.bias": WHOLE,
        "3.weight": ROWS}


def test_a_parameter_entry_wins_over_its_module_entry():
    experts = tiny_qwen3_moe()
    plan = {"model.layers.*.mlp.experts": "moe_tp_experts", "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}
    specs = hf_tpu.tp_plans.parameter_specs(experts, 2, plan)
    assert specs["model.layers.0.mlp.experts.gate_up_proj"] == ROWS  # the expert dim
    assert specs["model.layers.0.mlp.experts.down_proj"] == WHOLE


def test_only_what_the_plan_splits_must_divide():
    mlp_only = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise"}
    specs = hf_tpu.tp_plans.parameter_specs(gqa_llama(), 8, mlp_only)  # 4 key/value heads, but attention is whole
    assert specs["model.layers.0.mlp.down_proj.weight"] == COLS
    assert specs["model.layers.0.self_attn.k_proj.weight"] == WHOLE


@pytest.mark.parametrize(
    "make, tp_size, plan, message",
    [
        (lambda: gqa_llama(), 3, "auto",
         r"tp_size=3 does not divide the attention heads \(num_attention_heads=8\), the key/value heads "
         r"\(num_key_value_heads=4\), the MLP's intermediate size \(intermediate_size=128\) of LlamaForCausalLM: "
         r"use a tp size that splits them evenly \(1, 2, 4\)"),
        (lambda: gqa_llama(num_key_value_heads=2), 4, "auto",
         r"tp_size=4 does not divide the key/value heads \(num_key_value_heads=2\) of LlamaForCausalLM: use a tp "
         r"size that splits them evenly \(1, 2\)"),
        (lambda: gqa_llama(intermediate_size=98), 4, "auto",
         r"does not divide the MLP's intermediate size \(intermediate_size=98\) .*\(1, 2\)"),
        (lambda: tiny_qwen3_moe(num_experts=6), 4, {"model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm"},
         r"tp_size=4 does not divide the experts \(num_experts=6\) of Qwen3MoeForCausalLM: .*\(1, 2, 3, 6\)"),
        (lambda: SHIPPED["PixArtTransformer2DModel"][0](), 8, "auto",
         r"tp_size=8 does not divide the attention heads \(num_attention_heads=4\) .*\(1, 2, 4\)"),
        (lambda: gqa_llama(vocab_size=130), 4, "auto",
         r"model.embed_tokens.weight \(shape \(130, 64\)\) is split on dim 0 by plan entries 'model.embed_tokens', "
         r"'lm_head', but tp_size=4 does not divide its size 130: use a tp size of 1, 2, or keep it whole with "
         r"plan=\{\*\*hf_tpu.tp_plans.plan_for\(model\), 'model.embed_tokens': 'replicate', 'lm_head': 'replicate'\}"),
        (lambda: gqa_llama(), 2, {"model.layers.*.self_attn.qproj": "colwise"},
         r"plan entry 'model.layers.\*.self_attn.qproj' matches no module or parameter of LlamaForCausalLM; close "
         r"names: 'model.layers.\*.self_attn.q_proj'"),
        (lambda: gqa_llama(), 2, {"model.layers.*.self_attn.q_proj": "colwize"},
         r"plan entry 'model.layers.\*.self_attn.q_proj': unknown style 'colwize' \(did you mean 'colwise'"),
        (lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)), 2, "auto",
         r"Sequential has no tensor-parallel plan, upstream or shipped in hf_tpu.tp_plans .*pass plan="),
        (lambda: gqa_llama(), 2, "megatron", r"plan='megatron': pass 'auto', a shipped family"),
        (lambda: gqa_llama(), 0, "auto", r"tp_size must be a positive int"),
    ],
    ids=["heads", "kv_heads", "intermediate", "experts", "diffusers_heads", "split_dim", "unmatched_entry",
         "bad_style", "no_plan", "bad_plan_name", "bad_tp_size"],
)
def test_bad_plans_and_sizes_say_what_to_change(make, tp_size, plan, message):
    with pytest.raises(ValueError, match=message):
        hf_tpu.tp_plans.parameter_specs(make(), tp_size, plan)


def test_more_chips_than_exist_says_how_many_there_are():
    count = torch.tpu.device_count()
    with pytest.raises(ValueError, match=rf"tp_size={count + 1} asks for more chips than exist: there are {count} "
                                         rf"tpu chips .*use tp_size <= {count}"):
        hf_tpu.shard(gqa_llama(), tp_size=count + 1)
    with pytest.raises(ValueError, match=r"tp_size=2 but 1 devices were given"):
        hf_tpu.shard(gqa_llama(), tp_size=2, devices=["tpu:0"])
    with pytest.raises(ValueError, match=rf"tp_size x dp_size={2 * count} asks for more chips than exist"):
        hf_tpu.shard(gqa_llama(), tp_size=count, dp_size=2)
    with pytest.raises(ValueError, match=r"dp_size must be a positive int"):
        hf_tpu.shard(gqa_llama(), dp_size=0)


if __name__ == "__main__":
    four_chips.main(globals())
