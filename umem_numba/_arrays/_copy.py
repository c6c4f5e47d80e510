"""The copy layer: every copy between host, buffers and numba device arrays.

One set of rules for every buffer kind (managed, pinned, VMM, pool device
memory) and for any object with ``__cuda_array_interface__`` (numba's
``DeviceNDArray``, CuPy arrays):

* **DMA whenever a device may hold the data.**  Copies out of (or into)
  managed, VMM and device memory use ``cuMemcpyAsync``: managed memory is a
  valid operand, and its pages that sit on a device are read by the copy
  engine at bus speed instead of being faulted back page by page.  Pinned
  memory that no device holds is copied by the host when the other side is a
  numpy array.
* **Asynchronous on the stream, ordered by coherence on both sides.**  Before
  the copy the stream waits (on the device) for work recorded on either
  operand on other streams; afterwards one event is recorded and filed under
  both operands, so host access to either waits for the copy, and a later
  launch on another stream is ordered after it.  A numba array that names a
  stream in its CUDA Array Interface is synchronised with as the interface
  asks.
* **Synchronous where numpy receives the result.**  ``copy_to_host`` into a
  numpy array returns after the data is there; ``copy_from_host`` from a
  numpy array returns once the source has been read and leaves the device
  side pending.  A numpy array over memory the driver knows (a view of
  managed or pinned memory, ``buf.host``, ``cuda.pinned_array``) is read by
  the copy engine only when the stream gets to the copy, so for such a
  source the call waits for the copy (pass the :class:`PinnedBuffer` itself
  for an asynchronous copy that its coherence guards).
* **Graph capture.**  A copy onto a stream that is capturing a CUDA graph
  raises :class:`~umem_numba.CoherenceError` before it issues anything (no
  prefetch, no staging), so the capture stays intact.
* **Contiguity.**  Both sides of a DMA copy must be contiguous, in the same
  order: both C (row-major) or both F (column-major, ``order="F"`` buffers and
  their ``.T`` views); a DMA copy moves bytes.  A *numpy* operand in the
  other order (or a strided numpy source) is rearranged on the host, and a
  strided view of a host-accessible buffer (managed, pinned) is read on the
  host by ``copy_to_host``.  Any other strided operand is refused with a
  ``ValueError`` that says so: copy the contiguous buffer it slices and index
  the result (copying element by element over the bus would be slower than
  that).

Staging
-------
A copy between device memory and *pageable* numpy memory can go two ways:
straight to the driver (which stages through small buffers of its own on one
thread: about 10 GB/s host to device, as numba's ``copy_to_device`` gets),
or through pinned staging slots, pipelined: a pool of copier threads moves
chunks between numpy and the slots (``ctypes.memmove`` releases the GIL, so
they copy in parallel) while the copy engine moves the slots that are ready,
each slot reused once the DMA that used it is done (its event).  The host
copies then keep up with the bus.  ``staging=None`` picks the path measured
faster on the benchmark machine for copies of at least
:data:`STAGE_MIN_BYTES` (see ``python -m umem_numba bench copy``); ``False``
forces the driver path, ``True`` the internal staging slots, and a
:class:`PinnedBuffer` is used as the staging area instead.  The staging area
is the copy's own memory: a copy that finds its slots still read (or
written) by an earlier copy's DMA waits for that DMA, whatever the coherence
policy (``"off"``, ``"warn"`` and ``"raise"`` are about the user's buffers).
Copies through one staging area take turns, the internal area's and a user's
PinnedBuffer's alike: two threads that pass the same PinnedBuffer as
``staging`` are serialised (the second copy starts once the first one's host
side is done), never mixed.

``UMEM_NUMBA_COPY_THREADS`` sets the number of copier threads, an integer
from 1 to :data:`MAX_COPY_THREADS` (default: half the CPUs, at most 8).  It
is read once, when the first staged copy starts the copier threads (a bad
value makes that copy raise ``ValueError``); later changes have no effect.
The internal staging area is pinned memory (twice the threads,
:data:`CHUNK_BYTES` each) made once per device on first use and counted in
``umem_numba.stats()["pinned"]``.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from .. import _driver
from .._driver._location import Location, StreamLike, stream_handle
from .._errors import CoherenceError
from .._memory import _capture, _events
from .._memory._lifetime import Allocation, DriverMemory
from .._memory._resources import PINNED, MemoryResource
from .._memory._tracker import DeviceUse, Tracker, refuse_capture
from . import _layout

__all__ = ["copy"]

#: Auto choice for pageable numpy destinations (device -> host): staged or the driver's path.
STAGE_TO_HOST = True
#: Auto choice for pageable numpy sources (host -> device).
STAGE_FROM_HOST = True
#: Copies smaller than this take the driver's path under ``staging=None`` (threads cost more than they save).
STAGE_MIN_BYTES = 16 << 20
#: Size of one internal staging slot.
CHUNK_BYTES = 8 << 20


#: The most copier threads ``UMEM_NUMBA_COPY_THREADS`` may ask for (each adds two
#: :data:`CHUNK_BYTES` slots of pinned memory to a device's staging area).
MAX_COPY_THREADS = 64


def copier_threads() -> int:
    """Threads that copy chunks between numpy and the staging slots, parsed from ``UMEM_NUMBA_COPY_THREADS`` now.

    Unset or blank: half the CPUs, at most 8.  The copy layer reads it once,
    when the first staged copy starts the copier threads (see :mod:`umem_numba._arrays._copy`).

    Raises
    ------
    ValueError
        The value is not an integer from 1 to :data:`MAX_COPY_THREADS`.
    """
    raw = os.environ.get("UMEM_NUMBA_COPY_THREADS", "").strip()
    if not raw:
        return max(1, min(8, (os.cpu_count() or 2) // 2))
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_COPY_THREADS:
        raise ValueError(
            f"UMEM_NUMBA_COPY_THREADS must be an integer from 1 to {MAX_COPY_THREADS} "
            f"(the copier threads of staged copies), got {raw!r}"
        )
    return n


# ---------------------------------------------------------------------------
# Operands


@dataclass
class Side:
    """One operand of a copy, resolved to what the driver needs.

    A umem_numba buffer describes itself with ``buf._copy_side()``; this
    module never imports the buffer classes (it sits below them).
    """

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    contiguous: bool
    tracker: Tracker | None = None
    device_id: int | None = None
    on_device: bool = True  # a device may hold the data (DMA needed)
    cai_stream: int | None = None  # stream named by a CUDA Array Interface
    resource: MemoryResource | None = None  # what a umem_numba buffer's memory is; None if foreign
    host_view: Callable[[str], np.ndarray] | None = None  # settles coherence, then a numpy view
    order: str = "C"  # the orders the elements are dense in: "C", "F", "CF" (both) or "" (strided)
    raw: bool = False  # bytes without a shape (a cuda.core Buffer): matched by size only
    epoch: int | None = None  # the tracker's epoch when ``ptr`` was taken (Tracker.begin_use)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def _side_of(obj: Any) -> Side | None:
    """The side of a umem_numba buffer (``None`` for anything else)."""
    describe = getattr(obj, "_copy_side", None)
    return describe() if describe is not None else None


def _from_cai(obj: Any, what: str, role: str) -> Side:
    try:
        iface = obj.__cuda_array_interface__
    except AttributeError:
        iface = None
    if not isinstance(iface, dict):
        hint = " (use copy_to_host / copy_from_host for numpy arrays)" if isinstance(obj, np.ndarray) else ""
        raise TypeError(
            f"{what}: the {role} must be a numba device array or a umem_numba buffer, got {type(obj).__name__}{hint}"
        )
    info = _layout.cuda_array_info(obj, what)
    shape, dtype = info.shape, info.dtype
    order = info.order
    if iface["data"][1] and role == "destination":
        raise ValueError(f"{what}: the destination device array is read-only")
    stream = iface.get("stream")
    return Side(info.ptr, shape, dtype, bool(order), cai_stream=None if stream is None else int(stream), order=order)


def is_cuda_core(obj: Any) -> bool:
    """Whether ``obj`` is a cuda.core object (a ``Buffer``, a ``StridedMemoryView``, ...)."""
    return type(obj).__module__.startswith("cuda.core")


def cuda_core_side(obj: Any, what: str, role: str) -> Side:
    """A cuda.core ``StridedMemoryView`` (an array) or ``Buffer`` (bytes) as a copy operand.

    cuda.core is not imported: its objects are recognised by their module and
    read through their public attributes.

    Raises
    ------
    TypeError
        Another cuda.core object, or a view of memory only the host can reach.
    ValueError
        A closed Buffer, or a read-only view as the destination.
    """
    name = type(obj).__name__
    if hasattr(obj, "strides") and hasattr(obj, "is_device_accessible") and hasattr(obj, "ptr"):
        if not cuda_core_device_accessible(obj):
            raise TypeError(
                f"{what}: the {role} is a cuda.core {name} of host memory; this copy takes device-accessible "
                "memory (for host data use a numpy array: np.from_dlpack(view))"
            )
        if obj.dtype is None:
            raise TypeError(f"{what}: the {role}, a cuda.core {name}, has no dtype")
        if role == "destination" and obj.readonly:
            raise ValueError(f"{what}: the destination cuda.core {name} is read-only")
        dtype = _layout.normalize_dtype(obj.dtype)
        shape = tuple(int(d) for d in obj.shape)
        strides = (
            _layout.c_strides(shape, dtype.itemsize)
            if obj.strides is None
            else tuple(int(st) * dtype.itemsize for st in obj.strides)
        )
        order = _layout.dense_order(shape, strides, dtype.itemsize)
        device = _cuda_core_device(obj)
        return Side(int(obj.ptr), shape, dtype, bool(order), device_id=device if device >= 0 else None, order=order)
    if hasattr(obj, "handle") and hasattr(obj, "size") and hasattr(obj, "is_closed"):
        if obj.is_closed:
            raise ValueError(f"{what}: the {role}, a cuda.core {name}, is closed")
        nbytes = int(obj.size)
        ptr = int(obj.handle) if nbytes else 0
        device = _cuda_core_device(obj)
        return Side(
            ptr,
            (nbytes,),
            np.dtype(np.uint8),
            True,
            device_id=device if device >= 0 else None,
            order="CF",
            raw=True,
        )
    raise TypeError(
        f"{what}: the {role} is a cuda.core {name}; umem_numba copies a cuda.core Buffer (as bytes) "
        "or a StridedMemoryView"
    )


def cuda_core_device_accessible(obj: Any) -> bool:
    """Whether a cuda.core object says its memory is device-accessible (``True`` where it cannot say).

    A non-owning ``Buffer.from_handle`` has no memory resource to ask (some
    cuda.core versions raise there); ``cuMemcpyAsync`` copies any address the
    driver can resolve, so such a buffer is taken as it is.
    """
    try:
        return bool(obj.is_device_accessible)
    except Exception:
        return True


def _cuda_core_device(obj: Any) -> int:
    """A cuda.core object's device ordinal, ``-1`` where it has none to give.

    Only a hint (the context a legacy-stream copy is issued in): a non-owning
    ``Buffer.from_handle`` may not know its device, and that is no error here.
    """
    try:
        return int(obj.device_id)
    except Exception:
        return -1


def _resolve(obj: Any, what: str, role: str) -> Side:
    side = _side_of(obj)
    if side is not None:
        return side
    if is_cuda_core(obj):
        return cuda_core_side(obj, what, role)
    return _from_cai(obj, what, role)


def _check_match(dst: Side, src: Side, what: str) -> None:
    if dst.raw or src.raw:  # a cuda.core Buffer is bytes: sizes must agree, and the other side be dense
        if dst.nbytes != src.nbytes:
            raise ValueError(
                f"{what}: a cuda.core Buffer is copied as bytes: {src.nbytes} vs {dst.nbytes} bytes "
                "(source vs destination)"
            )
        return
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"{what}: mismatched arrays: {src.shape} {src.dtype} vs {dst.shape} {dst.dtype} (source vs destination)"
        )
    if dst.contiguous and src.contiguous and not _same_order(dst.order, src.order):
        raise ValueError(
            f"{what}: the source is {_order_name(src.order)} and the destination {_order_name(dst.order)}: "
            "a DMA copy moves bytes, so both must be in the same order (make the buffer with order=, "
            "or copy a .T view)"
        )


def _same_order(a: str, b: str) -> bool:
    """Whether two dense layouts put the elements at the same offsets."""
    return bool(set(a) & set(b))


def _order_name(order: str) -> str:
    return {"C": "C-ordered (row-major)", "F": "F-ordered (column-major)"}.get(order, "contiguous")


def _check_contiguous(side: Side, what: str, role: str) -> None:
    if not side.contiguous:
        raise ValueError(
            f"{what}: the {role} must be C-contiguous or F-contiguous (a strided view cannot be copied by "
            "DMA); copy the contiguous array it slices and index the result"
        )


def _numpy_order(side: Side) -> Literal["C", "F"]:
    """The numpy ``order=`` of an array laid out like ``side`` (C unless it is F only)."""
    return "F" if side.order == "F" else "C"


def _issue_context(*sides: Side) -> int | None:
    """The device whose context issues a copy on the default stream: a device-side operand's."""
    for s in sides:
        if s.tracker is not None and s.on_device and s.device_id is not None:
            return s.device_id
    for s in sides:
        if s.device_id is not None:
            return s.device_id
    return None


