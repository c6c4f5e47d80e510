"""DLPack export: a ``"dltensor"`` capsule over memory umem_numba owns.

The structures are DLPack's (``dlpack.h``, the unversioned ``DLManagedTensor``
that every consumer accepts).  The capsule keeps a Python object alive (the
buffer view being exported) until the consumer calls the deleter, or until
the capsule is collected without having been consumed.

At interpreter exit
-------------------
A consumer's tensor (PyTorch, CuPy) can outlive this module: module teardown
clears modules' globals (this one before ``__main__``, where the user's
tensors live), and the consumer then calls the deleter.  So the C callbacks
and the table of live exports are kept alive for the life of the process
(one leaked reference each), the callbacks bind what they use early, and once
the process exits (:func:`umem_numba._driver.shutting_down`) they release
nothing: the driver reclaims the memory.  umem_numba's exit hook also clears
the deleter of every live export (DLPack allows NULL): a consumer that frees
its tensor after the interpreter has finalized calls nothing.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from .. import _driver

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


_MANAGED_P = ctypes.POINTER(_DLManagedTensor)
_DELETER = ctypes.CFUNCTYPE(None, _MANAGED_P)
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


def _deleter_py(
    managed: Any,
    _quiet: Any = _driver.shutting_down,
    _addressof: Any = ctypes.addressof,
    _table: dict[int, tuple[Any, ...]] = _live,
    _lock: Any = _live_lock,
) -> None:
    # Defaults bind early: a consumer may call this after module teardown set our globals to None.
    if _quiet():
        return  # exit: the structures stay (leaked with the table), the driver reclaims the memory
    address = _addressof(managed.contents)
    with _lock:
        entry = _table.pop(address, None)
    if entry is not None:
        release = entry[-1]
        release()


_deleter = _DELETER(_deleter_py)


def _capsule_destructor_py(
    capsule: int,
    _quiet: Any = _driver.shutting_down,
    _api: Any = _pythonapi,
    _cast: Any = ctypes.cast,
    _pointer_type: Any = _MANAGED_P,
    _delete: Any = _deleter_py,
    _name: bytes = _NAME,
) -> None:
    # Unconsumed capsule (still named "dltensor"): the producer cleans up.
    if _quiet():
        return
    try:
        if _api.PyCapsule_IsValid(capsule, _name):
            pointer = _api.PyCapsule_GetPointer(capsule, _name)
            _delete(_cast(pointer, _pointer_type))
    except Exception:  # pragma: no cover - defensive: a destructor must never raise
        pass


_capsule_destructor = _CAPSULE_DESTRUCTOR(_capsule_destructor_py)


def _disarm_deleters(_table: dict[int, tuple[Any, ...]] = _live, _lock: Any = _live_lock) -> None:
    """At exit: clear the deleter of every live export, so that no consumer calls back into Python.

    A consumer's tensor may be freed after the interpreter has finalized (from
    a C++ destructor, or from one of the consumer's own threads): a call of
    the ctypes deleter then needs an interpreter that is gone, and the process
    dies with SIGSEGV and no Python frame.  DLPack lets the deleter be NULL
    (nothing to clean up), and at exit there is nothing to clean up: the
    driver reclaims the memory.
    """
    null = _DELETER()
    with _lock:
        for entry in _table.values():
            entry[0].deleter = null


_driver.on_exit(_disarm_deleters)

# Never freed, even by module teardown: consumers hold pointers to the C thunks
# (the deleter, the capsule destructor) and into the structures the table keeps,
# and may use them after this module's globals are gone.
for _immortal in (_deleter, _capsule_destructor, _live):
    _pythonapi.Py_IncRef(ctypes.py_object(_immortal))
del _immortal


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
