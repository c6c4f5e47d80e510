"""Launching kernels with coherence: ordered on the device, one event per launch.

:func:`launch`, :func:`coherent` and :func:`jit` launch a numba kernel and, for
every umem_numba buffer among the arguments (views included):

1. order the launch stream, on the device, after conflicting toolkit work on
   other streams (``cuStreamWaitEvent``; a read waits for the last write, a
   write for the last write and the reads since; see :mod:`umem_numba._memory._tracker`);
2. record one CUDA event after the kernel and file it under the buffer, as a
   read or a write.

Nothing waits on the host.  Which arguments a kernel only reads is inferred
from its Python source: an argument is read-only only when nothing stores
through it or anything derived from it (elements, rows, record fields,
aliases, loop targets, tuples), and it reaches no call but a few pure reads
(``len``, ``range``, ``min``/``max``, math functions, scalar casts); a device
function or ``cuda.atomic.*`` receiving it writes it, and a kernel whose
source cannot be read, or no longer matches its code, writes every argument
(:mod:`umem_numba._launch._write_inference`).  ``readonly=`` declares it instead (and then replaces the inference).

The stream may be numba's, a CuPy or PyTorch stream, any object with
``__cuda_stream__``, or a raw handle: numba's launch is given one external
stream per foreign stream.  numba's ``pre_launch_callbacks`` run as in numba
(a configured launch with any goes through numba's launch).

Launches into a CUDA graph capture are refused: an event recorded inside a
capture cannot be waited for, and the graph would keep using memory the
toolkit does not know is referenced.
"""

from __future__ import annotations

import struct
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import _driver, _numba_compat
from .._arrays._buffer import Buffer
from .._arrays._export import device_arrays
from .._driver import _sim
from .._driver._location import owns_stream, stream_classes, stream_handle
from .._errors import CoherenceError, CudaError
from .._memory import _capture, _events
from .._memory._tracker import Tracker, _launching, prefetch_touched
from ._kernel_call import KernelCall, scalar_type, supports
from ._write_inference import KernelInfo

__all__ = ["CoherentKernel", "coherent", "jit", "launch"]


def _uses(info: KernelInfo, args: tuple[Any, ...]) -> list[tuple[Tracker, bool]]:
    """``(tracker, write)`` per allocation among ``args`` (a write wins over reads of one allocation)."""
    uses: list[tuple[Tracker, bool]] = []
    for i, a in enumerate(args):
        if isinstance(a, Buffer):
            alloc = a._alloc
            if alloc is not None:  # a closed buffer fails in numba's typing with a clear error
                _add(uses, alloc.tracker, info.write(i))
        elif isinstance(a, (tuple, list)):
            for item in _buffers_in(a):
                _add(uses, item, True)
    return uses


def _buffers_in(seq: tuple[Any, ...] | list[Any]) -> list[Tracker]:
    out: list[Tracker] = []
    for a in seq:
        if isinstance(a, Buffer) and a._alloc is not None:
            out.append(a._alloc.tracker)
        elif isinstance(a, (tuple, list)):
            out.extend(_buffers_in(a))
    return out


def _add(uses: list[tuple[Tracker, bool]], tracker: Tracker, write: bool) -> None:
    for k, (t, w) in enumerate(uses):
        if t is tracker:
            if write and not w:
                uses[k] = (t, True)
            return
    uses.append((tracker, write))


def _walk(
    writes: tuple[bool, ...], args: tuple[Any, ...]
) -> tuple[list[int], list[Any], dict[Tracker, bool], dict[Tracker, int]] | None:
    """A launch's arguments read once: ``(type ids, kernel values, uses, epochs)``, or None for numba.

    ``type ids`` name the numba types (interned: their ids are cheaply hashed); ``values`` are what
    a direct call passes; ``uses`` maps each buffer's tracker to whether the launch writes it (a
    write wins over reads of one allocation); ``epochs`` holds each tracker's epoch when the
    launch took the buffer's address.  None: an argument only numba can launch (tuples, numba or
    foreign arrays, records).
    """
    nwrites = len(writes)
    type_ids: list[int] = []
    values: list[Any] = []
    uses: dict[Tracker, bool] = {}
    epochs: dict[Tracker, int] = {}
    for i, a in enumerate(args):
        if isinstance(a, Buffer):
            k = a._kparams
            if k is None or k[0].closed or a._views_can_retire:
                k = a._launch_arg()  # checks closed, retired and host-only buffers
            tracker = k[0].tracker
            epochs[tracker] = tracker.epoch
            if k[0].closed:  # the epoch read, then the buffer seen open: a close from here on changes it
                a._launch_arg()
            type_ids.append(id(k[1]))
            values += k[2]
            if not uses.get(tracker, False):
                uses[tracker] = i >= nwrites or writes[i]
        else:
            t = scalar_type(a)
            if t is None:
                return None
            type_ids.append(id(t))
            values.append(a)
    return type_ids, values, uses, epochs


