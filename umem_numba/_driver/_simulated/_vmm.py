"""Virtual memory management: reserved host address space, memfd "physical" memory, mappings and access.

Mixed into :class:`~umem_numba._driver._simulated.SimDriver` as :class:`VirtualMemory`.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from ._common import (
    _INVALID_VALUE,
    _OUT_OF_MEMORY,
    _SUCCESS,
    GRANULARITY,
    TOTAL_MEM,
    _int,
)
from ._memory import Allocations, _Memory

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC = lib
    return _LIBC


def _mmap(addr: int, size: int, prot: int, flags: int, fd: int, offset: int = 0) -> int | None:
    """libc's mmap (Python's cannot map at a given address); ``None`` on failure."""
    res = _libc().mmap(ctypes.c_void_p(addr or None), size, prot, flags, fd, offset)
    if res is None or res == ctypes.c_void_p(-1).value:
        return None
    return int(res)


class VirtualMemory(Allocations):
    """The driver's VMM entry points."""

    def _init_vmm(self) -> None:
        self._reserved: dict[int, int] = {}  # reserved address ranges: base -> size

    # -- virtual memory management: reserved host address space, memfd "physical" memory ----------
    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, ...]:
        return (_SUCCESS, GRANULARITY)

    def cuMemAddressReserve(self, size: Any, alignment: Any, addr: Any, flags: Any) -> tuple[Any, ...]:
        n, align = _int(size), max(_int(alignment), GRANULARITY)
        if n <= 0 or n % GRANULARITY:
            return (_INVALID_VALUE, None)
        raw = _mmap(0, n + align, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)
        if raw is None:
            return (_OUT_OF_MEMORY, None)
        base = raw + (-raw % align)
        if base > raw:
            _libc().munmap(ctypes.c_void_p(raw), ctypes.c_size_t(base - raw))
        tail = raw + n + align - (base + n)
        if tail:
            _libc().munmap(ctypes.c_void_p(base + n), ctypes.c_size_t(tail))
        with self._lock:
            self._reserved[base] = n
        return (_SUCCESS, base)

    def cuMemAddressFree(self, ptr: Any, size: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(size)
        with self._lock:
            if self._reserved.get(p) != n:
                return (_INVALID_VALUE,)
            if any(p <= m.base < p + n for m in self._memory.values() if m.kind == "vmm"):
                return (_INVALID_VALUE,)  # still mapped
            del self._reserved[p]
        _libc().munmap(ctypes.c_void_p(p), ctypes.c_size_t(n))
        return (_SUCCESS,)

    def cuMemCreate(self, size: Any, prop: Any, flags: Any) -> tuple[Any, ...]:
        n = _int(size)
        if n <= 0 or n % GRANULARITY:
            return (_INVALID_VALUE, None)
        if int(prop.location.id) != 0:
            return (101, None)
        with self._lock:
            if self._used() + n > TOTAL_MEM:
                return (_OUT_OF_MEMORY, None)
        fd = os.memfd_create("umem-sim-vmm", os.MFD_CLOEXEC)
        os.ftruncate(fd, n)
        with self._lock:
            return self._register(self._physical, lambda _: (fd, n, bool(int(prop.requestedHandleTypes))))

    def cuMemRelease(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            entry = self._physical.pop(_int(handle), None)
        if entry is None:
            return (_INVALID_VALUE,)
        os.close(entry[0])  # mappings keep the memory, as the driver's do
        return (_SUCCESS,)

    def cuMemExportToShareableHandle(self, handle: Any, kind: Any, flags: Any) -> tuple[Any, ...]:
        with self._lock:
            entry = self._physical.get(_int(handle))
        if entry is None:
            return (_INVALID_VALUE, None)
        if not entry[2]:
            return (800, None)  # CUDA_ERROR_NOT_PERMITTED: not created exportable
        return (_SUCCESS, os.dup(entry[0]))

    def cuMemImportFromShareableHandle(self, fd: Any, kind: Any) -> tuple[Any, ...]:
        try:
            mine = os.dup(_int(fd))
            n = os.fstat(mine).st_size
        except OSError:
            return (_INVALID_VALUE, None)
        with self._lock:
            return self._register(self._physical, lambda _: (mine, n, True))

    def cuMemMap(self, ptr: Any, size: Any, offset: Any, handle: Any, flags: Any) -> tuple[Any, ...]:
        p, n, off = _int(ptr), _int(size), _int(offset)
        with self._lock:
            entry = self._physical.get(_int(handle))
            if entry is None or off + n > entry[1] or n <= 0:
                return (_INVALID_VALUE,)
            if not any(b <= p and p + n <= b + sz for b, sz in self._reserved.items()):
                return (_INVALID_VALUE,)
            if any(self._find(q) is not None for q in (p, p + n - 1)):
                return (_INVALID_VALUE,)  # already mapped
            if _mmap(p, n, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED, entry[0], off) is None:
                return (_OUT_OF_MEMORY,)
            self._add_memory(_Memory("vmm", n, 0, 0, base=p))
        return (_SUCCESS,)

    def cuMemUnmap(self, ptr: Any, size: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(size)
        with self._lock:
            maps = [m for m in self._memory.values() if m.kind == "vmm" and p <= m.base < p + n]
            if not maps or any(m.base + m.size > p + n for m in maps):
                return (_INVALID_VALUE,)
            for m in maps:
                self._remove_memory(m)
            # Unlike cuMemFree, a GPU's cuMemUnmap does not wait for the device work queued on
            # the range (PyTorch's expandable segments synchronise their stream before unmapping
            # for that reason): that work would fault, or use whatever is mapped there by then.
            # It faults here when it runs, without touching the range (now PROT_NONE).
            self._fault_queued_work_on(p, p + n, "cuMemUnmap")
        _mmap(p, n, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1)
        return (_SUCCESS,)

    def cuMemSetAccess(self, ptr: Any, size: Any, descs: Any, count: Any) -> tuple[Any, ...]:
        p, n = _int(ptr), _int(size)
        flags = 0
        for d in list(descs)[: _int(count)]:
            if int(d.location.id) != 0:
                return (101,)
            flags = int(d.flags)
        with self._lock:
            maps = [m for m in self._memory.values() if m.kind == "vmm" and p <= m.base < p + n]
            if not maps:
                return (_INVALID_VALUE,)
            for m in maps:
                m.flags = flags
        return (_SUCCESS,)

    def cuMemGetAccess(self, location: Any, ptr: Any) -> tuple[Any, ...]:
        with self._lock:
            mem = self._find(_int(ptr))
        if mem is None or mem.kind != "vmm":
            return (_INVALID_VALUE, None)
        if int(location.id) != 0:
            return (_SUCCESS, 0)
        return (_SUCCESS, mem.flags)
