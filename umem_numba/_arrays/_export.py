"""What other libraries and numba's launches see of a buffer: every export protocol in one place.

A buffer's device memory leaves umem_numba through these doors, all here:

- the CUDA Array Interface (``__cuda_array_interface__``), one dict made by
  :func:`array_interface` for device views, host views and lent views alike;
- numba's launch protocol: ``_numba_type_``, ``_strided_memory_view_shim``
  (numba-cuda's fast launch path), ``device_ctypes_pointer``, and under
  numba's simulator ``to_device``;
- DLPack (``__dlpack__`` / ``__dlpack_device__``), for the buffer and for a
  lent view;
- :meth:`DeviceExports.lend`, the bounded hand-over, and the :class:`LentView`
  it yields.

An export through the interface or DLPack makes the buffer *escape* (host
access then synchronises every device: the other library's work cannot be
seen); a launch through umem_numba or a lent view does not.
:class:`DeviceExports` is a mixin of :class:`~umem_numba._arrays._buffer.Buffer`: it
holds no state of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .. import _driver, _numba_compat
from .._driver import _sim
from .._driver._location import _MAX_HANDLE, stream_handle
from .._errors import BufferClosedError, NotDeviceAccessibleError, UnsupportedError
from .._memory import _events
from .._memory._lifetime import Allocation, finalizer
from .._memory._plain_launch import PlainLaunch
from .._memory._tracker import DeviceUse, _launching
from . import _dlpack, _layout

#: The legacy default stream in the CUDA Array Interface (v3) and in DLPack.
_CAI_LEGACY_STREAM = 1


def array_interface(
    ptr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None, dtype: np.dtype, stream: int | None = None
) -> dict[str, Any]:
    """A version-3 array interface dict (CUDA's, or numpy's when ``stream`` is left out by the caller).

    ``strides`` None means C-contiguous; ``ptr`` is ignored (0) for an empty array.
    """
    size = 1
    for d in shape:
        size *= d
    return {
        "shape": shape,
        "typestr": dtype.str,
        "descr": dtype.descr if dtype.fields else [("", dtype.str)],
        "data": (ptr if size else 0, False),
        "strides": strides,
        "version": 3,
        "stream": stream,
    }


class _HostExport:
    """Base object of a numpy host view: keeps the allocation mapped while alive."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, alloc: Allocation, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface
        alloc.add_export()
        finalizer(self, alloc.drop_export)


def _nothing() -> None:
    """Release function of an export that holds nothing beyond its Python reference."""


