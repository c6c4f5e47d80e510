"""DeviceBuffer: device memory from a stream-ordered :class:`~umem_numba.MemoryPool`."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _driver
from .._arrays import _layout
from .._arrays._buffer import Buffer, cuda_core_source, host_source, like_layout, new_layout, source_order
from .._driver._location import StreamLike, stream_handle
from .._memory._pool import MemoryPool, check_pool, default_pool, existing_default_pool
from .._memory._tracker import refuse_capture

__all__ = ["DeviceBuffer", "device_empty", "device_from", "device_like", "device_zeros"]


class DeviceBuffer(Buffer):
    """An n-d array in device memory from a memory pool, usable by ``@cuda.jit`` kernels.

    Build one with :meth:`empty`, :meth:`zeros` or :meth:`from_array`.  The
    host cannot dereference it: read it with :meth:`copy_to_host` (DMA).

    Notes
    -----
    * Allocation and release are stream-ordered (see :doc:`/concepts/pools`):
      use the buffer on its allocation stream, or order other streams after
      it; ``close()`` queues the free without synchronising.
    * Counted in ``umem_numba.stats()["device"]``.
    """

    __slots__ = ()

    _host_accessible = False
    _constructors = ("DeviceBuffer.empty", "DeviceBuffer.zeros", "DeviceBuffer.from_array")

    @classmethod
    def empty(
        cls,
        shape: Any,
        dtype: Any = np.float64,
        *,
        pool: MemoryPool | None = None,
        stream: StreamLike = 0,
        order: str = "C",
    ) -> DeviceBuffer:
        """Allocate without initialising.

        Parameters
        ----------
        shape : int or tuple of int
        dtype : numpy dtype
        pool : MemoryPool, optional
            A ``"device"`` pool; default: the current device's default pool.
        stream : numba stream, 0 or None
            The allocation stream (``0``, the default, or ``None``: the
            legacy default stream).
        order : {"C", "F"}
            Row-major (default) or column-major (Fortran) element order.

        Raises
        ------
        TypeError, ValueError
            Bad shape, dtype, order or pool (before any driver call).
        OutOfMemoryError
            The pool cannot provide that much.
        """
        if order != "C":
            order = _layout.check_order(order, "DeviceBuffer.empty")
        shape, dtype, nbytes, strides = new_layout(shape, dtype, order)
        if pool is not None:
            check_pool(pool, "device", "DeviceBuffer.empty")
            alloc = pool.allocation(nbytes, stream, "device", "DeviceBuffer.empty")  # parses the stream
        else:
            handle = stream_handle(stream, what="DeviceBuffer.empty")  # a bad stream before any driver call
            device_id = _driver.ensure_context()
            pool = existing_default_pool("device", device_id)
            if pool is None:
                refuse_capture(handle, "DeviceBuffer.empty")  # before the default pool is made
                pool = default_pool("device", device_id)
            alloc = pool.allocation(nbytes, handle, "device", "DeviceBuffer.empty")  # refuses a capture first
        buf = object.__new__(cls)
        buf._init(alloc, 0, shape, strides, dtype, True)
        return buf

    @classmethod
    def zeros(
        cls,
        shape: Any,
        dtype: Any = np.float64,
        *,
        pool: MemoryPool | None = None,
        stream: StreamLike = 0,
        order: str = "C",
    ) -> DeviceBuffer:
        """Allocate and zero on the device (``cuMemsetD8Async`` on ``stream``)."""
        handle = stream_handle(stream, what="DeviceBuffer.zeros")
        _driver.ensure_context()
        refuse_capture(handle, "DeviceBuffer.zeros")  # before allocating on the stream: a capture stays intact
        buf = cls.empty(shape, dtype, pool=pool, stream=handle, order=order)
        buf._fill_zero(handle)
        return buf

    @classmethod
    def from_array(
        cls, array: Any, *, pool: MemoryPool | None = None, stream: StreamLike = 0, order: str = "K"
    ) -> DeviceBuffer:
        """A new buffer holding a copy of ``array`` (DMA on ``stream``); ``order="K"`` keeps an F source's order."""
        side, dev_order = cuda_core_source(array, order, "DeviceBuffer.from_array")
        if side is not None:  # a cuda.core Buffer or view of device memory: one DMA copy
            buf = cls.empty(side.shape, side.dtype, pool=pool, stream=stream, order=dev_order)
            try:
                buf.copy_from_host(array, stream=stream)
            except BaseException:
                buf.close()
                raise
            return buf
        src = host_source(array)
        if src.dtype.hasobject:
            raise TypeError("DeviceBuffer.from_array: object arrays cannot live in device memory")
        order = source_order(src, order, "DeviceBuffer.from_array")
        handle = stream_handle(stream, what="DeviceBuffer.from_array")
        _driver.ensure_context()
        refuse_capture(handle, "DeviceBuffer.from_array")  # before allocating on the stream
        buf = cls.empty(src.shape, src.dtype, pool=pool, stream=handle, order=order)
        buf.copy_from_host(src, stream=handle)
        return buf


def device_empty(
    shape: Any, dtype: Any = np.float64, *, pool: MemoryPool | None = None, stream: StreamLike = 0, order: str = "C"
) -> DeviceBuffer:
    """Shortcut for :meth:`DeviceBuffer.empty` (numba's ``cuda.device_array``)."""
    return DeviceBuffer.empty(shape, dtype, pool=pool, stream=stream, order=order)


def device_zeros(
    shape: Any, dtype: Any = np.float64, *, pool: MemoryPool | None = None, stream: StreamLike = 0, order: str = "C"
) -> DeviceBuffer:
    """Shortcut for :meth:`DeviceBuffer.zeros` (a ``cuMemsetD8Async`` on ``stream``)."""
    return DeviceBuffer.zeros(shape, dtype, pool=pool, stream=stream, order=order)


def device_like(
    array: Any, *, pool: MemoryPool | None = None, stream: StreamLike = 0, order: str = "K"
) -> DeviceBuffer:
    """An uninitialised :class:`DeviceBuffer` with ``array``'s shape and dtype (numba's ``cuda.device_array_like``).

    ``array`` is anything with ``shape`` and ``dtype`` (a buffer, a numba or
    numpy array; nothing is read from it) or that ``np.asarray`` takes.
    ``order="K"`` (default) keeps the order of an F-ordered ``array``; the
    other arguments are :meth:`DeviceBuffer.empty`'s.
    """
    shape, dtype, order = like_layout(array, order, "device_like")
    return DeviceBuffer.empty(shape, dtype, pool=pool, stream=stream, order=order)


def device_from(
    array: Any, *, pool: MemoryPool | None = None, stream: StreamLike = 0, order: str = "K"
) -> DeviceBuffer:
    """Shortcut for :meth:`DeviceBuffer.from_array` (numba's ``cuda.to_device``)."""
    return DeviceBuffer.from_array(array, pool=pool, stream=stream, order=order)
