"""Sharded tpu tensors: one process driving several chips, as JAX programs do.

A sharded tensor is an ordinary tpu tensor whose storage's JAX array carries a
``jax.sharding.NamedSharding`` over a mesh of local chips; its ``device`` is the mesh's first chip. Every
operator works on it unchanged, eager and under ``torch.compile(backend="tpu")``: the programs are jitted,
so XLA's SPMD partitioner propagates the shardings and inserts the collectives (a matmul with a
row-sharded weight ends in an all-reduce). What to expect::

    w = hf_tpu.distribute(torch.randn(8, 4), spec=("chips", None))   # rows split over all chips
    hf_tpu.placement(w)           # (device(type='tpu', index=0), ..., device(type='tpu', index=3))
    y = x @ w                     # x on tpu:0 (one chip of the mesh): put replicated on the mesh for the op
    y.cpu()                       # gathers the whole tensor

- A tensor on one chip of the mesh can be mixed with a sharded one: for that op it is copied, replicated,
  onto the mesh (distribute it once instead of paying the copy per op). A tensor on a chip outside the mesh,
  or sharded over another mesh, is the usual "Expected all tensors to be on the same device" error. Under
  ``torch.compile`` only the mesh's first chip can be mixed in: Dynamo sees the sharded tensor's ``device``.
- Results of ops are sharded as XLA chooses (usually like their inputs). Views share their base's storage
  and so its sharding. ``clone`` and the contiguous ``empty_like``/``zeros_like``/``randn_like`` ... of a
  sharded tensor are sharded alike. In-place writes (``add_``, ``copy_``, ``index_put_``) keep the written
  tensor's placement: a storage keeps, for its life, the chips (and sharding) of its first contents.
- ``.cpu()``, ``state_dict()`` + safetensors / ``save_pretrained`` see whole tensors (gathered to the host).
  ``.to("tpu:k")`` for another chip ``k`` gathers onto that chip; ``.to`` the tensor's own ``device`` is a
  no-op, as torch defines it, so ``distribute(t, ["tpu:0"])`` is how to gather onto the first chip.
- ``torch.tpu.memory_allocated(k)`` counts the bytes of chip ``k``'s shard (a replicated tensor: a whole
  copy on each chip); ``torch.tpu.synchronize(k)`` waits for the sharded programs too.
- Data parallel on the same mesh: :func:`split_batch` splits a batch's first dim over a mesh axis ("dp"),
  beside weights sharded over the others; :func:`view_spec` says how a view itself is split.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, Sequence, Union

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .backend import dtypes, runtime, storage
from .backend.devices import device_count, index_of

Devices = Union[Sequence[Union[torch.device, str, int]], Mesh, None]
Spec = Union[PartitionSpec, Sequence[Union[str, Sequence[str], None]], None]
Batch = Union[torch.Tensor, Mapping, list, tuple]


def mesh(devices: Sequence[torch.device | str | int] | None = None, shape: Sequence[int] | None = None,
         axis_names: Sequence[str] = ("chips",)) -> Mesh:
    """A ``jax.sharding.Mesh`` of tpu chips (default: all of them, in index order) of ``shape`` (default:
    one axis), whose axes are named ``axis_names``."""
    indices = range(device_count()) if devices is None else [index_of(d) for d in devices]
    indices = list(indices)
    if not indices:
        raise ValueError("a mesh needs at least one tpu device; pass e.g. devices=['tpu:0', 'tpu:1']")
    if len(set(indices)) != len(indices):
        raise ValueError(f"a mesh names each chip once, but got tpu:{indices}: remove the repeated chips")
    shape = (len(indices),) if shape is None else tuple(shape)
    if math.prod(shape) != len(indices):
        raise ValueError(f"a mesh of shape {shape} has {math.prod(shape)} chips, but {len(indices)} were given: "
                         "pass a shape whose product is the number of chips")
    if len(tuple(axis_names)) != len(shape):
        raise ValueError(f"a mesh of shape {shape} needs {len(shape)} axis names, got {tuple(axis_names)}")
    chips = np.array([runtime.device(index) for index in indices], dtype=object).reshape(shape)
    return Mesh(chips, tuple(axis_names))


def distribute(tensor: torch.Tensor, devices: Devices = None, spec: Spec = None) -> torch.Tensor:
    """A new tpu tensor with ``tensor``'s values (a tpu or CPU tensor), sharded over ``devices``.

    ``devices``: a ``jax.sharding.Mesh`` of tpu chips (see :func:`mesh`), or tpu devices for a one-axis mesh
    named ``"chips"`` (default: all chips). ``spec``: a ``PartitionSpec``, or per dim of ``tensor`` the mesh
    axis (or tuple of axes) that dim is split over, ``None`` for a whole dim; missing trailing dims and
    ``spec=None`` are whole (replicated on every chip). A one-chip mesh gives an ordinary one-chip tensor.
    A CPU tensor goes from the host straight to its shards: no chip ever holds it whole.

    The result is a new leaf (not connected to ``tensor``'s autograd graph) that requires grad if
    ``tensor`` does; to shard a parameter in place, assign it: ``param.data = distribute(param.data, ...)``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute takes a torch.Tensor, not {type(tensor).__name__}")
    first, sharding = _placed(tuple(tensor.shape), devices, spec)
    source = tensor.detach()
    from_host = source.device.type == "cpu"
    if from_host:  # the host array straight onto its shards: no whole copy on any chip
        from .backend.ops.memory import to_device

        array = to_device(source, tensor.dtype, sharding)
    else:
        if source.device.type != "tpu":
            source = source.to(torch.device("tpu", first))
        array = jax.device_put(storage.read(source), sharding)
    result = storage.wrap(array, tensor.dtype, first, transfer=from_host)
    return result.requires_grad_(tensor.requires_grad)


def zeros(shape: Sequence[int], dtype: torch.dtype, devices: Devices = None, spec: Spec = None) -> torch.Tensor:
    """A new tpu tensor of zeros sharded over ``devices`` as ``spec`` says (see :func:`distribute`), made on its
    shards: each chip allocates only its own part, none ever holds it whole."""
    first, sharding = _placed(tuple(shape), devices, spec)
    array = _zeros_program(tuple(shape), dtypes.to_jax(dtype), sharding)()
    return storage.wrap(array, dtype, first)


def _placed(shape: tuple[int, ...], devices: Devices, spec: Spec) -> tuple[int, jax.sharding.Sharding]:
    """The first chip and the sharding of a tensor of ``shape`` split over ``devices`` as ``spec`` says (a
    one-chip mesh: that chip alone); refuses devices that are not chips and dims that do not split evenly."""
    grid = devices if isinstance(devices, Mesh) else mesh(devices)
    partition = _partition_spec(spec, grid)
    _check_divisible(shape, partition, grid)
    first = [storage.chip_index(device) for device in grid.devices.flat][0]
    if grid.devices.size == 1:
        return first, jax.sharding.SingleDeviceSharding(grid.devices.flat[0])
    return first, NamedSharding(grid, partition)


@functools.lru_cache(maxsize=64)
def _zeros_program(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> Any:
    return jax.jit(functools.partial(jax.numpy.zeros, shape, dtype), out_shardings=sharding)


def placement(tensor: torch.Tensor) -> tuple[torch.device, ...]:
    """The devices a tensor's elements live on: each chip of a sharded tpu tensor's mesh, in mesh order (the
    first is its ``device``); a one-chip tensor's chip; a tensor elsewhere: its ``device``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"placement takes a torch.Tensor, not {type(tensor).__name__}")
    if tensor.device.type != "tpu":
        return (tensor.device,)
    return tuple(torch.device("tpu", chip) for chip in storage.placement(storage.buffer_of(tensor)))


def sharding_of(tensor: torch.Tensor) -> jax.sharding.Sharding | None:
    """The sharding of a sharded tpu tensor's storage array (a view shares its base's, whose shape may differ:
    :func:`view_spec` says how the view itself is split), ``None`` for a tensor on one chip."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "tpu":
        where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"sharding_of takes a tpu tensor, not one on {where}")
    return storage.buffer_of(tensor).sharding


