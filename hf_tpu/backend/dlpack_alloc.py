"""Builds tpu tensors on any chip index, with any strides, through torch's DLPack import.

torch maps DLPack's ``kDLExtDev`` devices to PrivateUse1, so a DLPack capsule that names our
fake address, ``tpu:k``, a shape and strides becomes a real PrivateUse1 tensor on ``tpu:k`` whose
storage has that address and the right byte size. (``torch._C._acc.create_empty_tensor`` only
makes contiguous tensors on index 0.) No memory is ever read through the address.
"""

from __future__ import annotations

import ctypes
import struct

import torch

_EXT_DEV = 12  # DLDeviceType kDLExtDev
_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6

# DLManagedTensor (dlpack.h), packed in one call: data, device (type, id), ndim, dtype (code, bits, lanes), shape and
# strides pointers, byte_offset, manager_ctx, deleter; then the shape and strides arrays (int64 each).
_HEAD = struct.Struct("=QiiiBBHQQQQQ")

# Each capsule's struct, shape and strides live in one malloc'd block that torch frees with libc's
# free when the tensor's storage dies. No Python runs then: a Python deleter called while an
# exception is in flight (a temporary tensor dropped by a raising call, e.g. ``.numpy()``) would turn
# it into "SystemError: error return without exception set".
_libc = ctypes.CDLL(None)
_malloc = _libc.malloc
_malloc.restype = ctypes.c_void_p
_malloc.argtypes = [ctypes.c_size_t]
_free = _libc.free
_free.restype = None
_free.argtypes = [ctypes.c_void_p]
_FREE = ctypes.cast(_free, ctypes.c_void_p).value

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_unused = ctypes.pythonapi.PyCapsule_IsValid  # torch renames a capsule it took to "used_dltensor"
_capsule_unused.restype = ctypes.c_int
_capsule_unused.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _code(dtype: torch.dtype) -> int | None:
    if dtype == torch.bool:
        return _BOOL
    if dtype == torch.bfloat16:
        return _BFLOAT
    if dtype.is_complex:
        return _COMPLEX
    if dtype in (torch.float16, torch.float32, torch.float64):
        return _FLOAT
    if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        return _UINT
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        return _INT
    return None


def tensor_at(address: int, shape: tuple, stride: tuple, dtype: torch.dtype, device_index: int) -> torch.Tensor:
    """A PrivateUse1 tensor on ``tpu:device_index`` over the fake ``address``."""
    code = _code(dtype)
    carrier = dtype if code is not None else torch.uint8  # e.g. float8: same bytes, viewed below
    ndim = len(shape)
    slots = max(ndim, 1)
    size = _HEAD.size + 2 * slots * 8
    block = _malloc(size)
    if not block:
        raise MemoryError("hf_tpu: cannot allocate a DLPack descriptor")
    sizes = block + _HEAD.size
    ctypes.memmove(block, _HEAD.pack(address, _EXT_DEV, device_index, ndim, _UINT if code is None else code,
                                     carrier.itemsize * 8, 1, sizes, sizes + slots * 8, 0, 0, _FREE)
                   + struct.pack(f"={2 * slots}q", *(shape or (0,)), *(stride or (0,))), size)
    capsule = _capsule_new(block, b"dltensor", None)
    try:
        tensor = torch._C._from_dlpack(capsule)
    except BaseException:
        if _capsule_unused(capsule, b"dltensor"):  # torch did not take it: nothing else frees the block
            _free(block)
        raise
    if carrier != dtype:
        tensor = torch.ops.aten.view.dtype.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), tensor, dtype)
    return tensor
