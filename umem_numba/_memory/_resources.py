"""Memory kinds as resources: where each kind of memory is reachable, and how a pool makes it.

As in cuda.core, where a ``Buffer`` asks its ``MemoryResource`` whether its
memory is device- or host-accessible, a umem_numba allocation asks its
:class:`MemoryResource` (``alloc.resource``) and a pool asks its own
(``pool.resource``): no buffer, copy or pool code branches on a kind's name.
The name (``"managed"``, ``"device"``, ``"pinned"``, ``"vmm"``) stays what
users and the statistics see.

The kinds
---------
``"managed"`` (:data:`MANAGED`)
    Unified memory (``cuMemAllocManaged``, or a managed pool:
    ``CU_MEM_ALLOCATION_TYPE_MANAGED``, cuda-bindings 13 and a CUDA 13
    driver).  Host- and device-accessible; it migrates, so it takes advice,
    prefetches and discards.
``"device"`` (:data:`DEVICE`)
    Device memory (``CU_MEM_ALLOCATION_TYPE_PINNED`` at a device location),
    the memory of :class:`~umem_numba.DeviceBuffer`.  The driver can share its
    pools with other processes.
``"pinned"`` (:data:`PINNED`)
    Page-locked host memory (``cuMemHostAlloc``, or a pool at
    ``CU_MEM_LOCATION_TYPE_HOST``, a CUDA 13 driver, or at one host NUMA node,
    ``CU_MEM_LOCATION_TYPE_HOST_NUMA``, a CUDA 12.6 driver), the memory of
    :class:`~umem_numba.PinnedBuffer`: a device reaches it only where mapped,
    and the driver maps a pinned pool for no device until
    ``cuMemPoolSetAccess`` grants one (its own device is granted when the pool
    is made).  Copies fill it from the host: it is what staging is made of.
``"vmm"`` (:data:`VMM`)
    Device memory mapped by hand (``cuMemCreate`` / ``cuMemMap``); no pools.

Shared pools
------------
:meth:`MemoryPool.default <umem_numba.MemoryPool.default>` wraps a pool the
driver owns, through :meth:`MemoryResource.shared_pool`: a device's current
pool (``cuDeviceGetMemPool``, which ``cudaMallocAsync``, CuPy's
``MemoryAsyncPool`` and cuda.core's ``DeviceMemoryResource`` use) or a
device's default managed pool (``cuMemGetDefaultMemPool``, which RMM's
``CudaAsyncManagedMemoryResource`` uses).

Access
------
``"rw"``, ``"r"`` and ``None`` name the driver's ``CU_MEM_ACCESS_FLAGS_PROT_*``
values for :meth:`MemoryPool.set_access <umem_numba.MemoryPool.set_access>`.
"""

from __future__ import annotations

import os
from typing import Any

from .. import _driver
from .._driver._location import HOST, Location
from .._errors import UnsupportedError

__all__ = [
    "ACCESS_MODES",
    "DEVICE",
    "MANAGED",
    "PINNED",
    "POOL_KINDS",
    "RESOURCES",
    "SHARED_KINDS",
    "VMM",
    "MemoryResource",
    "access_desc",
    "check_kind",
    "check_mode",
    "mode_of_flags",
]

#: The kinds of :class:`~umem_numba.MemoryPool`.
POOL_KINDS = ("managed", "device", "pinned")
#: The kinds :meth:`MemoryPool.default <umem_numba.MemoryPool.default>` can wrap.
SHARED_KINDS = ("device", "managed")
#: Access modes of :meth:`MemoryPool.set_access <umem_numba.MemoryPool.set_access>`: mode -> driver value.
ACCESS_MODES: dict[str | None, int] = {"rw": 3, "r": 1, None: 0}
#: The first driver versions with pinned pools at the host as a whole, and at one host NUMA node.
HOST_POOL_DRIVER = 13000
HOST_NUMA_POOL_DRIVER = 12060


