"""CUDA virtual memory management (VMM): reserve, create, map, grant access.

The driver's ``cuMemAlloc`` does four things at once; VMM splits them:

1. :meth:`AddressRange.reserve` takes device virtual address space (no memory);
2. :meth:`PhysicalMemory.create` takes physical memory on a device (no address);
3. :class:`Mapping` puts physical memory at an offset of a range;
4. :meth:`Mapping.set_access` lets devices read (and write) through the mapping.

Lifetimes
---------
A mapping holds both its range and its physical memory, so whatever order the
user closes or drops the three objects in, the driver sees ``cuMemUnmap``
first, then ``cuMemRelease`` and ``cuMemAddressFree``: closing a range or a
physical allocation that is still mapped marks it closed (no new mappings) and
frees it when its last mapping is unmapped.  Objects that are garbage
collected close themselves the same way (:class:`~umem_numba._memory._lifetime.Resource`).
"""

from __future__ import annotations

import bisect
from typing import Any

from .. import _driver
from .._driver._location import Target, as_device
from .._errors import BufferClosedError, UnsupportedError
from .._memory import _stats
from .._memory._lifetime import Resource, Transaction, finalizer
from ._access import (
    AccessFlags,
    alloc_prop,
    as_access,
    check_alignment,
    check_multiple,
    check_nonnegative,
    check_size,
    get_access,
    granularity,
    set_access,
)

__all__ = ["AddressRange", "Mapping", "PhysicalMemory"]


class _MappingTable:
    """Which byte ranges of an address range are mapped; each mapping holds a reference to the range.

    Mappings (and a VMMBuffer's chunks) refer to this table, never to the
    :class:`AddressRange` object, so dropping the range object still frees
    the reservation once the last mapping is unmapped.
    """

    __slots__ = ("maps", "res", "size", "starts")

    def __init__(self, size: int, res: Resource) -> None:
        self.size = size
        self.res = res
        self.maps: dict[int, int] = {}  # offset -> size of each live mapping
        self.starts: list[int] = []  # the same offsets, sorted (overlap checks in O(log n))

    def claim(self, offset: int, size: int) -> None:
        """Reserve ``[offset, offset + size)`` for a new mapping: bounds, overlap, and a reference."""
        if offset + size > self.size:
            raise ValueError(
                f"mapping {size} bytes at offset {offset} overflows the reserved range of "
                f"{self.size} bytes (offset + size = {offset + size})"
            )
        k = bisect.bisect_left(self.starts, offset)
        for other in self.starts[max(0, k - 1) : k + 1]:  # only the neighbours can overlap
            other_size = self.maps[other]
            if offset < other + other_size and other < offset + size:
                raise ValueError(
                    f"mapping [{offset}, {offset + size}) overlaps the mapping at "
                    f"[{other}, {other + other_size}) of this range"
                )
        self.res.retain()
        self.maps[offset] = size
        bisect.insort(self.starts, offset)

    def unclaim(self, offset: int) -> None:
        """Forget the mapping at ``offset`` (it was unmapped) and drop its reference to the range."""
        if self.maps.pop(offset, None) is not None:
            del self.starts[bisect.bisect_left(self.starts, offset)]
        self.res.unretain()


