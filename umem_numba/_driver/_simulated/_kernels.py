"""Kernels: queued launches of numba's simulated kernels, and running them (CUDA threads one by one where possible).

Mixed into :class:`~umem_numba._driver._simulated.SimDriver` as :class:`Kernels`.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

from ... import _numba_compat as _nc
from ..._errors import UnsupportedError
from ._common import _INVALID_HANDLE, _Error, _int
from ._memory import Allocations


class Kernels(Allocations):
    """Launches: queued on their stream, run by numba's simulator when the stream's work is needed."""

    # -- kernels: the one entry point umem_numba's launch uses ---------------------------
    def queue_plain_kernel(self, handle: Any, kernel: Any, args: tuple[Any, ...]) -> None:
        """Queue a plain numba launch (``kernel[g, b, s](...)``): as :meth:`queue_kernel`, the launch's error if not."""
        try:
            self.queue_kernel(handle, kernel, args)
        except _Error as e:
            from ..._errors import CudaError

            name = "CUDA_ERROR_INVALID_HANDLE" if e.code == _INVALID_HANDLE else ""
            raise CudaError(
                "cuLaunchKernel", e.code, name, f"a plain numba launch on stream {_int(handle):#x}"
            ) from None

    def queue_kernel(self, handle: Any, kernel: Any, args: tuple[Any, ...]) -> None:
        """Queue a launch of numba's simulated ``kernel`` (configured) on a stream.

        ``args`` holds numpy arrays over device memory where the kernel takes
        buffers: they become numba's simulator arrays when the kernel runs
        (no copies, so views and aliasing behave as on a GPU).
        """
        griddim, blockdim = kernel.grid_dim, kernel.block_dim
        shared = getattr(kernel, "dynshared_size", 0)
        name = getattr(kernel, "__name__", "kernel")

        def run() -> None:
            for lo, hi in spans:
                self._check_live(lo, hi - lo, f"kernel {name}")
            run_kernel(kernel, griddim, blockdim, shared, _fake_args(args))

        with self._lock:
            # Arrays over this driver's memory must still be allocated when the kernel runs;
            # others (numba's simulator arrays: host memory) are kept alive by the arguments.
            ours = [a for a in _arrays_in(args) if a.size and self._find(a.ctypes.data) is not None]
            spans = tuple(_extent(a) for a in ours)  # a view of negative strides starts at its last byte
            self._enqueue(handle, run, f"kernel {name}").spans = spans

    # -- what the GPU path would launch directly ---------------------------------------------
    def cuLaunchKernel(self, *args: Any) -> tuple[Any, ...]:
        raise UnsupportedError(
            "cuLaunchKernel: under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) kernels are run by the "
            "simulator (umem_numba queues them on their stream)"
        )


def _arrays_in(args: Any) -> Iterator[np.ndarray]:
    for a in args:
        if isinstance(a, np.ndarray):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _arrays_in(a)


def _extent(a: np.ndarray) -> tuple[int, int]:
    """The byte range ``[start, end)`` an array's elements lie in (strides of any sign)."""
    lo = hi = a.ctypes.data
    for stride, n in zip(a.strides, a.shape, strict=True):
        reach = stride * (n - 1)
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + a.itemsize


def fake_array(array: np.ndarray) -> Any:
    """numba's simulator array over ``array`` (no copy)."""
    return _nc.simulator_api().FakeCUDAArray(array)


def _fake_args(args: Any) -> list[Any]:
    """numpy arrays over device memory as numba's simulator arrays (no copy, unlike a numpy argument)."""
    array_class = _nc.simulator_api().FakeCUDAArray
    out: list[Any] = []
    for a in args:
        if isinstance(a, np.ndarray):
            out.append(array_class(a))
        elif isinstance(a, tuple):
            out.append(tuple(_fake_args(a)))
        elif isinstance(a, list):
            out.append(_fake_args(a))
        else:
            out.append(a)
    return out


#: What a kernel may use only with its threads running side by side (numba's simulator runs
#: one Python thread per CUDA thread for them); any other kernel runs its threads one by one.
_TOGETHER = frozenset(
    {
        "syncthreads",
        "syncthreads_count",
        "syncthreads_and",
        "syncthreads_or",
        "syncwarp",
        "shared",
        "cg",
        "this_grid",
        "shfl_sync",
        "shfl_up_sync",
        "shfl_down_sync",
        "shfl_xor_sync",
        "all_sync",
        "any_sync",
        "eq_sync",
        "ballot_sync",
        "match_any_sync",
        "match_all_sync",
        "activemask",
        "lanemask_lt",
    }
)
_ONE_BY_ONE: dict[Any, bool] = {}


