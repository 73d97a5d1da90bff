"""The op table: ATen overloads -> JAX lowerings -> PrivateUse1 kernels.

A lowering is a plain function from JAX arrays (and static Python values) to JAX arrays, written
with the same parameter list as the ATen schema::

    @lowering("add.Tensor", "add_.Tensor", "add.out")
    def add(self, other, alpha=1):
        ...

One lowering serves the functional overload, its in-place twin and its ``out=`` form: the kernel
built from the schema reads tensor arguments from device storage, calls the lowering under a
``jax.jit`` cached per static arguments (JAX caches per shape and dtype), and then either wraps the
results in new tpu tensors or writes them into the mutated arguments (``self`` of ``add_``, ``out``).
Tensor and Scalar arguments are traced; every other argument (dims, dtypes, flags) is static.
Lowerings are plain JAX functions so that graph mode can lower whole FX graphs with this same table.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import torch
from torch.utils._pytree import tree_map

from . import allocator, checks, devices, dtypes, fused, runtime, storage, tpu_lowering
from . import forks
from .out_of_memory import raise_if_out_of_memory

_TENSOR, _OPT_TENSOR, _TENSOR_LIST, _SCALAR, _STATIC = range(5)
_REQUIRED = object()


@dataclass
class Lowering:
    fn: Callable[..., Any]
    static: frozenset[str] = frozenset()
    writes_overlapping: bool = False
    sees_layout: bool = False
    calls_kernels: bool = False
    specialized: dict[str, frozenset] = field(default_factory=dict)
    positions: frozenset[str] = frozenset()


LOWERINGS: dict[str, Lowering] = {}
CUSTOM_KERNELS: dict[str, Callable[..., Any]] = {}


def lowering(
    *names: str, static: tuple[str, ...] = (), writes_overlapping: bool = False, sees_layout: bool = False,
    calls_kernels: bool = False, specialized: dict[str, tuple] | None = None, positions: tuple[str, ...] = (),
) -> Callable[[Callable], Callable]:
    """Registers a JAX lowering for ATen overloads (``"add.Tensor"``; namespace ``aten`` unless given).

    ``static`` names Scalar parameters whose value must be known at trace time (e.g. ``arange``'s
    bounds, which decide the output shape). ``writes_overlapping`` lets the in-place form write
    through views whose elements share memory (``expand``), as CPU allows for ``fill_``/``zero_``.
    ``sees_layout`` passes the lowering a keyword ``contiguous``: for each tensor parameter, in schema
    order, whether it is contiguous (``None`` for an absent optional). For ops whose ATen kernel picks
    its algorithm by layout and whose backward formula relies on that choice (``linalg.det`` factors
    ``A^T`` when ``A`` is contiguous, and its backward solves with the factors accordingly).
    ``calls_kernels``: the lowering may call a Pallas kernel (:func:`~hf_tpu.backend.runtime.pallas_kernels`),
    so its programs wait for their results where the kernel is interpreted (:func:`runtime.waiting`).
    ``specialized`` maps Scalar parameters to values that, given as Python numbers, reach the lowering as
    themselves (a program each) rather than traced: ``pow(x, 2)`` computes ``x * x``, as torch's CPU kernel does,
    where a traced exponent costs XLA's general power function; other values stay traced (one program for all).
    ``positions`` names integer (list) parameters that are traced like Scalars rather than static: ``roll``'s
    shifts, so that a new shift reuses the program.
    """

    def register(fn: Callable) -> Callable:
        special = {name: frozenset(values) for name, values in (specialized or {}).items()}
        entry = Lowering(fn, frozenset(static), writes_overlapping, sees_layout, calls_kernels, special,
                         frozenset(positions))
        for name in names:
            _check_unregistered(LOWERINGS, name, fn)
            LOWERINGS[name] = entry
        return fn

    return register


def _check_unregistered(table: dict, name: str, fn: Callable) -> None:
    """Two modules registering one overload would leave it to import order which one serves it."""
    if name in table:
        previous = getattr(table[name], "fn", table[name])
        first, second = (f"{f.__module__}.{f.__qualname__}" for f in (previous, fn))
        raise ValueError(f"{name} is registered twice: {first} and {second}")


def kernel(*names: str) -> Callable[[Callable], Callable]:
    """Registers a hand-written PrivateUse1 kernel (torch tensors in, torch tensors out)."""

    def register(fn: Callable) -> Callable:
        for name in names:
            _check_unregistered(CUSTOM_KERNELS, name, fn)
            CUSTOM_KERNELS[name] = fn
        return fn

    return register


def resolve(name: str) -> torch._ops.OpOverload:
    namespace, _, rest = name.rpartition("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace or "aten"), packet), overload or "default")


def _kind(argument: torch._C.Argument, static: frozenset[str], positions: frozenset[str]) -> int:
    text = str(argument.type)
    if argument.name in static:
        return _STATIC
    if argument.name in positions:
        return _SCALAR
    if text == "Tensor":
        return _TENSOR
    if text == "Optional[Tensor]":
        return _OPT_TENSOR
    if text in ("List[Tensor]", "List[Optional[Tensor]]"):
        return _TENSOR_LIST
    if text in ("number", "Optional[number]", "List[number]"):
        return _SCALAR
    return _STATIC


def schema_default(argument: torch._C.Argument) -> Any:
    """An argument's default as a lowering sees it (ScalarType codes as dtypes); a sentinel if required."""
    if not argument.has_default_value():
        return _REQUIRED
    value = argument.default_value
    if isinstance(value, int) and "ScalarType" in str(argument.type):
        return dtypes.from_scalar_type_code(value)
    return value


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def device_mismatch(first: Any, second: Any) -> RuntimeError:
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{first} and {second}!"
    )


