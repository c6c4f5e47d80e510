"""umem_numba: managed, pinned and VMM memory for Numba-CUDA kernels, with enforced coherence.

Importing never touches the GPU; the first call that needs one raises
:class:`CudaUnavailableError` if there is none.
"""

from __future__ import annotations

from ._errors import (
    BufferClosedError,
    CoherenceError,
    CudaError,
    CudaUnavailableError,
    OutOfMemoryError,
    UmemError,
    UnsupportedError,
)
from ._driver import available as gpu_available
from ._location import HOST, Location, as_location
from ._stats import KindStats, PoolStats, reset_peak, stats
from ._coherence import (
    CoherenceWarning,
    CoherentKernel,
    coherence_policy,
    coherent,
    get_coherence_policy,
    jit,
    launch,
    set_coherence_policy,
)
from ._managed import ManagedBuffer, managed_empty, managed_from, managed_like, managed_zeros
from ._pinned import HostAllocFlags, PinnedBuffer
from ._advice import HintState, ManagedMemoryHints, MemAdvice, MigrationPolicy
from ._prefetch import PrefetchPlan
from ._vmm import AccessFlags, AddressRange, Mapping, PhysicalMemory, allocation_granularity
from ._vmm_buffer import VMMBuffer
from ._copy import copy
from ._pool import MemoryPool
from ._device_buffer import DeviceBuffer
from ._info import info

__version__ = "0.1.0"


def __getattr__(name: str):
    # numba's NUMBA_CUDA_MEMORY_MANAGER=umem_numba reads _numba_memory_manager;
    # loaded lazily so that importing umem_numba does not import numba.cuda.
    if name in ("_numba_memory_manager", "UmemNumbaMemoryManager"):
        from ._emm import UmemNumbaMemoryManager
        return UmemNumbaMemoryManager
    raise AttributeError(f"module 'umem_numba' has no attribute {name!r}")

__all__ = [
    # vmm
    "VMMBuffer",
    "AccessFlags",
    "AddressRange",
    "PhysicalMemory",
    "Mapping",
    "allocation_granularity",
    # errors
    "UmemError",
    "CudaError",
    "OutOfMemoryError",
    "CudaUnavailableError",
    "UnsupportedError",
    "CoherenceError",
    "BufferClosedError",
    # machine
    "gpu_available",
    "info",
    "stats",
    "reset_peak",
    "KindStats",
    # locations
    "Location",
    "HOST",
    "as_location",
    # managed
    "ManagedBuffer",
    "managed_empty",
    "managed_zeros",
    "managed_like",
    "managed_from",
    # advice and prefetch
    "MemAdvice",
    "MigrationPolicy",
    "ManagedMemoryHints",
    "HintState",
    "PrefetchPlan",
    # copies
    "copy",
    # pools
    "MemoryPool",
    "UmemNumbaMemoryManager",
    "DeviceBuffer",
    "PoolStats",
    # pinned
    "PinnedBuffer",
    "HostAllocFlags",
    # coherence
    "launch",
    "coherent",
    "jit",
    "CoherentKernel",
    "coherence_policy",
    "set_coherence_policy",
    "get_coherence_policy",
    "CoherenceWarning",
]
