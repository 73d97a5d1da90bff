"""Pallas kernels on tpu: your own, from a kernels repository, and the built-in ones, as a marimo notebook.

    pip install -e ".[notebooks,test]"
    marimo edit notebooks/pallas_kernels.py      # or: python notebooks/pallas_kernels.py

(Not named kernels.py: run as a script, that file would shadow the `kernels` library it imports.)
"""

import marimo

__generated_with = "0.25.2"
app = marimo.App()


@app.cell
def _():
    import copy
    import functools
    import json
    import os
    import pathlib
    import tempfile
    import textwrap

    import jax
    import jax.numpy as jnp
    import marimo as mo
    import torch
    from jax.experimental import pallas as pl

    import hf_tpu.kernels  # also registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return copy, functools, hf_tpu, jax, jnp, json, mo, pathlib, pl, tempfile, textwrap, torch


@app.cell
def _(mo):
    mo.md("""
    # Pallas kernels on tpu

    [Pallas](https://docs.jax.dev/en/latest/pallas/index.html) is JAX's language for TPU kernels. This
    notebook writes one and calls it as a PyTorch op, loads another from a kernel repository with the Hugging
    Face `kernels` library, and runs a transformers model on hf_tpu's built-in kernels.

    Pallas TPU kernels compile (with Mosaic) only for TPU chips. Off TPU chips, as on this host when JAX's
    CPU platform backs the `tpu` device, the same kernels run in Pallas' **TPU interpret mode**, which
    simulates the chip's memories with ordinary XLA operations: the results are the kernel's own, slowly.
    That is why every size below is tiny.
    """)
    return


@app.cell
def _(mo):
    mo.md("""
    ## 1. A Pallas kernel as a torch op

    A fused, scaled SiLU, `scale * x * sigmoid(x)`, written the way one writes it for TPUs: the kernel
    body sees one `(8, 128)` block of the input in VMEM, and the `BlockSpec` over a 2D grid says which block
    each grid step reads and writes. A bare `pallas_call` cannot be differentiated, so a `jax.custom_vjp`
    pairs it with a second kernel computing the gradient.
    """)
    return


