"""umem_numba under numba's CUDA simulator: the same buffers and calls, backed by host memory.

Imported only when ``NUMBA_ENABLE_CUDASIM=1`` (see :mod:`umem_numba._sim`):
:mod:`umem_numba` then takes :class:`ManagedBuffer`, :class:`PinnedBuffer`,
:class:`VMMBuffer`, :class:`DeviceBuffer`, the hints, prefetch, copies and
the launch wrappers from here, once, at import.  The real-GPU modules are not
touched.

How it works
------------
* Every buffer is a typed, strided window onto one numpy byte array (the
  "allocation"); views share it.  Construction, indexing, ``.host``, copies,
  ``close`` and the error messages follow the GPU classes (the array
  behaviour is the same code: :mod:`umem_numba._layout`).
* numba's simulator hands kernel arguments that are numpy arrays over as
  copies, and others as they are, except :class:`~numba.cuda.simulator.args.ArgHint`
  objects, which give their own device array.  The buffers here are such
  hints: a kernel gets a simulator array over the buffer's own memory (no
  copy; views, strides and aliasing as on the GPU), for ``kernel[g, b](buf)``
  and :func:`umem_numba.launch` alike.
* Coherence holds trivially: the simulator runs each launch to completion
  before returning.  ``on_host()`` still holds: a launch using a held buffer
  raises :class:`~umem_numba.CoherenceError`, as on the GPU.
* Advice, policies and prefetch are checked as on the GPU (types, ranges,
  devices) and then do nothing: the read-back reports no advice and no
  prefetch location, and says that this is the simulator.
* The simulator has one device, 0.  Memory pools, the VMM building blocks
  (:class:`AddressRange`, :class:`PhysicalMemory`, :class:`Mapping`) and
  sharing memory between processes raise :class:`~umem_numba.UnsupportedError`
  naming the simulator.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, NamedTuple

import numpy as np
from numba import cuda as _nbcuda
from numba.cuda.simulator.args import ArgHint
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

from . import _launch, _layout, _stats
from ._advice import HintState, MemAdvice, MigrationPolicy
from ._advice import ManagedMemoryHints as _DeviceHints
from ._buffer import Buffer, source_order
from ._errors import BufferClosedError, CoherenceError, UnsupportedError
from ._location import Location, StreamLike, Target, as_location, stream_handle
from ._managed_span import check_range
from ._pinned import HostAllocFlags, _as_flags
from ._sim import NOTE
from ._tracker import check_policy
from ._vmm_access import AccessFlags, as_access, check_nonnegative, check_size, round_up

__all__ = [
    "AddressRange",
    "CoherentKernel",
    "DeviceBuffer",
    "ManagedBuffer",
    "ManagedMemoryHints",
    "Mapping",
    "MemoryPool",
    "PhysicalMemory",
    "PinnedBuffer",
    "PrefetchPlan",
    "VMMBuffer",
    "allocation_granularity",
    "coherent",
    "copy",
    "jit",
    "launch",
    "managed_empty",
    "managed_from",
    "managed_like",
    "managed_zeros",
]

#: The simulated allocation granularity of VMM memory (that of current GPUs).
GRANULARITY = 2 << 20
#: The simulated device's memory: the default capacity of a VMMBuffer (address space only).
DEVICE_BYTES = 1 << 30
#: The simulator's one device.
_DEVICES = 1
_SimStream = type(_nbcuda.stream())


def _unsupported(what: str) -> UnsupportedError:
    return UnsupportedError(f"{what} needs a real GPU: it is not available under {NOTE.split(':', 1)[0]}")


def _stream(stream: StreamLike, what: str) -> int:
    """A stream argument, checked like on the GPU; the simulator's own streams count as 0."""
    if isinstance(stream, _SimStream):
        return 0
    return stream_handle(stream, what=what)


def _location(target: Target, what: str, *, allow_host: bool = True) -> Location:
    """:func:`~umem_numba.as_location` for the simulator's one device (``None``: device 0)."""
    if target is None:
        return Location.device(0)
    loc = as_location(target, check=False, allow_host=allow_host, what=what)
    if not loc.is_host and loc.id >= _DEVICES:
        prefix = f"{what}: " if what else ""
        raise ValueError(f"{prefix}device {loc.id} does not exist: numba's CUDA simulator has {_DEVICES} device")
    return loc


# ---------------------------------------------------------------------------
# Allocations


class _Allocation:
    """One block of host memory standing in for device memory; freed once, counted in ``stats()``."""

    __slots__ = ("__weakref__", "attached", "chunks", "closed", "grants", "hold", "kind", "policy", "raw", "shrinks")

    def __init__(self, kind: str, nbytes: int, *, reserve: int | None = None) -> None:
        self.kind = kind
        self.closed = False
        self.hold = 0
        self.policy: str | None = None
        self.attached: str | int | None = None
        self.chunks: list[int] = []  # VMM: sizes of the "mapped" chunks
        self.grants: dict[int, AccessFlags] = {}
        self.shrinks: list[int] = []
        size = nbytes if reserve is None else reserve
        if reserve is not None and size:
            # VMM: address space for the capacity, pages touched only when used.
            raw = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        else:
            raw = np.zeros(size, dtype=np.uint8) if size else np.empty(0, np.uint8)
        self.raw: np.ndarray | None = raw
        if nbytes or reserve:
            _stats.record_alloc(kind, nbytes)
            # Freed when the last numpy view of the memory goes (a host view outlives close()).
            weakref.finalize(raw, _record_free, kind, nbytes, self.chunks)

    @property
    def ptr(self) -> int:
        raw = self.raw
        return int(raw.ctypes.data) if raw is not None and raw.size else 0


def _record_free(kind: str, nbytes: int, chunks: list[int]) -> None:
    if chunks:  # VMM: the mapped chunks go first, then the allocation
        _stats.record_resize(kind, -sum(chunks))
    _stats.record_free(kind, nbytes)


# ---------------------------------------------------------------------------
# The buffer