class _ConfiguredLaunch:
    """``kernel[grid, block, stream, sharedmem]``: the stream worked out once, direct calls cached.

    A launch whose arguments are all umem_numba buffers and real or integer
    scalars goes straight to ``cuLaunchKernel`` (:class:`KernelCall`, one per
    argument types and device) once numba has compiled the kernel for those
    types; any other launch, and the first of each kind, goes through numba.
    """

    __slots__ = ("_calls", "_configured", "_handle", "_info", "_keep_key", "_key", "_stream")

    def __init__(self, configured: Any, stream: Any, info: KernelInfo) -> None:
        self._configured = configured
        self._stream = stream
        self._handle = stream_handle(stream, what="launch")
        self._info = info
        # The stream's identity (cuStreamGetId) is kept after the first tracked
        # launch only for a stream that this object holds and that owns its
        # handle (numba's own streams: destroyed only when collected).  A raw
        # handle, or a borrowed one (external streams, CuPy, PyTorch), may name
        # another stream once its owner destroys it, and the special handles
        # (legacy 0/1, per-thread 2) name a different stream per context or
        # thread: those are identified at every launch.
        self._key: int | None = None
        self._keep_key = self._handle not in (0, 1, 2) and owns_stream(stream)
        #: (ids of the argument types..., device) -> (the types, their KernelCall or None: numba launches).
        self._calls: dict[tuple[int, ...], tuple[tuple[Any, ...], KernelCall | None]] = {}

    def __call__(self, *args: Any) -> None:
        walked = _walk(self._info.writes, args)
        if walked is None:  # tuples, numba or foreign arrays, records: numba launches
            self._numba_launch(args)
            return
        type_ids, values, uses, epochs = walked
        if not uses:
            self._configured(*args)
            return
        _driver.api()  # a forked child stops here, before any driver call
        self._dispatch(args, type_ids, values, uses, epochs, _current_device(self._handle))

    def _dispatch(
        self,
        args: tuple[Any, ...],
        type_ids: list[int],
        values: list[Any],
        uses: dict[Tracker, bool],
        epochs: dict[Tracker, int],
        device: int,
    ) -> None:
        """Launch ``args`` (walked by :func:`_walk`, with buffers among them) on ``device``."""
        key = (*type_ids, device)
        entry = self._calls.get(key)
        if entry is None:
            self._issue(list(uses.items()), args, epochs=epochs)  # numba compiles for these types
            types = tuple(a._launch_arg()[1] if isinstance(a, Buffer) else scalar_type(a) for a in args)
            self._calls[key] = (types, self._direct_call(types))  # the types keep their ids valid
            return
        call = entry[1]
        if call is not None and _numba_compat.pre_launch_callbacks(self._configured):
            call = None  # numba runs its callbacks (with the compiled kernel) before launching
        self._issue(list(uses.items()), args, call, values, device, epochs)

    @property
    def pre_launch_callbacks(self) -> list[Any]:
        """numba's ``pre_launch_callbacks`` of this configured launch (``(kernel, config)`` before each launch)."""
        callbacks = _numba_compat.pre_launch_callbacks(self._configured)
        if callbacks is None:
            raise AttributeError("pre_launch_callbacks: this numba-cuda has none (they came in 0.30)")
        return callbacks

    @pre_launch_callbacks.setter
    def pre_launch_callbacks(self, callbacks: list[Any]) -> None:
        _numba_compat.set_pre_launch_callbacks(self._configured, callbacks)

    def __getattr__(self, name: str) -> Any:
        # numba's configured launch answers the rest (griddim, blockdim, stream, sharedmem...).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._configured, name)

    def _direct_call(self, types: tuple[Any, ...]) -> KernelCall | None:
        """The direct call for ``types`` on the current device, if numba compiled it and nothing forbids."""
        dispatcher = self._info.dispatcher
        kernel = _numba_compat.compiled_kernel(dispatcher, types)
        if kernel is None or not supports(dispatcher, kernel):
            return None
        griddim, blockdim, sharedmem = _numba_compat.launch_dims(self._configured)
        try:
            return KernelCall(kernel, types, griddim, blockdim, sharedmem)
        except _numba_compat.NumbaInternalsError:  # this numba-cuda hides the compiled function: numba launches
            return None

    def _numba_launch(self, args: tuple[Any, ...]) -> None:
        """Launch through numba, tracking the buffers among ``args`` (nested sequences count as written)."""
        uses = _uses(self._info, args)
        if not uses:
            self._configured(*args)
            return
        self._issue(uses, args)

    def _issue(
        self,
        uses: list[tuple[Tracker, bool]],
        args: tuple[Any, ...],
        call: KernelCall | None = None,
        values: list[Any] | None = None,
        device: int | None = None,
        epochs: dict[Tracker, int] | None = None,
    ) -> None:
        """Order the stream after conflicting work, launch (directly or through numba), record one event.

        ``epochs``: each tracker's epoch when the launch took the buffer's address (see
        :meth:`Tracker.begin_use`): a buffer closed since, whose pool memory went to the
        next buffer, is refused rather than written.
        """
        handle = self._handle
        try:
            capturing = _driver.is_capturing(handle)
        except CudaError:
            if handle > 2:
                raise
            # 0, 1 and 2 name a stream of the current context, and a thread whose first CUDA call
            # this launch is has none (with one device, nothing before asked the driver).
            _driver.ensure_context()
            capturing = _driver.is_capturing(handle)
        if capturing:
            self._capture(uses, args, call, values, handle, epochs)
            return
        key = self._key
        if key is None:
            key = _driver.stream_key(handle)
            if self._keep_key:
                self._key = key
        begun: list[tuple[Tracker, bool, tuple[_events.Event, ...]]] = []
        moves: list[Tracker] = []  # managed memory the host touched: prefetched before the kernel
        try:
            waits: list[_events.Event] = []
            for tracker, write in uses:
                wait, covered = tracker.begin_use(key, write, "launch", epochs.get(tracker) if epochs else None)
                begun.append((tracker, write, covered))
                if wait:
                    waits += wait
                if tracker.migrate:
                    moves.append(tracker)
            if waits:
                stream_wait = _driver.api().stream_wait_event
                for event in {id(e): e for e in waits}.values():
                    _driver.check(
                        stream_wait(handle, event.handle, 0),
                        "cuStreamWaitEvent",
                        "ordering a launch after conflicting work on another stream",
                    )
            if moves:
                prefetch_touched(moves, handle, _driver.current_device() if device is None else device)
            if call is None or not self._direct(call, values, handle):
                _launching.current = tuple(t for t, _ in uses)  # numba's reads of these are not escapes
                try:
                    if _sim.active():  # the simulated driver: run when the stream's work is needed
                        _driver.api().drv.queue_kernel(handle, self._configured, device_arrays(args))
                    else:
                        self._configured(*args)
                finally:
                    _launching.current = ()
        except BaseException:
            for tracker, write, _ in begun:
                tracker.end_use(key, None, write, issued=False)
            raise
        recorded: _events.Event | None = None
        try:
            recorded = _events.record(handle, _driver.current_device() if device is None else device, key)
        finally:
            for tracker, write, covered in begun:
                tracker.end_use(key, recorded, write, covered)

    def _capture(
        self,
        uses: list[tuple[Tracker, bool]],
        args: tuple[Any, ...],
        call: KernelCall | None,
        values: list[Any] | None,
        handle: int,
        epochs: dict[Tracker, int] | None,
    ) -> None:
        """The launch on a capturing stream: joins this thread's ``umem_numba.capture`` graph, or is refused.

        Nothing is ordered or recorded now (the kernel does not run now): each
        launch of the graph orders itself and files the uses noted here.
        """
        recorder = _capture.recorder_for(handle)
        if recorder is None:
            raise CoherenceError(
                "cannot launch a tracked kernel into a CUDA graph capture umem_numba did not begin: an event "
                "recorded in it cannot be waited for, and the graph would keep using memory umem_numba may "
                "free; capture with `with umem_numba.capture(stream) as graph:` and launch it with "
                "graph.launch()"
            )
        for tracker, write in uses:
            recorder.add(tracker, write, epoch=epochs.get(tracker) if epochs else None)
        recorder.keep.append(args)  # every operand lives as long as the graph
        if call is None or not self._direct(call, values, handle):
            _launching.current = tuple(t for t, _ in uses)  # numba's reads of these are not escapes
            try:
                if _sim.active():
                    _driver.api().drv.queue_kernel(handle, self._configured, device_arrays(args))
                else:
                    self._configured(*args)
            finally:
                _launching.current = ()

    def _direct(self, call: KernelCall, values: Any, handle: int) -> bool:
        """Launch through ``call``; ``False`` (and the direct calls forgotten) where numba must launch."""
        try:
            err = call.launch(values, handle)
            if err == _driver.consts().invalid_context:
                from numba import cuda

                cuda.current_context()  # a thread numba has not used yet: make the device's context current
                err = call.launch(values, handle)
        except struct.error:  # a scalar outside its type's range: numba's typing decides
            return False
        if err == 0:
            return True
        # Nothing was launched: a module unloaded by a context reset, or a
        # configuration numba rejects with its own message.  numba launches.
        self._calls.clear()
        return False


