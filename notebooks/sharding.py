"""One process, many chips: sharded tpu tensors and a tensor-parallel model, as a marimo notebook.

    pip install -e ".[notebooks,test]"
    marimo edit notebooks/sharding.py      # or: python notebooks/sharding.py
"""

import marimo

__generated_with = "0.25.2"
app = marimo.App()


@app.cell
def _():
    import copy
    import os

    # 4 chips: read when hf_tpu first needs a device, so set before any tensor goes to "tpu". Without TPU
    # chips they are virtual chips on the host's CPU; on a TPU VM, its first 4 real chips.
    os.environ.setdefault("HF_TPU_NUM_DEVICES", "4")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import marimo as mo
    import torch
    import transformers
    from jax.sharding import PartitionSpec

    import hf_tpu  # registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0
    from hf_tpu.sharding import view_spec

    chips = [torch.device("tpu", index) for index in range(4)]
    assert torch.tpu.device_count() == 4, "this notebook needs 4 chips: HF_TPU_NUM_DEVICES=4 (or unset)"
    return PartitionSpec, chips, copy, hf_tpu, mo, torch, transformers, view_spec


@app.cell
def _(chips, mo, torch):
    mo.md(f"""
    # One process, many chips

    A TPU VM has 4 or 8 chips. With hf_tpu, **one** Python process drives all of them, as JAX programs do:
    a tpu tensor can be *sharded*, its elements split over several chips, and every PyTorch operator works
    on it unchanged. The operators are compiled by XLA, whose SPMD partitioner follows the shardings and
    inserts the communication between chips (an all-reduce after a matmul over a split dim, say).

    This notebook asks for 4 chips with `HF_TPU_NUM_DEVICES=4`, set in its first cell before any tensor
    goes to `tpu`. Without TPU chips, as in CI, that splits JAX's CPU platform into 4 virtual chips, so the
    same code runs on a laptop. On a TPU VM the same setting picks the first 4 of its real chips, and
    everything below runs on them unchanged (without the variable, every chip of the VM is a `tpu:k`). On a
    host whose JAX sees a GPU, also set `HF_TPU_PLATFORM=cpu` to get virtual chips.

    **Chips here:** {", ".join(f"`{chip}`" for chip in chips)}, each a `{torch.tpu.get_device_name()}`.
    """)
    return


@app.cell
def _(mo):
    mo.md("""
    ## 1. A sharded tensor

    `hf_tpu.distribute(tensor, spec=...)` puts a tensor on the chips, with `spec` saying, per dim, the mesh
    axis it is split over (the default mesh is all chips, one axis named `"chips"`) or `None` for a whole
    dim. A CPU tensor goes from the host straight to its pieces: no chip ever holds it whole. The result is
    an ordinary tpu tensor whose `device` is the first chip; `hf_tpu.placement` says where its elements
    live and `hf_tpu.sharding_of` how they are split (a JAX `NamedSharding`).
    """)
    return


