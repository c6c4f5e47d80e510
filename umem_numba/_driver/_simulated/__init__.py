"""A simulated CUDA driver over host memory, for numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).

:mod:`umem_numba._driver` loads this object instead of ``cuda.bindings.driver``
when numba's simulator is on.  It offers the driver entry points umem_numba
calls, with the binding's ``(CUresult, *values)`` convention, and the
binding's own enums and structs (it borrows them from ``cuda.bindings.driver``,
which imports without a GPU).  Every buffer, pool, copy, tracker and launch
class of umem_numba then runs over it unchanged.

One module per concept, as the real driver layer is; :class:`SimDriver` is composed of their mixins:

``_common``
    Sizes, result codes, the seed, device attributes, :class:`SimulatedFault`.
``_scheduling``
    Operations queued per stream, events, and the seeded loop that runs them (below).
``_memory``
    Allocations of each kind, pointer attributes, copies and memsets.
``_pools``
    Stream-ordered memory pools (device, managed, pinned), their frees and reuse.
``_locations``
    Memory locations (device, host, host NUMA node) as per-page codes.
``_managed``
    Advice, prefetches, range attributes, attaching and discards of managed memory.
``_vmm``
    Virtual memory management: reserved address space, memfd "physical" memory, mappings.
``_kernels``
    Queued launches of numba's simulated kernels, and running them.
``_graphs``
    Graph capture and graph launches, and the capture rules applied to every entry point.
``_sim_driver``
    :class:`SimDriver` itself, with the device and context entry points.
``_numba``
    numba's simulator API over it (:func:`install_numba`: streams, events, arrays, plain launches).

Memory
    Device, managed, pinned and pool memory are all host memory that this
    object owns (numpy byte arrays kept alive by address); a "device pointer"
    is the host address.  Each allocation remembers its kind, so pointer
    attributes, advice, range attributes and prefetch locations read back
    what was set.

Streams run late, in an adversarial order
    Each stream is a queue.  Work on it (kernels launched through umem_numba,
    copies, memsets, prefetches, event records, waits, stream-ordered frees)
    runs only when something needs it: a synchronisation of an event, a
    stream or the context, or a pageable copy that the real driver also
    completes before returning.  The work a synchronisation needs is run
    one operation at a time, each picked at random, with a seeded
    :class:`random.Random` (``UMEM_SIM_SEED``), among the streams whose next
    operation may run; with a spread (``reseed(seed, spread=p)``) an
    operation of another stream that nothing awaited needs runs instead
    with probability ``p``.  A query answers from what has run, and one that
    answers "not ready" lets one operation run, picked the same way, so
    polling finishes.  Host writes land at once; queued work sees them only
    if it runs later, as on a GPU.  A missing wait therefore shows as a
    stale read, a lost write or a corrupted block, the same way for the
    same seed.

    The legacy stream (handles 0 and 1) is ordered after all earlier work of
    blocking streams and they after its earlier work; handle 2 is a
    different per-thread stream in every thread; streams created with
    ``CU_STREAM_NON_BLOCKING`` have no implicit ordering.  A destroyed
    stream's or event's handle is handed out again, last freed first, once
    the work queued before has run; stream ids are never reused.

Graph capture
    Work queued on a capturing stream is recorded into a graph instead of
    run; a launch of the instantiated graph queues it on the launch stream,
    late like any stream work.  The driver's capture rules and errors are kept
    (see :class:`~._graphs.GraphCapture`).  Discards leave garbage drawn from the seed.

Refusals
    What it cannot do (several devices, peer access, IPC, loading modules,
    what a capture cannot record) it refuses with
    :class:`~umem_numba.UnsupportedError` naming the call and the simulator.
    It never gives a wrong answer.
"""

from __future__ import annotations

from ._common import DEFAULT_SEED, GRANULARITY, PAGE, TOTAL_MEM, SimulatedFault, seed
from ._kernels import fake_array, run_kernel
from ._numba import SimEvent, SimStream, install_numba
from ._scheduling import tracing
from ._sim_driver import SimDriver

__all__ = [
    "DEFAULT_SEED",
    "GRANULARITY",
    "PAGE",
    "TOTAL_MEM",
    "SimDriver",
    "SimEvent",
    "SimStream",
    "SimulatedFault",
    "fake_array",
    "install_numba",
    "run_kernel",
    "seed",
    "tracing",
]
