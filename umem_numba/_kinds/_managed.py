"""Managed (unified) memory: ``cuMemAllocManaged`` buffers that kernels and the host share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _driver
from .._arrays import _layout
from .._arrays._buffer import Buffer, cuda_core_source, host_source, like_layout, new_layout, source_order
from .._arrays._copy import copy
from .._driver._location import Location, StreamLike, Target, as_location, stream_handle
from .._hints._advice import ManagedMemoryHints, MigrationPolicy
from .._hints._prefetch import discard, discard_prefetch, prefetch
from .._memory import _cache
from .._memory._lifetime import Allocation, DriverMemory
from .._memory._pool import MemoryPool, check_pool
from .._memory._tracker import DeviceUse, Tracker, refuse_capture

__all__ = ["ManagedBuffer", "managed_empty", "managed_from", "managed_like", "managed_zeros"]

_ATTACH_NAMES = ("global", "host")


def _check_attach(attach: Any) -> str:
    if not isinstance(attach, str) or attach not in _ATTACH_NAMES:
        raise ValueError(f"attach must be 'global' or 'host', got {attach!r}")
    return attach


def _attach_flag(attach: str) -> int:
    c = _driver.consts()
    return c.attach_global if attach == "global" else c.attach_host


def _alloc_managed(size: int) -> int:
    """``cuMemAllocManaged`` of ``size`` bytes, attached globally (a new allocation for the cache)."""
    return int(
        _driver.call(
            "cuMemAllocManaged",
            size,
            _attach_flag("global"),
            detail=f"allocating {size} bytes of managed memory",
        )
    )


#: ``from_array`` copies host data of at least this many bytes by DMA (see :meth:`ManagedBuffer.from_array`).
#: Measured on an H100 (2026-11-27), a new buffer then a kernel and ``copy_to_host``: DMA took 0.93x
#: the host copy's time at 64 KiB, 0.85x at 256 KiB, 0.69x at 1 MiB; a buffer only read on the host
#: took 2.9x at 256 KiB (its pages come back).  From 256 KiB on, the kernel's gain is worth that.
FROM_ARRAY_DMA_MIN_BYTES = 256 << 10


class ManagedBuffer(Buffer):
    """An n-d array in managed (unified) memory, usable by ``@cuda.jit`` kernels and the host.

    Build one with :meth:`empty`, :meth:`zeros`, :meth:`from_array` (or the
    ``managed_*`` shortcuts).  Pass it to a kernel as it is; read it on the
    host through :attr:`host` or ``np.asarray``.

    Notes
    -----
    * Memory comes from the current device's context (numba's), C order.
    * Zero-size shapes are valid: no driver memory is allocated, ``ptr`` is 0
      and kernels receive an empty array.
    * Sizes are checked before any driver call; a request the device cannot
      satisfy raises :class:`~umem_numba.OutOfMemoryError`.
    * Host access waits for kernels that may still use the buffer (see
      :mod:`umem_numba` coherence); ``with buf:`` closes it at the end.

    Examples
    --------
    >>> @cuda.jit                                                         # doctest: +SKIP
    ... def double(a):
    ...     i = cuda.grid(1)
    ...     if i < a.shape[0]:
    ...         a[i] *= 2
    >>> buf = ManagedBuffer.from_array(np.arange(8, dtype=np.float32))  # doctest: +SKIP
    >>> double[1, 8](buf)                                                 # doctest: +SKIP
    >>> buf.host                                                          # doctest: +SKIP
    array([ 0.,  2.,  4.,  6.,  8., 10., 12., 14.], dtype=float32)
    """

    __slots__ = ()
    _constructors = ("ManagedBuffer.empty", "ManagedBuffer.zeros", "ManagedBuffer.from_array")
    _migrates_on_launch = True  # the next launch after host access prefetches it (set_auto_prefetch)

    # -- constructors ------------------------------------------------------------
    @classmethod
    def empty(
        cls,
        shape: Any,
        dtype: Any = np.float64,
        *,
        attach: str = "global",
        pool: MemoryPool | None = None,
        stream: StreamLike = 0,
        prefetch: Target | None = None,
        order: str = "C",
    ) -> ManagedBuffer:
        """Allocate without initialising.

        Parameters
        ----------
        shape : int or tuple of int
            Dimensions; zero is allowed, negative is not.
        dtype : numpy dtype
            Any fixed-size dtype (default ``float64``, as numpy's and numba's).
        attach : {"global", "host"}
            ``"global"``: any stream on any device may access it.  ``"host"``:
            attached to the host until a stream attaches it (only matters on
            devices without concurrentManagedAccess).
        pool : MemoryPool, optional
            A ``"managed"`` :class:`~umem_numba.MemoryPool` to allocate from
            (stream-ordered, see :doc:`/concepts/pools`); ``attach`` must then
            be ``"global"``.
        stream : numba stream, 0 or None
            The allocation stream of a pool buffer, and the stream of the
            ``prefetch`` (otherwise unused); ``0`` (default) or ``None``:
            the legacy default stream.
        prefetch : numba device, int, "cpu"/"cpu:N" or Location, optional
            Prefetch the new memory there on ``stream`` (like RMM's
            ``PrefetchResourceAdaptor``): stream-ordered, tracked like
            :meth:`prefetch`, and read back as the buffer's
            ``hints.last_prefetch_location``.  The target is checked before
            anything is allocated.
        order : {"C", "F"}
            Row-major (default) or column-major (Fortran) element order.
            Kernels see an F-ordered buffer as ``array(..., "F")``; element
            ranges (advice, prefetch) count in memory order.

        Returns
        -------
        ManagedBuffer

        Raises
        ------
        TypeError, ValueError
            Bad shape, dtype, attach value or prefetch target (before any
            driver call).
        UnsupportedError
            ``prefetch`` to a device without concurrentManagedAccess.
        OutOfMemoryError
            The driver cannot provide that much managed memory.
        CudaUnavailableError
            No GPU or driver.
        """
        if order != "C":
            order = _layout.check_order(order, "ManagedBuffer.empty")
        if prefetch is not None:
            new_layout(shape, dtype)  # a bad shape is reported before a bad target
            loc = _prefetch_target(prefetch, "ManagedBuffer.empty")
            buf = cls.empty(shape, dtype, attach=attach, pool=pool, stream=stream, order=order)
            buf._prefetch_new(loc, stream)
            return buf
        shape, dtype, nbytes, strides = new_layout(shape, dtype, order)
        if attach != "global":
            attach = _check_attach(attach)
        if pool is not None:
            # The pool path is a hot loop for some programs: every check is inline or one call.
            check_pool(pool, "managed", "ManagedBuffer.empty")
            if attach != "global":
                raise ValueError(
                    "ManagedBuffer.empty: pool memory is attached globally; attach='host' needs a pool-less buffer"
                )
            alloc = pool.allocation(nbytes, stream, "managed", "ManagedBuffer.empty")  # parses the stream
            buf = object.__new__(cls)
            buf._init(alloc, 0, shape, strides, dtype, True)
            return buf
        device_id = _driver.ensure_context()
        if nbytes and attach == "global":
            # From the allocation cache (a closed buffer's allocation of this size, idle), else new.
            cached, tracker = _cache.take_or_allocate("managed", device_id, nbytes, _alloc_managed, "cuMemFree")
            if tracker is None:
                tracker = Tracker(device_id, _driver.concurrent_managed_access(device_id))
            alloc = Allocation("managed", cached, cached.ptr, device_id, tracker)
            buf = object.__new__(cls)
            buf._init(alloc, 0, shape, strides, dtype, True)
            return buf
        # Zero bytes, or attached to the host (driver state a later buffer must not inherit): uncached.
        tracker = Tracker(device_id, _driver.concurrent_managed_access(device_id))
        memory = None
        ptr = 0
        if nbytes:
            with _driver.capture_safe():  # beside a user's graph capture: allowed, and the capture goes on
                ptr = int(
                    _driver.call(
                        "cuMemAllocManaged",
                        nbytes,
                        _attach_flag(attach),
                        detail=f"allocating {nbytes} bytes of managed memory for {shape} {dtype}",
                    )
                )
            memory = DriverMemory("managed", ptr, nbytes, "cuMemFree", device_id)
        alloc = Allocation("managed", memory, ptr, device_id, tracker)
        if attach == "host":
            alloc.tracker.attached = "host"
        buf = object.__new__(cls)
        buf._init(alloc, 0, shape, strides, dtype, True)
        return buf

    @classmethod
    def zeros(
        cls,
        shape: Any,
        dtype: Any = np.float64,
        *,
        attach: str = "global",
        stream: StreamLike = 0,
        pool: MemoryPool | None = None,
        prefetch: Target | None = None,
        order: str = "C",
    ) -> ManagedBuffer:
        """Allocate and zero on the device (``cuMemsetD8Async`` on ``stream``).

        The memset is tracked like a kernel: host access waits for it.  With
        ``pool``, ``stream`` is also the allocation stream; ``prefetch``
        migrates the zeroed memory to a target on ``stream`` after the
        memset (see :meth:`empty`); ``order`` as in :meth:`empty`.
        """
        handle = stream_handle(stream, what="ManagedBuffer.zeros")
        order = _layout.check_order(order, "ManagedBuffer.zeros")
        loc = None if prefetch is None else _prefetch_target(prefetch, "ManagedBuffer.zeros", shape, dtype)
        _driver.ensure_context()
        refuse_capture(handle, "ManagedBuffer.zeros")  # before allocating: a capture stays intact
        buf = cls.empty(shape, dtype, attach=attach, pool=pool, stream=handle, order=order)
        buf._fill_zero(handle)
        if loc is not None:
            buf._prefetch_new(loc, handle)
        return buf

    @classmethod
    def from_array(
        cls,
        array: Any,
        *,
        attach: str = "global",
        pool: MemoryPool | None = None,
        stream: StreamLike = 0,
        prefetch: Target | None = None,
        order: str = "K",
    ) -> ManagedBuffer:
        """A new buffer holding a copy of ``array`` (any layout).

        Parameters
        ----------
        array : array_like, cuda.core Buffer or StridedMemoryView
            Host data, converted with ``np.asarray`` (no object dtypes); or a
            cuda.core ``StridedMemoryView`` / ``Buffer`` (bytes, stored as
            ``uint8``) of device-accessible memory, copied by DMA on
            ``stream`` (the source must stay unchanged until that copy is
            done).
        attach, pool, stream
            As in :meth:`empty`.
        prefetch : numba device, int, "cpu"/"cpu:N" or Location, optional
            Prefetch the filled buffer there on ``stream`` (see :meth:`empty`).
        order : {"K", "C", "F"}
            ``"K"`` (default) keeps an F-ordered source's order and stores
            anything else C-ordered; ``"C"`` or ``"F"`` forces one.

        Notes
        -----
        Host data of 256 KiB or more goes to a ``"global"`` buffer by DMA on
        ``stream``, as :meth:`copy_from_host` copies it: the new pages are
        placed on the device first, so the copy engine writes device memory
        and the next kernel finds the data there (at DMA speed, where a host
        copy into new managed memory faults every page in on the CPU).  The
        copy is tracked like any other: host access waits for it.  Smaller
        arrays, ``attach="host"`` buffers, ``prefetch="cpu"`` and devices
        without concurrentManagedAccess are copied on the host.
        """
        what = "ManagedBuffer.from_array"
        side, dev_order = cuda_core_source(array, order, what)
        if side is not None:  # a cuda.core Buffer or view of device memory: one DMA copy on ``stream``
            loc = None if prefetch is None else _prefetch_target(prefetch, what, side.shape, side.dtype)
            buf = cls.empty(side.shape, side.dtype, attach=attach, pool=pool, stream=stream, order=dev_order)
            _copy_into(buf, array, stream)
        else:
            src = host_source(array)
            order = source_order(src, order, what)
            loc = None if prefetch is None else _prefetch_target(prefetch, what, src.shape, src.dtype)
            buf = cls.empty(src.shape, src.dtype, attach=attach, pool=pool, stream=stream, order=order)
            if (
                buf.nbytes >= FROM_ARRAY_DMA_MIN_BYTES
                and attach == "global"
                and buf._alloc.tracker.concurrent  # type: ignore[union-attr]
                and (loc is None or loc.kind == "device")
            ):
                # The copy engine writes the pages where the device reads them (the copy layer
                # prefetches new memory to the device first): a host copy would fault every page in
                # on the CPU (4.4 GB/s for 256 MiB on an H100, against 29 GB/s by DMA).
                try:
                    buf.copy_from_host(src, stream=stream)
                except BaseException:
                    buf.close()
                    raise
            elif buf.size:
                np.copyto(buf._host_array("from_array", prefetch=False), src)
        if loc is not None:
            buf._prefetch_new(loc, stream)
        return buf

    def _prefetch_new(self, loc: Location, stream: StreamLike) -> None:
        """The ``prefetch=`` of a constructor: the new buffer is closed again if it fails."""
        if not self.size:
            return  # nothing to migrate
        try:
            prefetch(self, loc, stream)
        except BaseException:
            self.close()
            raise

    def _repr_extra(self) -> str:
        return f", attached_to={self.attached_to!r}"

    # -- advice and prefetch (umem_numba._hints._advice, umem_numba._hints._prefetch) -------------
    @property
    def hints(self) -> ManagedMemoryHints:
        """Advice for the whole buffer, read live from the driver (see :class:`ManagedMemoryHints`).

        ``buf.hints.range(start, stop)`` narrows it to elements ``[start, stop)``.
        """
        return ManagedMemoryHints(self)

    def apply_policy(self, policy: MigrationPolicy) -> None:
        """Make ``policy``'s advice, and only it, be in effect (see :meth:`ManagedMemoryHints.apply_policy`)."""
        self.hints.apply_policy(policy)

    def prefetch(self, target: Target, stream: StreamLike = None) -> None:
        """Migrate the buffer to ``target`` (a device, an ordinal, ``"cpu"``, ``"cpu:N"``) asynchronously.

        Host access waits for the prefetch (coherence).  Raises
        :class:`~umem_numba.UnsupportedError` where the target device or the
        stream's device lacks concurrentManagedAccess.
        """
        prefetch(self, target, stream)

    def prefetch_range(self, start: int, stop: int, target: Target, stream: StreamLike = None) -> None:
        """Prefetch elements ``[start, stop)`` of the flat buffer, in memory order (no negative wrap-around)."""
        prefetch(self, target, stream, start, stop)

    def discard(self, stream: StreamLike = None) -> None:
        """Tell the driver the contents are no longer needed (``cuMemDiscardBatchAsync``, on ``stream``).

        The pages may be dropped: a later migration of them moves no data,
        and reading an element before writing it gives an indeterminate
        value.  Tracked as a write (ordered after every earlier use; host
        access and later work wait for it).  Use it on scratch data whose
        values are about to be overwritten, before it would otherwise
        migrate (see :doc:`/concepts/hints-prefetch`).

        Raises
        ------
        UnsupportedError
            cuda-bindings or the driver older than CUDA 13, or a device of
            the system without concurrentManagedAccess.
        """
        discard(self, stream)

    def discard_range(self, start: int, stop: int, stream: StreamLike = None) -> None:
        """Discard elements ``[start, stop)`` (the convention of :meth:`prefetch_range`)."""
        discard(self, stream, start, stop)

    def discard_prefetch(self, target: Target, stream: StreamLike = None) -> None:
        """Discard the contents and prefetch the pages to ``target`` (``cuMemDiscardAndPrefetchBatchAsync``).

        The buffer ends up resident at ``target`` without its old values
        travelling: for memory that is about to be overwritten there.
        Errors as in :meth:`discard` and :meth:`prefetch`.
        """
        discard_prefetch(self, target, stream)

    def discard_prefetch_range(self, start: int, stop: int, target: Target, stream: StreamLike = None) -> None:
        """:meth:`discard_prefetch` of elements ``[start, stop)``."""
        discard_prefetch(self, target, stream, start, stop)

    # -- host holds ----------------------------------------------------------------
    @contextlib.contextmanager
    def on_host(self) -> Iterator[np.ndarray]:
        """Hold the buffer for host use: yields the host view.

        Pending device work is settled on entry.  While the block runs, a
        launch that uses the buffer (through the toolkit, or a plain numba
        launch) raises :class:`~umem_numba.CoherenceError` before launching.
        """
        alloc = self._live()
        if alloc.tracker.writes:
            self._prefetch_for_host(alloc)  # the hold waits for the device: the pages come by prefetch
        alloc.tracker.hold("on_host (host hold)")
        try:
            yield self._host_array("host hold")
        finally:
            alloc.tracker.release_hold()

    # -- stream attachment ----------------------------------------------------------
    def attach(self, to: Any = "global", *, stream: StreamLike = None) -> None:
        """Attach the allocation to a stream, the host, or all streams (``cuStreamAttachMemAsync``).

        Parameters
        ----------
        to : numba stream, "host" or "global"
            A stream: only work on that stream may access the memory (on
            devices without concurrentManagedAccess, host access then waits
            for that stream only, not the whole device).  ``"host"``: no
            device access until re-attached.  ``"global"``: any stream.
        stream : numba stream, optional
            The stream the attach operation is ordered on; defaults to the
            stream being attached to, else the default stream.

        Notes
        -----
        Attachment applies to the whole allocation, also when called on a
        view.  On devices *with* concurrentManagedAccess (Pascal and newer on
        Linux) it only affects the driver's migration heuristics; host access
        is still checked against recorded work.
        """
        alloc = self._live()
        target: str | int | None
        if isinstance(to, str):
            if to not in _ATTACH_NAMES:
                raise ValueError(f"attach target must be a stream, 'host' or 'global', got {to!r}")
            target = None if to == "global" else "host"
            handle = stream_handle(stream, what="attach")
            flag = None
        else:
            target = stream_handle(to, what="attach")
            if target == 0:
                raise ValueError(
                    "cannot attach to the legacy default stream (handle 0): pass a created stream, 'host' or 'global'"
                )
            handle = target if stream is None else stream_handle(stream, what="attach")
        if not alloc.nbytes:
            alloc.tracker.attached = target
            return
        flag = _attach_flag(to) if isinstance(to, str) else _driver.consts().attach_single
        what = f"attaching a managed buffer to {to!r}"
        with _driver.device_context(alloc.device_id), DeviceUse([(alloc.tracker, True)], handle, what):
            _driver.call("cuStreamAttachMemAsync", handle, alloc.ptr, 0, flag, detail=what)
        alloc.tracker.attached = target
        if alloc.memory is not None:
            alloc.memory.note_advice()  # driver state of the memory: no later buffer may inherit it

    @property
    def attached_to(self) -> str | int:
        """Current attachment: ``"global"``, ``"host"`` or the stream handle (an int)."""
        target = self._live().tracker.attached
        return "global" if target is None else target