@app.cell
def _(PartitionSpec, chips, hf_tpu, torch):
    host = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))
    _before = [torch.tpu.memory_allocated(chip) for chip in chips]
    rows = hf_tpu.distribute(host, spec=("chips", None))  # rows split over the 4 chips, columns whole
    rows_bytes = [torch.tpu.memory_allocated(chip) - _before[k] for k, chip in enumerate(chips)]

    assert rows.device == chips[0]
    assert hf_tpu.placement(rows) == tuple(chips)
    assert hf_tpu.sharding_of(rows).spec == PartitionSpec("chips", None)
    assert rows_bytes == [host.nbytes // 4] * 4, rows_bytes  # each chip holds a quarter of the rows
    return host, rows, rows_bytes


@app.cell
def _(hf_tpu, host, mo, rows, rows_bytes):
    mo.md(f"""
    A `{tuple(host.shape)}` float32 tensor ({host.nbytes / 2**20:.2f} MB) split by rows:

    - `rows.device`: `{rows.device}`
    - `hf_tpu.placement(rows)`: `{hf_tpu.placement(rows)}`
    - `hf_tpu.sharding_of(rows)`: `{hf_tpu.sharding_of(rows)}`, each chip's piece
      `{hf_tpu.sharding_of(rows).shard_shape(tuple(rows.shape))}`
    - `torch.tpu.memory_allocated(k)` grew by {", ".join(f"{b / 2**10:.0f} KB" for b in rows_bytes)} on
      chips 0 to 3: a quarter each.
    """)
    return


@app.cell
def _(mo):
    mo.md("""
    Operators on a sharded tensor give sharded results, split as XLA chooses (usually like their inputs).
    A tensor on one chip of the mesh, like `weight` below on `tpu:0`, can be mixed in: for the op it is
    copied, whole, to every chip. A reduction over the split dim needs every chip's piece: XLA adds the
    all-reduce, and the sum comes out whole on every chip. `.cpu()` gathers the pieces into one CPU tensor.
    """)
    return


@app.cell
def _(PartitionSpec, chips, hf_tpu, host, rows, torch):
    scaled = rows * 2 + 1
    weight = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    projected = rows @ weight.to("tpu")  # weight on tpu:0 only
    column_sums = rows.sum(dim=0)

    assert hf_tpu.placement(scaled) == tuple(chips) == hf_tpu.placement(projected)
    assert hf_tpu.sharding_of(scaled).spec == PartitionSpec("chips", None) == hf_tpu.sharding_of(projected).spec
    assert hf_tpu.sharding_of(column_sums).spec == PartitionSpec()  # whole on every chip
    torch.testing.assert_close(scaled.cpu(), host * 2 + 1)
    torch.testing.assert_close(projected.cpu(), host @ weight, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(column_sums.cpu(), host.sum(dim=0), atol=1e-4, rtol=1e-5)
    return column_sums, projected, scaled


@app.cell
def _(column_sums, hf_tpu, mo, projected, scaled):
    mo.md(f"""
    | result | shape | `hf_tpu.sharding_of(...).spec` |
    |---|---|---|
    | `rows * 2 + 1` | `{tuple(scaled.shape)}` | `{hf_tpu.sharding_of(scaled).spec}` |
    | `rows @ weight` | `{tuple(projected.shape)}` | `{hf_tpu.sharding_of(projected).spec}` |
    | `rows.sum(dim=0)` | `{tuple(column_sums.shape)}` | `{hf_tpu.sharding_of(column_sums).spec}` (whole) |

    Each `.cpu()` equals the same computation on the CPU.
    """)
    return


@app.cell
def _(mo):
    mo.md("""
    ## 2. A tensor-parallel model: `hf_tpu.shard`

    `hf_tpu.shard(model, tp_size=4)` splits a model's parameters in place over 4 chips, following its
    tensor-parallel plan: transformers' own `base_model_tp_plan` for Llama (hf_tpu ships plans for models
    that have none upstream, such as GPT-2, BERT and T5). The plan is data, module pattern -> style, in
    transformers' vocabulary; `hf_tpu.tp_plans.plan_for(model)` shows it, and
    `hf_tpu.tp_plans.parameter_specs(model, tp_size)` what it makes of each parameter: Megatron's layout,
    `colwise` layers split their output features (dim 0 of a `Linear`'s `[out, in]` weight), `rowwise` ones
    their input features, the embedding its vocabulary, the norms stay whole.

    The model: a tiny Llama with random weights, built from a config (8 attention heads, 4 key/value heads).
    """)
    return


@app.cell
def _(hf_tpu, torch, transformers):
    def tiny_llama(**overrides) -> torch.nn.Module:
        torch.manual_seed(0)
        settings = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                        tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **overrides})).eval()

    llama = tiny_llama()
    plan = hf_tpu.tp_plans.plan_for(llama)
    specs = hf_tpu.tp_plans.parameter_specs(llama, tp_size=4)
    return llama, plan, specs, tiny_llama