# ---------------------------------------------------------------------------
# The one DMA primitive


def _dma(
    dst: Side,
    src: Side,
    handle: int,
    what: str,
    *,
    sync: bool,
    extra_dst: int | None = None,
    extra_src: int | None = None,
) -> _events.Event | None:
    """Queue ``src -> dst`` (whole operands) on ``handle`` with coherence on both sides.

    ``extra_*`` are raw pointers standing in for a side's pointer (staging).
    Returns the recorded event (``None`` for an empty copy).  Must run with the
    stream's context current.
    """
    nbytes = src.nbytes
    if not nbytes:
        return None
    device_id = _driver.ensure_context()
    with DeviceUse(_uses(dst, src), handle, what, _epochs(dst, src)) as use:
        _wait_for_interface_streams((dst, src), handle, device_id, what)
        _driver.call(
            "cuMemcpyAsync",
            dst.ptr if extra_dst is None else extra_dst,
            src.ptr if extra_src is None else extra_src,
            nbytes,
            handle,
            detail=what,
        )
    event = use.event
    if sync and event is not None:
        event.synchronize()
    return event


def _uses(dst: Side, src: Side) -> list[tuple[Tracker, bool]]:
    """The copy writes its destination and reads its source."""
    return [(s.tracker, s is dst) for s in (dst, src) if s.tracker is not None]


