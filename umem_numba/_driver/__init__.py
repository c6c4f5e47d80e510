"""The checked driver layer: every CUDA driver call of umem_numba goes through here.

``cuda.bindings.driver`` returns ``(CUresult, *values)`` tuples; :func:`check`
turns a failure into a :class:`~umem_numba.CudaError` that names the call.
Loading is lazy: importing umem_numba never touches the driver, and the first
call that needs it raises one :class:`~umem_numba.CudaUnavailableError` on a
machine with no driver or no GPU.  With numba's CUDA simulator switched on
(``NUMBA_ENABLE_CUDASIM=1``) the binding is :class:`umem_numba._driver._simulated.SimDriver`,
a simulated driver over host memory with the same entry points: everything
above this module runs unchanged over it.

Everything version-dependent is resolved once, in :class:`_Api`: the binding's
enums that umem_numba uses (:attr:`_Api.c`), and the entry points that
cuda-bindings 12.9 spells ``*_v2`` and 13.x spells plainly.  No other module
writes a driver constant as a literal.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from .._errors import CudaError, CudaUnavailableError, OutOfMemoryError
from . import _sim

#: Results that mean the context is already gone (interpreter shutdown): the
#: driver released everything itself, so there is nothing left to free.
_GONE = frozenset({"CUDA_ERROR_DEINITIALIZED", "CUDA_ERROR_CONTEXT_IS_DESTROYED"})
_OOM_NAMES = frozenset({"CUDA_ERROR_OUT_OF_MEMORY"})


def _constants(drv: Any) -> SimpleNamespace:
    """The binding's enum members umem_numba uses, looked up once."""
    attr = drv.CUmem_range_attribute
    vmm_handle = drv.CUmemAllocationHandleType
    granularity = drv.CUmemAllocationGranularity_flags
    return SimpleNamespace(
        success=drv.CUresult.CUDA_SUCCESS,
        not_ready=int(drv.CUresult.CUDA_ERROR_NOT_READY),
        invalid_value=int(drv.CUresult.CUDA_ERROR_INVALID_VALUE),
        invalid_context=int(drv.CUresult.CUDA_ERROR_INVALID_CONTEXT),
        # managed memory attachment
        attach_global=int(drv.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL),
        attach_host=int(drv.CUmemAttach_flags.CU_MEM_ATTACH_HOST),
        attach_single=int(drv.CUmemAttach_flags.CU_MEM_ATTACH_SINGLE),
        # the special stream handles
        stream_legacy=int(drv.CU_STREAM_LEGACY),
        stream_per_thread=int(drv.CU_STREAM_PER_THREAD),
        event_disable_timing=int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
        stream_non_blocking=int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING),
        # pinned host memory
        hostalloc_portable=int(drv.CU_MEMHOSTALLOC_PORTABLE),
        hostalloc_devicemap=int(drv.CU_MEMHOSTALLOC_DEVICEMAP),
        hostalloc_writecombined=int(drv.CU_MEMHOSTALLOC_WRITECOMBINED),
        # locations
        device_cpu=int(drv.CU_DEVICE_CPU),
        location_device=drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE,
        location_host=drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST,
        location_host_numa=drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA,
        location_invalid=int(drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID),
        # advice and range attributes (the legacy int-valued forms: cuda-bindings
        # 13.3 rejects the *_TYPE/*_ID forms in cuMemRangeGetAttribute)
        advise=drv.CUmem_advise,
        range_read_mostly=attr.CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY,
        range_preferred=attr.CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION,
        range_accessed_by=attr.CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY,
        range_last_prefetch=attr.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION,
        # The typed forms (CUDA 12.2+), which tell a host NUMA node from the host:
        # read through range_attribute_int, which works around cuda-bindings 13.3.
        range_preferred_type=attr.CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE,
        range_preferred_id=attr.CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID,
        range_last_prefetch_type=attr.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE,
        range_last_prefetch_id=attr.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID,
        pointer_is_managed=drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED,
        pointer_memory_type=drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        memorytype_host=int(drv.CUmemorytype.CU_MEMORYTYPE_HOST),
        # virtual memory management
        vmm_pinned=drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED,
        vmm_posix_fd=vmm_handle.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        vmm_no_handle=vmm_handle.CU_MEM_HANDLE_TYPE_NONE,
        granularity_minimum=granularity.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        granularity_recommended=granularity.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        access=drv.CUmemAccess_flags,
        # stream-ordered memory pools (managed pools: CUDA 13 bindings only)
        pool_managed=getattr(drv.CUmemAllocationType, "CU_MEM_ALLOCATION_TYPE_MANAGED", None),
        mempool_attribute=drv.CUmemPool_attribute,
    )


