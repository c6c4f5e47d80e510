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
collected close themselves the same way.

Sizes and offsets must be multiples of :func:`allocation_granularity` (2 MiB on
current GPUs); every check runs before the driver is asked, and the message
names the bad value and the nearest valid ones.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import operator
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator

from . import _driver, _stats
from ._errors import BufferClosedError, CudaError, UnsupportedError
from ._location import Location, Target, as_location

__all__ = ["AccessFlags", "allocation_granularity", "AddressRange", "PhysicalMemory", "Mapping"]

#: Results that mean the context is already gone (interpreter shutdown): the
#: driver released everything itself, there is nothing left to free.
_GONE = frozenset({"CUDA_ERROR_DEINITIALIZED", "CUDA_ERROR_CONTEXT_IS_DESTROYED"})


class AccessFlags(enum.IntFlag):
    """What a device may do through a mapping (``CUmemAccess_flags``).

    Attributes
    ----------
    NONE
        No access: a kernel touching the range faults.
    READ
        Loads only; a store faults.
    READ_WRITE
        Loads and stores.

    Notes
    -----
    The values are the driver's (0, 1, 3), so ``READ in READ_WRITE`` is true,
    ``READ | READ_WRITE`` is ``READ_WRITE`` and ``READ_WRITE & READ`` is
    ``READ``.  There is no write-only access: the value 2 is refused.
    """

    NONE = 0
    READ = 1
    READ_WRITE = 3


_VALID_ACCESS = frozenset({0, 1, 3})


def _as_access(flags: Any) -> AccessFlags:
    """Validate an access value (an :class:`AccessFlags` or the ints 0, 1, 3)."""
    if isinstance(flags, bool) or not isinstance(flags, int):
        raise TypeError(f"access flags must be AccessFlags (NONE, READ, READ_WRITE), got {flags!r}")
    if int(flags) not in _VALID_ACCESS:
        raise ValueError(f"invalid access flags {int(flags)}: use AccessFlags.NONE (0), READ (1) or "
                         "READ_WRITE (3); the driver has no write-only access")
    return AccessFlags(int(flags))


# ---------------------------------------------------------------------------
# validation that needs no driver


def _check_size(size: Any, what: str) -> int:
    """A positive byte count, or ``TypeError``/``ValueError`` naming it."""
    if isinstance(size, bool):
        raise TypeError(f"{what} must be an int number of bytes, not a bool")
    try:
        n = operator.index(size)
    except TypeError:
        raise TypeError(f"{what} must be an int number of bytes, got {type(size).__name__} {size!r}") from None
    if n <= 0:
        raise ValueError(f"{what} must be positive, got {n}")
    return n


def _check_offset(offset: Any, what: str) -> int:
    if isinstance(offset, bool):
        raise TypeError(f"{what} must be an int number of bytes, not a bool")
    try:
        n = operator.index(offset)
    except TypeError:
        raise TypeError(f"{what} must be an int number of bytes, got {type(offset).__name__} {offset!r}") from None
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    return n


def _check_alignment(alignment: Any) -> int:
    n = _check_offset(alignment, "alignment")
    if n & (n - 1):
        raise ValueError(f"alignment must be 0 or a power of two, got {n}")
    return n


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_multiple(n: int, granularity: int, what: str) -> None:
    if n % granularity:
        lower = n - n % granularity
        hint = f"{lower} or {lower + granularity}" if lower else f"{granularity}"
        raise ValueError(f"{what} ({n} bytes) must be a multiple of the allocation granularity "
                         f"({granularity} bytes); nearest valid: {hint}")


def _device_location(device: Target) -> Location:
    loc = as_location(device)
    if loc.is_host:
        raise ValueError("VMM memory lives on a device: pass a device ordinal or a numba device, not the host")
    return loc


# ---------------------------------------------------------------------------
# driver constants, resolved once


class _Consts:
    def __init__(self) -> None:
        drv = _driver.api().drv
        self.drv = drv
        self.pinned = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.on_device = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.posix_fd = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.no_handle = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self.gran_min = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.gran_rec = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        # Not `for f in AccessFlags`: iterating an IntFlag skips NONE and READ_WRITE (two bits).
        self.access = {v: drv.CUmemAccess_flags(v) for v in _VALID_ACCESS}


_consts: _Consts | None = None


