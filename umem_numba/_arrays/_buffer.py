"""Array behaviour shared by every umem_numba buffer.

An :class:`~umem_numba._memory._lifetime.Allocation` owns the memory and frees it
exactly once (see :mod:`umem_numba._memory._lifetime`).  A buffer is a typed,
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

import contextlib
import ctypes
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .. import _driver
from .._driver import _sim
from .._driver._location import stream_handle
from .._errors import BufferClosedError, CudaUnavailableError, UnsupportedError
from .._memory import _events
from .._memory._lifetime import Allocation, finalizer
from .._memory._tracker import DeviceUse, Tracker, _launching, check_policy
from . import _copy, _dlpack, _layout


class _HostExport:
    """Base object of a numpy host view: keeps the allocation mapped while alive."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, alloc: Allocation, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface
        alloc.add_export()
        finalizer(self, alloc.drop_export)


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


def _simulator_base() -> type:
    """The base of :class:`Buffer`: numba's ``ArgHint`` under its simulator, else ``object``.

    numba's simulator passes an ``ArgHint`` argument of a plain launch
    (``kernel[g, b](buf)``) through its ``to_device``, and any other
    non-numpy object as it is: buffers are such hints there (see
    :meth:`Buffer.to_device`).
    """
    if _sim.active():
        from numba.cuda.simulator.args import ArgHint

        return ArgHint
    return object


if TYPE_CHECKING:
    _Base = object
else:
    _Base = _simulator_base()


