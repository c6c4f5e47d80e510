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

import itertools
import reprlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .. import _driver
from .._driver import _sim
from .._errors import BufferClosedError, CoherenceError, CudaUnavailableError, UnsupportedError
from .._memory import _tracker
from .._memory._lifetime import Allocation
from .._memory._tracker import DeviceUse, Tracker, check_policy
from . import _copy, _layout
from ._export import DeviceExports, _HostExport, array_interface

#: A host view of at least this many bytes of managed memory the device wrote is prefetched to
#: the host before host code reads it (see Buffer._prefetch_for_host).
HOST_PREFETCH_MIN = 1 << 20

_HOST_LOCATION: list[Any] = []


def _host_location() -> Any:
    """The host's ``CUmemLocation`` (made once)."""
    if not _HOST_LOCATION:
        from .._driver._location import HOST

        _HOST_LOCATION.append(HOST.to_cu())
    return _HOST_LOCATION[0]


def _numba_base() -> type:
    """The base of :class:`Buffer`: numba's ``ArgHint`` (its simulator's under it), else ``object``.

    numba's launch hands an ``ArgHint`` argument of a plain launch
    (``kernel[g, b, s](buf)``) to its ``to_device(retr, stream)`` with the
    launch stream: buffers are such hints, so that the launch is ordered and
    recorded on its stream (see :meth:`Buffer.to_device`).
    """
    from .._numba_compat import arg_hint_base

    hint = arg_hint_base(_sim.active())
    return object if hint is None else hint


if TYPE_CHECKING:
    _Base = object
else:
    _Base = _numba_base()