class _SimBuffer(ArgHint):
    """Typed, strided window onto an :class:`_Allocation`; what every simulated buffer has."""

    _host_accessible: ClassVar[bool] = True
    _device_accessible: bool = True
    _kind: ClassVar[str] = "managed"
    _constructors: ClassVar[tuple[str, ...]] = ()
    #: ``kernels._common`` tells buffers from numba arrays by this attribute.
    _coherence_tracker = None

    __init__ = Buffer.__init__  # refuses direct calls, naming the constructors

    def _init(
        self,
        alloc: _Allocation,
        offset: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dtype: np.dtype,
        owner: bool,
    ) -> None:
        self._alloc: _Allocation | None = alloc
        self._owner = owner
        self._offset = offset
        self._shape = shape
        self._strides = strides
        self._dtype = dtype

    @classmethod
    def _new(cls, alloc: _Allocation, shape: tuple[int, ...], dtype: np.dtype, order: str = "C") -> Any:
        buf = object.__new__(cls)
        buf._init(alloc, 0, shape, _layout.strides_for(shape, dtype.itemsize, order), dtype, True)
        return buf

    # The window arithmetic is the GPU buffer's (it uses only the fields above and _live).
    _view = Buffer._view
    _copy_extra = Buffer._copy_extra

    # -- lifetime ---------------------------------------------------------------
    def _live(self) -> _Allocation:
        alloc = self._alloc
        if alloc is None or alloc.closed:
            raise BufferClosedError(f"this {type(self).__name__} is closed")
        return alloc

    closed = Buffer.closed

    def close(self) -> None:
        """Release the memory (owner) or drop this view's reference (view); closing twice does nothing.

        A numpy array from :attr:`host` keeps the memory until it is collected.
        """
        alloc = self._alloc
        if alloc is None:
            return
        if self._owner:
            alloc.closed = True
            alloc.raw = None
        self._alloc = None

    def __enter__(self) -> Any:
        self._live()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- array attributes (the GPU buffer's own code) -------------------------------
    shape = Buffer.shape
    dtype = Buffer.dtype
    strides = Buffer.strides
    ndim = Buffer.ndim
    size = Buffer.size
    nbytes = Buffer.nbytes
    itemsize = Buffer.itemsize
    is_c_contiguous = Buffer.is_c_contiguous
    is_f_contiguous = Buffer.is_f_contiguous
    transpose = Buffer.transpose
    T = Buffer.T
    is_view = Buffer.is_view
    __len__ = Buffer.__len__
    __getitem__ = Buffer.__getitem__
    view = Buffer.view
    reshape = Buffer.reshape

    @property
    def ptr(self) -> int:
        """Address of the first element (host memory, as the simulator's kernels see it)."""
        alloc = self._live()
        return alloc.ptr + self._offset if self.size else 0

    @property
    def device_id(self) -> int:
        """Always 0: the simulator's one device."""
        self._live()
        return 0

    # -- the memory as numpy -----------------------------------------------------------
    def _array(self) -> np.ndarray:
        """The elements as a numpy array over the allocation (no copy, no checks)."""
        alloc = self._live()
        if not self.size or alloc.raw is None:
            return np.empty(self._shape, self._dtype)
        return np.ndarray(self._shape, self._dtype, buffer=alloc.raw, offset=self._offset, strides=self._strides)

    def _host_array(self, what: str) -> np.ndarray:
        self._live()
        if not self._host_accessible:
            raise UnsupportedError(f"{type(self).__name__} memory is not host-accessible; use copy_to_host()")
        return self._array()

    @property
    def host(self) -> np.ndarray:
        """A numpy view of the same memory (no copy); it keeps the memory alive."""
        return self._host_array("host access")

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self._host_array("np.asarray")
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ValueError("a dtype conversion needs a copy")
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    # -- kernels: numba's simulator asks an ArgHint for its device array --------------
    def to_device(self, retr: list[Any], stream: Any = 0) -> FakeCUDAArray:
        """The simulator's device array over this buffer's memory (called by numba at launch)."""
        alloc = self._live()
        if not self._device_accessible:
            raise UnsupportedError(
                f"this {type(self).__name__} is not accessible from the device "
                "(pinned memory needs HostAllocFlags.DEVICEMAP)"
            )
        if alloc.hold:
            raise CoherenceError(
                "a kernel launch (or other device use) was attempted while the host "
                "holds this buffer (inside `with buf.on_host()`)"
            )
        return FakeCUDAArray(self._array())

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Not under the simulator: no other CUDA library can use host memory as device memory."""
        self._live()
        if not self._device_accessible:
            raise _NoDeviceViewError(
                f"this {type(self).__name__} is not accessible from the device "
                "(pinned memory needs HostAllocFlags.DEVICEMAP)"
            )
        raise _NoDeviceViewError(
            f"{type(self).__name__}.__cuda_array_interface__ needs a real GPU: under numba's CUDA simulator "
            "the memory is host memory (use .host or np.asarray)"
        )

    # -- copies -----------------------------------------------------------------------
    def copy_to_host(self, out: Any = None, stream: Any = None, *, staging: Any = None) -> Any:
        """Copy the elements into a new numpy array, a given one, or a :class:`PinnedBuffer` (returned)."""
        _stream(stream, "copy_to_host")
        _check_staging(staging)
        src = self._array()
        if out is None:
            return src.copy(order="K")  # an F-ordered buffer gives an F-ordered array, as on a GPU
        if isinstance(out, PinnedBuffer):
            dst = out._host_array("copy_to_host")
        elif isinstance(out, np.ndarray):
            dst = out
        else:
            raise TypeError(f"copy_to_host: out must be a numpy array or a PinnedBuffer, got {type(out).__name__}")
        _check_same(dst, src, "copy_to_host")
        if not dst.flags.writeable:
            raise ValueError("copy_to_host: out is read-only")
        np.copyto(dst, src)
        return out

    def copy_from_host(self, array: Any, stream: Any = None, *, staging: Any = None) -> None:
        """Copy a host array (or another buffer or simulator array) of the same shape and dtype into this one."""
        _stream(stream, "copy_from_host")
        _check_staging(staging)
        dst = self._array()
        src = _as_source(array)
        _check_same(dst, src, "copy_from_host")
        np.copyto(dst, src)

    # -- coherence (trivial: the simulator runs every launch to its end) --------------
    def synchronize(self) -> None:
        """Nothing to wait for: the simulator's kernels have finished when their launch returns."""
        self._live()

    @property
    def busy(self) -> bool:
        """Always False under the simulator."""
        self._live()
        return False

    @property
    def coherence_policy(self) -> str | None:
        """This buffer's own coherence policy (``None``: the block/global one); checked, nothing to enforce."""
        return self._live().policy

    @coherence_policy.setter
    def coherence_policy(self, policy: str | None) -> None:
        self._live().policy = None if policy is None else check_policy(policy)

    @contextlib.contextmanager
    def lend(self, stream: Any = None, *, readonly: bool = False) -> Iterator[LentView]:
        """Lend the buffer for work on ``stream``: the yielded view is valid inside the block."""
        handle = _stream(stream, "lend")
        self._live()
        if not self._device_accessible:
            raise UnsupportedError(f"this {type(self).__name__} is not accessible from the device")
        view = LentView(self, handle)
        try:
            yield view
        finally:
            view._buffer = None

    # -- DLPack: host memory, so a CPU tensor -------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCPU, 0)``: under the simulator the memory is host memory."""
        self._live()
        return (1, 0)

    def __dlpack__(self, **kwargs: Any) -> Any:
        """A DLPack capsule over the host memory (numpy's export); it keeps the memory alive."""
        if kwargs.get("copy"):
            raise BufferError("__dlpack__: umem_numba exports its memory without copying (copy=True refused)")
        kwargs.pop("copy", None)
        kwargs.pop("stream", None)
        kwargs.pop("dl_device", None)
        return self._array().__dlpack__(**kwargs)

    def __repr__(self) -> str:
        if self.closed:
            return f"<closed {type(self).__name__}>"
        return (
            f"{type(self).__name__}(shape={self._shape}, dtype={self._dtype}{self._repr_extra()}, "
            f"ptr={self.ptr:#x}{', view' if not self._owner else ''}, simulator)"
        )

    def _repr_extra(self) -> str:
        return ""


class _NoDeviceViewError(UnsupportedError, AttributeError):
    """Also an AttributeError, so ``hasattr(buf, "__cuda_array_interface__")`` is False."""


class LentView(ArgHint):
    """What :meth:`lend` yields under the simulator: the buffer for kernels and numpy, inside the block."""

    def __init__(self, buffer: _SimBuffer, stream: int) -> None:
        self._buffer: _SimBuffer | None = buffer
        self._stream = stream

    def _live(self) -> _SimBuffer:
        buf = self._buffer
        if buf is None:
            raise BufferClosedError("this LentView is used after its `with buf.lend(...)` block ended")
        buf._live()
        return buf

    @property
    def stream(self) -> int:
        """The stream handle the view is lent for."""
        return self._stream

    def to_device(self, retr: list[Any], stream: Any = 0) -> FakeCUDAArray:
        """The simulator's device array over the lent memory."""
        return self._live().to_device(retr, stream)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self._live()._array()
        return arr.astype(dtype) if dtype is not None else (arr.copy() if copy else arr)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCPU, 0)``."""
        return self._live().__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        """A DLPack capsule over the lent host memory."""
        return self._live().__dlpack__(**kwargs)


def _check_staging(staging: Any) -> None:
    if staging is not None and not isinstance(staging, (bool, PinnedBuffer)):
        raise TypeError(f"staging must be None, a bool or a PinnedBuffer, got {type(staging).__name__}")


def _check_same(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{what}: mismatched arrays: {a.shape} {a.dtype} vs {b.shape} {b.dtype}")


def _as_source(obj: Any) -> np.ndarray:
    """The elements of a copy's source: a buffer, a simulator device array or anything numpy reads."""
    if isinstance(obj, _SimBuffer):
        return obj._array()
    if isinstance(obj, FakeCUDAArray):
        return np.asarray(obj._ary)
    return np.asarray(obj)