class _Api:
    """The loaded binding, its constants and the version-dependent entry points."""

    def __init__(self, drv: Any, version: str) -> None:
        self.drv = drv
        self.version = version
        #: The simulated driver (numba's CUDA simulator) rather than a GPU's.
        self.simulated = bool(getattr(drv, "SIMULATED", False))
        self.c = _constants(drv)
        self.mem_advise = getattr(drv, "cuMemAdvise_v2", None) or drv.cuMemAdvise
        self.mem_prefetch = getattr(drv, "cuMemPrefetchAsync_v2", None) or drv.cuMemPrefetchAsync
        err, driver_version = drv.cuDriverGetVersion()
        self.driver_version = int(driver_version) if err == self.c.success else 0
        # One driver call for a whole prefetch plan: in cuda-bindings 13 *and* a
        # CUDA 13 driver (the binding may know a call the driver lacks).
        batch = getattr(drv, "cuMemPrefetchBatchAsync", None)
        self.mem_prefetch_batch = batch if self.driver_version >= 13000 else None
        # Discards (CUDA 13.0): ``None`` where the binding or the driver lacks them;
        # the reason is in :attr:`discard_missing`.
        discard = getattr(drv, "cuMemDiscardBatchAsync", None)
        discard_prefetch = getattr(drv, "cuMemDiscardAndPrefetchBatchAsync", None)
        if discard is None or discard_prefetch is None:
            self.discard_missing = (
                f"cuda-bindings {version} has no cuMemDiscardBatchAsync / cuMemDiscardAndPrefetchBatchAsync "
                "(they need cuda-bindings 13 and a CUDA 13 driver)"
            )
        elif self.driver_version < 13000:
            self.discard_missing = (
                f"the CUDA driver is version {self.driver_version // 1000}.{self.driver_version % 1000 // 10}; "
                "cuMemDiscardBatchAsync needs a CUDA 13.0 driver (R580 or newer)"
            )
        else:
            self.discard_missing = ""
        self.mem_discard_batch = None if self.discard_missing else discard
        self.mem_discard_prefetch_batch = None if self.discard_missing else discard_prefetch
        self.stream_get_device = getattr(drv, "cuStreamGetDevice", None)
        # Bound once: called on every tracked launch.
        self.stream_get_id = getattr(drv, "cuStreamGetId", None)
        self.stream_is_capturing = drv.cuStreamIsCapturing
        self.capture_none = drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        self.stream_wait_event = drv.cuStreamWaitEvent
        self.ctx_get_current = drv.cuCtxGetCurrent  # every allocation asks (ensure_context)


_lock = threading.Lock()
_api: _Api | None = None
_unavailable: str | None = None


def _load() -> _Api:
    global _unavailable
    if _forked_child:
        raise CudaUnavailableError(
            "this process was forked from one that had initialised CUDA; CUDA cannot be used in such a "
            "child (use multiprocessing's 'spawn' or 'forkserver' start method)"
        )
    with _lock:
        if _api is not None:
            return _api
        if _unavailable is None:
            _unavailable = _probe()
        if _unavailable:
            raise CudaUnavailableError(f"{_unavailable}; {_sim.HINT}")
        assert _api is not None
        return _api


def _probe() -> str:
    """Load the binding and initialise the driver; return '' or why not."""
    global _api
    if _sim.active():
        from cuda import bindings

        from ._simulated import SimDriver, install_numba

        sim = SimDriver()
        install_numba(sim)
        if os.environ.get("NUMBA_CUDA_MEMORY_MANAGER", "") in ("umem_numba", "umem_numba._interop._emm"):
            warnings.warn(
                "NUMBA_CUDA_MEMORY_MANAGER=umem_numba has no effect under numba's CUDA simulator "
                "(NUMBA_ENABLE_CUDASIM=1): the simulator has no memory managers, and numba's device arrays "
                "there are numpy arrays; umem_numba's own buffers and pools work as usual",
                RuntimeWarning,
                stacklevel=4,
            )
        # The binding's version: the simulated driver offers its entry points and enums.
        _api = _Api(sim, getattr(bindings, "__version__", "unknown"))
        return ""
    try:
        from cuda import bindings
        from cuda.bindings import driver as drv
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
        return f"cuda-bindings is not importable ({exc}); install numba-cuda[cu12] or [cu13]"
    try:
        (err,) = drv.cuInit(0)
    except Exception as exc:  # libcuda.so missing: pathfinder raises its own types
        return f"the NVIDIA driver library (libcuda) could not be loaded: {exc}"
    if err != drv.CUresult.CUDA_SUCCESS:
        return f"cuInit failed with {_result_name(drv, err)}: no usable CUDA GPU or driver"
    err, count = drv.cuDeviceGetCount()
    if err != drv.CUresult.CUDA_SUCCESS or count == 0:
        return "the CUDA driver reports no GPU"
    _api = _Api(drv, getattr(bindings, "__version__", "unknown"))
    return ""