@app.cell
def _(mo, plan, specs):
    mo.md("\n".join([
        "`hf_tpu.tp_plans.plan_for(llama)`:", "", "| module | style |", "|---|---|",
        *(f"| `{pattern}` | `{style}` |" for pattern, style in plan.items()), "",
        "`hf_tpu.tp_plans.parameter_specs(llama, tp_size=4)`, layer 1 as layer 0: JAX `PartitionSpec`s, `P('tp',)` "
        "splits dim 0 over the mesh axis `\"tp\"`, `P(None, 'tp')` dim 1, `P()` keeps the tensor whole.",
        "", "| parameter or buffer | spec |", "|---|---|",
        *(f"| `{name}` | `{spec}` |" for name, spec in specs.items() if ".layers.1." not in name),
    ]))
    return


@app.cell
def _(mo):
    mo.md("""
    Per-chip memory, first with a copy of the model on one chip (`.to("tpu")`), the reference to compare
    with, then with the model sharded over the 4 chips. What each chip should get follows from the specs:
    a quarter of each split tensor, a whole copy of each one kept whole.
    """)
    return


@app.cell
def _(PartitionSpec, chips, copy, hf_tpu, llama, specs, torch):
    def _on_each_chip() -> list[int]:
        return [torch.tpu.memory_allocated(chip) for chip in chips]

    _tensors = {**dict(llama.named_parameters()), **dict(llama.named_buffers())}  # a tied weight once
    whole_bytes = sum(tensor.nbytes for tensor in _tensors.values())
    piece_bytes = sum(tensor.nbytes // (1 if specs[name] == PartitionSpec() else 4)
                      for name, tensor in _tensors.items())

    _start = _on_each_chip()
    one_chip = copy.deepcopy(llama).to("tpu")
    _copied = _on_each_chip()
    sharded = hf_tpu.shard(llama, tp_size=4)  # in place: the same model object
    _split = _on_each_chip()
    one_chip_bytes = [after - before for before, after in zip(_start, _copied)]
    sharded_bytes = [after - before for before, after in zip(_copied, _split)]

    assert sharded is llama
    assert one_chip_bytes == [whole_bytes, 0, 0, 0], one_chip_bytes
    assert sharded_bytes == [piece_bytes] * 4, (sharded_bytes, piece_bytes)
    return one_chip, one_chip_bytes, piece_bytes, sharded, sharded_bytes, whole_bytes


@app.cell
def _(hf_tpu, mo, one_chip_bytes, sharded, sharded_bytes, whole_bytes):
    def _weight_row(name: str) -> str:
        weight = sharded.get_parameter(name)
        piece = hf_tpu.sharding_of(weight).shard_shape(tuple(weight.shape))
        return f"| `{name}` | `{tuple(weight.shape)}` | `{piece}` | {len(hf_tpu.placement(weight))} |"

    _names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
              "model.layers.0.input_layernorm.weight"]
    _tied = sharded.lm_head.weight is sharded.model.embed_tokens.weight
    mo.md("\n".join([
        "A few weights of the sharded model: each is on the 4 chips (`hf_tpu.placement`), split or whole.", "",
        "| weight | shape | each chip's piece | chips |", "|---|---|---|---|", *map(_weight_row, _names), "",
        f"Bytes added on each chip (`torch.tpu.memory_allocated(k)`), of the model's {whole_bytes / 2**10:.1f} KB "
        "of parameters and buffers:",
        "", "| chip | copy on one chip | sharded over 4 |", "|---|---|---|",
        *(f"| `tpu:{k}` | {whole / 2**10:.1f} KB | {split / 2**10:.1f} KB |"
          for k, (whole, split) in enumerate(zip(one_chip_bytes, sharded_bytes))), "",
        f"Tied weights stay tied: `lm_head.weight is model.embed_tokens.weight` is **{_tied}**, split over the "
        "vocabulary for both uses.",
    ]))
    return


@app.cell
def _(mo):
    mo.md("""
    The sharded model takes inputs on `tpu` (the first chip) and gives ordinary tpu tensors: compare its
    logits and its greedy `generate` with the copy on one chip.
    """)
    return


