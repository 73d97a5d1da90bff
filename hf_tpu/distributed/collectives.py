"""The collectives as JAX programs over a group's mesh: axis ``ranks`` (one entry per process), then the axes of
the chips each process's array is on (none for an array on one chip; a process x local chip mesh for an array
sharded over several of a process's chips, ``hf_tpu.distribute``).

Each process passes its own local array; :func:`run` makes it its block of a global array and
runs one jitted ``shard_map`` program in which the body sees this rank's block (on each of its chips, the block
of that chip's shard: chip k of every process holds the same part, so the ranks' parts meet chip by chip).
Every rank gets back its own result, on its own chips and split over them as its input was. On TPUs the
collective runs over ICI; on CPU hosts over JAX's gloo CPU collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "ranks"

Axis = str | tuple[str, ...]
"""The mesh axis a collective runs over, or several (their ranks in row-major order): a group's ranks. Eager
collectives run over their group's own mesh, axis :data:`AXIS`; a compiled graph over several groups runs on one
mesh where each group is some of its axes (hf_tpu/compile/graph_collectives.py)."""


def _gathered_reduce(x: Any, op: str, axis: Axis) -> Any:
    """``x`` reduced over the ranks by ``op``, every rank's value first gathered (for ops psum cannot do)."""
    every = lax.all_gather(x, axis)
    if op == "product":
        return jnp.prod(every, axis=0, dtype=x.dtype)
    if op in _BITWISE:
        return functools.reduce(_BITWISE[op], list(every))
    return (jnp.max if op == "max" else jnp.min)(every, axis=0)


_BITWISE = {"band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}


def all_reduce(x: Any, op: str, axis: Axis = AXIS) -> Any:
    """``x`` reduced over the ranks by ``op``: sum, avg, max, min, product, band, bor or bxor."""
    if op == "sum":
        return lax.psum(x, axis)
    if op == "avg":
        return lax.psum(x, axis) / jnp.asarray(lax.axis_size(axis), x.dtype)
    if op in ("max", "min") and x.dtype != jnp.bool_:
        return (lax.pmax if op == "max" else lax.pmin)(x, axis)
    return _gathered_reduce(x, op, axis)


def _from_root(x: Any, root: int, axis: Axis) -> Any:
    """Zeros on every rank but ``root``: summed over the ranks, the root's values exactly (x + 0 == x)."""
    return jnp.where(lax.axis_index(axis) == root, x, jnp.zeros_like(x))


def all_gather(x: Any, axis: Axis = AXIS) -> Any:
    """(ranks, *x.shape): every rank's ``x``, in group rank order."""
    return lax.all_gather(x, axis)


def reduce_scatter(x: Any, op: str, axis: Axis = AXIS) -> Any:
    """``x`` of (ranks * k, ...) reduced over the ranks; this rank's k rows of it."""
    if op in ("sum", "avg"):
        total = lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
        return total if op == "sum" else total / jnp.asarray(lax.axis_size(axis), x.dtype)
    rows = x.shape[0] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(_gathered_reduce(x, op, axis), lax.axis_index(axis) * rows, rows)


def broadcast(x: Any, root: int, axis: Axis = AXIS) -> Any:
    wide = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    return lax.psum(_from_root(wide, root, axis), axis).astype(x.dtype)


def scatter(x: Any, root: int, axis: Axis = AXIS) -> Any:
    """``x`` of (ranks * k, ...), meaningful on ``root`` only; this rank's k rows of the root's ``x``."""
    wide = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    return lax.psum_scatter(_from_root(wide, root, axis), axis, scatter_dimension=0, tiled=True).astype(x.dtype)


def all_to_all(x: Any, axis: Axis = AXIS) -> Any:
    """``x`` of (ranks * k, ...): block j goes to rank j; the result's block i came from rank i."""
    return lax.all_to_all(x, axis, split_axis=0, concat_axis=0, tiled=True)


def pad_blocks(x: Any, sizes: list[int], width: int) -> Any:
    """``x``'s consecutive blocks of ``sizes`` rows, each padded with zero rows to ``width``, one after another."""
    starts = np.cumsum([0, *sizes[:-1]])
    padding = [(0, 0)] * (x.ndim - 1)
    return jnp.concatenate([jnp.pad(x[start:start + size], [(0, width - size), *padding])
                            for start, size in zip(starts, sizes)])


def unpad_blocks(x: Any, sizes: list[int], width: int) -> Any:
    """The inverse of :func:`pad_blocks`: block i's first ``sizes[i]`` rows, one after another."""
    return jnp.concatenate([x[i * width:i * width + size] for i, size in enumerate(sizes)])


KINDS: dict[str, Callable[..., Any]] = {
    fn.__name__: fn for fn in (all_reduce, all_gather, reduce_scatter, broadcast, scatter, all_to_all)
}


ROW_KINDS = frozenset({"reduce_scatter", "scatter", "all_to_all"})
"""The collectives that split or exchange dim 0 of their input: it must be whole on each chip."""


@functools.cache
def _program(kind: str, mesh: Mesh, spec: PartitionSpec, static: Any) -> Callable[[Any], Any]:
    body = KINDS[kind]
    blocks = PartitionSpec(AXIS, *spec)
    gathered = PartitionSpec(AXIS, None, *spec)  # all_gather's (ranks, *x) per rank

    def per_rank(block: Any) -> Any:
        args = () if static is None else (static,)
        return body(block[0], *args)[None]

    out_specs = gathered if kind == "all_gather" else blocks
    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=blocks, out_specs=out_specs))


