"""Foreign consumers for the fuzzer: raw stream work through the driver, as another library would issue it.

A consumer takes memory the way CuPy or PyTorch would (a DLPack capsule, or the
CUDA Array Interface) and writes it with ``cuMemsetD32Async`` on a stream of its
own choosing: work umem_numba did not issue and can only know of through the
protocol (the stream handed to ``__dlpack__``, the stream named in the interface).
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

import numpy as np

import umem_numba as um

__all__ = ["Capsule", "memset_elements", "stream_wait_stream"]


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
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]


class Capsule:
    """A consumed ``"dltensor"`` capsule: the address, shape and strides (elements) of the tensor.

    Consuming renames the capsule (``"used_dltensor"``, as the protocol says), so
    the producer's memory is kept until :meth:`release` calls its deleter.
    """

    def __init__(self, capsule: Any) -> None:
        address = _api.PyCapsule_GetPointer(capsule, b"dltensor")
        _api.PyCapsule_SetName(capsule, b"used_dltensor")
        self._managed = ctypes.cast(address, ctypes.POINTER(_DLManagedTensor))
        t = self._managed.contents.dl_tensor
        self.ptr = int(t.data or 0) + int(t.byte_offset)
        self.shape = tuple(int(t.shape[i]) for i in range(t.ndim))
        self.itemsize = t.dtype.bits // 8
        if t.strides:
            self.strides = tuple(int(t.strides[i]) * self.itemsize for i in range(t.ndim))
        else:  # NULL strides: C-contiguous
            self.strides = tuple(s * self.itemsize for s in np.empty(self.shape, np.uint8).strides)
        self.device = (int(t.device.device_type), int(t.device.device_id))
        self._released = False

    def release(self) -> None:
        """The consumer is done with the tensor (its stream work may still be queued): call the deleter."""
        if not self._released:
            self._released = True
            self._managed.contents.deleter(self._managed)


def memset_elements(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], value: int, stream: int) -> int:
    """Write ``value`` (32 bits) into every element of a strided int32 array, on ``stream``; return the call count.

    One ``cuMemsetD32Async`` for a C-contiguous array, else one per run of
    contiguous last-axis elements (one per element where the last axis is
    strided): a library that honours the strides writes nothing in the gaps.
    """
    if not all(shape):
        return 0
    word = int(value) & 0xFFFFFFFF
    c_strides = tuple(s * 4 for s in np.empty(shape, np.uint8).strides)
    if tuple(strides) == c_strides or len(shape) == 0:
        um.driver_call("cuMemsetD32Async", ptr, word, int(np.prod(shape)), stream, detail="fuzz consumer")
        return 1
    if strides[-1] == 4:
        run, outer, ostrides = shape[-1], shape[:-1], strides[:-1]
    else:
        run, outer, ostrides = 1, shape, strides
    calls = 0
    for idx in itertools.product(*(range(n) for n in outer)):
        offset = sum(i * s for i, s in zip(idx, ostrides, strict=True))
        um.driver_call("cuMemsetD32Async", ptr + offset, word, run, stream, detail="fuzz consumer")
        calls += 1
    return calls


def stream_wait_stream(waiter: int, producer: int) -> None:
    """Make ``waiter`` wait, on the device, for the work queued on ``producer`` so far (an event between them)."""
    event = um.driver_call("cuEventCreate", 2, detail="fuzz consumer")  # CU_EVENT_DISABLE_TIMING
    try:
        um.driver_call("cuEventRecord", event, producer, detail="fuzz consumer")
        um.driver_call("cuStreamWaitEvent", waiter, event, 0, detail="fuzz consumer")
    finally:
        um.driver_call("cuEventDestroy", event, detail="fuzz consumer")
