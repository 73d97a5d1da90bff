"""Builds tpu tensors on any chip index, with any strides, through torch's DLPack import.

torch maps DLPack's ``kDLExtDev`` devices to PrivateUse1, so a DLPack capsule that names our
fake address, ``tpu:k``, a shape and strides becomes a real PrivateUse1 tensor on ``tpu:k`` whose
storage has that address and the right byte size. (``torch._C._acc.create_empty_tensor`` only
makes contiguous tensors on index 0.) No memory is ever read through the address.
"""

from __future__ import annotations

import ctypes

import torch

_EXT_DEV = 12  # DLDeviceType kDLExtDev
_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_alive: dict[int, tuple] = {}  # address of each capsule's struct -> what must outlive torch's use of it


@_Deleter
def _release(managed: ctypes.POINTER(_Managed)) -> None:
    _alive.pop(ctypes.addressof(managed.contents), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


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
    sizes = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*stride)
    managed = _Managed()
    managed.dl_tensor.data = address
    managed.dl_tensor.device = _Device(_EXT_DEV, device_index)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = _DataType(_code(carrier), carrier.itemsize * 8, 1)
    managed.dl_tensor.shape = sizes
    managed.dl_tensor.strides = strides
    managed.deleter = _release
    _alive[ctypes.addressof(managed)] = (managed, sizes, strides)
    tensor = torch._C._from_dlpack(_capsule_new(ctypes.addressof(managed), b"dltensor", None))
    if carrier != dtype:
        tensor = torch.ops.aten.view.dtype.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), tensor, dtype)
    return tensor