class MemoryResource:
    """One kind of memory: where it is reachable, what it supports, and how a pool makes it.

    The class attributes answer for every allocation of the kind; the pool
    methods are asked when a :class:`~umem_numba.MemoryPool` is made.
    """

    #: The kind's name: what ``buf``'s allocation, ``pool.kind`` and the statistics call it.
    name = ""
    #: The buffer class that holds this memory (for messages).
    buffer = ""
    #: Whether the host may dereference it.
    is_host_accessible = True
    #: Whether a device may hold the data, so that copies need DMA (``cuMemcpyAsync``).
    device_may_hold = True
    #: Whether it migrates between host and devices: advice, prefetch and discard apply.
    migrates = False
    #: Whether the host fills it for the copy engine: a copy's destination or staging area.
    stages_copies = False
    #: Whether it counts as the device's memory (what numba's memory info reports as free).
    occupies_device = True
    #: Whether devices' access to a pool of it can be granted and revoked (``cuMemPoolSetAccess``).
    pool_access_changes = True
    #: Whether the driver shares pools of it with other processes (POSIX file descriptors).
    pool_exportable = False

    def __repr__(self) -> str:
        return f"<memory resource {self.name!r}>"

    # -- pools -----------------------------------------------------------------------
    def check_numa(self, numa: Any) -> int | None:
        """The host NUMA node a pool's memory is placed on (``None``: none); checked before any driver call."""
        if numa is None:
            return None
        raise ValueError(
            f"MemoryPool: numa= places a pinned (host) pool on a host NUMA node; a {self.name} pool has none"
        )

    def check_preferred(self, target: Any) -> Location | None:
        """A pool's preferred location for its allocations (``None``: none given); checked before any driver call."""
        if target is None:
            return None
        raise ValueError(
            f"MemoryPool: preferred_location= says where a managed pool's pages prefer to live; "
            f"a {self.name} pool's memory stays where it is made (got {target!r})"
        )

    def pool_location(self, device_id: int, numa: int | None) -> Location:
        """Where a pool's memory lives (its device, unless the kind lives on the host)."""
        return Location.device(device_id)

    def pool_support(self, device_id: int, numa: int | None) -> str:
        """'' if a pool of this kind can be made on ``device_id`` here, else why not (asks the driver)."""
        if not _driver.device_attribute("MEMORY_POOLS_SUPPORTED", device_id):
            return f"device {device_id} does not support memory pools"
        return ""

    def pool_alloc_type(self, consts: Any) -> Any:
        """The ``CUmemAllocationType`` of a pool of this kind."""
        return consts.vmm_pinned

    def pool_limit(self, device_id: int) -> int:
        """The most one pool allocation can ask for (larger requests are refused before the driver)."""
        return int(_driver.call("cuDeviceTotalMem", device_id))

    def pool_refused(self, exc: Exception, where: Location) -> Exception | None:
        """What to raise instead of the driver's refusal of ``cuMemPoolCreate`` (None: its own error)."""
        return None

    def shared_pool(self, device_id: int) -> Any:
        """The driver's pool of this kind that other libraries use too (:meth:`MemoryPool.default`)."""
        raise UnsupportedError(f"the driver has no shared {self.name} memory pool")


class _Device(MemoryResource):
    name = "device"
    buffer = "DeviceBuffer"
    is_host_accessible = False
    pool_exportable = True

    def shared_pool(self, device_id: int) -> Any:
        """The device's *current* pool (``cuDeviceGetMemPool``: its default pool unless someone set another)."""
        if not _driver.device_attribute("MEMORY_POOLS_SUPPORTED", device_id):
            raise UnsupportedError(f"device {device_id} does not support memory pools")
        return _driver.call_on(
            device_id, "cuDeviceGetMemPool", device_id, detail=f"finding the current memory pool of device {device_id}"
        )


class _Managed(MemoryResource):
    name = "managed"
    buffer = "ManagedBuffer"
    migrates = True
    occupies_device = False  # it may live on the host
    pool_access_changes = False  # the driver maps managed memory for every device itself

    def check_preferred(self, target: Any) -> Location | None:
        """A device, the host or a host NUMA node, parsed by the one location parser (a missing one: ValueError)."""
        if target is None:
            return None
        from .._driver._location import as_location

        return as_location(target, what="MemoryPool preferred_location")

    def pool_support(self, device_id: int, numa: int | None) -> str:
        """Managed pools need cuda-bindings 13, a CUDA 13 driver and concurrentManagedAccess on every device."""
        missing = managed_pool_support()
        return f"managed memory pools need {missing}" if missing else ""

    def pool_alloc_type(self, consts: Any) -> Any:
        return consts.pool_managed

    def pool_limit(self, device_id: int) -> int:
        return super().pool_limit(device_id) + _host_ram()  # managed memory can spill to the host

    def shared_pool(self, device_id: int) -> Any:
        """The default managed pool of the device's location (``cuMemGetDefaultMemPool``, CUDA 13)."""
        api = _driver.api()
        get = getattr(api.drv, "cuMemGetDefaultMemPool", None)
        missing = []
        if get is None or api.c.pool_managed is None:
            missing.append(f"cuda-bindings 13 or newer (installed: {api.version})")
        if api.driver_version < 13000:
            missing.append(f"a CUDA 13 driver (this one supports CUDA {_version_text(api.driver_version)})")
        if not _driver.concurrent_managed_access(device_id):
            missing.append(f"concurrentManagedAccess on device {device_id}")
        if missing:
            raise UnsupportedError(
                f"the default managed memory pool (cuMemGetDefaultMemPool) needs {'; '.join(missing)}"
            )
        return _driver.call_on(
            device_id,
            "cuMemGetDefaultMemPool",
            Location.device(device_id).to_cu(),
            api.c.pool_managed,
            detail=f"finding the default managed memory pool of device {device_id}",
        )