def chip_mesh(sharding: jax.sharding.Sharding) -> Mesh:
    """The mesh of this process's chips an array of ``sharding`` is on: its own, or (a one-chip array, a layout of
    XLA's own) its chips as one axis ``chips``."""
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    return Mesh(np.array(sharding._device_assignment), ("chips",))


def local_layout(local: Any, kind: str) -> tuple[Any, Mesh, PartitionSpec]:
    """``local``, the mesh of this process's chips it is on and how it is split over them (one chip: a one-chip
    mesh, whole). Dim 0 is made whole on each chip for the collectives that split or exchange it; a layout of
    XLA's own that is not a mesh's is made a whole copy per chip."""
    sharding, chips = local.sharding, chip_mesh(local.sharding)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    if not isinstance(sharding, NamedSharding) and not sharding.is_fully_replicated:
        local = jax.device_put(local, NamedSharding(chips, spec))
    if kind in ROW_KINDS and spec and spec[0] is not None:
        spec = PartitionSpec(None, *spec[1:])
        local = jax.device_put(local, NamedSharding(chips, spec))
    return local, chips, spec


def run(kind: str, group_mesh: Callable[[Mesh], Mesh], local: Any, static: Any = None) -> Any:
    """Runs collective ``kind`` (a name in :data:`KINDS`) with this process's ``local`` array and ``static`` (the op
    name or root rank, or None). ``group_mesh`` gives, for the mesh of this process's chips ``local`` is on
    (:func:`local_layout`), the group's mesh: axis :data:`AXIS` over its processes, then those chips' axes. Returns
    this rank's result array, on ``local``'s chips, split over them as ``local`` is."""
    local, chips, spec = local_layout(local, kind)
    mesh = group_mesh(chips)
    blocks = [jnp.expand_dims(shard.data, 0) for shard in local.addressable_shards]
    whole = jax.make_array_from_single_device_arrays(
        (mesh.devices.shape[0], *local.shape), NamedSharding(mesh, PartitionSpec(AXIS, *spec)), blocks)
    result = _program(kind, mesh, spec, static)(whole)
    if chips.devices.size == 1:
        return result.addressable_shards[0].data[0]
    mine = NamedSharding(chips, PartitionSpec(*result.sharding.spec[1:]))
    return jax.make_array_from_single_device_arrays(result.shape[1:], mine,
                                                    [shard.data[0] for shard in result.addressable_shards])