@app.cell
def _(functools, jax, jnp, pl):
    BLOCK = (8, 128)

    def silu_kernel(x_ref, out_ref, *, scale):
        x = x_ref[...]
        out_ref[...] = x * jax.nn.sigmoid(x) * jnp.asarray(scale, x.dtype)

    def silu_grad_kernel(x_ref, grad_ref, out_ref, *, scale):
        x = x_ref[...]
        sigmoid = jax.nn.sigmoid(x)
        out_ref[...] = grad_ref[...] * jnp.asarray(scale, x.dtype) * sigmoid * (1 + x * (1 - sigmoid))

    def blockwise(kernel, *arrays):
        """``kernel`` over the (8, 128) blocks of same-shaped 2D arrays, into one array of that shape."""
        shape, dtype = arrays[0].shape, arrays[0].dtype
        if len(shape) != 2 or shape[0] % BLOCK[0] or shape[1] % BLOCK[1]:
            raise ValueError(f"scaled_silu takes a 2D array whose sizes are multiples of {BLOCK}, not {shape}: "
                             "pad it first")
        block = pl.BlockSpec(BLOCK, lambda i, j: (i, j))
        return pl.pallas_call(
            kernel,
            grid=(shape[0] // BLOCK[0], shape[1] // BLOCK[1]),
            in_specs=[block] * len(arrays),
            out_specs=block,
            out_shape=jax.ShapeDtypeStruct(shape, dtype),
        )(*arrays)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def pallas_scaled_silu(x, scale):
        return blockwise(functools.partial(silu_kernel, scale=scale), x)

    def pallas_scaled_silu_forward(x, scale):
        return pallas_scaled_silu(x, scale), x

    def pallas_scaled_silu_backward(scale, x, grad):
        return (blockwise(functools.partial(silu_grad_kernel, scale=scale), x, grad),)

    pallas_scaled_silu.defvjp(pallas_scaled_silu_forward, pallas_scaled_silu_backward)
    return (pallas_scaled_silu,)


@app.cell
def _(mo):
    mo.md("""
    `torch.tpu.pallas.jax_op` (TorchTPU's name for it; also `hf_tpu.jax_op`) turns an annotated JAX function
    into a `torch.library` custom op: `jax.Array` parameters are tensors, `float` (like `int`, `bool`, `str`,
    dtypes) is a static argument, with one trace per value. On tpu tensors the op hands their JAX arrays to
    the function without copies, its gradient is a second op computing `jax.vjp` of the function (here: the
    gradient kernel), and `torch.compile(backend="tpu")` puts both into the graph's one XLA program.
    """)
    return


@app.cell
def _(jax, pallas_scaled_silu, torch):
    @torch.tpu.pallas.jax_op("notebook::scaled_silu")
    def scaled_silu(x: jax.Array, scale: float) -> jax.Array:
        """``scale * x * sigmoid(x)`` of a 2D ``x`` whose sizes are multiples of (8, 128)."""
        return pallas_scaled_silu(x, scale)

    SCALE = 1.5

    def torch_scaled_silu(x):
        return torch.nn.functional.silu(x) * SCALE

    torch.manual_seed(0)
    x_cpu = torch.randn(16, 256)
    return SCALE, scaled_silu, torch_scaled_silu, x_cpu


@app.cell
def _(SCALE, scaled_silu, torch, torch_scaled_silu, x_cpu):
    # forward: the kernel on tpu against torch on cpu
    silu_error = (scaled_silu(x_cpu.to("tpu"), SCALE).cpu() - torch_scaled_silu(x_cpu)).abs().max().item()
    assert silu_error < 1e-6, silu_error

    # gradients: autograd on tpu runs the gradient kernel
    _x = x_cpu.to("tpu").requires_grad_()
    scaled_silu(_x, SCALE).square().sum().backward()
    _reference = x_cpu.clone().requires_grad_()
    torch_scaled_silu(_reference).square().sum().backward()
    grad_error = (_x.grad.cpu() - _reference.grad).abs().max().item()
    assert grad_error < 1e-5, grad_error

    # the same values and gradients from a compiled graph
    _compiled = torch.compile(lambda x: scaled_silu(x, SCALE), backend="tpu", fullgraph=True)
    _x.grad = None
    _values = _compiled(_x)
    _values.square().sum().backward()
    compiled_error = max((_values.detach().cpu() - torch_scaled_silu(x_cpu)).abs().max().item(),
                         (_x.grad.cpu() - _reference.grad).abs().max().item())
    assert compiled_error < 1e-5, compiled_error
    return compiled_error, grad_error, silu_error


@app.cell
def _(compiled_error, grad_error, mo, scaled_silu, silu_error, torch):
    try:
        scaled_silu(torch.ones(10, 100, device="tpu"), 1.0)
    except ValueError as _error:
        bad_shape = str(_error)
    else:
        raise AssertionError("scaled_silu took a shape that is not a multiple of its blocks")
    mo.md(f"""
    Largest differences from torch on cpu: **{silu_error:.1e}** for the values, **{grad_error:.1e}** for the
    gradients of `scaled_silu(x).square().sum()`, and **{compiled_error:.1e}** for both from
    `torch.compile(backend="tpu", fullgraph=True)`.

    A shape the kernel cannot tile is refused by the function's own check: *{bad_shape}*
    """)
    return


@app.cell
def _(mo):
    mo.md("""
    ## 2. A kernel repository and `kernels.kernelize`

    The [`kernels`](https://github.com/huggingface/kernels) library loads kernels from Hub repositories (or
    local directories in the same layout) and swaps them into models. A TPU build lives under
    `build/torch-tpu/`; the library picks it because hf_tpu sets `torch.backends.tpu`. Its
    `metadata.json` declares the TPU backend and no Python dependencies (the library's allow-list has no
    TPU entries, so a kernel imports `jax` at runtime), and the module is imported under the metadata's `id`.

    The repository below holds a row-wise RMSNorm kernel: each grid step normalises 8 rows, the whole
    hidden size in one block (`pl.cdiv` lets the last block run past the rows; its extra rows are dropped).
    It imports `jax_op` from `torch_tpu._internal.pallas`, as TPU kernels on the Hub do; hf_tpu provides
    that module.
    """)
    return


@app.cell
def _(json, pathlib, tempfile, textwrap):
    repository = pathlib.Path(tempfile.mkdtemp()) / "tpu-rms-norm"
    _build = repository / "build" / "torch-tpu"
    _metadata = {"name": "tpu-rms-norm", "id": "tpu_rms_norm_notebook", "version": 1, "license": "apache-2.0",
                 "backend": {"type": "tpu"}, "python-depends": []}
    _files = {
        "metadata.json": json.dumps(_metadata, indent=2),
        "tpu_rms_norm/__init__.py": """
            from . import layers
            from .ops import rms_norm

            __all__ = ["layers", "rms_norm"]
        """,
        "tpu_rms_norm/ops.py": """
            import functools

            import jax
            import jax.numpy as jnp
            from jax.experimental import pallas as pl
            from torch_tpu._internal.pallas import jax_op

            ROWS = 8


            def _rms_norm_kernel(x_ref, weight_ref, out_ref, *, eps):
                x = x_ref[...].astype(jnp.float32)
                normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + jnp.float32(eps))
                out_ref[...] = weight_ref[...] * normed.astype(out_ref.dtype)


            @jax_op("tpu_rms_norm_notebook::rms_norm")
            def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
                \"\"\"weight * x / sqrt(mean(x**2) + eps) over the last axis of x[N, H], weight[H].\"\"\"
                rows, hidden = x.shape
                row_block = pl.BlockSpec((ROWS, hidden), lambda i: (i, 0))
                return pl.pallas_call(
                    functools.partial(_rms_norm_kernel, eps=eps),
                    grid=(pl.cdiv(rows, ROWS),),
                    in_specs=[row_block, pl.BlockSpec((1, hidden), lambda i: (0, 0))],
                    out_specs=row_block,
                    out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                )(x, weight.reshape(1, hidden))
        """,
        "tpu_rms_norm/layers.py": """
            import torch

            from .ops import rms_norm


            class RMSNorm(torch.nn.Module):
                \"\"\"The forward of an RMSNorm module with a `weight` and an `eps`, on the kernel.\"\"\"

                weight: torch.Tensor  # read from the module whose forward this replaces
                eps: float
                can_torch_compile = True
                has_backward = False  # forward only: kernelize uses it for Mode.INFERENCE, not TRAINING

                def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
                    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
                    return rms_norm(rows, self.weight, self.eps).reshape(hidden_states.shape)
        """,
    }
    for _name, _text in _files.items():
        (_build / _name).parent.mkdir(parents=True, exist_ok=True)
        (_build / _name).write_text(textwrap.dedent(_text).lstrip())
    repository_files = sorted(str(path.relative_to(repository)) for path in repository.rglob("*") if path.is_file())
    return repository, repository_files


@app.cell
def _(mo, repository_files):
    mo.md("The repository's files:\n\n" + "\n".join(f"- `{name}`" for name in repository_files) + """

    A layer class follows the library's rules: no `__init__`, no members but `can_torch_compile` and
    `has_backward`, a `forward` with the parameters of the forward it replaces, and the state (`weight`,
    `eps`) read from the module it is bound to.

    The model's own RMSNorm names the layer it can take with `kernels.use_kernel_forward_from_hub`; a
    mapping from that name to a repository per device and mode tells `kernels.kernelize` where to find it.
    """)
    return


@app.cell
def _(torch):
    import kernels

    @kernels.use_kernel_forward_from_hub("RMSNorm")
    class RMSNorm(torch.nn.Module):
        def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.eps = eps

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.eps))

    class TinyModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(32, 128)
            self.norm = RMSNorm(128)
            self.down = torch.nn.Linear(128, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.norm(self.up(x)))

    torch.manual_seed(0)
    cpu_model = TinyModel().eval()
    with torch.no_grad():
        cpu_model.norm.weight.uniform_(0.5, 1.5)
    model_input = torch.randn(3, 5, 32)  # 15 rows: the last row block is partly past the end
    return cpu_model, kernels, model_input