def _result_name(drv: Any, err: Any) -> str:
    try:
        return str(drv.CUresult(err).name)
    except Exception:
        return f"CUresult {int(err)}"


#: Set in a child of fork(): the parent's CUDA state is unusable there.
_forked_child = False
#: Incremented in every child of fork(): allocations remember the generation
#: they were made in, and one from an earlier generation is never touched.
fork_generation = 0


def _after_fork_in_child() -> None:
    global _api, _forked_child, fork_generation
    fork_generation += 1
    if _api is not None:
        _api = None
        _forked_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def api() -> _Api:
    """Return the loaded driver API, loading it on first use.

    Raises
    ------
    CudaUnavailableError
        No driver, no GPU, or numba's simulator is enabled.
    """
    return _api if _api is not None else _load()


def consts() -> SimpleNamespace:
    """The driver constants (see :func:`_constants`), loading the driver on first use."""
    return api().c


def available() -> bool:
    """Whether a CUDA driver and at least one GPU can be used.

    Returns
    -------
    bool
        ``False`` with no driver, no GPU, or numba's CUDA simulator enabled
        (umem_numba then runs over its simulated driver).
    """
    try:
        return not api().simulated
    except CudaUnavailableError:
        return False


def unavailable_reason() -> str:
    """Why a real GPU cannot be used ('' when it can), without the simulator hint the error adds."""
    try:
        a = api()
    except CudaUnavailableError as exc:
        return _unavailable or str(exc)
    return _sim.NOTE if a.simulated else ""


def simulated() -> bool:
    """Whether the driver is the simulated one (numba's CUDA simulator is on)."""
    return api().simulated


def raise_for(result: Any, call: str, detail: str = "") -> None:
    """Raise the :class:`CudaError` subclass for a failed ``CUresult``."""
    drv = api().drv
    name = _result_name(drv, result)
    cls = OutOfMemoryError if name in _OOM_NAMES else CudaError
    raise cls(call, int(result), name, detail)


def check(result: tuple[Any, ...], call: str, detail: str = "") -> Any:
    """Unpack a binding's ``(CUresult, *values)`` tuple or raise.

    Returns
    -------
    None, the single value, or a tuple of values.
    """
    err = result[0]
    if err != 0:
        raise_for(err, call, detail)
    n = len(result)
    if n == 1:
        return None
    if n == 2:
        return result[1]
    return result[1:]


def call(name: str, *args: Any, detail: str = "") -> Any:
    """Call ``cuda.bindings.driver.<name>(*args)`` and :func:`check` it."""
    return check(getattr(api().drv, name)(*args), name, detail)


def is_finished(result: Any, call: str, detail: str = "") -> bool:
    """Decode a query's result (``cuEventQuery``, ``cuStreamQuery``): done, not ready, or raise."""
    err = int(result[0])
    if err == 0:
        return True
    if err == api().c.not_ready:
        return False
    raise_for(err, call, detail)
    return False  # unreachable