def _where(chips: tuple[int, ...]) -> str:
    """A tensor's device, and the chips it is spread over if it is sharded."""
    if len(chips) == 1:
        return f"tpu:{chips[0]}"
    return f"tpu:{chips[0]} (sharded over {', '.join(f'tpu:{chip}' for chip in chips)})"


def on_one_mesh(arrays: list[Any], chips: list[int]) -> tuple[list[Any], int] | None:
    """Arrays one program may take together: with the chip each came from, if some are spread over a mesh, the
    others (on one chip of that mesh) are put replicated on it, and the result's device is the mesh's first
    chip; ``None`` when none is spread. An array on a chip outside the mesh, or on another mesh, is the usual
    mixed-device error, as is a mix of one-chip arrays on different chips."""
    spread = [array.sharding for array in arrays if storage.is_spread(array)]
    if not spread:
        if any(chip != chips[0] for chip in chips):
            raise device_mismatch(f"tpu:{chips[0]}", f"tpu:{next(chip for chip in chips if chip != chips[0])}")
        return None
    mesh_chips = storage.chips(spread[0])
    for other in spread[1:]:
        if other._device_assignment != spread[0]._device_assignment:
            raise device_mismatch(_where(mesh_chips), _where(storage.chips(other)))
    replicated = storage.replicated(spread[0])
    placed = []
    for array, chip in zip(arrays, chips):
        if not storage.is_spread(array):
            if chip not in mesh_chips:
                raise device_mismatch(_where(mesh_chips), f"tpu:{chip}")
            array = jax.device_put(array, replicated)
        placed.append(array)
    return placed, mesh_chips[0]


def defer_check(check: Any, device_index: int) -> None:
    """:func:`checks.defer` for a program's check, which a program on a mesh returns on each of its chips:
    pending checks are merged per chip, so it is gathered onto the first."""
    if storage.is_spread(check):
        check = jax.device_put(check, runtime.device(device_index))
    checks.defer(check, device_index)


