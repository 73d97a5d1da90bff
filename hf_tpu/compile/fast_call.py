"""A cheap path for a compiled graph called again like its previous call (a decode step).

A decode step gets the same weights and static-cache tensors at every call, and a few new small tensors
(the token, its position). :class:`CallPlan` remembers, per input, the tensor, its storage's buffer and the
array read from it (all weakly: the plan keeps nothing alive and does not hold a donated array), and the
key of the executable the call ran. The next call checks each input against its record: an input that is
the same whole tensor on the same buffer holding the same array is used as is, with no further checks; a
new array on that buffer (a cache written by the last step) or a new tensor is read as usual and must
have the recorded shape, dtype and single-chip placement; a new tensor that passes becomes the record (the
next generate's cache is passed at every step of it). When every input passes, the call runs the same
executable; when any does not, ``read`` returns ``None`` and the caller takes its full path.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..backend import checks, storage


def _whole_array(tensor: torch.Tensor, array: Any) -> bool:
    """Whether ``array`` (just read from ``tensor``) is the tensor's storage array itself."""
    try:
        return storage.buffer_of(tensor).array is array
    except AttributeError:  # not a tpu tensor
        return False


class _Input:
    """What one call read from one input: the whole tensor (weakly; ``None`` if it was a view or not on tpu),
    its buffer and the array, the tensor's shape, the array's ``(shape, dtype)`` and the view the program takes of
    it (``None``: the array is the tensor's values)."""

    __slots__ = ("tensor", "buffer", "array", "shape", "signature", "view")

    def __init__(self, tensor: torch.Tensor, array: Any, view: tuple | None) -> None:
        whole = view is None and _whole_array(tensor, array)
        self.tensor = weakref.ref(tensor) if whole else None
        self.buffer = weakref.ref(storage.buffer_of(tensor)) if whole else None
        self.array = weakref.ref(array)
        self.shape = tensor.shape
        self.signature = (array.shape, array.dtype)
        self.view = view

    def same_array(self, tensor: torch.Tensor) -> Any:
        """The array to pass for ``tensor`` if it is the recorded whole tensor on the recorded buffer, whose
        array is the recorded one or has its signature; else ``None``."""
        if self.tensor is None or self.tensor() is not tensor:
            return None
        try:
            buffer = tensor.untyped_storage()._hf_buffer
        except AttributeError:  # given another storage since (``set_``)
            return None
        # the tensor object's shape, stride or offset can change in place (``resize_``, ``as_strided_``)
        if buffer is not self.buffer() or tensor.shape != self.shape or tensor.storage_offset() != 0 \
                or not tensor.is_contiguous():
            return None
        array = buffer.array
        if array is None:
            return None
        if array is not self.array():
            if not self.fits(array):
                return None
            self.array = weakref.ref(array)
        return array

    def fits(self, array: Any) -> bool:
        return (array.shape, array.dtype) == self.signature and type(array.sharding) is storage.ONE_CHIP


class CallPlan:
    """The inputs of a compiled graph's last call on one chip (its tensor inputs and constants, the views the
    program takes of them, its non-tensor inputs, the mutated inputs donated) and the executable with the sizes it
    returned (``compiled``), to check the next call against. The plan holds under the check mode
    (:mod:`..backend.checks`) it was made in."""

    __slots__ = ("inputs", "views", "device_index", "static_values", "mutated", "donated", "mode", "compiled")

    def __init__(self, tensors: list[torch.Tensor], arrays: list[Any], views: tuple, device_index: int,
                 static_values: tuple, mutated: frozenset[int], donated: tuple[int, ...], compiled: tuple) -> None:
        self.inputs = [_Input(tensor, array, view)
                       for tensor, array, view in zip(tensors, arrays, views or (None,) * len(tensors))]
        self.views, self.mutated = views, mutated
        self.device_index, self.static_values, self.donated = device_index, static_values, donated
        self.mode, self.compiled = checks.MODE, compiled

    def read(self, tensors: list[torch.Tensor], static_values: tuple) -> list[Any] | None:
        """The arrays to pass for ``tensors`` (the graph's tensor inputs and constants) if they match the
        plan, else ``None``."""
        if static_values != self.static_values or checks.MODE != self.mode or len(tensors) != len(self.inputs):
            return None
        arrays = []
        for position, (tensor, record) in enumerate(zip(tensors, self.inputs)):
            array = record.same_array(tensor)
            if array is None:
                # a new tensor updated in place (a new paged cache's bytes updated as floats): then donatable
                if position in self.mutated and tensor.device.type == "tpu":
                    storage.adopt_dtype(tensor)
                array = self._read_new(tensor, record)
                if array is None:
                    return None
                # the next call likely passes this tensor again (a new generate's cache): check it cheaply then
                self.inputs[position] = _Input(tensor, array, record.view)
            arrays.append(array)
        return arrays

    def write(self, tensors: list[torch.Tensor], positions: list[int], values: tuple) -> None:
        """Writes the new values of the mutated inputs at ``positions`` of a call whose inputs :meth:`read`
        matched: straight into the buffer of an input that is its storage's whole array (the read checked it, and
        the program returns the input's shape and dtype), else through ``storage.write``."""
        for position, value in zip(positions, values):
            buffer = self.inputs[position].buffer
            if buffer is None:
                storage.write_input(tensors[position], value, self.device_index)
            else:
                buffer().set(value)

    def _read_new(self, tensor: torch.Tensor, record: _Input) -> Any:
        """A tensor the plan has not seen, read as the full path reads it, if it fits the record (a view the
        program takes itself must be the recorded one)."""
        try:
            buffer = storage.buffer_of(tensor)
        except AttributeError:  # not a tpu tensor: the full path decides how it joins the program
            return None
        if buffer.device_index != self.device_index:
            return None
        if record.view is None:
            array = storage.read(tensor)
            return array if record.fits(array) else None
        array, view = storage.read_for_program(tensor)
        return array if view == record.view and record.fits(array) else None