def context_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says the context was already torn down (nothing left to free)."""
    return isinstance(exc, CudaError) and exc.name in _GONE


#: Set by :func:`_at_exit`, umem_numba's exit hook: the process is exiting.
_exiting = False


def shutting_down(_is_finalizing: Any = sys.is_finalizing) -> bool:
    """Whether the process is exiting: finalizers, deleters and free callbacks must do nothing then.

    True from the moment umem_numba's exit hook runs (an ``atexit`` handler
    that runs before every ``weakref.finalize`` finalizer run at exit, see
    below), and while the interpreter finalizes.  ``sys.is_finalizing()``
    alone is not enough: it is still ``False`` while ``atexit`` handlers run,
    and numba's memory finalizers (the plugin's free callback), PyTorch's or
    CuPy's teardown can free umem_numba memory then, in whatever context is
    current, while other libraries tear their own state down.  The driver
    reclaims every allocation, stream and pool when the process ends, so
    from here on nothing is freed.
    """
    # Early-bound default: module teardown sets this module's globals to None,
    # and a __del__ run after that still needs an answer.  ``_exiting`` is then
    # None, which also means exiting.
    return _exiting is not False or _is_finalizing()


#: Run by :func:`_at_exit` once :func:`shutting_down` is True (see :func:`on_exit`).
_exit_callbacks: list[Callable[[], None]] = []


def on_exit(callback: Callable[[], None]) -> None:
    """Run ``callback`` in umem_numba's exit hook, after the guard is on (it must not call the driver)."""
    _exit_callbacks.append(callback)


def _at_exit() -> None:
    """umem_numba's exit hook: let queued device work finish, then :func:`shutting_down` is True for good."""
    global _exiting
    if _exiting:
        return  # registered again (exit_hook_first): it ran already
    try:
        _defer_numba_cleanups(_settle_devices())
    except Exception:  # a sticky error, a driver already going: nothing to do about it at exit
        pass
    finally:
        _exiting = True
        for callback in _exit_callbacks:
            try:
                callback()
            except Exception:  # at exit: nothing to report to
                pass


_hook_modules = 0


def exit_hook_first() -> None:
    """Make umem_numba's exit hook run before the exit handlers of libraries imported since it was registered.

    ``atexit`` runs the handler registered last first.  PyTorch, CuPy or JAX
    imported after umem_numba register theirs later, so they ran before
    umem_numba's hook, while :func:`shutting_down` was still False: a
    umem_numba buffer they dropped then was freed, with the driver calls that
    takes, while they tore their own state down.  Called where another
    library's objects reach umem_numba (lends, exports, foreign streams);
    cheap when no module was imported since the last call.  ``weakref``'s
    exit handler stays registered before it (it was first), so every
    finalizer run at exit still sees the guard.
    """
    global _hook_modules
    count = len(sys.modules)
    if count == _hook_modules or _exiting:
        return
    _hook_modules = count
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _settle_devices() -> list[int]:
    """``cuCtxSynchronize`` on every active primary context (only where this process loaded the driver).

    At exit nothing is freed any more, and the driver tears down the contexts,
    with their streams and pools, after Python is done.  Destroying a pool
    with frees still queued behind running work crashed the driver in our
    tests (see ``MemoryPool.close``), so the work still queued (a kernel still
    running, stream-ordered frees behind it) finishes first, while every
    context is intact.  It costs at most the time that work had left to run
    (a kernel that never ends keeps the process from exiting).  Pure driver
    calls: numba's own state may already be going.  Returns the devices with
    an active primary context.
    """
    a = _api
    if a is None or _forked_child:
        return []  # the driver was never loaded here: no device work, and no reason to load it now
    drv = a.drv
    err, count = drv.cuDeviceGetCount()
    if err != 0:
        return []
    settled = []
    for d in range(int(count)):
        err, _flags, active = drv.cuDevicePrimaryCtxGetState(d)
        if err != 0 or not active:
            continue
        settled.append(d)
        err, ctx = drv.cuDevicePrimaryCtxRetain(d)
        if err != 0:
            continue
        try:
            if drv.cuCtxPushCurrent(ctx)[0] == 0:
                try:
                    drv.cuCtxSynchronize()
                finally:
                    drv.cuCtxPopCurrent()
        finally:
            drv.cuDevicePrimaryCtxRelease(d)
    return settled


#: numba's deferred cleanups, entered at exit and never left (see _defer_numba_cleanups).
_numba_cleanups_deferred = contextlib.ExitStack()


