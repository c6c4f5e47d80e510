"""Memory pools on the driver's stream-ordered allocator (``cuMemPoolCreate``).

A :class:`MemoryPool` hands out managed, device or pinned host memory with
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
reference, puts its memory on a free list (below) or queues the free on the
legacy default stream of its device, after that stream waits (on the device)
for the buffer's recorded work: no host synchronisation.  After a launch that bypassed the
toolkit, or by another library the buffer escaped to, the memory is *held*
until a device synchronise (see "Work umem_numba could not see" below).

The buffers' free lists
-----------------------
The lists themselves (what is kept, under which key, when it may be reused)
are :class:`~umem_numba._memory._free_lists.FreeLists`, apart from this façade, as
CuPy keeps ``_Arena`` apart from ``SingleDeviceMemoryPool``.
A driver allocation and free cost about 1 µs each through the binding, and
a buffer needs bookkeeping on top, so buffers (``ManagedBuffer.empty(...,
pool=)``, :class:`~umem_numba.DeviceBuffer`) keep the memory of closed
buffers in free lists of the pool, one per size (rounded up to 512 bytes),
as CuPy's pool does.  A closed buffer's memory goes on its list together
with the buffer's coherence record (the events of its last device work): the
next buffer of that size takes both, so its host access and its work on
other streams wait for the old work exactly as the driver's stream-ordered
free would make them, with no driver call on either side.  A plain numba
launch (which umem_numba cannot order) is safe on the allocation stream: a
buffer taken on another stream than the old work's makes that stream wait for
it (``cuStreamWaitEvent``).  Streams are told apart by their
``cuStreamGetId`` (:func:`umem_numba._driver.stream_key`), never by the raw
handle: handle 2, the per-thread default stream, names another stream in
every thread, and a destroyed stream's handle can come back for a new one.

Memory on the free lists is *used* from the driver's point of view
(``statistics().used_current``) and reported as ``cached``.  The lists hold
at most ``release_threshold`` bytes (default: everything); :meth:`MemoryPool.trim`
and :meth:`MemoryPool.close` give them back to the driver first, and an
allocation that finds the driver out of memory empties them and tries again.
Memory that ever took advice (``buf.hints``) goes back to the driver, not on
a list.  The raw :meth:`MemoryPool.allocate` / :meth:`MemoryPool.free`
interface (addresses, no coherence record) keeps free lists per size *and
stream* (by ``cuStreamGetId``), as CuPy's pool does: an address freed on a
stream is handed out again for an allocation on that stream only, where
stream order makes it safe.  The id of a live numba stream is kept while its
object lives, and the pool remembers the last one it saw (by a weak
reference), so passing the stream object (or its handle while it lives) costs
no driver call; a raw handle of a stream nobody is known to own costs one
``cuStreamGetId``.  A free that goes to the driver is queued on the
legacy default stream of the pool's device after that stream waits for the
buffer's recorded events: it never names a stream by a handle that may mean
another stream in the thread the free runs in (a garbage collection can run
it in any thread) or a stream destroyed meanwhile.

Kinds, shared pools and access
------------------------------
What a pool is made of (its kind and location, the driver's pools it can
wrap, the access modes) is described in :mod:`umem_numba._memory._resources`.  A
pool made here is owned: :meth:`MemoryPool.close` destroys it.  A pool from
:meth:`MemoryPool.default` is the driver's, shared with other libraries: it
is never destroyed or trimmed by umem_numba, and it keeps no free lists
(their limit is 0 bytes whatever the pool's release threshold), so memory
umem_numba frees is at once in the driver's pool for the other libraries.

Work umem_numba could not see
-----------------------------
A plain numba launch on a pool buffer, work of a library the buffer escaped
to, and every array of numba's memory-manager plugin (numba does not say on
which streams its kernels used an array) may be running on *any* stream,
non-blocking ones included.  No stream-ordered free can be ordered after such
work, and no event covers it: only a synchronise of the device does.  So such
memory is never freed to the driver nor put on a free list when it is
released: it is *held*, with a ticket per device it may be used on (the
pool's device; the plain launch's devices; every active device after an
escape).  A held block becomes *idle* (reusable on any stream, by buffers and
the raw interface alike: nothing can still use it) once a device synchronise
that *began after* it was held has completed on each of its devices.  The
pool counts its own synchronises per device (:func:`~umem_numba._memory._free_lists.synchronize_for_reuse`:
``cuCtxSynchronize`` between a begin ticket and a done mark), so an
allocation that finds no block on its lists first takes the held blocks that
a synchronise has freed meanwhile; when the pool holds
:data:`~umem_numba._memory._free_lists.HELD_SYNC_COUNT` blocks or
:data:`~umem_numba._memory._free_lists.HELD_SYNC_BYTES` bytes, that
allocation synchronises the held blocks' devices once and takes the whole
batch (numba's own allocator synchronises as often: ``cuMemFree`` does, for
every batch of its deferred frees).  Otherwise it asks the driver for new
memory.  Held and idle memory counts as ``cached``; :meth:`MemoryPool.trim`,
:meth:`MemoryPool.release_cached`, :meth:`MemoryPool.close` and an allocation
out of memory synchronise and give it back.  Buffers and raw addresses whose
work umem_numba tracked never wait for a synchronise: their paths are
unchanged.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from .. import _driver
from .._checks import as_nonnegative_int
from .._driver._location import _MAX_HANDLE, Location, StreamLike, Target, as_device, stream_handle
from .._errors import CudaError, OutOfMemoryError, UnsupportedError
from . import _events, _resources, _stats
from ._free_lists import KEEP_ALL, FreeLists, synchronize_for_reuse
from ._lifetime import Allocation, Memory, Transaction, finalizer, report_failed_free
from ._stats import PoolStats
from ._tracker import Tracker, refuse_capture


def _no_owner() -> None:
    """The owner in :data:`_NO_STREAM`: none, so no stream matches it."""


#: What the owner in ``MemoryPool._last`` of handle 0 returns: something alive that no caller can pass.
_ALWAYS = object()


def _always() -> object:
    """The owner in ``MemoryPool._last`` of handle 0: the pool's legacy stream, whose key never changes."""
    return _ALWAYS


