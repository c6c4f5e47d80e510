"""Stream-ordered memory pools: device, managed and host (pinned) pools, their frees and reuse.

Mixed into :class:`~umem_numba._driver._simulated.SimDriver` as :class:`Pools`.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..._errors import UnsupportedError
from ._common import (
    _INVALID_VALUE,
    _NOT_SUPPORTED,
    _SUCCESS,
    _Error,
    _int,
)
from ._locations import host_pool_location, location_code
from ._memory import Allocations, _Memory
from ._scheduling import _Op, _Stream

#: Chance that pool memory freed on another stream is reused, ordered after the free.
REUSE_ACROSS_STREAMS = 0.5


class _PoolBlock:
    __slots__ = ("free_op", "memory", "stream")

    def __init__(self, memory: _Memory, stream: _Stream, free_op: _Op) -> None:
        self.memory = memory
        self.stream = stream
        self.free_op = free_op


class _Pool:
    __slots__ = ("attrs", "destroyed", "free", "kind", "preferred", "used")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.destroyed = False
        self.free: list[_PoolBlock] = []
        self.used = 0
        self.preferred = -2  # managed pools: the location code of their allocations' preferred location
        self.attrs: dict[str, int] = {"RELEASE_THRESHOLD": 0, "USED_MEM_HIGH": 0, "RESERVED_MEM_HIGH": 0}


class Pools(Allocations):
    """The driver's memory pools."""

    def _init_pools(self) -> None:
        self._pools: dict[int, _Pool] = {}
        self._defaults: dict[str, int] = {}  # the default pool of each kind, made when first asked for
        self._current_pool = 0

    # -- pools ---------------------------------------------------------------------------
    def cuMemPoolCreate(self, props: Any) -> tuple[Any, ...]:
        managed = getattr(props.allocType, "name", "").endswith("MANAGED")
        if int(props.handleTypes):
            raise UnsupportedError(
                "cuMemPoolCreate: exportable memory pools are not supported under numba's CUDA simulator "
                "(NUMBA_ENABLE_CUDASIM=1); they need a real GPU"
            )
        preferred = -2
        host: dict[str, int] | None = None
        if managed:
            # A managed pool's location is its allocations' preferred location (device, host, host NUMA).
            try:
                preferred = location_code(props.location)
            except _Error as e:
                return (e.code, None)
        else:
            found = host_pool_location(props)
            if isinstance(found, int):
                return (found, None)
            host = found
        pool = _Pool("managed" if managed else "device" if host is None else "pinned")
        pool.preferred = preferred
        if host is not None:
            pool.attrs.update(host)
        with self._lock:
            return self._register(self._pools, lambda _: pool)

    def _pool(self, handle: Any) -> _Pool:
        pool = self._pools.get(_int(handle))
        if pool is None or pool.destroyed:
            raise _Error(_INVALID_VALUE)
        return pool

    def cuMemPoolDestroy(self, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            pool = self._pools.get(_int(handle))
            if pool is None or pool.destroyed:
                return (_INVALID_VALUE,)
            if pool.used:
                # The driver documents this as allowed (the pool goes with its last allocation), but on
                # an H100 (driver 580) freeing such an allocation crashed the process (SIGSEGV) at the
                # next synchronise: refused here rather than simulated.
                raise UnsupportedError(
                    f"cuMemPoolDestroy: {pool.used} bytes of the pool are still allocated; destroying it "
                    "before they are freed crashed a GPU's driver (H100, driver 580) when they were; "
                    "not supported under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
                )
            pool.destroyed = True
            self._drain()
            for block in pool.free:
                if block.memory.base in self._memory:
                    self._remove_memory(block.memory)
            pool.free = []
        return (_SUCCESS,)

    def cuMemAllocFromPoolAsync(self, nbytes: Any, handle: Any, stream: Any) -> tuple[Any, ...]:
        n = _int(nbytes)
        with self._lock:
            try:
                pool = self._pool(handle)
                s = self._stream(stream)
            except _Error as e:
                return (e.code, None)
            size = -(-max(n, 1) // 512) * 512
            for i, block in enumerate(pool.free):
                if block.memory.size != size:
                    continue
                if block.stream is s or block.free_op.done:
                    pass  # stream order, or the free has run: reuse as the driver may
                elif self._rng.random() < REUSE_ACROSS_STREAMS:
                    # The driver may reuse it, ordering the allocation after the free.
                    self._enqueue(stream, None, "pool reuse dependency", [block.free_op])
                else:
                    continue
                del pool.free[i]
                pool.used += size
                mem = block.memory
                mem.generation += 1
                if mem.kind == "managed":
                    # A new allocation: the pool's hints only, none of the last one's.
                    mem.forget_hints(pool.preferred)
                if mem.base not in self._memory:
                    self._add_memory(mem)
                return (_SUCCESS, mem.base)
            kind = pool.kind if pool.kind in ("managed", "pinned") else "device"
            res = self._allocate(kind, size, 0, _int(handle))
            if res[0] == _SUCCESS:
                pool.used += size
                if kind == "managed":
                    self._memory[res[1]].forget_hints(pool.preferred)
            return res

    def cuMemFreeAsync(self, ptr: Any, stream: Any) -> tuple[Any, ...]:
        p = _int(ptr)
        with self._lock:
            mem = self._memory.get(p)
            if mem is None or not mem.pool:
                return (_INVALID_VALUE,)
            pool = self._pools[mem.pool]
            if pool.destroyed:
                self._remove_memory(mem)
                return (_SUCCESS,)
            try:
                s = self._stream(stream)
            except _Error as e:
                return (e.code,)
            generation = mem.generation

            def run() -> None:
                # Freed memory holds garbage: work that reads it after the free shows it.
                ctypes.memset(mem.base, 0xFF, mem.size)
                if mem.generation == generation and mem.base in self._memory:
                    self._remove_memory(mem)  # not handed out again meanwhile: gone

            op = self._enqueue(s, run, "pool free")
            pool.free.append(_PoolBlock(mem, s, op))
            pool.used -= mem.size
        return (_SUCCESS,)

    def cuMemPoolTrimTo(self, handle: Any, keep: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code,)
            kept = 0
            remaining = []
            for block in pool.free:
                if block.free_op.done and kept + block.memory.size > _int(keep):
                    continue  # released
                kept += block.memory.size
                remaining.append(block)
            pool.free = remaining
        return (_SUCCESS,)

    def cuMemPoolGetAttribute(self, handle: Any, attr: Any) -> tuple[Any, ...]:
        name = getattr(attr, "name", str(attr)).replace("CU_MEMPOOL_ATTR_", "")
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code, None)
            reserved = pool.used + sum(b.memory.size for b in pool.free)
            values = {
                "USED_MEM_CURRENT": pool.used,
                "RESERVED_MEM_CURRENT": reserved,
            }
            pool.attrs["USED_MEM_HIGH"] = max(pool.attrs["USED_MEM_HIGH"], pool.used)
            pool.attrs["RESERVED_MEM_HIGH"] = max(pool.attrs["RESERVED_MEM_HIGH"], reserved)
            value = values.get(name, pool.attrs.get(name, 0))
        plain = ("REUSE_FOLLOW_EVENT_DEPENDENCIES", "LOCATION_TYPE", "LOCATION_ID", "ALLOCATION_TYPE")
        return (_SUCCESS, self._real.cuuint64_t(value) if name not in plain else value)

    def cuMemPoolSetAttribute(self, handle: Any, attr: Any, value: Any) -> tuple[Any, ...]:
        name = getattr(attr, "name", str(attr)).replace("CU_MEMPOOL_ATTR_", "")
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code,)
            pool.attrs[name] = _int(value)
        return (_SUCCESS,)

    def cuMemPoolGetAccess(self, handle: Any, location: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code, None)
            # A host (pinned) pool is mapped for no device until access is granted.
            own = 3 if int(location.id) == 0 and pool.kind != "pinned" else 0
            flags = pool.attrs.get(f"access{int(location.id)}", own)
        return (_SUCCESS, self._real.CUmemAccess_flags(flags))

    def cuMemPoolSetAccess(self, handle: Any, descs: Any, count: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                pool = self._pool(handle)
            except _Error as e:
                return (e.code,)
            for d in list(descs)[: _int(count)]:
                if int(d.location.id) != 0:
                    return (101,)  # CUDA_ERROR_INVALID_DEVICE: one device
                pool.attrs[f"access{int(d.location.id)}"] = int(d.flags)
        return (_SUCCESS,)

    def _default_pool(self, kind: str) -> int:
        handle = self._defaults.get(kind)
        if handle is None:
            handle = self._defaults[kind] = next(self._handles)
            self._pools[handle] = _Pool(kind)
        return handle

    def cuDeviceGetDefaultMemPool(self, device: Any) -> tuple[Any, ...]:
        with self._lock:
            return (_SUCCESS, self._default_pool("device"))

    def cuDeviceGetMemPool(self, device: Any) -> tuple[Any, ...]:
        with self._lock:
            return (_SUCCESS, self._current_pool or self._default_pool("device"))

    def cuDeviceSetMemPool(self, device: Any, handle: Any) -> tuple[Any, ...]:
        with self._lock:
            try:
                self._pool(handle)
            except _Error as e:
                return (e.code,)
            self._current_pool = _int(handle)
        return (_SUCCESS,)

    def cuMemGetDefaultMemPool(self, location: Any, kind: Any) -> tuple[Any, ...]:
        if not getattr(location.type, "name", "").endswith("DEVICE") or int(location.id) != 0:
            return (_NOT_SUPPORTED, None)  # CUDA_ERROR_NOT_SUPPORTED: host pools are not simulated
        managed = getattr(kind, "name", "").endswith("MANAGED")
        with self._lock:
            return (_SUCCESS, self._default_pool("managed" if managed else "device"))