class _Inputs:
    """Reads tensor arguments for one op call, checking that they share one tpu device, or one mesh of chips
    (see :func:`on_one_mesh`).

    A tensor that is a view (not its whole storage, contiguous) contributes its storage's array,
    and its geometry is recorded in ``views`` under its position: the view is then taken inside the
    op's own jitted program, so a transposed weight costs no extra dispatch. A view's storage offset
    that moves (see :func:`storage.view_geometry`) is in ``offsets``, the program's last arguments.
    """

    __slots__ = ("device_index", "views", "offsets", "numbers", "read_from", "mixed", "recording")

    def __init__(self, recording: bool) -> None:
        self.recording = recording  # fused eager mode will record the op: pending values may be read
        self.device_index = None
        self.views: list[tuple[tuple[int, int], tuple]] = []
        self.offsets: list[int] = []
        self.numbers: list[int] = []  # slots holding a Python float or complex (the 2.5 of `x * 2.5`)
        self.read_from: list[tuple[tuple[int, int], int, Any]] = []  # (position, chip, array) per tensor read
        self.mixed = False  # another chip or a sharded array among the inputs: see place()

    def read(self, tensor: torch.Tensor, position: tuple[int, int]) -> Any:
        try:
            buffer = storage.buffer_of(tensor)
        except AttributeError:
            if isinstance(tensor, (float, complex)) and position[1] < 0:
                self.numbers.append(position[0])
            return self._foreign(tensor)
        array = buffer.array
        if array is None:
            array = buffer.current() if self.recording else buffer.materialize()
        chip = buffer.device_index
        if self.device_index is None:
            self.device_index = chip
        elif chip != self.device_index:
            self.mixed = True
        if type(array.sharding) is not storage.ONE_CHIP:
            self.mixed = True
        self.read_from.append((position, chip, array))
        if not storage.holds_whole(tensor, buffer, array):
            _add_view(tensor, buffer, position, self.views, self.offsets)
        return array

    def place(self, dynamic: list) -> None:
        """When the inputs are not all on one chip: puts them on one mesh (:func:`on_one_mesh`) in ``dynamic``."""
        arrays = [fused.concrete(array) for _, _, array in self.read_from]  # only one-chip chains are recorded
        together = on_one_mesh(arrays, [chip for _, chip, _ in self.read_from])
        if together is not None:
            arrays, self.device_index = together
        for ((slot, item), _, old), new in zip(self.read_from, arrays):
            if new is old:
                continue
            if item < 0:
                dynamic[slot] = new
            else:
                items = list(dynamic[slot])
                items[item] = new
                dynamic[slot] = tuple(items)

    def _foreign(self, tensor: torch.Tensor) -> Any:
        if not isinstance(tensor, torch.Tensor):  # a wrapped Python number, e.g. the 2 in `x + 2`
            return tensor
        # Like CUDA, a zero-dim CPU tensor may join a device op as a scalar operand.
        if tensor.device.type == "cpu" and tensor.dim() == 0:
            host = tensor.detach().resolve_conj().resolve_neg()
            bits = host.view(torch.int16) if host.dtype == torch.bfloat16 else host
            return bits.numpy().view(dtypes.host_numpy_dtype(host.dtype))
        raise device_mismatch(f"tpu:{self.device_index or 0}", tensor.device)

    def read_list(self, tensors: list, slot: int) -> tuple:
        return tuple(None if t is None else self.read(t, (slot, i)) for i, t in enumerate(tensors))


def _add_view(tensor: torch.Tensor, buffer: storage.Buffer, position: tuple[int, int], views: list,
              offsets: list) -> None:
    geometry = storage.view_geometry(tensor, buffer)
    views.append((position, geometry))
    if geometry[4] is storage.MOVING:
        offsets.append(tensor.storage_offset())


def _apply_views(values: tuple, views: tuple, offsets: tuple) -> list:
    """Inside the jitted program: replaces storage arrays by the views the op was called with (those at a moving
    storage offset at ``offsets``, in order)."""
    values, moving = list(values), iter(offsets)
    for (slot, item), geometry in views:
        offset = next(moving) if geometry[4] is storage.MOVING else None
        if item < 0:
            values[slot] = storage.view_of(values[slot], geometry, offset)
        else:
            items = list(values[slot])
            items[item] = storage.view_of(items[item], geometry, offset)
            values[slot] = tuple(items)
    return values


def check_cast(value: Any, destination: torch.Tensor) -> None:
    result = dtypes.to_torch(value.dtype)
    if result != destination.dtype and not torch.can_cast(result, destination.dtype):
        raise RuntimeError(
            f"result type {dtypes.type_name(result)} can't be cast to the desired output type "
            f"{dtypes.type_name(destination.dtype)}"
        )


def resize_output(out: torch.Tensor, shape: tuple) -> None:
    if tuple(out.shape) != tuple(shape):
        if out.numel():
            warnings.warn(
                f"An output with one or more elements was resized since it had shape {list(out.shape)}, which does not "
                f"match the required output shape {list(shape)}. This behavior is deprecated.",
                UserWarning,
            )
        out.resize_(shape)


def check_no_internal_overlap(destination: torch.Tensor) -> None:
    if 0 in destination.stride() and torch._debug_has_internal_overlap(destination) == 1:
        raise RuntimeError(
            "unsupported operation: more than one element of the written-to tensor refers to a single "
            "memory location. Please clone() the tensor before performing the operation."
        )


def _store(destination: torch.Tensor, value: Any, is_out: bool, overlap_ok: bool) -> None:
    if not overlap_ok:
        check_no_internal_overlap(destination)
    check_cast(value, destination)
    if is_out:
        resize_output(destination, value.shape)
    storage.write(destination, value)


def _is_default(value: Any, default: Any) -> bool:
    """Whether a Scalar argument is its schema default (then static: no per-call transfer)."""
    return value is default or (type(value) is type(default) and value == default)


