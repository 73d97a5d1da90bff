"""Attention at sequence 1024: hf_tpu's fused SDPA lowering (eager and compiled) next to torch CPU SDPA,
hand-written JAX and the Pallas flash kernel, side by side in one process.

``F.scaled_dot_product_attention`` of ``[batch, heads, seq, head_dim]`` query, key and value (self-attention,
``--causal`` or not, ``--dtype`` float32 or bfloat16; with ``--documents N``, under the boolean mask of N packed
documents instead, each attending causally to itself); with ``--backward``, the forward and the gradients of all
three inputs for a fixed random output gradient. Variants, all on the same numbers:

- ``torch cpu``: torch's CPU SDPA (its flash kernel);
- ``tpu eager``: ``F.scaled_dot_product_attention`` on tpu tensors, which hf_tpu routes to its fused lowering
  (``_scaled_dot_product_fused_attention_overrideable``: one XLA program, softmax in float32);
- ``tpu compiled``: the same call under ``torch.compile(backend="tpu")``;
- ``jax dense``: ``jax.jit`` of a hand-written softmax attention (the bar the lowering should reach);
- ``jax.nn``: ``jax.jit(jax.nn.dot_product_attention)`` (XLA implementation), given its ``[batch, seq, heads,
  head_dim]`` layout beforehand;
- ``pallas flash``: ``jax.jit`` of ``hf_tpu.kernels.pallas.flash_attention`` (JAX's TPU flash kernel). Off TPU chips
  it runs in TPU interpret mode, whose times say nothing about the kernel: there it is left out unless
  ``--pallas`` (checked and timed, slowly). On TPU chips (``hf_tpu.kernels.pallas.use_by_default()``) it always
  runs. Under ``--documents``, ``pallas splash`` instead: ``hf_tpu.kernels.pallas.masked_attention`` (JAX's splash
  kernel, which skips the blocks of other documents; tpu SDPA takes it on chips too).

JAX's inputs are the tpu tensors' own arrays (``hf_tpu.kernels.to_jax``); float32 products run at full precision
everywhere (``Precision.HIGHEST``, as hf_tpu's lowering). Every result (and gradient) is first compared with
torch CPU SDPA in float32 on the same inputs; then times are the median of ``--repeats`` runs after one warm-up
(which compiles), each ending when its results are ready.

    python benchmarks/attention.py [--batch 2] [--heads 8] [--head-dim 64] [--seq 1024] [--dtype float32]
                                   [--causal both] [--documents 0] [--backward] [--repeats 10] [--pallas]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import hf_tpu  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
from _report import report
from hf_tpu.kernels import pallas, to_jax

# off TPU chips the Pallas kernels run interpreted: their rows say so
INTERPRETED = "" if pallas.use_by_default() else " (interp)"

# max |difference| from the float32 reference that counts as agreeing, by input dtype
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}

Results = tuple  # the output, then (with --backward) the gradients of query, key and value


@dataclass(frozen=True)
class Runner:
    run: Callable[[], Results]  # one timed call, returning once its results are ready
    to_host: Callable[[Results], list[torch.Tensor]]  # its results as float32 host tensors in [B, H, S, D]


def inputs(args: argparse.Namespace) -> list[torch.Tensor]:
    """Query, key, value and the output gradient, on the host in ``--dtype``."""
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    return [torch.randn(shape, generator=generator).to(getattr(torch, args.dtype)) for _ in range(4)]


# --- torch ---------------------------------------------------------------------------------------------------------


def document_mask(seq: int, documents: int) -> torch.Tensor:
    """``[seq, seq]`` booleans: ``documents`` packed documents of equal length, each attending causally to itself."""
    position = torch.arange(seq)
    document = position * documents // seq
    return (position[None, :] <= position[:, None]) & (document[None, :] == document[:, None])


def torch_runner(tensors: Sequence[torch.Tensor], causal: bool, backward: bool, device: str,
                 compiled: bool = False, mask: torch.Tensor | None = None) -> Runner:
    """SDPA of ``tensors`` moved to ``device`` (``torch.compile(backend="tpu")`` with ``compiled``), synchronized."""
    query, key, value, grad_out = (t.to(device) for t in tensors)
    mask = None if mask is None else mask.to(device)

    def attend(query, key, value):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal)

    if compiled:
        attend = torch.compile(attend, backend="tpu", dynamic=False)

    def run() -> Results:
        if backward:
            leaves = [t.detach().requires_grad_() for t in (query, key, value)]
            out = attend(*leaves)
            results = (out.detach(), *torch.autograd.grad(out, leaves, grad_out))
        else:
            with torch.no_grad():
                results = (attend(query, key, value),)
        if device == "tpu":
            torch.tpu.synchronize()
        return results

    return Runner(run, lambda results: [r.float().cpu() for r in results])


def reference(tensors: Sequence[torch.Tensor], causal: bool, backward: bool,
              mask: torch.Tensor | None) -> list[torch.Tensor]:
    """torch CPU SDPA (and gradients) in float32 on the same (rounded) inputs."""
    return list(torch_runner([t.float() for t in tensors], causal, backward, "cpu", mask=mask).run())


# --- JAX -----------------------------------------------------------------------------------------------------------


def dense_attention(query: jax.Array, key: jax.Array, value: jax.Array, causal: bool,
                    mask: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v over ``[B, H, S, D]`` (where ``mask`` allows), the softmax in float32."""
    precision = jax.lax.Precision.HIGHEST if query.dtype == jnp.float32 else None
    scale = jnp.asarray(query.shape[-1] ** -0.5, jnp.float32)
    logits = jnp.einsum("bhqd,bhkd->bhqk", query, key, precision=precision,
                        preferred_element_type=jnp.float32) * scale
    if causal:
        allowed = jnp.tril(jnp.ones(logits.shape[-2:], jnp.bool_))
        logits = jnp.where(allowed, logits, jnp.asarray(-jnp.inf, jnp.float32))
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.asarray(-jnp.inf, jnp.float32))
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, value, precision=precision,
                      preferred_element_type=jnp.float32).astype(query.dtype)