def _epochs(dst: Side, src: Side) -> list[int | None]:
    """The epochs of :func:`_uses`' trackers when the sides took their addresses."""
    return [s.epoch for s in (dst, src) if s.tracker is not None]


def _wait_for_interface_streams(sides: tuple[Side, ...], handle: int, device_id: int, what: str) -> None:
    """A CUDA Array Interface that names a stream: the copy's stream waits for that stream's work."""
    for side in sides:
        s = side.cai_stream
        if s is not None and s != handle:
            ev = _events.record(s, device_id)
            _driver.call(
                "cuStreamWaitEvent",
                handle,
                ev.handle,
                0,
                detail=f"{what}: ordering after the stream named by a CUDA Array Interface",
            )


def copy(dst: Any, src: Any, stream: StreamLike = None) -> None:
    """Copy ``src`` into ``dst``, asynchronously on ``stream`` (``cuMemcpyAsync``).

    Parameters
    ----------
    dst, src : umem_numba buffer, device array or cuda.core object
        Any umem_numba buffer (managed, pinned, VMM, pool device memory, views
        included), an object with ``__cuda_array_interface__`` (numba's
        ``DeviceNDArray``, CuPy arrays), or a cuda.core ``StridedMemoryView``
        of device-accessible memory; a cuda.core ``Buffer`` is bytes: the
        other side must be contiguous with the same ``nbytes``.  Same shape and dtype, both
        contiguous in the same order (C, or F).  Pinned buffers need no
        DEVICEMAP flag here.
    stream : numba stream, 0 or None
        The stream the copy is queued on (``None``/``0``: the legacy default
        stream of the device that owns a buffer operand).

    Raises
    ------
    TypeError
        An operand is neither a buffer nor a device array (numpy arrays go
        through :meth:`~umem_numba.ManagedBuffer.copy_to_host` and
        ``copy_from_host``).
    ValueError
        Shapes or dtypes differ, an operand is not contiguous, or one is
        C-ordered and the other F-ordered.
    BufferClosedError
        An operand buffer is closed.

    Notes
    -----
    Nothing waits on the host: work already recorded on either buffer (on
    other streams) is ordered before the copy on the device, and host access
    to either buffer afterwards waits for the copy.  Plain numba arrays carry
    no such record: order work on them yourself (same stream, or a
    synchronize), as with any numba copy.
    """
    what = "copy"
    d = _resolve(dst, what, "destination")
    s = _resolve(src, what, "source")
    _check_match(d, s, what)
    _check_contiguous(d, what, "destination")
    _check_contiguous(s, what, "source")
    n = s.nbytes
    if n and d.ptr < s.ptr + n and s.ptr < d.ptr + n:
        raise ValueError(f"{what}: source and destination overlap in memory")
    handle = stream_handle(stream)
    recorder = _capture.recorder_for(handle) if handle else None
    if recorder is not None:
        _capture_copy(d, s, (dst, src), handle, recorder)
        return
    _copy_sides(d, s, handle, what, sync=False)