@app.cell
def _(copy, cpu_model, kernels, model_input, repository, torch):
    _mapping = {
        "RMSNorm": {
            "tpu": {kernels.Mode.INFERENCE: kernels.LocalLayerRepository(repo_path=repository, layer_name="RMSNorm")}
        }
    }
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    with kernels.use_kernel_mapping(_mapping):
        kernels.kernelize(tpu_model, device="tpu", mode=kernels.Mode.INFERENCE)

    rms_norm_kernel = kernels.get_local_kernel(repository)  # the same module kernelize imported
    assert tpu_model.norm.forward.__func__ is rms_norm_kernel.layers.RMSNorm.forward
    assert "forward" not in vars(cpu_model.norm)

    with torch.no_grad():
        _expected = cpu_model(model_input)
        model_error = (tpu_model(model_input.to("tpu")).cpu() - _expected).abs().max().item()
    assert model_error < 1e-5, model_error
    return model_error, rms_norm_kernel


@app.cell
def _(mo):
    mo.md("""
    `kernels.get_local_kernel(path)` returns the repository's module itself, so its functions can be called
    directly:
    """)
    return


@app.cell
def _(cpu_model, rms_norm_kernel, torch):
    _rows = torch.randn(20, 128)
    _weight = cpu_model.norm.weight.detach()
    _direct = rms_norm_kernel.rms_norm(_rows.to("tpu"), _weight.to("tpu"), 1e-6).cpu()
    with torch.no_grad():
        direct_error = (_direct - cpu_model.norm(_rows)).abs().max().item()
    assert direct_error < 1e-5, direct_error
    return (direct_error,)