# ---------------------------------------------------------------------------
# Streams numba's launch does not take


def _numba_config(config: tuple[Any, ...], stream: Any) -> tuple[Any, ...]:
    """``config`` with its stream as numba's launch takes it (see :func:`_launch_stream`)."""
    native = _launch_stream(stream)
    if native is stream:
        return config
    return (config[0], config[1], native, *config[3:])


def _launch_stream(stream: Any) -> Any:
    """``stream`` as numba's launch takes it: numba's own kinds and ``0``/``None`` unchanged, others wrapped.

    numba-cuda's launch takes only its own ``Stream``, a cuda.core stream, a
    graph builder or ``0``: a CuPy or PyTorch stream, any other object with
    ``__cuda_stream__`` and a raw handle become a numba external stream over
    the same handle, made once per stream object (held weakly) or per raw
    handle, so that numba's configuration cache hits as well.  The
    per-thread handle 2 names each thread's own stream: its wrapper is made
    per thread.
    """
    if stream is None or _sim.active():  # the simulator runs every launch in order, on no stream
        return stream
    if type(stream) is int:
        return 0 if stream == 0 else _external_for_handle(stream_handle(stream, what="launch"))
    native, _ = stream_classes()
    if isinstance(stream, native):
        return stream
    known = _external_streams.get(id(stream))
    if known is not None and known[0]() is stream:
        return known[1]
    handle = stream_handle(stream, what="launch")
    if handle == 0:
        return 0
    if handle in (1, 2):
        return _external_for_handle(handle)
    try:
        ref = weakref.ref(stream)
    except TypeError:  # no weak references (a numpy integer): one wrapper per handle
        return _external_for_handle(handle)
    wrapped = _make_external_stream(handle)
    if len(_external_streams) >= _EXTERNAL_KEPT:
        _external_streams.clear()
    _external_streams[id(stream)] = (ref, wrapped)
    return wrapped


