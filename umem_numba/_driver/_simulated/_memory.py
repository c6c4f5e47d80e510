"""Memory: allocations of each kind, pointer attributes, copies and memsets.

Mixed into :class:`~umem_numba._driver._simulated.SimDriver` as :class:`Allocations`.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._errors import UnsupportedError
from ._common import (
    _CONTEXT,
    _INVALID_VALUE,
    _OUT_OF_MEMORY,
    _SUCCESS,
    PAGE,
    TOTAL_MEM,
    SimulatedFault,
    _Error,
    _int,
)
from ._scheduling import Scheduling

#: What ``cuPointerGetAttributes`` answers for an address the driver does not know (plain host
#: memory): NULL values with ``CUDA_SUCCESS`` (cuda.core reads memory type 0 as "unregistered host
#: memory" the same way).  Only the attributes umem_numba asks about unknown memory.
_UNKNOWN_POINTER: dict[str, Any] = {"MEMORY_TYPE": 0, "IS_MANAGED": False}


class _Memory:
    """One allocation: host bytes, their kind and the hints set on them."""

    __slots__ = (
        "accessed_by",
        "array",
        "attach",
        "base",
        "flags",
        "generation",
        "kind",
        "last_prefetch",
        "pool",
        "preferred",
        "read_mostly",
        "size",
    )

    def __init__(self, kind: str, size: int, flags: int = 0, pool: int = 0, base: int | None = None) -> None:
        pages = max(1, -(-size // PAGE))
        if base is None:
            # Page aligned, as the driver's allocations are (at least 256 bytes).
            self.array: np.ndarray | None = np.zeros(pages * PAGE + PAGE, np.uint8)
            addr = self.array.ctypes.data
            self.base = addr + (-addr % PAGE)
        else:  # a VMM mapping: the memory is a shared mapping of a memfd at a reserved address
            self.array = None
            self.base = base
        self.size = size
        self.kind = kind  # "device", "managed", "pinned"
        self.flags = flags
        self.pool = pool
        self.generation = 0  # pool memory: incremented at each reuse
        self.attach = 0
        if kind == "managed":
            self.read_mostly = np.zeros(pages, np.bool_)
            self.preferred = np.full(pages, -2, np.int32)
            self.accessed_by = np.zeros((pages, 2), np.bool_)  # device 0, host
            self.last_prefetch = np.full(pages, -2, np.int32)

    def forget_hints(self, preferred: int = -2) -> None:
        """Managed memory: no advice (a new allocation); ``preferred``: its pool's location code."""
        self.read_mostly[:] = False
        self.preferred[:] = preferred
        self.accessed_by[:] = False


def _fault(message: str) -> Callable[[], None]:
    def fault() -> None:
        raise SimulatedFault(message)

    return fault


