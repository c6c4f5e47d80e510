"""The fuzzer's world: its model of every allocation, its kernels, streams, watchdog and rule families.

:class:`Alloc` holds one allocation's model (a numpy array in program order, and a mask of the
elements whose value is known); a :class:`View` indexes it as the buffer it stands for is
indexed.  The kernels are the fuzzer's device work (fill, add, copy, sleep-then-fill, a kernel
whose source cannot be read), compiled once per process.  The machine that drives them is in
:mod:`support.fuzz_machine`; the race rules in :mod:`support.fuzz_races`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis.stateful import Bundle, precondition
from numba import cuda

import umem_numba as um
from support.helpers import worker_thread
from umem_numba import _driver

#: Rule families: ``core`` is always on; each other one is what a failure of that family's test is about.
FAMILIES: dict[str, str] = {
    "core": "buffers of every kind and views; um.jit fill/add/copy/sleep-then-fill on random streams; host reads "
    "and writes; copy_from_host/copy_to_host/um.copy (DMA, staged, PinnedBuffer destinations); pools; close",
    "hints": "prefetch, discard, discard_prefetch, advice and migration policies (managed memory)",
    "lend": "buf.lend(s) with a foreign consumer (DLPack stream=, CUDA Array Interface) on a third stream",
    "export": "buffer-level DLPack (stream=) and CUDA Array Interface exports to a consumer on its own stream "
    "(the buffer escapes)",
    "reentry": "host access, synchronize, on_host and close inside `with buf.lend(s):` on the same thread",
    "staging": "two threads copying through one user PinnedBuffer given as staging=",
    "capture": "operations on a stream that is capturing a CUDA graph: they work or are refused, and the "
    "capture stays valid; umem_numba.capture of tracked fills, launched then and later on any stream",
    "threads": "the same operations from worker threads (their per-thread default streams)",
    "vmm": "VMMBuffer grow and shrink",
    "plain": "plain @cuda.jit launches (numba's own launch) on random streams",
    "races": "orderings made on purpose: pool blocks and VMM ranges handed out again under queued work, several "
    "readers then a writer, a discard between writers, page-locked host memory changed after a copy, a copy "
    "within one allocation, escaped pool memory let go (tests/support/fuzz_races.py)",
    "probes": "bad arguments the docs promise a clear error for (DLPack stream values, lend(None) interfaces, "
    "zero-size prefetch/discard)",
    "numba": "numba's array habits: element reads and item/slice assignment through indexing, copy_to_device from "
    "numpy, and ptr read for a raw numba kernel on a stream of its own (the buffer escapes)",
}


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


#: ``UMEM_FUZZ_TRACE=1``: each step's description on stderr as it starts (a process that crashes in a
#: driver call leaves no shrunk program: the trace is the program up to the crash).
TRACE = os.environ.get("UMEM_FUZZ_TRACE", "").strip() not in ("", "0")
#: Seconds one step may take before it counts as a hang.
STEP_TIMEOUT = _env_float("UMEM_FUZZ_STEP_TIMEOUT", 10.0)
#: Device sleep of the sleeping writer, in nanoseconds (the simulator sleeps this long in wall-clock time).
SLEEP_NS = 2_000_000
DTYPE = np.dtype(np.int32)
#: Concurrent copies per shared-staging step.
STAGING_ROUNDS = 100
#: In the simulated driver's refusals of what it does not simulate (never umem_numba's own words).
SIMULATOR_REFUSAL = "under numba's CUDA simulator"
#: Errors a documented refusal may raise (never a raw CudaError: that names a driver call the docs do not promise).
REFUSALS = (um.CoherenceError, um.UnsupportedError)

#: numba streams (blocking: ordered with the legacy stream), non-blocking streams as CuPy/PyTorch make
#: them (numba's external_stream over cuStreamCreate(CU_STREAM_NON_BLOCKING)), the two default streams.
STREAMS = ("s1", "s2", "nb1", "nb2", "legacy", "per-thread")
NUMBA_STREAMS = ("s1", "s2")
NON_BLOCKING = ("nb1", "nb2")
KINDS = ("managed", "device", "pinned-mapped", "pinned-pool", "vmm")
#: Kinds whose memory the host can read through ``.host``.
HOST_KINDS = frozenset({"managed", "pinned-mapped", "pinned-pool"})
#: Kinds a kernel can use.
DEVICE_KINDS = frozenset({"managed", "device", "pinned-mapped", "vmm"})


#: When the current search started and when its first failing step failed (time.monotonic()).
CLOCK: dict[str, float] = {}


def first_failure() -> None:
    CLOCK.setdefault("failed", time.monotonic())


class StepHungError(AssertionError):
    """A fuzzer step did not finish within ``UMEM_FUZZ_STEP_TIMEOUT`` seconds."""


class UnexpectedError(AssertionError):
    """A step raised what the docs do not promise for it."""


@contextlib.contextmanager
def watchdog(what: str, seconds: float = STEP_TIMEOUT) -> Iterator[None]:
    """Interrupt the main thread with :class:`StepHungError` if the block runs longer than ``seconds``.

    Python's lock and condition waits are interruptible by signals on POSIX, so a step
    stuck in a wait gets the exception at the wait, with its stack.  Off the main thread
    (or where there is no SIGALRM) nothing is armed: worker-thread steps use join timeouts.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise StepHungError(f"step {what} hung: not finished after {seconds:g} s (UMEM_FUZZ_STEP_TIMEOUT)")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def page_locked(shape: tuple[int, ...], order: str = "C") -> np.ndarray:
    """numba's ``cuda.pinned_array`` (page-locked numpy memory); a plain array where it is empty.

    On a GPU numba cannot make an empty one (``memhostalloc(0)`` gives a null pointer, which numpy
    refuses), and an empty array is never copied.
    """
    if not int(np.prod(shape)):
        return np.empty(shape, DTYPE, order=order)
    return cuda.pinned_array(shape, DTYPE, order=order)