def _as_operand(obj: Any, what: str, side: str) -> np.ndarray:
    """An operand of :func:`copy`: a buffer or a simulator device array (numpy arrays are refused, as on the GPU)."""
    if isinstance(obj, _SimBuffer):
        arr = obj._array()
    elif isinstance(obj, FakeCUDAArray):
        arr = obj._ary
    else:
        raise TypeError(
            f"{what}: the {side} must be a numba device array or a umem_numba buffer, got {type(obj).__name__} "
            "(numpy arrays go through copy_to_host / copy_from_host)"
        )
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: the {side} is not C-contiguous")  # as on the GPU
    return arr


def copy(dst: Any, src: Any, stream: StreamLike = None) -> None:
    """Copy ``src`` into ``dst`` (buffers of any kind, or the simulator's device arrays); done on return.

    Raises
    ------
    TypeError
        An operand is neither a buffer nor a device array.
    ValueError
        Shapes or dtypes differ, an operand is not C-contiguous, or they overlap.
    BufferClosedError
        An operand buffer is closed.
    """
    d = _as_operand(dst, "copy", "destination")
    s = _as_operand(src, "copy", "source")
    if d.shape != s.shape or d.dtype != s.dtype:
        raise ValueError(f"copy: mismatched arrays: {s.shape} {s.dtype} vs {d.shape} {d.dtype} (source vs destination)")
    _stream(stream, "copy")
    if s.size and np.shares_memory(d, s):
        raise ValueError("copy: source and destination overlap in memory")
    np.copyto(d, s)


# ---------------------------------------------------------------------------
# Managed memory


def _check_attach(attach: Any) -> str:
    if not isinstance(attach, str) or attach not in ("global", "host"):
        raise ValueError(f"attach must be 'global' or 'host', got {attach!r}")
    return attach


def _no_pool(pool: Any, what: str) -> None:
    if pool is not None:
        raise _unsupported(f"{what}(pool=...): a MemoryPool")