def fixed_scalar(value: Any, default: Any, special: frozenset) -> bool | tuple:
    """How a Scalar argument reaches its lowering: ``True`` at its schema default, ``(type, value)`` at one of the
    values the lowering specializes (both fixed at trace time), ``False`` traced (see :func:`lowering`)."""
    if _is_default(value, default):
        return True
    if special and (value.__class__ is int or value.__class__ is float) and value in special:
        return value.__class__, value  # the type too: x ** 2 and x ** 2.0 differ for an integer x
    return False


def _program_key(static_values: tuple, fixed: tuple, views: tuple, order: tuple | None,
                 contiguity: tuple) -> tuple:
    """What a kernel's jitted program depends on beyond its inputs' shapes and dtypes (``compile_for``'s key)."""
    return (
        static_values,
        tuple(map(type, static_values)) if static_values else (),  # arange(4) and arange(4.0) differ
        fixed,
        views,
        torch.get_default_dtype(),  # type promotion of Python floats depends on it
        order,
        checks.MODE,
        contiguity,
    )


_scalar_arrays: dict[tuple, Any] = {}


def _scalar_array(value: Any, wide: bool) -> Any:
    """A cached, weakly-typed device scalar: jit calls with arrays skip a host transfer per call."""
    key = (type(value), value, wide)
    array = _scalar_arrays.get(key)
    if array is None:
        if len(_scalar_arrays) > 4096:
            _scalar_arrays.clear()
        array = _scalar_arrays[key] = dtypes.scalar_operand(value, wide)
    return array