class _Pinned(MemoryResource):
    name = "pinned"
    buffer = "PinnedBuffer"
    device_may_hold = False
    stages_copies = True
    occupies_device = False

    def check_numa(self, numa: Any) -> int | None:
        if numa is None:
            return None
        from .._driver._location import as_location

        return as_location(Location.host(numa), what="MemoryPool").id  # a node the machine lacks: ValueError

    def pool_location(self, device_id: int, numa: int | None) -> Location:
        return HOST if numa is None else Location("host_numa", numa)

    def pool_support(self, device_id: int, numa: int | None) -> str:
        """A CUDA 13 driver (12.6 at a host NUMA node) and a device that reports host memory pools."""
        missing = pinned_pool_support(device_id, numa)
        return f"pinned (host) memory pools need {missing}" if missing else ""

    def pool_limit(self, device_id: int) -> int:
        return _host_ram() or (1 << 64) - 1

    def pool_refused(self, exc: Exception, where: Location) -> Exception | None:
        """The device reported host pools and the driver refused this one all the same: unsupported."""
        if getattr(exc, "name", "") in ("CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_INVALID_VALUE"):
            return UnsupportedError(f"pinned (host) memory pools at {where}: the driver refused one ({exc})")
        return None


class _VMM(MemoryResource):
    name = "vmm"
    buffer = "VMMBuffer"
    is_host_accessible = False

    def pool_support(self, device_id: int, numa: int | None) -> str:
        return "VMM memory is reserved and mapped by hand (VMMBuffer), not pooled"


MANAGED = _Managed()
DEVICE = _Device()
PINNED = _Pinned()
VMM = _VMM()
#: Every resource by its kind's name.
RESOURCES: dict[str, MemoryResource] = {r.name: r for r in (MANAGED, DEVICE, PINNED, VMM)}


def check_kind(kind: Any, kinds: tuple[str, ...] = POOL_KINDS, what: str = "MemoryPool kind") -> MemoryResource:
    """The resource of ``kind`` if it is one of ``kinds``, else a ``ValueError`` naming them (no driver call).

    ``what`` is the subject of the message: ``"{what} must be 'a' or 'b', got ..."``.
    """
    if not isinstance(kind, str) or kind not in kinds:
        names = ", ".join(repr(k) for k in kinds[:-1]) + f" or {kinds[-1]!r}"
        raise ValueError(f"{what} must be {names}, got {kind!r}")
    return RESOURCES[kind]


def _version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _host_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0


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
        missing.append(f"a CUDA 13 driver (this one supports CUDA {_version_text(version)})")
    lacking = [i for i in range(_driver.device_count()) if not _driver.device_attribute("CONCURRENT_MANAGED_ACCESS", i)]
    if lacking:
        missing.append(f"concurrentManagedAccess on every device (device(s) {', '.join(map(str, lacking))} lack it)")
    return "; ".join(missing)


def pinned_pool_support(device_id: int, numa: int | None) -> str:
    """'' if a pinned pool (at the host, or at host NUMA node ``numa``) can be made here, else what is missing."""
    api = _driver.api()
    version = api.driver_version
    need = HOST_POOL_DRIVER if numa is None else HOST_NUMA_POOL_DRIVER
    where = "the host" if numa is None else f"host NUMA node {numa}"
    if version < need:
        return (
            f"a CUDA {_version_text(need)} driver for pinned pools at {where} "
            f"(this one supports CUDA {_version_text(version)})"
        )
    attr = "HOST_MEMORY_POOLS_SUPPORTED" if numa is None else "HOST_NUMA_MEMORY_POOLS_SUPPORTED"
    if not hasattr(api.drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + attr):
        return f"cuda-bindings that know CU_DEVICE_ATTRIBUTE_{attr} (installed: {api.version})"
    try:
        supported = _driver.device_attribute(attr, device_id)
    except Exception as exc:  # an older driver that does not know the attribute
        return f"a driver that reports CU_DEVICE_ATTRIBUTE_{attr} ({exc})"
    if not supported:
        return f"device {device_id} to support pinned memory pools at {where} (CU_DEVICE_ATTRIBUTE_{attr} is 0)"
    return ""


def check_mode(mode: Any) -> str | None:
    """An access mode: ``"rw"``, ``"r"`` or ``None`` (no access); anything else is a clear error."""
    if mode is None or (isinstance(mode, str) and mode in ACCESS_MODES):
        return mode
    raise ValueError(f"MemoryPool.set_access: mode must be 'rw' (read-write), 'r' (read-only) or None, got {mode!r}")


def mode_of_flags(flags: Any) -> str | None:
    """Decode ``CUmemAccess_flags`` read back from the driver."""
    value = int(flags)
    for mode, bits in ACCESS_MODES.items():
        if bits == value:
            return mode
    raise ValueError(f"the driver reported unknown pool access flags {value}")


def access_desc(device_id: int, mode: str | None) -> Any:
    """A ``CUmemAccessDesc`` granting ``mode`` to device ``device_id``."""
    api = _driver.api()
    desc = api.drv.CUmemAccessDesc()
    desc.location.type = api.c.location_device
    desc.location.id = device_id
    desc.flags = api.c.access(ACCESS_MODES[mode])
    return desc