def _copy_into(buf: Buffer, source: Any, stream: StreamLike) -> None:
    """A constructor's DMA copy from a device source; the new buffer is closed again if it fails."""
    try:
        copy(buf, source, stream)
    except BaseException:
        buf.close()
        raise


def _prefetch_target(target: Target, what: str, shape: Any = None, dtype: Any = None) -> Location:
    """Check a constructor's ``prefetch=`` target before anything is allocated."""
    if shape is not None:
        new_layout(shape, dtype)  # a bad shape is reported before a bad target
    what = f"{what}(prefetch={target!r})"
    loc = as_location(target, check=False, what=what)
    return as_location(loc, require_concurrent=True, what=what)


def managed_empty(
    shape: Any,
    dtype: Any = np.float64,
    *,
    attach: str = "global",
    pool: MemoryPool | None = None,
    stream: StreamLike = 0,
    prefetch: Target | None = None,
    order: str = "C",
) -> ManagedBuffer:
    """Shortcut for :meth:`ManagedBuffer.empty` (numba's ``cuda.managed_array``), with all its arguments."""
    return ManagedBuffer.empty(shape, dtype, attach=attach, pool=pool, stream=stream, prefetch=prefetch, order=order)


def managed_zeros(
    shape: Any,
    dtype: Any = np.float64,
    *,
    attach: str = "global",
    pool: MemoryPool | None = None,
    stream: StreamLike = 0,
    prefetch: Target | None = None,
    order: str = "C",
) -> ManagedBuffer:
    """Shortcut for :meth:`ManagedBuffer.zeros`, with all its arguments."""
    return ManagedBuffer.zeros(shape, dtype, attach=attach, pool=pool, stream=stream, prefetch=prefetch, order=order)


