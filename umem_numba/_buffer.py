"""Array behaviour shared by every umem_numba buffer.

An :class:`~umem_numba._lifetime.Allocation` owns the memory and frees it
exactly once (see :mod:`umem_numba._lifetime`).  A buffer is a typed,
strided window (shape, strides, byte offset) onto an allocation; slicing
makes another window onto the same allocation.

Close semantics
---------------
* ``owner.close()`` releases the memory now (after waiting for device work
  that may still use it, per the coherence policy); every view of it then
  raises :class:`~umem_numba.BufferClosedError` on use.
* ``view.close()`` only drops that view's reference.
* A numpy array obtained from ``.host`` keeps the memory mapped: if the owner is
  closed while such an array is alive, the release is deferred until the
  array is collected, so host code can never touch freed memory through it.
* Closing twice is harmless.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any, ClassVar

import numpy as np

from . import _copy, _driver, _events, _layout
from ._errors import BufferClosedError, UnsupportedError
from ._lifetime import Allocation
from ._tracker import Tracker, _launching, check_policy


class _HostExport:
    """Base object of a numpy host view: keeps the allocation mapped while alive."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, alloc: Allocation, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface
        alloc.export_host()
        weakref.finalize(self, alloc.host_export_gone)


class _NotOnDeviceError(UnsupportedError, AttributeError):
    """Also an AttributeError, so ``hasattr(buf, "__cuda_array_interface__")`` is False."""


def _fast_launch_path() -> bool:
    """Whether numba-cuda's launch takes our precomputed device view (see StridedViewShim)."""
    global _FAST
    if _FAST is None:
        try:
            from numba.cuda.cudadrv import devicearray
            _FAST = hasattr(devicearray, "_to_strided_memory_view")
        except Exception:
            _FAST = False
    return _FAST


_FAST: bool | None = None


