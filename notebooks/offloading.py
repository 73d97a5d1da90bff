"""Fitting a model that does not fit the chip: offloading on tpu, as a marimo notebook.

    pip install -e ".[notebooks,test]"
    marimo edit notebooks/offloading.py      # or: python notebooks/offloading.py
"""

import marimo

__generated_with = "0.25.2"
app = marimo.App()


@app.cell
def _():
    import os
    import tempfile

    import marimo as mo
    import torch

    import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return mo, tempfile, torch


@app.cell
def _(mo):
    mo.md("""
    # Offloading on tpu

    A chip's memory is often smaller than the model. The Hugging Face stack keeps the weights on the host
    and brings them to the chip as they are needed; on `tpu` it works as on CUDA. This notebook builds
    small models with random weights (nothing is downloaded) and measures what each approach keeps on
    the chip with `torch.tpu.max_memory_allocated()`.
    """)
    return


@app.cell
def _(tempfile, torch):
    import transformers

    torch.manual_seed(0)
    _config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    llama_dir = tempfile.mkdtemp()
    transformers.LlamaForCausalLM(_config).save_pretrained(llama_dir)
    llama_bytes = sum(p.numel() * p.element_size() for p in transformers.LlamaForCausalLM(_config).parameters())
    prompt = torch.tensor([[1, 17, 42, 7, 99, 3]])
    return llama_bytes, llama_dir, prompt, transformers


@app.cell
def _(llama_dir, prompt, torch, transformers):
    torch.tpu.reset_peak_memory_stats()
    _model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    full_tokens = _model.generate(prompt.to("tpu"), max_new_tokens=8, do_sample=False).cpu()
    full_peak = torch.tpu.max_memory_allocated()
    del _model
    return full_peak, full_tokens


@app.cell
def _(mo):
    mo.md("""
    ## A memory budget: `device_map="auto"` with `max_memory`

    Give the chip less memory than the model needs. accelerate's planner puts what fits on `tpu:0` (the
    integer `0` in `max_memory` and in the device map is the chip) and the rest on the host; hooks copy the
    host layers' weights to the chip for their forward only.
    """)
    return


@app.cell
def _(llama_bytes, llama_dir, prompt, torch, transformers):
    budget = llama_bytes // 2
    torch.tpu.reset_peak_memory_stats()
    _model = transformers.AutoModelForCausalLM.from_pretrained(
        llama_dir, device_map="auto", max_memory={0: budget, "cpu": "1GB"})
    device_map = _model.hf_device_map
    budget_tokens = _model.generate(prompt.to("tpu"), max_new_tokens=8, do_sample=False).cpu()
    budget_peak = torch.tpu.max_memory_allocated()
    del _model
    return budget, budget_peak, budget_tokens, device_map


@app.cell
def _(budget, budget_peak, budget_tokens, device_map, full_peak, full_tokens, llama_bytes, mo, torch):
    assert torch.equal(budget_tokens, full_tokens)
    _placed = ", ".join(f"`{name}`: {place}" for name, place in device_map.items())
    mo.md(f"""
    The model has {llama_bytes / 2**20:.2f} MB of weights; the chip was given {budget / 2**20:.2f} MB.

    Device map: {_placed}.

    Peak chip memory while generating: **{budget_peak / 2**20:.2f} MB** with the budget, against
    {full_peak / 2**20:.2f} MB fully loaded, and the same 8 greedy tokens.
    """)
    return


@app.cell
def _(mo):
    mo.md("""
    ## diffusers group offloading with a transfer stream

    `enable_group_offload` keeps every group of layers on the host and loads one group at a time. With
    `use_stream=True` it copies the next group on a second `torch.tpu.Stream` while the current one
    computes, and pins the host copies (`Tensor.pin_memory()`) so the copies can run asynchronously.
    """)
    return


@app.cell
def _(torch):
    import diffusers

    def transformer():
        torch.manual_seed(0)
        return diffusers.SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=32,
            num_attention_heads=4, caption_projection_dim=128, joint_attention_dim=64, pooled_projection_dim=64,
        ).eval()

    _generator = torch.Generator().manual_seed(0)
    denoiser_inputs = dict(
        hidden_states=torch.randn(1, 4, 16, 16, generator=_generator).to("tpu"),
        encoder_hidden_states=torch.randn(1, 8, 64, generator=_generator).to("tpu"),
        pooled_projections=torch.randn(1, 64, generator=_generator).to("tpu"),
        timestep=torch.tensor([500.0]).to("tpu"),
    )

    def peak_and_output(model):
        torch.tpu.synchronize()
        torch.tpu.reset_peak_memory_stats()
        with torch.no_grad():
            output = model(**denoiser_inputs).sample.cpu()
        return torch.tpu.max_memory_allocated(), output

    return peak_and_output, transformer


@app.cell
def _(peak_and_output, torch, transformer):
    on_chip_peak, on_chip_output = peak_and_output(transformer().to("tpu"))
    _offloaded = transformer()
    _offloaded.enable_group_offload(onload_device=torch.device("tpu"), offload_type="block_level",
                                    num_blocks_per_group=1, use_stream=True)
    streamed_peak, streamed_output = peak_and_output(_offloaded)
    assert torch.equal(streamed_output, on_chip_output)
    assert all(p.device.type == "cpu" for p in _offloaded.parameters())
    return on_chip_peak, streamed_peak


@app.cell
def _(mo, on_chip_peak, streamed_peak):
    mo.md(f"""
    Peak chip memory of one forward: **{streamed_peak / 2**20:.2f} MB** with group offloading and a stream,
    against {on_chip_peak / 2**20:.2f} MB with the model on the chip ({streamed_peak / on_chip_peak:.0%}), with
    identical outputs. Between forwards the weights are back on the host.

    `benchmarks/offloading.py` measures the same for a larger model and every approach (leaf-level groups,
    layerwise float8 casting, accelerate's `cpu_offload`), with the time each one costs.
    """)
    return


if __name__ == "__main__":
    app.run()