class ManagedBuffer(_SimBuffer):
    """An n-d array in managed memory, here host memory that the simulator's kernels use.

    The same API as on a GPU (see the GPU class's documentation); advice and
    prefetch are accepted and do nothing, and host access never waits.
    """

    _constructors = ("ManagedBuffer.empty", "ManagedBuffer.zeros", "ManagedBuffer.from_array")

    @classmethod
    def empty(
        cls,
        shape: Any,
        dtype: Any = np.float32,
        *,
        attach: str = "global",
        pool: Any = None,
        stream: StreamLike = None,
        prefetch: Target | None = None,
        order: str = "C",
    ) -> ManagedBuffer:
        """Allocate (zeroed host memory under the simulator); ``prefetch`` is checked, nothing migrates."""
        order = _layout.check_order(order, "ManagedBuffer.empty")
        shp, dt, nbytes = _new_layout(shape, dtype)
        attach = _check_attach(attach)
        _no_pool(pool, "ManagedBuffer.empty")
        _stream(stream, "ManagedBuffer.empty")
        if prefetch is not None:
            _location(prefetch, "ManagedBuffer.empty(prefetch=...)")
        alloc = _Allocation("managed", nbytes)
        if attach == "host":
            alloc.attached = "host"
        return cls._new(alloc, shp, dt, order)

    @classmethod
    def zeros(
        cls,
        shape: Any,
        dtype: Any = np.float32,
        *,
        attach: str = "global",
        stream: StreamLike = 0,
        pool: Any = None,
        prefetch: Target | None = None,
        order: str = "C",
    ) -> ManagedBuffer:
        """Allocate and zero."""
        _stream(stream, "ManagedBuffer.zeros")
        return cls.empty(shape, dtype, attach=attach, pool=pool, prefetch=prefetch, order=order)

    @classmethod
    def from_array(
        cls,
        array: Any,
        *,
        attach: str = "global",
        pool: Any = None,
        stream: StreamLike = None,
        prefetch: Target | None = None,
        order: str = "K",
    ) -> ManagedBuffer:
        """A new buffer holding a copy of ``array`` (``order="K"`` keeps an F-ordered source's order)."""
        src = np.asarray(array)
        order = source_order(src, order, "ManagedBuffer.from_array")
        buf = cls.empty(src.shape, src.dtype, attach=attach, pool=pool, stream=stream, prefetch=prefetch, order=order)
        if buf.size:
            np.copyto(buf._array(), src)
        return buf

    def _repr_extra(self) -> str:
        return f", attached_to={self.attached_to!r}"

    @property
    def hints(self) -> ManagedMemoryHints:
        """Advice for the whole buffer: accepted and checked; the read-back says nothing migrates."""
        return ManagedMemoryHints(self)

    def apply_policy(self, policy: MigrationPolicy) -> None:
        """Check ``policy`` as on a GPU (nothing migrates under the simulator)."""
        self.hints.apply_policy(policy)

    def prefetch(self, target: Target, stream: StreamLike = None) -> None:
        """Check the target and stream; nothing migrates under the simulator."""
        _prefetch(self, target, stream, None, None, "prefetch")

    def prefetch_range(self, start: int, stop: int, target: Target, stream: StreamLike = None) -> None:
        """Check the range, target and stream; nothing migrates under the simulator."""
        _prefetch(self, target, stream, start, stop, "prefetch_range")

    def discard(self, stream: StreamLike = None) -> None:
        """Needs a real GPU (``cuMemDiscardBatchAsync``): UnsupportedError under the simulator."""
        raise _unsupported("ManagedBuffer.discard (cuMemDiscardBatchAsync)")

    def discard_range(self, start: int, stop: int, stream: StreamLike = None) -> None:
        """Needs a real GPU: UnsupportedError under the simulator."""
        raise _unsupported("ManagedBuffer.discard_range (cuMemDiscardBatchAsync)")

    def discard_prefetch(self, target: Target, stream: StreamLike = None) -> None:
        """Needs a real GPU (``cuMemDiscardAndPrefetchBatchAsync``): UnsupportedError under the simulator."""
        raise _unsupported("ManagedBuffer.discard_prefetch (cuMemDiscardAndPrefetchBatchAsync)")

    def discard_prefetch_range(self, start: int, stop: int, target: Target, stream: StreamLike = None) -> None:
        """Needs a real GPU: UnsupportedError under the simulator."""
        raise _unsupported("ManagedBuffer.discard_prefetch_range (cuMemDiscardAndPrefetchBatchAsync)")

    @contextlib.contextmanager
    def on_host(self) -> Iterator[np.ndarray]:
        """Hold the buffer for host use: a launch using it inside the block raises CoherenceError."""
        alloc = self._live()
        alloc.hold += 1
        try:
            yield self._host_array("host hold")
        finally:
            alloc.hold -= 1

    def attach(self, to: Any = "global", *, stream: StreamLike = None) -> None:
        """Record the attachment (``"global"``, ``"host"`` or a stream); it changes nothing under the simulator."""
        alloc = self._live()
        if isinstance(to, str):
            if to not in ("global", "host"):
                raise ValueError(f"attach target must be a stream, 'host' or 'global', got {to!r}")
            _stream(stream, "attach")
            alloc.attached = None if to == "global" else "host"
            return
        target = _stream(to, "attach")
        if target == 0 and not isinstance(to, _SimStream):
            raise ValueError(
                "cannot attach to the legacy default stream (handle 0): pass a created stream, 'host' or 'global'"
            )
        _stream(stream, "attach")
        alloc.attached = target

    @property
    def attached_to(self) -> str | int:
        """Current attachment: ``"global"``, ``"host"`` or the stream handle."""
        target = self._live().attached
        return "global" if target is None else target


def managed_empty(shape: Any, dtype: Any = np.float32, *, attach: str = "global", order: str = "C") -> ManagedBuffer:
    """Shortcut for :meth:`ManagedBuffer.empty`."""
    return ManagedBuffer.empty(shape, dtype, attach=attach, order=order)


def managed_zeros(
    shape: Any, dtype: Any = np.float32, *, attach: str = "global", stream: StreamLike = 0, order: str = "C"
) -> ManagedBuffer:
    """Shortcut for :meth:`ManagedBuffer.zeros`."""
    return ManagedBuffer.zeros(shape, dtype, attach=attach, stream=stream, order=order)


def managed_like(array: Any, *, attach: str = "global", order: str = "K") -> ManagedBuffer:
    """An uninitialised buffer with ``array``'s shape and dtype (``order="K"`` keeps an F array's order)."""
    shape = getattr(array, "shape", None)
    dtype = getattr(array, "dtype", None)
    strides = getattr(array, "strides", None)
    if shape is None or dtype is None:
        arr = np.asarray(array)
        shape, dtype, strides = arr.shape, arr.dtype, arr.strides
    order = _layout.check_order(order, "managed_like", allow_keep=True)
    if order == "K":
        itemsize = np.dtype(dtype).itemsize
        f_only = strides is not None and _layout.dense_order(tuple(shape), tuple(strides), itemsize) == "F"
        order = "F" if f_only else "C"
    return ManagedBuffer.empty(shape, dtype, attach=attach, order=order)


def managed_from(array: Any, *, attach: str = "global", order: str = "K") -> ManagedBuffer:
    """Shortcut for :meth:`ManagedBuffer.from_array`."""
    return ManagedBuffer.from_array(array, attach=attach, order=order)


def _new_layout(shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype, int]:
    dt = _layout.normalize_dtype(dtype)
    shp = _layout.normalize_shape(shape)
    return shp, dt, _layout.checked_nbytes(shp, dt)


# ---------------------------------------------------------------------------
# Advice and prefetch: checked, then nothing happens


def _managed_elements(obj: Any, what: str) -> int:
    """Elements of a managed buffer that advice and prefetch accept (checks as on the GPU)."""
    if not isinstance(obj, _SimBuffer):
        raise TypeError(f"{what}: expected a ManagedBuffer (or a view of one), got {type(obj).__name__}")
    if obj.closed:
        raise BufferClosedError(f"{what}: this {type(obj).__name__} is closed")
    if not isinstance(obj, ManagedBuffer):
        raise UnsupportedError(
            f"{what}: {type(obj).__name__} memory is {obj._kind} memory, not managed "
            "memory; advice and prefetch need a ManagedBuffer"
        )
    if not obj.is_c_contiguous:
        raise ValueError(f"{what}: advice and prefetch need a C-contiguous buffer; this view is strided")
    return obj.size


def _prefetch(obj: Any, target: Target, stream: StreamLike, start: Any, stop: Any, what: str) -> None:
    lo, hi = check_range(start, stop, _managed_elements(obj, what), what)
    _location(target, what)
    _stream(stream, what)
    del lo, hi


class SimHintState(HintState):
    """:class:`~umem_numba.HintState` as the simulator reports it: no advice, no prefetch, nothing migrates."""

    __slots__ = ()

    #: Always True: the state comes from numba's simulator, not a driver.
    simulated: ClassVar[bool] = True
    #: Says what the read-back means here.
    note: ClassVar[str] = NOTE

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in zip(self._fields, self, strict=True))
        return f"HintState({fields}; simulated: nothing migrates)"