def _defer_numba_cleanups(devices: list[int]) -> None:
    """At exit, with contexts on several devices: numba's queued cleanups no longer run.

    A process that launched kernels on GPUs 0 and 1 and captured graphs on each died
    after its work was done, in numba's exit finalizers, in ``cuLibraryUnload`` of a
    kernel module ("double free or corruption", or a segfault; 4 x H200).  numba-cuda
    0.30 links a kernel once (one cuda.core ``ObjectCode`` per compute capability) and
    loads that object into each device's context it runs on, so the modules of two
    contexts hold one ``cuLibrary`` handle, and each module's finalizer queues its
    unload at exit, run when that context's queue flushes (more than
    ``CUDA_DEALLOCS_COUNT`` items).  (A kernel on two GPUs without the captures exited
    cleanly, so the second unload alone is not the whole trigger.)  numba's public
    ``defer_cleanup`` in every context stops the queues from flushing; the driver frees
    what they hold with the contexts.  With one device nothing changes.
    """
    nbcuda = sys.modules.get("numba.cuda")
    if len(devices) < 2 or nbcuda is None or _api is None or _api.simulated:
        return
    for d in devices:
        try:
            with nbcuda.gpus[d]:
                _numba_cleanups_deferred.enter_context(nbcuda.defer_cleanup())
        except Exception:  # numba's state for this device is gone already: nothing left to defer
            continue


# ``weakref.finalize`` runs its finalizers still alive at exit (atexit=True, numba's
# memory finalizers among them) from one atexit handler, registered when the first
# finalize object of the process is made.  atexit runs the handler registered last
# first: making sure that handler is registered before ours makes ours run before it,
# so every finalizer run at exit sees shutting_down() (numba's utils do the same).
weakref.finalize(_at_exit, _at_exit).detach()
atexit.register(_at_exit)


# --------------------------------------------------------------------------
# Contexts.  umem_numba shares numba's primary contexts, so that memory it
# allocates is valid in every kernel numba launches.


def _numba_cuda() -> Any:
    from numba import cuda as nbcuda

    return nbcuda


#: Contexts numba made current here, by handle -> device ordinal (numba's primary contexts: a
#: handle stays valid for the whole process).
_numba_contexts: dict[int, int] = {}


def ensure_context() -> int:
    """Make numba's context for the current device current; return its ordinal.

    When a context numba made is current already (every call after the
    thread's first), one ``cuCtxGetCurrent`` answers: numba's own lookup
    costs several microseconds, and every allocation asks.
    """
    a = _api if _api is not None else api()
    if a.simulated:
        return 0  # the simulated driver has one device and one context
    err, current = a.ctx_get_current()
    if not err:
        device = _numba_contexts.get(int(current))
        if device is not None:
            return device
    nbcuda = _numba_cuda()
    try:
        ctx = nbcuda.current_context()
    except Exception as exc:  # CudaSupportError and friends
        raise CudaUnavailableError(f"numba could not create a CUDA context: {exc}") from exc
    device = int(ctx.device.id)
    err, current = a.drv.cuCtxGetCurrent()
    if not err and int(current):
        _numba_contexts[int(current)] = device
    return device


class _Scope(threading.local):
    device: int | None = None


_scope = _Scope()


@contextlib.contextmanager
def device_context(device_id: int | None) -> Iterator[int]:
    """Run the block with numba's context of ``device_id`` current.

    ``None`` means the current device.  The previous context is restored;
    nested blocks for the device already entered cost nothing.
    """
    if device_id is not None:
        if _scope.device == device_id:
            yield device_id
            return
        # A context of that device is current already (numba's, or one numba is
        # setting up right now, e.g. while it initialises a memory manager).
        err, current_dev = api().drv.cuCtxGetDevice()
        if err == 0 and int(current_dev) == device_id:
            yield device_id
            return
    current = ensure_context()
    if device_id is None or device_id == current:
        yield current
        return
    with _numba_cuda().gpus[device_id]:
        outer, _scope.device = _scope.device, device_id
        try:
            yield device_id
        finally:
            _scope.device = outer


def call_on(device_id: int, name: str, *args: Any, detail: str = "") -> Any:
    """A checked driver call with numba's context of ``device_id`` current."""
    with device_context(device_id):
        return call(name, *args, detail=detail)


@contextlib.contextmanager
def capture_safe() -> Iterator[None]:
    """Let this thread make a call that a CUDA graph capture prohibits, without breaking the capture.

    While a stream captures in the driver's "global" mode (the default), any
    thread's potentially unsafe call (``cuMemAllocManaged``, ``cuMemAlloc``,
    ``cuMemHostAlloc``, ``cuMemFree``, ``cuMemFreeHost``) fails and
    invalidates the capture.  umem_numba's own allocations and frees put
    nothing into a capture, so they run with this thread in the "relaxed"
    mode (``cuThreadExchangeStreamCaptureMode``, as PyTorch's allocator does),
    and the user's capture goes on.
    """
    drv = api().drv
    err, old = drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    if err != 0:
        raise_for(err, "cuThreadExchangeStreamCaptureMode", "allowing an allocation or free beside a graph capture")
    try:
        yield
    finally:
        drv.cuThreadExchangeStreamCaptureMode(old)