class Allocations(Scheduling):
    """Allocations and what reads and writes them."""

    def _init_memory(self) -> None:
        self._memory: dict[int, _Memory] = {}  # by base address
        self._bases: list[int] = []  # sorted
        # VMM physical memory (cuMemCreate): handle -> (memfd, size, exportable); device memory in use too.
        self._physical: dict[int, tuple[int, int, bool]] = {}

    # -- memory bookkeeping ------------------------------------------------------------
    def _add_memory(self, mem: _Memory) -> int:
        self._memory[mem.base] = mem
        bisect.insort(self._bases, mem.base)
        return mem.base

    def _remove_memory(self, mem: _Memory) -> None:
        del self._memory[mem.base]
        self._bases.remove(mem.base)

    def _find(self, ptr: int) -> _Memory | None:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            return None
        mem = self._memory[self._bases[i]]
        return mem if ptr < mem.base + max(mem.size, 1) else None

    def _check_live(self, ptr: int, nbytes: int, what: str) -> None:
        """Raise (an illegal address, as a GPU would fault) unless ``[ptr, ptr + nbytes)`` is simulated memory."""
        end = ptr + nbytes
        while ptr < end:
            mem = self._find(ptr)
            if mem is None:
                raise SimulatedFault(
                    f"{what}: {end - ptr} bytes at {ptr:#x} are not allocated memory (freed, unmapped, or never)"
                )
            if mem.kind == "vmm" and not mem.flags:
                raise SimulatedFault(f"{what}: the device has no access to the VMM mapping at {mem.base:#x}")
            ptr = mem.base + mem.size

    def _fault_queued_work_on(self, lo: int, hi: int, call: str) -> None:
        """Make every queued operation that uses ``[lo, hi)`` a fault when it runs (lock held).

        For memory taken away under queued work by a call that does not wait for it: the
        operation touches nothing, and the synchronisation that waits for it reports the fault
        naming it, as a kernel fault is reported.
        """
        for op in self._pending:
            hit = [max(a, lo) for a, b in op.spans if a < hi and lo < b]
            if hit and op.run is not None:
                op.run = _fault(f"{op.what} used memory unmapped by {call} at {min(hit):#x}")

    def owns(self, ptr: int) -> bool:
        """Whether ``ptr`` lies in memory this driver allocated."""
        with self._lock:
            return self._find(_int(ptr)) is not None

    def cuMemGetInfo(self) -> tuple[Any, ...]:
        with self._lock:
            used = self._used() - sum(m.size for m in self._memory.values() if m.kind == "pinned")
        return (_SUCCESS, TOTAL_MEM - used, TOTAL_MEM)

    # -- allocation --------------------------------------------------------------------
    def _allocate(self, kind: str, nbytes: Any, flags: int = 0, pool: int = 0) -> tuple[Any, ...]:
        n = _int(nbytes)
        if n <= 0:
            return (_INVALID_VALUE, None)
        with self._lock:
            if self._used() + n > TOTAL_MEM:
                return (_OUT_OF_MEMORY, None)
            try:
                mem = _Memory(kind, n, flags, pool)
            except MemoryError:
                return (_OUT_OF_MEMORY, None)
            return (_SUCCESS, self._add_memory(mem))

    def _used(self) -> int:
        """Device bytes in use: allocations (not VMM mappings) and VMM physical memory."""
        mapped = sum(m.size for m in self._memory.values() if m.kind != "vmm")
        return mapped + sum(size for _, size, _ in self._physical.values())

    def cuMemAlloc(self, nbytes: Any) -> tuple[Any, ...]:
        return self._allocate("device", nbytes)

    def cuMemAllocManaged(self, nbytes: Any, flags: Any) -> tuple[Any, ...]:
        res = self._allocate("managed", nbytes, _int(flags))
        if res[0] == _SUCCESS:
            self._memory[res[1]].attach = _int(flags)
        return res

    def cuMemHostAlloc(self, nbytes: Any, flags: Any) -> tuple[Any, ...]:
        return self._allocate("pinned", nbytes, _int(flags))

    def cuMemHostGetDevicePointer(self, ptr: Any, flags: Any) -> tuple[Any, ...]:
        with self._lock:
            mem = self._find(_int(ptr))
        if mem is None or mem.kind != "pinned":
            return (_INVALID_VALUE, None)
        return (_SUCCESS, _int(ptr))

    def cuMemHostGetFlags(self, ptr: Any) -> tuple[Any, ...]:
        with self._lock:
            mem = self._find(_int(ptr))
        if mem is None or mem.kind != "pinned" or mem.pool:  # cuMemHostAlloc memory only
            return (_INVALID_VALUE, None)
        return (_SUCCESS, mem.flags)

    def _free(self, ptr: Any, kinds: tuple[str, ...]) -> tuple[Any, ...]:
        p = _int(ptr)
        with self._lock:
            mem = self._memory.get(p)
            if mem is None or mem.kind not in kinds or mem.pool:
                return (_INVALID_VALUE,)
            # The driver's free waits for the device work queued before it, as cudaFree's implicit
            # synchronisation does (PyTorch's expandable segments rely on the difference: cuMemUnmap
            # does not wait; see VirtualMemory.cuMemUnmap).  Not possible from a finalizer run
            # while simulated work runs: that work holds what it uses.
            if not self._running:
                self._drain()
            self._remove_memory(mem)
        return (_SUCCESS,)

    def cuMemFree(self, ptr: Any) -> tuple[Any, ...]:
        return self._free(ptr, ("device", "managed"))

    def cuMemFreeHost(self, ptr: Any) -> tuple[Any, ...]:
        return self._free(ptr, ("pinned",))

    # -- copies and memsets --------------------------------------------------------------
    def _copy(self, dst: Any, src: Any, nbytes: Any, handle: Any, what: str) -> tuple[Any, ...]:
        d, s_, n = _int(dst), _int(src), _int(nbytes)
        if n < 0:
            return (_INVALID_VALUE,)
        if n == 0:
            return (_SUCCESS,)
        with self._lock:
            try:
                stream = self._stream(handle)
            except _Error as e:
                return (e.code,)
            dst_known, src_known = self._find(d) is not None, self._find(s_) is not None
            if not src_known:
                # Pageable source: the driver has read it when the call returns.
                snapshot = ctypes.string_at(s_, n)

                def run() -> None:
                    if dst_known:
                        self._check_live(d, n, what)
                    ctypes.memmove(d, snapshot, n)

            else:

                def run() -> None:
                    if dst_known:
                        self._check_live(d, n, what)
                    self._check_live(s_, n, what)
                    ctypes.memmove(d, s_, n)

            op = self._enqueue(stream, run, what)
            op.spans = tuple((p, p + n) for p, known in ((d, dst_known), (s_, src_known)) if known)
            if not dst_known:
                # Pageable destination: the call returns once the copy is done.
                self._drive([op])
        return (_SUCCESS,)

    def cuMemcpyAsync(self, dst: Any, src: Any, nbytes: Any, handle: Any) -> tuple[Any, ...]:
        return self._copy(dst, src, nbytes, handle, "cuMemcpyAsync")

    def cuMemcpyHtoDAsync(self, dst: Any, src: Any, nbytes: Any, handle: Any) -> tuple[Any, ...]:
        if isinstance(src, np.ndarray):
            src = src.ctypes.data
        with self._lock:
            mem = self._find(_int(dst))
        if mem is not None and mem.kind == "pinned" and mem.pool:
            # Host memory of a pinned pool is no device destination: an H100 (driver 580) answers
            # CUDA_ERROR_INVALID_VALUE (cuMemcpyAsync takes it, by unified addressing).
            return (_INVALID_VALUE,)
        return self._copy(dst, src, nbytes, handle, "cuMemcpyHtoDAsync")

    def cuMemcpyDtoHAsync(self, dst: Any, src: Any, nbytes: Any, handle: Any) -> tuple[Any, ...]:
        if isinstance(dst, np.ndarray):
            dst = dst.ctypes.data
        return self._copy(dst, src, nbytes, handle, "cuMemcpyDtoHAsync")

    def cuMemcpyDtoDAsync(self, dst: Any, src: Any, nbytes: Any, handle: Any) -> tuple[Any, ...]:
        return self._copy(dst, src, nbytes, handle, "cuMemcpyDtoDAsync")

    def cuMemcpyPeerAsync(
        self, dst: Any, dst_ctx: Any, src: Any, src_ctx: Any, nbytes: Any, handle: Any
    ) -> tuple[Any, ...]:
        return self._copy(dst, src, nbytes, handle, "cuMemcpyPeerAsync")

    def cuMemsetD8Async(self, ptr: Any, value: Any, count: Any, handle: Any) -> tuple[Any, ...]:
        p, v, n = _int(ptr), _int(value) & 0xFF, _int(count)
        with self._lock:
            if self._find(p) is None:
                return (_INVALID_VALUE,)

            def run() -> None:
                self._check_live(p, n, "cuMemsetD8Async")
                ctypes.memset(p, v, n)

            try:
                self._enqueue(handle, run, "cuMemsetD8Async").spans = ((p, p + n),)
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    def cuMemsetD32Async(self, ptr: Any, value: Any, count: Any, handle: Any) -> tuple[Any, ...]:
        p, v, n = _int(ptr), _int(value) & 0xFFFFFFFF, _int(count)
        with self._lock:
            if self._find(p) is None:
                return (_INVALID_VALUE,)

            def run() -> None:
                self._check_live(p, 4 * n, "cuMemsetD32Async")
                np.frombuffer((ctypes.c_uint32 * n).from_address(p), np.uint32)[:] = v  # type: ignore[call-overload]

            try:
                self._enqueue(handle, run, "cuMemsetD32Async").spans = ((p, p + 4 * n),)
            except _Error as e:
                return (e.code,)
        return (_SUCCESS,)

    # The synchronous forms: on the legacy stream, done when they return.
    def _sync(self, res: tuple[Any, ...]) -> tuple[Any, ...]:
        if res[0] == _SUCCESS:
            with self._lock:
                self._drive(list(self._legacy.ops))
        return res

    def cuMemsetD8(self, ptr: Any, value: Any, count: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemsetD8Async(ptr, value, count, 0))

    def cuMemsetD32(self, ptr: Any, value: Any, count: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemsetD32Async(ptr, value, count, 0))

    def cuMemcpy(self, dst: Any, src: Any, nbytes: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemcpyAsync(dst, src, nbytes, 0))

    def cuMemcpyHtoD(self, dst: Any, src: Any, nbytes: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemcpyHtoDAsync(dst, src, nbytes, 0))

    def cuMemcpyDtoH(self, dst: Any, src: Any, nbytes: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemcpyDtoHAsync(dst, src, nbytes, 0))

    def cuMemcpyDtoD(self, dst: Any, src: Any, nbytes: Any) -> tuple[Any, ...]:
        return self._sync(self.cuMemcpyDtoDAsync(dst, src, nbytes, 0))

    # -- pointer attributes ---------------------------------------------------------------------
    def cuPointerGetAttribute(self, attr: Any, ptr: Any) -> tuple[Any, ...]:
        name = getattr(attr, "name", str(attr)).replace("CU_POINTER_ATTRIBUTE_", "")
        p = _int(ptr)
        with self._lock:
            mem = self._find(p)
        if mem is None:
            return (_INVALID_VALUE, None)
        mt = self._real.CUmemorytype
        values: dict[str, Any] = {
            "IS_MANAGED": mem.kind == "managed",
            "MEMORY_TYPE": mt.CU_MEMORYTYPE_HOST if mem.kind == "pinned" else mt.CU_MEMORYTYPE_DEVICE,
            "MAPPING_BASE_ADDR": mem.base,
            "MAPPING_SIZE": mem.size,
            "DEVICE_POINTER": p,
            "HOST_POINTER": p,
            "DEVICE_ORDINAL": 0,
            "CONTEXT": _CONTEXT,
            "MAPPED": True,
            "RANGE_START_ADDR": mem.base,
            "RANGE_SIZE": mem.size,
            "MEMPOOL_HANDLE": mem.pool or None,
            "IS_LEGACY_CUDA_IPC_CAPABLE": False,
            "SYNC_MEMOPS": True,
            "BUFFER_ID": mem.base,
            "ACCESS_FLAGS": 3,
        }
        if name not in values:
            raise UnsupportedError(
                f"cuPointerGetAttribute({name}): not supported under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
            )
        return (_SUCCESS, values[name])

    def cuPointerGetAttributes(self, numAttributes: Any, attributes: Any, ptr: Any) -> tuple[Any, ...]:  # noqa: N803
        """The driver's answers: for memory it knows, ``cuPointerGetAttribute``'s; for other memory, NULL values.

        Unlike ``cuPointerGetAttribute``, the driver does not fail for an
        address it does not know (plain host memory): it answers ``CUDA_SUCCESS``
        with every attribute NULL.  Only the NULL answers umem_numba relies on
        are given here (memory type 0, not managed); other attributes of
        unknown memory are refused rather than guessed.
        """
        attributes = list(attributes or ())
        if int(numAttributes) != len(attributes):
            return (_INVALID_VALUE, None)
        p = _int(ptr)
        with self._lock:
            mem = self._find(p)
        values = []
        for attr in attributes:
            name = getattr(attr, "name", str(attr)).replace("CU_POINTER_ATTRIBUTE_", "")
            if mem is None:
                if name not in _UNKNOWN_POINTER:
                    raise UnsupportedError(
                        f"cuPointerGetAttributes({name}) of memory the driver does not know: not supported under "
                        "numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
                    )
                values.append(_UNKNOWN_POINTER[name])
                continue
            err, value = self.cuPointerGetAttribute(attr, p)
            if err != _SUCCESS:
                return (err, None)
            values.append(value)
        return (_SUCCESS, values)