_NOTHING = SimHintState(False, None, frozenset(), None)


class ManagedMemoryHints:
    """Advice for a managed buffer or a range of it, under numba's CUDA simulator.

    Advice and policies are checked as on a GPU (types, targets, ranges) and
    then have no effect: the simulator has no driver and nothing migrates.
    The read-back properties report the state in effect, which is none:
    ``read_mostly`` False, no preferred location, no accessed-by, no prefetch
    location; :meth:`state` returns a :class:`HintState` whose ``note`` says so.

    Parameters
    ----------
    obj : ManagedBuffer
    start, stop : int, optional
        Element range ``[start, stop)``; the whole buffer by default.
    """

    __slots__ = ("_obj", "_start", "_stop")

    #: Always True: these hints belong to numba's simulator.
    simulated = True

    def __init__(self, obj: Any, start: int | None = None, stop: int | None = None) -> None:
        size = _managed_elements(obj, "ManagedMemoryHints")
        self._obj = obj
        self._start, self._stop = check_range(start, stop, size, "ManagedMemoryHints")

    def _check(self, what: str) -> None:
        _managed_elements(self._obj, what)

    @property
    def start(self) -> int:
        """First element of the range."""
        return self._start

    @property
    def stop(self) -> int:
        """One past the last element of the range."""
        return self._stop

    def range(self, start: int, stop: int) -> ManagedMemoryHints:
        """Hints for elements ``[start, stop)`` of this range."""
        lo, hi = check_range(start, stop, self._stop - self._start, "ManagedMemoryHints.range")
        return ManagedMemoryHints(self._obj, self._start + lo, self._start + hi)

    @property
    def read_mostly(self) -> bool:
        """False: no advice is in effect under the simulator."""
        self._check("read_mostly")
        return False

    @property
    def preferred_location(self) -> Location | None:
        """None: no advice is in effect under the simulator."""
        self._check("preferred_location")
        return None

    @property
    def accessed_by(self) -> frozenset[Location]:
        """Empty: no advice is in effect under the simulator."""
        self._check("accessed_by")
        return frozenset()

    @property
    def last_prefetch_location(self) -> Location | None:
        """None: nothing migrates under the simulator."""
        self._check("last_prefetch_location")
        return None

    def state(self) -> HintState:
        """All four hints at once: nothing in effect; ``.note`` says it is the simulator."""
        self._check("state")
        return _NOTHING

    def advise(self, advice: MemAdvice, target: Target | None = None) -> None:
        """Check one piece of advice as on a GPU; it has no effect under the simulator."""
        if not isinstance(advice, MemAdvice):
            raise TypeError(f"advice must be a MemAdvice, got {type(advice).__name__} {advice!r}")
        what = f"{advice.name}"
        if advice.takes_location:
            if target is None:
                raise ValueError(f"{what} needs a target: a device, an ordinal or 'cpu'")
            _location(target, what)
        elif target is not None:
            raise ValueError(f"{what} takes no target (the driver ignores it); got {target!r}")
        self._check(what)

    # The named forms are the GPU class's: each is one call of advise() or apply_policy() above.
    set_read_mostly = _DeviceHints.set_read_mostly
    unset_read_mostly = _DeviceHints.unset_read_mostly
    set_preferred_location = _DeviceHints.set_preferred_location
    unset_preferred_location = _DeviceHints.unset_preferred_location
    set_accessed_by = _DeviceHints.set_accessed_by
    unset_accessed_by = _DeviceHints.unset_accessed_by
    clear = _DeviceHints.clear

    def apply_policy(self, policy: MigrationPolicy) -> None:
        """Check ``policy`` (its device must exist); no effect under the simulator."""
        if not isinstance(policy, MigrationPolicy):
            raise TypeError(f"policy must be a MigrationPolicy, got {type(policy).__name__} {policy!r}")
        what = f"apply_policy({policy!r})"
        self._check(what)
        for _advice, loc in policy.advice_for(0):
            if loc is not None:
                _location(loc, what)

    def prefetch(self, target: Target, stream: StreamLike = None) -> None:
        """Check the target and stream; nothing migrates under the simulator."""
        _prefetch(self._obj, target, stream, self._start, self._stop, "prefetch")

    def __repr__(self) -> str:
        return (
            f"ManagedMemoryHints({type(self._obj).__name__}, elements [{self._start}, {self._stop}), "
            "simulated: nothing migrates)"
        )


class _Entry(NamedTuple):
    obj: Any
    start: int
    stop: int
    target: Location