def _capture_copy(d: Side, s: Side, owners: tuple[Any, Any], handle: int, recorder: _capture.CaptureRecorder) -> None:
    """``copy`` on a stream this thread captures with ``umem_numba.capture``: a memcpy node of the graph.

    Nothing is ordered or recorded now (each launch of the graph is); the
    graph notes the write of ``d`` and the read of ``s`` and keeps both alive.
    """
    for side in (d, s):
        if side.cai_stream is not None and side.cai_stream != handle:
            raise CoherenceError(
                "copy: inside umem_numba.capture, an operand whose CUDA Array Interface names another stream "
                "cannot be ordered (waiting on another stream's event would break the capture)"
            )
    for side, owner in zip((d, s), owners, strict=True):
        if side.tracker is not None:
            recorder.add(side.tracker, side is d, epoch=side.epoch)
        recorder.keep.append(owner)
    if s.nbytes:
        with _driver.device_context(recorder.device):
            _driver.call("cuMemcpyAsync", d.ptr, s.ptr, s.nbytes, handle, detail="copy (captured into a graph)")


def _copy_sides(d: Side, s: Side, stream: StreamLike, what: str, *, sync: bool) -> _events.Event | None:
    handle = stream_handle(stream)
    dev = _issue_context(d, s) if handle == 0 else None
    with _driver.device_context(dev):
        return _dma(d, s, handle, what, sync=sync)


