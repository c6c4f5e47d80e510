"""What a memory pool is made of: its kind, its location, and how the driver makes, lends or shares it.

This module describes pools; :mod:`umem_numba._memory._pool` runs them (free lists,
coherence, statistics).  Keeping the two apart keeps the allocation paths of
the pool free of the rules below, which only matter when a pool is made.

Kinds
-----
``"device"``
    Device memory (``CU_MEM_ALLOCATION_TYPE_PINNED`` at a device location),
    the memory of :class:`~umem_numba.DeviceBuffer`.
``"managed"``
    Unified memory (``CU_MEM_ALLOCATION_TYPE_MANAGED``; cuda-bindings 13 and a
    CUDA 13 driver).
``"pinned"``
    Page-locked host memory (``CU_MEM_ALLOCATION_TYPE_PINNED`` at
    ``CU_MEM_LOCATION_TYPE_HOST``, a CUDA 13 driver; or at one host NUMA node,
    ``CU_MEM_LOCATION_TYPE_HOST_NUMA``, a CUDA 12.6 driver), the memory of
    :class:`~umem_numba.PinnedBuffer`.  The driver maps such a pool for no
    device until ``cuMemPoolSetAccess`` grants one: the pool's device gets
    read-write access when the pool is made.

Shared pools
------------
:meth:`MemoryPool.default <umem_numba.MemoryPool.default>` wraps a pool the
driver owns (a device's current pool, ``cuDeviceGetMemPool``, which
``cudaMallocAsync``, CuPy's ``MemoryAsyncPool`` and cuda.core's
``DeviceMemoryResource`` use; or a device's default managed pool,
``cuMemGetDefaultMemPool``, which RMM's ``CudaAsyncManagedMemoryResource``
uses) without owning it.

Access
------
``"rw"``, ``"r"`` and ``None`` name the driver's ``CU_MEM_ACCESS_FLAGS_PROT_*``
values for :meth:`MemoryPool.set_access <umem_numba.MemoryPool.set_access>`.
"""

from __future__ import annotations

from typing import Any

from .. import _driver
from .._driver._location import HOST, Location
from .._errors import UnsupportedError

__all__ = [
    "ACCESS_MODES",
    "POOL_KINDS",
    "SHARED_KINDS",
    "access_desc",
    "check_kind",
    "check_mode",
    "check_numa",
    "mode_of_flags",
    "pinned_pool_support",
    "pool_location",
    "shared_pool_handle",
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


def check_kind(kind: Any, kinds: tuple[str, ...] = POOL_KINDS, what: str = "MemoryPool") -> str:
    """``kind`` if it is one of ``kinds``, else a ``ValueError`` naming them (no driver call)."""
    if not isinstance(kind, str) or kind not in kinds:
        names = ", ".join(repr(k) for k in kinds[:-1]) + f" or {kinds[-1]!r}"
        raise ValueError(f"{what} kind must be {names}, got {kind!r}")
    return kind


def check_numa(kind: str, numa: Any) -> int | None:
    """The host NUMA node of a pinned pool (``None``: the host as a whole); checked before any driver call."""
    if numa is None:
        return None
    if kind != "pinned":
        raise ValueError(f"MemoryPool: numa= places a pinned (host) pool on a host NUMA node; a {kind} pool has none")
    from .._driver._location import as_location

    return as_location(Location.host(numa), what="MemoryPool").id  # a node the machine lacks: ValueError


def pool_location(kind: str, device_id: int, numa: int | None) -> Location:
    """Where the pool's memory lives: the device, the host, or one host NUMA node."""
    if kind != "pinned":
        return Location.device(device_id)
    return HOST if numa is None else Location("host_numa", numa)


def _driver_version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def pinned_pool_support(device_id: int, numa: int | None) -> str:
    """'' if a pinned pool (at the host, or at host NUMA node ``numa``) can be made here, else what is missing."""
    api = _driver.api()
    version = api.driver_version
    need = HOST_POOL_DRIVER if numa is None else HOST_NUMA_POOL_DRIVER
    where = "the host" if numa is None else f"host NUMA node {numa}"
    if version < need:
        return (
            f"a CUDA {_driver_version_text(need)} driver for pinned pools at {where} "
            f"(this one supports CUDA {_driver_version_text(version)})"
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


def shared_pool_handle(kind: str, device_id: int) -> Any:
    """The driver's pool of ``kind`` for a device, which other libraries use too.

    ``"device"``: the device's *current* pool (``cuDeviceGetMemPool``: its
    default pool unless someone called ``cuDeviceSetMemPool``), the one
    ``cudaMallocAsync`` and CuPy's ``MemoryAsyncPool`` allocate from.
    ``"managed"``: the default managed pool of the device's location
    (``cuMemGetDefaultMemPool``, CUDA 13), the one RMM's
    ``CudaAsyncManagedMemoryResource`` allocates from.
    """
    api = _driver.api()
    if kind == "device":
        if not _driver.device_attribute("MEMORY_POOLS_SUPPORTED", device_id):
            raise UnsupportedError(f"device {device_id} does not support memory pools")
        return _driver.call_on(
            device_id, "cuDeviceGetMemPool", device_id, detail=f"finding the current memory pool of device {device_id}"
        )
    get = getattr(api.drv, "cuMemGetDefaultMemPool", None)
    missing = []
    if get is None or api.c.pool_managed is None:
        missing.append(f"cuda-bindings 13 or newer (installed: {api.version})")
    if api.driver_version < 13000:
        missing.append(f"a CUDA 13 driver (this one supports CUDA {_driver_version_text(api.driver_version)})")
    if not _driver.concurrent_managed_access(device_id):
        missing.append(f"concurrentManagedAccess on device {device_id}")
    if missing:
        raise UnsupportedError(f"the default managed memory pool (cuMemGetDefaultMemPool) needs {'; '.join(missing)}")
    return _driver.call_on(
        device_id,
        "cuMemGetDefaultMemPool",
        Location.device(device_id).to_cu(),
        api.c.pool_managed,
        detail=f"finding the default managed memory pool of device {device_id}",
    )


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
