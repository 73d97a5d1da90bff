"""Tensor parallelism with one process per chip (torchrun + tpu_dist), as a marimo notebook.

    pip install -e ".[notebooks,test]"
    marimo edit notebooks/tensor_parallel.py      # or: python notebooks/tensor_parallel.py
"""

import marimo

__generated_with = "0.25.2"
app = marimo.App()


@app.cell
def _():
    import importlib.util
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import textwrap
    from pathlib import Path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # 2 chips for this notebook's own process (section 4), read when hf_tpu first needs a device; the launched
    # processes do not inherit it: each of them drives one chip
    os.environ.setdefault("HF_TPU_NUM_DEVICES", "2")
    if importlib.util.find_spec("libtpu") is None:  # no TPU software: JAX's CPU devices stand in for the chips
        os.environ.setdefault("HF_TPU_PLATFORM", "cpu")

    import marimo as mo
    import torch
    import transformers

    import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

    return Path, json, mo, os, signal, socket, subprocess, sys, tempfile, textwrap, torch, transformers


@app.cell
def _(mo):
    _ways = [
        ("start", "`torchrun --nproc-per-node N script.py` or `hf-tpu launch`", "`python script.py`"),
        ("each process sees", "its own chip, as `tpu:0`", "every chip, `tpu:0` .. `tpu:N-1`"),
        ("load", "`from_pretrained(path, distributed_config=DistributedConfig(tp_size=N))`",
         "the same with `device_map=\"tpu\"`, or `hf_tpu.shard(model, tp_size=N)`"),
        ("weights", "DTensors: each rank holds its shard", "sharded tpu tensors (a JAX `NamedSharding`)"),
        ("communication", "the `tpu_dist` c10d backend: collectives as JAX programs on JAX's multi-process runtime",
         "XLA's SPMD partitioner inserts the collectives"),
        ("where it fits", "scripts written for GPUs' torchrun, multi-host pods, DDP / FSDP training",
         "one TPU VM (4 or 8 chips), serving"),
    ]
    mo.md("\n".join([
        "# Many chips: one process per chip, or one process for all", "",
        "A model that does not fit one chip is split over several: *tensor parallelism*, each chip holding a "
        "slice of every large weight (Megatron's layout: attention heads and MLP columns split, the norms whole). "
        "hf_tpu runs it two ways, on the same op table:", "",
        "| | one process per chip | one process, many chips |", "|---|---|---|",
        *(f"| {what} | {per_chip} | {one_process} |" for what, per_chip, one_process in _ways), "",
        "The second is the subject of `notebooks/sharding.py`. This notebook shows the first: a script written as "
        "for GPUs, launched with `hf-tpu launch --nproc-per-node 2`, against the same model in one process, on "
        "one chip and on 2 chips. "
        "`python benchmarks/tensor_parallel.py` puts both side by side (decode tokens/s, weight bytes per chip).", "",
        "On this host every process's chip is a JAX CPU device (`HF_TPU_PLATFORM=cpu` without libtpu), so the "
        "processes share the host's cores: the point here is that the results are the same, not speed.",
    ]))
    return


@app.cell
def _(mo):
    mo.md("""
    ## 1. A checkpoint

    A tiny Llama with random weights, built from a config and saved with `save_pretrained` (nothing is
    downloaded). 4 attention heads and 4 key/value heads, so that 2 processes split them evenly.
    """)
    return


@app.cell
def _(Path, tempfile, torch, transformers):
    _config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                       tie_word_embeddings=False)
    torch.manual_seed(0)
    _model = transformers.LlamaForCausalLM(_config)
    _model.generation_config.eos_token_id = None  # random weights: always decode every new token
    _model.generation_config.pad_token_id = 0
    workspace = Path(tempfile.mkdtemp(prefix="tensor_parallel_notebook_"))
    checkpoint = workspace / "tiny-llama"
    _model.save_pretrained(checkpoint)
    whole_bytes = sum(p.numel() * p.element_size() for p in _model.parameters())
    prompt = [5, 9, 17, 4, 12, 33]
    new_tokens = 8
    return checkpoint, new_tokens, prompt, whole_bytes, workspace