# ---------------------------------------------------------------------------
# Host side


def _host_side(arr: np.ndarray) -> Side:
    order = ("C" if arr.flags.c_contiguous else "") + ("F" if arr.flags.f_contiguous else "")
    return Side(arr.ctypes.data if arr.size else 0, arr.shape, arr.dtype, bool(order), on_device=False, order=order)


def _driver_memory(arr: np.ndarray) -> bool:
    """Whether a numpy array lies in memory the driver knows: managed, or page-locked (pinned, registered).

    A DMA reads (or writes) such memory when the copy engine gets to it, not
    when ``cuMemcpyAsync`` returns, unlike pageable memory, which the driver
    stages before returning.  Page-locked memory is the driver's host memory
    type; plain (pageable) memory has none (memory type 0), also where devices
    can read it directly (HMM, ATS), so it keeps the staged path.

    One ``cuPointerGetAttributes`` call, not ``cuPointerGetAttribute``: the
    latter fails (``CUDA_ERROR_INVALID_VALUE``) for the pageable memory most
    copies come from, and compute-sanitizer reports that failure as an error
    of the user's program; the former answers NULL values with success.
    """
    if not arr.size:
        return False
    a = _driver.api()
    attrs = [a.c.pointer_is_managed, a.c.pointer_memory_type]
    err, values = a.drv.cuPointerGetAttributes(len(attrs), attrs, arr.ctypes.data)
    if int(err) != 0:
        return False
    managed, memory_type = (int(v or 0) for v in values)
    return bool(managed) or memory_type == a.c.memorytype_host


class _Staging:
    """The internal pinned staging slots of a device, with the lock that makes one copy use them at a time.

    Sized once, from the copier threads of the copy that makes it: its slot
    count and size are its own, never re-read from the setting.  Its tracker
    always waits (policy ``"sync"``): the slots are the copy layer's own
    memory, and the user's coherence policy is about the user's buffers.
    """

    _by_device: ClassVar[dict[int, _Staging]] = {}
    _guard = threading.Lock()

    def __init__(self, device_id: int, threads: int) -> None:
        self.lock = threading.Lock()
        self.count = 2 * threads
        self.size = CHUNK_BYTES
        nbytes = self.count * self.size
        with _driver.device_context(device_id), _driver.capture_safe():
            ptr = int(_driver.call("cuMemHostAlloc", nbytes, 0, detail="pinning a copy staging area"))
        tracker = Tracker(device_id)
        tracker.policy = "sync"
        self._alloc = Allocation(
            "pinned",
            DriverMemory("pinned", ptr, nbytes, "cuMemFreeHost", device_id),
            ptr,
            device_id,
            tracker,
        )
        self.side = Side(ptr, (nbytes,), np.dtype(np.uint8), True, tracker, device_id, False, None, PINNED)

    @classmethod
    def get(cls, device_id: int, threads: int) -> _Staging:
        with cls._guard:
            st = cls._by_device.get(device_id)
            if st is None:
                st = cls._by_device[device_id] = cls(device_id, threads)
            return st