def cpu_copies(args: tuple, kwargs: dict) -> tuple[Any, Any, list[torch.device]]:
    """``args`` and ``kwargs`` with each tpu tensor (in lists too) replaced by a CPU copy, and the devices of those
    tensors."""
    devices = []

    def to_cpu(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "tpu":
            devices.append(value.device)
            return value.cpu()
        return value

    return tree_map(to_cpu, args), tree_map(to_cpu, kwargs), devices


def _refuse_as_cpu_does(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """Raises CPU's error if the op, run on CPU copies of its arguments, refuses a Scalar it cannot convert to
    the type it computes in ("value cannot be converted to type int8_t without overflow": ``fill_(300)`` on
    int8, ``clamp(max=100000)`` on int16); XLA would wrap the number around or round it to infinity. Whether an op
    converts its Scalar so (``fill_``, ``masked_fill``, ``clamp``, ``alpha``) or wraps it into a tensor first
    (``eq(x, 300)``, ``add(x, 300)``) is the CPU kernel's choice, so only a run of it tells; this is done only for
    a number that overflows an input's dtype. Any other error of the CPU run is left to the op itself."""
    args, kwargs, _ = cpu_copies(args, kwargs)
    if "device" in kwargs:  # a factory's (kwarg-only in every ATen schema)
        kwargs["device"] = "cpu"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            op(*args, **kwargs)
    except RuntimeError as error:
        if "cannot be converted" in str(error):
            raise RuntimeError(str(error)) from None
    except Exception:  # noqa: BLE001 (another complaint of CPU's kernel: the op decides for itself)
        pass


def _read_plainly(tensor: Any, position: tuple[int, int], views: list, offsets: list, chips: list) -> Any:
    """What fused eager's plain path reads for a tensor argument (see ``record_plainly`` in :func:`build_kernel`): its
    storage's array or pending value, with the view's geometry appended to ``views`` (and a moving storage offset to
    ``offsets``) if it is not the whole of it, and its chip appended to ``chips``; ``None`` for a tensor that is no
    tpu tensor on one chip."""
    try:
        buffer = tensor.untyped_storage()._hf_buffer
    except AttributeError:  # a CPU tensor, a storage torch made again: the general path
        return None
    array = buffer.array
    if array is None:
        array = buffer.current()
    if type(array.sharding) is not storage.ONE_CHIP:
        return None
    if not storage.holds_whole(tensor, buffer, array):
        _add_view(tensor, buffer, position, views, offsets)
    chips.append(buffer.device_index)
    return array


def build_kernel(op: torch._ops.OpOverload, entry: Lowering) -> Callable[..., Any]:
    schema = op._schema
    arguments = list(schema.arguments)
    names = [a.name for a in arguments]
    defaults = [schema_default(a) for a in arguments]
    written = [a.alias_info is not None and a.alias_info.is_write for a in arguments]
    is_out = [w and a.kwarg_only for w, a in zip(written, arguments)]
    inputs = [i for i in range(len(arguments)) if not is_out[i]]
    kinds = [_kind(arguments[i], entry.static, entry.positions) for i in inputs]
    tensor_slots = [
        (slot, inputs[slot], kind) for slot, kind in enumerate(kinds) if kind in (_TENSOR, _OPT_TENSOR, _TENSOR_LIST)
    ]
    scalar_slots = [(slot, inputs[slot], defaults[inputs[slot]], entry.specialized.get(names[inputs[slot]], ()))
                    for slot, kind in enumerate(kinds) if kind == _SCALAR]
    static_slots = [(slot, inputs[slot]) for slot, kind in enumerate(kinds) if kind == _STATIC]
    static_indices = [index for _, index in static_slots]
    destinations = [i for i in range(len(arguments)) if written[i]]
    device_arg = names.index("device") if "device" in names else None
    dtype_arg = names.index("dtype") if "dtype" in names else None

    def wide_scalars(dynamic: list, bound: list) -> bool:
        return dtypes.needs_wide_scalars(dynamic, None if dtype_arg is None else bound[dtype_arg])

    probes_cpu = torch.Tag.nondeterministic_seeded not in op.tags  # a CPU run must not draw from CPU's generator

    def may_overflow(value: int | float, dynamic: list, bound: list) -> bool:
        """Whether a Scalar argument overflows the dtype of a tensor input or of the ``dtype`` argument (or the
        default dtype it stands for), one of which the op computes in."""
        if not probes_cpu:
            return False
        targets = [item.dtype for operand in dynamic  # arrays (a number in a tensor's place has no dtype)
                   for item in (operand if isinstance(operand, tuple) else (operand,)) if hasattr(item, "dtype")]
        if dtype_arg is not None:
            targets.append(dtypes.to_jax(bound[dtype_arg] or torch.get_default_dtype()))
        return any(dtypes.scalar_overflows(value, target) for target in targets)

    returns = list(schema.returns)
    returns_written = bool(returns) and all(r.alias_info is not None and r.alias_info.is_write for r in returns)
    returns_list = bool(returns) and str(returns[0].type).startswith("List")
    position = {name: i for i, name in enumerate(names)}
    lowering_fn = entry.fn
    overlap_ok = entry.writes_overlapping
    keeps_layout = torch.Tag.pointwise in op.tags and not destinations and len(returns) == 1
    first_tensor = tensor_slots[0][1] if tensor_slots and tensor_slots[0][2] == _TENSOR else None
    n_inputs = len(inputs)
    layout_indices = [index for _, index, kind in tensor_slots if kind != _TENSOR_LIST] if entry.sees_layout else ()
    op_name = op.name()
    # An in-place op's tensors (add_'s self, _foreach_add_'s list, _fused_adamw_'s lists): (dynamic slot, argument)
    # of each, whose arrays the op may donate (see donated_slots).
    in_place = tuple((k, index) for k, (_, index, kind) in enumerate(tensor_slots)
                     if kind in (_TENSOR, _TENSOR_LIST) and index in destinations and not is_out[index])
    every_donor = tuple(k for k, _ in in_place)

    def donated_slots(bound: list, dynamic: list, reader: _Inputs) -> tuple[int, ...]:
        """The in-place tensors (a list: all of its tensors) that are their storages' whole arrays held by nothing
        else: XLA writes the results into their memory, and the update needs the tensors' size once, as on CPU.
        Each other one is a copy, counted (``torch.tpu.memory_stats()["in_place_copies"]``); but a view, written
        into its storage's array afterwards, which :func:`storage.write` donates if it can."""
        slots = []
        for slot, index in in_place:
            is_list = dynamic[slot].__class__ is tuple
            tensors = bound[index] if is_list else (bound[index],)
            arrays = dynamic[slot] if is_list else dynamic  # each array is looked up, not held in a variable here:
            positions = range(len(tensors)) if is_list else (slot,)  # storage.donatable counts who holds it
            # (``records=1``: the reader's record of what it read holds each array once more)
            whole = [storage.is_whole(tensor, storage.buffer_of(tensor)) for tensor in tensors]
            passed = storage.occurrences(arrays)
            if all(whole) and all(storage.donatable(tensor, arrays, position, passed, records=1)
                                  for tensor, position in zip(tensors, positions)):
                slots.append(slot)
                continue
            for _ in range(sum(whole)):
                allocator.copied_in_place(reader.device_index or 0)
        return tuple(slots)

    @functools.lru_cache(maxsize=storage.PROGRAMS_PER_CACHE)
    def compile_for(key: tuple, donated: tuple[int, ...]) -> Callable:
        """One jitted function per combination of static values; Scalars left at their schema
        default or at a value the lowering specializes are static too (no per-call transfer), other Scalars are
        traced (see :func:`fixed_scalar`). ``donated``: the dynamic slots whose arrays XLA may write into."""
        static_values, _, fixed_scalars, views, _, order, _, contiguity = key
        layout = {"contiguous": contiguity} if entry.sees_layout else {}
        dynamic_slots = [slot for slot, _, _ in tensor_slots] + [
            slot for (slot, *_), state in zip(scalar_slots, fixed_scalars) if state is False
        ]
        fixed = [(slot, value) for (slot, _), value in zip(static_slots, static_values)] + [
            (slot, default if state is True else state[1])
            for (slot, _, default, _), state in zip(scalar_slots, fixed_scalars) if state is not False
        ]

        moving = sum(geometry[4] is storage.MOVING for _, geometry in views)

        def traced(*dynamic_values):
            if views:
                offsets = dynamic_values[len(dynamic_values) - moving:]
                dynamic_values = _apply_views(dynamic_values[:len(dynamic_values) - moving], views, offsets)
            call = [None] * n_inputs
            for slot, value in zip(dynamic_slots, dynamic_values):
                call[slot] = value
            for slot, value in fixed:
                call[slot] = value
            with checks.collecting() as collected:
                result = lowering_fn(*call, **layout)
            storage.check_result_sizes(result)
            return (result if order is None else jax.numpy.transpose(result, order)), checks.combined(collected)

        # keep_unused: unused inputs still pin the chip
        program = tpu_lowering.checked(op_name, jax.jit(traced, keep_unused=True, donate_argnums=donated))
        return runtime.waiting_if_interpreted(program) if entry.calls_kernels else program

    # What a recorded call of the common kind needs (see record_plainly): tensor arguments by position (and whether
    # each is a list), and the schema's defaults of the Scalars and of the static arguments past the positional ones.
    plain = (not destinations and len(returns) == 1 and str(returns[0].type) == "Tensor" and not entry.calls_kernels)
    tensor_places = [(index, kind == _TENSOR_LIST) for _, index, kind in tensor_slots]
    scalar_indices = [(index, default, special) for _, index, default, special in scalar_slots]
    all_defaulted = (True,) * len(scalar_slots)

    def record_plainly(args: tuple) -> torch.Tensor | None:
        """Fused eager mode's common call, recorded with less bookkeeping than the general path below, with the
        same program and the same result: positional arguments only, each tensor argument (or list item) a tpu
        tensor on one chip (the same for all; a view is read as the general path reads it, and a pointwise op's
        result keeps its first input's layout as there) or a Python number, Scalars at their defaults or numbers
        the op's dtypes hold, one tensor returned. ``None`` for any other call, which the general path takes."""
        count = len(args)
        arrays, views, offsets, floats, chips = [], [], [], [], []
        for index, is_list in tensor_places:
            value = args[index] if index < count else None
            if value is None:
                arrays.append(None)
            elif is_list:
                items = []
                for item, tensor in enumerate(value):
                    if tensor is None:
                        items.append(None)
                        continue
                    array = _read_plainly(tensor, (len(arrays), item), views, offsets, chips)
                    if array is None:
                        return None
                    items.append(array)
                arrays.append(tuple(items))
            elif value.__class__ is float or value.__class__ is int:  # the 2.5 of `x * 2.5`
                if value.__class__ is float:
                    floats.append(len(arrays))
                arrays.append(value)
            else:
                array = _read_plainly(value, (len(arrays), -1), views, offsets, chips)
                if array is None:
                    return None
                arrays.append(array)
        if not chips:  # factories: the general path places them
            return None
        device_index = chips[0]
        if chips.count(device_index) != len(chips):
            return None
        fixed, given = all_defaulted, []
        for position, (index, default, special) in enumerate(scalar_indices):
            if index < count and (state := fixed_scalar(value := args[index], default, special)) is not True:
                if state is False:
                    if value.__class__ is not int and value.__class__ is not float:
                        return None  # a tensor: the general path reads it
                    given.append(value)
                fixed = (*fixed[:position], state, *fixed[position + 1:])
        if floats or given:  # as the general path passes them: weakly-typed arrays of the op's width
            bound = list(args) + defaults[count:]
            wide = wide_scalars(arrays, bound)
            for slot in floats:
                arrays[slot] = _scalar_array(arrays[slot], wide)
            arrays += [_scalar_array(value, wide) for value in given]
            # A number past the quick test is checked against the dtypes the op computes in (those of all its
            # operands: at least those the general path checks); one that may overflow takes the general path,
            # which raises CPU's error.
            if any(not dtypes.fits_every_dtype(value) and may_overflow(value, arrays, bound) for value in given):
                return None
        static_values = tuple([_frozen(args[index] if index < count else defaults[index])
                               for index in static_indices]) if static_indices else ()
        contiguity = tuple([None if i >= count or args[i] is None else args[i].is_contiguous()
                            for i in layout_indices]) if layout_indices else ()
        order = None
        if views and keeps_layout and first_tensor is not None and first_tensor < count:
            order = _memory_order(list(args) + defaults[count:], first_tensor, tensor_slots)
        result, _ = call(compile_for(_program_key(static_values, fixed, tuple(views), order, contiguity), ()),
                         arrays + offsets, device_index)
        return _wrap(result, device_index) if order is None else _wrap_in_order(result, order, device_index)

    def call(fn: Callable, dynamic: list, recording_on: int | None) -> Any:
        """``fn(*dynamic)``, or recorded on chip ``recording_on``; errors of shapes and dtypes that tracing the
        lowering finds are RuntimeErrors, as torch raises them."""
        try:
            return fn(*dynamic) if recording_on is None else fused.record(fn, dynamic, op_name, recording_on)
        except (TypeError, ValueError) as error:
            raise RuntimeError(f"{op_name}: {error}") from error

    def run(*args, **kwargs):
        if forks.forked:
            raise RuntimeError(forks.FORK_MESSAGE)
        reader = None
        try:
            if plain and fused.ON and not kwargs:
                recorded = record_plainly(args)
                if recorded is not None:
                    return recorded
            reader = _Inputs(fused.ON and (not entry.calls_kernels or fused.records_kernels()))
            bound = list(args) + defaults[len(args):] if len(args) < len(defaults) else list(args)
            for name, value in kwargs.items():
                bound[position[name]] = value
            dynamic = []
            for _, index, kind in tensor_slots:
                value = bound[index]
                if kind == _TENSOR_LIST:
                    dynamic.append(reader.read_list(value, len(dynamic)))
                elif value is None:
                    dynamic.append(None)
                else:
                    dynamic.append(reader.read(value, (len(dynamic), -1)))
            wide = None
            if reader.numbers:  # passed as weakly-typed scalars of the op's width (see dtypes.scalar_operand)
                wide = wide_scalars(dynamic, bound)
                for slot in reader.numbers:
                    dynamic[slot] = _scalar_array(dynamic[slot], wide)
            fixed = [] if scalar_slots else ()
            for _, index, default, special in scalar_slots:
                value = bound[index]
                state = fixed_scalar(value, default, special)
                fixed.append(state)
                if state is False:
                    if isinstance(value, torch.Tensor):
                        value = reader.read(value, (len(dynamic), -1))
                    elif value is not None:
                        if value.__class__ in (int, float) and not dtypes.fits_every_dtype(value) \
                                and may_overflow(value, dynamic, bound):
                            _refuse_as_cpu_does(op, args, kwargs)
                        if wide is None:
                            wide = wide_scalars(dynamic, bound)
                        if isinstance(value, (list, tuple)):
                            value = tuple(_scalar_array(v, wide) for v in value)
                        else:
                            value = _scalar_array(value, wide)
                    dynamic.append(value)
            if reader.mixed:
                reader.place(dynamic)
            dynamic += reader.offsets
            static_values = tuple([_frozen(bound[index]) for index in static_indices]) if static_indices else ()
            order = None
            if keeps_layout and first_tensor is not None:
                first = bound[first_tensor]
                if isinstance(first, torch.Tensor) and not first.is_contiguous():  # else a contiguous result
                    order = _memory_order(bound, first_tensor, tensor_slots)
            contiguity = tuple([None if bound[i] is None else bound[i].is_contiguous() for i in layout_indices]) \
                if layout_indices else ()
            key = _program_key(static_values, tuple(fixed), tuple(reader.views) if reader.views else (), order,
                               contiguity)
            recorded = reader.recording and not reader.mixed
            donated = ()
            if in_place and not reader.mixed:  # a recorded op's program is traced into its chain's, where donation
                # means nothing: it is strict mode's donating program, not one more
                donated = every_donor if recorded else donated_slots(bound, dynamic, reader)
            result, check = call(compile_for(key, donated), dynamic,
                                 _device_of(reader, bound, device_arg) if recorded else None)
            if fused.DEBUG:
                fused.settle(op_name, result, check)
            elif check is not None:
                defer_check(check, reader.device_index or 0)

            if destinations:
                dynamic.clear()  # the arrays read: a storage array written through a view may be donated
                reader.read_from.clear()
                outs = [bound[i] for i in destinations]
                if len(outs) == 1 and isinstance(outs[0], (list, tuple)):  # foreach in-place: list of tensors
                    for tensor, value in zip(outs[0], result):
                        _store(tensor, value, False, overlap_ok)
                else:
                    values = result if isinstance(result, (tuple, list)) and len(outs) > 1 else (result,)
                    for i, tensor, value in zip(destinations, outs, values):
                        _store(tensor, value, is_out[i], overlap_ok)
                if returns_written:
                    return outs[0] if len(outs) == 1 else tuple(outs)
            if not returns:  # in-place ops without a return, and asserts
                return None

            device_index = reader.device_index
            if device_index is None:  # a factory: the result goes to the chip its `device` names
                device_index = _device_of(reader, bound, device_arg)
                if device_index and not recorded:  # a recorded chain runs on its chip
                    result = jax.device_put(result, runtime.device(device_index))
            if isinstance(result, (tuple, list)):
                wrapped = [_wrap(r, device_index) for r in result]
                return wrapped if returns_list else tuple(wrapped)
            if order is not None:
                return _wrap_in_order(result, order, device_index)
            return _wrap(result, device_index)
        except Exception as error:  # what guard.guarded does for hand-written kernels, without a call more
            raise_if_out_of_memory(error, getattr(reader, "device_index", None) or 0)
            raise

    run.__name__ = f"tpu_{op.__name__}"
    _PROGRAM_CACHES.append(compile_for)
    return run


_PROGRAM_CACHES: list[Any] = []


def _device_of(reader: _Inputs, bound: list, device_arg: int | None) -> int:
    """The chip an op runs on: its inputs', or for a factory the one its ``device`` names."""
    if reader.device_index is not None:
        return reader.device_index
    return devices.index_of(bound[device_arg] if device_arg is not None else None)


def eager_program_count() -> int:
    """How many jitted programs the eager kernels hold (each kernel keeps at most
    ``storage.PROGRAMS_PER_CACHE``, least recently used evicted first)."""
    return sum(cache.cache_info().currsize for cache in _PROGRAM_CACHES)


def _memory_order(bound: list, first: int, tensor_slots: list) -> tuple[int, ...] | None:
    """The dims of a pointwise op's result from outermost to innermost in memory, when its first
    tensor input is laid out in another order than row-major and has the result's shape: as on CPU
    (TensorIterator), the result then takes that input's layout, so ``(x.mT * 2).mT`` is contiguous
    again. ``None`` means a contiguous result."""
    tensor = bound[first]
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or tensor.is_contiguous():
        return None
    stride = tensor.stride()
    if len(set(stride)) != len(stride) or 0 in stride:
        return None
    shape = tuple(tensor.shape)
    shapes = [tuple(bound[index].shape) for _, index, _ in tensor_slots if isinstance(bound[index], torch.Tensor)]
    if not all(_broadcasts_to(other, shape) for other in shapes):
        torch.broadcast_shapes(*shapes)  # torch's error for shapes that do not broadcast at all
        return None
    return tuple(sorted(range(tensor.dim()), key=lambda dim: -stride[dim]))


def _broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether broadcasting ``shape`` with ``target`` gives ``target`` (``torch.broadcast_shapes`` is slow)."""
    if len(shape) > len(target):
        return False
    return all(size == 1 or size == goal for size, goal in zip(reversed(shape), reversed(target)))


def _wrap_in_order(physical: Any, order: tuple[int, ...], device_index: int) -> torch.Tensor:
    """A new tpu tensor whose memory is ``physical`` (the result transposed into ``order``)."""
    shape = [0] * len(order)
    for position, dim in enumerate(order):
        shape[dim] = physical.shape[position]
    stride, step = [0] * len(order), 1
    for dim in reversed(order):
        stride[dim], step = step, step * shape[dim]
    return storage.wrap_strided(physical, dtypes.to_torch(physical.dtype), device_index, tuple(shape), tuple(stride))


def _wrap(array: Any, device_index: int) -> torch.Tensor | None:
    """A new tpu tensor owning ``array``; ``None`` (an output left out, e.g. by ``output_mask``) stays
    ``None``, which torch receives as an undefined tensor."""
    if array is None:
        return None
    return storage.wrap(array, dtypes.to_torch(array.dtype), device_index)