@app.cell
def _(direct_error, mo, model_error, tpu_model):
    _bound = tpu_model.norm.forward.__func__
    mo.md(f"""
    After `kernelize`, the tpu model's `norm.forward` is `{_bound.__module__}.{_bound.__qualname__}`, bound to
    the model's own module; the cpu model keeps its forward. Largest differences from the cpu model:
    **{model_error:.1e}** for the kernelized model's outputs, **{direct_error:.1e}** for `rms_norm` called
    directly.
    """)
    return


@app.cell
def _(mo):
    mo.md("""
    ## 3. The built-in kernels on a transformers model

    hf_tpu ships Pallas kernels for flash attention, decode attention over the KV cache, RMSNorm and
    mixture-of-experts grouped matmuls. `hf_tpu.kernels.enable(model)` wires them into a transformers model
    on tpu, in place: it sets the attention (and experts) implementation to `tpu_pallas` and binds kernel
    forwards to modules such as the RMSNorms. That changes `model.config`, so the model without kernels
    below is a deep copy made before.
    """)
    return


@app.cell
def _(copy, hf_tpu, torch):
    import transformers

    torch.manual_seed(0)
    _config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    plain_llama = transformers.LlamaForCausalLM(_config).eval().to("tpu")
    kernel_llama = hf_tpu.kernels.enable(copy.deepcopy(plain_llama))
    prompt = torch.tensor([[5, 9, 17, 33, 2, 8, 77, 100]], device="tpu")

    with torch.no_grad():
        logits_error = (kernel_llama(prompt).logits - plain_llama(prompt).logits).abs().max().item()
    assert logits_error < 1e-5, logits_error
    kernel_tokens = kernel_llama.generate(prompt, max_new_tokens=4, do_sample=False).cpu()
    assert torch.equal(kernel_tokens, plain_llama.generate(prompt, max_new_tokens=4, do_sample=False).cpu())
    kernel_modules = sorted({type(module).__name__ for module in kernel_llama.modules() if "forward" in vars(module)})
    assert kernel_llama.config._attn_implementation == "tpu_pallas" and "LlamaRMSNorm" in kernel_modules
    return kernel_llama, kernel_modules, kernel_tokens, logits_error


@app.cell
def _(kernel_llama, kernel_modules, kernel_tokens, logits_error, mo):
    _names = ", ".join(f"`{name}`" for name in kernel_modules)
    mo.md(f"""
    Attention implementation: `{kernel_llama.config._attn_implementation}`; modules whose forward is now a
    kernel's: {_names}. Largest logits difference from the model without kernels:
    **{logits_error:.1e}**; the same greedy tokens: `{kernel_tokens.tolist()[0]}`.

    On TPU chips the same code compiles the kernels with Mosaic, which is where they pay off;
    `hf_tpu.kernels.pallas.use_by_default()` says whether TPU chips back the device.
    """)
    return


if __name__ == "__main__":
    app.run()