def _c() -> _Consts:
    global _consts
    if _consts is None:
        _consts = _Consts()
    return _consts


# The driver only reads these structures: build each one once (grow is a hot path).
_prop_cache: dict[tuple[int, bool], Any] = {}
_desc_cache: dict[tuple[tuple[int, int], ...], list] = {}


def _alloc_prop(device_id: int, exportable: bool) -> Any:
    """``CUmemAllocationProp`` for pinned device memory (optionally fd-exportable)."""
    prop = _prop_cache.get((device_id, exportable))
    if prop is None:
        c = _c()
        prop = c.drv.CUmemAllocationProp()
        prop.type = c.pinned
        prop.location.type = c.on_device
        prop.location.id = device_id
        # An fd can only be exported if it was requested at cuMemCreate.
        prop.requestedHandleTypes = c.posix_fd if exportable else c.no_handle
        _prop_cache[(device_id, exportable)] = prop
    return prop


def _access_descs(grants: dict[int, AccessFlags]) -> list:
    key = tuple(sorted((d, int(f)) for d, f in grants.items()))
    descs = _desc_cache.get(key)
    if descs is None:
        c = _c()
        descs = []
        for device_id, flags in key:
            desc = c.drv.CUmemAccessDesc()
            desc.location.type = c.on_device
            desc.location.id = device_id
            desc.flags = c.access[flags]
            descs.append(desc)
        _desc_cache[key] = descs
    return descs


def _set_access(ptr: int, size: int, grants: dict[int, AccessFlags], detail: str) -> None:
    """One ``cuMemSetAccess`` for every device in ``grants`` over a fully mapped span."""
    descs = _access_descs(grants)
    if descs:
        _driver.call("cuMemSetAccess", ptr, size, descs, len(descs), detail=detail)


def _get_access(ptr: int, device_id: int) -> AccessFlags:
    flags = _driver.call("cuMemGetAccess", Location.device(device_id).to_cu(), ptr,
                         detail=f"reading device {device_id}'s access to {ptr:#x}")
    return AccessFlags(int(flags))


_gran_cache: dict[tuple[int, bool, bool], int] = {}


def _granularity(device_id: int, recommended: bool = False, exportable: bool = False) -> int:
    key = (device_id, recommended, exportable)
    g = _gran_cache.get(key)
    if g is None:
        c = _c()
        g = int(_driver.call("cuMemGetAllocationGranularity", _alloc_prop(device_id, exportable),
                             c.gran_rec if recommended else c.gran_min,
                             detail=f"VMM granularity of device {device_id}"))
        _gran_cache[key] = g
    return g


def allocation_granularity(device: Target = None, recommended: bool = False, *,
                           exportable: bool = False) -> int:
    """Granularity of VMM sizes, offsets and addresses on a device.

    Parameters
    ----------
    device : int, numba device, Location or None
        The device (``None``: the current one).
    recommended : bool
        ``False``: the minimum the driver accepts; ``True``: the size it
        recommends for performance (a multiple of the minimum).
    exportable : bool
        For allocations that can be exported as a POSIX file descriptor.

    Returns
    -------
    int
        Bytes; every :class:`PhysicalMemory` size and :class:`Mapping` offset
        must be a multiple of the minimum.

    Raises
    ------
    ValueError, TypeError
        Not a device.
    CudaError
        The device does not support VMM.
    """
    loc = _device_location(device)
    return _granularity(loc.id, bool(recommended), bool(exportable))


# ---------------------------------------------------------------------------
# lifetimes


class _Resource:
    """One driver object, freed exactly once and only after the objects built on it.

    ``retain``/``unretain`` count the dependants (mappings); ``close`` marks it
    closed and frees it at once, or when the last dependant goes.
    """

    __slots__ = ("what", "_free", "_users", "closed", "freed", "_lock")

    def __init__(self, what: str, free: Callable[[], None]) -> None:
        self.what = what
        self._free = free
        self._users = 0
        self.closed = False
        self.freed = False
        self._lock = threading.Lock()

    def retain(self) -> None:
        with self._lock:
            if self.closed:
                raise BufferClosedError(f"{self.what} is closed")
            self._users += 1

    def unretain(self) -> None:
        with self._lock:
            self._users -= 1
            run = self.closed and self._users == 0 and not self.freed
            if run:
                self.freed = True
        if run:
            self._run()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            run = self._users == 0
            if run:
                self.freed = True
        if run:
            self._run()

    def _run(self) -> None:
        try:
            self._free()
        except CudaError as exc:
            if exc.name not in _GONE:
                # A failed free is reported, never hidden (the memory may be lost).
                warnings.warn(f"umem_numba: freeing {self.what} failed: {exc}", RuntimeWarning, stacklevel=3)
        except Exception as exc:  # driver unloaded at interpreter exit
            if not _shutting_down():
                warnings.warn(f"umem_numba: freeing {self.what} failed: {exc!r}", RuntimeWarning, stacklevel=3)