def in_worker(name: str, fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on the named worker thread and return its result; a hang is a :class:`StepHungError`."""
    future = worker_thread(name).submit(fn)
    try:
        return future.result(timeout=STEP_TIMEOUT)
    except concurrent.futures.TimeoutError:
        stacks = "".join(traceback.format_stack(_thread_frame(name))) if _thread_frame(name) else ""
        raise StepHungError(
            f"step {what} on thread {name} hung: not finished after {STEP_TIMEOUT:g} s\n{stacks}"
        ) from None


def _thread_frame(name: str) -> Any:
    for t in threading.enumerate():
        if t.name.startswith(f"umem-{name}"):
            return sys._current_frames().get(t.ident or 0)
    return None


# -- kernels (compiled on first use) ---------------------------------------------------------


class _Kernels:
    def __init__(self) -> None:
        self._k: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        k = self._k.get(name)
        if k is None:
            k = self._k[name] = _make_kernel(name)
        return k


def _make_kernel(name: str) -> Any:
    if name == "fill1":

        def fill1(a, v):
            i = cuda.grid(1)
            if i < a.shape[0]:
                a[i] = v

        return um.jit(fill1)
    if name == "fill2":

        def fill2(a, v):
            i, j = cuda.grid(2)
            if i < a.shape[0] and j < a.shape[1]:
                a[i, j] = v

        return um.jit(fill2)
    if name == "sleepfill1":

        def sleepfill1(a, v, ns):
            cuda.nanosleep(ns)
            i = cuda.grid(1)
            if i < a.shape[0]:
                a[i] = v

        return um.jit(sleepfill1)
    if name == "sleepfill2":

        def sleepfill2(a, v, ns):
            cuda.nanosleep(ns)
            i, j = cuda.grid(2)
            if i < a.shape[0] and j < a.shape[1]:
                a[i, j] = v

        return um.jit(sleepfill2)
    if name == "add1":

        def add1(dst, src, n):
            i = cuda.grid(1)
            if i < n:
                dst[i] += src[i]

        return um.jit(add1)
    if name == "add2":

        def add2(dst, src, n, m):
            i, j = cuda.grid(2)
            if i < n and j < m:
                dst[i, j] += src[i, j]

        return um.jit(add2)
    if name == "copy1":

        def copy1(dst, src, n):
            i = cuda.grid(1)
            if i < n:
                dst[i] = src[i]

        return um.jit(copy1)
    if name == "copy2":

        def copy2(dst, src, n, m):
            i, j = cuda.grid(2)
            if i < n and j < m:
                dst[i, j] = src[i, j]

        return um.jit(copy2)
    if name == "plainfill1":

        def plainfill1(a, v):
            i = cuda.grid(1)
            if i < a.shape[0]:
                a[i] = v

        return cuda.jit(plainfill1)
    if name == "plainfill2":

        def plainfill2(a, v):
            i, j = cuda.grid(2)
            if i < a.shape[0] and j < a.shape[1]:
                a[i, j] = v

        return cuda.jit(plainfill2)
    if name == "plainsleepfill1":

        def plainsleepfill1(a, v, ns):
            cuda.nanosleep(ns)
            i = cuda.grid(1)
            if i < a.shape[0]:
                a[i] = v

        return cuda.jit(plainsleepfill1)
    if name == "plainsleepfill2":

        def plainsleepfill2(a, v, ns):
            cuda.nanosleep(ns)
            i, j = cuda.grid(2)
            if i < a.shape[0] and j < a.shape[1]:
                a[i, j] = v

        return cuda.jit(plainsleepfill2)
    if name == "rowfill1":  # one dimension: nothing to index through; the same as fill1
        return _make_kernel("fill1")
    if name == "rowfill2":

        def rowfill2(a, v):
            i, j = cuda.grid(2)
            if i < a.shape[0] and j < a.shape[1]:
                a[i][j] = v  # a store through the row a[i]: a write of a all the same

        return um.jit(rowfill2)
    if name.startswith("opaquefill"):
        return _opaque_kernel(name)
    raise KeyError(name)


#: A fill kernel made from source text that inspect cannot find (as exec'd or interactive code
#: is): umem_numba cannot tell what it writes, so it must take it as writing every argument.
_OPAQUE_SOURCE = {
    "opaquefill1": "def opaquefill1(a, v):\n    i = cuda.grid(1)\n    if i < a.shape[0]:\n        a[i] = v\n",
    "opaquefill2": (
        "def opaquefill2(a, v):\n    i, j = cuda.grid(2)\n"
        "    if i < a.shape[0] and j < a.shape[1]:\n        a[i, j] = v\n"
    ),
}


def _opaque_kernel(name: str) -> Any:
    namespace: dict[str, Any] = {"cuda": cuda}
    exec(compile(_OPAQUE_SOURCE[name], f"<fuzz-generated {name}>", "exec"), namespace)
    return um.jit(namespace[name])


KERNELS = _Kernels()


def launch_config(shape: tuple[int, ...]) -> tuple[Any, Any]:
    """``(grid, block)`` covering ``shape`` (1-D or 2-D)."""
    if len(shape) == 1:
        return max(1, -(-shape[0] // 32)), 32
    return (max(1, -(-shape[0] // 8)), max(1, -(-shape[1] // 8))), (8, 8)


# -- the model --------------------------------------------------------------------------------


@dataclass(eq=False)
class Alloc:
    """One allocation (an owner buffer) and its model."""

    name: str
    kind: str
    buf: Any
    model: np.ndarray
    known: np.ndarray
    pool: str | None
    closed: bool = False
    #: A foreign library (DLPack/CAI outside a launch or lend) holds it: close() leaves the memory to it.
    escaped: bool = False
    views: list[View] = field(default_factory=list)


class View:
    """A buffer (the owner or a view of it) and how it indexes its allocation's model.

    Not a dataclass: Hypothesis prints a step's arguments with ``repr``, which is the label.
    """

    def __init__(self, alloc: Alloc, buf: Any, ops: tuple[Any, ...], label: str) -> None:
        self.alloc, self.buf, self.ops, self.label = alloc, buf, ops, label

    def __repr__(self) -> str:
        return self.label

    def model(self) -> np.ndarray:
        return apply_ops(self.alloc.model, self.ops)

    def known(self) -> np.ndarray:
        return apply_ops(self.alloc.known, self.ops)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.model().shape

    @property
    def closed(self) -> bool:
        return self.alloc.closed

    @property
    def kind(self) -> str:
        return self.alloc.kind

    def contiguous(self) -> bool:
        m = self.model()
        return bool(m.flags.c_contiguous or m.flags.f_contiguous)


def apply_ops(a: Any, ops: tuple[Any, ...]) -> Any:
    """Apply view operations (an index, or ``"T"``) to a numpy array or a buffer alike."""
    for op in ops:
        a = a.T if op == "T" else a[op]
    return a


def fmt_index(key: Any) -> str:
    if not isinstance(key, tuple):
        key = (key,)
    parts = []
    for k in key:
        if isinstance(k, slice):
            parts.append(
                f"{'' if k.start is None else k.start}:{'' if k.stop is None else k.stop}"
                + ("" if k.step in (None, 1) else f":{k.step}")
            )
        else:
            parts.append(str(k))
    return "[" + ", ".join(parts) + "]"


def overlaps(a: View, b: View) -> bool:
    """Whether two views share elements (the same allocation, overlapping element sets)."""
    return a.alloc is b.alloc and bool(np.shares_memory(a.model(), b.model()))


def values_for(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Fresh random int32 data (never zero, so that a lost write shows) drawn from ``seed``."""
    return np.random.default_rng(seed).integers(1, 1000, size=shape).astype(DTYPE)


def check_equal(actual: np.ndarray, view: View, what: str) -> None:
    expected, known = view.model(), view.known()
    actual = np.asarray(actual)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, the model says {expected.shape}"
    bad = known & (actual != expected)
    if bad.any():
        where = np.argwhere(bad)[:5]
        details = ", ".join(
            f"[{', '.join(map(str, w))}] = {actual[tuple(w)]} (expected {expected[tuple(w)]})" for w in where
        )
        raise AssertionError(
            f"{what} of {view.label} ({view.kind}) differs from the model at {int(bad.sum())} of "
            f"{int(known.sum())} known elements: {details}"
        )


def driver_event_count() -> int | None:
    """Events the (simulated) driver holds now, if it says; None where it does not."""
    drv = _driver.api().drv
    table = getattr(drv, "_events", None)
    return len(table) if isinstance(table, dict) else None


def pool_cached() -> tuple[int, int]:
    """``(free lists, reserved)``: bytes the live pools keep for later buffers, two ways.

    umem_numba's free lists hold closed buffers' blocks; a GPU driver's pool also reserves in
    chunks (32 MiB for small blocks), kept while the pool lives (the process-wide pools live on).
    The growth of either during a program is memory held, not leaked.
    """
    pools = um.stats()["pool"]
    return int(getattr(pools, "cached", 0)), int(getattr(pools, "reserved_current", 0) or 0)


def driver_allocations() -> dict[int, tuple[str, int]]:
    """The simulated driver's allocations ``{base: (kind, bytes)}`` where it says (diagnostics only)."""
    table = getattr(_driver.api().drv, "_memory", None)
    if not isinstance(table, dict):
        return {}
    return {base: (getattr(m, "kind", "?"), getattr(m, "size", -1)) for base, m in list(table.items())}


def unaccounted_events() -> int | None:
    """Driver events neither in umem_numba's event pool nor held by a live pooled event: leaked handles.

    Live events (recorded work a tracker still refers to, an internal staging area's last
    use) are accounted for; a handle that is in neither place was lost.
    """
    total = driver_event_count()
    if total is None:
        return None
    from umem_numba._memory import _events

    gc.collect()  # the only collection of a program: finalizers of escaped buffers and events run here
    pooled = sum(len(v) for v in _events._free.values())
    # type(), not isinstance(): a dead weakref.proxy among the objects (numba's RNG initialiser leaves
    # some under its simulator) raises ReferenceError when asked for its __class__.
    live = sum(1 for o in gc.get_objects() if type(o) is _events.Event)
    return total - pooled - live


# -- the machine ------------------------------------------------------------------------------


#: The rules of each family but ``core``, by method name (filled by :func:`family`).
FAMILY_RULES: dict[str, list[str]] = {}
#: How many times more often a machine picks the rules of the families it enables than a core rule.
FAMILY_WEIGHT = 4
#: Host reads (the checks) are picked this many times as often as another core rule.
READ_WEIGHT = 3


def family(name: str) -> Callable[[Any], Any]:
    """A rule of ``name``'s family: chosen only by machines that enable it (and then more often)."""

    def mark(f: Any) -> Any:
        FAMILY_RULES.setdefault(name, []).append(f.__name__)
        return precondition(lambda self: name in self.families)(f)

    return mark


#: Every buffer the machine holds (a Hypothesis bundle: rules take their operands from it).
BUFFERS = Bundle("buffers")