def view_spec(tensor: torch.Tensor) -> PartitionSpec | None:
    """How a sharded tpu tensor is split, per dim of the tensor itself (for a view: its own dims, not its
    storage's). Views that reorder their whole storage's dims or split a dim in several (``view``,
    ``transpose``, ``permute``, ``unflatten``) are followed: a split dim's entry goes to its outermost part.
    ``None`` for a one-chip tensor, and where the tensor is not such a view (a slice, merged dims, a dtype
    view, a split that does not fall on shard boundaries) or the storage's sharding is not a ``NamedSharding``."""
    buffer = storage.buffer_of(tensor)
    sharding, array = buffer.sharding, buffer.array
    if (not isinstance(sharding, NamedSharding) or array is None or tensor.storage_offset()
            or tensor.dtype != buffer.dtype or tensor.numel() != array.size):
        return None
    entries = tuple(sharding.spec) + (None,) * (array.ndim - len(sharding.spec))
    storage_dims, stride = [], 1  # (contiguous stride, size, entry) of each storage dim
    for size, entry in reversed(tuple(zip(array.shape, entries))):
        storage_dims.append((stride, size, entry))
        stride *= size
    parts_of: dict[int, list[tuple[int, int, int]]] = {}  # storage dim -> (stride, dim, size) of the dims in it
    for dim, (size, step) in enumerate(zip(tensor.shape, tensor.stride())):
        if size > 1:
            owner = next((index for index, (base, length, _) in enumerate(storage_dims)
                          if base <= step < base * length and step % base == 0), None)
            if owner is None:
                return None
            parts_of.setdefault(owner, []).append((step, dim, size))
    spec: list = [None] * tensor.dim()
    for owner, parts in parts_of.items():
        base, length, entry = storage_dims[owner]
        covered = base
        for step, _, size in sorted(parts):
            if step != covered:
                return None
            covered *= size
        if covered != base * length:
            return None
        if entry is not None:
            _, outermost, size = max(parts)
            if size % _parts(entry, sharding.mesh):
                return None
            spec[outermost] = entry
    return PartitionSpec(*spec)


