"""Memory pools on the driver's stream-ordered allocator (``cuMemPoolCreate``).

A :class:`MemoryPool` hands out managed or device memory with
``cuMemAllocFromPoolAsync`` and takes it back with ``cuMemFreeAsync``: both
are queued on a stream, so allocating and freeing cost a driver call each
and never synchronise.  Freed memory stays in the pool for the next
allocation (up to the release threshold) until :meth:`MemoryPool.trim`.

Stream-ordered lifetime
-----------------------
A buffer from a pool is *allocated on* a stream: work on that stream (and
host access, which waits for it through coherence) may use it at once; work
on another stream must be ordered after it (a umem_numba copy does that by
itself, a kernel launch on another stream does not: launch on the allocation
stream, or synchronise it first).  Closing the buffer, or dropping the last
reference, queues the free on the stream of the buffer's last recorded work,
after the stream waits (on the device) for work recorded on other streams:
no host synchronisation.  Keep that stream alive until the buffer is closed,
as with any stream-ordered allocator.  After a launch that bypassed the
toolkit (stream unknown) the free goes on the legacy default stream, which
orders after every blocking stream of the device.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from . import _driver, _events, _stats
from ._checks import as_nonnegative_int
from ._errors import OutOfMemoryError, UnsupportedError
from ._lifetime import Allocation, Memory, Transaction, finalizer
from ._location import Location, StreamLike, Target, as_device, stream_handle
from ._stats import PoolStats
from ._tracker import Tracker

__all__ = ["MemoryPool"]

POOL_KINDS = ("managed", "device")
#: Release threshold meaning "keep everything until trim()".
KEEP_ALL = (1 << 64) - 1

_live: weakref.WeakSet[MemoryPool] = weakref.WeakSet()
_defaults: dict[tuple[str, int], MemoryPool] = {}
_defaults_lock = threading.Lock()


def _check_kind(kind: Any) -> str:
    if kind not in POOL_KINDS:
        raise ValueError(f"MemoryPool kind must be 'managed' or 'device', got {kind!r}")
    return kind


def _check_bytes(value: Any, what: str, *, positive: bool = False) -> int:
    n = as_nonnegative_int(value, what, "an int number of bytes")
    if positive and n == 0:
        raise ValueError(f"{what} must be positive, got {n}")
    if n > KEEP_ALL:
        raise ValueError(f"{what} ({n}) does not fit in 64 bits")
    return n


def managed_pool_support() -> str:
    """'' if managed pools can be created here, else what is missing (asks the driver)."""
    api = _driver.api()
    missing = []
    try:
        major = int(str(api.version).split(".")[0])
    except ValueError:
        major = 0
    if major < 13 or api.c.pool_managed is None:
        missing.append(f"cuda-bindings 13 or newer (installed: {api.version}; pip install numba-cuda[cu13])")
    version = int(_driver.call("cuDriverGetVersion"))
    if version < 13000:
        missing.append(f"a CUDA 13 driver (this one supports CUDA {version // 1000}.{version % 1000 // 10})")
    lacking = [i for i in range(_driver.device_count()) if not _driver.device_attribute("CONCURRENT_MANAGED_ACCESS", i)]
    if lacking:
        missing.append(f"concurrentManagedAccess on every device (device(s) {', '.join(map(str, lacking))} lack it)")
    return "; ".join(missing)


class MemoryPool:
    """A stream-ordered memory pool of managed or device memory.

    Parameters
    ----------
    kind : {"managed", "device"}
        ``"managed"``: unified memory (host- and device-accessible; the pool's
        device is the preferred location of its allocations).  ``"device"``:
        device memory (:class:`~umem_numba.DeviceBuffer`).
    device : int, numba device or None
        The pool's device (``None``: the current one).
    release_threshold : int, optional
        Bytes of free memory the pool keeps across synchronisations before
        returning the rest to the driver.  Default: keep everything until
        :meth:`trim` (the driver's own default, 0, gives memory back at every
        synchronisation and makes allocation slow again).
    exportable : bool
        Device pools only: create the pool shareable with other processes
        (POSIX file descriptors), which numba IPC through the memory-manager
        plugin needs.

    Raises
    ------
    ValueError, TypeError
        Bad kind, device or threshold (before any driver call).
    UnsupportedError
        Managed pools need cuda-bindings 13, a CUDA 13 driver and
        concurrentManagedAccess on every device: the message says which is
        missing.  A device without memory-pool support, or an exportable
        managed pool (the driver cannot share managed pools), is refused too.

    Examples
    --------
    >>> pool = um.MemoryPool("managed")                           # doctest: +SKIP
    >>> buf = um.ManagedBuffer.empty(1 << 20, pool=pool, stream=s)  # doctest: +SKIP
    >>> buf.close()               # queued on s: no synchronisation # doctest: +SKIP
    >>> pool.trim(0)                                               # doctest: +SKIP
    """

    __slots__ = (
        "__weakref__",
        "_alloc_fn",
        "_closed",
        "_free_fn",
        "_handle",
        "_limit",
        "device_id",
        "exportable",
        "kind",
    )

    def __init__(
        self, kind: str, device: Target = None, release_threshold: int | None = None, *, exportable: bool = False
    ) -> None:
        kind = _check_kind(kind)
        threshold = KEEP_ALL if release_threshold is None else _check_bytes(release_threshold, "release_threshold")
        if kind == "managed" and exportable:
            raise UnsupportedError(
                "a managed memory pool cannot be exported to other processes "
                "(the driver supports IPC for device pools only)"
            )
        device_id = as_device(device, what="MemoryPool")
        loc = Location.device(device_id)
        api = _driver.api()
        drv, c = api.drv, api.c
        if kind == "managed":
            missing = managed_pool_support()
            if missing:
                raise UnsupportedError(f"managed memory pools need {missing}")
        elif not _driver.device_attribute("MEMORY_POOLS_SUPPORTED", loc.id):
            raise UnsupportedError(f"device {loc.id} does not support memory pools")
        if exportable and not _driver.device_attribute("MEMPOOL_SUPPORTED_HANDLE_TYPES", loc.id) & int(c.vmm_posix_fd):
            raise UnsupportedError(f"device {loc.id} cannot export memory pools as file descriptors")
        props = drv.CUmemPoolProps()
        props.allocType = c.pool_managed if kind == "managed" else c.vmm_pinned
        props.handleTypes = c.vmm_posix_fd if exportable else c.vmm_no_handle
        props.location = loc.to_cu()
        props.maxSize = 0
        handle = _driver.call_on(
            loc.id, "cuMemPoolCreate", props, detail=f"creating a {kind} memory pool on device {loc.id}"
        )
        self.kind = kind
        self.device_id = loc.id
        self.exportable = bool(exportable)
        self._handle = handle
        self._closed = False
        self._alloc_fn = drv.cuMemAllocFromPoolAsync
        self._free_fn = drv.cuMemFreeAsync
        total = int(_driver.call("cuDeviceTotalMem", loc.id))
        if kind == "managed":
            total += _host_ram()
        self._limit = total
        with Transaction() as tx:
            tx.append(_driver.call, "cuMemPoolDestroy", handle)
            self.release_threshold = threshold
            tx.commit()
        finalizer(self, _destroy, handle)
        _live.add(self)

    # -- properties ---------------------------------------------------------------
    @property
    def handle(self) -> int:
        """The ``CUmemoryPool`` handle as an int."""
        return int(self._handle)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def location(self) -> Location:
        """The pool's device as a :class:`~umem_numba.Location`."""
        return Location.device(self.device_id)

    def _attr(self, name: str) -> int:
        attr = getattr(_driver.consts().mempool_attribute, "CU_MEMPOOL_ATTR_" + name)
        return int(_driver.call("cuMemPoolGetAttribute", self._live(), attr, detail=f"reading {name} of a memory pool"))

    def _set_attr(self, name: str, value: int) -> None:
        api = _driver.api()
        attr = getattr(api.c.mempool_attribute, "CU_MEMPOOL_ATTR_" + name)
        _driver.call(
            "cuMemPoolSetAttribute",
            self._live(),
            attr,
            api.drv.cuuint64_t(value),
            detail=f"setting {name} of a memory pool",
        )

    @property
    def release_threshold(self) -> int:
        """Free bytes kept across synchronisations (read from the driver)."""
        return self._attr("RELEASE_THRESHOLD")

    @release_threshold.setter
    def release_threshold(self, value: int) -> None:
        self._set_attr("RELEASE_THRESHOLD", _check_bytes(value, "release_threshold"))

    def statistics(self) -> PoolStats:
        """Reserved and used bytes, current and high-water, read from the driver."""
        return PoolStats(
            1,
            self._attr("RESERVED_MEM_CURRENT"),
            self._attr("RESERVED_MEM_HIGH"),
            self._attr("USED_MEM_CURRENT"),
            self._attr("USED_MEM_HIGH"),
        )

    def reset_high(self) -> None:
        """Reset the reserved and used high-water marks to the current values."""
        self._set_attr("RESERVED_MEM_HIGH", 0)
        self._set_attr("USED_MEM_HIGH", 0)

    # -- allocation -------------------------------------------------------------------
    def _live(self) -> Any:
        if self._closed:
            raise ValueError("this MemoryPool is closed")
        return self._handle

    def allocate(self, nbytes: int, stream: StreamLike = None) -> int:
        """Allocate raw memory on ``stream``; returns the device address.

        The low-level interface (the memory-manager plugin and the benchmark
        use it); buffers come from ``ManagedBuffer.empty(..., pool=pool)`` and
        :class:`~umem_numba.DeviceBuffer`.  Free with :meth:`free`.

        Raises
        ------
        OutOfMemoryError
            The pool cannot grow by that much (the pool stays usable).
        """
        if type(nbytes) is not int:
            nbytes = _check_bytes(nbytes, "nbytes", positive=True)
        elif nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        handle = stream if type(stream) is int else stream_handle(stream)
        if self._closed:
            self._live()
        if nbytes > self._limit:
            raise OutOfMemoryError(
                "cuMemAllocFromPoolAsync",
                2,
                "CUDA_ERROR_OUT_OF_MEMORY",
                f"{nbytes} bytes requested from a {self.kind} pool of device "
                f"{self.device_id}, more than the {self._limit} bytes that can exist "
                "(refused before the driver call)",
            )
        err, ptr = self._alloc_fn(nbytes, self._handle, handle)
        if err != 0:
            return self._retry(err, nbytes, handle)
        return int(ptr)

    def _retry(self, err: Any, nbytes: int, handle: int) -> int:
        if _name(err) == "CUDA_ERROR_INVALID_CONTEXT":  # a thread with no current context
            with _driver.device_context(self.device_id):
                err, ptr = self._alloc_fn(nbytes, self._handle, handle)
            if err == 0:
                return int(ptr)
        detail = f"allocating {nbytes} bytes from a {self.kind} memory pool of device {self.device_id}"
        if _name(err) == "CUDA_ERROR_OUT_OF_MEMORY":
            try:
                s = self.statistics()
                detail += f" (pool: {s.used_current} bytes used, {s.reserved_current} reserved)"
            except Exception:
                pass
        _driver.raise_for(err, "cuMemAllocFromPoolAsync", detail)
        raise AssertionError("unreachable")

    def free(self, ptr: int, stream: StreamLike = None) -> None:
        """Return memory from :meth:`allocate` to the pool, ordered on ``stream``."""
        handle = stream if type(stream) is int else stream_handle(stream)
        err = self._free_fn(ptr, handle)[0]
        if err != 0:
            if _name(err) == "CUDA_ERROR_INVALID_CONTEXT":
                with _driver.device_context(self.device_id):
                    err = self._free_fn(ptr, handle)[0]
            if err != 0:
                _driver.raise_for(err, "cuMemFreeAsync", f"freeing {ptr:#x} into a memory pool")

    def trim(self, keep_bytes: int = 0) -> None:
        """Give free memory back to the driver until at most ``keep_bytes`` stay reserved.

        Memory whose stream-ordered free has not run yet cannot be released:
        synchronise the streams first for a full trim.
        """
        keep = _check_bytes(keep_bytes, "keep_bytes")
        _driver.call("cuMemPoolTrimTo", self._live(), keep, detail="trimming a memory pool")

    def allocation(self, nbytes: int, stream: int, kind: str) -> Allocation:
        """An :class:`~umem_numba._lifetime.Allocation` of ``nbytes`` on ``stream``, freed back stream-ordered.

        ``nbytes`` may be 0 (nothing is allocated); ``kind`` is the
        statistics bucket (``"managed"`` or ``"device"``).
        """
        tracker = Tracker(self.device_id)
        if not nbytes:
            return Allocation(kind, None, 0, self.device_id, tracker)
        with _driver.device_context(self.device_id if stream == 0 else None) as dev:
            ptr = self.allocate(nbytes, stream)
            with Transaction() as tx:
                tx.append(self.free, ptr, stream)
                alloc = Allocation(kind, _PoolMemory(self, kind, ptr, nbytes, stream), ptr, self.device_id, tracker)
                tx.commit()
            # Usable once the stream reaches the allocation: host access and
            # copies on other streams wait for this event.
            tracker.add(stream, _events.record(stream, dev))  # the allocation is the first write
        return alloc

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the pool (``cuMemPoolDestroy``).

        Allocations still alive stay valid; the driver releases the pool's
        memory once they are all freed.  Closing twice does nothing.
        """
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        _driver.call("cuMemPoolDestroy", self._handle, detail="destroying a memory pool")

    def __enter__(self) -> MemoryPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"handle={self.handle:#x}"
        return f"MemoryPool({self.kind!r}, device={self.device_id}, {state})"


def _name(err: Any) -> str:
    return _driver._result_name(_driver.api().drv, err)


def _destroy(handle: Any) -> None:
    try:
        _driver.api().drv.cuMemPoolDestroy(handle)
    except Exception:  # interpreter exit: the driver releases everything
        pass


def _host_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0


class _PoolMemory(Memory):
    """Pool memory of one buffer: its release is a free queued after its pending work, never on the host."""

    __slots__ = ("alloc_stream", "kind", "nbytes", "pool", "ptr")
    stream_ordered = True

    def __init__(self, pool: MemoryPool, kind: str, ptr: int, nbytes: int, alloc_stream: int) -> None:
        self.pool = pool
        self.kind = kind
        self.ptr = ptr
        self.nbytes = nbytes
        self.alloc_stream = alloc_stream

    def describe(self) -> str:
        return f"{self.kind} pool memory at {self.ptr:#x} ({self.nbytes} bytes)"

    def free(self, tracker: Tracker) -> None:
        stream = self.alloc_stream
        pending = list(tracker.pending.items())
        if tracker.unknown:
            stream = 0  # legacy default stream: after every blocking stream's work
        elif pending:
            stream = pending[-1][0]  # the stream first used most recently
        with _driver.device_context(self.pool.device_id):
            for s, event in pending:
                if s != stream:
                    _driver.call(
                        "cuStreamWaitEvent",
                        stream,
                        event.handle,
                        0,
                        detail="ordering a pool free after the buffer's work",
                    )
            self.pool.free(self.ptr, stream)


# ---------------------------------------------------------------------------
# Defaults and statistics


def default_pool(kind: str, device_id: int) -> MemoryPool:
    """The process-wide pool of ``kind`` on a device (created on first use)."""
    key = (kind, device_id)
    pool = _defaults.get(key)
    if pool is None or pool.closed:
        with _defaults_lock:
            pool = _defaults.get(key)
            if pool is None or pool.closed:
                pool = _defaults[key] = MemoryPool(kind, device=device_id)
    return pool


def check_pool(pool: Any, kind: str, what: str) -> MemoryPool:
    """Validate a ``pool=`` argument of a buffer constructor."""
    if not isinstance(pool, MemoryPool):
        raise TypeError(f"{what}: pool must be a umem_numba.MemoryPool, got {type(pool).__name__}")
    if pool.kind != kind:
        other = "DeviceBuffer" if pool.kind == "device" else "ManagedBuffer"
        raise ValueError(
            f"{what}: this is a {pool.kind!r} pool; it makes {other}s, not "
            f"{'ManagedBuffer' if kind == 'managed' else 'DeviceBuffer'}s"
        )
    pool._live()
    return pool


def totals() -> PoolStats:
    """Counters summed over every live pool (read from the driver)."""
    out = [0, 0, 0, 0, 0]
    for pool in list(_live):
        if pool.closed:
            continue
        try:
            s = pool.statistics()
        except Exception:  # the driver is gone (interpreter exit)
            continue
        out[0] += 1
        out[1] += s.reserved_current
        out[2] += s.reserved_high
        out[3] += s.used_current
        out[4] += s.used_high
    return PoolStats(*out)


_stats.add_source("pool", totals)
