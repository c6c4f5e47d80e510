"""VMMBuffer: a device array that grows and shrinks in place (CUDA VMM).

A :class:`VMMBuffer` reserves virtual address space for its whole capacity
once, and maps physical memory behind it only for the current length.
Growing maps more physical memory after the last chunk: the device address
and the contents never move, so kernels, views and pointers handed out
before stay valid.  Shrinking unmaps and releases whole chunks past the new
end.

Chunks
------
Physical memory comes in chunks, each a multiple of the allocation
granularity (2 MiB on current GPUs).  By default the initial length is one
chunk and every growth step adds one (the fastest growth: three driver calls
per step).  With ``chunk_bytes=N`` memory is created in chunks of at most N
bytes instead.  Chunk boundaries matter because the driver maps physical
memory only whole and sets access only on whole mappings:

* ``shrink`` releases the chunks that lie wholly past the new end; the chunk
  that straddles it stays mapped (see :attr:`VMMBuffer.mapped_nbytes`);
* ``set_access`` on a view needs the view to start and end on chunk
  boundaries (on the owner it covers everything).

Shrink and views
----------------
A view whose bytes reach past a shrink becomes unusable for good: every use
(kernel launches included) raises :class:`~umem_numba.BufferClosedError`,
even if the buffer grows again, since the view would see new, uninitialised
memory.  Views inside the kept length stay valid, with the same address and
contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _driver
from .._arrays import _layout
from .._arrays._buffer import Buffer, cuda_core_source, host_source, new_layout, source_order
from .._driver._location import StreamLike, Target, as_device, stream_handle
from .._errors import BufferClosedError, CoherenceError, UnsupportedError
from .._memory._lifetime import Transaction
from .._memory._tracker import refuse_capture
from ._access import (
    AccessFlags,
    as_access,
    check_nonnegative,
    check_size,
    get_access,
    granularity,
    round_up,
    set_access,
)
from ._allocation import VMMAllocation, VMMChunks
from ._mapping import AddressRange

__all__ = ["VMMBuffer"]


def _check_length(n: Any, what: str) -> int:
    return check_nonnegative(n, what)


def _row_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    n = dtype.itemsize
    for d in shape[1:]:
        n *= d
    return n


def _check_capacity(capacity: Any, length: int, row: int) -> int | None:
    if capacity is None:
        return None
    cap = _check_length(capacity, "capacity")
    if cap < length:
        raise ValueError(f"capacity {cap} is smaller than the initial length {length}")
    if cap * row > _layout.MAX_NBYTES:
        raise ValueError(f"capacity {cap} x {row} bytes per row is more address space than any device has")
    return cap


def _check_chunk_bytes(chunk_bytes: Any) -> int | None:
    if chunk_bytes is None:
        return None
    return check_size(chunk_bytes, "chunk_bytes")


def _layout_of(shape: Any, dtype: Any, order: str = "C") -> tuple[tuple[int, ...], np.dtype, int, tuple[int, ...], int]:
    shape, dtype, nbytes, strides = new_layout(shape, dtype, order)
    if not shape:
        raise ValueError("a VMMBuffer needs at least one dimension (it grows along axis 0); got shape ()")
    return shape, dtype, nbytes, strides, _row_bytes(shape, dtype)


class VMMBuffer(Buffer):
    """A device array in VMM memory that grows and shrinks in place.

    Build one with :meth:`empty`, :meth:`zeros` or :meth:`from_array`, or map
    memory another process exported with :meth:`from_shareable_handle`.
    Kernels take it as they are; the host reads it through
    :meth:`copy_to_host` (it is device memory: :attr:`host` raises).

    Notes
    -----
    * The length is the first axis: :meth:`grow`, :meth:`shrink` and
      :meth:`resize` change ``shape[0]`` of the owning buffer; views keep the
      shape they were made with (see the module notes for shrink).
    * :meth:`set_access` controls which devices may read or write, on the
      whole buffer or on a view of it; grants on the whole buffer also apply
      to memory mapped by later growth.
    * Counted in ``umem_numba.stats()["vmm"]``: one allocation per buffer
      whose ``live_bytes`` follow the mapped physical memory.

    Examples
    --------
    >>> buf = VMMBuffer.from_array(np.arange(4, dtype=np.float32))  # doctest: +SKIP
    >>> ptr = buf.ptr; buf.grow(1 << 20)                             # doctest: +SKIP
    >>> buf.ptr == ptr                                                # doctest: +SKIP
    True
    """

    __slots__ = ("_capacity", "_end", "_epoch")
    _capacity: int
    _epoch: int
    _end: int

    _host_accessible = False
    _views_can_retire = True
    _constructors = ("VMMBuffer.empty", "VMMBuffer.zeros", "VMMBuffer.from_array", "VMMBuffer.from_shareable_handle")

    # -- construction -------------------------------------------------------------
    @classmethod
    def empty(
        cls,
        shape: Any,
        dtype: Any = np.float64,
        *,
        device: Target = None,
        capacity: int | None = None,
        exportable: bool = False,
        chunk_bytes: int | None = None,
        order: str = "C",
    ) -> VMMBuffer:
        """Reserve address space for ``capacity`` rows and map memory for ``shape``.

        Parameters
        ----------
        shape : int or tuple of int
            Initial shape (at least one dimension; zero length is allowed).
        dtype : numpy dtype
            Element type (default ``float64``, as numpy's and numba's).
        device : int, numba device or None
            The device (``None``: the current one); it is granted READ_WRITE.
        capacity : int, optional
            Largest first-axis length the buffer may grow to.  Default: as
            many rows as the device has memory (address space is cheap; only
            mapped memory is used).
        exportable : bool
            Create memory that :meth:`export_fds` can share with other processes.
        chunk_bytes : int, optional
            Create physical memory in chunks of at most this many bytes (a
            multiple of :attr:`granularity`), so that ``shrink`` and a view's
            ``set_access`` can work at that size.  Default: one chunk for the
            initial length and one per growth step (fastest).
        order : {"C", "F"}
            Row-major (default) or column-major element order.  Growth adds
            rows (axis 0), which are contiguous only in C order: an F-ordered
            buffer of two or more dimensions cannot :meth:`grow` or
            :meth:`shrink`.  For a column-major array that grows, make a
            C-ordered buffer of the transposed shape and use its ``.T`` view.

        Returns
        -------
        VMMBuffer

        Raises
        ------
        TypeError, ValueError
            Bad shape, dtype, capacity or chunk_bytes (checked before any
            allocation; the granularity check asks the driver for it).
        OutOfMemoryError
            The device does not have the memory for the initial length.
        CudaError
            Other driver failures (e.g. a device without VMM support).
        """
        order = _layout.check_order(order, "VMMBuffer.empty")
        shape, dtype, nbytes, strides, row = _layout_of(shape, dtype, order)
        cap = _check_capacity(capacity, shape[0], row)
        chunk = _check_chunk_bytes(chunk_bytes)
        device_id = as_device(device, what="VMMBuffer.empty")
        exportable = bool(exportable)
        gran = granularity(device_id, exportable=exportable)
        if chunk is not None and chunk % gran:
            raise ValueError(f"chunk_bytes ({chunk}) must be a multiple of the allocation granularity ({gran} bytes)")
        if cap is None:
            cap = _default_capacity(device_id, shape[0], row, gran)
        reserve = round_up(cap * row, gran)
        rng = AddressRange._reserve(reserve, gran, device_id) if reserve else None
        alloc = VMMAllocation(VMMChunks(rng, device_id, exportable), gran, chunk)
        with Transaction() as tx:
            tx.append(alloc.close)
            if nbytes:
                alloc.map_more(round_up(nbytes, gran))
            tx.commit()
        alloc.length_nbytes = nbytes
        return cls._wrap(alloc, shape, strides, dtype, cap)

    @classmethod
    def zeros(
        cls,
        shape: Any,
        dtype: Any = np.float64,
        *,
        device: Target = None,
        capacity: int | None = None,
        exportable: bool = False,
        chunk_bytes: int | None = None,
        stream: StreamLike = 0,
        order: str = "C",
    ) -> VMMBuffer:
        """Like :meth:`empty`, then zero every byte on ``stream`` (``cuMemsetD8Async``).

        Host reads wait for the memset (coherence).  Memory mapped by later
        growth is not zeroed.
        """
        handle = stream_handle(stream, what="VMMBuffer.zeros")
        _driver.ensure_context()
        refuse_capture(handle, "VMMBuffer.zeros")  # before allocating: a capture stays intact
        buf = cls.empty(
            shape,
            dtype,
            device=device,
            capacity=capacity,
            exportable=exportable,
            chunk_bytes=chunk_bytes,
            order=order,
        )
        buf._fill_zero(handle)
        return buf

    @classmethod
    def from_array(
        cls,
        array: Any,
        *,
        device: Target = None,
        capacity: int | None = None,
        exportable: bool = False,
        chunk_bytes: int | None = None,
        order: str = "K",
    ) -> VMMBuffer:
        """A new buffer holding a copy of ``array`` (at least 1-d).

        Keyword arguments are :meth:`empty`'s; ``order="K"`` (default) keeps
        an F-ordered source's order.
        """
        side, dev_order = cuda_core_source(array, order, "VMMBuffer.from_array")
        if side is not None:  # a cuda.core Buffer or view of device memory: one DMA copy
            buf = cls.empty(
                side.shape,
                side.dtype,
                device=device,
                capacity=capacity,
                exportable=exportable,
                chunk_bytes=chunk_bytes,
                order=dev_order,
            )
            try:
                buf.copy_from_host(array)
            except BaseException:
                buf.close()
                raise
            return buf
        src = host_source(array)
        order = source_order(src, order, "VMMBuffer.from_array")
        buf = cls.empty(
            src.shape,
            src.dtype,
            device=device,
            capacity=capacity,
            exportable=exportable,
            chunk_bytes=chunk_bytes,
            order=order,
        )
        buf.copy_from_host(src)
        return buf

    @classmethod
    def from_shareable_handle(
        cls,
        handle: int | Sequence[tuple[int, int]],
        shape: Any,
        dtype: Any = np.float64,
        *,
        device: Target = None,
        access: AccessFlags = AccessFlags.READ_WRITE,
    ) -> VMMBuffer:
        """Map memory that another process exported (:meth:`export_fd` / :meth:`export_fds`).

        Parameters
        ----------
        handle : int or sequence of (int, int)
            One file descriptor (a single-chunk export: its size is ``shape``'s
            bytes rounded up to the granularity), or the ``(fd, nbytes)``
            pairs of :meth:`export_fds`, in order.  The descriptors are not
            closed here: close them after the call (an open descriptor keeps
            the memory allocated after both processes let go of it).
        shape, dtype
            The array the exporter shared (must fit in the imported memory).
        device : int, numba device or None
            The device that maps the memory and is granted ``access``, as this
            process numbers it: the device the memory is on, or one with peer
            access to it (``cuDeviceCanAccessPeer``), which then reads and
            writes it over the peer link.
        access : AccessFlags
            What ``device`` may do: ``READ_WRITE`` (default), or ``READ`` for
            memory this process must only read (a kernel's store through it
            then faults, as with :meth:`set_access`).

        Returns
        -------
        VMMBuffer
            Its capacity is its length: it cannot grow.  Both processes see
            the same physical memory; order their work yourself (e.g. a pipe
            message after a ``synchronize()``).

        Raises
        ------
        TypeError, ValueError
            Bad descriptors, sizes not multiples of the granularity, or a
            shape larger than the imported memory (before any driver call).
        CudaError
            A descriptor that is not an exported CUDA allocation, or a
            ``device`` without peer access to the memory.
        """
        shape, dtype, nbytes, strides, _ = _layout_of(shape, dtype)
        pieces = _import_pieces(handle, nbytes)
        fl = as_access(access)
        if fl == AccessFlags.NONE:
            raise ValueError("from_shareable_handle: access=NONE would map memory that no device may use")
        device_id = as_device(device, what="VMMBuffer.from_shareable_handle")
        gran = granularity(device_id, exportable=True)
        sized = [(fd, round_up(nbytes, gran) if size is None else size) for fd, size in pieces]
        for _, size in sized:
            if size % gran:
                raise ValueError(f"imported chunk size {size} is not a multiple of the granularity {gran}")
        total = sum(size for _, size in sized)
        if nbytes > total:
            raise ValueError(f"shape {shape} of {dtype} needs {nbytes} bytes but the imported memory has {total}")
        chunks = VMMChunks(AddressRange._reserve(total, gran, device_id), device_id, False)
        alloc = VMMAllocation(chunks, gran, None)
        with Transaction() as tx:
            tx.append(alloc.close)
            chunks.import_chunks(sized, fl)
            tx.commit()
        alloc.grants = {device_id: fl}
        alloc.length_nbytes = nbytes
        return cls._wrap(alloc, shape, strides, dtype, shape[0])

    @classmethod
    def _wrap(
        cls, alloc: VMMAllocation, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype, capacity: int
    ) -> VMMBuffer:
        buf = object.__new__(cls)
        buf._init(alloc, 0, shape, strides, dtype, True)
        buf._capacity = capacity
        buf._epoch = 0
        buf._end = -1
        return buf

    def _copy_extra(self, view: Buffer) -> None:
        alloc = self._live()
        assert isinstance(view, VMMBuffer)
        view._capacity = self._capacity
        view._epoch = len(alloc.shrinks)
        _, hi = _layout.extent(view._shape, view._strides, view._dtype.itemsize)
        view._end = view._offset + hi

    # -- lifetime -------------------------------------------------------------------
    def _live(self) -> VMMAllocation:
        alloc = super()._live()
        assert isinstance(alloc, VMMAllocation)
        if not self._owner:
            later = alloc.shrinks[self._epoch :]
            if later and self._end > min(later):
                raise BufferClosedError(
                    f"this view of a VMMBuffer (bytes up to {self._end}) lies beyond a shrink of the buffer "
                    f"to {min(later)} bytes: its memory was released, so the view can no longer be used"
                )
        return alloc

    def _check_resizable(self, what: str) -> None:
        """Refuse to change the length of an F-ordered buffer of 2+ dimensions (rows are not contiguous)."""
        shape, itemsize = self._shape, self._dtype.itemsize
        if (
            len(shape) >= 2
            and self._strides == _layout.f_strides(shape, itemsize)
            and self._strides != _layout.c_strides(shape, itemsize)
        ):
            raise ValueError(
                f"{what}(): this VMMBuffer is F-ordered; growth adds rows (axis 0), which are contiguous only "
                "in C order. Make a C-ordered buffer of the transposed shape and use its .T view instead"
            )

    def _owner_alloc(self, what: str) -> VMMAllocation:
        alloc = self._live()
        if not self._owner:
            raise ValueError(f"{what}() changes the length of the owning buffer; this is a view of it")
        return alloc

    # -- size -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Largest first-axis length the buffer can grow to."""
        return self._capacity

    @property
    def mapped_nbytes(self) -> int:
        """Physical bytes mapped now (the length rounded up to whole chunks)."""
        return self._live().chunks.nbytes

    @property
    def reserved_nbytes(self) -> int:
        """Bytes of address space reserved for the capacity."""
        rng = self._live().chunks.range
        return rng.size if rng is not None else 0

    @property
    def granularity(self) -> int:
        """The allocation granularity in bytes (sizes and access ranges are multiples of it)."""
        return self._live().granularity

    @property
    def chunk_count(self) -> int:
        """Number of physical allocations mapped now."""
        return len(self._live().chunks.chunks)

    @property
    def chunk_bytes(self) -> int | None:
        """Largest chunk size new memory is created in (``None``: one chunk per growth step)."""
        return self._live().chunk_bytes

    @property
    def exportable(self) -> bool:
        """Whether :meth:`export_fds` can share the memory."""
        return self._live().chunks.exportable

    def grow(self, new_length: int) -> None:
        """Grow the first axis to ``new_length`` in place.

        The address and the existing contents stay; the new rows are
        uninitialised.  Memory is mapped only when the current chunks do not
        already cover the new length.

        Parameters
        ----------
        new_length : int
            At least the current length, at most :attr:`capacity`.

        Raises
        ------
        TypeError, ValueError
            Not an int, smaller than the length, or past the capacity.
        OutOfMemoryError
            The device does not have the memory.  The buffer is exactly as it
            was (nothing is left mapped or allocated).
        """
        alloc = self._owner_alloc("grow")
        self._check_resizable("grow")
        n = _check_length(new_length, "new length")
        if n < self._shape[0]:
            raise ValueError(f"grow({n}) is smaller than the current length {self._shape[0]}; use shrink()")
        if n > self._capacity:
            raise ValueError(
                f"cannot grow to {n}: the capacity is {self._capacity} (set capacity= when creating the buffer)"
            )
        with alloc.resize_lock:
            need = round_up(n * _row_bytes(self._shape, self._dtype), alloc.granularity)
            if need > alloc.chunks.nbytes:
                alloc.map_more(need - alloc.chunks.nbytes)
            self._set_length(alloc, n)

    def shrink(self, new_length: int) -> None:
        """Shrink the first axis to ``new_length``, releasing the chunks past it.

        Device work that may still use the buffer is settled first (coherence
        policy).  Views reaching past the new length become unusable.

        Raises
        ------
        TypeError, ValueError
            Not an int, negative or larger than the length.
        CoherenceError
            Under the ``"raise"`` policy, while a kernel may use the buffer
            (nothing is changed); while a live graph uses the buffer.
        """
        alloc = self._owner_alloc("shrink")
        self._check_resizable("shrink")
        n = _check_length(new_length, "new length")
        if n > self._shape[0]:
            raise ValueError(f"shrink({n}) is larger than the current length {self._shape[0]}; use grow()")
        if n == self._shape[0]:
            return
        if alloc.tracker.graphs or alloc.tracker.capturing:
            raise CoherenceError(
                "shrink: a CUDA graph (umem_numba.capture) uses this VMMBuffer; shrinking would unmap memory "
                "that its launches use: close the graph first"
            )
        with alloc.resize_lock, alloc.tracker.exclusive("resized"):
            # Unmapping under a running kernel is a fault, not a stale read:
            # "warn" and "off" wait here too ("raise" raises).
            alloc.tracker.settle("shrinking a VMMBuffer", alloc.tracker.effective_policy(), always_wait=True)
            new_nbytes = n * _row_bytes(self._shape, self._dtype)
            alloc.release_past(round_up(new_nbytes, alloc.granularity))
            alloc.shrinks.append(new_nbytes)
            self._set_length(alloc, n)

    def resize(self, new_length: int) -> None:
        """:meth:`grow` or :meth:`shrink` to ``new_length``.

        Parameters
        ----------
        new_length : int
            The new first-axis length, from 0 to :attr:`capacity`.

        Raises
        ------
        TypeError, ValueError, OutOfMemoryError, CoherenceError
            As :meth:`grow` and :meth:`shrink`; the buffer is unchanged.
        """
        self._owner_alloc("resize")
        n = _check_length(new_length, "new length")
        if n >= self._shape[0]:
            self.grow(n)
        else:
            self.shrink(n)

    def _set_length(self, alloc: VMMAllocation, n: int) -> None:
        self._shape = (n, *self._shape[1:])
        self._strides = _layout.c_strides(self._shape, self._dtype.itemsize)
        # numba's cached type and launch view describe the old shape.
        self._nbtype = None
        self._shim = None
        self._kparams = None
        alloc.length_nbytes = n * _row_bytes(self._shape, self._dtype)

    # -- access control ------------------------------------------------------------
    def set_access(self, device: Target, flags: AccessFlags) -> None:
        """Set what ``device`` may do with this buffer (or this view's bytes).

        Parameters
        ----------
        device : int, numba device or Location
            The device; another GPU needs peer support for READ or READ_WRITE.
        flags : AccessFlags
            NONE, READ or READ_WRITE.

        Raises
        ------
        TypeError, ValueError
            Bad device or flags, an empty view, or a view that does not start
            and end on chunk boundaries (a view that runs to the end of the
            buffer may end anywhere); checked before the driver call.
        CudaError
            The driver refused (e.g. no peer access between the devices).

        Notes
        -----
        On the owning buffer the grant covers all mapped memory and also
        applies to memory mapped by later :meth:`grow`.  On a view it covers
        that range only.  The driver sets access on whole mappings only, so a
        view must start and end on chunk boundaries: create the buffer with
        ``chunk_bytes=`` for ranges finer than its growth steps.

        Access takes effect at once, for kernels already running too: a
        kernel that writes where it may only read fails, and the CUDA context
        is then unusable (every later call fails; the process has to exit).
        Revoke access only when no kernel uses the range.
        """
        alloc = self._live()
        fl = as_access(flags)
        target = as_device(device, what="VMMBuffer.set_access")
        start, stop = self._access_span(alloc)
        with alloc.resize_lock, _driver.device_context(alloc.device_id):
            if stop > start:
                set_access(
                    alloc.device_ptr + start,
                    stop - start,
                    {target: fl},
                    f"granting device {target} {fl.name} access to a VMMBuffer",
                )
            if self._owner:
                alloc.grants[target] = fl

    def get_access(self, device: Target) -> AccessFlags:
        """The access ``device`` has to this buffer's first byte, as ``cuMemGetAccess`` reports it.

        Parameters
        ----------
        device : int, numba device or Location
            The device asked about.

        Returns
        -------
        AccessFlags

        Raises
        ------
        ValueError
            An empty buffer or view (no byte to ask about).
        """
        alloc = self._live()
        target = as_device(device, what="VMMBuffer.get_access")
        if self.size == 0:
            raise ValueError("get_access() needs a non-empty buffer: nothing is mapped at an empty view")
        with _driver.device_context(alloc.device_id):
            return get_access(self._address, target)

    def _access_span(self, alloc: VMMAllocation) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of the allocation that set_access covers."""
        if self._owner:
            return 0, alloc.chunks.nbytes
        lo, hi = _layout.extent(self._shape, self._strides, self._dtype.itemsize)
        start, stop = self._offset + lo, self._offset + hi
        if stop <= start:
            raise ValueError("set_access() on an empty view: it covers no memory")
        chunks = alloc.chunks
        if stop >= alloc.length_nbytes:
            stop = chunks.nbytes  # the tail of the last chunk belongs to the view's range
        bounds = [c.offset for c in chunks.chunks] + [chunks.nbytes]
        if start not in bounds or stop not in bounds:
            raise ValueError(
                f"set_access() on a view must start and end on chunk boundaries (the driver sets access on "
                f"whole mappings): this view spans bytes [{start}, {stop}); the boundaries are "
                f"{_some(bounds)}.  Create the buffer with chunk_bytes= (a multiple of {alloc.granularity}) "
                "for finer ranges"
            )
        return start, stop

    # -- sharing between processes --------------------------------------------------
    def export_fds(self) -> list[tuple[int, int]]:
        """Export the mapped memory as POSIX file descriptors, one per chunk.

        Returns
        -------
        list of (int, int)
            ``(fd, nbytes)`` per chunk in address order; pass the list to
            :meth:`from_shareable_handle` in the other process.  The caller
            owns the descriptors: send them (``pass_fds``, ``SCM_RIGHTS``)
            and ``os.close`` them.

        Raises
        ------
        UnsupportedError
            The buffer was not created with ``exportable=True``.
        ValueError
            Called on a view (the export covers the whole allocation).
        """
        alloc = self._owner_alloc("export_fds")
        if not alloc.chunks.exportable:
            raise UnsupportedError(
                "this VMMBuffer was created without exportable=True: its memory cannot be exported as a file descriptor"
            )
        return alloc.chunks.export_fds()

    def export_fd(self) -> int:
        """Export a single-chunk buffer as one POSIX file descriptor.

        A buffer is one chunk until it grows past its first chunk; use
        :meth:`export_fds` for any buffer.  The caller owns the descriptor.

        Raises
        ------
        UnsupportedError
            Not exportable, or made of several chunks (or none).
        """
        alloc = self._owner_alloc("export_fd")
        n = len(alloc.chunks.chunks)
        if n != 1 and alloc.chunks.exportable:
            raise UnsupportedError(
                f"this VMMBuffer is mapped from {n} chunks; export_fd() needs exactly one: "
                "use export_fds() and pass its list to from_shareable_handle()"
            )
        return self.export_fds()[0][0]

    def _repr_extra(self) -> str:
        alloc = self._alloc
        mapped = alloc.nbytes if alloc is not None else 0
        return f", mapped={mapped}, capacity={self._capacity}"


# ---------------------------------------------------------------------------
# helpers


def _default_capacity(device_id: int, length: int, row: int, gran: int) -> int:
    """As many rows as the device has memory (at least ``length``)."""
    if row == 0:
        return max(length, 1)
    total = int(_driver.call("cuDeviceTotalMem", device_id, detail=f"total memory of device {device_id}"))
    return max(length, round_up(total, gran) // row)


def _some(values: list[int]) -> str:
    """A short listing of chunk boundaries for an error message."""
    if len(values) <= 8:
        return ", ".join(str(v) for v in values)
    return ", ".join(str(v) for v in values[:4]) + ", ..., " + ", ".join(str(v) for v in values[-3:])


def _import_pieces(handle: Any, nbytes: int) -> list[tuple[int, int | None]]:
    """Validate :meth:`VMMBuffer.from_shareable_handle`'s descriptors (``None``: size from the shape)."""
    if isinstance(handle, (list, tuple)):
        if not handle:
            raise ValueError("from_shareable_handle: the list of (fd, nbytes) pairs is empty")
        pieces: list[tuple[int, int | None]] = []
        for item in handle:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise TypeError(f"from_shareable_handle: expected (fd, nbytes) pairs, got {item!r}")
            pieces.append((check_nonnegative(item[0], "file descriptor"), check_size(item[1], "imported chunk size")))
        total = sum(size for _, size in pieces if size is not None)
        if nbytes > total:
            raise ValueError(f"the shape needs {nbytes} bytes but the imported chunks hold {total}")
        return pieces
    if nbytes == 0:
        raise ValueError("from_shareable_handle: an empty shape maps no memory; pass the exported shape")
    return [(check_nonnegative(handle, "file descriptor"), None)]