@app.cell
def _(mo):
    mo.md("""
    ## 2. The script each process runs

    What a GPU user writes, with `"tpu"` for `"cuda"`: `init_process_group()` with no backend (on tpu it is
    `tpu_dist`), then transformers' own tensor-parallel load. Each rank reports where its weights live, its
    slice of one weight, the bytes its chip holds (`torch.tpu.memory_allocated`) and its greedy tokens.
    """)
    return


@app.cell
def _(mo, textwrap, workspace):
    script_text = textwrap.dedent('''\
        """One rank of a tensor-parallel generate: run it with hf-tpu launch (or torchrun)."""
        import json
        import sys

        import torch
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        import hf_tpu  # noqa: F401  (only needed where TORCH_DEVICE_BACKEND_AUTOLOAD=0)

        checkpoint, prompt, new_tokens, results = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        dist.init_process_group()  # no backend: tpu's default, tpu_dist
        rank, world = dist.get_rank(), dist.get_world_size()
        before = torch.tpu.memory_allocated()
        model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=world))
        weight_bytes = torch.tpu.memory_allocated() - before
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        with torch.no_grad():
            output = model.generate(torch.tensor([prompt]).to("tpu"), max_new_tokens=new_tokens, do_sample=False)
        report = dict(rank=rank, world=world, backend=dist.group.WORLD.name(), device=str(q_proj.device),
                      weight_type=type(q_proj).__name__, q_proj=list(q_proj.shape),
                      q_proj_here=list(q_proj.to_local().shape), weight_bytes=weight_bytes,
                      tokens=output[0, len(prompt):].cpu().tolist())
        print(f"rank {rank}: {report}", flush=True)
        with open(f"{results}/rank{rank}.json", "w") as file:
            json.dump(report, file)
        dist.destroy_process_group()
    ''')
    script = workspace / "generate_tp.py"
    script.write_text(script_text)
    mo.md(f"`{script.name}`:\n\n```python\n{script_text}```")
    return (script,)


@app.cell
def _(mo):
    mo.md("""
    ## 3. Two processes: `hf-tpu launch --nproc-per-node 2`

    `hf-tpu launch` is torchrun (every torchrun option passes through); without `--nproc-per-node` it starts
    one process per local chip. Here it runs in a subprocess, bounded by a timeout, with a free port for the
    rendezvous (`--master-port`) and each process on its own (JAX CPU) chip (`HF_TPU_NUM_DEVICES` unset).
    """)
    return


@app.cell
def _(checkpoint, json, new_tokens, os, prompt, script, signal, socket, subprocess, sys, workspace):
    def _free_port() -> int:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    def _run(command: list[str], timeout: float) -> str:
        """``command``'s output; past ``timeout`` it is stopped with every process it started (a session)."""
        environment = {key: value for key, value in os.environ.items() if key != "HF_TPU_NUM_DEVICES"}
        process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise RuntimeError(f"hf-tpu launch ran over {timeout} s:\n{output[-3000:]}") from None
        if process.returncode != 0:
            raise RuntimeError(f"hf-tpu launch failed ({process.returncode}):\n{output[-3000:]}")
        return output

    results = workspace / "results"
    results.mkdir(exist_ok=True)
    launch = ["hf-tpu", "launch", "--nproc-per-node", "2", "--master-port", str(_free_port()), str(script),
              str(checkpoint), json.dumps(prompt), str(new_tokens), str(results)]
    # `hf-tpu` is `python -m hf_tpu.cli`: this interpreter's, whatever is on PATH
    launch_output = _run([sys.executable, "-m", "hf_tpu.cli", *launch[1:]], timeout=300)
    ranks = [json.loads((results / f"rank{rank}.json").read_text()) for rank in range(2)]
    rank_lines = [line for line in launch_output.splitlines() if line.startswith("rank ")]
    assert len(rank_lines) == 2, launch_output[-3000:]
    return launch, rank_lines, ranks


@app.cell
def _(launch, mo, rank_lines, ranks, whole_bytes):
    _rows = [f"| {r['rank']} | `{r['backend']}` | `{r['device']}` | `{r['weight_type']}` {r['q_proj']} | "
             f"{r['q_proj_here']} | {r['weight_bytes'] / 2**10:.1f} KB | `{r['tokens']}` |" for r in ranks]
    mo.md("\n".join([
        f"`{' '.join(launch[:6])} generate_tp.py ...`: each rank printed", "", "```", *sorted(rank_lines), "```", "",
        "| rank | backend | device | `q_proj.weight` | its slice here | weights on its chip | greedy tokens |",
        "|---|---|---|---|---|---|---|", *_rows, "",
        f"The whole model is {whole_bytes / 2**10:.1f} KB of weights: each rank's chip holds about half (the norms "
        "are whole on both). Both ranks call `tpu:0` their chip, each its own.",
    ]))
    return


