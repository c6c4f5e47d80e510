"""Launching kernels with coherence: ordered on the device, one event per launch.

:func:`launch`, :func:`coherent` and :func:`jit` launch a numba kernel and, for
every umem_numba buffer among the arguments (views included):

1. order the launch stream, on the device, after conflicting toolkit work on
   other streams (``cuStreamWaitEvent``; a read waits for the last write, a
   write for the last write and the reads since; see :mod:`umem_numba._tracker`);
2. record one CUDA event after the kernel and file it under the buffer, as a
   read or a write.

Nothing waits on the host.  Which arguments a kernel only reads is inferred
from its Python source (an argument that is only indexed for loading, or
asked for ``shape``/``dtype``/``size``/``ndim``/``strides``, is read-only;
anything else, including passing it to a device function, counts as a write),
or declared with ``readonly=`` (which then replaces the inference).

Launches into a CUDA graph capture are refused: an event recorded inside a
capture cannot be waited for, and the graph would keep using memory the
toolkit does not know is referenced.
"""

from __future__ import annotations

import ast
import inspect
import struct
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from . import _driver, _events
from ._buffer import Buffer, device_arrays
from ._errors import CoherenceError, CudaError
from ._kernel_call import KernelCall, scalar_type, supports
from ._location import stream_handle
from ._tracker import Tracker, _launching

__all__ = ["CoherentKernel", "coherent", "jit", "launch"]

#: Array attributes that read no element.
_META = frozenset({"shape", "size", "ndim", "dtype", "strides", "itemsize", "nbytes"})


# ---------------------------------------------------------------------------
# Which arguments a kernel writes


#: Calls that read their arguments and cannot write an array passed to them.
_READING_CALLS = frozenset({"range", "len", "min", "max", "abs", "int", "float", "bool", "complex", "round"})
#: Expressions whose operands are only read.
_READING_PARENTS = (
    ast.BinOp,
    ast.UnaryOp,
    ast.Compare,
    ast.BoolOp,
    ast.IfExp,
    ast.If,
    ast.While,
    ast.Assert,
    ast.FormattedValue,
)