def _shutting_down() -> bool:
    return sys.is_finalizing()


class _Scope(threading.local):
    device: int | None = None


_scope = _Scope()


@contextlib.contextmanager
def _on_device(device_id: int) -> Iterator[None]:
    """numba's context of ``device_id`` current; nested scopes of one device cost nothing."""
    if _scope.device == device_id:
        yield
        return
    with _driver.device_context(device_id):
        outer, _scope.device = _scope.device, device_id
        try:
            yield
        finally:
            _scope.device = outer


def _in_context(device_id: int, name: str, *args: Any, detail: str = "") -> Any:
    """A driver call with numba's context of ``device_id`` current."""
    with _on_device(device_id):
        return _driver.call(name, *args, detail=detail)


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

    __slots__ = ("_ptr", "_size", "_device_id", "_res", "_maps", "_starts", "__weakref__")

    @classmethod
    def reserve(cls, size: int, alignment: int = 0, *, device: Target = None) -> "AddressRange":
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
        size = _check_size(size, "reservation size")
        alignment = _check_alignment(alignment)
        loc = _device_location(device)
        gran = _granularity(loc.id)
        _check_multiple(size, gran, "reservation size")
        return cls._reserve(size, alignment or gran, loc.id)

    @classmethod
    def _reserve(cls, size: int, alignment: int, device_id: int) -> "AddressRange":
        ptr = int(_in_context(device_id, "cuMemAddressReserve", size, alignment, 0, 0,
                              detail=f"reserving {size} bytes of device address space"))
        self = object.__new__(cls)
        self._ptr = ptr
        self._size = size
        self._device_id = device_id
        self._maps: dict[int, int] = {}  # offset -> size of each live mapping
        self._starts: list[int] = []  # the same offsets, sorted (overlap checks in O(log n))

        def free() -> None:
            _in_context(device_id, "cuMemAddressFree", ptr, size, detail="freeing a VMM address range")

        self._res = _Resource(f"VMM address range {ptr:#x} ({size} bytes)", free)
        weakref.finalize(self, self._res.close)
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

    def __enter__(self) -> "AddressRange":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<AddressRange{state} ptr={self._ptr:#x} size={self._size} mappings={len(self._maps)}>"


class PhysicalMemory:
    """Physical device memory from ``cuMemCreate``, not addressable until mapped.

    Build one with :meth:`create` (or :meth:`from_shareable_handle` for memory
    another process exported); map it with :class:`Mapping`.

    Notes
    -----
    Counted in ``umem_numba.stats()["vmm"]`` while alive.  ``close()`` while
    mapped defers the ``cuMemRelease`` until the last mapping is unmapped.
    """

    __slots__ = ("_handle", "_size", "_device_id", "_exportable", "_res", "__weakref__")

    @classmethod
    def create(cls, size: int, device: Target = None, *, exportable: bool = False) -> "PhysicalMemory":
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
        size = _check_size(size, "physical allocation size")
        loc = _device_location(device)
        _check_multiple(size, _granularity(loc.id, exportable=bool(exportable)), "physical allocation size")
        handle = _in_context(loc.id, "cuMemCreate", size, _alloc_prop(loc.id, bool(exportable)), 0,
                             detail=f"creating {size} bytes of physical memory on device {loc.id}")
        return cls._adopt(handle, size, loc.id, bool(exportable))

    @classmethod
    def from_shareable_handle(cls, fd: int, size: int, device: Target = None) -> "PhysicalMemory":
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
        fd = _check_offset(fd, "file descriptor")
        size = _check_size(size, "imported allocation size")
        loc = _device_location(device)
        _check_multiple(size, _granularity(loc.id, exportable=True), "imported allocation size")
        handle = _in_context(loc.id, "cuMemImportFromShareableHandle", fd, _c().posix_fd,
                             detail=f"importing VMM memory from file descriptor {fd}")
        return cls._adopt(handle, size, loc.id, True)

    @classmethod
    def _adopt(cls, handle: Any, size: int, device_id: int, exportable: bool) -> "PhysicalMemory":
        self = object.__new__(cls)
        self._handle = handle
        self._size = size
        self._device_id = device_id
        self._exportable = exportable

        def free() -> None:
            try:
                _in_context(device_id, "cuMemRelease", handle, detail="releasing VMM physical memory")
            finally:
                _stats.record_free("vmm", size)

        _stats.record_alloc("vmm", size)
        self._res = _Resource(f"VMM physical memory ({size} bytes on device {device_id})", free)
        weakref.finalize(self, self._res.close)
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
            raise UnsupportedError("this physical memory was created without exportable=True, so the driver "
                                   "cannot give a file descriptor for it")
        fd = _in_context(self._device_id, "cuMemExportToShareableHandle", self._handle, _c().posix_fd, 0,
                         detail="exporting VMM memory as a POSIX file descriptor")
        return int(fd)

    def close(self) -> None:
        """Release now, or after the last mapping of it is unmapped."""
        self._res.close()

    def __enter__(self) -> "PhysicalMemory":
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
    """

    __slots__ = ("_range", "_physical", "_offset", "_res", "__weakref__")

    def __init__(self, address_range: AddressRange, physical: PhysicalMemory, offset: int = 0) -> None:
        if not isinstance(address_range, AddressRange):
            raise TypeError(f"address_range must be an AddressRange, got {type(address_range).__name__}")
        if not isinstance(physical, PhysicalMemory):
            raise TypeError(f"physical must be a PhysicalMemory, got {type(physical).__name__}")
        offset = _check_offset(offset, "mapping offset")
        size = physical.size
        if offset + size > address_range.size:
            raise ValueError(f"mapping {size} bytes at offset {offset} overflows the reserved range of "
                             f"{address_range.size} bytes (offset + size = {offset + size})")
        gran = _granularity(physical.device_id, exportable=physical.exportable)
        _check_multiple(offset, gran, "mapping offset")
        maps, starts = address_range._maps, address_range._starts
        k = bisect.bisect_left(starts, offset)
        for other in starts[max(0, k - 1):k + 1]:  # only the neighbours can overlap
            other_size = maps[other]
            if offset < other + other_size and other < offset + size:
                raise ValueError(f"mapping [{offset}, {offset + size}) overlaps the mapping at "
                                 f"[{other}, {other + other_size}) of this range")
        rres, pres = address_range._res, physical._res
        rres.retain()
        try:
            pres.retain()
        except BaseException:
            rres.unretain()
            raise
        ptr = address_range.ptr + offset
        device_id = physical.device_id
        try:
            _in_context(device_id, "cuMemMap", ptr, size, 0, physical._handle, 0,
                        detail=f"mapping {size} bytes at {ptr:#x}")
        except BaseException:
            pres.unretain()
            rres.unretain()
            raise
        maps[offset] = size
        bisect.insort(starts, offset)

        def unmap() -> None:
            try:
                _in_context(device_id, "cuMemUnmap", ptr, size, detail=f"unmapping {size} bytes at {ptr:#x}")
            finally:
                if maps.pop(offset, None) is not None:
                    del starts[bisect.bisect_left(starts, offset)]
                pres.unretain()
                rres.unretain()

        self._range = address_range
        self._physical = physical
        self._offset = offset
        self._res = _Resource(f"VMM mapping at {ptr:#x} ({size} bytes)", unmap)
        weakref.finalize(self, self._res.close)

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
        fl = _as_access(flags)
        loc = _device_location(device)
        with _on_device(self._physical.device_id):
            _set_access(self.ptr, self.size, {loc.id: fl}, f"granting {fl.name} access to device {loc.id}")

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
        loc = _device_location(device)
        with _on_device(self._physical.device_id):
            return _get_access(self.ptr, loc.id)

    def close(self) -> None:
        """Unmap (then free the range and memory if they were closed)."""
        self._res.close()

    def __enter__(self) -> "Mapping":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " unmapped" if self.closed else ""
        return f"<Mapping{state} ptr={self.ptr:#x} size={self.size} offset={self._offset}>"
