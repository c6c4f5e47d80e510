"""Pinned (page-locked) host memory from ``cuMemHostAlloc``.

Pinned memory is locked out of the operating system's paging: it makes
host<->device copies fast and asynchronous, but every byte of it is taken from
what the rest of the machine can use.  Allocate what you stream through, not
whole datasets, and watch ``umem_numba.stats()["pinned"]``.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Any

import numpy as np

from . import _driver, _events
from ._buffer import Allocation, Buffer, _check_same, new_layout
from ._location import StreamLike, stream_handle

__all__ = ["HostAllocFlags", "PinnedBuffer"]


class HostAllocFlags(enum.IntFlag):
    """Flags of ``cuMemHostAlloc``; combine with ``|``, test with ``in`` or ``&``.

    Attributes
    ----------
    DEFAULT
        Page-locked, usable for fast copies in the allocating context.
    PORTABLE
        Pinned for every CUDA context, not only the allocating one.
    DEVICEMAP
        Also mapped into the device address space: kernels can read and write
        it over the bus (the buffer then has ``__cuda_array_interface__``).
    WRITECOMBINED
        Write-combined: faster for the device to read over PCIe, very slow for
        the host to read.  Use for host-write-once, device-read buffers.
    """

    DEFAULT = 0
    PORTABLE = 1
    DEVICEMAP = 2
    WRITECOMBINED = 4


_ALL_FLAGS = int(HostAllocFlags.PORTABLE | HostAllocFlags.DEVICEMAP | HostAllocFlags.WRITECOMBINED)


def _as_flags(flags: Any) -> HostAllocFlags:
    if isinstance(flags, bool) or not isinstance(flags, int):
        raise TypeError(f"flags must be HostAllocFlags, got {type(flags).__name__}")
    if int(flags) & ~_ALL_FLAGS:
        raise ValueError(f"unknown host allocation flag bits {int(flags) & ~_ALL_FLAGS:#x}")
    return HostAllocFlags(flags)


def _device_view(obj: Any, what: str) -> tuple[int, tuple[int, ...], np.dtype, Any]:
    """``(device pointer, shape, dtype, tracker)`` of a contiguous device-side array."""
    from ._buffer import Buffer as _Buf

    if isinstance(obj, _Buf):
        if not obj.is_c_contiguous:
            raise ValueError(f"{what}: the buffer view must be C-contiguous")
        alloc = obj._live()
        return obj.ptr, obj.shape, obj.dtype, alloc.tracker
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is None:
        raise TypeError(f"{what}: expected a numba device array or a umem_numba buffer, "
                        f"got {type(obj).__name__}")
    shape = tuple(iface["shape"])
    dtype = np.dtype(iface["typestr"]) if not iface.get("descr") or len(iface["descr"]) == 1 \
        else np.dtype(iface["descr"])
    strides = iface.get("strides")
    if strides is not None:
        from ._layout import c_strides
        if tuple(strides) != c_strides(shape, dtype.itemsize):
            raise ValueError(f"{what}: the device array must be C-contiguous")
    return int(iface["data"][0]), shape, dtype, None


class PinnedBuffer(Buffer):
    """An n-d array in page-locked host memory.

    Build one with the constructors :meth:`empty`, :meth:`zeros` and
    :meth:`from_array`.

    Notes
    -----
    Copies to and from device arrays are asynchronous on the given stream;
    host access to the pinned buffer waits for them (coherence), so a host
    write can never race an upload still reading the buffer.  With
    :attr:`HostAllocFlags.DEVICEMAP` kernels can use the buffer directly.
    """

    __slots__ = ("_flags",)

    def _copy_extra(self, view: Buffer) -> None:
        view._flags = self._flags  # type: ignore[attr-defined]

    @property
    def _device_accessible(self) -> bool:  # type: ignore[override]
        return HostAllocFlags.DEVICEMAP in self._flags

    @classmethod
    def empty(cls, shape: Any, dtype: Any = np.float32,
              flags: HostAllocFlags = HostAllocFlags.DEFAULT) -> "PinnedBuffer":
        """Allocate page-locked memory without initialising it.

        Parameters
        ----------
        shape : int or tuple of int
        dtype : numpy dtype
        flags : HostAllocFlags
            Any combination of PORTABLE, DEVICEMAP, WRITECOMBINED.

        Raises
        ------
        OutOfMemoryError
            The OS refused to lock that much memory.
        """
        shape, dtype, nbytes, strides = new_layout(shape, dtype)
        flags = _as_flags(flags)
        device_id = _driver.ensure_context()
        device_ptr = None
        if nbytes:
            ptr = int(_driver.call("cuMemHostAlloc", nbytes, int(flags),
                                   detail=f"pinning {nbytes} bytes of host memory"))
            drv = _driver.api().drv

            def free(ptr: int = ptr) -> None:
                _driver.check(drv.cuMemFreeHost(ptr), "cuMemFreeHost")

            if HostAllocFlags.DEVICEMAP in flags:
                try:
                    device_ptr = int(_driver.call("cuMemHostGetDevicePointer", ptr, 0))
                except BaseException:
                    free()
                    raise
        else:
            ptr, free = 0, None
        alloc = Allocation("pinned", ptr, nbytes, device_id, free, device_ptr=device_ptr)
        buf = object.__new__(cls)
        buf._init(alloc, 0, shape, strides, dtype, True)
        buf._flags = flags
        return buf

    @classmethod
    def zeros(cls, shape: Any, dtype: Any = np.float32,
              flags: HostAllocFlags = HostAllocFlags.DEFAULT) -> "PinnedBuffer":
        """Allocate and zero every byte (``nbytes``, not ``size``)."""
        buf = cls.empty(shape, dtype, flags)
        alloc = buf._live()
        if alloc.nbytes:
            ctypes.memset(alloc.ptr, 0, alloc.nbytes)
        return buf

    @classmethod
    def from_array(cls, array: Any, flags: HostAllocFlags = HostAllocFlags.DEFAULT) -> "PinnedBuffer":
        """A pinned copy of ``array``."""
        src = np.asarray(array)
        buf = cls.empty(src.shape, src.dtype, flags)
        if buf.size:
            np.copyto(buf._host_array("from_array"), src)
        return buf

    @property
    def flags(self) -> HostAllocFlags:
        """The flags the memory was allocated with."""
        return self._flags

    @property
    def driver_flags(self) -> HostAllocFlags:
        """The flags as the driver reports them (``cuMemHostGetFlags``)."""
        alloc = self._live()
        if not alloc.nbytes:
            return self._flags
        return HostAllocFlags(int(_driver.call("cuMemHostGetFlags", alloc.ptr)) & _ALL_FLAGS)

    def _repr_extra(self) -> str:
        return f", flags={self._flags!r}"

    # -- copies ------------------------------------------------------------------
    def copy_to_device(self, dst: Any, stream: StreamLike = 0) -> None:
        """Asynchronously copy this buffer into ``dst`` (a numba device array or a buffer).

        Raises
        ------
        ValueError
            Shapes or dtypes differ, or either side is not C-contiguous.
        """
        self._copy(dst, "copy_to_device", to_device=True, stream=stream)

    def copy_from_device(self, src: Any, stream: StreamLike = 0) -> None:
        """Asynchronously copy ``src`` (a numba device array or a buffer) into this buffer."""
        self._copy(src, "copy_from_device", to_device=False, stream=stream)

    def _copy(self, other: Any, what: str, *, to_device: bool, stream: StreamLike) -> None:
        alloc = self._live()
        if not self.is_c_contiguous:
            raise ValueError(f"{what}: the pinned buffer view must be C-contiguous")
        dptr, shape, dtype, other_tracker = _device_view(other, what)
        _check_same(self._shape, self._dtype, shape, dtype, what)
        handle = stream_handle(stream)
        # Work already queued on either side, on other streams, comes first;
        # host access to either side afterwards waits for this copy.
        alloc.tracker.order_before(handle, what)
        if other_tracker is not None:
            other_tracker.order_before(handle, what)
        nbytes = self.nbytes
        if nbytes:
            hptr = alloc.ptr + self._offset
            src, dst = (hptr, dptr) if to_device else (dptr, hptr)
            _driver.call("cuMemcpyAsync", dst, src, nbytes, handle, detail=what)
            event = _events.record(handle, alloc.device_id)
            alloc.tracker.add(handle, event)
            if other_tracker is not None:
                other_tracker.add(handle, event)