@app.cell
def _(chips, hf_tpu, one_chip, sharded, torch):
    input_ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0)).to("tpu")
    with torch.no_grad():
        sharded_logits = sharded(input_ids).logits
        one_chip_logits = one_chip(input_ids).logits
    logits_difference = (sharded_logits.cpu() - one_chip_logits.cpu()).abs().max().item()

    _settings = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    sharded_tokens = sharded.generate(input_ids, **_settings)
    one_chip_tokens = one_chip.generate(input_ids, **_settings)

    assert sharded_logits.device == chips[0] and hf_tpu.placement(sharded_logits) == tuple(chips)
    assert logits_difference < 1e-4, logits_difference
    assert torch.equal(sharded_tokens.cpu(), one_chip_tokens.cpu())
    return logits_difference, one_chip_tokens, sharded_logits, sharded_tokens


@app.cell
def _(logits_difference, mo, one_chip_tokens, sharded_logits, sharded_tokens, view_spec):
    mo.md(f"""
    - Logits `{tuple(sharded_logits.shape)}` on `{sharded_logits.device}`, split over the chips as XLA chose:
      `{view_spec(sharded_logits)}` (`hf_tpu.sharding.view_spec`, per dim of the tensor: here over the
      vocabulary, like the embedding the head shares its weight with). Largest difference from the one-chip logits:
      **{logits_difference:.1e}** (float32).
    - Greedy tokens, sharded: `{sharded_tokens.cpu().tolist()}`
    - Greedy tokens, one chip: `{one_chip_tokens.cpu().tolist()}` (identical)
    """)
    return


@app.cell
def _(mo):
    mo.md("""
    ## 3. When the chips do not fit the model

    Megatron's layout keeps each attention head whole on one chip, so `tp_size` must divide the number of
    heads and of key/value heads (and the MLP's intermediate size). `hf_tpu.shard` checks the plan before
    it moves anything, and says what to change. Here, a Llama with 2 key/value heads over 4 chips, and
    more chips than this host has:
    """)
    return


@app.cell
def _(chips, hf_tpu, tiny_llama, torch):
    two_kv_heads = tiny_llama(num_key_value_heads=2)

    def _error_of(tp_size: int) -> str:
        try:
            hf_tpu.shard(two_kv_heads, tp_size=tp_size)
        except ValueError as error:
            return str(error)
        raise AssertionError(f"hf_tpu.shard(model, tp_size={tp_size}) should have refused")

    kv_heads_error = _error_of(4)
    too_many_chips_error = _error_of(8)
    print(f"tp_size=4: ValueError: {kv_heads_error}\ntp_size=8: ValueError: {too_many_chips_error}")
    assert "num_key_value_heads=2" in kv_heads_error and "(1, 2)" in kv_heads_error, kv_heads_error
    assert "more chips than exist" in too_many_chips_error, too_many_chips_error
    assert all(parameter.device == torch.device("cpu") for parameter in two_kv_heads.parameters())  # untouched

    hf_tpu.shard(two_kv_heads, tp_size=2)  # what the message suggests
    assert hf_tpu.placement(two_kv_heads.model.layers[0].self_attn.k_proj.weight) == tuple(chips[:2])
    return kv_heads_error, too_many_chips_error


@app.cell
def _(kv_heads_error, mo, too_many_chips_error):
    mo.md(f"""
    - `hf_tpu.shard(model, tp_size=4)`: `ValueError: {kv_heads_error}`
    - `hf_tpu.shard(model, tp_size=8)`: `ValueError: {too_many_chips_error}`

    The model is left as it was (on the CPU), and `tp_size=2`, as the message suggests, shards it over
    `tpu:0` and `tpu:1`. Where a model has no plan, upstream or shipped, pass one:
    `hf_tpu.shard(model, tp_size=4, plan={{"layers.*.attn.q": "colwise", ...}})`, with full module names
    and `*` for layer numbers; every entry must match a module or parameter.
    """)
    return


if __name__ == "__main__":
    app.run()