_count: int | None = None


def device_count() -> int:
    """Number of CUDA devices visible to the driver (it does not change in a process)."""
    global _count
    if _count is None:
        _count = int(call("cuDeviceGetCount"))
    return _count


_attr_cache: dict[tuple[int, str], int] = {}


def device_attribute(name: str, device_id: int) -> int:
    """Read ``CU_DEVICE_ATTRIBUTE_<name>`` of a device (cached: they do not change)."""
    key = (device_id, name)
    value = _attr_cache.get(key)
    if value is None:
        drv = api().drv
        attr = getattr(drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name)
        value = int(call("cuDeviceGetAttribute", attr, device_id))
        _attr_cache[key] = value
    return value


def concurrent_managed_access(device_id: int) -> bool:
    """The device's concurrentManagedAccess attribute."""
    return bool(device_attribute("CONCURRENT_MANAGED_ACCESS", device_id))


def current_device() -> int:
    """Ordinal of the device whose context is current (no driver call with one GPU)."""
    if device_count() == 1:
        return 0
    return int(check(api().drv.cuCtxGetDevice(), "cuCtxGetDevice"))


#: Streams whose owner is alive, by handle: ``[weak reference to the owner, its id or None,
#: its device or None]``.  While the owner (a stream numba created) lives, the stream is not
#: destroyed, so its handle names that one stream in every thread and its ``cuStreamGetId``
#: and ``cuStreamGetDevice`` can be kept.
_owned_streams: dict[int, list[Any]] = {}
_OWNED_KEPT = 256


def note_owned_stream(handle: int, owner: Any) -> None:
    """Remember that ``owner`` (alive) owns the stream ``handle``: :func:`stream_key` may then keep its id.

    Only for an object whose collection destroys the stream (numba's own
    streams); never for the special handles 0, 1 and 2, which name a
    different stream per context or thread.
    """
    if handle in (0, 1, 2):
        return
    known = _owned_streams.get(handle)
    if known is not None and known[0]() is owner:
        return
    try:
        ref = weakref.ref(owner)
    except TypeError:
        return
    if len(_owned_streams) >= _OWNED_KEPT:
        _owned_streams.clear()
    _owned_streams[handle] = [ref, None, None]


def stream_key(handle: int) -> int:
    """A key that names one stream for as long as it exists: ``cuStreamGetId``.

    Raw handles are ambiguous: ``0`` is the legacy stream of whichever
    context is current, ``2`` is the calling thread's per-thread stream, and
    a destroyed stream's handle can come back for a new stream.  The stream
    id is unique in the process.  It is asked of the driver at every call,
    except for a stream whose owner is known to be alive
    (:func:`note_owned_stream`): its handle cannot have been reused.
    (Without ``cuStreamGetId``, before CUDA 12, the handle is the key.)
    """
    owned = owned_stream(handle)
    if owned is not None:
        key = owned[1]
        if key is None:
            key = owned[1] = _ask_stream_id(handle)
        return int(key)
    return _ask_stream_id(handle)


def launch_device(handle: int) -> int:
    """The device a launch on stream ``handle`` runs on, without a driver call once it is known.

    A stream whose owner is alive (:func:`note_owned_stream`) belongs to one context for
    good (a launch on it runs in that device's context or fails): its
    ``cuStreamGetDevice``, asked once, is kept.  Not while the stream captures a
    graph, which refuses that call and is invalidated by the refusal: a launch
    there takes the current device (where a launch on that stream can only run),
    and the question waits for a launch outside the capture.  Any other stream,
    the legacy and per-thread streams included, is launched on in the current
    context: :func:`current_device` (no driver call with one GPU; ``cuCtxGetDevice``
    at every launch on a machine with more, which cost plain launches 6 % on two
    H200s).
    """
    if device_count() == 1:  # first: a one-GPU launch pays what it paid before (no lookup)
        return 0
    owned = owned_stream(handle)
    if owned is None:
        return current_device()
    device = owned[2]
    if device is None:
        a = _api if _api is not None else api()
        get = a.stream_get_device
        if get is None or is_capturing(handle):  # cuda-bindings older than 12.8; a capture
            return current_device()
        device = owned[2] = int(check(get(handle), "cuStreamGetDevice", f"finding the device of stream {handle:#x}"))
    return int(device)