class PrefetchPlan:
    """A list of prefetches, checked as on a GPU; executing it moves nothing under the simulator."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    def add(self, obj: Any, target: Target, *, discard: bool = False) -> PrefetchPlan:
        """Add all of ``obj`` to go to ``target`` (checked now; the plan is unchanged on error)."""
        if discard:
            raise _unsupported("PrefetchPlan.add(discard=True) (cuMemDiscardAndPrefetchBatchAsync)")
        return self._add(obj, None, None, target, "PrefetchPlan.add")

    def add_range(self, obj: Any, start: int, stop: int, target: Target, *, discard: bool = False) -> PrefetchPlan:
        """Add elements ``[start, stop)`` of ``obj`` to go to ``target``."""
        if discard:
            raise _unsupported("PrefetchPlan.add_range(discard=True) (cuMemDiscardAndPrefetchBatchAsync)")
        return self._add(obj, start, stop, target, "PrefetchPlan.add_range")

    def add_discard(self, obj: Any) -> PrefetchPlan:
        """Needs a real GPU (``cuMemDiscardBatchAsync``): UnsupportedError under the simulator."""
        raise _unsupported("PrefetchPlan.add_discard (cuMemDiscardBatchAsync)")

    def add_discard_range(self, obj: Any, start: int, stop: int) -> PrefetchPlan:
        """Needs a real GPU (``cuMemDiscardBatchAsync``): UnsupportedError under the simulator."""
        raise _unsupported("PrefetchPlan.add_discard_range (cuMemDiscardBatchAsync)")

    def _add(self, obj: Any, start: Any, stop: Any, target: Target, name: str) -> PrefetchPlan:
        what = f"{name} (entry {len(self._entries)})"
        lo, hi = check_range(start, stop, _managed_elements(obj, what), what)
        loc = _location(target, what)
        self._entries.append(_Entry(obj, lo, hi, loc))
        return self

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> tuple[tuple[Any, int, int, Location], ...]:
        """``(array, start, stop, target)`` of every entry, in order."""
        return tuple((e.obj, e.start, e.stop, e.target) for e in self._entries)

    def clear(self) -> None:
        """Remove every entry."""
        self._entries.clear()

    def execute(self, stream: StreamLike = None) -> None:
        """Check every entry (a buffer closed since it was added raises); nothing migrates."""
        _stream(stream, "PrefetchPlan.execute")
        for i, e in enumerate(self._entries):
            what = f"PrefetchPlan.execute: entry {i} (elements [{e.start}, {e.stop}) to {e.target})"
            _managed_elements(e.obj, what)

    def __repr__(self) -> str:
        n = len(self._entries)
        return f"PrefetchPlan({n} entr{'y' if n == 1 else 'ies'}, simulated)"


# ---------------------------------------------------------------------------
# Pinned, device and VMM memory


class PinnedBuffer(_SimBuffer):
    """An n-d array in "page-locked" host memory (plain host memory under the simulator).

    Kernels may use it when it has :attr:`HostAllocFlags.DEVICEMAP`, as on a GPU.
    """

    _kind = "pinned"
    _constructors = ("PinnedBuffer.empty", "PinnedBuffer.zeros", "PinnedBuffer.from_array")

    def _copy_extra(self, view: Any) -> None:
        view._flags = self._flags
        view._device_accessible = self._device_accessible

    @classmethod
    def empty(
        cls,
        shape: Any,
        dtype: Any = np.float32,
        flags: HostAllocFlags = HostAllocFlags.DEFAULT,
        *,
        order: str = "C",
        pool: Any = None,
        stream: StreamLike = None,
    ) -> PinnedBuffer:
        """Allocate (zeroed host memory under the simulator; pinned pools need a GPU)."""
        _no_pool(pool, "PinnedBuffer.empty")
        if stream is not None:
            raise ValueError("PinnedBuffer.empty: stream= is the allocation stream of pool memory; pass pool= too")
        order = _layout.check_order(order, "PinnedBuffer.empty")
        shp, dt, nbytes = _new_layout(shape, dtype)
        fl = _as_flags(flags)
        buf = cls._new(_Allocation("pinned", nbytes), shp, dt, order)
        buf._flags = fl
        buf._device_accessible = HostAllocFlags.DEVICEMAP in fl
        return buf

    @classmethod
    def zeros(
        cls,
        shape: Any,
        dtype: Any = np.float32,
        flags: HostAllocFlags = HostAllocFlags.DEFAULT,
        *,
        order: str = "C",
        pool: Any = None,
        stream: StreamLike = None,
    ) -> PinnedBuffer:
        """Allocate and zero."""
        return cls.empty(shape, dtype, flags, order=order, pool=pool, stream=stream)

    @classmethod
    def from_array(
        cls,
        array: Any,
        flags: HostAllocFlags = HostAllocFlags.DEFAULT,
        *,
        order: str = "K",
        pool: Any = None,
        stream: StreamLike = None,
    ) -> PinnedBuffer:
        """A copy of ``array``."""
        _no_pool(pool, "PinnedBuffer.from_array")
        src = np.asarray(array)
        buf = cls.empty(
            src.shape,
            src.dtype,
            flags,
            order=source_order(src, order, "PinnedBuffer.from_array"),
            pool=pool,
            stream=stream,
        )
        if buf.size:
            np.copyto(buf._array(), src)
        return buf

    @property
    def flags(self) -> HostAllocFlags:
        """The flags the memory was allocated with."""
        return self._flags

    @property
    def driver_flags(self) -> HostAllocFlags:
        """The flags given (there is no driver to ask under the simulator)."""
        self._live()
        return self._flags

    def _repr_extra(self) -> str:
        return f", flags={self._flags!r}"

    def copy_to_device(self, dst: Any, stream: StreamLike = 0) -> None:
        """Copy this buffer into ``dst`` (a simulator device array or a buffer)."""
        copy(dst, self, stream)

    def copy_from_device(self, src: Any, stream: StreamLike = 0) -> None:
        """Copy ``src`` (a simulator device array or a buffer) into this buffer."""
        copy(self, src, stream)


class DeviceBuffer(_SimBuffer):
    """An n-d array in "device" memory: host memory the host may not read directly, as on a GPU."""

    _host_accessible = False
    _kind = "device"
    _constructors = ("DeviceBuffer.empty", "DeviceBuffer.zeros", "DeviceBuffer.from_array")

    @classmethod
    def empty(
        cls, shape: Any, dtype: Any = np.float32, *, pool: Any = None, stream: StreamLike = None, order: str = "C"
    ) -> DeviceBuffer:
        """Allocate (zeroed host memory under the simulator; memory pools need a GPU)."""
        order = _layout.check_order(order, "DeviceBuffer.empty")
        shp, dt, nbytes = _new_layout(shape, dtype)
        _no_pool(pool, "DeviceBuffer.empty")
        _stream(stream, "DeviceBuffer.empty")
        return cls._new(_Allocation("device", nbytes), shp, dt, order)

    @classmethod
    def zeros(
        cls, shape: Any, dtype: Any = np.float32, *, pool: Any = None, stream: StreamLike = None, order: str = "C"
    ) -> DeviceBuffer:
        """Allocate and zero."""
        return cls.empty(shape, dtype, pool=pool, stream=stream, order=order)

    @classmethod
    def from_array(cls, array: Any, *, pool: Any = None, stream: StreamLike = None, order: str = "K") -> DeviceBuffer:
        """A new buffer holding a copy of ``array``."""
        src = np.asarray(array)
        if src.dtype.hasobject:
            raise TypeError("DeviceBuffer.from_array: object arrays cannot live in device memory")
        order = source_order(src, order, "DeviceBuffer.from_array")
        buf = cls.empty(src.shape, src.dtype, pool=pool, stream=stream, order=order)
        buf.copy_from_host(src)
        return buf


def _vmm_c_only(order: Any, what: str) -> None:
    """F-ordered VMM buffers need a real GPU (the simulator's VMM buffer is C-ordered only)."""
    if _layout.check_order(order, what) != "C":
        raise _unsupported(f"{what}(order='F')")


def _row_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    n = dtype.itemsize
    for d in shape[1:]:
        n *= d
    return n


class VMMBuffer(_SimBuffer):
    """A "device" array that grows and shrinks in place, in host address space reserved for its capacity.

    The same API and checks as on a GPU: the address and contents stay when it
    grows; chunks, granularity (2 MiB) and access grants are book-kept;
    exporting memory to another process needs a GPU.
    """

    _host_accessible = False
    _kind = "vmm"
    _constructors = ("VMMBuffer.empty", "VMMBuffer.zeros", "VMMBuffer.from_array", "VMMBuffer.from_shareable_handle")

    def _copy_extra(self, view: Any) -> None:
        alloc = self._live()
        view._capacity = self._capacity
        view._chunk_bytes = self._chunk_bytes
        view._exportable = self._exportable
        view._epoch = len(alloc.shrinks)
        _, hi = _layout.extent(view._shape, view._strides, view._dtype.itemsize)
        view._end = view._offset + hi

    @classmethod
    def empty(
        cls,
        shape: Any,
        dtype: Any = np.float32,
        *,
        device: Target = None,
        capacity: int | None = None,
        exportable: bool = False,
        chunk_bytes: int | None = None,
        order: str = "C",
    ) -> VMMBuffer:
        """Reserve host address space for ``capacity`` rows and "map" ``shape``."""
        _vmm_c_only(order, "VMMBuffer.empty")
        shp, dt, nbytes = _new_layout(shape, dtype)
        if not shp:
            raise ValueError("a VMMBuffer needs at least one dimension (it grows along axis 0); got shape ()")
        row = _row_bytes(shp, dt)
        cap: int | None = None
        if capacity is not None:
            cap = check_nonnegative(capacity, "capacity")
            if cap < shp[0]:
                raise ValueError(f"capacity {cap} is smaller than the initial length {shp[0]}")
            if cap * row > _layout.MAX_NBYTES:
                raise ValueError(f"capacity {cap} x {row} bytes per row is more address space than any device has")
        chunk = None if chunk_bytes is None else check_size(chunk_bytes, "chunk_bytes")
        _location(device, "VMMBuffer.empty", allow_host=False)
        if chunk is not None and chunk % GRANULARITY:
            raise ValueError(
                f"chunk_bytes ({chunk}) must be a multiple of the allocation granularity ({GRANULARITY} bytes)"
            )
        if cap is None:
            cap = max(shp[0], DEVICE_BYTES // row) if row else max(shp[0], 1)
        alloc = _Allocation("vmm", 0, reserve=round_up(cap * row, GRANULARITY))
        alloc.grants[0] = AccessFlags.READ_WRITE
        buf = cls._new(alloc, shp, dt)
        buf._capacity = cap
        buf._chunk_bytes = chunk
        buf._exportable = bool(exportable)
        buf._epoch = 0
        buf._end = -1
        if nbytes:
            buf._map_more(alloc, round_up(nbytes, GRANULARITY))
        return buf

    @classmethod
    def zeros(
        cls,
        shape: Any,
        dtype: Any = np.float32,
        *,
        device: Target = None,
        capacity: int | None = None,
        exportable: bool = False,
        chunk_bytes: int | None = None,
        stream: StreamLike = 0,
        order: str = "C",
    ) -> VMMBuffer:
        """Like :meth:`empty`, then zero every byte."""
        _vmm_c_only(order, "VMMBuffer.zeros")
        _stream(stream, "VMMBuffer.zeros")
        buf = cls.empty(shape, dtype, device=device, capacity=capacity, exportable=exportable, chunk_bytes=chunk_bytes)
        if buf.size:
            buf._array()[...] = 0
        return buf

    @classmethod
    def from_array(
        cls,
        array: Any,
        *,
        device: Target = None,
        capacity: int | None = None,
        exportable: bool = False,
        chunk_bytes: int | None = None,
        order: str = "K",
    ) -> VMMBuffer:
        """A new buffer holding a copy of ``array`` (at least 1-d)."""
        src = np.asarray(array)
        _vmm_c_only(source_order(src, order, "VMMBuffer.from_array"), "VMMBuffer.from_array")
        buf = cls.empty(
            src.shape, src.dtype, device=device, capacity=capacity, exportable=exportable, chunk_bytes=chunk_bytes
        )
        buf.copy_from_host(src)
        return buf

    @classmethod
    def from_shareable_handle(
        cls, handle: Any, shape: Any, dtype: Any = np.float32, *, device: Target = None, access: Any = None
    ) -> Any:
        """Needs a real GPU (raises :class:`~umem_numba.UnsupportedError`)."""
        raise _unsupported("VMMBuffer.from_shareable_handle (memory shared between processes)")

    # -- lifetime: views past a shrink are retired --------------------------------------
    def _live(self) -> _Allocation:
        alloc = super()._live()
        if not self._owner:
            later = alloc.shrinks[self._epoch :]
            if later and self._end > min(later):
                raise BufferClosedError(
                    f"this view of a VMMBuffer (bytes up to {self._end}) lies beyond a shrink of the buffer "
                    f"to {min(later)} bytes: its memory was released, so the view can no longer be used"
                )
        return alloc

    def _owner_alloc(self, what: str) -> _Allocation:
        alloc = self._live()
        if not self._owner:
            raise ValueError(f"{what}() changes the length of the owning buffer; this is a view of it")
        return alloc

    def _map_more(self, alloc: _Allocation, nbytes: int) -> None:
        step = self._chunk_bytes or nbytes
        while nbytes > 0:
            n = min(step, nbytes)
            alloc.chunks.append(n)
            nbytes -= n
            _stats.record_resize("vmm", n)

    # -- size ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Largest first-axis length the buffer can grow to."""
        return self._capacity

    @property
    def mapped_nbytes(self) -> int:
        """Bytes "mapped" now (the length rounded up to whole chunks)."""
        return sum(self._live().chunks)

    @property
    def reserved_nbytes(self) -> int:
        """Bytes of address space reserved for the capacity."""
        raw = self._live().raw
        return 0 if raw is None else int(raw.size)

    @property
    def granularity(self) -> int:
        """The simulated allocation granularity (2 MiB)."""
        self._live()
        return GRANULARITY

    @property
    def chunk_count(self) -> int:
        """Number of chunks "mapped" now."""
        return len(self._live().chunks)

    @property
    def chunk_bytes(self) -> int | None:
        """Largest chunk size new memory comes in (``None``: one chunk per growth step)."""
        self._live()
        return self._chunk_bytes

    @property
    def exportable(self) -> bool:
        """Whether it was created exportable (exporting still needs a GPU)."""
        self._live()
        return self._exportable

    def grow(self, new_length: int) -> None:
        """Grow the first axis to ``new_length`` in place (the address and contents stay)."""
        alloc = self._owner_alloc("grow")
        n = check_nonnegative(new_length, "new length")
        if n < self._shape[0]:
            raise ValueError(f"grow({n}) is smaller than the current length {self._shape[0]}; use shrink()")
        if n > self._capacity:
            raise ValueError(
                f"cannot grow to {n}: the capacity is {self._capacity} (set capacity= when creating the buffer)"
            )
        need = round_up(n * _row_bytes(self._shape, self._dtype), GRANULARITY)
        mapped = sum(alloc.chunks)
        if need > mapped:
            self._map_more(alloc, need - mapped)
        self._set_length(n)

    def shrink(self, new_length: int) -> None:
        """Shrink the first axis to ``new_length``; views reaching past it become unusable."""
        alloc = self._owner_alloc("shrink")
        n = check_nonnegative(new_length, "new length")
        if n > self._shape[0]:
            raise ValueError(f"shrink({n}) is larger than the current length {self._shape[0]}; use grow()")
        if n == self._shape[0]:
            return
        new_nbytes = n * _row_bytes(self._shape, self._dtype)
        keep = round_up(new_nbytes, GRANULARITY)
        offset = 0
        kept: list[int] = []
        for size in alloc.chunks:
            if offset >= keep:
                _stats.record_resize("vmm", -size)
            else:
                kept.append(size)
            offset += size
        alloc.chunks[:] = kept
        alloc.shrinks.append(new_nbytes)
        self._set_length(n)

    def resize(self, new_length: int) -> None:
        """:meth:`grow` or :meth:`shrink` to ``new_length``."""
        self._owner_alloc("resize")
        n = check_nonnegative(new_length, "new length")
        if n >= self._shape[0]:
            self.grow(n)
        else:
            self.shrink(n)

    def _set_length(self, n: int) -> None:
        self._shape = (n, *self._shape[1:])
        self._strides = _layout.c_strides(self._shape, self._dtype.itemsize)

    def set_access(self, device: Target, flags: AccessFlags) -> None:
        """Record what ``device`` may do (checked as on a GPU; the simulator does not enforce it)."""
        alloc = self._live()
        fl = as_access(flags)
        target = _location(device, "VMMBuffer.set_access", allow_host=False).id
        if not self._owner:
            lo, hi = _layout.extent(self._shape, self._strides, self._dtype.itemsize)
            if hi <= lo:
                raise ValueError("set_access() on an empty view: it covers no memory")
        alloc.grants[target] = fl

    def get_access(self, device: Target) -> AccessFlags:
        """The access recorded for ``device`` (READ_WRITE for the buffer's device unless changed)."""
        alloc = self._live()
        target = _location(device, "VMMBuffer.get_access", allow_host=False).id
        if self.size == 0:
            raise ValueError("get_access() needs a non-empty buffer: nothing is mapped at an empty view")
        return alloc.grants.get(target, AccessFlags.NONE)

    def export_fds(self) -> list[tuple[int, int]]:
        """Needs a real GPU (raises :class:`~umem_numba.UnsupportedError`)."""
        self._owner_alloc("export_fds")
        raise _unsupported("VMMBuffer.export_fds (sharing memory with another process)")

    def export_fd(self) -> int:
        """Needs a real GPU (raises :class:`~umem_numba.UnsupportedError`)."""
        self._owner_alloc("export_fd")
        raise _unsupported("VMMBuffer.export_fd (sharing memory with another process)")

    def _repr_extra(self) -> str:
        alloc = self._alloc
        mapped = sum(alloc.chunks) if alloc is not None else 0
        return f", mapped={mapped}, capacity={self._capacity}"


def allocation_granularity(device: Target = None, recommended: bool = False, *, exportable: bool = False) -> int:
    """The simulated VMM granularity, 2 MiB (the device is checked)."""
    _location(device, "allocation_granularity", allow_host=False)
    return GRANULARITY


class _NeedsGpu:
    """A driver-level object: under numba's CUDA simulator every way to make one raises UnsupportedError."""

    _what: ClassVar[str] = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _unsupported(self._what)

    @classmethod
    def _refuse(cls, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported(cls._what)


class MemoryPool(_NeedsGpu):
    """A stream-ordered memory pool: needs a real GPU (UnsupportedError under the simulator)."""

    _what = "MemoryPool (a stream-ordered driver pool)"

    @classmethod
    def default(cls, *args: Any, **kwargs: Any) -> Any:
        """Needs a real GPU (raises :class:`~umem_numba.UnsupportedError`)."""
        raise _unsupported("MemoryPool.default (the driver's pool other libraries share)")


class AddressRange(_NeedsGpu):
    """Reserved device address space: needs a real GPU (use VMMBuffer under the simulator)."""

    _what = "AddressRange (VMM building blocks; VMMBuffer works)"
    reserve = _NeedsGpu._refuse


class PhysicalMemory(_NeedsGpu):
    """Physical device memory: needs a real GPU (use VMMBuffer under the simulator)."""

    _what = "PhysicalMemory (VMM building blocks; VMMBuffer works)"
    create = _NeedsGpu._refuse
    from_shareable_handle = _NeedsGpu._refuse


class Mapping(_NeedsGpu):
    """A VMM mapping: needs a real GPU (use VMMBuffer under the simulator)."""

    _what = "Mapping (VMM building blocks; VMMBuffer works)"


# ---------------------------------------------------------------------------
# Launches: the GPU code; only the simulator's stream objects need translating


class CoherentKernel(_launch.CoherentKernel):
    """A numba kernel launched like on a GPU (see the GPU class); the simulator's streams are accepted."""

    __slots__ = ()

    def __getitem__(self, config: Any) -> Any:
        if isinstance(config, tuple) and len(config) > 2 and isinstance(config[2], _SimStream):
            config = (config[0], config[1], 0, *config[3:])
        return super().__getitem__(config)


def coherent(kernel: Any, *, readonly: Iterable[str] | None = None) -> CoherentKernel:
    """Wrap a numba kernel (see :func:`umem_numba.coherent`); under the simulator coherence holds trivially."""
    if isinstance(kernel, CoherentKernel) and readonly is None:
        return kernel
    if isinstance(kernel, _launch.CoherentKernel):
        kernel = kernel.kernel
    wrapped = getattr(kernel, "_umem_coherent", None)
    if isinstance(wrapped, CoherentKernel) and readonly is None:
        return wrapped
    out = CoherentKernel(kernel, readonly)
    if readonly is None:
        with contextlib.suppress(AttributeError):
            kernel._umem_coherent = out
    return out


def launch(kernel: Any, griddim: Any, blockdim: Any, *args: Any, stream: Any = 0, sharedmem: int = 0) -> None:
    """Launch a kernel (see :func:`umem_numba.launch`); the simulator has run it when this returns."""
    coherent(kernel)[griddim, blockdim, stream, sharedmem](*args)


def jit(func_or_sig: Any = None, *, readonly: Iterable[str] | None = None, **options: Any) -> Any:
    """``numba.cuda.jit`` (the simulator's) whose kernels are :func:`coherent` (see :func:`umem_numba.jit`)."""

    def wrap(obj: Any) -> Any:
        return obj if options.get("device") else coherent(obj, readonly=readonly)

    if func_or_sig is None:
        return lambda f: wrap(_nbcuda.jit(**options)(f))
    if callable(func_or_sig) and not isinstance(func_or_sig, (str, list, tuple)):
        return wrap(_nbcuda.jit(func_or_sig, **options))
    inner = _nbcuda.jit(func_or_sig, **options)
    return lambda f: wrap(inner(f))


def public() -> dict[str, Any]:
    """The names :mod:`umem_numba` takes from here under the simulator."""
    g = globals()
    return {name: g[name] for name in __all__}
