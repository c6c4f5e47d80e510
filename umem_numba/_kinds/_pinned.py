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

from .. import _driver
from .._arrays import _layout
from .._arrays._buffer import Buffer, cuda_core_source, host_source, new_layout, source_order
from .._arrays._copy import copy
from .._checks import as_int
from .._driver._location import StreamLike, stream_handle
from .._memory import _cache
from .._memory._lifetime import Allocation, DriverMemory, Transaction
from .._memory._pool import MemoryPool, check_pool
from .._memory._tracker import Tracker

__all__ = ["HostAllocFlags", "PinnedBuffer"]


class HostAllocFlags(enum.IntFlag):
    """Flags of ``cuMemHostAlloc``; combine with ``|``, test with ``in`` or ``&``.

    The values are the driver's ``CU_MEMHOSTALLOC_*`` (checked against
    ``cuda.bindings`` by the test suite), so the enum works without a driver.

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
    value = as_int(flags, "flags", "HostAllocFlags")
    if value & ~_ALL_FLAGS or value < 0:
        raise ValueError(f"unknown host allocation flag bits {value & ~_ALL_FLAGS:#x}")
    return HostAllocFlags(value)


def _alloc_pinned(size: int) -> int:
    """``cuMemHostAlloc`` of ``size`` bytes with the default flags (a new allocation for the cache)."""
    return int(_driver.call("cuMemHostAlloc", size, 0, detail=f"pinning {size} bytes of host memory"))


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

    With ``pool=`` (a ``MemoryPool("pinned")``) the memory comes from the
    driver's stream-ordered host pool, like a pool's device or managed
    memory: allocated on ``stream`` (host access waits for the stream to
    reach the allocation), freed stream-ordered, reused through the pool's
    free lists with the old buffer's coherence record, counted in
    ``stats()["pinned"]`` and the pool's statistics.  Kernels on the devices
    the pool grants access to (its own, :meth:`MemoryPool.set_access`) can
    use it directly.
    """

    __slots__ = ("_device_accessible", "_flags")
    _flags: HostAllocFlags
    _constructors = ("PinnedBuffer.empty", "PinnedBuffer.zeros", "PinnedBuffer.from_array")

    def _copy_extra(self, view: Buffer) -> None:
        assert isinstance(view, PinnedBuffer)
        view._flags = self._flags
        view._device_accessible = self._device_accessible

    @classmethod
    def empty(
        cls,
        shape: Any,
        dtype: Any = np.float64,
        flags: HostAllocFlags = HostAllocFlags.DEFAULT,
        *,
        order: str = "C",
        pool: MemoryPool | None = None,
        stream: StreamLike = 0,
    ) -> PinnedBuffer:
        """Allocate page-locked memory without initialising it.

        Parameters
        ----------
        shape : int or tuple of int
        dtype : numpy dtype
        flags : HostAllocFlags
            Any combination of PORTABLE, DEVICEMAP, WRITECOMBINED
            (``cuMemHostAlloc``'s; pool memory takes none).
        order : {"C", "F"}
            Row-major (default) or column-major (Fortran) element order.
        pool : MemoryPool, optional
            A ``"pinned"`` pool: the memory comes from it, stream-ordered on
            ``stream`` (see the class notes).
        stream : numba stream, 0 or None
            The allocation stream of a pool buffer (only with ``pool``;
            without one, only the default ``0`` / ``None``).

        Raises
        ------
        TypeError, ValueError
            Bad shape, dtype, order, flags, pool or stream (before any driver call).
        OutOfMemoryError
            The OS refused to lock that much memory.
        """
        order = _layout.check_order(order, "PinnedBuffer.empty")
        shape, dtype, nbytes, strides = new_layout(shape, dtype, order)
        flags = _as_flags(flags)
        if pool is not None:
            return cls._from_pool(pool, stream, shape, dtype, nbytes, strides, flags)
        if stream is not None and stream_handle(stream, what="PinnedBuffer.empty") != 0:
            raise ValueError("PinnedBuffer.empty: stream= is the allocation stream of pool memory; pass pool= too")
        device_id = _driver.ensure_context()
        if nbytes and not flags:
            # From the allocation cache (a closed buffer's page-locked memory of this size, idle), else new.
            cached, tracker = _cache.take_or_allocate("pinned", device_id, nbytes, _alloc_pinned, "cuMemFreeHost")
            alloc = Allocation("pinned", cached, cached.ptr, device_id, tracker or Tracker(device_id))
        else:
            alloc = cls._driver_allocation(nbytes, flags, device_id)
        buf = object.__new__(cls)
        buf._init(alloc, 0, shape, strides, dtype, True)
        buf._flags = flags
        buf._device_accessible = HostAllocFlags.DEVICEMAP in flags
        return buf

    @staticmethod
    def _driver_allocation(nbytes: int, flags: HostAllocFlags, device_id: int) -> Allocation:
        """A page-locked allocation of its own (flags other than the default, or zero bytes): freed at close."""
        ptr = 0
        device_ptr = None
        memory = None
        if nbytes:
            with Transaction() as tx:
                with _driver.capture_safe():  # beside a user's graph capture: allowed, and the capture goes on
                    ptr = int(
                        _driver.call(
                            "cuMemHostAlloc", nbytes, int(flags), detail=f"pinning {nbytes} bytes of host memory"
                        )
                    )
                memory = DriverMemory("pinned", ptr, nbytes, "cuMemFreeHost", device_id)
                tx.append(memory.free, None)
                if HostAllocFlags.DEVICEMAP in flags:
                    device_ptr = int(_driver.call("cuMemHostGetDevicePointer", ptr, 0))
                tx.commit()
        return Allocation("pinned", memory, ptr, device_id, Tracker(device_id), device_ptr=device_ptr)

    @classmethod
    def _from_pool(
        cls,
        pool: MemoryPool,
        stream: StreamLike,
        shape: tuple[int, ...],
        dtype: np.dtype,
        nbytes: int,
        strides: tuple[int, ...],
        flags: HostAllocFlags,
    ) -> PinnedBuffer:
        """A buffer of pinned pool memory, allocated on ``stream`` (see :meth:`empty`)."""
        check_pool(pool, "pinned", "PinnedBuffer.empty")
        if flags:
            raise ValueError(
                f"PinnedBuffer.empty: flags ({flags!r}) are cuMemHostAlloc's; pool memory takes none "
                "(devices reach it through the pool's access grants, MemoryPool.set_access)"
            )
        handle = stream_handle(stream, what="PinnedBuffer.empty")
        alloc = pool.allocation(nbytes, handle, "pinned", "PinnedBuffer.empty")
        buf = object.__new__(cls)
        buf._init(alloc, 0, shape, strides, dtype, True)
        buf._flags = flags
        buf._device_accessible = True  # the same address on the host and on the granted devices
        return buf

    @classmethod
    def zeros(
        cls,
        shape: Any,
        dtype: Any = np.float64,
        flags: HostAllocFlags = HostAllocFlags.DEFAULT,
        *,
        order: str = "C",
        pool: MemoryPool | None = None,
        stream: StreamLike = 0,
    ) -> PinnedBuffer:
        """Allocate and zero every byte (``nbytes``, not ``size``); arguments as in :meth:`empty`.

        Pool memory is zeroed on ``stream`` (``cuMemsetD8Async``, no host wait).
        """
        buf = cls.empty(shape, dtype, flags, order=order, pool=pool, stream=stream)
        if pool is not None:
            buf._fill_zero(stream_handle(stream, what="PinnedBuffer.zeros"))
            return buf
        alloc = buf._live()
        if alloc.nbytes:
            ctypes.memset(alloc.ptr, 0, alloc.nbytes)
        return buf

    @classmethod
    def from_array(
        cls,
        array: Any,
        flags: HostAllocFlags = HostAllocFlags.DEFAULT,
        *,
        order: str = "K",
        pool: MemoryPool | None = None,
        stream: StreamLike = 0,
    ) -> PinnedBuffer:
        """A pinned copy of ``array``; ``order="K"`` (default) keeps an F-ordered source's order.

        A cuda.core ``StridedMemoryView`` or ``Buffer`` of device memory is
        copied by DMA (host access to the new buffer waits for that copy).
        ``pool`` and ``stream`` as in :meth:`empty`; a host source is copied
        on the host once the stream has reached the allocation.
        """
        side, dev_order = cuda_core_source(array, order, "PinnedBuffer.from_array")
        if side is not None:
            buf = cls.empty(side.shape, side.dtype, flags, order=dev_order, pool=pool, stream=stream)
            try:
                copy(buf, array, stream_handle(stream, what="PinnedBuffer.from_array"))
            except BaseException:
                buf.close()
                raise
            return buf
        src = host_source(array)
        order = source_order(src, order, "PinnedBuffer.from_array")
        buf = cls.empty(src.shape, src.dtype, flags, order=order, pool=pool, stream=stream)
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
        if not alloc.nbytes or (alloc.memory is not None and alloc.memory.stream_ordered):
            return self._flags  # pool memory is not cuMemHostAlloc's: it has no such flags
        return HostAllocFlags(int(_driver.call("cuMemHostGetFlags", alloc.ptr)) & _ALL_FLAGS)

    def _repr_extra(self) -> str:
        return f", flags={self._flags!r}"

    # -- copies ------------------------------------------------------------------
    def copy_into(self, dst: Any, stream: StreamLike = 0) -> None:
        """Asynchronously copy this buffer into ``dst`` (a numba device array or a buffer).

        It was named ``copy_to_device(dst)``: numba's ``copy_to_device(ary)``
        copies the other way (from ``ary`` into the array), which
        :meth:`copy_to_device` now does here too (see the changelog).

        Raises
        ------
        ValueError
            Shapes or dtypes differ, or the sides are not contiguous in the same order.
        TypeError
            ``dst`` is neither a buffer nor a device array.
        """
        copy(dst, self, stream)

    def copy_from_device(self, src: Any, stream: StreamLike = 0) -> None:
        """Asynchronously copy ``src`` (a numba device array or a buffer) into this buffer.

        :meth:`copy_to_device` (numba's name) does the same, and also takes host arrays.
        """
        copy(self, src, stream)
