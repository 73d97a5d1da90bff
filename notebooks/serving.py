"""Serving on tpu: one-program decoding and continuous batching, as a marimo notebook.

    pip install -e ".[notebooks,test]"
    marimo edit notebooks/serving.py      # or: python notebooks/serving.py
"""

import marimo

__generated_with = "0.25.2"
app = marimo.App()


@app.cell
def _():
    import marimo as mo
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    return ContinuousBatchingConfig, GenerationConfig, mo, torch, transformers


@app.cell
def _(mo):
    mo.md("""
    # Serving on tpu

    A tiny Llama built from a config (no download) serves a handful of requests of different lengths, three
    ways: `generate` with a static cache (every decode step in one XLA program), transformers' continuous
    batching (`generate_batch`: a paged cache, requests joining and leaving the batch at every step), and the
    same on CPU. The tokens are the same each way.
    """)
    return


@app.cell
def _(torch, transformers):
    _config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config).eval()
    prompts = [torch.randint(3, 256, (length,)).tolist() for length in (5, 23, 9, 40, 14, 3)]
    return model, prompts


@app.cell
def _(mo):
    mo.md("""
    ## Continuous batching on CPU, then on tpu

    On tpu each step of the batch runs as one compiled program. Batches are padded to a few sizes (powers of
    two), so a run compiles a bounded number of programs, and a second run with other lengths reuses them;
    `torch.tpu.compile_stats()["compilations"]` counts them.
    """)
    return


@app.cell
def _(ContinuousBatchingConfig, GenerationConfig, model, prompts, torch):
    _generation = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    _batching = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64)

    def generate_batch(device):
        """Each request's tokens, in the order of the prompts."""
        outputs = model.to(device).generate_batch(inputs=prompts, generation_config=_generation,
                                                  continuous_batching_config=_batching)
        ordered = sorted(outputs, key=lambda key: int(key.split("_")[-1]))
        return [outputs[key].generated_tokens for key in ordered]

    on_cpu = generate_batch("cpu")
    _before = torch.tpu.compile_stats()["compilations"]
    on_tpu = generate_batch("tpu")
    programs = torch.tpu.compile_stats()["compilations"] - _before
    return on_cpu, on_tpu, programs


@app.cell
def _(mo, on_cpu, on_tpu, programs):
    assert on_tpu == on_cpu
    _rows = "\n".join(f"| {index} | {tokens} |" for index, tokens in enumerate(on_tpu))
    mo.md(f"""
    Continuous batching on tpu gives CPU's tokens: **{on_tpu == on_cpu}**, compiling {programs} programs.

    | request | tokens |
    | --- | --- |
    {_rows}
    """)
    return


@app.cell
def _(mo):
    mo.md("""
    ## The same requests through `generate` with a static cache

    One left-padded batch, decoded in one XLA program: the loop over tokens runs on the device.
    `compile_stats()["decode_loops"]` counts such runs.
    """)
    return


@app.cell
def _(model, on_cpu, prompts, torch):
    _longest = max(map(len, prompts))
    _ids = torch.tensor([[0] * (_longest - len(p)) + p for p in prompts], device="tpu")
    _mask = torch.tensor([[0] * (_longest - len(p)) + [1] * len(p) for p in prompts], device="tpu")
    _loops = torch.tpu.compile_stats()["decode_loops"]
    _out = model.to("tpu").generate(_ids, attention_mask=_mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                    cache_implementation="static")
    static_tokens = _out[:, _longest:].cpu().tolist()
    one_program = torch.tpu.compile_stats()["decode_loops"] > _loops
    assert static_tokens == on_cpu
    return one_program, static_tokens


@app.cell
def _(mo, one_program, on_cpu, static_tokens):
    mo.md(f"""
    Static-cache `generate` gives the same tokens: **{static_tokens == on_cpu}**; decoded in one program:
    **{one_program}**.

    To serve over HTTP, `transformers serve MODEL --device tpu` (add `--continuous-batching` for the paged
    cache) answers OpenAI-compatible chat completions; see the serving guide.
    """)
    return


if __name__ == "__main__":
    app.run()