def library_attention(query: jax.Array, key: jax.Array, value: jax.Array, causal: bool,
                      mask: jax.Array | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention`` over its own ``[B, S, H, D]`` layout, at full float32 precision."""
    with jax.default_matmul_precision("highest"):
        return jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=causal, implementation="xla")


def pallas_attention(query: jax.Array, key: jax.Array, value: jax.Array, causal: bool) -> jax.Array:
    return pallas.flash_attention(query, key, value, causal=causal)


def jax_runner(attention: Callable[..., jax.Array], tensors: Sequence[torch.Tensor], causal: bool, backward: bool,
               heads_second: bool = True, mask: torch.Tensor | None = None) -> Runner:
    """``jax.jit`` of ``attention`` (and with ``backward`` its VJP) on the tpu tensors' arrays, blocking until
    ready. ``heads_second=False``: ``attention`` takes ``[B, S, H, D]``; its inputs are transposed beforehand and
    its results back afterwards (outside the timed call). ``mask`` (``[S, S]``) goes to ``attention`` as
    ``[1, 1, S, S]``, if given."""
    layout = (lambda x: x) if heads_second else (lambda x: jnp.swapaxes(x, 1, 2))
    arrays = [layout(to_jax(t.to("tpu"))) for t in tensors]
    attend = functools.partial(attention, causal=causal)
    if mask is not None:
        attend = functools.partial(attend, mask=jnp.asarray(mask.numpy())[None, None])

    def forward_backward(query, key, value, grad_out):
        out, vjp = jax.vjp(attend, query, key, value)
        return (out, *vjp(grad_out))

    compiled = jax.jit(forward_backward) if backward else jax.jit(lambda q, k, v, _: (attend(q, k, v),))

    def to_host(results: Results) -> list[torch.Tensor]:
        return [torch.from_numpy(np.array(layout(r).astype(jnp.float32))) for r in results]  # layout: self-inverse

    return Runner(lambda: jax.block_until_ready(compiled(*arrays)), to_host)


def splash_runner(tensors: Sequence[torch.Tensor], mask: torch.Tensor, backward: bool) -> Runner:
    """``jax.jit`` of the splash kernel under ``mask`` (and with ``backward`` its backward kernels, given the
    forward's output and logsumexp) on the tpu tensors' arrays, blocking until ready."""
    arrays = [to_jax(t.to("tpu")) for t in tensors]
    allowed = jnp.asarray(mask.numpy())[None, None]

    def attend(query, key, value, grad_out):
        out, logsumexp = pallas.masked_attention(query, key, value, allowed)
        if not backward:
            return (out,)
        return (out, *pallas.masked_attention_backward(query, key, value, out, logsumexp, grad_out, allowed))

    compiled = jax.jit(attend)
    return Runner(lambda: jax.block_until_ready(compiled(*arrays)),
                  lambda results: [torch.from_numpy(np.array(r.astype(jnp.float32))) for r in results])


# --- timing --------------------------------------------------------------------------------------------------------


def runners(tensors: Sequence[torch.Tensor], causal: bool, backward: bool, with_pallas: bool,
            mask: torch.Tensor | None) -> dict[str, Runner]:
    found = {
        "torch cpu": torch_runner(tensors, causal, backward, "cpu", mask=mask),
        "tpu eager": torch_runner(tensors, causal, backward, "tpu", mask=mask),
        "tpu compiled": torch_runner(tensors, causal, backward, "tpu", compiled=True, mask=mask),
        "jax dense": jax_runner(dense_attention, tensors, causal, backward, mask=mask),
        "jax.nn": jax_runner(library_attention, tensors, causal, backward, heads_second=False, mask=mask),
    }
    if with_pallas and mask is None:
        found["pallas flash" + INTERPRETED] = jax_runner(pallas_attention, tensors, causal, backward)
    elif with_pallas:
        found["pallas splash" + INTERPRETED] = splash_runner(tensors, mask, backward)
    return found


def measure(run: Callable[[], Results], repeats: int) -> tuple[float, Results]:
    """(median ms of ``repeats`` runs after the first, the first run's results)."""
    results = run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, results


def compare(args: argparse.Namespace, causal: bool, with_pallas: bool) -> bool:
    """Checks each variant against the float32 reference, times it and prints a table; whether all agreed."""
    tensors = inputs(args)
    mask = document_mask(args.seq, args.documents) if args.documents else None
    expected = reference(tensors, causal, args.backward, mask)
    rows = {}
    for name, runner in runners(tensors, causal, args.backward, with_pallas, mask).items():
        print(f"{name}...", file=sys.stderr, flush=True)
        milliseconds, results = measure(runner.run, args.repeats)
        difference = max((a - b).abs().max().item() for a, b in zip(runner.to_host(results), expected))
        rows[name] = milliseconds, difference

    what = "forward+backward" if args.backward else "forward"
    masked = f"{args.documents} documents" if args.documents else "causal" if causal else "no mask"
    print(f"{masked}, {what}:")
    print(f"  {'variant':<22} {'ms':>9} {'/ torch cpu':>12} {'max |diff|':>11} {'agrees':>7}")
    cpu_ms = rows["torch cpu"][0]
    for name, (milliseconds, difference) in rows.items():
        agrees = difference <= TOLERANCE[args.dtype]
        print(f"  {name:<22} {milliseconds:9.2f} {cpu_ms / milliseconds:11.2f}x {difference:11.2e} {str(agrees):>7}")
    jax_ms = rows["jax dense"][0]
    print(f"  tpu compiled vs jax dense: {jax_ms / rows['tpu compiled'][0]:.2f}x, tpu eager vs jax dense: "
          f"{jax_ms / rows['tpu eager'][0]:.2f}x (above 1 = faster)")
    case = f"{masked} {what}"
    for name in ("tpu compiled", "tpu eager"):
        report(f"{case}, speed: {name} / jax dense", jax_ms / rows[name][0], "x", "jax.jit of hand-written attention")
        report(f"{case}, speed: {name} / torch cpu", cpu_ms / rows[name][0], "x", "torch CPU SDPA")
    for name in rows:
        if name.startswith("pallas"):
            print(f"  {name} vs tpu compiled: {rows['tpu compiled'][0] / rows[name][0]:.2f}x")
    print()
    return all(difference <= TOLERANCE[args.dtype] for _, difference in rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", choices=tuple(TOLERANCE), default="float32")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--documents", type=int, default=0,
                        help="attend under the boolean mask of this many packed documents (causal within each)")
    parser.add_argument("--backward", action="store_true", help="time forward + backward (gradients of q, k, v)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pallas", action="store_true",
                        help="run the Pallas kernels off TPU chips too (interpret mode: slow, meaningless times)")
    args = parser.parse_args()

    on_chips = pallas.use_by_default()
    print(f"tpu device backed by: {torch.tpu.get_device_name()}; torch threads: {torch.get_num_threads()}")
    print(f"SDPA, batch {args.batch}, {args.heads} heads, seq {args.seq}, head_dim {args.head_dim}, {args.dtype}; "
          f"ms: median of {args.repeats}; ratios: torch cpu ms / variant ms (above 1 = faster)")
    if not on_chips:
        print("No TPU chips: the Pallas kernels run in TPU interpret mode, "
              + ("timed anyway (--pallas), but its times are meaningless off chips" if args.pallas
                 else "left out (--pallas runs it; its times are meaningless off chips)"))
    print()
    cases = (False,) if args.documents else {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    agreed = [compare(args, causal, with_pallas=on_chips or args.pallas) for causal in cases]
    print(f"graph mode: {torch.tpu.compile_stats()}")
    if not all(agreed):
        raise SystemExit(f"some variant disagrees with torch CPU by more than {TOLERANCE[args.dtype]:g}")


if __name__ == "__main__":
    main()