class Buffer:
    """Typed, strided window onto an :class:`Allocation` (base of every buffer type).

    Not instantiated directly: use :class:`ManagedBuffer`, :class:`PinnedBuffer`
    or :class:`VMMBuffer` constructors.
    """

    __slots__ = (
        "__weakref__",
        "_alloc",
        "_dtype",
        "_nbtype",
        "_offset",
        "_owner",
        "_shape",
        "_shim",
        "_strides",
    )

    #: Whether the host may dereference this kind of memory.
    _host_accessible: ClassVar[bool] = True
    #: Whether kernels may use this buffer (subclasses may decide per instance).
    _device_accessible: bool = True
    #: Whether views can be retired while the allocation lives (VMM shrink): a
    #: launch must then check the view, not only the allocation.
    _views_can_retire: ClassVar[bool] = False
    #: The constructors to name when someone calls the class directly.
    _constructors: ClassVar[tuple[str, ...]] = ("ManagedBuffer.empty", "PinnedBuffer.empty", "VMMBuffer.empty")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        raise TypeError(
            f"{name}() cannot be called directly; use {', '.join(self._constructors)} "
            "(or their zeros / from_array variants)"
        )

    # -- construction -----------------------------------------------------------
    def _init(self, alloc: Allocation, offset: int, shape: tuple[int, ...],
              strides: tuple[int, ...], dtype: np.dtype, owner: bool) -> None:
        self._alloc: Allocation | None = alloc
        self._owner = owner
        self._offset = offset
        self._shape = shape
        self._strides = strides
        self._dtype = dtype
        self._nbtype: Any = None
        self._shim: _layout.StridedViewShim | None = None

    def _view(self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...],
              dtype: np.dtype | None = None) -> Buffer:
        view = object.__new__(type(self))
        view._init(self._live(), offset, shape, strides, self._dtype if dtype is None else dtype, False)
        self._copy_extra(view)
        return view

    def _copy_extra(self, view: Buffer) -> None:
        """Subclasses copy their own per-buffer fields into a new view."""

    # -- lifetime -----------------------------------------------------------------
    def _live(self) -> Allocation:
        alloc = self._alloc
        if alloc is None or alloc.closed:
            raise BufferClosedError(f"this {type(self).__name__} is closed")
        return alloc

    @property
    def closed(self) -> bool:
        """Whether this buffer (or the allocation it views) is closed."""
        return self._alloc is None or self._alloc.closed

    def close(self) -> None:
        """Release the memory (owner) or drop this view's reference (view).

        Device work still using the memory is waited for first (or, under the
        ``"raise"`` coherence policy, :class:`CoherenceError` is raised and the
        buffer stays open).  Closing twice does nothing.
        """
        alloc = self._alloc
        if alloc is None:
            return
        if self._owner:
            alloc.close()
        self._alloc = None
        self._shim = None

    def __enter__(self) -> Buffer:
        self._live()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- array attributes --------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Dimensions, like ``ndarray.shape``."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """Element type."""
        return self._dtype

    @property
    def strides(self) -> tuple[int, ...]:
        """Byte steps per dimension, like ``ndarray.strides``."""
        return self._strides

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self._shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes spanned by the elements (``size * itemsize``)."""
        return self.size * self._dtype.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._dtype.itemsize

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d buffer")
        return self._shape[0]

    @property
    def ptr(self) -> int:
        """Address of the first element (as kernels see it)."""
        alloc = self._live()
        return alloc.device_ptr + self._offset if self.size else 0

    @property
    def is_c_contiguous(self) -> bool:
        """Whether the elements are dense in row-major order."""
        return _layout.is_c_contiguous(self._shape, self._strides, self._dtype.itemsize)

    @property
    def is_view(self) -> bool:
        """False for the buffer that owns the allocation, True for views of it."""
        return not self._owner

    @property
    def device_id(self) -> int:
        """Ordinal of the device whose context owns the memory."""
        return self._live().device_id

    # -- views --------------------------------------------------------------------
    def __getitem__(self, key: Any) -> Buffer:
        """Basic indexing: ints, slices (any step) and ``...``; returns a view."""
        self._live()
        offset, shape, strides = _layout.index_view(self._shape, self._strides, key)
        return self._view(self._offset + offset, shape, strides)

    def view(self, dtype: Any) -> Buffer:
        """Reinterpret a C-contiguous buffer as another dtype of the same itemsize."""
        dt = _layout.normalize_dtype(dtype)
        if dt.itemsize != self._dtype.itemsize:
            raise ValueError(f"view() needs the same itemsize: {self._dtype} has {self._dtype.itemsize}, "
                             f"{dt} has {dt.itemsize}")
        return self._view(self._offset, self._shape, self._strides, dt)

    def reshape(self, *shape: Any) -> Buffer:
        """A view with another shape (C-contiguous buffers only; one ``-1`` allowed)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        dims = list(shape)
        if dims.count(-1) > 1:
            raise ValueError("reshape: only one dimension may be -1")
        if -1 in dims:
            known = 1
            for d in dims:
                if d != -1:
                    known *= d
            if known == 0 or self.size % known:
                raise ValueError(f"cannot reshape {self._shape} into {tuple(shape)}")
            dims[dims.index(-1)] = self.size // known
        new_shape = _layout.normalize_shape(tuple(dims))
        n = 1
        for d in new_shape:
            n *= d
        if n != self.size:
            raise ValueError(f"cannot reshape {self._shape} ({self.size} elements) into {new_shape}")
        if not self.is_c_contiguous:
            raise ValueError("reshape needs a C-contiguous buffer; this view is strided")
        return self._view(self._offset, new_shape, _layout.c_strides(new_shape, self._dtype.itemsize))

    # -- device side: what numba and other CUDA libraries see ----------------------
    def _device_export(self) -> Allocation:
        alloc = self._live()
        if not self._device_accessible:
            raise _NotOnDeviceError(f"this {type(self).__name__} is not accessible from the device "
                               "(pinned memory needs HostAllocFlags.DEVICEMAP)")
        alloc.tracker.on_device_export()
        return alloc

    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA Array Interface v3 (no stream: umem_numba's coherence tracks the work)."""
        alloc = self._device_export()
        size = self.size
        return {
            "shape": self._shape,
            "typestr": self._dtype.str,
            "descr": self._dtype.descr if self._dtype.fields else [("", self._dtype.str)],
            "data": (alloc.device_ptr + self._offset if size else 0, False),
            "strides": None if self.is_c_contiguous else self._strides,
            "version": 3,
            "stream": None,
        }

    @property
    def __cuda_memory__(self) -> bool:
        # True lets numba-cuda launch straight from _strided_memory_view_shim.
        return _fast_launch_path() and self._device_accessible

    @property
    def _numba_type_(self) -> Any:
        # Read by numba's typing on every launch: kept short.
        alloc = self._alloc
        if alloc is None or alloc.closed or not self._device_accessible:
            alloc = self._device_export()  # raises the right error
        if self._views_can_retire and not self._owner:
            self._live()
        if not _launching.active:
            alloc.tracker.on_device_export()
        t = self._nbtype
        if t is None:
            t = self._nbtype = _layout.numba_type(self._dtype, self._shape, self._strides)
        return t

    @property
    def _strided_memory_view_shim(self) -> _layout.StridedViewShim:
        alloc = self._alloc
        if alloc is None or alloc.closed or not self._device_accessible:
            alloc = self._device_export()
        if self._views_can_retire and not self._owner:
            self._live()
        if not _launching.active:
            alloc.tracker.on_device_export()
        shim = self._shim
        if shim is None:
            ptr = alloc.device_ptr + self._offset if self.size else 0
            shim = self._shim = _layout.StridedViewShim(ptr, self._shape, self._strides, self._dtype)
        return shim

    @property
    def device_ctypes_pointer(self) -> ctypes.c_void_p:
        """The device address as ``ctypes.c_void_p`` (numba's device-memory protocol)."""
        alloc = self._device_export()
        return ctypes.c_void_p(alloc.device_ptr + self._offset if self.size else 0)

    def _fill_zero(self, stream: int) -> None:
        """Zero every byte on the device (``cuMemsetD8Async``), tracked like a kernel."""
        if not self.nbytes:
            return
        alloc = self._live()
        if not self.is_c_contiguous:
            raise ValueError("zeroing needs a C-contiguous buffer")
        with _driver.device_context(alloc.device_id):
            _driver.call("cuMemsetD8Async", alloc.device_ptr + self._offset, 0, self.nbytes, stream,
                         detail=f"zeroing a {type(self).__name__}")
            alloc.tracker.add(stream, _events.record(stream, alloc.device_id))

    # -- host side ----------------------------------------------------------------
    def _host_array(self, what: str) -> np.ndarray:
        alloc = self._live()
        if not self._host_accessible:
            raise UnsupportedError(f"{type(self).__name__} memory is not host-accessible; "
                                   "use copy_to_host()")
        alloc.tracker.before_host_access(what)
        size = self.size
        iface = {
            "shape": self._shape,
            "typestr": self._dtype.str,
            "descr": self._dtype.descr if self._dtype.fields else [("", self._dtype.str)],
            "data": (alloc.ptr + self._offset if size else 0, False),
            "strides": self._strides,
            "version": 3,
        }
        if size == 0:
            return np.empty(self._shape, self._dtype)
        return np.asarray(_HostExport(alloc, iface))

    @property
    def host(self) -> np.ndarray:
        """A numpy view of the same memory (no copy).

        Device work that may still use the buffer is settled first, per the
        coherence policy.  The array keeps the memory alive.
        """
        return self._host_array("host access")

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self._host_array("np.asarray")
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ValueError("a dtype conversion needs a copy")
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def copy_to_host(self, out: Any = None, stream: Any = None, *, staging: Any = None) -> Any:
        """Copy the elements into a new numpy array, a given one, or a :class:`PinnedBuffer`.

        Parameters
        ----------
        out : numpy.ndarray or PinnedBuffer, optional
            Same shape and dtype, writeable (C-contiguous where a device may
            hold the data).  A :class:`PinnedBuffer` receives an asynchronous
            copy: host access to it waits for the copy (coherence), so it works
            as a reusable destination.
        stream : numba stream, 0 or None
            The stream of the copy (``None``/``0``: the buffer's device's
            default stream).
        staging : None, bool or PinnedBuffer
            How to reach pageable numpy memory (see :mod:`umem_numba._copy`):
            ``None`` picks the measured faster path, ``False`` lets the driver
            copy straight into it, ``True`` or a :class:`PinnedBuffer` goes
            through pinned staging chunks.

        Returns
        -------
        numpy.ndarray or PinnedBuffer
            ``out`` (or the new array).  A numpy result is complete when this
            returns.

        Raises
        ------
        ValueError
            ``out`` does not match, or a strided view of memory the host cannot
            read (copy the contiguous buffer it slices instead).
        TypeError
            ``out`` or ``staging`` of the wrong type.

        Notes
        -----
        Memory a device may hold (managed, VMM, device) is copied by DMA
        (``cuMemcpyAsync``) after the device work recorded on the buffer, not
        read page by page by the host.
        """
        return _copy.to_host(self._copy_side(), out, stream, staging)

    def copy_from_host(self, array: Any, stream: Any = None, *, staging: Any = None) -> None:
        """Copy a host array (or another buffer / device array) of the same shape and dtype into this one.

        Parameters
        ----------
        array : array_like, buffer or device array
            The source.  A strided numpy source is made contiguous on the host
            first.
        stream : numba stream, 0 or None
            The stream of the copy.
        staging : None, bool or PinnedBuffer
            As in :meth:`copy_to_host`, for a pageable numpy source.

        Notes
        -----
        Queued after device work recorded on this buffer; later host access
        and launches are ordered after it.  A pageable numpy source has been
        read when this returns; a page-locked one (a :class:`PinnedBuffer`'s
        memory) must stay unchanged until the copy is done
        (``buf.synchronize()``), unless it is passed as the PinnedBuffer
        itself, whose coherence then guards it.  A managed destination is
        prefetched to its device first (where the device allows) so that the
        copy engine writes device memory.

        Raises
        ------
        ValueError
            Shape or dtype mismatch, or this view is strided and device-resident.
        """
        _copy.from_host(self._copy_side(), array, stream, staging)

    def _copy_side(self) -> _copy.Side:
        """This buffer as an operand of the copy layer."""
        alloc = self._live()
        ptr = alloc.device_ptr + self._offset if self.size else 0
        host_view = self._host_array if self._host_accessible else None
        return _copy.Side(ptr, self._shape, self._dtype, self.is_c_contiguous, alloc.tracker, alloc.device_id,
                          alloc.kind in _copy.DEVICE_KINDS, None, alloc.kind, host_view)

    def synchronize(self) -> None:
        """Wait for every piece of device work recorded on (or suspected of using) this buffer."""
        alloc = self._live()
        t = alloc.tracker
        t.wait(extra=t._extra_wait(t.unknown))

    @property
    def busy(self) -> bool:
        """Whether device work recorded on this buffer may still be running."""
        t = self._live().tracker
        return bool(t.unknown or t.busy_streams())

    @property
    def coherence_policy(self) -> str | None:
        """This buffer's own coherence policy (``None``: use the block/global one)."""
        return self._live().tracker.policy

    @coherence_policy.setter
    def coherence_policy(self, policy: str | None) -> None:
        self._live().tracker.policy = None if policy is None else check_policy(policy)

    @property
    def _coherence_tracker(self) -> Tracker | None:
        alloc = self._alloc
        return None if alloc is None else alloc.tracker

    def __repr__(self) -> str:
        if self.closed:
            return f"<closed {type(self).__name__}>"
        extra = self._repr_extra()
        return (f"{type(self).__name__}(shape={self._shape}, dtype={self._dtype}{extra}, "
                f"ptr={self.ptr:#x}{', view' if not self._owner else ''})")

    def _repr_extra(self) -> str:
        return ""


def _check_same(shape_a: tuple, dtype_a: np.dtype, shape_b: tuple, dtype_b: np.dtype, what: str) -> None:
    if tuple(shape_a) != tuple(shape_b) or np.dtype(dtype_a) != np.dtype(dtype_b):
        raise ValueError(f"{what}: mismatched arrays: {tuple(shape_a)} {np.dtype(dtype_a)} "
                         f"vs {tuple(shape_b)} {np.dtype(dtype_b)}")


def new_layout(shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype, int, tuple[int, ...]]:
    """Validate a constructor's shape and dtype: ``(shape, dtype, nbytes, strides)``."""
    dt = _layout.normalize_dtype(dtype)
    shp = _layout.normalize_shape(shape)
    nbytes = _layout.checked_nbytes(shp, dt)
    return shp, dt, nbytes, _layout.c_strides(shp, dt.itemsize)