def _names(code: Any) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            yield from _names(const)


def _one_by_one(fn: Any, seen: set[int] | None = None) -> bool:
    """Whether ``fn`` (and the device functions it calls) can run its CUDA threads one after another."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return True
    seen.add(id(fn))
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    names = set(_names(code))
    if names & _TOGETHER:
        return False
    values = [fn.__globals__.get(n) for n in names]
    values += [_cell(c) for c in (fn.__closure__ or ())]
    for v in values:
        inner = getattr(v, "py_func", None) if type(v).__name__ == "FakeCUDAKernel" else None
        if inner is not None and not _one_by_one(inner, seen):
            return False
    return True


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _with_module(fn: Any, module: Any) -> Any:
    """``fn`` with ``cuda`` captured from an enclosing function (a closure) bound to ``module``.

    numba's simulator swaps the kernel's global ``cuda`` only; a kernel
    defined inside a function that imported ``cuda`` there gets it here.
    Its numba scalar types (``uint64(i)``) become :func:`_fast_scalars`'s.
    """
    from numba import cuda

    closure = fn.__closure__
    fast = _fast_scalars(fn)
    if fast is None and (not closure or not any(_cell(c) is cuda for c in closure)):
        return fn
    cells = closure and tuple(types.CellType(module) if _cell(c) is cuda else c for c in closure)
    glob = fn.__globals__
    if fast is not None:
        # A copy of the globals, with ``cuda`` swapped as numba swaps it in the original (where a
        # kernel of the same module running in another thread may have put its own fake module).
        fake_module = _nc.simulator_api().FakeCUDAModule
        glob = {k: module if v is cuda or isinstance(v, fake_module) else fast.get(k, v) for k, v in glob.items()}
    return types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, cells)


_FAST_TYPES: dict[int, Any] = {}


def _fast_scalars(fn: Any) -> dict[str, Any] | None:
    """The kernel's global numba scalar types, each as a type that casts a number in a fraction of the time.

    ``uint64(i)`` in a simulated kernel calls numba's ``Type.__call__``: an
    import, an abstract-class check, then ``numpy.uint64(i)``; the stencil
    kernels index with it, and it took three quarters of their simulated
    time.  The stand-in is an instance of a subclass of the same numba type
    class with the same fields (``numpy_support.as_dtype``, ``isinstance`` and
    signatures still see a numba type); called with one number it returns
    ``getattr(numpy, name)(number)`` at once, exactly what numba's does, and
    anything else goes to numba's type itself.  None when the kernel names no
    such type.
    """
    classes = _nc.fast_scalar_type_classes()
    out: dict[str, Any] = {}
    for name in set(_names(fn.__code__)):
        v = fn.__globals__.get(name)
        if type(v) not in classes:
            continue
        fast = _FAST_TYPES.get(id(v))
        if fast is None:
            cast = getattr(np, v.name)
            base = type(v)

            def call(self: Any, *args: Any, _cast: Any = cast, _numba: Any = v) -> Any:
                if len(args) == 1 and (type(args[0]) in (int, float, bool) or isinstance(args[0], np.generic)):
                    return _cast(args[0])
                return _numba(*args)  # a signature, or numba's own error: numba's type answers

            sub = type(f"_Fast{base.__name__}", (base,), {"__call__": call})
            fast = object.__new__(sub)
            fast.__dict__.update(v.__dict__)
            _FAST_TYPES[id(v)] = fast
        out[name] = fast
    return out or None


class _Clock(threading.local):
    """Sleep requested by the CUDA threads of the kernel this thread runs one by one."""

    longest: float | None = None  # seconds; None: not running a kernel one by one
    current = 0.0


_clock = _Clock()


def _nanosleep(ns: int) -> None:
    """``cuda.nanosleep`` in a simulated kernel: the kernel takes (at least) that long."""
    if _clock.longest is None:  # numba's threads run side by side: sleep for real
        time.sleep(ns * 1e-9)
    else:
        _clock.current += ns * 1e-9


_MODULES: dict[type, type] = {}


def _one_by_one_module(base: type) -> type:
    """numba's fake ``cuda`` module with the thread's indices as plain attributes (set per CUDA thread).

    numba's looks them up through ``threading.current_thread()`` at every use.
    """
    cls = _MODULES.get(base)
    if cls is None:
        cls = type(
            "OneByOneCUDAModule",
            (base,),
            {
                "threadIdx": None,
                "blockIdx": None,
                "thread_id": 0,
                "laneid": property(lambda self: self.thread_id % 32),
            },
        )
        _MODULES[base] = cls
    return cls


def run_kernel(kernel: Any, griddim: Any, blockdim: Any, shared: int, args: list[Any]) -> None:
    """Run numba's simulated ``kernel`` over ``args`` (simulator arrays), as configured when it was queued.

    numba's simulator starts one Python thread per CUDA thread, for
    ``syncthreads`` and the warp functions.  A kernel that uses none of them
    (nor calls a device function that does) runs its CUDA threads one by one
    in this thread instead, with the same results: far faster.  Anything
    else, a debug kernel, or a numba without the pieces this needs, takes
    numba's own path.
    """
    fn = getattr(kernel, "fn", None)
    ok = _ONE_BY_ONE.get(fn)
    if ok is None:
        try:
            ok = fn is not None and not _nc.sim_kernel_debug(kernel) and not kernel.extensions and _one_by_one(fn)
        except Exception:
            ok = False
        _ONE_BY_ONE[fn] = ok
    if not ok:
        kernel.grid_dim, kernel.block_dim, kernel.dynshared_size = griddim, blockdim, shared
        call = type(kernel).__call__
        getattr(call, "_numba", call)(kernel, *args)
        return
    sim = _nc.simulator_api()
    array_class, dim3 = sim.FakeCUDAArray, sim.Dim3

    grid, block = griddim, blockdim
    module = _one_by_one_module(sim.FakeCUDAModule)(grid, block, shared)
    retr: list[Any] = []

    def fake(a: Any) -> Any:  # numba's simulator's own argument conversion
        if isinstance(a, np.ndarray) and a.ndim > 0:
            a = sim.InOut(a).to_device(retr)
        elif isinstance(a, sim.ArgHint):
            a = a.to_device(retr)
        elif isinstance(a, np.void):
            a = array_class(a)
        if isinstance(a, array_class):
            raw = _nc.sim_array_data(a)
            # A plain numpy array indexes the same, several times faster; records keep numba's
            # wrapper (it makes `a[i].x = v` write through).
            if isinstance(raw, np.ndarray) and raw.dtype.fields is None and raw.ndim:
                return raw
            return sim.FakeWithinKernelCUDAArray(a)
        return a

    fake_args = [fake(a) for a in args]
    me = threading.current_thread()
    saved = {k: me.__dict__.get(k) for k in ("threadIdx", "blockIdx", "thread_id")}
    bx, by, _ = block
    body = _with_module(fn, module)
    _clock.longest = 0.0
    threads = [(t, dim3(*t), t[0] + bx * (t[1] + by * t[2])) for t in np.ndindex(*block)]
    with _nc.sim_push_kernel_context(module), sim.swapped_cuda_module(fn, module):
        try:
            for g in np.ndindex(*grid):
                me.blockIdx = module.blockIdx = dim3(*g)  # type: ignore[attr-defined]
                for t, idx, tid in threads:
                    me.threadIdx = module.threadIdx = idx  # type: ignore[attr-defined]
                    me.thread_id = module.thread_id = tid  # type: ignore[attr-defined]
                    _clock.current = 0.0
                    try:
                        body(*fake_args)
                        _clock.longest = max(_clock.longest, _clock.current)
                    except Exception as e:
                        msg = f"tid={list(t)} ctaid={list(g)}: {e}" if str(e) else f"tid={list(t)} ctaid={list(g)}"
                        raise type(e)(msg).with_traceback(e.__traceback__) from None
        finally:
            # The CUDA threads ran side by side on a GPU: the kernel took its longest sleep.
            slept, _clock.longest = _clock.longest, None
            for k, v in saved.items():
                if v is None:
                    me.__dict__.pop(k, None)
                else:
                    me.__dict__[k] = v
    if slept:
        time.sleep(slept)
    for wb in retr:
        wb()
