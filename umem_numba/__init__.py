"""umem_numba: managed, pinned and VMM memory for Numba-CUDA kernels, with enforced coherence.

Importing never touches the GPU; the first call that needs one raises
:class:`CudaUnavailableError` if there is none.  Under numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1`` when umem_numba is imported) the same classes run
over a simulated driver whose memory is host memory and whose streams run
their work late, in a seeded adversarial order (see
:mod:`umem_numba._driver._simulated`).
"""

from __future__ import annotations

from ._arrays._copy import copy
from ._cli._info import info
from ._driver import _sim
from ._driver import available as gpu_available
from ._driver._devices import (
    can_access_peer,
    device_attribute,
    device_count,
    driver_call,
    ensure_context,
    gpu_unavailable_reason,
    mem_info,
)
from ._driver._location import HOST, Host, Location, as_location, stream_handle
from ._driver._streams import PriorityStream
from ._errors import (
    BufferClosedError,
    CoherenceError,
    CudaError,
    CudaUnavailableError,
    NotDeviceAccessibleError,
    OutOfMemoryError,
    UmemError,
    UnsupportedError,
)
from ._hints._advice import HintState, ManagedMemoryHints, MemAdvice, MigrationPolicy
from ._hints._prefetch import PrefetchPlan
from ._kinds._device import DeviceBuffer, device_empty, device_from, device_like, device_zeros
from ._kinds._managed import ManagedBuffer, managed_empty, managed_from, managed_like, managed_zeros
from ._kinds._pinned import HostAllocFlags, PinnedBuffer
from ._launch._coherent import CoherentForAll, CoherentKernel, coherent, jit, launch
from ._launch._graphs import Graph, capture
from ._memory._cache import get_allocation_cache, release_allocation_cache, set_allocation_cache
from ._memory._pool import MemoryPool
from ._memory._stats import KindStats, PoolStats, reset_peak, stats
from ._memory._tracker import (
    CoherenceWarning,
    coherence_policy,
    get_auto_prefetch,
    get_coherence_policy,
    set_auto_prefetch,
    set_coherence_policy,
)
from ._vmm._access import AccessFlags, allocation_granularity
from ._vmm._buffer import VMMBuffer
from ._vmm._mapping import AddressRange, Mapping, PhysicalMemory

__version__ = "0.1.0"

# numba's CUDA simulator: load the simulated driver now, so that numba's stream
# constructors name its streams before the program makes any.
if _sim.active():
    from . import _driver

    _driver.api()


def __getattr__(name: str) -> type:
    # numba's NUMBA_CUDA_MEMORY_MANAGER=umem_numba reads _numba_memory_manager; the plugin's
    # module is loaded only when numba asks for it (its first context).
    if name in ("_numba_memory_manager", "UmemNumbaMemoryManager"):
        from ._interop._emm import UmemNumbaMemoryManager

        return UmemNumbaMemoryManager
    raise AttributeError(f"module 'umem_numba' has no attribute {name!r}")


def __dir__() -> list[str]:
    # dir(um) and tab completion show the public API only, not the private subpackages or `annotations`.
    return sorted([*__all__, "__version__"])


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
    "NotDeviceAccessibleError",
    "CoherenceError",
    "BufferClosedError",
    # machine
    "gpu_available",
    "gpu_unavailable_reason",
    "info",
    "device_count",
    "device_attribute",
    "mem_info",
    "can_access_peer",
    "stats",
    "reset_peak",
    "KindStats",
    # locations
    "Location",
    "HOST",
    "Host",
    "as_location",
    # streams and the driver
    "PriorityStream",
    "stream_handle",
    "ensure_context",
    "driver_call",
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
    "device_empty",
    "device_zeros",
    "device_like",
    "device_from",
    "PoolStats",
    "set_allocation_cache",
    "get_allocation_cache",
    "release_allocation_cache",
    # pinned
    "PinnedBuffer",
    "HostAllocFlags",
    # coherence
    "launch",
    "coherent",
    "jit",
    "CoherentForAll",
    "CoherentKernel",
    "coherence_policy",
    "set_coherence_policy",
    "set_auto_prefetch",
    "get_auto_prefetch",
    "get_coherence_policy",
    "CoherenceWarning",
    # graphs
    "capture",
    "Graph",
]