class _Copiers:
    """The copier threads and the count they were started with (the setting, read once)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="umem-copy")


_copiers: _Copiers | None = None
_copiers_guard = threading.Lock()


def _copier_pool() -> _Copiers:
    """The copier threads, started on first use (idle threads cost nothing).

    ``UMEM_NUMBA_COPY_THREADS`` is read here, once: a bad value raises (and
    the next staged copy reads it again); later changes have no effect.
    """
    global _copiers
    copiers = _copiers
    if copiers is None:
        with _copiers_guard:
            copiers = _copiers
            if copiers is None:
                copiers = _copiers = _Copiers(copier_threads())
    return copiers


def _pinned_side(obj: Any) -> Side | None:
    """The side of a PinnedBuffer (``None`` for anything else)."""
    side = _side_of(obj)
    return side if side is not None and side.resource is not None and side.resource.stages_copies else None


#: One lock per user staging area (by its allocation: views of one PinnedBuffer share it).
_user_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_user_locks_guard = threading.Lock()


def _user_lock(staging: Any) -> threading.Lock:
    """The lock that makes copies through the user's staging PinnedBuffer take turns."""
    alloc = staging._live()
    with _user_locks_guard:
        lock = _user_locks.get(alloc)
        if lock is None:
            lock = _user_locks[alloc] = threading.Lock()
        return lock


def _staging_area(staging: Any, device_id: int, threads: int) -> tuple[Side, threading.Lock | None, int, int]:
    """``(area, lock, slot count, slot bytes)``: the user's PinnedBuffer, or the device's internal area.

    Either comes with its lock: copies through one staging area (the internal
    one, or one PinnedBuffer given by several threads) take turns, since each
    uses every slot.
    """
    user = _pinned_side(staging)
    if user is not None:
        if not user.contiguous:
            raise ValueError("the staging PinnedBuffer must be C-contiguous")
        if user.nbytes < 2:
            raise ValueError(f"the staging PinnedBuffer is too small ({user.nbytes} bytes)")
        return (user, _user_lock(staging), *_user_slots(user.nbytes, threads))
    st = _Staging.get(device_id, threads)
    return st.side, st.lock, st.count, st.size


def _check_staging_arg(staging: Any) -> None:
    if staging is None or isinstance(staging, bool) or _pinned_side(staging) is not None:
        return
    raise TypeError(f"staging must be None, True, False or a PinnedBuffer, got {type(staging).__name__}")