def _external_for_handle(handle: int) -> Any:
    """The one numba external stream over a raw ``handle`` (for handle 2: this thread's)."""
    if handle == 2:
        wrapped = getattr(_per_thread, "stream", None)
        if wrapped is None:
            wrapped = _per_thread.stream = _make_external_stream(2)
        return wrapped
    wrapped = _external_handles.get(handle)
    if wrapped is None:
        if len(_external_handles) >= _EXTERNAL_KEPT:
            _external_handles.clear()
        wrapped = _external_handles[handle] = _make_external_stream(handle)
    return wrapped


def _make_external_stream(handle: int) -> Any:
    from numba import cuda

    return cuda.external_stream(handle)


#: Foreign stream objects by id, with a weak reference that proves the id -> numba external stream.
_external_streams: dict[int, tuple[weakref.ref[Any], Any]] = {}
#: Raw handles -> numba external stream (the per-thread handle 2 lives in ``_per_thread``).
_external_handles: dict[int, Any] = {}
_per_thread = threading.local()
_EXTERNAL_KEPT = 256


def _current_device(handle: int = 0) -> int:
    """The device of a launch on stream ``handle`` (:func:`umem_numba._driver.launch_device`)."""
    try:
        return _driver.launch_device(handle)
    except CudaError:  # no current context in this thread yet: numba makes the device's current
        from numba import cuda

        cuda.current_context()
        return _driver.launch_device(handle)