_Last = tuple[Callable[[], Any], int, "int | None", "dict[int, list[int]] | None"]
#: ``MemoryPool._last`` before any live numba stream was used: matches no stream.
_NO_STREAM: _Last = (_no_owner, -1, None, None)

#: Free-list sizes are multiples of this (bytes), as in CuPy's pool.
ROUND = 512
_ROUND_UP, _ROUND_MASK = ROUND - 1, -ROUND  # size = (nbytes + _ROUND_UP) & _ROUND_MASK

__all__ = ["MemoryPool"]

POOL_KINDS = _resources.POOL_KINDS
_live: weakref.WeakSet[MemoryPool] = weakref.WeakSet()
_defaults: dict[tuple[str, int], MemoryPool] = {}
#: The wrappers of the driver's shared pools (:meth:`MemoryPool.default`), by kind and device.
_shared: dict[tuple[str, int], MemoryPool] = {}
_defaults_lock = threading.Lock()


def _check_bytes(value: Any, what: str, *, positive: bool = False) -> int:
    n = as_nonnegative_int(value, what, "an int number of bytes")
    if positive and n == 0:
        raise ValueError(f"{what} must be positive, got {n}")
    if n > KEEP_ALL:
        raise ValueError(f"{what} ({n}) does not fit in 64 bits")
    return n


