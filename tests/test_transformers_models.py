"""transformers models saved as safetensors and loaded with from_pretrained on cpu and on tpu: logits,
greedy generation (dynamic and static cache), seeded sampling and beam search against the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from hf_tpu.compile import compile_stats, reset_compile_stats

VOCAB = 128
_DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
_QWEN3 = dict(_DECODER, head_dim=8)

# name -> (model class, config class, config settings)
MODELS: dict[str, tuple[Any, Any, dict]] = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, _DECODER),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, _QWEN3),
    "qwen3_moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig,
        dict(_QWEN3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    ),
    "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig, dict(_QWEN3, sliding_window=4)),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, _DECODER),
    "gpt2": (
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config,
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2),
    ),
    "bert": (
        transformers.BertForMaskedLM,
        transformers.BertConfig,
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64),
    ),
    "t5": (
        transformers.T5ForConditionalGeneration,
        transformers.T5Config,
        dict(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, decoder_start_token_id=0,
             pad_token_id=0, eos_token_id=2),
    ),
    "vit": (
        transformers.ViTForImageClassification,
        transformers.ViTConfig,
        dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_labels=5),
    ),
}
DECODERS = ["llama", "qwen3", "qwen3_moe", "gemma3", "mistral", "gpt2"]
GENERATORS = DECODERS + ["t5"]

# bfloat16 keeps 8 bits of mantissa: CPU and XLA round intermediate results at different places, so
# logits (of magnitude ~0.1-1 here) differ by a few units in the last place.
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(name)``: the directory of that model, built from its tiny config with seed 0 and saved
    once as safetensors (float32)."""
    saved: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in saved:
            model_class, config_class, settings = MODELS[name]
            torch.manual_seed(0)
            model = model_class(config_class(**settings))
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path, safe_serialization=True)
            assert (path / "model.safetensors").exists()
            saved[name] = str(path)
        return saved[name]

    return get


def load(path: str, name: str, dtype: torch.dtype = torch.float32, **options: Any) -> torch.nn.Module:
    return MODELS[name][0].from_pretrained(path, dtype=dtype, **options).eval()


def inputs(name: str, device: str) -> dict[str, torch.Tensor]:
    """A batch of two: token ids with left padding in the second row, or two images."""
    generator = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=generator).to(device)}
    ids = torch.randint(3, VOCAB, (2, 6), generator=generator)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if name == "t5":
        batch["decoder_input_ids"] = torch.randint(3, VOCAB, (2, 3), generator=generator)
    return {key: value.to(device) for key, value in batch.items()}


def prompt(device: str) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2)).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_from_pretrained_logits_match_cpu(checkpoint, name, dtype):
    path = checkpoint(name)
    cpu_model = load(path, name, dtype)
    tpu_model = load(path, name, dtype, device_map="tpu")
    parameters = list(tpu_model.parameters())
    assert all(p.device == torch.device("tpu:0") and p.dtype == dtype for p in parameters)
    assert all(type(p) is torch.nn.Parameter for p in parameters)
    with torch.no_grad():
        expected = cpu_model(**inputs(name, "cpu")).logits
        actual = tpu_model(**inputs(name, "tpu")).logits
    assert actual.device.type == "tpu" and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected, **TOLERANCES[dtype])


GREEDY = dict(max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("name", GENERATORS)
def test_greedy_generate_matches_cpu(checkpoint, name):
    path = checkpoint(name)
    expected = load(path, name).generate(prompt("cpu"), **GREEDY)
    actual = load(path, name, device_map="tpu").generate(prompt("tpu"), **GREEDY)
    assert actual.device.type == "tpu"
    assert actual.cpu().tolist() == expected.tolist()


@pytest.mark.parametrize("name", GENERATORS)
def test_static_cache_generate_is_compiled_and_matches_cpu(checkpoint, name):
    """cache_implementation="static" makes generate compile its decode steps with graph mode: for greedy
    decoding, all of them as one program (the step in a loop on the device), sliding-window layers too."""
    path = checkpoint(name)
    options = dict(GREEDY, cache_implementation="static")
    expected = load(path, name).generate(prompt("cpu"), **options)
    reset_compile_stats()
    actual = load(path, name, device_map="tpu").generate(prompt("tpu"), **options)
    assert actual.cpu().tolist() == expected.tolist()
    stats = compile_stats()
    assert stats["graphs"] >= 1 and stats["fallbacks"] == 0 and stats["decode_loops"] == 1, stats


def test_seeded_sampling_is_reproducible(checkpoint):
    model = load(checkpoint("llama"), "llama", device_map="tpu")
    options = dict(max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9, temperature=1.5)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(model.generate(prompt("tpu"), **options).cpu().tolist())
    assert runs[0] == runs[1]
    assert all(0 <= token < VOCAB for token in runs[0][0])


def test_beam_search_matches_cpu(checkpoint):
    path = checkpoint("llama")
    options = dict(max_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
    expected = load(path, "llama").generate(prompt("cpu"), **options)
    actual = load(path, "llama", device_map="tpu").generate(prompt("tpu"), **options)
    assert actual.cpu().tolist() == expected.tolist()