class Buffer(DeviceExports, _Base):
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
    #: Host access marks the memory for a prefetch before the next launch (managed memory).
    _migrates_on_launch: ClassVar[bool] = False
    #: numba's plain launch calls :meth:`to_device` with its stream (numba's ``ArgHint``).
    _plain_via_to_device: ClassVar[bool] = _Base is not object
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
            if not alloc._released:  # the attribute, not the property: every close reads it
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
        """The device address of the first element, for work umem_numba does not issue.

        For a raw kernel, a driver call or another library given only the
        address.  Reading it marks the buffer as shared, as reading
        ``__cuda_array_interface__`` does: device work that may still use
        the buffer is settled first, under the coherence policy (the reader
        may start its own work at once, on any stream), and the buffer
        *escapes*: from then on host access, and toolkit work on it,
        synchronise every device, since work through the address cannot be
        seen.  A zero-size buffer or view gives 0 and marks nothing.

        For bounded raw work, read the address of a lent view instead:
        ``with buf.lend(stream) as view: view.ptr`` gives the same address
        for work on ``stream``, recorded precisely when the block ends
        (nothing escapes).  Kernels through :func:`~umem_numba.launch`,
        :func:`~umem_numba.jit` or a plain ``kernel[g, b](buf)`` take the
        buffer itself, never its address.

        Raises
        ------
        CoherenceError
            Inside this buffer's own ``lend`` block on this thread (use the
            lent view's ``ptr``), or device work is pending under the
            ``"raise"`` policy.
        """
        alloc = self._live()
        if not self.size:
            return 0
        tracker = alloc.tracker
        tracker.refuse_inside_own_lend(
            "reading ptr of a lent buffer (use the lent view's ptr for work on the lent stream)"
        )
        tracker.before_host_access("ptr")
        tracker.on_device_export(True)
        _driver.exit_hook_first()  # the library given the address exits after umem_numba's hook
        return alloc.device_ptr + self._offset

    @property
    def _address(self) -> int:
        """The device address of the first element, untracked: umem_numba's own reads (copies, launches, pools).

        Reading it tells the coherence tracker nothing; code that hands the
        address to device work umem_numba does not see reads :attr:`ptr`.
        """
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

    # -- views and elements ---------------------------------------------------------
    def __getitem__(self, key: Any) -> Any:
        """Basic indexing, as numpy and numba's device arrays do it: ints, slices (any step) and ``...``.

        An integer for every axis gives the element's *value* (a numpy
        scalar, a copy): a host read that first waits for the device work
        recorded on the buffer, under the coherence policy, as numba's
        ``DeviceNDArray`` element reads do.  Memory the host reads directly
        (managed, pinned) is read in place; device and VMM memory by a small
        DMA copy.  Anything else gives a view (no copy), a 0-d one too where
        the key holds ``...`` (``buf[i, j, ...]``).

        Raises
        ------
        IndexError
            Too many indices, or an integer out of range.
        TypeError
            Advanced (array, list, boolean) or other unsupported indices.
        """
        self._live()
        offset, shape, strides = _layout.index_view(self._shape, self._strides, key)
        view = self._view(self._offset + offset, shape, strides)
        if shape or not _element_key(key):
            return view
        return view._element_value()

    def __setitem__(self, key: Any, value: Any) -> None:
        """Assign from the host, as numpy does it: ``buf[i] = v``, ``buf[2:5] = a``, ``buf[::2, 1] = 0``.

        ``value`` is broadcast to the indexed view and cast to its dtype,
        numpy's way; a umem_numba buffer or a device array of the view's
        shape and dtype is copied by DMA.  Ordered like
        :meth:`copy_from_host`: after the device work recorded on the
        buffer, and before later host access and launches.  Memory the host
        reads directly (managed, pinned) is written in place once that work
        is done (the coherence policy decides how to wait); device and VMM
        memory by DMA on the buffer's device's default stream, one copy per
        contiguous run of a strided view (assign to the contiguous buffer
        instead where the runs are many and short).

        Raises
        ------
        IndexError, TypeError
            A key :meth:`__getitem__` refuses, or an object ``value``.
        ValueError
            ``value`` cannot be broadcast to the view.
        """
        self._live()
        offset, shape, strides = _layout.index_view(self._shape, self._strides, key)
        self._view(self._offset + offset, shape, strides)._assign(value)

    def __iter__(self) -> Iterator[Any]:
        """Iterate over the first axis, as numpy does: values of a 1-d buffer, views of a larger one.

        Each value is an element read (see :meth:`__getitem__`): for many
        elements, copy the buffer to the host once instead.
        """
        if not self._shape:
            raise TypeError("iteration over a 0-d buffer")
        return (self[i] for i in range(self._shape[0]))

    def _element_value(self) -> Any:
        """The value of this 0-d view: a host read that waits for the device work on the buffer."""
        if self._host_accessible:
            here = self._host_array("element read", prefetch=False)
        else:
            here = np.empty((), self._dtype)
            self.copy_to_host(here)
        return here.copy()[()]  # a copy first: a record scalar would be a view of the buffer

    def _assign(self, value: Any) -> None:
        """``self[...] = value`` from the host, ordered like :meth:`copy_from_host` (see :meth:`__setitem__`)."""
        if _device_operand(value):
            self.copy_from_host(value)  # a buffer or device array: DMA, both sides ordered
            return
        src = np.asarray(value)
        if src.dtype.hasobject:
            raise TypeError(
                f"cannot assign {type(value).__name__} to a {type(self).__name__} of {self._dtype}: "
                "object values cannot live in CUDA memory"
            )
        order = _layout.dense_order(self._shape, self._strides, self._dtype.itemsize)
        dense = np.empty(self._shape, self._dtype, order="F" if order == "F" else "C")
        # numpy's broadcasting and casting, on the host first: a value that does not fit the view
        # is refused before anything waits for, or is queued on, the device.
        np.copyto(dense, src, casting="unsafe")
        if self._host_accessible:
            self._host_array("item assignment", prefetch=False)[...] = dense  # written, not read: no prefetch
        elif order:
            self.copy_from_host(dense)
        else:
            self._scatter_from_host(dense)

    def _scatter_from_host(self, src: np.ndarray) -> None:
        """Write a strided view of device-only memory from C-ordered ``src``: one DMA per contiguous run.

        The runs are queued on the default stream of the buffer's device as
        one piece of tracked work (ordered after the work recorded on the
        buffer, recorded as a write).  ``src`` is pageable host memory, which
        the driver has read when each ``cuMemcpyAsync`` returns.
        """
        if not self.size:
            return
        alloc = self._live()
        itemsize = self._dtype.itemsize
        shape, strides = self._shape, self._strides
        if strides[-1] == itemsize:  # the last axis is dense: runs along it
            run, outer, outer_strides = shape[-1] * itemsize, shape[:-1], strides[:-1]
        else:
            run, outer, outer_strides = itemsize, shape, strides
        base, host = alloc.device_ptr + self._offset, src.ctypes.data
        what = f"item assignment to a strided {type(self).__name__} view"
        with _driver.device_context(alloc.device_id), DeviceUse([(alloc.tracker, True)], 0, what):
            for k, index in enumerate(itertools.product(*(range(n) for n in outer))):
                dst = base + sum(i * st for i, st in zip(index, outer_strides, strict=True))
                _driver.call("cuMemcpyAsync", dst, host + k * run, run, 0, detail=what)

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

    # -- host side ----------------------------------------------------------------
    def _host_array(self, what: str, *, prefetch: bool = True) -> np.ndarray:
        """A numpy view for host code, once device work that may use the memory is settled.

        ``prefetch``: the host is about to read the view (see :meth:`_prefetch_for_host`).
        """
        alloc = self._live()
        if not self._host_accessible:
            raise UnsupportedError(f"{type(self).__name__} memory is not host-accessible; use copy_to_host()")
        tracker = alloc.tracker
        if self._migrates_on_launch and (tracker.writes or tracker.device_wrote):
            if prefetch:
                self._prefetch_for_host(alloc)
            tracker.device_wrote = False  # the host takes the pages now (by that prefetch, or by faults)
        tracker.before_host_access(what)
        if self.size == 0:
            return np.empty(self._shape, self._dtype)
        if self._migrates_on_launch and tracker.migrate is None and tracker.concurrent and _tracker.get_auto_prefetch():
            # The host may touch every page of it now: the next launch prefetches it back.
            assert alloc.memory is not None  # a buffer with elements has memory
            tracker.migrate = (alloc.ptr, alloc.memory.nbytes)
        iface = array_interface(alloc.ptr + self._offset, self._shape, self._strides, self._dtype)
        return np.asarray(_HostExport(alloc, iface))

    def _prefetch_for_host(self, alloc: Allocation) -> None:
        """Managed memory the device wrote, about to be read on the host: brought over by prefetch.

        The view's bytes (the whole allocation for a view that is not
        contiguous) are prefetched to the host on a private stream that
        first waits for the device work writing them; host access then waits
        for the prefetch as for that work.  Only under the ``"sync"`` policy,
        with automatic prefetch on (:func:`~umem_numba.set_auto_prefetch`), on
        a device with concurrentManagedAccess, and for at least
        :data:`HOST_PREFETCH_MIN` bytes: smaller reads fault in faster than
        a prefetch is issued.  A refused prefetch is not an error (a hint).
        """
        tracker = alloc.tracker
        nbytes = self.nbytes
        if nbytes < HOST_PREFETCH_MIN or not tracker.concurrent or not _tracker._auto_prefetch:
            return
        if tracker.effective_policy() != "sync":  # "raise" / "warn" / "off": the host does not wait here
            return
        contiguous = self.is_c_contiguous or self.is_f_contiguous
        ptr, size = (alloc.ptr + self._offset, nbytes) if contiguous else (alloc.ptr, alloc.memory.nbytes)  # type: ignore[union-attr]
        side = _driver.side_stream(alloc.device_id)
        what = f"prefetching a {type(self).__name__} to the host before host access"
        try:
            with _driver.device_context(alloc.device_id), DeviceUse([(tracker, False)], side, what):
                _driver.api().mem_prefetch(ptr, size, _host_location(), 0, side)  # a hint: refusals pass
        except (CoherenceError, BufferClosedError):
            return  # the host access reports it, in its own words

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

    def copy_to_host(self, ary: Any = None, stream: Any = 0, *, out: Any = None, staging: Any = None) -> Any:
        """Copy the elements into a new numpy array, a given one, or a :class:`PinnedBuffer`.

        Parameters
        ----------
        ary : numpy.ndarray or PinnedBuffer, optional
            The destination (numba's name for it; ``out`` is the same):
            same shape and dtype, writeable (C-contiguous where a device may
            hold the data).  A :class:`PinnedBuffer` receives an asynchronous
            copy: host access to it waits for the copy (coherence), so it works
            as a reusable destination.
        stream : numba stream, 0 or None
            The stream of the copy (``0``/``None``: the buffer's device's
            default stream).
        out : numpy.ndarray or PinnedBuffer, optional
            The destination, as ``ary`` (give one of them).
        staging : None, bool or PinnedBuffer
            How to reach pageable numpy memory (see :doc:`/concepts/memory-kinds`):
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
            The destination does not match, or a strided view of memory the
            host cannot read (copy the contiguous buffer it slices instead).
        TypeError
            The destination or ``staging`` of the wrong type, or both ``ary``
            and ``out`` given.

        Notes
        -----
        Memory a device may hold (managed, VMM, device) is copied by DMA
        (``cuMemcpyAsync``) after the device work recorded on the buffer, not
        read page by page by the host.
        """
        if out is not None:
            if ary is not None:
                raise TypeError("copy_to_host: give the destination as ary or out, not both (ary is numba's name)")
            ary = out
        return _copy.to_host(self._copy_side(), ary, stream, staging)

    def copy_to_device(self, ary: Any, stream: Any = 0, *, staging: Any = None) -> None:
        """Copy ``ary`` *into* this buffer, as numba's ``DeviceNDArray.copy_to_device(ary)`` does.

        The source is the argument: a host array (anything ``np.asarray``
        takes: a list, a numpy array), another buffer, a numba device array
        or a cuda.core view; same shape and dtype.  Ordered like
        :meth:`copy_from_host`, which it is under numba's name (a
        :class:`PinnedBuffer` copies *out* to a device array with
        :meth:`PinnedBuffer.copy_into`).

        Parameters
        ----------
        ary : array_like, buffer or device array
            The source.
        stream : numba stream, 0 or None
            The stream of the copy (``0``/``None``: the buffer's device's
            default stream).
        staging : None, bool or PinnedBuffer
            As in :meth:`copy_to_host`, for a pageable numpy source.

        Raises
        ------
        ValueError
            Shape or dtype mismatch, or this view is strided and device-resident.
        TypeError
            An object array as the source.
        """
        _copy.from_host(self._copy_side(), ary, stream, staging)

    def copy_from_host(self, array: Any, stream: Any = 0, *, staging: Any = None) -> None:
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
        epoch = alloc.tracker.epoch
        if alloc.closed:  # read the epoch, then see the buffer open: a later close changes it
            self._live()
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
            alloc.resource.device_may_hold,
            None,
            alloc.resource,
            host_view,
            order,
            epoch=epoch,
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
            f"ptr={self._address:#x}{', view' if not self._owner else ''})"
        )

    def _repr_extra(self) -> str:
        return ""