class AddressRange:
    """A reservation of device virtual address space, with no memory behind it yet.

    Build one with :meth:`reserve`; map :class:`PhysicalMemory` into it with
    :class:`Mapping`.

    Notes
    -----
    ``close()`` (or garbage collection) frees the reservation with
    ``cuMemAddressFree``, but only once every mapping in it is unmapped: until
    then the range is marked closed and refuses new mappings.
    """

    __slots__ = ("__weakref__", "_device_id", "_mappings", "_ptr", "_res", "_size")
    _ptr: int
    _size: int
    _device_id: int
    _res: Resource
    _mappings: _MappingTable

    @classmethod
    def reserve(cls, size: int, alignment: int = 0, *, device: Target = None) -> AddressRange:
        """Reserve ``size`` bytes of virtual address space.

        Parameters
        ----------
        size : int
            Bytes; a positive multiple of :func:`allocation_granularity`.
        alignment : int
            Alignment of the start address: 0 (the granularity) or a power of two.
        device : int, numba device or None
            Whose context reserves it (``None``: the current device).  The
            address space is shared by every device of the process.

        Returns
        -------
        AddressRange

        Raises
        ------
        TypeError, ValueError
            A size that is not a positive int multiple of the granularity, an
            alignment that is not 0 or a power of two (checked before any
            driver call).
        OutOfMemoryError
            No virtual address space left.
        """
        size = check_size(size, "reservation size")
        alignment = check_alignment(alignment)
        device_id = as_device(device, what="AddressRange.reserve")
        gran = granularity(device_id)
        check_multiple(size, gran, "reservation size")
        return cls._reserve(size, alignment or gran, device_id)

    @classmethod
    def _reserve(cls, size: int, alignment: int, device_id: int) -> AddressRange:
        ptr = int(
            _driver.call_on(
                device_id,
                "cuMemAddressReserve",
                size,
                alignment,
                0,
                0,
                detail=f"reserving {size} bytes of device address space",
            )
        )
        self = object.__new__(cls)
        self._ptr = ptr
        self._size = size
        self._device_id = device_id

        def free() -> None:
            _driver.call_on(device_id, "cuMemAddressFree", ptr, size, detail="freeing a VMM address range")

        self._res = Resource(f"VMM address range {ptr:#x} ({size} bytes)", free)
        self._mappings = _MappingTable(size, self._res)
        finalizer(self, self._res.close)
        return self

    @property
    def ptr(self) -> int:
        """Start address of the range."""
        return self._ptr

    @property
    def size(self) -> int:
        """Bytes reserved."""
        return self._size

    @property
    def device_id(self) -> int:
        """Device whose context reserved the range."""
        return self._device_id

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the range may still await its mappings)."""
        return self._res.closed

    @property
    def released(self) -> bool:
        """Whether the address space has been returned to the driver."""
        return self._res.freed

    def close(self) -> None:
        """Free the reservation now, or after its last mapping is unmapped."""
        self._res.close()

    def __enter__(self) -> AddressRange:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<AddressRange{state} ptr={self._ptr:#x} size={self._size} mappings={len(self._mappings.maps)}>"


class PhysicalMemory:
    """Physical device memory from ``cuMemCreate``, not addressable until mapped.

    Build one with :meth:`create` (or :meth:`from_shareable_handle` for memory
    another process exported); map it with :class:`Mapping`.

    Notes
    -----
    Counted in ``umem_numba.stats()["vmm"]`` while alive.  ``close()`` while
    mapped defers the ``cuMemRelease`` until the last mapping is unmapped.
    """

    __slots__ = ("__weakref__", "_device_id", "_exportable", "_handle", "_res", "_size")
    _handle: Any
    _size: int
    _device_id: int
    _exportable: bool
    _res: Resource

    @classmethod
    def create(cls, size: int, device: Target = None, *, exportable: bool = False) -> PhysicalMemory:
        """Allocate ``size`` bytes of physical memory on a device.

        Parameters
        ----------
        size : int
            Bytes; a positive multiple of :func:`allocation_granularity`.
        device : int, numba device or None
            The device (``None``: the current one).
        exportable : bool
            Request a POSIX file descriptor handle type, so that
            :meth:`export_fd` can share it with another process.

        Returns
        -------
        PhysicalMemory

        Raises
        ------
        TypeError, ValueError
            ``size`` is not a positive int multiple of the granularity
            (checked before ``cuMemCreate``).
        OutOfMemoryError
            The device does not have that much free memory.
        """
        size = check_size(size, "physical allocation size")
        device_id = as_device(device, what="PhysicalMemory.create")
        check_multiple(size, granularity(device_id, exportable=bool(exportable)), "physical allocation size")
        handle = _driver.call_on(
            device_id,
            "cuMemCreate",
            size,
            alloc_prop(device_id, bool(exportable)),
            0,
            detail=f"creating {size} bytes of physical memory on device {device_id}",
        )
        return cls._adopt(handle, size, device_id, bool(exportable))

    @classmethod
    def from_shareable_handle(cls, fd: int, size: int, device: Target = None) -> PhysicalMemory:
        """Import physical memory that another process exported with :meth:`export_fd`.

        Parameters
        ----------
        fd : int
            The file descriptor received (``subprocess`` ``pass_fds``, or a
            unix socket with ``SCM_RIGHTS``).  It is not closed here: close it
            once imported, because an open descriptor keeps the memory alive
            after every process has released it.
        size : int
            Bytes of the exported allocation (the exporter's :attr:`size`);
            the driver does not tell.
        device : int, numba device or None
            The device the memory is on, as this process numbers it.

        Returns
        -------
        PhysicalMemory

        Raises
        ------
        CudaError
            The descriptor is not an exported CUDA allocation.
        """
        fd = check_nonnegative(fd, "file descriptor")
        size = check_size(size, "imported allocation size")
        device_id = as_device(device, what="PhysicalMemory.from_shareable_handle")
        check_multiple(size, granularity(device_id, exportable=True), "imported allocation size")
        handle = _driver.call_on(
            device_id,
            "cuMemImportFromShareableHandle",
            fd,
            _driver.consts().vmm_posix_fd,
            detail=f"importing VMM memory from file descriptor {fd}",
        )
        return cls._adopt(handle, size, device_id, True)

    @classmethod
    def _adopt(cls, handle: Any, size: int, device_id: int, exportable: bool) -> PhysicalMemory:
        self = object.__new__(cls)
        self._handle = handle
        self._size = size
        self._device_id = device_id
        self._exportable = exportable

        def free() -> None:
            try:
                _driver.call_on(device_id, "cuMemRelease", handle, detail="releasing VMM physical memory")
            finally:
                _stats.record_free("vmm", size)

        _stats.record_alloc("vmm", size)
        self._res = Resource(f"VMM physical memory ({size} bytes on device {device_id})", free)
        finalizer(self, self._res.close)
        return self

    @property
    def size(self) -> int:
        """Bytes of physical memory."""
        return self._size

    @property
    def device_id(self) -> int:
        """Device the memory is on."""
        return self._device_id

    @property
    def handle(self) -> int:
        """The driver's ``CUmemGenericAllocationHandle`` as an int."""
        return int(self._handle)

    @property
    def exportable(self) -> bool:
        """Whether :meth:`export_fd` can share it."""
        return self._exportable

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (release may wait for mappings)."""
        return self._res.closed

    @property
    def released(self) -> bool:
        """Whether ``cuMemRelease`` has run."""
        return self._res.freed

    def export_fd(self) -> int:
        """Export as a POSIX file descriptor for another process.

        Returns
        -------
        int
            A new descriptor, owned by the caller: send it (``pass_fds`` or
            ``SCM_RIGHTS``) and ``os.close`` it.  The physical memory stays
            allocated while any descriptor or import of it is open.

        Raises
        ------
        UnsupportedError
            Created without ``exportable=True``.
        BufferClosedError
            Already closed.
        """
        if self._res.closed:
            raise BufferClosedError(f"{self._res.what} is closed")
        if not self._exportable:
            raise UnsupportedError(
                "this physical memory was created without exportable=True, so the driver "
                "cannot give a file descriptor for it"
            )
        fd = _driver.call_on(
            self._device_id,
            "cuMemExportToShareableHandle",
            self._handle,
            _driver.consts().vmm_posix_fd,
            0,
            detail="exporting VMM memory as a POSIX file descriptor",
        )
        return int(fd)

    def close(self) -> None:
        """Release now, or after the last mapping of it is unmapped."""
        self._res.close()

    def __enter__(self) -> PhysicalMemory:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<PhysicalMemory{state} size={self._size} device={self._device_id}>"


class Mapping:
    """Physical memory mapped into an address range at an offset.

    Parameters
    ----------
    address_range : AddressRange
        Where to map.
    physical : PhysicalMemory
        What to map: all of it (the driver does not map part of an allocation).
    offset : int
        Byte offset in the range; a multiple of the granularity, and
        ``offset + physical.size <= address_range.size``.

    Raises
    ------
    TypeError, ValueError
        Bad offset, out of the range's bounds, or overlapping another mapping
        of the range (checked before ``cuMemMap``).
    BufferClosedError
        The range or the physical memory is closed.

    Notes
    -----
    A fresh mapping grants no device any access: call :meth:`set_access`
    (typically ``READ_WRITE`` for the memory's own device) before use.
    Access is set per whole mapping (the driver refuses part of one).
    The mapping keeps its range and physical memory alive; ``close()`` (or
    garbage collection) unmaps it, after which they are freed if closed.
    Device work on the mapping's address is the caller's to finish first:
    the low-level layer cannot see it (a :class:`~umem_numba.VMMBuffer`
    waits for its own work before it unmaps).
    """

    __slots__ = ("__weakref__", "_offset", "_physical", "_range", "_res")

    def __init__(self, address_range: AddressRange, physical: PhysicalMemory, offset: int = 0) -> None:
        if not isinstance(address_range, AddressRange):
            raise TypeError(f"address_range must be an AddressRange, got {type(address_range).__name__}")
        if not isinstance(physical, PhysicalMemory):
            raise TypeError(f"physical must be a PhysicalMemory, got {type(physical).__name__}")
        offset = check_nonnegative(offset, "mapping offset")
        size = physical.size
        device_id = physical.device_id
        check_multiple(offset, granularity(device_id, exportable=physical.exportable), "mapping offset")
        ptr = address_range.ptr + offset
        pres = physical._res
        table = address_range._mappings
        with Transaction() as tx:
            table.claim(offset, size)
            tx.append(table.unclaim, offset)
            pres.retain()
            tx.append(pres.unretain)
            _driver.call_on(
                device_id, "cuMemMap", ptr, size, 0, physical._handle, 0, detail=f"mapping {size} bytes at {ptr:#x}"
            )
            tx.commit()

        def unmap() -> None:
            try:
                _driver.call_on(device_id, "cuMemUnmap", ptr, size, detail=f"unmapping {size} bytes at {ptr:#x}")
            finally:
                pres.unretain()
                table.unclaim(offset)

        self._range = address_range
        self._physical = physical
        self._offset = offset
        self._res = Resource(f"VMM mapping at {ptr:#x} ({size} bytes)", unmap)
        finalizer(self, self._res.close)

    @property
    def ptr(self) -> int:
        """Device address of the first mapped byte."""
        return self._range.ptr + self._offset

    @property
    def size(self) -> int:
        """Bytes mapped."""
        return self._physical.size

    @property
    def offset(self) -> int:
        """Offset in the address range."""
        return self._offset

    @property
    def address_range(self) -> AddressRange:
        """The range mapped into."""
        return self._range

    @property
    def physical(self) -> PhysicalMemory:
        """The physical memory mapped."""
        return self._physical

    @property
    def closed(self) -> bool:
        """Whether the mapping has been unmapped."""
        return self._res.closed

    def _check_open(self) -> None:
        if self._res.closed:
            raise BufferClosedError(f"{self._res.what} is unmapped")

    def set_access(self, device: Target, flags: AccessFlags) -> None:
        """Grant ``device`` access to the whole mapping.

        Parameters
        ----------
        device : int, numba device or Location
            The device whose kernels get access (a peer device needs P2P
            support for a grant other than NONE).
        flags : AccessFlags
            NONE, READ or READ_WRITE.

        Raises
        ------
        TypeError, ValueError
            Bad device or flags (before the driver call).
        CudaError
            The driver refused (e.g. no peer access between the devices).
        """
        self._check_open()
        fl = as_access(flags)
        target = as_device(device, what="Mapping.set_access")
        with _driver.device_context(self._physical.device_id):
            set_access(self.ptr, self.size, {target: fl}, f"granting {fl.name} access to device {target}")

    def get_access(self, device: Target) -> AccessFlags:
        """The access ``device`` has to this mapping, as the driver reports it.

        Parameters
        ----------
        device : int, numba device or Location
            The device asked about.

        Returns
        -------
        AccessFlags
            ``cuMemGetAccess`` for the mapping's first byte.
        """
        self._check_open()
        target = as_device(device, what="Mapping.get_access")
        with _driver.device_context(self._physical.device_id):
            return get_access(self.ptr, target)

    def close(self) -> None:
        """Unmap (then free the range and memory if they were closed)."""
        self._res.close()

    def __enter__(self) -> Mapping:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " unmapped" if self.closed else ""
        return f"<Mapping{state} ptr={self.ptr:#x} size={self.size} offset={self._offset}>"