def _user_slots(nbytes: int, threads: int) -> tuple[int, int]:
    """``(slot count, slot bytes)`` cut from a user's staging buffer of ``nbytes`` (at least 2).

    Twice the copier threads, as large as the buffer allows; the slots never
    reach past its end.
    """
    count = max(2, min(2 * threads, nbytes // (64 << 10)))
    size = nbytes // count
    if size >= 4096:
        size -= size % 4096  # page-aligned slots copy fastest
    return count, size


def _staged(
    dev: Side, host: np.ndarray, handle: int, what: str, staging: Any, copiers: _Copiers, *, to_host: bool
) -> None:
    """Device <-> pageable numpy through pinned staging slots: parallel host copies overlapped with DMA.

    The staging area's own coherence record orders its reuse: a copy that
    finds it still being read by the previous copy's DMA waits for exactly
    that (host to device returns once the source has been read, the device
    side still pending, like the driver's path).
    """
    device_id = _driver.ensure_context()
    stage, lock, count, size = _staging_area(
        staging, dev.device_id if dev.device_id is not None else device_id, copiers.threads
    )
    if lock is not None:
        lock.acquire()
    try:
        assert stage.tracker is not None
        # The host is about to write (or read) the slots.  The staging area is the
        # copy's own scratch memory (the user's PinnedBuffer too, once passed as
        # `staging`): it always waits for the DMA that last used it, whatever the
        # coherence policy.  Under "off" the slots would be refilled under the copy
        # engine; under "raise" the user would get an error about memory not theirs.
        stage.tracker.settle(what, "sync")
        uses = [(stage.tracker, True)] + ([(dev.tracker, not to_host)] if dev.tracker is not None else [])
        with DeviceUse(uses, handle, what, [stage.epoch, dev.epoch][: len(uses)]):
            _wait_for_interface_streams((dev,), handle, device_id, what)
            _Pipeline(dev.ptr, host.ctypes.data, dev.nbytes, stage.ptr, count, size, handle, device_id, what).run(
                copiers.pool, to_host
            )
    finally:
        if lock is not None:
            lock.release()


class _Pipeline:
    """One staged copy: chunk ``k`` uses slot ``k % count``; host copies on the copier threads, DMA in order here.

    Host to device: copier threads fill the slots; this thread issues each
    chunk's DMA as soon as its slot is full, and a slot is refilled once the
    event after its DMA has completed (the copier thread waits for it).
    Device to host: this thread issues each chunk's DMA into its slot; a
    copier thread waits for it, then empties the slot into numpy.
    """

    def __init__(
        self,
        dev_ptr: int,
        host_ptr: int,
        total: int,
        stage_ptr: int,
        count: int,
        size: int,
        handle: int,
        device_id: int,
        what: str,
    ) -> None:
        self.dev_ptr, self.host_ptr, self.total = dev_ptr, host_ptr, total
        self.stage_ptr, self.count, self.size = stage_ptr, count, size
        self.handle, self.device_id, self.what = handle, device_id, what
        self.context = _driver.check(_driver.api().drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self.chunks = (total + size - 1) // size

    def _span(self, k: int) -> tuple[int, int, int]:
        """``(offset, bytes, slot address)`` of chunk ``k``."""
        off = k * self.size
        return off, min(self.size, self.total - off), self.stage_ptr + (k % self.count) * self.size

    def _dma(self, dst: int, src: int, nbytes: int) -> _events.Event:
        err = _driver.api().drv.cuMemcpyAsync(dst, src, nbytes, self.handle)[0]
        if err != 0:
            _driver.raise_for(err, "cuMemcpyAsync", self.what)
        return _events.record(self.handle, self.device_id)

    def _host_copy(self, after: _events.Event | None, dst: int, src: int, nbytes: int) -> None:
        """On a copier thread: wait for the DMA that last used the slot, then copy (the GIL is released)."""
        if after is not None:
            _driver.call("cuCtxSetCurrent", self.context, detail=self.what)
            after.synchronize()
        ctypes.memmove(dst, src, nbytes)

    def run(self, pool: ThreadPoolExecutor, to_host: bool) -> None:
        pending: dict[int, Future[None]] = {}
        try:
            if to_host:
                self._to_host(pool, pending)
            else:
                self._from_host(pool, pending)
        finally:
            # On an error, copier threads may still touch the slots or numpy: let them finish first.
            for future in pending.values():
                future.exception()

    def _from_host(self, pool: ThreadPoolExecutor, pending: dict[int, Future[None]]) -> None:
        for k in range(min(self.count, self.chunks)):
            off, n, slot = self._span(k)
            pending[k] = pool.submit(self._host_copy, None, slot, self.host_ptr + off, n)
        for k in range(self.chunks):
            pending.pop(k).result()
            off, n, slot = self._span(k)
            event = self._dma(self.dev_ptr + off, slot, n)
            j = k + self.count
            if j < self.chunks:
                off_j, n_j, _ = self._span(j)
                pending[j] = pool.submit(self._host_copy, event, slot, self.host_ptr + off_j, n_j)

    def _to_host(self, pool: ThreadPoolExecutor, pending: dict[int, Future[None]]) -> None:
        for k in range(min(self.count, self.chunks)):
            off, n, slot = self._span(k)
            event = self._dma(slot, self.dev_ptr + off, n)
            pending[k] = pool.submit(self._host_copy, event, self.host_ptr + off, slot, n)
        for k in range(self.chunks):
            pending.pop(k).result()
            j = k + self.count
            if j < self.chunks:
                off_j, n_j, slot = self._span(j)
                event = self._dma(slot, self.dev_ptr + off_j, n_j)
                pending[j] = pool.submit(self._host_copy, event, self.host_ptr + off_j, slot, n_j)


def _prefetch_for_write(dst: Side, handle: int) -> None:
    """A managed destination about to be written by DMA: move its pages to the device first.

    Unpopulated pages are then created on the device and the copy engine writes
    device memory at full speed, instead of the copy faulting pages around.
    Only where the device has concurrentManagedAccess (else prefetch is not
    allowed); errors are ignored (it is an optimisation only).
    """
    if dst.resource is None or not dst.resource.migrates or dst.device_id is None or not dst.nbytes:
        return
    if not _driver.concurrent_managed_access(dst.device_id):
        return
    res = _driver.api().mem_prefetch(dst.ptr, dst.nbytes, Location.device(dst.device_id).to_cu(), 0, handle)
    # An optimisation only: a refused prefetch leaves a correct (slower) copy.
    del res


def to_host(src: Side, out: Any = None, stream: StreamLike = None, staging: Any = None) -> Any:
    """Implementation of ``Buffer.copy_to_host`` (see there); ``src`` is the buffer's side."""
    what = "copy_to_host"
    _check_staging_arg(staging)
    d = _pinned_side(out)
    if d is not None:
        _check_match(d, src, what + "(out)")
        _check_contiguous(d, what, "destination PinnedBuffer")
        if not src.contiguous:
            raise ValueError(
                f"{what}: a strided view cannot be copied into a PinnedBuffer by DMA; "
                "copy the contiguous buffer it slices"
            )
        _copy_sides(d, src, stream, what, sync=False)
        return out
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"{what}: out must be a numpy array or a PinnedBuffer, got {type(out).__name__}")
        if out.shape != src.shape or out.dtype != src.dtype:
            raise ValueError(f"{what}(out): mismatched arrays: {out.shape} {out.dtype} vs {src.shape} {src.dtype}")
        if not out.flags.writeable:
            raise ValueError(f"{what}(out): out is read-only")
    if not src.contiguous or not src.on_device:
        if src.host_view is None:
            kind = src.resource.name if src.resource else "device"
            raise ValueError(
                f"{what}() needs a C-contiguous view of {kind} memory (DMA); "
                "copy the contiguous buffer it slices and index the numpy result"
            )
        host = src.host_view(what)  # settles the coherence first
        if out is None:
            return host.copy(order="K")  # an F-ordered buffer gives an F-ordered array
        np.copyto(out, host)
        return out
    if out is not None and not (out.flags.c_contiguous or out.flags.f_contiguous):
        raise ValueError(f"{what}(out): out must be C-contiguous or F-contiguous")
    if out is None:
        out = np.empty(src.shape, src.dtype, order=_numpy_order(src))
    if not src.nbytes:
        return out
    if not _same_order(_host_side(out).order, src.order):
        # The other order: the bytes land in an array laid out like the source, numpy rearranges them.
        np.copyto(out, to_host(src, None, stream, staging))
        return out
    handle = stream_handle(stream)
    use_stage = (STAGE_TO_HOST and src.nbytes >= STAGE_MIN_BYTES) if staging is None else bool(staging)
    copiers = _copier_pool() if use_stage else None  # checks the setting before any driver call
    with _driver.device_context(src.device_id if handle == 0 else None):
        refuse_capture(handle, what)  # before any work on the stream: a refused copy leaves a capture intact
        if copiers is not None and not _driver_memory(out):
            _staged(src, out, handle, what, staging, copiers, to_host=True)
        else:
            _dma(_host_side(out), src, handle, what, sync=True)
    return out


def from_host(dst: Side, array: Any, stream: StreamLike = None, staging: Any = None) -> None:
    """Implementation of ``Buffer.copy_from_host`` (see there); ``dst`` is the buffer's side."""
    what = "copy_from_host"
    _check_staging_arg(staging)
    if (
        _side_of(array) is not None
        or is_cuda_core(array)
        or (not isinstance(array, np.ndarray) and hasattr(array, "__cuda_array_interface__"))
    ):
        s = _resolve(array, what, "source")
        _check_match(dst, s, what)
        _check_contiguous(dst, what, "destination")
        _check_contiguous(s, what, "source")
        _copy_sides(dst, s, stream, what, sync=False)
        return
    src = np.asarray(array)
    if src.dtype.hasobject:
        raise TypeError(f"{what}: object arrays cannot be copied to CUDA memory")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"{what}: mismatched arrays: {src.shape} {src.dtype} vs {dst.shape} {dst.dtype}")
    if not dst.on_device:  # pinned memory: the host copies it
        assert dst.host_view is not None
        np.copyto(dst.host_view(what), src)
        return
    _check_contiguous(dst, what, "destination buffer view")
    # A strided numpy source, or one in the other order, is rearranged on the host.
    src = np.asfortranarray(src) if dst.order == "F" else np.ascontiguousarray(src)
    if not dst.nbytes:
        return
    handle = stream_handle(stream)
    use_stage = (STAGE_FROM_HOST and dst.nbytes >= STAGE_MIN_BYTES) if staging is None else bool(staging)
    copiers = _copier_pool() if use_stage else None  # checks the setting before any driver call
    with _driver.device_context(dst.device_id if handle == 0 else None):
        refuse_capture(handle, what)  # before the prefetch: a refused copy leaves a capture intact
        # Memory the driver knows (a numpy view of managed or pinned memory) is read
        # by the copy engine when it gets to the copy: wait for it, or the caller
        # could change the source before it is read.  Pageable memory has been read
        # (staged by the driver, or by our slots) when the call returns.
        known = _driver_memory(src)
        _prefetch_for_write(dst, handle)
        if known:
            _dma(dst, _host_side(src), handle, what, sync=True)
        elif copiers is not None:
            _staged(dst, src, handle, what, staging, copiers, to_host=False)
        else:
            # The device side stays pending (host access to the buffer waits for it).
            _dma(dst, _host_side(src), handle, what, sync=False)