class MemoryPool:
    """A stream-ordered memory pool of managed, device or pinned host memory.

    Parameters
    ----------
    kind : {"managed", "device", "pinned"}
        ``"managed"``: unified memory (host- and device-accessible; the pool's
        device is the preferred location of its allocations).  ``"device"``:
        device memory (:class:`~umem_numba.DeviceBuffer`).  ``"pinned"``:
        page-locked host memory (:class:`~umem_numba.PinnedBuffer`), on the
        driver's host-location pools; the pool's device gets read-write access
        to it (:meth:`set_access` grants others).
    device : int, numba device or None
        The pool's device (``None``: the current one).  For a pinned pool, the
        device that may use its memory and whose context runs its frees.
    release_threshold : int, optional
        Bytes of free memory the pool keeps across synchronisations before
        returning the rest to the driver.  Default: keep everything until
        :meth:`trim` (the driver's own default, 0, gives memory back at every
        synchronisation and makes allocation slow again).
    exportable : bool
        Device pools only: create the pool shareable with other processes
        (POSIX file descriptors), which numba IPC through the memory-manager
        plugin needs.
    numa : int, optional
        Pinned pools only: the host NUMA node of the memory
        (``CU_MEM_LOCATION_TYPE_HOST_NUMA``; ``info()["numa_nodes"]`` lists
        them); ``None``: the host as a whole (``CU_MEM_LOCATION_TYPE_HOST``).
    preferred_location : int, str, Location or numba device, optional
        Managed pools only: the preferred location of every allocation, as
        the driver records it for the pages (``preferred_location`` of the
        buffer's hints reads it back): a device, ``"cpu"`` (the host) or
        ``"cpu:N"`` / ``Host(numa=N)`` (host NUMA node ``N``), as cuda.core's
        ``ManagedMemoryResourceOptions(preferred_location=...)``.  ``None``:
        the pool's device.

    Raises
    ------
    ValueError, TypeError
        Bad kind, device, threshold, NUMA node or preferred location (before
        any driver call).
    UnsupportedError
        Managed pools need cuda-bindings 13, a CUDA 13 driver and
        concurrentManagedAccess on every device; pinned pools need a CUDA 13
        driver (a CUDA 12.6 one at a host NUMA node) and a device that
        reports host memory pools: the message says which is missing.  A
        device without memory-pool support, or an exportable managed or
        pinned pool (the driver can share device pools only), is refused too.

    See Also
    --------
    MemoryPool.default : the driver's pool that CuPy, RMM and cuda.core share.

    Examples
    --------
    >>> pool = um.MemoryPool("managed")                           # doctest: +SKIP
    >>> buf = um.ManagedBuffer.empty(1 << 20, pool=pool, stream=s)  # doctest: +SKIP
    >>> buf.close()               # queued on s: no synchronisation # doctest: +SKIP
    >>> pool.trim(0)                                               # doctest: +SKIP
    >>> staging = um.PinnedBuffer.empty(1 << 20, pool=um.MemoryPool("pinned"), stream=s)  # doctest: +SKIP
    >>> host_first = um.MemoryPool("managed", preferred_location="cpu")  # doctest: +SKIP
    """

    __slots__ = (
        "__weakref__",
        "_alloc_fn",
        "_closed",
        "_driver_pool",
        "_finalizer",
        "_free_fn",
        "_get_id",
        "_handle",
        "_last",
        "_legacy_key",
        "_limit",
        "_lists",
        "_owned",
        "_raw_sizes",
        "_where",
        "device_id",
        "exportable",
        "kind",
    )

    def __init__(
        self,
        kind: str,
        device: Target = None,
        release_threshold: int | None = None,
        *,
        exportable: bool = False,
        numa: int | None = None,
        preferred_location: Target | Location = None,
    ) -> None:
        resource = _resources.check_kind(kind)
        kind = resource.name
        threshold = KEEP_ALL if release_threshold is None else _check_bytes(release_threshold, "release_threshold")
        if exportable and not resource.pool_exportable:
            raise UnsupportedError(
                f"a {kind} memory pool cannot be exported to other processes "
                "(the driver supports IPC for device pools only)"
            )
        numa = resource.check_numa(numa)
        preferred = resource.check_preferred(preferred_location)
        device_id = as_device(device, what="MemoryPool")
        loc = Location.device(device_id)
        where = resource.pool_location(device_id, numa) if preferred is None else preferred
        api = _driver.api()
        drv, c = api.drv, api.c
        missing = resource.pool_support(device_id, numa)
        if missing:
            raise UnsupportedError(missing)
        if exportable and not _driver.device_attribute("MEMPOOL_SUPPORTED_HANDLE_TYPES", loc.id) & int(c.vmm_posix_fd):
            raise UnsupportedError(f"device {loc.id} cannot export memory pools as file descriptors")
        props = drv.CUmemPoolProps()
        props.allocType = resource.pool_alloc_type(c)
        props.handleTypes = c.vmm_posix_fd if exportable else c.vmm_no_handle
        props.location = where.to_cu()
        props.maxSize = 0
        try:
            handle = _driver.call_on(
                loc.id, "cuMemPoolCreate", props, detail=f"creating a {kind} memory pool at {where} for device {loc.id}"
            )
        except CudaError as exc:
            refused = resource.pool_refused(exc, where)
            if refused is None:
                raise
            raise refused from exc
        self._adopt(kind, loc.id, handle, where, owned=True, exportable=exportable)
        with Transaction() as tx:
            tx.append(self._driver_pool.let_go)  # nothing allocated yet: destroyed now
            self.release_threshold = threshold
            if where.is_host and resource.pool_access_changes:
                # A host pool is mapped for no device until access is granted (cuMemPoolCreate);
                # managed memory preferring the host is mapped for every device by the driver.
                self._grant(loc.id, "rw")
            tx.commit()
        self._finalizer = finalizer(self, _let_go, self._lists, self._driver_pool)
        _live.add(self)

    def _adopt(self, kind: str, device_id: int, handle: Any, where: Location, *, owned: bool, exportable: bool) -> None:
        """Set up the façade over the driver pool ``handle`` (made here, or the driver's, ``owned=False``)."""
        api = _driver.api()
        drv = api.drv
        self.kind = kind
        self.device_id = device_id
        self.exportable = bool(exportable)
        self._where = where
        self._owned = owned
        self._handle = handle
        self._closed = False
        #: The driver pool and its outstanding allocations: destroyed once this pool lets it go and
        #: the last is freed (never, for the driver's shared pools).
        self._driver_pool = DriverPool(handle, device_id, owned=owned)
        self._alloc_fn = drv.cuMemAllocFromPoolAsync
        self._free_fn = drv.cuMemFreeAsync
        #: The free lists (the policy: what is kept for reuse, and when it may be reused).  A
        #: shared pool keeps none (limit 0): memory umem_numba frees must reach the driver's pool,
        #: where the other libraries allocate from.
        self._lists: FreeLists[_PoolMemory] = FreeLists(device_id, KEEP_ALL if owned else 0, self._driver_pool.freed)
        #: ``cuStreamGetId`` of the legacy stream of the pool device's context (looked up once).
        self._legacy_key: int | None = None
        #: Every address allocate() handed out that is in use (not freed): its rounded size, and
        #: the stream (handle, key, thread) it was allocated on when the key was looked up, so
        #: that a free on the same handle (in the same thread, for the handles 1 and 2 that name a
        #: stream per context or thread; 0 otherwise) need not ask the driver again.
        self._raw_sizes: dict[int, tuple[int, int, int | None, int]] = {}
        #: The last live numba stream used with this pool: (weak reference to the stream object
        #: that owns it, its handle, its ``cuStreamGetId``, its raw free lists); see :meth:`_resolve`.
        self._last: _Last = _NO_STREAM
        self._get_id = api.stream_get_id
        #: The most an allocation can ask for (larger requests are refused before the driver).
        self._limit: int = self.resource.pool_limit(device_id)

    @classmethod
    def default(cls, kind: str = "device", device: Target = None) -> MemoryPool:
        """The driver's pool that other libraries allocate from too, wrapped without owning it.

        Parameters
        ----------
        kind : {"device", "managed"}
            ``"device"``: the device's *current* pool (``cuDeviceGetMemPool``,
            its default pool unless ``cuDeviceSetMemPool`` chose another), the
            pool of ``cudaMallocAsync``, CuPy's ``MemoryAsyncPool``, cuda.core's
            ``DeviceMemoryResource(device)`` and RMM's async resources built on
            it.  ``"managed"``: the device's default managed pool
            (``cuMemGetDefaultMemPool``, CUDA 13), RMM's
            ``CudaAsyncManagedMemoryResource``.
        device : int, numba device or None
            ``None``: the current device.

        Returns
        -------
        MemoryPool
            One wrapper per pool and process (asked again if the device's
            current pool changed).  It is never destroyed: :meth:`close` only
            gives umem_numba's memory back and stops using the pool.  It keeps
            no free lists (closed buffers' memory goes back to the driver's
            pool at once, where the other libraries can reuse it) and does not
            change the pool's release threshold; setting
            :attr:`release_threshold` or calling :meth:`trim` acts on the
            shared pool, for every library (a trim releases only memory no
            allocation uses, other libraries' free memory included).

        Raises
        ------
        ValueError, TypeError
            Bad kind or device (before any driver call).
        UnsupportedError
            No memory pools on the device; for ``"managed"``, cuda-bindings
            13, a CUDA 13 driver or concurrentManagedAccess is missing.
        """
        resource = _resources.check_kind(kind, _resources.SHARED_KINDS, "MemoryPool.default kind")
        kind = resource.name
        device_id = as_device(device, what="MemoryPool.default")
        handle = resource.shared_pool(device_id)
        key = (kind, device_id)
        with _defaults_lock:
            pool = _shared.get(key)
            if pool is not None and not pool._closed and int(pool._handle) == int(handle):
                return pool
            pool = object.__new__(cls)
            pool._adopt(kind, device_id, handle, Location.device(device_id), owned=False, exportable=False)
            pool._finalizer = finalizer(pool, _release_all, pool._lists)
            _live.add(pool)
            _shared[key] = pool
        return pool

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
        """Where the pool's memory lives: its device, or the host (a host NUMA node) for a pinned pool.

        For a managed pool, the preferred location of its allocations (``preferred_location=``).
        """
        return self._where

    @property
    def resource(self) -> _resources.MemoryResource:
        """What the pool's memory is: where it is reachable, what it supports (one description per kind)."""
        return _resources.RESOURCES[self.kind]

    @property
    def shared(self) -> bool:
        """Whether this wraps a pool the driver owns (:meth:`default`): never destroyed by umem_numba."""
        return not self._owned

    # -- access from devices ---------------------------------------------------------
    def set_access(self, device: Target, mode: str | None) -> None:
        """Grant device ``device`` access to the pool's memory (``cuMemPoolSetAccess``), or revoke it.

        Parameters
        ----------
        device : int or numba device
            A device other than the pool's own (peer access between GPUs; for a
            pinned pool, another GPU that may use the host memory).  The pool's
            own device always has read-write access: ``"rw"`` for it does
            nothing, anything else is refused.
        mode : {"rw", "r", None}
            Read-write, read-only, or no access.  The grant covers the pool's
            memory now and later; read it back with :meth:`access`.

        Raises
        ------
        ValueError, TypeError
            Bad mode, unknown device, or a change to the pool's own device
            (before any driver call but the device count).
        UnsupportedError
            A managed pool (the driver maps managed memory for every device
            itself and refuses access changes).
        CudaError
            The driver refused (e.g. no peer access between the two GPUs).
        """
        mode = _resources.check_mode(mode)
        if not self.resource.pool_access_changes:
            raise UnsupportedError(
                "MemoryPool.set_access: a managed pool cannot change which devices reach it "
                "(the driver maps managed memory for every device itself)"
            )
        device_id = as_device(device, what="MemoryPool.set_access")
        if device_id == self.device_id:
            if mode == "rw":
                return
            raise ValueError(
                f"MemoryPool.set_access: device {device_id} is this pool's own device, which always has "
                f"read-write access; {mode!r} would take it away"
            )
        self._live()
        self._grant(device_id, mode)

    def _grant(self, device_id: int, mode: str | None) -> None:
        desc = _resources.access_desc(device_id, mode)
        _driver.call_on(
            self.device_id,
            "cuMemPoolSetAccess",
            self._handle,
            [desc],
            1,
            detail=f"granting device {device_id} {mode or 'no'} access to a {self.kind} memory pool",
        )

    def access(self, device: Target) -> str | None:
        """How device ``device`` may use the pool's memory, read from the driver (``cuMemPoolGetAccess``).

        Returns
        -------
        {"rw", "r", None}
            Read-write, read-only, or no access.
        """
        device_id = as_device(device, what="MemoryPool.access")
        flags = _driver.call_on(
            self.device_id,
            "cuMemPoolGetAccess",
            self._live(),
            Location.device(device_id).to_cu(),
            detail=f"reading device {device_id}'s access to a {self.kind} memory pool",
        )
        return _resources.mode_of_flags(flags)

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
        value = _check_bytes(value, "release_threshold")
        self._set_attr("RELEASE_THRESHOLD", value)
        self._lists.limit = value if self._owned else 0  # a shared pool keeps no free lists
        if self.cached_bytes > value:
            self.release_cached()

    def statistics(self) -> PoolStats:
        """Reserved and used bytes, current and high-water, read from the driver; ``cached`` from the free lists.

        Memory on the free lists counts as used for the driver;
        ``used_current - cached`` is what live buffers and raw allocations hold.
        """
        return PoolStats(
            1,
            self._attr("RESERVED_MEM_CURRENT"),
            self._attr("RESERVED_MEM_HIGH"),
            self._attr("USED_MEM_CURRENT"),
            self._attr("USED_MEM_HIGH"),
            self.cached_bytes,
        )

    @property
    def cached_bytes(self) -> int:
        """Bytes on the free lists: closed buffers' memory and freed addresses, kept for reuse (held too)."""
        return self._lists.cached_bytes

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
        :class:`~umem_numba.DeviceBuffer`.  Free with :meth:`free`.  Memory
        freed on the same stream (the same ``cuStreamGetId``), of the same
        size rounded up to 512 bytes, is handed out again without a driver
        call, as CuPy's pool does; then memory a device synchronise has
        settled (see the module notes); otherwise ``cuMemAllocFromPoolAsync``.

        Raises
        ------
        OutOfMemoryError
            The pool cannot grow by that much (the pool stays usable).
        """
        if type(nbytes) is not int:
            nbytes = _check_bytes(nbytes, "nbytes", positive=True)
        elif nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        # The last live numba stream (see _resolve), inline: this is the whole cost of a reuse.
        ref, handle, key, lists = self._last
        owner = ref()
        thread = 0  # the thread matters only for the handles 1 and 2, a stream per context or thread
        if owner is None or (owner is not stream and (type(stream) is not int or stream != handle)):
            if type(stream) is int and 2 < stream < _MAX_HANDLE:  # a raw handle: as _resolve, with no call
                handle, key, lists = stream, None, None
            else:
                handle, key, lists = self._resolve(stream)
                if 0 < handle < 3:
                    thread = threading.get_ident()
        if self._closed:
            self._live()
        size = (nbytes + _ROUND_UP) & _ROUND_MASK
        ptr = 0
        raw = self._lists.raw
        if lists is None and raw:
            if key is None:
                key = self._stream_key(handle)
            lists = raw.get(key)
        if lists:
            free_list = lists.get(size)
            if free_list:
                try:
                    ptr = free_list.pop()
                except IndexError:  # another thread took the last one
                    pass
        if not ptr:
            ptr = self._take_settled(size, handle) or self._allocate_or_empty_lists(size, handle)
        self._raw_sizes[ptr] = (size, handle, key, thread)
        return ptr

    def _resolve(
        self, stream: StreamLike, what: str = "", refuse_capture: str | None = None
    ) -> tuple[int, int | None, dict[int, list[int]] | None]:
        """``(handle, key, raw free lists)`` of a stream-like value (None: only the driver can tell the key).

        The key (``cuStreamGetId``) is known without a driver call for handle
        0 once looked up (the legacy stream of the pool's device, see
        :meth:`_stream_key`) and for a live numba stream (its id is kept by
        :func:`_driver.stream_key`).  Both are remembered in ``_last``: for a
        live numba stream, a weak reference to the stream object, its handle,
        its id and its raw free lists (for handle 0, an owner that is always
        alive).  The hot paths (:meth:`allocate`, :meth:`free`,
        :meth:`allocation`) check it inline and take the handle, id and lists
        from it with no parsing and no lookup.  That is sound because the
        reference is alive: a stream numba created is destroyed only once its
        object is collected, so while the object lives its handle names that
        one stream in every thread, and neither the object nor its int handle
        (matched only while the object lives) can mean another stream; once it
        is collected, the handle is looked up again.  The handles 1 and 2 (a
        stream per context or thread), raw handles and foreign streams are
        never remembered: their key is asked of the driver when it is needed
        (:meth:`_stream_key`; a live numba stream's raw handle gets its kept id).

        ``refuse_capture`` (words for the message): refuse a capturing stream
        as soon as the handle is known, before any other driver call
        (``cuStreamGetId`` is refused inside a capture, and invalidates it).
        """
        raw = type(stream) is int and 0 <= stream < _MAX_HANDLE
        handle = stream if raw else stream_handle(stream, what=what)
        if refuse_capture is not None:
            self._refuse_capture(handle, refuse_capture)
        if handle > 2 and raw:
            return handle, None, None  # a raw handle: its key is looked up when needed (_stream_key keeps a live one's)
        if handle == 0:  # the legacy stream of the pool's device, the same in every thread
            key = self._legacy_key
            if key is None:  # looked up when a free list needs it (see _stream_key)
                return 0, None, None
            lists = self._lists.raw_for(key)
            self._last = (_always, 0, key, lists)
            return 0, key, lists
        if handle < 3:
            return handle, None, None
        owned = _driver.owned_stream(handle)
        if owned is None:
            return handle, None, None
        key = owned[1]
        key = self._stream_key(handle) if key is None else int(key)
        lists = self._lists.raw_for(key)
        self._last = (owned[0], handle, key, lists)
        return handle, key, lists

    def _stream_key(self, handle: int) -> int:
        """The stream's ``cuStreamGetId``, as the operation on ``handle`` will see it.

        Handle 0 is the legacy stream of the pool's device (the context every
        stream-0 operation of the pool runs in): its key is looked up once.
        A live numba stream's key is kept by :func:`_driver.stream_key`.  Any
        other handle is asked of the driver each time, since the same handle
        can name another stream in another thread (2) or after a stream was
        destroyed: pass the stream object rather than its raw handle.
        """
        if handle == 0:
            key = self._legacy_key
            if key is None:
                with _driver.device_context(self.device_id):
                    key = self._legacy_key = _driver.stream_key(0)
            return key
        owned = _driver.owned_stream(handle) if handle > 2 else None  # 1 and 2 are never owned
        if owned is not None and owned[1] is not None:
            return int(owned[1])  # a live numba stream: its handle names it alone
        get = self._get_id
        if get is None:  # before CUDA 12: the handle is all there is
            return handle
        err, sid = get(handle)
        if err != 0:  # e.g. no context current in this thread
            with _driver.device_context(self.device_id):
                return _driver.stream_key(handle)
        if owned is not None:
            owned[1] = int(sid)
        return int(sid)

    def _take_settled(self, size: int, handle: int) -> int:
        """Held memory a synchronise settled, of ``size`` (0: none); see :meth:`FreeLists.take_settled`.

        The batch synchronise it may make is skipped while ``handle``, the
        allocation's stream, captures a graph.
        """
        return self._lists.take_settled(size, lambda: _driver.is_capturing(handle))

    def _driver_allocate(self, nbytes: int, handle: int) -> int:
        """``cuMemAllocFromPoolAsync`` (out of memory: a clear :class:`OutOfMemoryError`)."""
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
        ptr = int(ptr) if err == 0 else self._retry(err, nbytes, handle)
        self._driver_pool.allocated()
        return ptr

    def _allocate_or_empty_lists(self, size: int, handle: int) -> int:
        """Driver memory; out of memory empties the free lists, trims the pool and tries once more."""
        try:
            return self._driver_allocate(size, handle)
        except OutOfMemoryError:
            if not self.cached_bytes:
                raise
            with _driver.device_context(self.device_id):
                self.release_cached()
                # The frees are stream-ordered on the legacy stream: let them run, then give what
                # the pool holds unused back to the driver, so that another size can use it.
                _driver.call("cuStreamSynchronize", 0, detail="letting freed pool memory return")
                if self._owned:  # never trim a pool other libraries share behind their backs
                    _driver.call("cuMemPoolTrimTo", self._handle, 0, detail="trimming a memory pool out of memory")
            return self._driver_allocate(size, handle)

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

    def free(self, ptr: int, stream: StreamLike = None, *, unordered: bool = False) -> None:
        """Return memory from :meth:`allocate` to the pool, ordered on ``stream``.

        It goes on the free list of its size and stream (within the release
        threshold), else back to the driver (``cuMemFreeAsync``).

        Parameters
        ----------
        ptr : int
            An address :meth:`allocate` returned.
        stream : stream-like, optional
            Every use of the memory is ordered before later work on this stream.
        unordered : bool
            The memory may still be used by work on *any* stream of the device
            (numba's memory-manager plugin frees so): it is held until a device
            synchronise, then reused on any stream (see the module notes);
            ``stream`` is ignored.

        Raises
        ------
        ValueError
            ``ptr`` is not memory of this pool's :meth:`allocate` that is in use.
        """
        if unordered:
            entry = self._raw_sizes.pop(ptr, None)
            if entry is None:
                raise ValueError(
                    f"free: {ptr:#x} is not memory of this pool's allocate() in use (freed twice, or another pool's)"
                )
            self._lists.hold(ptr, entry[0], {self.device_id}, True)  # a closed pool's: settled and freed now
            return
        ref, handle, key, lists = self._last  # the last live numba stream (see _resolve), inline as in allocate()
        owner = ref()
        if owner is None or (owner is not stream and (type(stream) is not int or stream != handle)):
            entry = self._raw_sizes.get(ptr)
            if entry is not None and type(stream) is int and stream == entry[1] and stream > 2:
                # The raw handle it was allocated on (checked then): the allocation's key serves
                # (see below), with no lookup.
                handle, key, lists = stream, entry[2], None
            else:
                handle, key, lists = self._resolve(stream)  # a bad stream raises before the address is taken
        entry = self._raw_sizes.pop(ptr, None)
        if entry is None:
            raise ValueError(
                f"free: {ptr:#x} is not memory of this pool's allocate() in use (freed twice, or another pool's)"
            )
        if self._closed:  # closed: nothing is kept (the last free lets the driver pool go)
            self._driver_free(ptr, handle)
            return
        size = entry[0]
        if self._lists.has_room(size):
            if lists is None:
                if key is None:
                    # The allocation's key serves when the handle is the same (and the thread, for
                    # the handles 1 and 2).  If the stream was destroyed and its handle reused
                    # meanwhile, the entry is filed under the dead stream's id, which no allocation
                    # can present again: it only waits for release_cached(), never reaches an
                    # unordered stream.
                    key = entry[2]
                    if key is None or handle != entry[1] or (0 < handle < 3 and threading.get_ident() != entry[3]):
                        key = self._stream_key(handle)
                lists = self._lists.raw_for(key)
            self._lists.keep_raw(lists, size, ptr)
            return
        self._driver_free(ptr, handle)

    def _driver_free(self, ptr: int, handle: int) -> None:
        err = self._free_fn(ptr, handle)[0]
        if err != 0:
            if _name(err) == "CUDA_ERROR_INVALID_CONTEXT":
                with _driver.device_context(self.device_id):
                    err = self._free_fn(ptr, handle)[0]
            if err != 0:
                _driver.raise_for(err, "cuMemFreeAsync", f"freeing {ptr:#x} into a memory pool")
        self._driver_pool.freed()

    def trim(self, keep_bytes: int = 0) -> None:
        """Give free memory back to the driver until at most ``keep_bytes`` stay reserved.

        The free lists are emptied first (and the legacy stream synchronised,
        so that their frees have run).  Memory whose stream-ordered free on
        another stream has not run yet cannot be released: synchronise those
        streams first for a full trim.  On a shared pool (:meth:`default`) the
        trim is the caller's explicit choice for every library using the
        pool: it releases only memory no allocation uses (other libraries'
        free memory too), never memory in use; umem_numba itself never trims
        a shared pool.
        """
        keep = _check_bytes(keep_bytes, "keep_bytes")
        self._live()
        if self.cached_bytes:
            with _driver.device_context(self.device_id):
                self.release_cached()
                # Their frees are queued on the legacy stream: a trim can only release them once they ran.
                _driver.call("cuStreamSynchronize", 0, detail="letting freed pool memory return before a trim")
        _driver.call("cuMemPoolTrimTo", self._handle, keep, detail="trimming a memory pool")

    def allocation(self, nbytes: int, stream: StreamLike, kind: str, what: str = "") -> Allocation:
        """The allocation record a buffer views: ``nbytes`` on ``stream``, freed back stream-ordered.

        ``nbytes`` may be 0 (nothing is allocated); ``kind`` is the
        statistics bucket (``"managed"`` or ``"device"``); ``what`` names the
        caller in the message about a bad ``stream``.  Memory comes from the
        free list of its size when one is there (no driver call), else from
        the driver's pool.
        """
        # Before anything reaches the stream (cuStreamGetId, a reuse's cuStreamWaitEvent, the
        # allocation itself), whatever the size: a refused allocation leaves the capture intact.
        refusal = what or f"allocating from a {kind} pool"
        ref, handle, key, _ = self._last  # the last live numba stream (see _resolve), inline as in allocate()
        owner = ref()
        if owner is None or (owner is not stream and (type(stream) is not int or stream != handle)):
            handle, key, _ = self._resolve(stream, what, refusal)
            checked = True
        else:
            # The legacy stream (handle 0) never captures itself: a capture elsewhere only makes
            # driver work on it illegal.  A free-list block that needs no ordering makes no driver
            # call, so there the check (one driver call, a third of this path) waits for the first.
            checked = handle != 0
            if checked:
                self._refuse_capture(handle, refusal)
        if not nbytes:
            return Allocation(kind, None, 0, self.device_id, Tracker(self.device_id))
        size = (nbytes + _ROUND_UP) & _ROUND_MASK
        lists = self._lists
        if lists.buffers:
            memory = lists.take_buffer(size)
            if memory is not None:
                tracker = memory.tracker
                assert tracker is not None  # every entry of a list carries its record
                if (tracker.writes or tracker.reads) and (
                    key is None or memory.ordered_on != key or tracker.recorded_since(memory.ordered_mark)
                ):
                    if not checked:
                        try:
                            self._refuse_capture(handle, refusal)
                        except BaseException:
                            lists.put_back(memory)  # untouched: the next allocation may take it
                            raise
                    if key is None:
                        key = self._stream_key(handle)
                    if memory.ordered_on != key or tracker.recorded_since(memory.ordered_mark):
                        self._order_reuse(tracker, handle, key)
                        # The stream now comes after every carried event: the next reuse on it
                        # need not look again, unless an event is filed meanwhile (checked here,
                        # so that one filed by a launch racing the close is caught too).
                        memory.ordered_on = key
                        memory.ordered_mark = tracker.mark()
                memory.tracker = None
                memory.nbytes = nbytes
                return Allocation(kind, memory, memory.ptr, self.device_id, tracker)
        if not checked:
            self._refuse_capture(handle, refusal)
        if lists.idle or lists.held:
            ptr = self._take_settled(size, handle)
            if ptr:  # nothing can still use it: no event, no wait
                return Allocation(
                    kind, _PoolMemory(self, kind, ptr, nbytes, size), ptr, self.device_id, Tracker(self.device_id)
                )
        with _driver.device_context(self.device_id if handle == 0 else None) as dev:
            ptr = self._allocate_or_empty_lists(size, handle)
            tracker = Tracker(self.device_id)
            with Transaction() as tx:
                tx.append(self._driver_free, ptr, handle)
                memory = _PoolMemory(self, kind, ptr, nbytes, size)
                alloc = Allocation(kind, memory, ptr, self.device_id, tracker)
                tx.commit()
            # Usable once the stream reaches the allocation: host access and
            # copies on other streams wait for this event.
            tracker.add(handle, _events.record(handle, dev))  # the allocation is the first write
        return alloc

    def _refuse_capture(self, handle: int, what: str) -> None:
        """:func:`refuse_capture` for an allocation stream (handle 0: the legacy stream of the pool's device).

        The special handles 0, 1 and 2 name a stream of the *current* context: in a thread
        that has none yet (a worker thread's first CUDA call), the driver answers
        ``CUDA_ERROR_INVALID_CONTEXT``, so the check is made again with the pool's context current.
        """
        try:
            refuse_capture(handle, what)
        except CudaError:
            if handle > 2:
                raise
            with _driver.device_context(self.device_id):  # no context current in this thread
                refuse_capture(handle, what)

    def _order_reuse(self, tracker: Tracker, stream: int, key: int) -> None:
        """A free-list entry taken on ``stream``: the stream waits for the old buffer's work on other streams.

        A plain numba launch on ``stream`` cannot be ordered by umem_numba, so
        the stream itself is ordered, as the driver's stream-ordered allocation
        would order it.  The events stay in ``tracker``: the new buffer's host
        access and tracked work on other streams wait for them.  ``key`` is the
        stream's ``cuStreamGetId``: events are compared by it, not by handle.
        """
        dev = self.device_id
        events = (*tracker.writes.values(), *tracker.reads.values())
        others = [e for e in events if e.key != key or e.device_id != dev]
        if others:
            with _driver.device_context(dev if stream == 0 else None):
                for event in others:
                    _driver.call("cuStreamWaitEvent", stream, event.handle, 0, detail="ordering a reused pool block")

    def _keep(self, memory: _PoolMemory, tracker: Tracker) -> bool:
        """Put a closed buffer's memory on its free list (False: it must go back to the driver).

        Memory that took advice goes back, so that no later buffer inherits the advice.
        """
        return not memory.advised and self._lists.keep_buffer(memory, tracker)

    def release_cached(self) -> None:
        """Give the memory on the buffers' free lists back to the driver's pool (stream-ordered).

        Each block's free is queued on the legacy default stream after the
        last device work of the buffer that held it; memory of work umem_numba
        could not see is freed after a device synchronise.  :meth:`trim` and
        :meth:`close` call this first.
        """
        self._lists.release()

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the pool (``cuMemPoolDestroy``), after giving the free lists back.

        Allocations still alive stay valid, and the driver pool is destroyed
        only once the last of them is freed: destroying a pool, then freeing an
        allocation of it, crashed the driver in our tests (SIGSEGV at the next
        synchronise; H100, driver 580), and so did destroying one while its
        frees were still queued (an H200, driver 580), so the device is
        synchronised before the destroy.  Closing
        twice does nothing.  A shared pool (:meth:`default`) is not destroyed:
        umem_numba only stops using it (the next :meth:`default` call makes a
        new wrapper).
        """
        if self._closed:
            return
        self._closed = True
        self._lists.closed = True  # no freed memory joins a free list from here on
        self.release_cached()
        self._finalizer.detach()  # a later collection must not destroy a reused handle
        _live.discard(self)
        # Destroyed now if nothing of the pool is allocated, else at the free of the last allocation.
        self._driver_pool.let_go()

    def __enter__(self) -> MemoryPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"handle={self.handle:#x}"
        where = f", location={self._where}" if self._where != Location.device(self.device_id) else ""
        shared = ", shared" if not self._owned else ""
        return f"MemoryPool({self.kind!r}, device={self.device_id}{where}{shared}, {state})"


def _name(err: Any) -> str:
    return _driver._result_name(_driver.api().drv, err)


def _release_all(lists: FreeLists) -> None:
    """A collected wrapper of a shared pool: its memory back to the driver's pool, which stays."""
    try:
        lists.release()
    except Exception:  # the context is gone: the driver released everything with it
        pass


def _let_go(lists: FreeLists, driver_pool: DriverPool) -> None:
    """A collected pool: its free lists back to the driver; the driver pool goes with its last allocation.

    Addresses of :meth:`MemoryPool.allocate` nobody can free any more (the pool is gone) keep the
    driver pool for good: it is released with the context.
    """
    try:
        lists.release()
    except Exception:  # the context is gone: the driver released everything with it
        pass
    driver_pool.let_go()


class DriverPool:
    """A driver pool and its outstanding allocations; an owned one is destroyed at the free of its last.

    Every ``cuMemAllocFromPoolAsync`` of the pool counts one allocation and
    every ``cuMemFreeAsync`` of it one free, whoever makes it (a buffer's
    release, the free lists, the raw interface).  Once the :class:`MemoryPool`
    lets the pool go (closed, or collected) and nothing is outstanding, the
    driver pool is destroyed (``cuMemPoolDestroy``) after a synchronise of its
    device.  Destroying it with allocations outstanding, then freeing them,
    crashed the driver (SIGSEGV at the next synchronise; H100 and H200, driver
    580), so the count decides, not the lifetime of Python objects: a garbage
    cycle collection runs every weak reference callback before any
    ``__del__``, so a finalizer on this object ran before the releases of the
    buffers collected with it (the API fuzzer found it on an H200).  A shared
    pool (``owned`` False) is counted, never destroyed.
    """

    __slots__ = ("_destroyed", "_let_go", "_lock", "_outstanding", "device_id", "handle", "owned")

    def __init__(self, handle: Any, device_id: int, *, owned: bool) -> None:
        self.handle = handle
        self.device_id = device_id
        self.owned = owned
        self._lock = threading.Lock()
        self._outstanding = 0
        self._let_go = False
        self._destroyed = False

    @property
    def outstanding(self) -> int:
        """Allocations of the pool not freed to the driver yet."""
        return self._outstanding

    @property
    def destroyed(self) -> bool:
        """Whether ``cuMemPoolDestroy`` was issued."""
        return self._destroyed

    def allocated(self) -> None:
        """One ``cuMemAllocFromPoolAsync`` succeeded."""
        with self._lock:
            self._outstanding += 1

    def freed(self) -> None:
        """One ``cuMemFreeAsync`` was issued (after it, so that the destroy's synchronise covers it)."""
        with self._lock:
            self._outstanding -= 1
            last = self._let_go and self._outstanding == 0 and not self._destroyed
            if last:
                self._destroyed = True
        if last:
            self._destroy()

    def let_go(self) -> None:
        """The pool is closed or collected: destroy it now if nothing is outstanding, else at the last free."""
        with self._lock:
            if self._let_go or not self.owned:
                return
            self._let_go = True
            now = self._outstanding == 0 and not self._destroyed
            if now:
                self._destroyed = True
        if now:
            self._destroy()

    def _destroy(self) -> None:
        """``cuMemPoolDestroy`` once nothing is queued on the device (its frees included); never raises."""
        if _driver.shutting_down():  # the driver releases every pool with the context
            return
        try:
            synchronize_for_reuse({self.device_id}, "settling a memory pool's queued work before destroying it")
            with _driver.device_context(self.device_id):
                _driver.call("cuMemPoolDestroy", self.handle, detail="destroying a memory pool")
        except Exception as exc:  # quiet when the context is gone: the driver released everything with it
            report_failed_free(f"destroying a memory pool of device {self.device_id}", exc)


class _PoolMemory(Memory):
    """Pool memory of one buffer: its release is a free queued after its pending work, never on the host.

    ``size`` is what the driver allocated (``nbytes`` rounded up to
    :data:`ROUND`), the free list it returns to.  ``tracker`` is set while it
    waits on a free list; ``advised`` once advice was given on it (such
    memory goes back to the driver, so no later buffer inherits the advice).
    The pool is referred to weakly: the free lists hold these objects, and a
    pool that is collected must be able to go (its finalizer frees them).
    """

    __slots__ = (
        "advised",
        "device_id",
        "kind",
        "nbytes",
        "ordered_mark",
        "ordered_on",
        "owner",
        "pool_ref",
        "ptr",
        "size",
        "tracker",
    )
    stream_ordered = True

    def __init__(self, pool: MemoryPool, kind: str, ptr: int, nbytes: int, size: int) -> None:
        self.pool_ref = weakref.ref(pool)
        #: Counts this memory's free (see :class:`DriverPool`).
        self.owner = pool._driver_pool
        self.device_id = pool.device_id
        self.kind = kind
        self.ptr = ptr
        self.nbytes = nbytes
        self.size = size
        self.advised = False
        self.tracker: Tracker | None = None
        #: The stream (``cuStreamGetId``) already ordered after every event of ``tracker``, None
        #: if none; valid while the tracker's record count is still ``ordered_mark``.
        self.ordered_on: int | None = None
        self.ordered_mark = -1

    def describe(self) -> str:
        return f"{self.kind} pool memory at {self.ptr:#x} ({self.nbytes} bytes)"

    def note_advice(self) -> None:
        self.advised = True

    def free(self, tracker: Tracker) -> None:
        pool = self.pool_ref()
        if pool is not None and pool._keep(self, tracker):
            return
        if pool is not None and not pool._closed and (tracker.unknown_devices or tracker.escaped):
            # Work umem_numba could not see may use it on any stream: held until a synchronise.
            events, unknown, _gen, escaped = tracker.pending_work()
            pool._lists.hold(self.ptr, self.size, self._unseen_devices(events, unknown, escaped), not self.advised)
            return
        self.free_to_driver(tracker)

    def _unseen_devices(self, events: list[Any], unknown: set[int], escaped: bool) -> set[int]:
        """The devices whose synchronise settles every use of the memory (escaped: every active device)."""
        devices = {self.device_id, *unknown, *(e.device_id for e in events)}
        if escaped:
            devices.update(_driver.active_devices())
        return devices

    def free_to_driver(self, tracker: Tracker) -> None:
        """``cuMemFreeAsync`` after every piece of work recorded in ``tracker``.

        Queued on the legacy default stream of the pool's device, after it
        waits for every recorded event of another stream (by
        ``cuStreamGetId``): a garbage collection may run this in any thread,
        where the handle of the buffer's last stream may name another stream
        (2, the per-thread stream) or none (a destroyed stream).  Work
        umem_numba could not see cannot be ordered on any stream: the devices
        are synchronised first.
        """
        events, unknown, _gen, escaped = tracker.pending_work()
        with _driver.device_context(self.device_id):
            if unknown or escaped:
                synchronize_for_reuse(
                    self._unseen_devices(events, unknown, escaped),
                    f"waiting for work umem_numba could not see before freeing {self.describe()}",
                )
                events = []  # all done
            legacy = _driver.stream_key(0) if events else 0
            for event in events:
                if event.key != legacy or event.device_id != self.device_id:
                    _driver.call(
                        "cuStreamWaitEvent",
                        0,
                        event.handle,
                        0,
                        detail="ordering a pool free after the buffer's work",
                    )
            _driver.call("cuMemFreeAsync", self.ptr, 0, detail=f"freeing {self.describe()} into its pool")
        self.owner.freed()


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


def existing_default_pool(kind: str, device_id: int) -> MemoryPool | None:
    """The process-wide pool of ``kind`` on a device if it exists and is open (no driver call), else None."""
    pool = _defaults.get((kind, device_id))
    return None if pool is None or pool._closed else pool


def check_pool(pool: Any, kind: str, what: str) -> MemoryPool:
    """Validate a ``pool=`` argument of a buffer constructor."""
    if type(pool) is MemoryPool and pool.kind == kind and not pool._closed:
        return pool
    if not isinstance(pool, MemoryPool):
        raise TypeError(f"{what}: pool must be a umem_numba.MemoryPool, got {type(pool).__name__}")
    if pool.kind != kind:
        raise ValueError(
            f"{what}: this is a {pool.kind!r} pool; it makes {pool.resource.buffer}s, "
            f"not {_resources.RESOURCES[kind].buffer}s"
        )
    pool._live()
    return pool


def totals() -> PoolStats:
    """Counters summed over every live pool (read from the driver)."""
    out = [0, 0, 0, 0, 0, 0]
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
        out[5] += s.cached
    return PoolStats(*out)


_stats.add_source("pool", totals)