def launch(kernel: Any, griddim: Any, blockdim: Any, *args: Any, stream: Any = 0, sharedmem: int = 0) -> None:
    """Launch a numba CUDA kernel, ordered and recorded on every buffer argument.

    Parameters
    ----------
    kernel : numba CUDA dispatcher or CoherentKernel
        A ``@cuda.jit`` kernel.
    griddim, blockdim : int or tuple
        Launch configuration, as in ``kernel[griddim, blockdim]``.
    *args
        Kernel arguments; umem_numba buffers (and views) among them are tracked.
    stream : numba stream, CuPy/PyTorch stream, object with ``__cuda_stream__``, int handle, 0 or None
        The launch stream (``0``/``None``: the legacy default stream).
    sharedmem : int
        Dynamic shared memory in bytes.

    Raises
    ------
    CoherenceError
        A buffer argument is held by the host (:meth:`ManagedBuffer.on_host`),
        or the stream is capturing a CUDA graph.

    Notes
    -----
    Nothing is synchronised on the host: the stream waits on the device for
    conflicting work on other streams, and the launch records one CUDA event
    that later host access waits for.
    """
    coherent(kernel)[griddim, blockdim, stream, sharedmem](*args)


_CONFIG_CACHE_SIZE = 64


class CoherentKernel:
    """A numba kernel whose launches are ordered and recorded by umem_numba's coherence.

    Use it exactly like the kernel: ``k[grid, block, stream, sharedmem](*args)``.
    Other attributes (``py_func``, ``overloads``, ``inspect_*``...) are the
    wrapped kernel's.

    Parameters
    ----------
    kernel : numba CUDA dispatcher
        The ``@cuda.jit`` kernel to wrap.
    readonly : iterable of str, optional
        Names of the parameters the kernel never writes (their buffers stay
        readable by other streams concurrently).  Default: inferred from the
        kernel's source, every parameter counting as written where that is
        not available.
    """

    __slots__ = ("_configs", "_forall_blocks", "_foralls", "_info", "kernel")

    def __init__(self, kernel: Any, readonly: Iterable[str] | None = None) -> None:
        if not hasattr(kernel, "__getitem__") or not hasattr(kernel, "py_func"):
            raise TypeError(f"coherent() needs a numba @cuda.jit kernel, got {type(kernel).__name__}")
        self.kernel = kernel
        self._info = KernelInfo(kernel, readonly)
        self._configs: dict[tuple[Any, ...], _ConfiguredLaunch] = {}
        #: (ids of the argument types..., device, sharedmem) -> (the types, the block size forall
        #: picked by the occupancy API).
        self._forall_blocks: dict[tuple[Any, ...], tuple[tuple[Any, ...], int]] = {}
        #: forall() objects by (ntasks, tpb, stream, sharedmem): a loop of forall launches builds one.
        self._foralls: dict[tuple[Any, ...], CoherentForAll] = {}

    @property
    def writes(self) -> dict[str, bool]:
        """For each parameter, whether a launch counts as writing it."""
        return dict(zip(self._info.params, self._info.writes, strict=True))

    def __getitem__(self, config: Any) -> _ConfiguredLaunch:
        if not isinstance(config, tuple) or not 2 <= len(config) <= 4:
            raise ValueError("launch configuration must be [griddim, blockdim[, stream[, sharedmem]]]")
        stream = config[2] if len(config) > 2 else 0
        # A raw handle is cached by its value (each int object is new), and
        # the per-thread handle 2 per thread; any other stream by identity.
        raw = type(stream) is int
        try:
            key = (
                config[0],
                config[1],
                stream if raw else id(stream),
                config[3] if len(config) > 3 else 0,
                raw,
                threading.get_ident() if raw and stream == 2 else 0,
            )
            cached = self._configs.get(key)
        except TypeError:  # unhashable dimensions (lists): no caching
            return _ConfiguredLaunch(self.kernel[_numba_config(config, stream)], stream, self._info)
        if cached is None or (not raw and cached._stream is not stream):
            configured = self.kernel[_numba_config(config, stream)]
            cached = _ConfiguredLaunch(configured, stream, self._info)
            if configured is self.kernel:
                return cached  # numba's simulator configures the kernel object itself: never reuse
            if len(self._configs) >= _CONFIG_CACHE_SIZE:
                self._configs.clear()
            self._configs[key] = cached
        return cached

    def forall(self, ntasks: int, tpb: int = 0, stream: Any = 0, sharedmem: int = 0) -> CoherentForAll:
        """A launch of at least ``ntasks`` threads, ordered and recorded like ``kernel[grid, block, stream]``.

        numba's ``forall``, tracked: the block size is ``tpb``, or (0) the one
        numba picks (the occupancy API's largest, for the kernel compiled for
        the arguments; found once per argument types and device), and the
        grid covers ``ntasks``.  The launch itself is ``self[grid, tpb,
        stream, sharedmem](*args)``: ordered after conflicting work on other
        streams and recorded on ``stream``, so host access waits for that
        stream only.  Under numba's simulator, with ``tpb`` 0, the
        configuration is the simulator's own (``ntasks`` blocks of one thread).

        Parameters
        ----------
        ntasks : int
            Threads wanted (the kernel checks its bounds: the grid is rounded up).
        tpb : int, optional
            Threads per block (0: numba's choice).
        stream : stream-like, optional
            The launch stream (default 0, as numba's).
        sharedmem : int, optional
            Dynamic shared memory per block, in bytes.

        Returns
        -------
        CoherentForAll
            Call it with the kernel's arguments.

        Raises
        ------
        ValueError
            ``ntasks``, ``tpb`` or ``sharedmem`` is negative.
        TypeError
            One of them is not an integer.
        """
        raw = type(stream) is int
        if type(ntasks) is int and type(tpb) is int and type(sharedmem) is int:  # bools and others: checked
            key = (ntasks, tpb, stream if raw else id(stream), sharedmem, raw and stream == 2 and threading.get_ident())
            cached = self._foralls.get(key)
            if cached is not None and (raw or cached.stream is stream):
                return cached
            made = CoherentForAll(self, ntasks, tpb, stream, sharedmem)
            if len(self._foralls) >= _CONFIG_CACHE_SIZE:
                self._foralls.clear()
            self._foralls[key] = made
            return made
        return CoherentForAll(self, ntasks, tpb, stream, sharedmem)

    def _forall_block(self, args: tuple[Any, ...], sharedmem: int) -> int:
        """numba's forall block size for ``args`` (found once per argument types, device and ``sharedmem``)."""
        types = tuple(a._launch_arg()[1] if isinstance(a, Buffer) else self._typeof(a) for a in args)
        # numba types are interned: their ids name them, cheaply hashed (the entry keeps them alive)
        key = (*map(id, types), _current_device(), sharedmem)
        entry = self._forall_blocks.get(key)
        if entry is None:
            entry = self._forall_blocks[key] = (types, _numba_compat.forall_block_size(self.kernel, types, sharedmem))
        return entry[1]

    def _typeof(self, value: Any) -> Any:
        t = scalar_type(value)
        return t if t is not None else self.kernel.typeof_pyval(value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel(*args, **kwargs)  # numba raises its own "missing launch config" error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __repr__(self) -> str:
        return f"CoherentKernel({self.kernel!r})"


class CoherentForAll:
    """``kernel.forall(ntasks, tpb, stream, sharedmem)`` of a :class:`CoherentKernel`: call it to launch.

    See :meth:`CoherentKernel.forall`.
    """

    __slots__ = ("_handle", "_launches", "kernel", "ntasks", "sharedmem", "stream", "tpb")

    def __init__(self, kernel: CoherentKernel, ntasks: int, tpb: int, stream: Any, sharedmem: int) -> None:
        for name, value in (("ntasks", ntasks), ("tpb", tpb), ("sharedmem", sharedmem)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"forall: {name} must be an integer, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"forall: {name} must not be negative, got {value}")
        self._handle = stream_handle(stream, what="forall")  # a bad stream is refused here, as kernel[...] refuses it
        self.kernel = kernel
        self.ntasks = int(ntasks)
        self.tpb = int(tpb)
        self.stream = stream
        self.sharedmem = int(sharedmem)
        #: (ids of the argument types..., device) -> (the types, the configured launch of the block
        #: size numba picks for them): a loop of calls walks its arguments once per call.
        self._launches: dict[tuple[int, ...], tuple[tuple[Any, ...], _ConfiguredLaunch]] = {}

    def __call__(self, *args: Any) -> None:
        n = self.ntasks
        if n == 0:  # nothing to launch; a closed or host-only buffer is refused all the same
            for a in args:
                if isinstance(a, Buffer):
                    a._launch_arg()
            return
        if _sim.active():
            # numba's simulator configures forall as ntasks blocks of one thread (its threads are Python's),
            # and configures the kernel object itself: a configured launch is never kept there.
            tpb = self.tpb
            self.kernel[(n + tpb - 1) // tpb if tpb else n, tpb or 1, self.stream, self.sharedmem](*args)
            return
        walked = _walk(self.kernel._info.writes, args)
        if walked is None or not walked[2]:  # numba launches, or no buffer to track
            tpb = self.tpb or self.kernel._forall_block(args, self.sharedmem)
            self._configured(tpb)(*args)
            return
        type_ids, values, uses, epochs = walked
        _driver.api()  # a forked child stops here, before any driver call
        device = _current_device(self._handle)
        key = (*type_ids, device)
        entry = self._launches.get(key)
        if entry is None:
            tpb = self.tpb or self.kernel._forall_block(args, self.sharedmem)
            types = tuple(a._launch_arg()[1] if isinstance(a, Buffer) else scalar_type(a) for a in args)
            if len(self._launches) >= _CONFIG_CACHE_SIZE:
                self._launches.clear()
            entry = self._launches[key] = (types, self._configured(tpb))  # the types keep their ids valid
        entry[1]._dispatch(args, type_ids, values, uses, epochs, device)

    def _configured(self, tpb: int) -> _ConfiguredLaunch:
        return self.kernel[(self.ntasks + tpb - 1) // tpb, tpb, self.stream, self.sharedmem]

    def __repr__(self) -> str:
        return f"CoherentForAll({self.kernel!r}, ntasks={self.ntasks}, tpb={self.tpb}, stream={self.stream!r})"


def coherent(kernel: Any, *, readonly: Iterable[str] | None = None) -> CoherentKernel:
    """Wrap a numba kernel so that its launches are ordered and recorded (see :class:`CoherentKernel`).

    Parameters
    ----------
    kernel : numba CUDA dispatcher or CoherentKernel
    readonly : iterable of str, optional
        Parameters the kernel never writes (default: inferred).

    Returns
    -------
    CoherentKernel
    """
    if isinstance(kernel, CoherentKernel) and readonly is None:
        return kernel
    if isinstance(kernel, CoherentKernel):
        kernel = kernel.kernel
    wrapped = getattr(kernel, "_umem_coherent", None)
    if isinstance(wrapped, CoherentKernel) and readonly is None:
        return wrapped
    out = CoherentKernel(kernel, readonly)
    if readonly is None:
        try:
            kernel._umem_coherent = out  # one wrapper per kernel: launch() reuses its cache
        except AttributeError:
            pass
    return out


def jit(func_or_sig: Any = None, *, readonly: Iterable[str] | None = None, **options: Any) -> Any:
    """``numba.cuda.jit`` whose kernels are :func:`coherent`.

    Use as ``@umem_numba.jit`` or ``@umem_numba.jit(signature, **options)``;
    options are numba's.  Device functions (``device=True``) are returned
    unwrapped: they are not launched.

    Parameters
    ----------
    func_or_sig : function, signature or None
        As for ``numba.cuda.jit``.
    readonly : iterable of str, optional
        Parameters the kernel never writes (default: inferred).
    **options
        numba's options.

    Returns
    -------
    CoherentKernel, or a decorator making one
    """
    from numba import cuda as nbcuda

    def wrap(obj: Any) -> Any:
        return obj if options.get("device") else coherent(obj, readonly=readonly)

    if func_or_sig is None:
        return lambda f: wrap(nbcuda.jit(**options)(f))
    if callable(func_or_sig) and not isinstance(func_or_sig, (str, list, tuple)):
        return wrap(nbcuda.jit(func_or_sig, **options))
    inner = nbcuda.jit(func_or_sig, **options)
    return lambda f: wrap(inner(f))
