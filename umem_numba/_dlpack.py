"""DLPack export: a ``"dltensor"`` capsule over memory umem_numba owns.

The structures are DLPack's (``dlpack.h``, the unversioned ``DLManagedTensor``
that every consumer accepts).  The capsule keeps a Python object alive (the
buffer view being exported) until the consumer calls the deleter, or until
the capsule is collected without having been consumed.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

__all__ = ["KDL_CPU", "KDL_CUDA", "KDL_CUDA_HOST", "make_capsule"]

KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3

_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_NAME = b"dltensor"

_pythonapi = ctypes.pythonapi
_pythonapi.PyCapsule_New.restype = ctypes.py_object
_pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_pythonapi.PyCapsule_IsValid.restype = ctypes.c_int
_pythonapi.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
_pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

#: What each live export keeps alive, by the address of its DLManagedTensor.
_live: dict[int, tuple[Any, ...]] = {}
_live_lock = threading.Lock()


@_DELETER
def _deleter(managed: Any) -> None:
    address = ctypes.addressof(managed.contents)
    with _live_lock:
        entry = _live.pop(address, None)
    if entry is not None:
        release = entry[-1]
        release()


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule: int) -> None:
    # Unconsumed capsule (still named "dltensor"): the producer cleans up.
    try:
        if _pythonapi.PyCapsule_IsValid(capsule, _NAME):
            pointer = _pythonapi.PyCapsule_GetPointer(capsule, _NAME)
            _deleter(ctypes.cast(pointer, ctypes.POINTER(_DLManagedTensor)))
    except Exception:  # interpreter exit: ctypes is already torn down
        pass


def dl_dtype(dtype: np.dtype) -> tuple[int, int]:
    """``(code, bits)`` of a numpy dtype, or ``BufferError`` for one DLPack cannot describe."""
    code = _CODES.get(dtype.kind)
    if code is None or dtype.fields is not None:
        raise BufferError(f"dtype {dtype} has no DLPack equivalent")
    return code, dtype.itemsize * 8


def make_capsule(
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: np.dtype,
    device: tuple[int, int],
    keep: Any,
    release: Any,
) -> Any:
    """A ``"dltensor"`` PyCapsule over ``ptr``.

    Parameters
    ----------
    ptr : int
        Address of the first element.
    shape, strides : tuple of int
        Shape, and strides in bytes (multiples of the itemsize).
    dtype : numpy.dtype
    device : (int, int)
        DLPack ``(device_type, device_id)``.
    keep : object
        Kept alive until the consumer is done (the buffer view).
    release : callable
        Called once, when the consumer is done (or the capsule is dropped unused).
    """
    code, bits = dl_dtype(dtype)
    itemsize = dtype.itemsize
    if any(s % itemsize for s in strides):
        raise BufferError(f"strides {strides} are not multiples of the itemsize {itemsize}")
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*(s // itemsize for s in strides))
    managed = _DLManagedTensor()
    managed.dl_tensor.data = ptr or None
    managed.dl_tensor.device = _DLDevice(*device)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = _DLDataType(code, bits, 1)
    managed.dl_tensor.shape = shape_arr
    managed.dl_tensor.strides = strides_arr
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    with _live_lock:
        _live[address] = (managed, shape_arr, strides_arr, keep, release)
    return _pythonapi.PyCapsule_New(address, _NAME, _capsule_destructor)