def _reads_only(node: ast.Name, parent: ast.AST | None) -> bool:
    """Whether this use of a parameter can only read it (anything unsure counts as a write)."""
    if isinstance(parent, ast.Subscript) and parent.value is node:
        return isinstance(parent.ctx, ast.Load)  # p[i] read; p[i] = ... / p[i] += ... write
    if isinstance(parent, ast.Attribute) and parent.value is node:
        return parent.attr in _META  # p.shape and friends; a method call could write
    if isinstance(parent, ast.Call) and node in parent.args:
        func = parent.func
        return isinstance(func, ast.Name) and func.id in _READING_CALLS  # device functions may write
    if isinstance(parent, ast.For) and parent.iter is node:
        return True
    if isinstance(parent, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and parent.value is node:
        # Storing its value into an array element reads it; binding it to a name aliases it.
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        return all(isinstance(t, ast.Subscript) for t in targets)
    return isinstance(parent, _READING_PARENTS)


def _written_params(func: Callable[..., Any]) -> tuple[str, ...] | None:
    """Names of the parameters ``func`` may write (``None``: the source is unavailable: all)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except Exception:  # no source (exec'd, interactive), or none we can parse
        return None
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func.__name__]
    if not defs:
        return None
    fn = defs[0]
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(fn):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    written: set[str] = set()
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Name)
            and node.id in params
            and (isinstance(node.ctx, ast.Store) or not _reads_only(node, parents.get(id(node))))
        ):
            written.add(node.id)  # rebound, stored into, or used in a way we cannot follow
    return tuple(p for p in params if p in written)


class _KernelInfo:
    """Per kernel: for each positional argument, whether a launch may write it."""

    __slots__ = ("dispatcher", "params", "writes")

    def __init__(self, kernel: Any, readonly: Iterable[str] | None) -> None:
        self.dispatcher = kernel
        py_func = kernel.py_func
        sig = inspect.signature(py_func)
        self.params = [
            p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if readonly is not None:
            ro = {readonly} if isinstance(readonly, str) else set(readonly)
            unknown = ro - set(self.params)
            if unknown:
                raise ValueError(f"readonly names {sorted(unknown)} are not parameters of {py_func.__name__}{sig}")
            self.writes = tuple(p not in ro for p in self.params)
        else:
            written = _written_params(py_func)
            self.writes = tuple(written is None or p in written for p in self.params)

    def write(self, index: int) -> bool:
        """Whether argument ``index`` may be written (arguments past the parameters: yes)."""
        return index >= len(self.writes) or self.writes[index]


# ---------------------------------------------------------------------------
# The launch itself


def _uses(info: _KernelInfo, args: tuple[Any, ...]) -> list[tuple[Tracker, bool]]:
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


class _ConfiguredLaunch:
    """``kernel[grid, block, stream, sharedmem]``: the stream worked out once, direct calls cached.

    A launch whose arguments are all umem_numba buffers and real or integer
    scalars goes straight to ``cuLaunchKernel`` (:class:`KernelCall`, one per
    argument types and device) once numba has compiled the kernel for those
    types; any other launch, and the first of each kind, goes through numba.
    """

    __slots__ = ("_calls", "_configured", "_handle", "_info", "_key", "_stream")

    def __init__(self, configured: Any, stream: Any, info: _KernelInfo) -> None:
        self._configured = configured
        self._stream = stream  # held: its handle cannot be reused while this object lives
        self._handle = stream_handle(stream, what="launch")
        self._info = info
        # A created stream keeps its identity (looked up at the first tracked
        # launch); the special handles (legacy 0/1, per-thread 2) name a
        # different stream per context or thread.
        self._key: int | None = None
        #: (ids of the argument types..., device) -> (the types, their KernelCall or None: numba launches).
        self._calls: dict[tuple[int, ...], tuple[tuple[Any, ...], KernelCall | None]] = {}

    def __call__(self, *args: Any) -> None:
        writes = self._info.writes
        nwrites = len(writes)
        type_ids: list[int] = []  # numba types are interned: their ids name them, cheaply hashed
        values: list[Any] = []
        uses: dict[Tracker, bool] = {}
        for i, a in enumerate(args):
            if isinstance(a, Buffer):
                k = a._kparams
                if k is None or k[0].closed or a._views_can_retire:
                    k = a._launch_arg()  # checks closed, retired and host-only buffers
                type_ids.append(id(k[1]))
                values += k[2]
                tracker = k[0].tracker
                if not uses.get(tracker, False):  # a write wins over reads of one allocation
                    uses[tracker] = i >= nwrites or writes[i]
            else:
                t = scalar_type(a)
                if t is None:  # tuples, numba or foreign arrays, records: numba launches
                    self._numba_launch(args)
                    return
                type_ids.append(id(t))
                values.append(a)
        if not uses:
            self._configured(*args)
            return
        _driver.api()  # a forked child stops here, before any driver call
        device = _current_device()
        key = (*type_ids, device)
        entry = self._calls.get(key)
        if entry is None:
            self._issue(list(uses.items()), args)  # numba compiles for these types
            types = tuple(a._launch_arg()[1] if isinstance(a, Buffer) else scalar_type(a) for a in args)
            self._calls[key] = (types, self._direct_call(types))  # the types keep their ids valid
            return
        self._issue(list(uses.items()), args, entry[1], values, device)

    def _direct_call(self, types: tuple[Any, ...]) -> KernelCall | None:
        """The direct call for ``types`` on the current device, if numba compiled it and nothing forbids."""
        dispatcher = self._info.dispatcher
        kernel = dispatcher.overloads.get(types)
        if kernel is None or not supports(dispatcher, kernel):
            return None
        c = self._configured
        return KernelCall(kernel, types, c.griddim, c.blockdim, c.sharedmem)

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
    ) -> None:
        """Order the stream after conflicting work, launch (directly or through numba), record one event."""
        handle = self._handle
        if _driver.is_capturing(handle):
            raise CoherenceError(
                "cannot launch a tracked kernel into a CUDA graph capture: an event recorded in a capture "
                "cannot be waited for, and the graph would keep using memory umem_numba may free; capture "
                "with plain numba launches and keep the buffers alive (and unchanged on the host) while the "
                "graph can run"
            )
        key = self._key
        if key is None:
            key = _driver.stream_key(handle)
            if handle not in (0, 1, 2):
                self._key = key
        begun: list[tuple[Tracker, bool, tuple[_events.Event, ...]]] = []
        try:
            waits: list[_events.Event] = []
            for tracker, write in uses:
                wait, covered = tracker.begin_use(key, write, "launch")
                begun.append((tracker, write, covered))
                if wait:
                    waits += wait
            if waits:
                stream_wait = _driver.api().stream_wait_event
                for event in {id(e): e for e in waits}.values():
                    _driver.check(
                        stream_wait(handle, event.handle, 0),
                        "cuStreamWaitEvent",
                        "ordering a launch after conflicting work on another stream",
                    )
            if call is None or not self._direct(call, values, handle):
                _launching.current = tuple(t for t, _ in uses)  # numba's reads of these are not escapes
                try:
                    if _driver.api().simulated:  # numba's simulator: run when the stream's work is needed
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


def _current_device() -> int:
    try:
        return _driver.current_device()
    except CudaError:  # no current context in this thread yet: numba makes the device's current
        from numba import cuda

        cuda.current_context()
        return _driver.current_device()


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
    stream : numba stream, CuPy/PyTorch stream, 0 or None
        The launch stream.
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

    __slots__ = ("_configs", "_info", "kernel")

    def __init__(self, kernel: Any, readonly: Iterable[str] | None = None) -> None:
        if not hasattr(kernel, "__getitem__") or not hasattr(kernel, "py_func"):
            raise TypeError(f"coherent() needs a numba @cuda.jit kernel, got {type(kernel).__name__}")
        self.kernel = kernel
        self._info = _KernelInfo(kernel, readonly)
        self._configs: dict[tuple[Any, ...], _ConfiguredLaunch] = {}

    @property
    def writes(self) -> dict[str, bool]:
        """For each parameter, whether a launch counts as writing it."""
        return dict(zip(self._info.params, self._info.writes, strict=True))

    def __getitem__(self, config: Any) -> _ConfiguredLaunch:
        if not isinstance(config, tuple) or not 2 <= len(config) <= 4:
            raise ValueError("launch configuration must be [griddim, blockdim[, stream[, sharedmem]]]")
        stream = config[2] if len(config) > 2 else 0
        try:
            key = (config[0], config[1], id(stream), config[3] if len(config) > 3 else 0)
            cached = self._configs.get(key)
        except TypeError:  # unhashable dimensions (lists): no caching
            return _ConfiguredLaunch(self.kernel[config], stream, self._info)
        if cached is None or cached._stream is not stream:
            configured = self.kernel[config]
            cached = _ConfiguredLaunch(configured, stream, self._info)
            if configured is self.kernel:
                return cached  # numba's simulator configures the kernel object itself: never reuse
            if len(self._configs) >= _CONFIG_CACHE_SIZE:
                self._configs.clear()
            self._configs[key] = cached
        return cached

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel(*args, **kwargs)  # numba raises its own "missing launch config" error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __repr__(self) -> str:
        return f"CoherentKernel({self.kernel!r})"


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
