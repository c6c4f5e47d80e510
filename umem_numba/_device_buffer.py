"""DeviceBuffer: device memory from a stream-ordered :class:`~umem_numba.MemoryPool`."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _driver
from ._buffer import Buffer, new_layout
from ._location import StreamLike, stream_handle

__all__ = ["DeviceBuffer"]


class DeviceBuffer(Buffer):
    """An n-d array in device memory from a memory pool, usable by ``@cuda.jit`` kernels.

    Build one with :meth:`empty`, :meth:`zeros` or :meth:`from_array`.  The
    host cannot dereference it: read it with :meth:`copy_to_host` (DMA).

    Notes
    -----
    * Allocation and release are stream-ordered (see :mod:`umem_numba._pool`):
      use the buffer on its allocation stream, or order other streams after
      it; ``close()`` queues the free without synchronising.
    * Counted in ``umem_numba.stats()["device"]``.
    """

    __slots__ = ()

    _host_accessible = False

    @classmethod
    def empty(cls, shape: Any, dtype: Any = np.float32, *, pool: Any = None,
              stream: StreamLike = None) -> "DeviceBuffer":
        """Allocate without initialising.

        Parameters
        ----------
        shape : int or tuple of int
        dtype : numpy dtype
        pool : MemoryPool, optional
            A ``"device"`` pool; default: the current device's default pool.
        stream : numba stream, 0 or None
            The allocation stream.

        Raises
        ------
        TypeError, ValueError
            Bad shape, dtype or pool (before any driver call).
        OutOfMemoryError
            The pool cannot provide that much.
        """
        from ._pool import check_pool, default_pool

        shape, dtype, nbytes, strides = new_layout(shape, dtype)
        if pool is not None:
            check_pool(pool, "device", "DeviceBuffer.empty")
        handle = stream_handle(stream)
        device_id = _driver.ensure_context()
        if pool is None:
            pool = default_pool("device", device_id)
        if nbytes:
            alloc = pool._allocation(nbytes, handle, "device")
        else:
            from ._buffer import Allocation
            alloc = Allocation("device", 0, 0, pool.device_id, None)
        buf = object.__new__(cls)
        buf._init(alloc, 0, shape, strides, dtype, True)
        return buf

    @classmethod
    def zeros(cls, shape: Any, dtype: Any = np.float32, *, pool: Any = None,
              stream: StreamLike = None) -> "DeviceBuffer":
        """Allocate and zero on the device (``cuMemsetD8Async`` on ``stream``)."""
        from . import _events
        buf = cls.empty(shape, dtype, pool=pool, stream=stream)
        if buf.nbytes:
            alloc = buf._live()
            handle = stream_handle(stream)
            with _driver.device_context(alloc.device_id if handle == 0 else None) as dev:
                _driver.call("cuMemsetD8Async", alloc.ptr, 0, buf.nbytes, handle, detail="zeroing a DeviceBuffer")
                alloc.tracker.add(handle, _events.record(handle, dev))
        return buf

    @classmethod
    def from_array(cls, array: Any, *, pool: Any = None, stream: StreamLike = None) -> "DeviceBuffer":
        """A new buffer holding a copy of ``array`` (DMA on ``stream``)."""
        src = np.asarray(array)
        if src.dtype.hasobject:
            raise TypeError("DeviceBuffer.from_array: object arrays cannot live in device memory")
        buf = cls.empty(src.shape, src.dtype, pool=pool, stream=stream)
        buf.copy_from_host(src, stream=stream)
        return buf