class DLPackExport:
    """The DLPack protocol's entry point, written once for buffers and lent views."""

    __slots__ = ()

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
            The consumer's stream, as DLPack defines it for CUDA: ``None`` or
            ``1`` the legacy default stream, ``2`` the per-thread default
            stream, ``-1`` no ordering, any other positive int a stream
            handle (``0`` is refused: DLPack forbids it).  For a buffer it waits, on the device, for
            toolkit work on the buffer, and the buffer then escapes, as with
            ``__cuda_array_interface__``: use ``lend`` for bounded work.  For
            a lent view, a consumer stream other than the lending one waits
            for the lending stream's work so far, and nothing escapes.
        max_version : tuple of int, optional
            Accepted; an unversioned capsule is returned.
        dl_device : tuple of int, optional
            Must be ``__dlpack_device__()`` (no cross-device export).
        copy : bool, optional
            ``True`` is refused (umem_numba exports without copying).

        Raises
        ------
        TypeError, ValueError
            ``stream`` is not one of the above (checked before any driver call).

        Returns
        -------
        PyCapsule
            Named ``"dltensor"``; the memory stays allocated until the
            consumer releases it, even across ``close()``.
        """
        return self._dlpack_capsule(dlpack_stream(stream), dl_device, copy)

    def _dlpack_capsule(self, stream: int | None, dl_device: tuple[int, int] | None, copy: bool | None) -> Any:
        """The capsule, for a consumer on ``stream`` (a handle; ``None``: no ordering wanted)."""
        raise NotImplementedError


def dlpack_stream(stream: Any) -> int | None:
    """The consumer's stream handle of a ``__dlpack__(stream=...)`` call, checked before any driver call.

    DLPack's rules for CUDA: ``None`` is the legacy default stream (handle 1),
    1 the legacy stream, 2 the per-thread default stream, -1 "no
    synchronisation" (returned as ``None``), any other positive integer a
    stream handle; 0 is forbidden (it would be ambiguous).
    """
    if stream is None:
        return _CAI_LEGACY_STREAM
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
        raise TypeError(
            f"__dlpack__: stream={stream!r} is not a stream: DLPack's stream argument is an int "
            f"(a CUDA stream handle, 1, 2 or -1) or None, got {type(stream).__name__}"
        )
    value = int(stream)
    if value == -1:
        return None
    if value == 0:
        raise ValueError(
            "__dlpack__: stream=0 is not allowed for CUDA (DLPack: it would be ambiguous); pass 1 or None "
            "for the legacy default stream, 2 for the per-thread default stream, -1 for no synchronisation"
        )
    if value < 0 or value >= _MAX_HANDLE:
        raise ValueError(
            f"__dlpack__: stream={value} is not a CUDA stream handle (a positive integer below 2**64), "
            "nor -1 (no synchronisation)"
        )
    return value


class DeviceExports(DLPackExport):
    """The device side of a :class:`~umem_numba._arrays._buffer.Buffer`: what numba and other CUDA libraries see."""

    if not TYPE_CHECKING:  # no state of its own (mypy is told the Buffer attributes it uses instead)
        __slots__ = ()

    if TYPE_CHECKING:  # provided by Buffer
        _alloc: Allocation | None
        _offset: int
        _shape: tuple[int, ...]
        _strides: tuple[int, ...]
        _dtype: np.dtype
        _owner: bool
        _nbtype: Any
        _shim: _layout.StridedViewShim | None
        _kparams: tuple[Allocation, Any, tuple[int, ...]] | None
        _device_accessible: bool
        _views_can_retire: ClassVar[bool]
        _plain_via_to_device: ClassVar[bool]

        @property
        def size(self) -> int: ...
        @property
        def _address(self) -> int: ...
        @property
        def is_c_contiguous(self) -> bool: ...
        def _live(self) -> Allocation: ...
        def _host_array(self, what: str) -> np.ndarray: ...

    def _device_alloc(self) -> Allocation:
        alloc = self._live()
        if not self._device_accessible:
            raise NotDeviceAccessibleError(
                f"this {type(self).__name__} is not accessible from the device "
                "(pinned memory needs HostAllocFlags.DEVICEMAP)"
            )
        return alloc

    def _device_export(self, escape: bool = True) -> Allocation:
        alloc = self._device_alloc()
        alloc.tracker.on_device_export(escape)
        if escape:
            _driver.exit_hook_first()  # the other library exits after umem_numba's hook
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
            params = _numba_compat.kernel_array_params(ptr, self._shape, self._strides, self._dtype.itemsize)
            k = self._kparams = (alloc, t, params)
        return k

    def _interface(self, alloc: Allocation, stream: int | None) -> dict[str, Any]:
        """The CUDA Array Interface of this view of ``alloc``'s device memory (the one device-view helper)."""
        strides = None if self.is_c_contiguous else self._strides
        return array_interface(alloc.device_ptr + self._offset, self._shape, strides, self._dtype, stream)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3.

        Reading it outside a umem_numba launch hands the memory to another
        library for good (the buffer *escapes*): from then on host access
        synchronises every device, since that library's work cannot be
        seen.  Use :meth:`lend` to hand it over for a bounded piece of work.

        The interface names no stream (CAI v3: "no synchronisation needed"),
        so device work that may still use the memory (the toolkit's, and an
        earlier consumer's of an escaped buffer) is settled first, under the
        coherence policy, as for host access.
        """
        alloc = self._device_alloc()
        if alloc.tracker not in _launching.current:  # numba reading it for a tracked launch: no settling
            alloc.tracker.before_host_access("__cuda_array_interface__")
        return self._interface(self._device_export(), None)

    @property
    def __cuda_memory__(self) -> bool:
        # True lets numba-cuda launch straight from _strided_memory_view_shim.
        return _numba_compat.strided_view_launch_supported() and self._device_accessible

    @property
    def _numba_type_(self) -> Any:
        # Read by numba's typing on every launch: kept short.
        alloc = self._alloc
        if alloc is None or alloc.closed or not self._device_accessible:
            try:
                alloc = self._device_export()  # raises the right error
            except NotDeviceAccessibleError as exc:
                # Not as an AttributeError here: numba's typing would take that
                # as "no _numba_type_" and launch on the host pointer through
                # __dlpack__, with nothing tracked.
                raise UnsupportedError(f"a kernel launch cannot use this buffer: {exc}") from None
        if self._views_can_retire and not self._owner:
            self._live()
        tracker = alloc.tracker
        if tracker not in _launching.current and not self._plain_via_to_device:
            # numba-cuda without ArgHint.to_device: typing is the only sign of a plain launch.
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
            # Reached through numba's own hints (cuda.In(buf), cuda.Out(buf)), which name no stream
            # to umem_numba: work on an unknown stream.
            tracker.on_device_export(False)
        return self._shim_of(alloc)

    def _shim_of(self, alloc: Allocation) -> _layout.StridedViewShim:
        """numba's device-array stand-in over ``alloc`` (what its launch packs as parameters; cached)."""
        shim = self._shim
        if shim is None:
            ptr = alloc.device_ptr + self._offset if self.size else 0
            shim = self._shim = _layout.StridedViewShim(ptr, self._shape, self._strides, self._dtype)
        return shim

    @property
    def device_ctypes_pointer(self) -> ctypes.c_void_p:
        """The device address as ``ctypes.c_void_p`` (numba's device-memory protocol).

        numba reads it for its own copies (``DeviceNDArray.copy_to_device(buf)``),
        issued at once on numba's stream: as for ``__cuda_array_interface__``,
        device work that may still use the buffer is settled first, and the
        buffer escapes.
        """
        alloc = self._device_alloc()
        if alloc.tracker not in _launching.current:
            alloc.tracker.before_host_access("device_ctypes_pointer")
        self._device_export()
        return ctypes.c_void_p(alloc.device_ptr + self._offset if self.size else 0)

    def _device_array(self) -> np.ndarray:
        """A numpy array over the device address (the simulated driver's memory is host memory)."""
        alloc = self._device_alloc()
        if not self.size:
            return np.empty(self._shape, self._dtype)
        ptr = alloc.device_ptr + self._offset
        return np.asarray(_DeviceArray(array_interface(ptr, self._shape, self._strides, self._dtype)))

    def to_device(self, retr: list[Any], stream: Any = 0) -> Any:
        """numba's launch protocol (``ArgHint``): the device array a plain ``kernel[g, b, s](buf)`` gets.

        numba calls it with the launch stream, then each function appended
        to ``retr`` once the kernel is queued: the stream first waits, on the
        device, for conflicting work on other streams, and one event recorded
        after the kernel is filed as a write (:class:`PlainLaunch`), so host
        access waits for that stream's work only.  No copy is made.  Under
        numba's simulator the simulated driver queues the launch alike and
        gets a numpy array over the memory.
        """
        alloc = self._device_alloc()
        if self._views_can_retire and not self._owner:
            self._live()
        tracker = alloc.tracker
        if tracker not in _launching.current:  # a launch of umem_numba's own files its use itself
            PlainLaunch.register(tracker, stream, retr, self)  # parses the stream once per launch
        if _sim.active():
            from .._driver._simulated import fake_array

            return fake_array(self._device_array())
        return self._shim_of(alloc)

    # -- lending to other libraries -------------------------------------------------
    @contextlib.contextmanager
    def lend(self, stream: Any = None, *, readonly: bool = False) -> Iterator[LentView]:
        """Lend the buffer to another library for work on ``stream``, tracked precisely.

        On entry ``stream`` waits, on the device, for toolkit work on the
        buffer that conflicts; inside the block the yielded view gives CuPy,
        PyTorch or numba the memory (``__cuda_array_interface__`` naming the
        stream, and ``__dlpack__``) without the buffer escaping; on exit one
        event is recorded on ``stream`` and one on each stream a DLPack
        consumer named, and host access later waits for exactly that work.
        A consumer that names no stream (one that read the CUDA Array
        Interface, or passed DLPack's ``stream=-1``) may work on any stream:
        the buffer then counts as used by a launch umem_numba did not see
        (the next host access synchronises the device).

        Parameters
        ----------
        stream : numba, CuPy or PyTorch stream, int or None
            Where the other library works (``None``/``0``: the legacy default
            stream, which the view's ``__cuda_array_interface__`` names ``1``).
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
        ...     cupy.from_dlpack(view)[...] *= 2
        >>> buf.host                                                  # doctest: +SKIP
        """
        handle = stream_handle(stream, what="lend")
        alloc = self._live()
        _driver.exit_hook_first()  # the consumer's library exits after umem_numba's hook
        if not self._device_accessible:
            raise NotDeviceAccessibleError(f"this {type(self).__name__} is not accessible from the device")
        view = LentView(self, alloc, handle)
        tracker = alloc.tracker
        with _driver.device_context(alloc.device_id), DeviceUse([(tracker, not readonly)], handle, "lend"):
            # Host access to the buffer on this thread inside the block raises (it would wait for the block).
            lender = tracker.lend_entered()
            try:
                yield view
            finally:
                tracker.lend_left(lender)
                view._retire()
                # Before the block's own registration ends: host access on other threads, and
                # a pool's reuse of the memory, then wait for the consumers' work too.
                view._record_consumers(tracker, not readonly)

    # -- DLPack ------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(device_type, device_id)``: CUDA for memory a device may hold, else CUDA-host (mapped) or CPU."""
        alloc = self._live()
        if alloc.resource.device_may_hold:
            return (_dlpack.KDL_CUDA, alloc.device_id)
        return (_dlpack.KDL_CUDA_HOST if self._device_accessible else _dlpack.KDL_CPU, 0)

    def _dlpack_capsule(self, stream: int | None, dl_device: tuple[int, int] | None, copy: bool | None) -> Any:
        """``__dlpack__`` of the buffer: the consumer's stream waits for toolkit work, then the buffer escapes."""
        device = self._dlpack_request(dl_device, copy)
        alloc = self._live()
        if device[0] == _dlpack.KDL_CPU:
            arr = self._host_array("__dlpack__")
            return _dlpack.make_capsule(arr.ctypes.data, self._shape, self._strides, self._dtype, device, arr, _nothing)
        consumer = stream
        if consumer is not None:
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
        if isinstance(a, DeviceExports):
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
    holder = _DeviceArray(array_interface(iface["data"][0], shape, iface.get("strides"), dtype))
    holder.owner = owner  # the array keeps the memory's owner alive until the kernel has run
    return np.asarray(holder)


class LentView(DLPackExport):
    """What :meth:`Buffer.lend` yields: the buffer's device memory for one stream, inside the block.

    It offers ``__cuda_array_interface__`` (naming the stream) and
    ``__dlpack__`` without the buffer escaping: the work is recorded when the
    block ends.  Using it after the block raises
    :class:`~umem_numba.BufferClosedError`.
    """

    __slots__ = ("_alloc", "_buffer", "_consumers", "_stream", "_unseen")

    def __init__(self, buffer: DeviceExports, alloc: Allocation, stream: int) -> None:
        self._buffer: DeviceExports | None = buffer
        self._alloc = alloc
        self._stream = stream
        #: Streams DLPack consumers named, other than the lending stream (handles, in order).
        self._consumers: dict[int, None] = {}
        #: A consumer whose stream cannot be known took the view (CUDA Array Interface, DLPack's -1).
        self._unseen = False

    def _retire(self) -> None:
        self._buffer = None

    def _record_consumers(self, tracker: Any, write: bool) -> None:
        """At the block's end: file the consumers' work, as far as it can be known, under ``tracker``.

        A stream a DLPack consumer named gets an event, filed like the lending
        stream's.  A consumer that named no stream (the CUDA Array Interface
        says which stream to order after, not which one the consumer works
        on; DLPack's ``stream=-1``) may work on any stream of the device:
        the memory is then treated as used by a launch umem_numba did not
        see (host access synchronises the device; a pool holds the memory
        until a synchronise).  When unsure, it writes.
        """
        alloc = self._alloc
        events = []
        unseen = self._unseen
        for handle in self._consumers:
            try:
                events.append(_events.record(handle, alloc.device_id))
            except Exception:
                unseen = True  # the work may be queued there: cover it the other way
        tracker.file_lent_work(events, write, alloc.device_id if unseen else None)

    def _live(self) -> DeviceExports:
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
    def ptr(self) -> int:
        """The device address of the lent memory's first element, for raw work on the lent stream.

        A raw kernel or driver call queued on :attr:`stream` inside the
        block is recorded when the block ends, like the lending stream's
        other work: host access then waits for exactly that, and the buffer
        does not escape (``buf.ptr`` would make it escape).  Work on another
        stream must be ordered after the lending stream first (an event) and
        before the block ends.  0 for a zero-size view.
        """
        return self._live()._address

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3 naming the lending stream (consumers order themselves after it).

        A view lent on the legacy default stream (``lend(None)`` / ``lend(0)``) names it ``1``,
        as CAI v3 spells the legacy stream: ``None`` there means "no synchronisation needed"
        and ``0`` is not allowed.
        """
        buf = self._live()
        self._unseen = True  # the consumer's own stream is not said: see _record_consumers
        return buf._interface(self._alloc, self._stream or _CAI_LEGACY_STREAM)

    def __dlpack_device__(self) -> tuple[int, int]:
        """As :meth:`Buffer.__dlpack_device__`."""
        return self._live().__dlpack_device__()

    def _dlpack_capsule(self, stream: int | None, dl_device: tuple[int, int] | None, copy: bool | None) -> Any:
        """``__dlpack__`` of a lent view: a consumer on another stream waits for the lending stream's work."""
        buf = self._live()
        device = buf._dlpack_request(dl_device, copy)
        alloc = self._alloc
        lending = self._stream or _CAI_LEGACY_STREAM  # 0 and 1 both name the legacy stream
        if stream is None:
            self._unseen = True  # -1: the consumer orders itself, on a stream it does not name
        elif stream != lending:
            self._consumers[stream] = None  # recorded when the block ends
            # The consumer works on another stream: make it wait for the lending stream's work so far.
            with _driver.device_context(alloc.device_id):
                event = _events.record(self._stream, alloc.device_id)
                _driver.call("cuStreamWaitEvent", stream, event.handle, 0, detail="__dlpack__ of a lent view")
        return buf._device_capsule(alloc, device)