def _device_operand(value: Any) -> bool:
    """Whether an assigned value is a copy-layer device operand (a buffer, a device array, a cuda.core view).

    Asked of the class where it can be (a CUDA Array Interface is often a
    property with effects: a buffer's escapes), as the copy layer tells them.
    """
    if hasattr(value, "_copy_side") or _copy.is_cuda_core(value):
        return True
    if isinstance(value, np.ndarray):
        return False
    return hasattr(type(value), "__cuda_array_interface__") or "__cuda_array_interface__" in getattr(
        value, "__dict__", ()
    )


def _element_key(key: Any) -> bool:
    """Whether an index that left no dimension names an element (no slice, no ``...``), as numpy tells them apart."""
    parts = key if isinstance(key, tuple) else (key,)
    return not any(k is Ellipsis or isinstance(k, slice) for k in parts)


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


def like_layout(array: Any, order: Any, what: str) -> tuple[Any, Any, str]:
    """``(shape, dtype, order)`` of a new buffer like ``array`` (``np.empty_like``'s rules; the ``*_like`` shortcuts).

    ``array`` is anything with ``shape`` and ``dtype`` (a buffer, a numba or
    numpy array; nothing is read from it) or that ``np.asarray`` takes.
    ``order="K"`` keeps an F-ordered ``array``'s order and makes anything
    else C-ordered.
    """
    shape = getattr(array, "shape", None)
    dtype = getattr(array, "dtype", None)
    strides = getattr(array, "strides", None)
    if shape is None or dtype is None:
        arr = np.asarray(array)
        shape, dtype, strides = arr.shape, arr.dtype, arr.strides
    order = _layout.check_order(order, what, allow_keep=True)
    if order == "K":
        dt = np.dtype(dtype)
        f_only = strides is not None and _layout.dense_order(tuple(shape), tuple(strides), dt.itemsize) == "F"
        order = "F" if f_only else "C"
    return shape, dtype, order


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
    """A ``from_array`` source as numpy (a cuda.core view of host memory through DLPack).

    Raises ``TypeError`` naming the source when it is ``None`` or its values
    are not numbers kernels can use (text, Python objects), before anything
    else is checked or allocated.
    """
    if array is None:
        raise TypeError(
            "from_array(None): the source is None; pass the data to copy: a numpy array (or anything "
            "np.asarray takes, such as a list of numbers), or a cuda.core StridedMemoryView / Buffer"
        )
    src = np.from_dlpack(array) if _copy.is_cuda_core(array) and hasattr(array, "__dlpack__") else np.asarray(array)
    try:
        _layout.normalize_dtype(src.dtype)
    except TypeError as exc:
        raise TypeError(f"from_array({reprlib.repr(array)}): {exc}") from None
    return src