def managed_like(
    array: Any,
    *,
    attach: str = "global",
    pool: MemoryPool | None = None,
    stream: StreamLike = 0,
    prefetch: Target | None = None,
    order: str = "K",
) -> ManagedBuffer:
    """An uninitialised buffer with ``array``'s shape and dtype (like ``np.empty_like``).

    ``array`` is anything with ``shape`` and ``dtype`` (a buffer, a numba or
    numpy array) or that ``np.asarray`` takes.  ``order="K"`` (default)
    keeps the order of an F-ordered ``array``; the other arguments are
    :meth:`ManagedBuffer.empty`'s.
    """
    shape, dtype, order = like_layout(array, order, "managed_like")
    return ManagedBuffer.empty(shape, dtype, attach=attach, pool=pool, stream=stream, prefetch=prefetch, order=order)


def managed_from(
    array: Any,
    *,
    attach: str = "global",
    pool: MemoryPool | None = None,
    stream: StreamLike = 0,
    prefetch: Target | None = None,
    order: str = "K",
) -> ManagedBuffer:
    """Shortcut for :meth:`ManagedBuffer.from_array` (numba's ``cuda.to_device`` into managed memory)."""
    return ManagedBuffer.from_array(array, attach=attach, pool=pool, stream=stream, prefetch=prefetch, order=order)