def split_batch(batch: Batch, mesh: Mesh, axis: str = "dp") -> Batch:
    """``batch`` with each tensor's first dim split over the mesh axis ``axis`` and whole along the mesh's
    other axes: data parallel over ``axis`` for a model whose weights are sharded over the others (the SPMD
    partitioner sums the gradients over ``axis``). ``batch``: a tensor, or a dict, list or tuple of them (as
    a DataLoader gives); other values in it are returned as they are."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("split_batch splits the first dim of each tensor, but got a 0-dim tensor: pass it "
                             "on its own, or hf_tpu.distribute(tensor, mesh) to replicate it")
        return distribute(batch, mesh, (axis,))
    if isinstance(batch, Mapping):  # dict, transformers' BatchEncoding
        return type(batch)({key: split_batch(value, mesh, axis) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(split_batch(value, mesh, axis) for value in batch)
    return batch


def _partition_spec(spec: Spec, grid: Mesh) -> PartitionSpec:
    if spec is None:
        return PartitionSpec()
    if isinstance(spec, str):
        raise TypeError(f"spec={spec!r}: give one entry per dim, e.g. spec=({spec!r}, None) to split dim 0")
    entries = tuple(spec)
    used = [axis for entry in entries if entry is not None for axis in ((entry,) if isinstance(entry, str) else entry)]
    unknown = [axis for axis in used if axis not in grid.axis_names]
    if unknown:
        raise ValueError(f"spec {entries} names mesh axes {unknown} that the mesh does not have; its axes are "
                         f"{tuple(grid.axis_names)}")
    if len(set(used)) != len(used):
        raise ValueError(f"spec {entries} splits over a mesh axis twice: each axis can split one dim")
    return PartitionSpec(*entries)


def _check_divisible(shape: tuple[int, ...], partition: PartitionSpec, grid: Mesh) -> None:
    if len(partition) > len(shape):
        raise ValueError(f"spec {tuple(partition)} has {len(partition)} entries but the tensor has {len(shape)} "
                         "dims: give at most one entry per dim")
    for dim, entry in enumerate(partition):
        axes = _axes(entry)
        parts = _parts(entry, grid)
        if shape[dim] % parts:
            raise ValueError(f"dim {dim} of size {shape[dim]} cannot be split evenly over {parts} chips (mesh axes "
                             f"{axes}): split a dim whose size is a multiple of {parts}, or use fewer chips")


def _axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _parts(entry: str | Sequence[str] | None, grid: Mesh) -> int:
    """How many pieces a dim whose spec entry is ``entry`` is cut into."""
    return math.prod(grid.shape[axis] for axis in _axes(entry))
