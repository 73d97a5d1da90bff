"""Fused eager: ops on tpu tensors recorded, and run as one XLA program when a value is needed.

``torch.tpu.set_eager_mode(mode)`` (or ``HF_TPU_EAGER_MODE``) chooses how eager ops run:

- ``strict`` (the default): each op runs its own cached ``jax.jit`` program at once;
- ``fused``: each op built from a lowering (:func:`dispatch.build_kernel`) is *recorded*: its jitted program
  (the very function strict mode would call) and its inputs are appended to a chain, and its results are
  :class:`Lazy` values (shape and dtype known, elements not computed) that storages hold in place of arrays. The
  chain runs as one ``jax.jit`` of the recorded programs, in order, when a value is needed: a storage read that
  needs an array (``.item()``, ``.cpu()``, printing, hand-written kernels and fallbacks reading their inputs,
  collectives, compiled graphs), ``torch.tpu.synchronize()``, a change of the current stream and a read of a
  stream's or an event's work (``query``, ``synchronize``; ``record`` on a non-default stream: one recorded on the
  default stream holds a :class:`Recorded` marker instead), a host sync of the deferred checks, an op on
  another chip or across chips (sharded tensors run strict), the end of a backward pass (its gradients are
  computed while the host records the optimizer's step), or :data:`MAX_OPS` ops or :data:`MAX_WORK` result
  elements. Programs are cached by the chain's structure (the programs, which inputs feed which op, the inputs'
  shapes and dtypes, which results are still referenced), least recently used evicted past
  :data:`PROGRAM_CACHE_SIZE`, so a loop body recorded again runs the program built for it the first time;
- ``debug``: strict, and each op waits for its result and raises its failed checks at once, so an error points
  at the line that issued it.

Values are immutable, so a recorded op sees what its inputs held when it was recorded, whatever is written to their
storages later; views, in-place ops and aliasing go through the same storage reads and writes as in strict mode (a
write through a view is recorded as the view-writer program strict mode runs). Shapes and dtypes are inferred at
record time (the op's program is traced then, once per input signature, and the chain runs that very trace, whatever
global state its lowering reads changes later), so tracing errors are raised by the op's own line. An error when a
chain runs is located by running its ops one by one, and names the op and the source line that recorded it (kept for
ops that may raise when they run: those that call out of XLA's own ops, to a host callback or a kernel; XLA's own
ops fail only for want of memory, reported as such). A chain is recorded under one lock: the autograd engine records
backward ops from its own thread into the same chain, in issue order.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import jax
import jax.extend
import numpy as np
import torch

from . import checks, completion, engine_hooks, runtime, segmented_cache, tpu_lowering
from .out_of_memory import raise_if_out_of_memory

MODES = runtime.EAGER_MODES
MODE = "strict"
ON = False  # MODE == "fused": read by every kernel, so a plain module flag
DEBUG = False  # MODE == "debug"

MAX_OPS = 1024
"""A chain this long runs before more is recorded (bounds the inputs it keeps alive and its compile time); one
that follows a chain cut so may run from half as long on, where a loop body starts again (see :func:`_ends_before`)."""

MAX_WORK = 1 << 18
"""A chain whose results hold this many elements runs before more is recorded (as for :data:`MAX_OPS`, one that
follows a chain cut so may run from half as many on); results of fusible ops (:func:`_fusible`) do not count,
XLA computes them in the loops of their neighbours. A chain's run is dispatched asynchronously, so the chip
computes it while the host records the next one, as strict mode's per-op dispatch overlaps: a tiny Llama forward
takes 0.7x the time of one chain ending at the sync point, on a 2-core host (benchmarks/fused_eager.py); chains
of cheap ops run rarely, each run costing some host time."""

PROGRAM_CACHE_SIZE = 256
"""How many chain programs are kept (:class:`~hf_tpu.backend.segmented_cache.SegmentedCache`: those found since they
were built are evicted after the others, so that a run of one-off chains does not evict a loop body's programs; the
ops' traces are kept so too). A chain whose program was evicted runs op by op when it comes back, and gets its
program again only if it comes back once more within half as many chain runs (see :func:`_run`)."""

_REMEMBERED = 16 * PROGRAM_CACHE_SIZE
"""How many chain structures :func:`_run` remembers having built a program for (their hashes, with the chain run each
last missed the cache at)."""


class Lazy:
    """A value of the chain being recorded: output ``slot`` of it, with the shape and dtype it will have.

    Stored by a :class:`~hf_tpu.backend.storage.Buffer` as its ``pending`` contents; ``array`` is set when the
    chain runs.
    """

    __slots__ = ("slot", "shape", "dtype", "size", "signature", "sharding", "array", "chain", "__weakref__")

    def value(self) -> Any:
        """The computed array: runs the chain first if it has not run."""
        if self.array is None:
            with _lock:  # waits for a run in progress on another thread
                if self.array is None and self.chain is _chain:
                    _restart(_chain.device)
            if self.array is None:
                raise _failed(self)
        return self.array


class Recorded:
    """A completion marker of the ops recorded so far, as a JAX array is one of the op that computes it
    (``is_ready``, ``block_until_ready``): what an event recorded on the default stream holds while ops are pending,
    so that recording it runs nothing. Asked, it runs the chain (if it has not run: with the ops recorded since)."""

    __slots__ = ("chain",)

    def __init__(self, chain: _Chain) -> None:
        self.chain = chain

    def _finished(self) -> Any:
        chain = self.chain
        with _lock:  # a chain stops being the current one only by running (under the lock)
            if chain is _chain:
                _restart(chain.device)
        if chain.error is not None:
            raise RuntimeError(f"the fused eager chain this waits for failed ({chain.error})")
        return chain.finished

    def is_ready(self) -> bool:
        finished = self._finished()
        return finished is None or finished.is_ready()

    def block_until_ready(self) -> None:
        finished = self._finished()
        if finished is not None:
            finished.block_until_ready()


def recorded() -> Recorded | None:
    """The completion marker of the ops recorded and not run yet (:class:`Recorded`), None if there are none."""
    with _lock:
        return Recorded(_chain) if _chain.ops else None


def concrete(value: Any) -> Any:
    """``value`` with a :class:`Lazy` value replaced by its array (the chain runs if needed)."""
    return value.value() if value.__class__ is Lazy else value


def _failed(value: Lazy) -> RuntimeError:
    return RuntimeError(f"this tensor's value was never computed: its fused eager chain failed ({value.chain.error})")


class _Op:
    """One recorded call: ``trace`` (a :class:`_Trace`) of the values in slots ``refs`` (a tuple of slots for a list
    argument), its result's leaves in slots from ``first`` on (their values' weak references in its chain's
    ``outputs``)."""

    __slots__ = ("trace", "refs", "first", "name", "line")


_structure_of = operator.attrgetter("trace", "refs")  # an op's part of its chain's structure (see _run)


class _Chain:
    """The ops recorded since the last run, on one chip."""

    def __init__(self, device: int | None) -> None:
        self.device = device
        self.sharding = None if device is None else runtime.one_chip(device)  # its results'
        self.ops: list[_Op] = []
        self.outputs: list[weakref.ref] = []  # weak references to the ops' result values, in slot order
        # The concrete values the chain reads, one slot each; but an array an op reads twice is two parameters of
        # the program, as in strict mode (XLA may compile an op differently when two of its operands are one value:
        # it turned divisions by one shared divisor into products with its reciprocal before pointwise.divided).
        self.inputs: list[Any] = []
        self.input_slots: list[int] = []
        self.input_signatures: list[tuple] = []
        # id(input) -> its first slot and its signature; inputs are kept alive. A number's slot is not shared (None):
        # which numbers are equal (and so one cached array, or one small int) changes from step to step, the
        # structure of the chain must not.
        self.known: dict[int, tuple[int | None, tuple]] = {}
        self.slots = 0
        self.checks = 0  # ops with a check output
        self.work = 0  # elements of the ops' results
        self.after_bound = False  # the chain before it ran at the size bound (see _ends_before)
        self.error: BaseException | None = None
        self.finished: Any = None  # once it ran: its newest result array, if it has one (see Recorded)

    def ref(self, value: Any, signature: Any, used: list[int]) -> Any:
        """The slot of a value an op reads (of ``signature``); ``used``: the input slots the op reads already."""
        if value is None:
            return None
        if value.__class__ is Lazy:
            if value.array is None:
                if value.chain is not self:
                    raise _failed(value)
                return value.slot
            value = value.array
        known = self.known.get(id(value))
        slot = None if known is None else known[0]
        if slot is None or slot in used:
            slot = self.slots
            if known is None:
                # not a number, nor a number's cached array (a weakly-typed scalar: equal numbers share one)
                shared = len(signature) == 3 and (signature[0] or not signature[2])
                self.known[id(value)] = (slot if shared else None, signature)
            self.slots += 1
            self.inputs.append(value)
            self.input_slots.append(slot)
            self.input_signatures.append(signature)
        used.append(slot)
        return slot


def _signature_of(value: Any) -> Any:
    """What a program traced for an argument depends on: an array's shape, dtype and weak type (a pending
    value's, known already), a Python number's type; ``None``; a tuple of those for a list argument."""
    kind = _kinds.get(value.__class__)
    if kind is None:  # isinstance(jax.Array) is slow: each class is classified once
        kind = _kinds[value.__class__] = _kind_of(value)
    if kind == "jax":
        return (value.shape, value.dtype, value.weak_type)
    if kind == "lazy":
        return value.signature if value.array is None else _signature_of(value.array)
    if kind == "tuple":
        return tuple([_signature_of(item) for item in value])
    if kind == "numpy":
        return (value.shape, value.dtype, False)
    return None if value is None else (value.__class__,)


def _kind_of(value: Any) -> str:
    if value.__class__ in (Lazy, tuple):
        return value.__class__.__name__.lower()
    if isinstance(value, jax.Array):
        return "jax"
    return "numpy" if isinstance(value, np.ndarray) else "number"


_kinds: dict[type, str] = {}


def _abstract(value: Any, signature: tuple | None) -> Any:
    if signature is None or len(signature) == 1:
        return value  # None, or a Python number: traced as a weakly typed scalar, as a jitted call does
    return jax.ShapeDtypeStruct(signature[0], signature[1], weak_type=signature[2])


_lock = threading.RLock()
_chain = _Chain(None)
# (program, input signatures) -> its trace (see _traced)
_traces = segmented_cache.SegmentedCache(lambda: runtime.PROGRAMS_PER_CACHE)
_programs = segmented_cache.SegmentedCache(lambda: PROGRAM_CACHE_SIZE)  # chain structure -> jitted chain program
# hashes of the chain structures a program was built for -> the chain run they last missed the cache at, newest last
_built: OrderedDict = OrderedDict()
_runs = 0  # chain runs since the start (not reset with the stats)
_STATS = ("ops", "flushes", "program_hits", "program_misses", "op_by_op")
_stats = dict.fromkeys(_STATS, 0)


def _unchecked(fn: Callable) -> Callable:
    """The jitted function behind the wrappers of :func:`tpu_lowering.checked` (a recorded op is checked when it is
    traced, see :func:`_traced`) and :func:`runtime.waiting_if_interpreted` (recorded only where nothing is
    interpreted)."""
    while not hasattr(fn, "trace"):
        fn = fn.__wrapped__
    return fn


class _Trace:
    """An op's program traced for one input signature: ``jaxpr`` (closed, of the flattened inputs), the structure
    of its result (``None`` for one array), per result leaf (shape, dtype, signature, size), ``check``: whether the
    last output is a check; ``exact``: it computes no floating-point value (:func:`_exact`); ``fusible``: its
    floats are only rounded correctly, moved and compared (both: see :func:`_build`); ``work``: its results'
    elements, none for a fusible op (see :data:`MAX_WORK`); ``may_fail``: it calls out of XLA's own ops (see
    :func:`_may_fail`), so an op of it keeps the line that recorded it; ``alone``: the jaxpr jitted by itself, made
    when an op of this trace first runs alone."""

    __slots__ = ("jaxpr", "tree", "leaves", "check", "work", "exact", "fusible", "may_fail", "alone")


def _traced(fn: Callable, call: Any, signature: tuple, pair: bool, name: str) -> _Trace:
    """``fn`` (jitted) traced for values of ``signature``, as strict mode's call of it would trace it, and checked
    for TPU chips as strict mode checks it (:func:`tpu_lowering.checked`), into the cache :func:`record` looks in
    first."""
    abstract = [
        tuple(_abstract(v, s) for v, s in zip(value, sig)) if value.__class__ is tuple else _abstract(value, sig)
        for value, sig in zip(call, signature)
    ]
    unchecked = _unchecked(fn)
    traced = unchecked.trace(*abstract)
    if tpu_lowering.MODE != "off":  # checked as strict mode checks it, once per signature; the chain is glue
        tpu_lowering.check(name, unchecked, tuple(abstract))
    result, check = traced.out_info if pair else (traced.out_info, None)
    leaves, tree = jax.tree_util.tree_flatten(result)
    found = _Trace()
    found.jaxpr, found.check, found.alone = traced.jaxpr, check is not None, None
    found.tree = None if jax.tree_util.treedef_is_leaf(tree) and leaves else tree
    found.leaves = tuple((leaf.shape, leaf.dtype, (leaf.shape, leaf.dtype, leaf.weak_type), int(np.prod(leaf.shape)))
                         for leaf in leaves)
    found.exact = _exact(traced.jaxpr.jaxpr)
    found.fusible = _fusible(traced.jaxpr.jaxpr)
    found.work = 0 if found.fusible else sum(leaf[3] for leaf in found.leaves)
    found.may_fail = _may_fail(traced.jaxpr.jaxpr)
    _traces[fn, signature] = found
    return found


_MOVES = frozenset({
    # operations whose floating-point results are elements of their operands (or constants), moved
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
    "dynamic_update_slice", "concatenate", "pad", "rev", "select_n", "copy", "copy_p", "gather", "scatter",
    "pjit", "jit", "closed_call"})


def _exact(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` computes nothing from a floating-point value (nor do the jaxprs inside its equations): every
    equation that reads or gives one moves elements (:data:`_MOVES`: a view's read or write, a cache written at a
    position); integer and boolean arithmetic is exact, however XLA fuses it with its neighbours, and moved floats
    are values their producers pinned or isolated already (see :func:`_build`)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _MOVES and any(
                jax.numpy.issubdtype(var.aval.dtype, np.inexact) for var in (*eqn.invars, *eqn.outvars)):
            return False
    return all(_exact(inner) for inner in jax.extend.core.subjaxprs(jaxpr))


_CORRECTLY_ROUNDED = frozenset({
    # IEEE 754's correctly rounded operations and those exact by nature (selections, comparisons, conversions,
    # moving elements): each result is one value, however the loop that computes it is compiled and fused
    "add", "sub", "mul", "div", "sqrt", "rem", "neg", "abs", "sign", "max", "min", "clamp", "floor", "ceil", "round",
    "nextafter", "integer_pow", "square", "is_finite", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "select_n", "convert_element_type", "copy", "copy_p", "stop_gradient", "iota", "broadcast_in_dim", "reshape",
    "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad",
    "rev", "optimization_barrier",
    # calls of jaxprs, whose equations are looked at in turn
    "pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call"})


def _fusible(jaxpr: Any) -> bool:
    """Whether every equation of ``jaxpr`` (and of the jaxprs inside them) is a correctly rounded operation
    (:data:`_CORRECTLY_ROUNDED`) and no value of it is a complex one: an op of such a jaxpr gives strict mode's
    bits whatever XLA fuses it with, once its float inputs and results are values its neighbours cannot be
    rewritten with (:func:`_pinned`). Transcendental functions are not: XLA's CPU compiler evaluates them with
    other code in a loop of several ops than in a loop of one (``exp``, ``log``, ``erf`` differ in the last bit),
    nor are reductions, whose order of summation depends on the loop; nor complex multiplication, a multiply-add."""
    return all(eqn.primitive.name in _CORRECTLY_ROUNDED for eqn in jaxpr.eqns) and not any(
        jax.numpy.issubdtype(value.aval.dtype, np.complexfloating) for value in _values(jaxpr)) and all(
        _fusible(inner) for inner in jax.extend.core.subjaxprs(jaxpr))


def _values(jaxpr: Any) -> tuple:
    return (*jaxpr.invars, *jaxpr.constvars, *jaxpr.outvars, *(var for eqn in jaxpr.eqns for var in eqn.outvars))


_CALLS_OUT = ("callback", "pallas_call", "custom_call", "ffi")  # in the names of primitives that leave XLA's own ops


def _may_fail(jaxpr: Any) -> bool:
    """Whether running ``jaxpr`` may raise: where an equation (or one of the jaxprs inside it) calls out of XLA's own
    ops, to a host callback, a kernel or a foreign function. XLA's own ops fail only for want of memory, which is
    reported as such (:func:`_located`); their failed checks are outputs, raised at a host read."""
    return any(word in eqn.primitive.name for eqn in jaxpr.eqns for word in _CALLS_OUT) or any(
        _may_fail(inner) for inner in jax.extend.core.subjaxprs(jaxpr))


_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
# id(code) -> (code, in torch or hf_tpu): the code is kept, so its id is not reused; a code object's hash is slow
_internal_code: dict[int, tuple[Any, bool]] = {}


def _user_line() -> tuple[Any, int] | None:
    """The innermost caller outside torch and hf_tpu, which issued the op being recorded: its code and the offset of
    the instruction it is at (:func:`_line_of` gives the line: ``f_lineno`` decodes the line table from the
    function's start, microseconds in a long function, paid by every op)."""
    try:  # past this function, record and record's caller in hf_tpu (not made into frame objects: faster)
        frame = sys._getframe(3)
    except ValueError:  # nothing above that caller: an op of the backward pass, run by autograd's thread
        return None
    while frame is not None:
        code = frame.f_code
        known = _internal_code.get(id(code))
        if known is None:
            known = _internal_code[id(code)] = (code, code.co_filename.startswith(_INTERNAL))
        if not known[1]:
            return code, frame.f_lasti
        frame = frame.f_back
    return None


def _line_of(place: tuple[Any, int]) -> str:
    """``file:line`` of what :func:`_user_line` found (``co_positions`` has one entry per 2-byte code unit)."""
    code, offset = place
    return f"{code.co_filename}:{next(itertools.islice(code.co_positions(), offset // 2, None))[0]}"


def record(fn: Callable, call: Any, name: str, device: int, pair: bool = True) -> Any:
    """Records ``fn(*call)`` (a jitted program; ``call`` holds arrays, :class:`Lazy` values, Python numbers,
    ``None`` and tuples of those) on ``tpu:device`` and returns its result with :class:`Lazy` leaves; with
    ``pair``, ``fn`` returns ``(result, check)`` and so does this, with no check (the chain collects it)."""
    with _lock:
        chain = _chain
        known = chain.known  # an array read again (a weight) is not asked for its shape and dtype again
        signature = []
        for value in call:
            if value.__class__ is Lazy and value.array is None:
                signature.append(value.signature)
            else:
                entry = known.get(id(value))
                signature.append(entry[1] if entry else _signature_of(value))
        signature = tuple(signature)
        trace = _traces.find((fn, signature)) or _traced(fn, call, signature, pair, name)
        bound = (len(chain.ops) >= MAX_OPS // 2 or chain.work >= MAX_WORK // 2) and _ends_before(chain, trace)
        if chain.device != device or bound:
            chain = _restart(device)
            chain.after_bound = bound
        refs, used = [], []
        for value, sig in zip(call, signature):
            if value.__class__ is Lazy and value.chain is chain and value.array is None:
                refs.append(value.slot)  # the result of an op of this chain: the common case
            elif value.__class__ is tuple:
                refs.append(tuple([chain.ref(item, item_sig, used) for item, item_sig in zip(value, sig)]))
            else:
                refs.append(chain.ref(value, sig, used))
        op = _Op()
        slot = op.first = chain.slots
        # the recording line is looked up only for an op that may fail when the chain runs (about 1.5 µs an op)
        op.trace, op.refs, op.name, op.line = trace, tuple(refs), name, _user_line() if trace.may_fail else None
        chain.ops.append(op)
        chain.work += trace.work
        _stats["ops"] += 1
        outputs = chain.outputs
        if trace.tree is None:  # one array: the common case
            result = _pending(trace.leaves[0], slot, chain)
            outputs.append(weakref.ref(result))
            chain.slots = slot + 1
        else:
            handles = [_pending(leaf, slot + index, chain) for index, leaf in enumerate(trace.leaves)]
            outputs += map(weakref.ref, handles)
            chain.slots = slot + len(handles)
            result = jax.tree_util.tree_unflatten(trace.tree, handles)
        if trace.check:
            chain.checks += 1
            if checks.MODE == "immediate":  # each failing op raises at once: run it now
                _restart(device)
    return (result, None) if pair else result


def _pending(leaf: tuple, slot: int, chain: _Chain) -> Lazy:
    """The :class:`Lazy` value of output ``slot`` of ``chain``, of ``leaf`` (see :class:`_Trace`)."""
    handle = Lazy()
    handle.shape, handle.dtype, handle.signature, handle.size = leaf
    handle.slot, handle.sharding, handle.array, handle.chain = slot, chain.sharding, None, chain
    return handle


def _ends_before(chain: _Chain, trace: _Trace) -> bool:
    """Whether ``chain`` runs at the size bound before an op of ``trace`` is recorded: at :data:`MAX_OPS` ops or
    :data:`MAX_WORK` result elements; or, if the chain before it ran at the bound too, from half as many on at an op
    like its first one. A loop with no sync point in its body is so cut where its body starts again (where the
    chain started), into a few programs run again and again, not at a new place in its body each time (a bound
    apart), each a new program. Chains that start after a sync point end at the next one, if it comes within the
    bound."""
    length, work = len(chain.ops), chain.work
    return length >= MAX_OPS or work >= MAX_WORK or (
        chain.after_bound and (length >= MAX_OPS // 2 or work >= MAX_WORK // 2) and chain.ops[0].trace is trace)


@functools.cache
def records_kernels() -> bool:
    """Whether ops whose lowering may call a Pallas kernel are recorded: unless the kernels run interpreted, where
    their programs must wait for their results (:func:`runtime.waiting`)."""
    return not runtime.pallas_kernels() or runtime.backing_platform() == "tpu"


def apply(fn: Callable, name: str, device: int, *args: Any) -> Any:
    """``fn(*args)`` for a jitted storage program (a view read or write, a cast): recorded in fused eager mode
    when every argument is on one chip (a value of the chain is), as an op of the op table is; else run now."""
    if ON and all(arg.__class__ is Lazy or arg.__class__ is int  # an int: a view's storage offset
                  or type(arg.sharding) is jax.sharding.SingleDeviceSharding for arg in args):
        return record(fn, args, name, device, pair=False)
    return fn(*(concrete(arg) for arg in args))


def flush() -> None:
    """Runs the recorded chain, if any (a sync point)."""
    with _lock:
        if _chain.ops:
            _restart(_chain.device)


def _restart(device: int | None) -> _Chain:
    """Starts a new chain on ``device`` after running the current one."""
    global _chain
    previous, _chain = _chain, _Chain(device)
    if previous.ops:
        _run(previous)
    return _chain


def _run(chain: _Chain) -> None:
    """Runs the chain as one program, built the first time its structure runs. A structure whose program was built
    and evicted since runs op by op instead, each op's recorded trace a program of its own, as strict mode runs it:
    structures that come back in a cycle longer than the cache (a generate loop whose growing token tensors give
    every step a new structure) would otherwise build a program at each run. One that comes back again within
    half the cache's size of chain runs (a loop body whose programs another workload evicted) is in a cycle the
    cache holds: its program is built again."""
    global _runs
    _runs += 1
    live = list(filter(None, map(operator.call, chain.outputs)))  # the values still referenced (a Lazy is true)
    if not live and not chain.checks:
        _release(chain)
        return
    live_slots = tuple(handle.slot for handle in live)
    donated = _donated(chain.inputs, live)
    key = (tuple(map(_structure_of, chain.ops)), tuple(chain.input_slots),
           tuple(chain.input_signatures), live_slots, donated)
    program = _programs.find(key)
    if program is None:
        _stats["program_misses"] += 1
        structure = hash(key)
        last_miss = _built.pop(structure, None)
        if last_miss is not None and _runs - last_miss > PROGRAM_CACHE_SIZE // 2:
            _stats["op_by_op"] += 1
            program = functools.partial(_op_by_op, chain, live_slots)
        else:
            program = _programs[key] = _build(chain.ops, tuple(chain.input_slots), live_slots, chain.slots,
                                              donated)
        _built[structure] = _runs
        if len(_built) > _REMEMBERED:
            _built.popitem(last=False)
    else:
        _stats["program_hits"] += 1
    _stats["flushes"] += 1
    try:
        outputs, check = program(*chain.inputs)
        if chain.device:  # a chain of factories alone runs on the default device
            outputs = jax.device_put(outputs, runtime.device(chain.device))
    except Exception as error:
        chain.error = error
        values: dict[int, Any] = dict(zip(chain.input_slots, chain.inputs))
        located = _located(chain, error, values)
        for handle in live:  # the ops before the failing one have their results, as in strict mode
            if handle.slot in values:
                handle.array, handle.chain = values[handle.slot], None
        _release(chain)
        raise located from error
    for handle, array in zip(live, outputs):
        handle.array, handle.chain = array, None
    _release(chain)
    if outputs:
        chain.finished = outputs[-1]
        completion.computed(outputs[-1], chain.device)
    if check is not None:
        checks.defer(check, chain.device)


DONATED_BYTES = 1 << 20
"""An input array of a chain this large that only the chain holds is donated to its program (see :func:`_donated`);
smaller ones are not worth a program variant."""


def _donated(inputs: list, live: list) -> tuple[int, ...]:
    """The positions of the chain's inputs whose memory its program may write its results into: arrays of at least
    :data:`DONATED_BYTES` that nothing but the chain holds (a storage written in place by the chain: its old array;
    neither a tensor's current array nor one a view, a saved tensor or the user still holds), each matched with a
    live result of its shape and dtype. An in-place update, or a cache written at a position, then needs the
    tensor's size once, as in strict mode (:func:`dispatch.build_kernel`'s ``donated_slots``)."""
    wanted = {}
    for handle in live:
        wanted[handle.shape, handle.dtype] = wanted.get((handle.shape, handle.dtype), 0) + 1
    positions = []
    for position in range(len(inputs)):
        array = inputs[position]
        if array.__class__ is not jax.Array and not isinstance(array, jax.Array) or array.nbytes < DONATED_BYTES:
            continue
        # references: the inputs list, this variable, getrefcount's argument, and the newest-array records
        if sys.getrefcount(array) - completion.is_latest(array) > 3 or not wanted.get((array.shape, array.dtype)):
            continue
        wanted[array.shape, array.dtype] -= 1
        positions.append(position)
    return tuple(positions)


def _op_by_op(chain: _Chain, live_slots: tuple, *inputs: Any) -> tuple[list, Any]:
    """The chain's live results and first failed check, each op's trace run as a program of its own (as strict
    mode runs the op)."""
    values: dict[int, Any] = dict(zip(chain.input_slots, inputs))
    found = [check for op in chain.ops if (check := _run_op(op, values)) is not None]
    return [values[slot] for slot in live_slots], (checks._first_failure(tuple(found)) if found else None)


def _run_op(op: _Op, values: dict[int, Any]) -> Any:
    """Runs one recorded op alone on ``values`` (by slot), which gets its results; returns its check, if any."""
    trace = op.trace
    if trace.alone is None:
        trace.alone = jax.jit(jax.extend.core.jaxpr_as_fun(trace.jaxpr))
    outputs = trace.alone(*jax.tree_util.tree_leaves(_resolve(op.refs, values)))
    check = outputs.pop() if trace.check else None
    values.update(zip(range(op.first, op.first + len(outputs)), outputs))
    return check


def _release(chain: _Chain) -> None:
    """A chain that ran keeps no inputs and no ops."""
    chain.ops, chain.outputs, chain.inputs, chain.known = [], [], [], {}


def _resolve(refs: tuple, values: Any) -> list:
    return [values[ref] if ref.__class__ is int else (
        None if ref is None else tuple(None if item is None else values[item] for item in ref)) for ref in refs]


def _build(ops: list[_Op], input_slots: tuple, live_slots: tuple, slots: int, donated: tuple[int, ...] = ()) \
        -> Callable:
    """One jitted program running the chain's ops in order: the inputs in, the live results and one check out.

    Each op runs as the taken branch of a conditional on ``gate`` (an input, always true): XLA fuses within a
    branch but not across, so each op's arithmetic is compiled as in its own program (a fused loop could contract
    one op's ``x * y`` and the next one's ``+ z`` into a fused multiply-add, which rounds differently), and the
    results are those of strict mode, bit for bit. An op that computes no floating-point value (:func:`_exact`:
    integer and boolean bookkeeping, such as ``generate``'s token and stopping tensors; a view's read or write)
    runs as it is: fusing it cannot change a bit, a conditional costs XLA about four times the compile time of what
    it holds, and a cache written at a position in a donated buffer is updated in place. Neither does an op
    whose floats are only rounded correctly, compared and moved (:func:`_fusible`: additions, products, quotients,
    square roots, selections, casts, concatenations: an optimizer's update, a residual add), once its float
    results are pinned (:func:`_pinned`) so that no arithmetic of its neighbours can be contracted with them: such
    ops run as they are, and XLA fuses consecutive ones into one loop (AdamW's update on all parameters: one pass
    over the memory instead of one per op).

    On a GPU no op is isolated (:func:`_isolating`): XLA's GPU runtime runs a conditional by copying its predicate
    to the host and waiting for the device, which would make every float op of a chain a round trip. There XLA
    fuses across ops, and only excess precision is ruled out (each op's results keep their dtype's rounding, as
    in strict mode); a contracted multiply-add may differ from strict mode in the last bit."""
    plan = [(op.trace, op.refs, op.first) for op in ops]
    isolating = _isolating()

    def chain_program(gate, *inputs):
        values = [None] * slots
        for slot, value in zip(input_slots, inputs):
            values[slot] = value
        found = []
        for trace, refs, first in plan:
            args = jax.tree_util.tree_leaves(_resolve(refs, values))
            if not isolating or trace.exact:
                outputs = jax.extend.core.jaxpr_as_fun(trace.jaxpr)(*args)
            elif trace.fusible:
                outputs = _pinned(gate, trace.jaxpr, jax.extend.core.jaxpr_as_fun(trace.jaxpr)(*args))
            else:
                outputs = _isolated(gate, trace.jaxpr, args)
            if trace.check:
                found.append(outputs.pop())
            values[first:first + len(outputs)] = outputs
        return [values[slot] for slot in live_slots], (checks._first_failure(tuple(found)) if found else None)

    program = jax.jit(chain_program, donate_argnums=tuple(1 + position for position in donated),
                      compiler_options=None if isolating else {"xla_allow_excess_precision": False})
    return functools.partial(program, _gate())


def _isolating() -> bool:
    """Whether chain programs run each float op in a conditional of its own (see :func:`_build`): everywhere but
    on a GPU."""
    return runtime.backing_platform() != "gpu"


def _isolated(gate: Any, jaxpr: Any, args: list) -> list:
    """Traced: the outputs of ``jaxpr`` (closed) on ``args`` as the branch a conditional on ``gate`` takes (see
    :func:`_build`); the other branch gives zeros. Branches must give the same types, so weakly typed outputs (of
    Python numbers alone) leave the conditional strongly typed and are made weak again after it (conversions to
    their own dtype: no-ops in HLO)."""
    avals = jaxpr.out_avals
    run = jax.extend.core.jaxpr_as_fun(jaxpr)
    outputs = jax.lax.cond(
        gate, lambda *a: [jax.lax.convert_element_type(x, x.dtype) for x in run(*a)],
        lambda *_: [jax.numpy.zeros(aval.shape, aval.dtype) for aval in avals], *args)
    return _weak_again(outputs, avals)


def _pinned(gate: Any, jaxpr: Any, outputs: list) -> list:
    """Traced: the outputs of ``jaxpr`` with each float one replaced by its bits or'ed with zero bits XLA cannot
    know (derived from ``gate``), seen as floats again: the same value, which XLA cannot rewrite across (no multiply
    before it contracted with an addition after it into one rounding, no ``x * 2 / 2`` simplified), and which is
    rounded to its dtype (no excess precision kept across it); elementwise, so fused with both sides."""
    pinned = []
    for value in outputs:
        if jax.numpy.issubdtype(value.dtype, np.floating):
            unsigned = np.dtype(f"uint{8 * value.dtype.itemsize}")
            zero = jax.lax.convert_element_type(jax.lax.bitwise_not(gate), unsigned)
            bits = jax.lax.bitcast_convert_type(value, unsigned)
            value = jax.lax.bitcast_convert_type(jax.lax.bitwise_or(bits, jax.lax.broadcast(zero, bits.shape)),
                                                 value.dtype)
        pinned.append(value)
    return _weak_again(pinned, jaxpr.out_avals)


def _weak_again(outputs: list, avals: list) -> list:
    """Traced: ``outputs`` made weakly typed where ``avals`` are (conversions to their own dtype: no-ops in HLO)."""
    from jax._src.lax import lax as lax_internal  # weakly-typed conversion: no public API makes one

    return [lax_internal._convert_element_type(x, aval.dtype, weak_type=True) if aval.weak_type else x
            for x, aval in zip(outputs, avals)]


@functools.cache
def _gate() -> Any:
    return jax.numpy.asarray(True)


def _located(chain: _Chain, error: Exception, values: dict[int, Any]) -> Exception:
    """The error of a chain's run, naming the op that raises it (found by running the ops one by one on ``values``,
    the chain's inputs by slot, which gets the results of the ops before it) and the line that recorded it."""
    for op in chain.ops:
        try:
            check = _run_op(op, values)
            jax.block_until_ready([check, *(values[slot] for slot in range(op.first, op.first + len(op.trace.leaves)))])
        except Exception as op_error:  # noqa: BLE001 (whatever the op raises is what is reported)
            raise_if_out_of_memory(op_error, chain.device or 0)
            where = "" if op.line is None else f" (recorded at {_line_of(op.line)})"
            return RuntimeError(f"{op.name}{where} failed when its fused eager chain ran: "
                                f"{type(op_error).__name__}: {op_error}")
    raise_if_out_of_memory(error, chain.device or 0)
    return RuntimeError(f"a fused eager chain of {len(chain.ops)} ops ({', '.join(op.name for op in chain.ops)}) "
                        f"failed, but none of its ops fails alone: {type(error).__name__}: {error}")


def settle(name: str, result: Any, check: Any) -> None:
    """Debug mode, after an op ran: waits for its result and raises its failed check now."""
    try:
        jax.block_until_ready(result)
    except Exception as error:  # noqa: BLE001
        raise RuntimeError(f"{name}: {type(error).__name__}: {error}") from error
    if check is not None:
        checks._raise_for(np.asarray(check))


def set_mode(mode: str) -> None:
    """Selects the eager mode (see the module's docstring); runs what was recorded so far first."""
    global MODE, ON, DEBUG
    if mode not in MODES:
        raise ValueError(f"eager mode {mode!r} is not one of {', '.join(MODES)}: use 'strict' (each op runs at once), "
                         "'fused' (ops recorded and run as one program at a sync) or 'debug' (each op waits for its "
                         "result and checks it)")
    flush()
    MODE, ON, DEBUG = mode, mode == "fused", mode == "debug"


def stats() -> dict[str, int]:
    """Fused eager's counters (public: for users, tests and benchmarks), since the start or the last
    :func:`reset_stats`: ``ops`` recorded, chain runs (``flushes``), chain programs found in the cache
    (``program_hits``) and not (``program_misses``: built, or run op by op, ``op_by_op``, for a structure whose
    program was evicted); and now: ``programs`` cached, ``pending`` ops recorded and
    not run yet. A loop body recorded again and again settles to hits only."""
    return {**_stats, "programs": len(_programs), "pending": len(_chain.ops)}


def reset_stats() -> None:
    """Sets the counters of :func:`stats` back to zero (the cached programs stay)."""
    _stats.update(dict.fromkeys(_STATS, 0))


checks.flush_recorded = engine_hooks.backward_ended = flush
set_mode(runtime.eager_mode())