class Buffer(_Base):
    """Typed, strided window onto an :class:`Allocation` (base of every buffer type).

    Not instantiated directly: use :class:`ManagedBuffer`, :class:`PinnedBuffer`
    or :class:`VMMBuffer` constructors.
    """

    __slots__ = (
        *(("__weakref__",) if _Base is object else ()),  # numba's ArgHint has __weakref__ (and a __dict__)
        "_alloc",
        "_dtype",
        "_kparams",
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
    def _init(
        self,
        alloc: Allocation,
        offset: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dtype: np.dtype,
        owner: bool,
    ) -> None:
        self._alloc: Allocation | None = alloc
        self._owner = owner
        self._offset = offset
        self._shape = shape
        self._strides = strides
        self._dtype = dtype
        self._nbtype: Any = None
        self._shim: _layout.StridedViewShim | None = None
        self._kparams: tuple[Allocation, Any, tuple[int, ...]] | None = None

    def _view(
        self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype | None = None
    ) -> Buffer:
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
        if alloc.generation != _driver.fork_generation:
            raise CudaUnavailableError(
                f"this {type(self).__name__} was made before fork(), in the parent "
                "process: its memory belongs to the parent's CUDA context"
            )
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
            if not alloc.released:
                # Released later (host exports, or a device view held by another
                # library): this object keeps the memory until it is collected.
                return
        self._alloc = None
        self._shim = None
        self._kparams = None

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
    def is_f_contiguous(self) -> bool:
        """Whether the elements are dense in column-major (Fortran) order."""
        return _layout.is_f_contiguous(self._shape, self._strides, self._dtype.itemsize)

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

    def transpose(self, *axes: Any) -> Buffer:
        """A view with the axes permuted, like ``ndarray.transpose`` (no copy).

        ``transpose()`` reverses the axes: the transpose of a C-ordered
        buffer is F-ordered and the other way round.  ``transpose(1, 0, 2)``
        or ``transpose((1, 0, 2))`` gives the order of the axes.
        """
        self._live()
        ndim = len(self._shape)
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        if not axes:
            perm = tuple(range(ndim))[::-1]
        else:
            perm = tuple(_layout.as_axis(a, ndim, "transpose") for a in axes)
            if sorted(perm) != list(range(ndim)):
                raise ValueError(f"transpose: axes {tuple(axes)} are not a permutation of {ndim} axes")
        return self._view(self._offset, tuple(self._shape[a] for a in perm), tuple(self._strides[a] for a in perm))

    @property
    def T(self) -> Buffer:
        """The transposed view (axes reversed), like ``ndarray.T``."""
        return self.transpose()

    def view(self, dtype: Any) -> Buffer:
        """Reinterpret a C-contiguous buffer as another dtype of the same itemsize."""
        dt = _layout.normalize_dtype(dtype)
        if dt.itemsize != self._dtype.itemsize:
            raise ValueError(
                f"view() needs the same itemsize: {self._dtype} has {self._dtype.itemsize}, {dt} has {dt.itemsize}"
            )
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
            raise ValueError(
                "reshape needs a C-contiguous buffer; this view is strided or F-ordered "
                "(reshape the .T of an F-ordered buffer)"
            )
        return self._view(self._offset, new_shape, _layout.c_strides(new_shape, self._dtype.itemsize))

    # -- device side: what numba and other CUDA libraries see ----------------------
    def _device_alloc(self) -> Allocation:
        alloc = self._live()
        if not self._device_accessible:
            raise _NotOnDeviceError(
                f"this {type(self).__name__} is not accessible from the device "
                "(pinned memory needs HostAllocFlags.DEVICEMAP)"
            )
        return alloc

    def _device_export(self, escape: bool = True) -> Allocation:
        alloc = self._device_alloc()
        alloc.tracker.on_device_export(escape)
        return alloc

    def _launch_arg(self) -> tuple[Allocation, Any, tuple[int, ...]]:
        """``(allocation, numba type, kernel parameters)`` for a launch through umem_numba (cached).

        Checked like a device export, but not one: the launch files its own use.
        """
        alloc = self._device_alloc()
        t = self._nbtype
        if t is None:
            t = self._nbtype = _layout.numba_type(self._dtype, self._shape, self._strides)
        k = self._kparams
        if k is None or k[0] is not alloc:
            ptr = alloc.device_ptr + self._offset
            params = _layout.kernel_params(ptr, self._shape, self._strides, self._dtype.itemsize)
            k = self._kparams = (alloc, t, params)
        return k

    def _interface(self, alloc: Allocation, stream: int | None) -> dict[str, Any]:
        return {
            "shape": self._shape,
            "typestr": self._dtype.str,
            "descr": self._dtype.descr if self._dtype.fields else [("", self._dtype.str)],
            "data": (alloc.device_ptr + self._offset if self.size else 0, False),
            "strides": None if self.is_c_contiguous else self._strides,
            "version": 3,
            "stream": stream,
        }

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3.

        Reading it outside a umem_numba launch hands the memory to another
        library for good (the buffer *escapes*): from then on host access
        synchronises every device, since that library's work cannot be
        seen.  Use :meth:`lend` to hand it over for a bounded piece of work.
        """
        return self._interface(self._device_export(), None)

    @property
    def __cuda_memory__(self) -> bool:
        # True lets numba-cuda launch straight from _strided_memory_view_shim.
        return _fast_launch_path() and self._device_accessible

    @property
    def _numba_type_(self) -> Any:
        # Read by numba's typing on every launch: kept short.
        alloc = self._alloc
        if alloc is None or alloc.closed or not self._device_accessible:
            try:
                alloc = self._device_export()  # raises the right error
            except _NotOnDeviceError as exc:
                # Not as an AttributeError here: numba's typing would take that
                # as "no _numba_type_" and launch on the host pointer through
                # __dlpack__, with nothing tracked.
                raise UnsupportedError(f"a kernel launch cannot use this buffer: {exc}") from None
        if self._views_can_retire and not self._owner:
            self._live()
        tracker = alloc.tracker
        if tracker not in _launching.current:
            tracker.on_device_export(False)
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
        tracker = alloc.tracker
        if tracker not in _launching.current:
            tracker.on_device_export(False)
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

    def _device_array(self) -> np.ndarray:
        """A numpy array over the device address (the simulated driver's memory is host memory)."""
        alloc = self._device_alloc()
        if not self.size:
            return np.empty(self._shape, self._dtype)
        return np.asarray(_DeviceArray(self._interface(alloc, None) | {"strides": self._strides}))

    def to_device(self, retr: list[Any], stream: Any = 0) -> Any:
        """numba's simulator: the array a plain ``kernel[g, b](buf)`` launch gets (no copy).

        Such a launch runs at the call, ordered after all queued work (the
        conservative case: it may have been launched on any stream); it
        marks the buffer as used by a launch umem_numba did not make, as on a
        GPU.
        """
        from .._driver._simulated import fake_array

        self._device_export(escape=False)
        _driver.call("cuCtxSynchronize", detail="a plain launch under numba's simulator runs at the call")
        return fake_array(self._device_array())

    def _fill_zero(self, stream: int) -> None:
        """Zero every byte on the device (``cuMemsetD8Async``), ordered and recorded like a kernel."""
        if not self.nbytes:
            return
        alloc = self._live()
        if not (self.is_c_contiguous or self.is_f_contiguous):
            raise ValueError("zeroing needs a C-contiguous or F-contiguous buffer")
        what = f"zeroing a {type(self).__name__}"
        with _driver.device_context(alloc.device_id), DeviceUse([(alloc.tracker, True)], stream, what):
            _driver.call("cuMemsetD8Async", alloc.device_ptr + self._offset, 0, self.nbytes, stream, detail=what)

    # -- lending to other libraries -------------------------------------------------
    @contextlib.contextmanager
    def lend(self, stream: Any = None, *, readonly: bool = False) -> Iterator[LentView]:
        """Lend the buffer to another library for work on ``stream``, tracked precisely.

        On entry ``stream`` waits, on the device, for toolkit work on the
        buffer that conflicts; inside the block the yielded view gives CuPy,
        PyTorch or numba the memory (``__cuda_array_interface__`` naming the
        stream, and ``__dlpack__``) without the buffer escaping; on exit one
        event is recorded on ``stream``, and host access later waits for
        exactly that work.

        Parameters
        ----------
        stream : numba, CuPy or PyTorch stream, int or None
            Where the other library works (``None``/``0``: the legacy default
            stream).
        readonly : bool
            The library only reads: the buffer stays readable concurrently
            by other streams.

        Yields
        ------
        LentView
            Valid inside the block only (afterwards it raises).

        Examples
        --------
        >>> s = cupy.cuda.Stream(non_blocking=True)                   # doctest: +SKIP
        >>> with buf.lend(s) as view, s:                              # doctest: +SKIP
        ...     cupy.asarray(view)[...] *= 2
        >>> buf.host                                                  # doctest: +SKIP
        """
        handle = stream_handle(stream, what="lend")
        alloc = self._live()
        if not self._device_accessible:
            raise _NotOnDeviceError(f"this {type(self).__name__} is not accessible from the device")
        view = LentView(self, alloc, handle)
        with _driver.device_context(alloc.device_id), DeviceUse([(alloc.tracker, not readonly)], handle, "lend"):
            try:
                yield view
            finally:
                view._retire()

    # -- DLPack ------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(device_type, device_id)``: CUDA for managed, VMM and pool memory, CUDA-host for mapped pinned."""
        alloc = self._live()
        if alloc.kind == "pinned":
            if not self._device_accessible:
                return (_dlpack.KDL_CPU, 0)
            return (_dlpack.KDL_CUDA_HOST, 0)
        return (_dlpack.KDL_CUDA, alloc.device_id)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """Export as a DLPack capsule (the array API standard's protocol).

        Parameters
        ----------
        stream : int or None
            The consumer's stream: it waits, on the device, for toolkit work
            on the buffer (``None``: the legacy default stream; ``-1``: no
            ordering).  The buffer then escapes, as with
            ``__cuda_array_interface__``: use :meth:`lend` for bounded work.
        max_version : tuple of int, optional
            Accepted; an unversioned capsule is returned.
        dl_device : tuple of int, optional
            Must be :meth:`__dlpack_device__` (no cross-device export).
        copy : bool, optional
            ``True`` is refused (umem_numba exports without copying).

        Returns
        -------
        PyCapsule
            Named ``"dltensor"``; the memory stays allocated until the
            consumer releases it, even across :meth:`close`.
        """
        device = self._dlpack_request(dl_device, copy)
        alloc = self._live()
        if stream is not None and not isinstance(stream, int):
            raise TypeError(f"__dlpack__: stream must be an int or None, got {type(stream).__name__}")
        if device[0] == _dlpack.KDL_CPU:
            arr = self._host_array("__dlpack__")
            return _dlpack.make_capsule(arr.ctypes.data, self._shape, self._strides, self._dtype, device, arr, _nothing)
        consumer = _driver.consts().stream_legacy if stream is None else stream
        if consumer != -1:
            with _driver.device_context(alloc.device_id):
                waits, _ = alloc.tracker.begin_use(_driver.stream_key(consumer), True, "__dlpack__")
                try:
                    for event in waits:
                        _driver.call("cuStreamWaitEvent", consumer, event.handle, 0, detail="__dlpack__")
                finally:
                    alloc.tracker.end_use(0, None, True, issued=False)
        self._device_export(escape=True)
        return self._device_capsule(alloc, device)

    def _dlpack_request(self, dl_device: tuple[int, int] | None, copy: bool | None) -> tuple[int, int]:
        """Check what a DLPack consumer asked for; return the device to export to."""
        device = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"__dlpack__: cannot export to device {tuple(dl_device)}; the memory is on {device}")
        if copy:
            raise BufferError("__dlpack__: umem_numba exports its memory without copying (copy=True refused)")
        _dlpack.dl_dtype(self._dtype)
        return device

    def _device_capsule(self, alloc: Allocation, device: tuple[int, int]) -> Any:
        """A capsule over the device memory; it keeps this view and the memory until the consumer lets go."""
        alloc.add_export()
        ptr = alloc.device_ptr + self._offset if self.size else 0
        return _dlpack.make_capsule(ptr, self._shape, self._strides, self._dtype, device, self, alloc.drop_export)

    # -- host side ----------------------------------------------------------------
    def _host_array(self, what: str) -> np.ndarray:
        alloc = self._live()
        if not self._host_accessible:
            raise UnsupportedError(f"{type(self).__name__} memory is not host-accessible; use copy_to_host()")
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
            How to reach pageable numpy memory (see :mod:`umem_numba._arrays._copy`):
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
        and launches are ordered after it.  A numpy source has been read
        when this returns: for one over page-locked or managed memory (a
        :class:`PinnedBuffer`'s or :class:`ManagedBuffer`'s ``.host``) that
        means waiting for the copy itself; pass the PinnedBuffer itself for
        an asynchronous copy, which its coherence then guards.  A managed destination is
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
        order = _layout.dense_order(self._shape, self._strides, self._dtype.itemsize)
        return _copy.Side(
            ptr,
            self._shape,
            self._dtype,
            bool(order),
            alloc.tracker,
            alloc.device_id,
            alloc.kind in _copy.DEVICE_KINDS,
            None,
            alloc.kind,
            host_view,
            order,
        )

    def synchronize(self) -> None:
        """Wait for every piece of device work recorded on (or suspected of using) this buffer."""
        self._live().tracker.wait_all("synchronize")

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
        return (
            f"{type(self).__name__}(shape={self._shape}, dtype={self._dtype}{extra}, "
            f"ptr={self.ptr:#x}{', view' if not self._owner else ''})"
        )

    def _repr_extra(self) -> str:
        return ""


def _check_same(shape_a: tuple, dtype_a: np.dtype, shape_b: tuple, dtype_b: np.dtype, what: str) -> None:
    if tuple(shape_a) != tuple(shape_b) or np.dtype(dtype_a) != np.dtype(dtype_b):
        raise ValueError(
            f"{what}: mismatched arrays: {tuple(shape_a)} {np.dtype(dtype_a)} vs {tuple(shape_b)} {np.dtype(dtype_b)}"
        )


Layout = tuple[tuple[int, ...], np.dtype, int, tuple[int, ...]]

#: Validated layouts of recent constructor calls, by ``(shape, dtype)`` as given:
#: allocating the same shape in a loop (pool buffers) skips numpy's dtype parsing.
_layouts: dict[tuple[Any, Any], Layout] = {}
_LAYOUTS_KEPT = 512


def new_layout(shape: Any, dtype: Any, order: str = "C") -> Layout:
    """Validate a constructor's shape and dtype: ``(shape, dtype, nbytes, strides)``.

    ``order`` is ``"C"`` or ``"F"`` (the caller checked it with
    :func:`umem_numba._arrays._layout.check_order`).
    """
    if order != "C":
        dt = _layout.normalize_dtype(dtype)
        shp = _layout.normalize_shape(shape)
        return (shp, dt, _layout.checked_nbytes(shp, dt), _layout.f_strides(shp, dt.itemsize))
    # Only plain ints are keys: True == 1 and hashes alike, but a bool is no size.
    plain = type(shape) is int or (type(shape) is tuple and all(type(d) is int for d in shape))
    key = (shape, dtype)
    if plain:
        try:
            hit = _layouts.get(key)
        except TypeError:  # an unhashable dtype spec (a list of fields)
            plain = False
        else:
            if hit is not None:
                return hit
    dt = _layout.normalize_dtype(dtype)
    shp = _layout.normalize_shape(shape)
    nbytes = _layout.checked_nbytes(shp, dt)
    layout = (shp, dt, nbytes, _layout.c_strides(shp, dt.itemsize))
    if plain:
        if len(_layouts) >= _LAYOUTS_KEPT:
            _layouts.clear()
        _layouts[key] = layout
    return layout


def source_order(src: np.ndarray, order: Any, what: str) -> str:
    """The order a ``from_array`` copy of ``src`` is stored in: ``"K"`` keeps an F-ordered source's."""
    order = _layout.check_order(order, what, allow_keep=True)
    if order == "K":
        return "F" if src.flags.f_contiguous and not src.flags.c_contiguous else "C"
    return order


def cuda_core_source(array: Any, order: Any, what: str) -> tuple[_copy.Side | None, str]:
    """What a ``from_array`` of a cuda.core object copies: ``(side, order)`` for a DMA copy.

    ``(None, "")`` for anything else, and for a cuda.core view of memory only
    the host can reach (``np.from_dlpack`` reads it).  The order is the
    source's for ``"K"``; an explicit other order is refused (a DMA copy
    keeps the byte order).
    """
    if not _copy.is_cuda_core(array) or not _copy.cuda_core_device_accessible(array):
        return None, ""
    side = _copy.cuda_core_side(array, what, "source")
    wanted = _layout.check_order(order, what, allow_keep=True)
    if not side.contiguous:
        raise ValueError(f"{what}: the cuda.core {type(array).__name__} is strided; a DMA copy needs it contiguous")
    if wanted == "K":
        return side, "F" if side.order == "F" else "C"
    if wanted not in side.order:
        raise ValueError(
            f"{what}: order={wanted!r} of a source in {side.order} order: a DMA copy keeps the order "
            "(leave order='K', or copy through the host)"
        )
    return side, wanted


def host_source(array: Any) -> np.ndarray:
    """A ``from_array`` source as numpy (a cuda.core view of host memory through DLPack)."""
    if _copy.is_cuda_core(array) and hasattr(array, "__dlpack__"):
        return np.from_dlpack(array)
    return np.asarray(array)


def _nothing() -> None:
    """Release function of an export that holds nothing beyond its Python reference."""


class _DeviceArray:
    """numpy's array interface over a device address (simulated driver only: it is host memory)."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface
        self.owner: Any = None


def device_arrays(args: tuple[Any, ...] | list[Any]) -> tuple[Any, ...]:
    """``args`` with each buffer (also inside tuples and lists) as a numpy array over its device memory.

    What the simulated driver's queued kernel launches take (see
    :meth:`umem_numba._driver._simulated.SimDriver.queue_kernel`).
    """
    out: list[Any] = []
    for a in args:
        if isinstance(a, Buffer):
            out.append(a._device_array())
        elif isinstance(a, tuple):
            out.append(device_arrays(a))
        elif isinstance(a, list):
            out.append(list(device_arrays(a)))
        elif hasattr(a, "__cuda_array_interface__"):
            # Another library's array: its interface is read at the launch, as numba does.
            out.append(_interface_array(a.__cuda_array_interface__, a))
        else:
            out.append(a)
    return tuple(out)


def _interface_array(iface: dict[str, Any], owner: Any) -> np.ndarray:
    """A numpy array over the memory a CUDA Array Interface describes (simulated driver only)."""
    shape = tuple(iface["shape"])
    descr = iface.get("descr") or []
    named = any(field[0] for field in descr)
    dtype = np.dtype([tuple(field) for field in descr]) if named else np.dtype(iface["typestr"])
    if not iface["data"][0] or 0 in shape:
        return np.empty(shape, dtype)
    host = {"shape": shape, "typestr": dtype.str, "descr": dtype.descr, "data": (iface["data"][0], False)}
    host["strides"] = iface.get("strides")
    host["version"] = 3
    holder = _DeviceArray(host)
    holder.owner = owner  # the array keeps the memory's owner alive until the kernel has run
    return np.asarray(holder)


class LentView:
    """What :meth:`Buffer.lend` yields: the buffer's device memory for one stream, inside the block.

    It offers ``__cuda_array_interface__`` (naming the stream) and
    ``__dlpack__`` without the buffer escaping: the work is recorded when the
    block ends.  Using it after the block raises
    :class:`~umem_numba.BufferClosedError`.
    """

    __slots__ = ("_alloc", "_buffer", "_stream")

    def __init__(self, buffer: Buffer, alloc: Allocation, stream: int) -> None:
        self._buffer: Buffer | None = buffer
        self._alloc = alloc
        self._stream = stream

    def _retire(self) -> None:
        self._buffer = None

    def _live(self) -> Buffer:
        buf = self._buffer
        if buf is None:
            raise BufferClosedError("this LentView is used after its `with buf.lend(...)` block ended")
        buf._live()
        return buf

    @property
    def stream(self) -> int:
        """The stream handle the view is lent for."""
        return self._stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3 naming the lending stream (consumers order themselves after it)."""
        buf = self._live()
        return buf._interface(self._alloc, self._stream or None)

    def __dlpack_device__(self) -> tuple[int, int]:
        """As :meth:`Buffer.__dlpack_device__`."""
        return self._live().__dlpack_device__()

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule over the lent memory (the consumer's stream should be the lending one)."""
        buf = self._live()
        device = buf._dlpack_request(dl_device, copy)
        alloc = self._alloc
        if stream is not None and stream not in (-1, self._stream) and isinstance(stream, int):
            # The consumer works on another stream: make it wait for the lending stream's work so far.
            with _driver.device_context(alloc.device_id):
                handle = _driver.consts().stream_legacy if stream is None else stream
                event = _events.record(self._stream, alloc.device_id)
                _driver.call("cuStreamWaitEvent", handle, event.handle, 0, detail="__dlpack__ of a lent view")
        return buf._device_capsule(alloc, device)