def owned_stream(handle: int) -> list[Any] | None:
    """``[owner reference, id or None, device or None]`` of a stream whose owner is alive
    (:func:`note_owned_stream`), else None."""
    owned = _owned_streams.get(handle)
    if owned is not None and owned[0]() is not None:
        return owned
    return None


def _ask_stream_id(handle: int) -> int:
    a = _api if _api is not None else api()
    get = a.stream_get_id
    if get is None:
        return handle
    err, sid = get(handle)
    if err != 0:
        raise_for(err, "cuStreamGetId", f"identifying stream {handle:#x}")
    return int(sid)


def is_capturing(handle: int) -> bool:
    """Whether ``handle`` is capturing a CUDA graph (``cuStreamIsCapturing``)."""
    a = _api if _api is not None else api()
    err, status = a.stream_is_capturing(handle)
    if err != 0:
        # An implicit capture of the legacy stream reports itself as an error.
        if _result_name(a.drv, err) == "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT":
            return True
        raise_for(err, "cuStreamIsCapturing", f"checking stream {handle:#x} for graph capture")
    return bool(status != a.capture_none)


_side_streams: dict[tuple[int, int], int] = {}
_side_lock = threading.Lock()


def side_stream(device_id: int) -> int:
    """A private non-blocking stream of ``device_id`` (created once per process, never destroyed).

    For the toolkit's own ordered work that belongs to no user stream (batched
    discards on the legacy stream, prefetches before host access); make the
    device's context current before queuing on it.
    """
    key = (device_id, fork_generation)
    handle = _side_streams.get(key)
    if handle is None:
        with _side_lock:
            handle = _side_streams.get(key)
            if handle is None:
                with device_context(device_id):
                    raw = call("cuStreamCreate", consts().stream_non_blocking, detail="a private stream")
                handle = _side_streams[key] = int(raw)
    return handle


def active_devices() -> list[int]:
    """Devices whose primary context is active (where device work can exist)."""
    out = []
    for d in range(device_count()):
        _flags, active = call("cuDevicePrimaryCtxGetState", d)
        if active:
            out.append(d)
    return out


def synchronize_devices(devices: list[int] | set[int] | None, what: str) -> None:
    """``cuCtxSynchronize`` on each device (``None``: every device with an active context)."""
    for d in sorted(active_devices() if devices is None else devices):
        with device_context(d):
            call("cuCtxSynchronize", detail=what)


_range_get_attribute: Any = None


def _raw_range_get_attribute() -> Any:
    """The driver's ``cuMemRangeGetAttribute`` as a ctypes function (found through ``cuGetProcAddress``).

    cuda-bindings 13.3 and older refuse the ``*_TYPE``/``*_ID`` range attributes
    in their ``cuMemRangeGetAttribute`` wrapper (its helper only knows the four
    legacy ones, a ``TypeError``); the driver itself has had them since CUDA 12.2.
    """
    global _range_get_attribute
    if _range_get_attribute is None:
        import ctypes

        pfn, _status = call("cuGetProcAddress", b"cuMemRangeGetAttribute", 12020, 0)
        if not pfn:
            raise CudaError("cuGetProcAddress", 0, "CUDA_SUCCESS", "the driver has no cuMemRangeGetAttribute for 12.2")
        proto = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
        )
        _range_get_attribute = (proto(int(pfn)), ctypes)
    return _range_get_attribute


def range_attribute_int(attr: Any, ptr: int, nbytes: int, detail: str = "") -> int:
    """Read a 32-bit range attribute of managed memory (``cuMemRangeGetAttribute``), any binding version.

    The binding's wrapper is used where it takes ``attr``; where it refuses it
    (cuda-bindings 13.3 and the typed location attributes) the driver's entry
    point is called directly, and its result is checked like any other call.
    """
    try:
        return int(call("cuMemRangeGetAttribute", 4, attr, ptr, nbytes, detail=detail))
    except TypeError:
        pass
    fn, ctypes = _raw_range_get_attribute()
    out = ctypes.c_int32(0)
    err = fn(ctypes.byref(out), 4, int(attr), ptr, nbytes)
    check((err,), "cuMemRangeGetAttribute", detail)
    return int(out.value)


def mem_get_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current device."""
    ensure_context()
    free, total = call("cuMemGetInfo")
    return int(free), int(total)