@app.cell
def _(mo):
    mo.md("""
    ## 4. The same model in one process

    The same checkpoint, the same greedy `generate`, in this notebook's process: loaded whole on one chip
    (`device_map="tpu"`), and split over 2 chips by one process (`device_map="tpu"` with the same
    `DistributedConfig(tp_size=2)`, no torchrun: sharded tpu tensors, `HF_TPU_NUM_DEVICES=2` virtual chips
    here). The tokens must be identical to every rank's (this notebook fails otherwise).
    """)
    return


@app.cell
def _(checkpoint, new_tokens, prompt, ranks, torch, transformers, whole_bytes):
    from transformers.distributed import DistributedConfig

    def _load_and_generate(**options) -> tuple[list[int], list[int]]:
        """Greedy tokens, and the bytes the load added on chips 0 and 1."""
        before = [torch.tpu.memory_allocated(chip) for chip in range(2)]
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map="tpu", **options)
        added = [torch.tpu.memory_allocated(chip) - start for chip, start in enumerate(before)]
        with torch.no_grad():
            output = model.generate(torch.tensor([prompt]).to("tpu"), max_new_tokens=new_tokens, do_sample=False)
        return output[0, len(prompt):].cpu().tolist(), added

    assert torch.tpu.device_count() >= 2, "this notebook's process needs 2 chips: HF_TPU_NUM_DEVICES=2 (or unset)"
    one_process_tokens, (one_process_bytes, _) = _load_and_generate()
    spmd_tokens, spmd_bytes = _load_and_generate(distributed_config=DistributedConfig(tp_size=2))

    assert [r["backend"] for r in ranks] == ["tpu_dist"] * 2, ranks
    assert all(r["device"] == "tpu:0" and r["weight_type"] == "DTensor" for r in ranks), ranks
    assert [r["q_proj_here"][0] * 2 for r in ranks] == [r["q_proj"][0] for r in ranks], ranks  # colwise: rows split
    assert all(r["tokens"] == one_process_tokens for r in ranks), (ranks, one_process_tokens)
    assert spmd_tokens == one_process_tokens, (spmd_tokens, one_process_tokens)
    assert one_process_bytes >= whole_bytes, (one_process_bytes, whole_bytes)
    halves = [r["weight_bytes"] for r in ranks] + spmd_bytes  # each chip: about half of the weights
    assert all(0.45 * one_process_bytes < half < 0.55 * one_process_bytes for half in halves), halves
    return one_process_bytes, one_process_tokens, spmd_bytes, spmd_tokens


@app.cell
def _(mo, one_process_bytes, one_process_tokens, ranks, spmd_bytes, spmd_tokens):
    mo.md(f"""
    - One process, one chip: `{one_process_tokens}`, {one_process_bytes / 2**10:.1f} KB on its chip.
    - Two processes, `tpu_dist`: {", ".join(f"rank {r['rank']} `{r['tokens']}`" for r in ranks)}: **identical**,
      with {" and ".join(f"{r['weight_bytes'] / one_process_bytes:.0%}" for r in ranks)} of the weight bytes on
      each rank's chip.
    - One process, 2 chips (SPMD): `{spmd_tokens}`: **identical**, with
      {" and ".join(f"{used / one_process_bytes:.0%}" for used in spmd_bytes)} of the weight bytes on `tpu:0` and
      `tpu:1`.

    The static cache (`cache_implementation="static"`, its decode step compiled with the collectives inside
    the program), Qwen3 and Qwen3-MoE (with expert parallelism too) behave the same:
    `tests/test_tpu_dist_transformers.py` checks them at 2 and 4 processes. Beyond one host, `hf-tpu launch`
    takes torchrun's `--nnodes`, `--node-rank` and `--rdzv-endpoint`: see `docs/guide/multi-host.md`.
    """)
    return


if __name__ == "__main__":
    app.run()
