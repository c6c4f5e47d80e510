"""The stateful fuzzer: random programs over umem_numba's public API, checked against a numpy model.

:class:`UmemMachine` is a Hypothesis ``RuleBasedStateMachine``.  Its state is a set of live
buffers of every kind (managed, device, mapped pinned, pinned from a pool, VMM; from pools and
not; views: slices, steps, F order, ``.T``), numba streams, the legacy and per-thread default
streams, managed/device/pinned pools and a few worker threads.  Its rules are the public
operations: um.jit kernels that read and write (fill, add, copy, sleep-then-fill) on random
streams, plain ``@cuda.jit`` launches, the copies, prefetch/discard/advice, lending to a foreign
consumer on a third stream, DLPack and CUDA Array Interface exports, pools, VMM grow and shrink,
host reads and writes, ``close`` at any point, graph capture, and a ``PrefetchPlan`` built over
several steps and executed after other steps wrote, closed or reused its buffers.

The model is **program order**: umem_numba promises that host code and later device work see
every earlier operation's effect, whatever the streams, so each allocation has one numpy array
that every operation updates at the call, plus a mask of the elements whose value is known
(a discard makes its range indeterminate; an ``empty`` buffer starts unknown).  Views index the
model array of their allocation exactly as they index the buffer.  Every host read (``.host``,
``np.asarray``, ``copy_to_host``, ``on_host``...) must equal the model where it is known.

Other invariants, per step: no step hangs (a watchdog interrupts it after
``UMEM_FUZZ_STEP_TIMEOUT`` seconds and fails with the step's stack); an error is one the docs
promise for that step (``BufferClosedError`` after ``close``, ``CoherenceError`` /
``UnsupportedError`` for work refused in a capture, ...), never a raw ``CudaError``,
``SimulatedFault`` or anything else; a capture the user began stays valid
(``cuStreamEndCapture`` gives a graph).  At the end of each program every buffer and pool is
closed and umem_numba's live counters, the driver's memory and its events are back to where
they were.

Rules belong to *families* (:data:`FAMILIES`); a machine enables ``core`` plus the families it
names, so a failure points at one area (see tests/fuzz/test_fuzz.py and docs/contributing.md).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, multiple, precondition, rule
from numba import cuda

import umem_numba as um
from support.fuzz_consumers import Capsule, memset_elements, stream_wait_stream
from support.fuzz_model import (  # the world the machine acts on
    BUFFERS,
    DEVICE_KINDS,
    DTYPE,
    FAMILIES,
    FAMILY_RULES,
    FAMILY_WEIGHT,
    HOST_KINDS,
    KERNELS,
    KINDS,
    NON_BLOCKING,
    NUMBA_STREAMS,
    READ_WEIGHT,
    REFUSALS,
    SIMULATOR_REFUSAL,
    SLEEP_NS,
    STAGING_ROUNDS,
    STEP_TIMEOUT,
    STREAMS,
    TRACE,
    Alloc,
    StepHungError,
    UnexpectedError,
    View,
    apply_ops,
    check_equal,
    driver_allocations,
    family,
    first_failure,
    fmt_index,
    in_worker,
    launch_config,
    overlaps,
    page_locked,
    pool_cached,
    unaccounted_events,
    values_for,
    watchdog,
)
from support.fuzz_races import RaceRules
from support.helpers import worker_thread
from umem_numba import _driver, _sim


@contextlib.contextmanager
def _dma_from_array(on: bool) -> Iterator[None]:
    """``ManagedBuffer.from_array`` copies by DMA at every size inside the block (``on``), as it does from 1 MiB."""
    from umem_numba._kinds import _managed

    if not on:
        yield
        return
    saved = _managed.FROM_ARRAY_DMA_MIN_BYTES
    _managed.FROM_ARRAY_DMA_MIN_BYTES = 0
    try:
        yield
    finally:
        _managed.FROM_ARRAY_DMA_MIN_BYTES = saved


class UmemMachine(RaceRules, RuleBasedStateMachine):
    """Random programs over umem_numba's public API, checked against program order (module docstring)."""

    #: Families this machine enables (besides ``core``); subclasses set it.
    ENABLED: ClassVar[frozenset[str]] = frozenset(FAMILIES)

    buffers = BUFFERS

    def __init__(self) -> None:
        super().__init__()
        self.families = frozenset({"core", *self.ENABLED})
        um.set_auto_prefetch(True)  # the default: a program that turned it off does not leak the setting
        um.set_allocation_cache(True)  # likewise
        if _sim.active():
            # Work an earlier failed program left queued runs now, not inside this one.
            _driver.api().drv.drain_quietly()
        # The previous program's teardown left everything settled and collected.
        self.baseline_stats = {k: v.live_count for k, v in um.stats().items() if hasattr(v, "live_count")}
        self.baseline_free = um.mem_info()[0]
        self.baseline_cached = pool_cached()
        self.baseline_allocations = driver_allocations()
        self.streams: dict[str, Any] = {name: cuda.stream() for name in NUMBA_STREAMS}
        for name in NON_BLOCKING:
            self.streams[name] = cuda.external_stream(int(um.driver_call("cuStreamCreate", 1, detail="fuzz")))
        self.streams["legacy"] = cuda.default_stream()
        self.streams["per-thread"] = cuda.per_thread_default_stream()
        self.pools: dict[str, um.MemoryPool] = {}
        self.allocs: list[Alloc] = []
        self.stagings: list[Any] = []
        self.counter = 0
        #: A step failed: the teardown only cleans up (its own checks would report the same defect again).
        self.failed = False
        #: The shared-staging step ran in this program (once per program: it is the slowest step).
        self.staged = False
        #: A managed pool (the fuzzer's or the driver's default) was used: see MANAGED_POOL_RESIDUE.
        self.managed_pool_used = False
        #: Live umem_numba graphs kept for later launches: (graph, the view it writes, the value it
        #: fills, or the view it copies from).
        self.graphs: list[tuple[um.Graph, View, int, View | None]] = []
        #: One PrefetchPlan kept across steps, and what its entries are: (view, operation). Other
        #: steps write, close and reuse its buffers' memory before it runs (again).
        self.plan = um.PrefetchPlan()
        self.plan_entries: list[tuple[View, str]] = []

    # -- helpers -----------------------------------------------------------------------------
    def stream(self, name: str) -> Any:
        return self.streams[name]

    def handle(self, name: str) -> int:
        """The raw handle of a stream: what a foreign library would pass (the legacy stream as 0)."""
        return um.stream_handle(self.streams[name])

    def dlpack_stream(self, name: str) -> int:
        """The DLPack ``stream=`` value of a stream: 1 legacy, 2 per-thread, else the handle."""
        return {"legacy": 1, "per-thread": 2}.get(name, self.handle(name))

    def pool(self, kind: str) -> um.MemoryPool:
        p = self.pools.get(kind)
        if p is None:
            p = self.pools[kind] = um.MemoryPool(kind)
        self.managed_pool_used |= kind == "managed"
        return p

    def new_name(self, prefix: str = "b") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def register(self, kind: str, buf: Any, known: bool, pool: str | None, values: np.ndarray | None = None) -> View:
        name = self.new_name()
        shape, order = buf.shape, ("F" if buf.is_f_contiguous and not buf.is_c_contiguous else "C")
        model = np.zeros(shape, DTYPE, order=order) if values is None else np.array(values, DTYPE, order=order)
        alloc = Alloc(name, kind, buf, model, np.full(shape, known, bool, order=order), pool)
        self.allocs.append(alloc)
        view = View(alloc, buf, (), name)
        alloc.views.append(view)
        return view

    @contextlib.contextmanager
    def step(self, what: str, *views: View, allowed: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Run a step under the watchdog; a closed operand must raise BufferClosedError, other errors fail.

        ``allowed`` are errors the docs promise for this step; raising one is fine (the
        step's model update, after the ``yield``, does not happen then).
        """
        closed = any(v.closed for v in views)
        if TRACE:  # flushed before the step: a crash in the driver leaves the program up to here
            sys.stderr.write(f"[fuzz step] {what}\n")
            sys.stderr.flush()
        try:
            with watchdog(what), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield
            if TRACE:
                sys.stderr.write(f"[fuzz step]   free memory {um.mem_info()[0] - self.baseline_free:+d} bytes\n")
            for w in caught:
                if issubclass(w.category, RuntimeWarning) and "umem_numba" in str(w.message):
                    # umem_numba reports a failed release as a warning (a finalizer must not raise):
                    # device work still used memory that was freed under it.
                    raise AssertionError(f"{what}: {w.category.__name__}: {w.message}")
        except um.BufferClosedError:
            if closed or um.BufferClosedError in allowed:
                raise _RefusedError() from None
            raise
        except allowed as exc:
            if isinstance(exc, um.UnsupportedError) and SIMULATOR_REFUSAL in str(exc):
                # The simulated driver refusing a call it cannot simulate (inside a capture: a call
                # the capture would have recorded on a GPU) is not umem_numba's documented refusal.
                self.failed = True
                first_failure()
                raise UnexpectedError(
                    f"{what}: a driver call reached the simulated driver, which refused it: {exc}"
                ) from exc
            raise _RefusedError() from None
        except (StepHungError, AssertionError):
            self.failed = True
            first_failure()
            raise
        except Exception as exc:
            self.failed = True
            first_failure()
            raise UnexpectedError(f"{what}: unexpected {type(exc).__name__}: {exc}") from exc
        if closed:
            raise AssertionError(f"{what}: an operand was closed, but no BufferClosedError was raised")

    def run(self, what: str, *views: View, allowed: tuple[type[BaseException], ...] = ()) -> Any:
        """A decorator-like helper: ``with self.attempt(...)`` that swallows documented refusals."""
        return _Attempt(self, what, views, allowed)

    def writable_pair(self, data: Any, dst: View, kinds: frozenset[str]) -> View | None:
        """A view with dst's number of dimensions, not overlapping it, of one of ``kinds`` (drawn)."""
        candidates = [
            v
            for a in self.allocs
            for v in a.views
            if v.kind in kinds and len(v.shape) == len(dst.shape) and not overlaps(v, dst)
        ]
        if not candidates:
            return None
        return data.draw(st.sampled_from(candidates), label="src")

    def attach(self, alloc: Alloc, buf: Any, ops: tuple[Any, ...], label: str) -> View:
        view = View(alloc, buf, ops, label)
        alloc.views.append(view)
        return view

    def mark_discarded(self, view: View) -> None:
        # The driver rounds a discard to whole pages: the whole allocation (tiny here) may be garbage.
        view.alloc.known[...] = False
        if view.alloc.pool is not None and not _sim.active():
            for a in self.allocs:  # on a GPU, pool neighbours can share the discarded pages
                if a.pool == view.alloc.pool:
                    a.known[...] = False

    # -- set-up --------------------------------------------------------------------------------
    @initialize(sim_seed=st.integers(0, 2**32 - 1), spread=st.sampled_from((0.0, 0.3, 0.7)))
    def reseed(self, sim_seed: int, spread: float) -> None:
        """The simulated driver's order of stream work, drawn with the program (so a replay is exact).

        ``spread``: how often independent streams run ahead of what a synchronisation needs (0: work
        runs as late as possible; more: an unordered writer may overtake a reader queued before it).
        """
        if _sim.active():
            _driver.api().drv.reseed(sim_seed, spread=spread)

    # -- buffers ---------------------------------------------------------------------------------
    @rule(
        target=buffers,
        kind=st.sampled_from(KINDS),
        shape=st.one_of(
            st.tuples(st.integers(0, 24)),
            st.tuples(st.integers(1, 6), st.integers(1, 6)),
        ),
        order=st.sampled_from("CF"),
        init=st.sampled_from(("empty", "zeros", "from_array")),
        pooled=st.booleans(),
        stream=st.sampled_from(STREAMS),
        seed=st.integers(0, 2**16),
        shortcut=st.sampled_from(("", "", "fn", "like")),
    )
    def new_buffer(
        self,
        kind: str,
        shape: tuple[int, ...],
        order: str,
        init: str,
        pooled: bool,
        stream: str,
        seed: int,
        shortcut: str = "",
    ) -> Any:
        """A buffer of any kind, by its constructor or (managed, device) its shortcut: ``managed_empty/zeros/from``,
        ``device_empty/zeros/from``, or ``managed_like``/``device_like`` of a template for an ``empty`` one."""
        values = values_for(seed, shape)
        s = self.stream(stream)
        pool = None
        kw: dict[str, Any] = {}
        if kind == "managed":
            cls: Any = um.ManagedBuffer
            if pooled:
                pool = "managed"
                kw = {"pool": self.pool("managed"), "stream": s}
            elif init != "zeros":
                kw = {"stream": s}
        elif kind == "device":
            cls = um.DeviceBuffer
            kw = {"stream": s}
            if pooled:
                pool = "device"
                kw["pool"] = self.pool("device")
        elif kind == "pinned-mapped":
            cls = um.PinnedBuffer
            kw = {"flags": um.HostAllocFlags.DEVICEMAP}
        elif kind == "pinned-pool":
            cls = um.PinnedBuffer
            pool = "pinned"
            kw = {"pool": self.pool("pinned"), "stream": s}
        else:
            cls = um.VMMBuffer
            if init == "zeros":
                kw = {"stream": s}
        prefix = {um.ManagedBuffer: "managed", um.DeviceBuffer: "device"}.get(cls)
        if prefix is None or (init == "zeros" and shortcut == "like"):
            shortcut = ""
        if shortcut == "like" and init != "empty":
            shortcut = "fn"
        made_by = f"{cls.__name__}.{init}"
        if shortcut:
            made_by = f"um.{prefix}_{'like' if shortcut == 'like' else {'from_array': 'from'}.get(init, init)}"
        # Half of the managed from_array sources take the DMA path of 1 MiB and more at any size (the
        # seed decides, so that the programs the seeds stand for draw as before).
        dma = kind == "managed" and init == "from_array" and seed % 2 == 0
        with (
            self.step(f"{made_by}({shape}, order={order!r}, pool={pool}{', by DMA' if dma else ''})"),
            _dma_from_array(dma),
        ):
            src = np.asfortranarray(values) if order == "F" else values
            if shortcut == "like":
                buf = getattr(um, f"{prefix}_like")(src, **kw)  # the template's shape, dtype and order
            elif shortcut:
                fn = getattr(um, made_by.removeprefix("um."))
                buf = fn(src, **kw) if init == "from_array" else fn(shape, DTYPE, order=order, **kw)
            elif init == "from_array":
                buf = cls.from_array(src, **kw)
            else:
                buf = getattr(cls, init)(shape, DTYPE, order=order, **kw)
        view = self.register(kind, buf, init != "empty", pool, values if init == "from_array" else None)
        return view

    @precondition(lambda self: any(not a.closed for a in self.allocs))
    @rule(target=buffers, src=buffers, data=st.data())
    def take_view(self, src: View, data: Any) -> Any:
        """A slice (with steps), an integer index, or ``.T`` of a live view."""
        if src.closed or src.kind == "vmm":
            return multiple()  # VMM views retire on shrink: the VMM family keeps whole buffers
        shape = src.shape
        how = data.draw(st.sampled_from(("slice", "T", "index")), label="how")
        if how == "T":
            if len(shape) < 2:
                return multiple()
            key: Any = "T"
            label = f"{src.label}.T"
        elif how == "index":
            if len(shape) < 2 or shape[0] == 0:
                return multiple()
            key = data.draw(st.integers(0, shape[0] - 1), label="row")
            label = f"{src.label}{fmt_index(key)}"
        else:
            parts = []
            for n in shape:
                start = data.draw(st.integers(0, max(n - 1, 0)), label="start")
                stop = data.draw(st.integers(start, n), label="stop")
                step = data.draw(st.sampled_from((1, 1, 2, 3)), label="step")
                parts.append(slice(start, stop, step))
            key = tuple(parts)
            label = f"{src.label}{fmt_index(key)}"
        with self.step(f"view {label}", src):
            buf = src.buf.T if key == "T" else src.buf[key]
        return self.attach(src.alloc, buf, (*src.ops, key), label)

    @rule(view=buffers)
    def close(self, view: View) -> None:
        """Close the allocation the view belongs to (the owner), at any point."""
        alloc = view.alloc
        with self.run(f"{alloc.name}.close()"):
            alloc.buf.close()
        alloc.closed = True

    @rule(kind=st.sampled_from(("device", "managed", "pinned")))
    def close_pool(self, kind: str) -> None:
        """``MemoryPool.close()`` while buffers of the pool may still live (and work on them be queued):
        they stay valid; the pool's next use makes a new pool."""
        pool = self.pools.pop(kind, None)
        if pool is None:
            return
        with self.run(f"{kind} pool.close() with its buffers alive"):
            pool.close()

    @rule(op=st.sampled_from(("release", "release", "off", "on")))
    def allocation_cache(self, op: str) -> None:
        """The allocation cache of buffers made without ``pool=``: released, or switched off / on, while
        buffers live and work on them may be queued (closed buffers' memory is reused by the next buffer
        of its size; the model says every buffer's contents stay its own)."""
        call = "release_allocation_cache()" if op == "release" else f"set_allocation_cache({op == 'on'})"
        with self.run(f"um.{call}"):
            if op == "release":
                um.release_allocation_cache()
            else:
                um.set_allocation_cache(op == "on")

    # -- kernels ------------------------------------------------------------------------------
    @rule(
        view=buffers,
        value=st.integers(1, 1000),
        stream=st.sampled_from(STREAMS),
        variant=st.sampled_from(("", "sleep", "opaque", "row")),
        forall=st.booleans(),
    )
    def kernel_fill(self, view: View, value: int, stream: str, variant: str, forall: bool) -> None:
        """um.jit: fill; after a device sleep (so that a missing wait shows), from source umem_numba
        cannot read (``opaque``: it must count as a writer), or through rows (``a[i][j] = v``).
        A 1-D fill launches as ``k[grid, block, stream]`` or as ``k.forall(n, stream=stream)``."""
        if view.kind not in DEVICE_KINDS or len(view.shape) not in (1, 2):
            return
        nd = len(view.shape)
        k = KERNELS.get(f"{variant}fill{nd}")
        args = (view.buf, value, SLEEP_NS) if variant == "sleep" else (view.buf, value)
        if forall and nd == 1:
            with self.run(f"{k.__name__}.forall({view.shape[0]}, stream={stream})({view.label}, {value})", view):
                k.forall(view.shape[0], stream=self.stream(stream))(*args)
                view.model()[...] = value
                view.known()[...] = True
            return
        grid, block = launch_config(view.shape)
        with self.run(f"{k.__name__}[{stream}]({view.label}, {value})", view):
            k[grid, block, self.stream(stream)](*args)
            view.model()[...] = value
            view.known()[...] = True

    @rule(dst=buffers, data=st.data(), stream=st.sampled_from(STREAMS), op=st.sampled_from(("add", "copy")))
    def kernel_binary(self, dst: View, data: Any, stream: str, op: str) -> None:
        """um.jit: ``dst += src`` or ``dst = src`` over the overlapping index range of two views."""
        if dst.kind not in DEVICE_KINDS or len(dst.shape) not in (1, 2):
            return
        src = self.writable_pair(data, dst, DEVICE_KINDS)
        if src is None:
            return
        nd = len(dst.shape)
        region = tuple(slice(0, min(a, b)) for a, b in zip(dst.shape, src.shape, strict=True))
        sizes = [min(a, b) for a, b in zip(dst.shape, src.shape, strict=True)]
        k = KERNELS.get(f"{op}{nd}")
        grid, block = launch_config(tuple(sizes))
        with self.run(f"{op}{nd}[{stream}]({dst.label}, {src.label})", dst, src):
            k[grid, block, self.stream(stream)](dst.buf, src.buf, *sizes)
            dm, sm = dst.model(), src.model()
            dk, sk = dst.known(), src.known()
            if op == "add":
                dm[region] += sm[region]
                dk[region] &= sk[region]
            else:
                dm[region] = sm[region]
                dk[region] = sk[region]

    @family("plain")
    @rule(view=buffers, value=st.integers(1, 1000), stream=st.sampled_from(STREAMS), sleep=st.booleans())
    def plain_launch(self, view: View, value: int, stream: str, sleep: bool) -> None:
        """numba's own launch of a plain @cuda.jit kernel, sleeping first or not (filed under its stream's mark)."""
        if view.kind not in DEVICE_KINDS or len(view.shape) not in (1, 2):
            return
        nd = len(view.shape)
        grid, block = launch_config(view.shape)
        name = f"plainsleepfill{nd}" if sleep else f"plainfill{nd}"
        with self.run(f"{name}[{stream}]({view.label}, {value})", view):
            if sleep:
                KERNELS.get(name)[grid, block, self.stream(stream)](view.buf, value, SLEEP_NS)
            else:
                KERNELS.get(name)[grid, block, self.stream(stream)](view.buf, value)
            view.model()[...] = value
            view.known()[...] = True

    # -- host access ----------------------------------------------------------------------------
    @rule(view=buffers, how=st.sampled_from(("host", "asarray", "copy_to_host", "on_host", "synchronize")))
    def host_read(self, view: View, how: str) -> None:
        """Read on the host; the values must equal the model where it is known."""
        if how in ("host", "asarray", "on_host") and view.kind not in HOST_KINDS:
            how = "copy_to_host"
        if how == "on_host" and view.kind != "managed":
            how = "host"  # on_host() holds are a ManagedBuffer's
        with self.run(f"{view.label}.{how}", view):
            if how == "host":
                got = np.array(view.buf.host)
            elif how == "asarray":
                got = np.array(np.asarray(view.buf))
            elif how == "on_host":
                with view.buf.on_host() as a:
                    got = np.array(a)
            elif how == "synchronize":
                view.buf.synchronize()
                return
            else:
                got = self.read_any(view)
            check_equal(got, view, f"{view.label}.{how}")

    def read_any(self, view: View, stream: Any = None, staging: Any = None) -> np.ndarray:
        """copy_to_host of the view, or of its owner indexed like the view where the view is strided."""
        if view.contiguous() or view.kind in HOST_KINDS:
            return view.buf.copy_to_host(stream=stream, staging=staging)
        return apply_ops(view.alloc.buf.copy_to_host(stream=stream, staging=staging), view.ops)

    @rule(view=buffers, seed=st.integers(0, 2**16), how=st.sampled_from(("host", "on_host")))
    def host_write(self, view: View, seed: int, how: str) -> None:
        """Write through ``.host`` / ``on_host()`` (managed and pinned memory)."""
        if view.kind not in HOST_KINDS:
            return
        if how == "on_host" and view.kind != "managed":
            how = "host"
        values = values_for(seed, view.shape)
        with self.run(f"{view.label}.{how}[...] = values", view):
            if how == "host":
                view.buf.host[...] = values
            else:
                with view.buf.on_host() as a:
                    a[...] = values
            view.model()[...] = values
            view.known()[...] = True

    # -- copies ---------------------------------------------------------------------------------
    @rule(
        view=buffers,
        seed=st.integers(0, 2**16),
        stream=st.sampled_from(STREAMS),
        staging=st.sampled_from(("none", "false", "true", "user")),
    )
    def copy_from_host(self, view: View, seed: int, stream: str, staging: str) -> None:
        """``buf.copy_from_host(numpy)`` (DMA, driver or staged path; a user staging PinnedBuffer)."""
        if not view.contiguous() and view.kind not in HOST_KINDS:
            return  # refused with a ValueError: documented, and not interesting every time
        values = values_for(seed, view.shape)
        stg = self.staging_arg(staging)
        # A strided view of pinned memory is written by the host, unless staging=False asks for a DMA,
        # which a strided view cannot take (a documented ValueError); one of managed memory, which a
        # device may hold, is a DMA operand and refused the same way (the copy layer's docs; ``buf[key]
        # = values`` writes it, the numba family's element_write).
        strided_dma = not view.contiguous() and (staging == "false" or view.kind == "managed")
        what = f"{view.label}.copy_from_host(values, stream={stream}, staging={staging})"
        with self.run(what, view, allowed=(ValueError,) if strided_dma else ()):
            view.buf.copy_from_host(values, stream=self.stream(stream), staging=stg)
            view.model()[...] = values
            view.known()[...] = True

    def staging_arg(self, staging: str) -> Any:
        if staging == "user":
            if not self.stagings:
                self.stagings.append(um.PinnedBuffer.empty(64, np.uint8))
            return self.stagings[0]
        return {"none": None, "false": False, "true": True}[staging]

    @rule(
        view=buffers,
        stream=st.sampled_from(STREAMS),
        staging=st.sampled_from(("none", "false", "true", "user")),
        into=st.sampled_from(("new", "numpy", "ary", "pinned")),
    )
    def copy_to_host(self, view: View, stream: str, staging: str, into: str) -> None:
        """``buf.copy_to_host()`` into a new array, a given numpy array (positional, or numba's ``ary=``), or a
        PinnedBuffer (then read)."""
        if not view.contiguous() and view.kind not in HOST_KINDS:
            return
        if into == "pinned" and not view.contiguous():
            into = "numpy"  # a PinnedBuffer destination takes a contiguous source
        stg = self.staging_arg(staging)
        s = self.stream(stream)
        with self.run(f"{view.label}.copy_to_host(into={into}, stream={stream}, staging={staging})", view):
            if into == "new":
                got = view.buf.copy_to_host(stream=s, staging=stg)
            elif into == "numpy":
                got = np.full(view.shape, -7, DTYPE)
                view.buf.copy_to_host(got, stream=s, staging=stg)
            elif into == "ary":
                got = np.full(view.shape, -7, DTYPE)
                assert view.buf.copy_to_host(ary=got, stream=s, staging=stg) is got
            else:
                order = "F" if view.model().flags.f_contiguous and not view.model().flags.c_contiguous else "C"
                out = um.PinnedBuffer.empty(view.shape, DTYPE, order=order)
                try:
                    view.buf.copy_to_host(out, stream=s)
                    got = np.array(out.host)
                finally:
                    out.close()
            check_equal(got, view, f"{view.label}.copy_to_host")

    @rule(
        dst=buffers,
        data=st.data(),
        stream=st.sampled_from(STREAMS),
        how=st.sampled_from(("um.copy", "copy_to_device", "copy_into")),
    )
    def um_copy(self, dst: View, data: Any, stream: str, how: str = "um.copy") -> None:
        """``um.copy(dst, src)``, ``dst.copy_to_device(src)`` (numba's direction) or, from a PinnedBuffer,
        ``src.copy_into(dst)``, between two contiguous views of equal shape and order."""
        if not dst.contiguous():
            return
        dm = dst.model()
        candidates = [
            v
            for a in self.allocs
            for v in a.views
            if v.shape == dst.shape
            and v.contiguous()
            and not overlaps(v, dst)
            and (v.model().flags.c_contiguous == dm.flags.c_contiguous or v.model().size <= 1)
        ]
        if not candidates:
            return
        src = data.draw(st.sampled_from(candidates), label="src")
        if how == "copy_into" and not src.kind.startswith("pinned"):
            how = "um.copy"  # copy_into is a PinnedBuffer's
        what = {
            "um.copy": f"um.copy({dst.label}, {src.label}, stream={stream})",
            "copy_to_device": f"{dst.label}.copy_to_device({src.label}, stream={stream})",
            "copy_into": f"{src.label}.copy_into({dst.label}, stream={stream})",
        }[how]
        with self.run(what, dst, src):
            s = self.stream(stream)
            if how == "um.copy":
                um.copy(dst.buf, src.buf, stream=s)
            elif how == "copy_to_device":
                dst.buf.copy_to_device(src.buf, stream=s)
            else:
                src.buf.copy_into(dst.buf, stream=s)
            dst.model()[...] = src.model()
            dst.known()[...] = src.known()

    # -- numba's array habits ---------------------------------------------------------------------
    @family("numba")
    @rule(view=buffers, data=st.data())
    def element_read(self, view: View, data: Any) -> None:
        """``buf[i, j]``: an integer per axis gives the element's value, a host read that waits for device work."""
        shape = view.shape
        if not shape or 0 in shape:
            return
        index = tuple(data.draw(st.integers(-n, n - 1), label="index") for n in shape)
        what = f"{view.label}{fmt_index(index)}"
        with self.run(what, view):
            got = view.buf[index]
            assert np.ndim(got) == 0 and not hasattr(got, "_coherence_tracker"), (
                f"{what} gave a {type(got).__name__}, not the element's value"
            )
            expected = view.model()[index]
            if view.known()[index] and got != expected:
                raise AssertionError(f"{what} ({view.kind}) read {got}, the model says {expected}")

    @family("numba")
    @rule(
        view=buffers,
        data=st.data(),
        seed=st.integers(0, 2**16),
        how=st.sampled_from(("element", "slice", "scalar")),
    )
    def element_write(self, view: View, data: Any, seed: int, how: str) -> None:
        """``buf[key] = value`` from the host: an element, or a slice per axis (any step, negative too) set to
        random values or to one scalar (broadcast); ordered after earlier device work, before later."""
        shape = view.shape
        if not shape or 0 in shape:
            return
        key: tuple[Any, ...]
        if how == "element":
            key = tuple(data.draw(st.integers(-n, n - 1), label="index") for n in shape)
        else:
            parts = []
            for n in shape:
                start = data.draw(st.integers(0, n - 1), label="start")
                stop = data.draw(st.sampled_from((None, *range(n + 1))), label="stop")
                step = data.draw(st.sampled_from((1, 1, 2, 3, -1, -2)), label="step")
                parts.append(slice(start, stop, step))
            key = tuple(parts)
        region = view.model()[key]
        value: Any = int(values_for(seed, ())) if how != "slice" else values_for(seed, np.shape(region))
        with self.run(f"{view.label}{fmt_index(key)} = {'values' if how == 'slice' else value}", view):
            view.buf[key] = value
            view.model()[key] = value
            view.known()[key] = True

    @family("numba")
    @rule(
        view=buffers,
        seed=st.integers(0, 2**16),
        stream=st.sampled_from(STREAMS),
        layout=st.sampled_from(("C", "F", "strided")),
    )
    def copy_to_device_from_numpy(self, view: View, seed: int, stream: str, layout: str) -> None:
        """``buf.copy_to_device(a)``: numba's direction, from a numpy array (any layout) into the buffer."""
        if not view.contiguous() and not view.kind.startswith("pinned"):
            return  # a strided DMA destination: a documented ValueError, as for copy_from_host
        values = values_for(seed, view.shape)
        if layout == "F":
            src = np.asfortranarray(values)
        elif layout == "strided" and values.ndim:
            wide = np.zeros((*values.shape[:-1], 2 * values.shape[-1]), DTYPE)
            wide[..., ::2] = values
            src = wide[..., ::2]
        else:
            src = values
        with self.run(f"{view.label}.copy_to_device(values ({layout}), stream={stream})", view):
            view.buf.copy_to_device(src, stream=self.stream(stream))
            view.model()[...] = values
            view.known()[...] = True

    @family("numba")
    @rule(view=buffers, value=st.integers(1, 1000), stream=st.sampled_from(STREAMS), sleep=st.booleans())
    def ptr_raw_kernel(self, view: View, value: int, stream: str, sleep: bool) -> None:
        """``buf.ptr`` given to a plain numba kernel (over a numba array made from the raw address, as a library
        given only the address would), on a stream of its own, sleeping first or not: reading ``ptr`` makes
        the buffer shared, so host access and later work must see the kernel's write."""
        shape = view.shape
        if view.kind not in DEVICE_KINDS or len(shape) not in (1, 2) or 0 in shape:
            return
        nd = len(shape)
        grid, block = launch_config(shape)
        what = f"raw {'sleeping ' if sleep else ''}kernel on {stream} through {view.label}.ptr writes {value}"
        with self.run(what, view):
            iface = {
                "shape": shape,
                "strides": view.buf.strides,
                "typestr": DTYPE.str,
                "data": (view.buf.ptr, False),
                "version": 3,
                "stream": None,
            }
            raw = cuda.as_cuda_array(SimpleNamespace(__cuda_array_interface__=iface))
            if sleep:
                KERNELS.get(f"plainsleepfill{nd}")[grid, block, self.stream(stream)](raw, value, SLEEP_NS)
            else:
                KERNELS.get(f"plainfill{nd}")[grid, block, self.stream(stream)](raw, value)
            view.alloc.escaped = True
            view.model()[...] = value
            view.known()[...] = True

    # -- hints ------------------------------------------------------------------------------------
    @family("hints")
    @rule(
        view=buffers,
        op=st.sampled_from(("prefetch", "discard", "discard_prefetch", "advise", "policy", "launch_prefetch")),
        where=st.sampled_from((0, "cpu")),
        stream=st.sampled_from(STREAMS),
        advice=st.sampled_from(("read_mostly", "preferred", "accessed_by", "clear")),
    )
    def hint(self, view: View, op: str, where: Any, stream: str, advice: str) -> None:
        """prefetch / discard / discard_prefetch / advice / a migration policy on managed memory; or
        launch-time migration on (``where`` 0) or off (um.set_auto_prefetch: values never change)."""
        if op == "launch_prefetch":
            with self.run(f"um.set_auto_prefetch({where == 0})"):
                um.set_auto_prefetch(where == 0)
            return
        if view.kind != "managed":
            return
        s = self.stream(stream)
        what = f"{view.label}.{op}({where!r}, stream={stream})" if op != "advise" else f"{view.label}.hints.{advice}"
        # Advice on no elements is refused (ValueError naming the empty range, tests/hints/test_advice.py);
        # prefetch and discard of a whole zero-size buffer do nothing.
        empty_advice = op in ("advise", "policy") and not int(np.prod(view.shape))
        # Pool memory takes no advice (the driver answers CUDA_ERROR_NOT_SUPPORTED: UnsupportedError,
        # docs/concepts/pools.md); a managed pool's preferred_location is the way there.
        pool_advice = op in ("advise", "policy") and view.alloc.pool is not None
        # Hints need a contiguous buffer or view (a documented ValueError for a strided one).
        strided = not view.contiguous()
        allowed = ((ValueError,) if empty_advice or strided else ()) + ((um.UnsupportedError,) if pool_advice else ())
        with self.run(what, view, allowed=allowed):
            if op == "prefetch":
                view.buf.prefetch(where, stream=s)
            elif op == "discard":
                view.buf.discard(stream=s)
                self.mark_discarded(view)
            elif op == "discard_prefetch":
                view.buf.discard_prefetch(where, stream=s)
                self.mark_discarded(view)
            elif op == "policy":
                policy = um.MigrationPolicy.PREFER_DEVICE(0) if where == 0 else um.MigrationPolicy.READ_MOSTLY
                view.buf.apply_policy(policy)
            else:
                h = view.buf.hints
                if advice == "read_mostly":
                    h.set_read_mostly()
                elif advice == "preferred":
                    h.set_preferred_location(where)
                elif advice == "accessed_by":
                    h.set_accessed_by(0)
                else:
                    h.clear()

    @family("hints")
    @rule(
        view=buffers,
        op=st.sampled_from(("prefetch", "discard", "discard_prefetch")),
        where=st.sampled_from((0, "cpu")),
        part=st.tuples(st.floats(0, 1), st.floats(0, 1)) | st.none(),
    )
    def plan_add(self, view: View, op: str, where: Any, part: tuple[float, float] | None) -> None:
        """``PrefetchPlan.add`` / ``add_range`` / ``add_discard`` / ``add_discard_range`` of a managed view
        (``part``: an element range, in memory order); the entry runs at a later ``plan_execute``."""
        if view.kind != "managed":
            return
        n = int(np.prod(view.shape))
        lo, hi = (None, None) if part is None or n == 0 else sorted(int(f * n) for f in part)
        if lo is not None and lo == hi:
            lo, hi = (lo, hi + 1) if hi < n else (lo - 1, hi)
        where_text = "" if op == "discard" else f", {where!r}"
        what = (
            f"plan.add{'_discard' if op == 'discard' else ''}{'' if lo is None else '_range'}"
            f"({view.label}{'' if lo is None else f', {lo}, {hi}'}{where_text}"
            f"{', discard=True' if op == 'discard_prefetch' else ''})"
        )
        added = False
        # A strided view is refused (ValueError naming it), as for the other hints.
        with self.run(what, view, allowed=() if view.contiguous() else (ValueError,)):
            plan = self.plan
            if op == "discard" and lo is None:
                plan.add_discard(view.buf)
            elif op == "discard":
                plan.add_discard_range(view.buf, lo, hi)
            elif lo is None:
                plan.add(view.buf, where, discard=op == "discard_prefetch")
            else:
                plan.add_range(view.buf, lo, hi, where, discard=op == "discard_prefetch")
            added = True
        if added:
            self.plan_entries.append((view, op))

    @family("hints")
    @rule(stream=st.sampled_from(STREAMS), clear=st.booleans())
    def plan_execute(self, stream: str, clear: bool) -> None:
        """``PrefetchPlan.execute`` of the kept plan on a stream, maybe again later: a closed entry's buffer is
        refused (BufferClosedError) before anything is issued; the discards make their memory unknown."""
        if not self.plan_entries:
            return
        views = [v for v, _ in self.plan_entries]
        with self.run(f"plan.execute(stream={stream}): {self.plan!r}", *views):
            self.plan.execute(self.stream(stream))
            for v, op in self.plan_entries:
                if op != "prefetch":
                    self.mark_discarded(v)
        if clear:
            self.plan.clear()
            self.plan_entries.clear()

    # -- lending and exports ------------------------------------------------------------------------
    @family("lend")
    @rule(
        view=buffers,
        lend_stream=st.sampled_from((*STREAMS, "None")),
        consumer_stream=st.sampled_from(STREAMS),
        protocol=st.sampled_from(("dlpack", "cai", "cai-lent-stream")),
        value=st.integers(1, 1000),
        close_after=st.sampled_from((False, False, True)),
    )
    def lend_to_consumer(
        self, view: View, lend_stream: str, consumer_stream: str, protocol: str, value: int, close_after: bool
    ) -> None:
        """``with buf.lend(s) as v:`` a foreign consumer writes ``value`` into v on its own stream.

        ``dlpack``: ``v.__dlpack__(stream=consumer)``, then memsets on the consumer's stream
        (the protocol makes that stream wait for the lender's work).  ``cai``: the consumer
        reads the interface, waits for the stream it names, and writes on its own stream.
        ``cai-lent-stream``: it writes on the stream the interface names.  After the block,
        host access and later work must see the write; a pool buffer closed right after the
        block must not be handed out again before the consumer is done.
        """
        if view.kind not in DEVICE_KINDS:
            return
        lend_arg = None if lend_stream == "None" else self.stream(lend_stream)
        what = f"with {view.label}.lend({lend_stream}): {protocol} consumer on {consumer_stream} writes {value}"
        with self.run(what, view):
            with view.buf.lend(lend_arg) as lent:
                if protocol == "dlpack":
                    cap = Capsule(lent.__dlpack__(stream=self.dlpack_stream(consumer_stream)))
                    try:
                        memset_elements(cap.ptr, cap.shape, cap.strides, value, self.handle(consumer_stream))
                    finally:
                        cap.release()
                else:
                    iface = lent.__cuda_array_interface__
                    # None would mean "no synchronisation needed" (CAI v3); lend(None) or lend(0)
                    # saying so is the probes family's concern: here it is taken as the legacy stream.
                    named = iface["stream"] if iface["stream"] is not None else 0
                    ptr = iface["data"][0]
                    strides = iface["strides"] or tuple(s * 4 for s in np.empty(iface["shape"], np.uint8).strides)
                    if protocol == "cai":
                        consumer = self.handle(consumer_stream)
                        stream_wait_stream(consumer, named)
                    else:
                        consumer = named
                    memset_elements(ptr, tuple(iface["shape"]), tuple(strides), value, consumer)
            view.model()[...] = value
            view.known()[...] = True
            if close_after:
                view.alloc.buf.close()
                view.alloc.closed = True

    @family("export")
    @rule(
        view=buffers,
        consumer_stream=st.sampled_from(("none", *STREAMS)),  # first: Hypothesis favours it
        protocol=st.sampled_from(("dlpack", "cai")),
        value=st.integers(1, 1000),
        reads=st.booleans(),
    )
    def export_to_consumer(self, view: View, consumer_stream: str, protocol: str, value: int, reads: bool) -> None:
        """A buffer handed over for good: ``__dlpack__(stream=consumer)`` or CAI; the buffer escapes.

        The consumer writes on its stream; from then on host access synchronises every device
        (the docs' promise for escaped buffers), so it must see the write.  Or (``reads``, DLPack)
        it copies the tensor out on its stream and waits for that stream alone, as a library's
        ``.cpu()`` does: what it gets must be the buffer's contents, earlier work included.
        """
        if view.kind not in DEVICE_KINDS:
            return
        reads = reads and protocol == "dlpack" and view.contiguous()
        what = f"{view.label}.__{protocol}__ to a consumer on {consumer_stream} " + (
            "copying it out" if reads else f"writing {value}"
        )
        with self.run(what, view):
            # "none": DLPack's stream=None, the legacy default stream, which does not wait for the
            # non-blocking streams by itself (the CUDA Array Interface has no such value here).
            handle = 0 if consumer_stream == "none" else self.handle(consumer_stream)
            if protocol == "dlpack":
                named = None if consumer_stream == "none" else self.dlpack_stream(consumer_stream)
                cap = Capsule(view.buf.__dlpack__(stream=named))
                try:
                    if reads:
                        m = view.model()
                        order = "F" if m.flags.f_contiguous and not m.flags.c_contiguous else "C"
                        out = page_locked(m.shape, order)  # page-locked: copied on the stream
                        if out.size:
                            um.driver_call(
                                "cuMemcpyDtoHAsync", out.ctypes.data, cap.ptr, out.nbytes, handle, detail="fuzz"
                            )
                        um.driver_call("cuStreamSynchronize", handle, detail="fuzz consumer")
                        check_equal(np.array(out), view, what)
                    else:
                        memset_elements(cap.ptr, cap.shape, cap.strides, value, handle)
                finally:
                    cap.release()
            else:
                iface = view.buf.__cuda_array_interface__
                strides = iface["strides"] or tuple(s * 4 for s in np.empty(iface["shape"], np.uint8).strides)
                memset_elements(iface["data"][0], tuple(iface["shape"]), tuple(strides), value, handle)
            view.alloc.escaped = True
            if not reads:
                view.model()[...] = value
                view.known()[...] = True

    # -- host access inside a lend (item 4 of issue 27) --------------------------------------------
    @family("reentry")
    @rule(
        view=buffers,
        lend_stream=st.sampled_from(STREAMS),
        op=st.sampled_from(("host", "asarray", "synchronize", "on_host", "close")),
    )
    def host_access_inside_lend(self, view: View, lend_stream: str, op: str) -> None:
        """Host access to a buffer inside its own ``lend`` block, same thread: works or raises, never hangs."""
        if view.kind not in DEVICE_KINDS or (op in ("host", "asarray", "on_host") and view.kind not in HOST_KINDS):
            return
        if op == "on_host" and view.kind != "managed":
            op = "host"
        what = f"with {view.label}.lend({lend_stream}): {view.label}.{op}"
        closed = False
        with self.run(what, view, allowed=(um.CoherenceError, um.UnsupportedError)):
            with view.buf.lend(self.stream(lend_stream)):
                if op == "host":
                    got: Any = np.array(view.buf.host)
                elif op == "asarray":
                    got = np.array(np.asarray(view.buf))
                elif op == "on_host":
                    with view.buf.on_host() as a:
                        got = np.array(a)
                elif op == "synchronize":
                    view.buf.synchronize()
                    got = None
                else:
                    view.alloc.buf.close()
                    closed = True
                    got = None
            if got is not None:
                check_equal(got, view, what)
        if closed:
            view.alloc.closed = True

    # -- two threads through one user staging buffer (item 3) -----------------------------------------
    @family("staging")
    @precondition(lambda self: not self.staged)
    @rule(
        target=buffers,
        n=st.integers(64, 128),
        seed=st.integers(0, 2**16),
        direction=st.sampled_from(("from_host", "to_host")),
        kind=st.sampled_from(("device", "managed")),
        staging_bytes=st.sampled_from((64, 256)),
    )
    def shared_staging(self, n: int, seed: int, direction: str, kind: str, staging_bytes: int) -> Any:
        """Two threads copy at once through one user PinnedBuffer given as ``staging=``, :data:`STAGING_ROUNDS` times.

        The interpreter switches threads every microsecond meanwhile, so that the two copies'
        chunks interleave (a missing lock on the user's staging area then mixes them in about
        one round in twelve on the simulator: the rounds make a mix all but certain at the one such
        step of a program, so that Hypothesis can shrink the program).
        """
        rounds = STAGING_ROUNDS
        self.staged = True
        cls = um.DeviceBuffer if kind == "device" else um.ManagedBuffer
        stg = um.PinnedBuffer.empty(staging_bytes, np.uint8)
        self.stagings.append(stg)
        a_vals, b_vals = values_for(seed, (n,)), values_for(seed + 1, (n,))
        views = []
        with self.step(f"two {kind} buffers of {n}"):
            if direction == "from_host":
                bufs = [cls.empty(n, DTYPE), cls.empty(n, DTYPE)]
            else:
                bufs = [cls.from_array(a_vals), cls.from_array(b_vals)]
        for buf, vals in zip(bufs, (a_vals, b_vals), strict=True):
            views.append(self.register(kind, buf, direction == "to_host", None, vals))
        what = f"two threads {direction} {n} int32 each through one {staging_bytes}-byte staging PinnedBuffer"
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            for _ in range(rounds):
                barrier = threading.Barrier(2)
                outs = [np.zeros(n, DTYPE), np.zeros(n, DTYPE)]

                def job(i: int, barrier: threading.Barrier = barrier, outs: list[np.ndarray] = outs) -> None:
                    barrier.wait(timeout=STEP_TIMEOUT)
                    if direction == "from_host":
                        bufs[i].copy_from_host((a_vals, b_vals)[i], stream=2, staging=stg)
                    else:
                        bufs[i].copy_to_host(outs[i], stream=2, staging=stg)

                with self.step(what):
                    futures = [worker_thread(f"fuzz-stage-{i}").submit(job, i) for i in range(2)]
                    for f in futures:
                        try:
                            f.result(timeout=STEP_TIMEOUT)
                        except concurrent.futures.TimeoutError:
                            raise StepHungError(f"{what}: hung") from None
                    if direction == "from_host":
                        for v, vals in zip(views, (a_vals, b_vals), strict=True):
                            v.model()[...] = vals
                            v.known()[...] = True
                            check_equal(self.read_any(v), v, what)
                    else:
                        for v, out in zip(views, outs, strict=True):
                            check_equal(out, v, what)
        finally:
            sys.setswitchinterval(switch)
        return multiple(*views)

    # -- graph capture (item 6) ------------------------------------------------------------------------
    @family("capture")
    @rule(
        target=buffers,
        data=st.data(),
        stream=st.sampled_from((*NUMBA_STREAMS, *NON_BLOCKING)),
        op=st.sampled_from(
            (
                "empty",
                "zeros",
                "from_array",
                "kernel",
                "copy_from_host",
                "copy_to_host",
                "um_copy",
                "prefetch",
                "discard",
                "lend",
            )
        ),
        kind=st.sampled_from(("managed", "device", "pinned-pool")),
        pooled=st.booleans(),
        mode=st.sampled_from((0, 1, 2)),
    )
    def capture(self, data: Any, stream: str, op: str, kind: str, pooled: bool, mode: int) -> Any:
        """An operation on a stream that is capturing a graph: works or is refused, and the capture stays valid."""
        s = self.stream(stream)
        h = self.handle(stream)
        modes = {0: "global", 1: "thread-local", 2: "relaxed"}
        what = f"in a {modes[mode]} capture of {stream}: {op}"
        made: list[View] = []
        view: View | None = None
        if op in ("kernel", "copy_from_host", "copy_to_host", "um_copy", "prefetch", "discard", "lend"):
            # Prefetch and discard take managed memory only: they draw among managed views, so that each
            # one drawn reaches the operation (drawn among every kind, most did nothing).
            kinds = ("managed",) if op in ("prefetch", "discard") else DEVICE_KINDS
            live = [v for a in self.allocs if not a.closed for v in a.views if v.kind in kinds]
            if not live:
                return multiple()
            view = data.draw(st.sampled_from(live), label="view")
        for pool_kind in ("managed", "device", "pinned"):
            self.pool(pool_kind)  # made before the capture: creating a pool in one is the user's error
        um.driver_call("cuStreamBeginCapture", h, mode, detail="fuzz: the user's capture")
        try:
            with self.run(what, *([view] if view else []), allowed=REFUSALS):
                made = self._capture_op(op, kind, pooled, s, view)
        finally:
            graph = _driver.api().drv.cuStreamEndCapture(h)
            err, g = graph[0], graph[1] if len(graph) > 1 else None
            ok = int(err) == 0
            if ok and g is not None:
                um.driver_call("cuGraphDestroy", g, detail="fuzz")
        assert ok, f"{what}: the user's capture was invalidated (cuStreamEndCapture: {err!r})"
        return multiple(*made)

    @family("capture")
    @rule(
        view=buffers,
        data=st.data(),
        value=st.integers(1, 1000),
        stream=st.sampled_from((*NUMBA_STREAMS, *NON_BLOCKING)),
        on=st.sampled_from(STREAMS),
        launches=st.integers(0, 2),
        op=st.sampled_from(("fill", "sleepfill", "copy", "forkfill")),
        keep=st.booleans(),
    )
    def graph_capture(
        self, view: View, data: Any, value: int, stream: str, on: str, launches: int, op: str, keep: bool
    ) -> None:
        """``umem_numba.capture`` of a tracked fill (sleeping first or not) or of ``um.copy`` from another
        view, launched 0 to 2 times on any stream, then closed or kept for later launches (a VMMBuffer's
        graph is closed: it may shrink).  ``forkfill``: a stream forked into the capture first tries a
        plain launch of the buffer (refused: it would replay untracked), then joins back before the fill."""
        if view.kind not in DEVICE_KINDS or len(view.shape) not in (1, 2):
            return
        src: View | None = None
        if op == "copy":
            if not view.contiguous():
                return
            src = self.writable_pair(data, view, frozenset(DEVICE_KINDS))
            m = view.model()
            if src is None or src.shape != view.shape or not src.contiguous():
                return
            if m.flags.c_contiguous != src.model().flags.c_contiguous:
                return  # um.copy keeps the order: both C or both F
        s = self.stream(stream)
        views = (view,) if src is None else (view, src)
        # Half the graphs keep their kernels' captured priorities (the value decides: the seeds draw as before).
        node_priorities = value % 2 == 0
        what = (
            f"um.capture({stream}, node_priorities={node_priorities}): {op}({view.label}, "
            f"{src.label if src else value}); launch x{launches} on {on}"
        )
        if op == "forkfill" and not hasattr(self, "_fork"):
            self._fork = (cuda.stream(), cuda.event(timing=False), cuda.event(timing=False))
        with self.run(what, *views):
            with um.capture(s, node_priorities=node_priorities) as graph:
                if src is not None:
                    um.copy(view.buf, src.buf, stream=s)
                else:
                    grid, block = launch_config(view.shape)
                    if op == "forkfill":
                        self._forked_plain_launch_refused(s, view, value)
                        op = "fill"
                    k = KERNELS.get(f"{op}{len(view.shape)}")
                    k[grid, block, s](*((view.buf, value, SLEEP_NS) if op == "sleepfill" else (view.buf, value)))
            try:
                for _ in range(launches):
                    graph.launch(self.stream(on))
                    self._graph_effect(view, value, src)
            finally:
                if keep and view.kind != "vmm" and (src is None or src.kind != "vmm"):
                    self.graphs.append((graph, view, value, src))
                else:
                    graph.close()

    def _forked_plain_launch_refused(self, s: Any, view: View, value: int) -> None:
        """Inside a capture on ``s``: fork a stream in, try a plain launch of ``view`` there, join it back."""
        side, fork, join = self._fork  # made outside the capture (a stream destroyed in it would end it)
        fork.record(s)
        fork.wait(side)
        nd = len(view.shape)
        grid, block = launch_config(view.shape)
        try:
            KERNELS.get(f"plainfill{nd}")[grid, block, side](view.buf, value)
        except um.CoherenceError as exc:
            assert "forked" in str(exc), exc
        else:
            raise AssertionError("a plain launch of a buffer on a forked stream was not refused")
        join.record(side)
        join.wait(s)

    def _graph_effect(self, view: View, value: int, src: View | None) -> None:
        """What one launch of a kept graph does to the model: a fill of ``value``, or a copy of ``src``."""
        if src is None:
            view.model()[...] = value
            view.known()[...] = True
        else:
            view.model()[...] = src.model()
            view.known()[...] = src.known()

    @family("capture")
    @rule(data=st.data(), on=st.sampled_from(STREAMS), close=st.booleans())
    def graph_launch(self, data: Any, on: str, close: bool) -> None:
        """A kept graph launched again on any stream (refused once one of its buffers was closed), or closed."""
        if not self.graphs:
            return
        entry = data.draw(st.sampled_from(self.graphs), label="graph")
        graph, view, value, src = entry
        label = f"graph({view.label} := {src.label if src else value})"
        if close:
            with self.run(f"{label}.close()"):
                graph.close()
            self.graphs.remove(entry)
            return
        views = (view,) if src is None else (view, src)
        with self.run(f"{label}.launch({on})", *views, allowed=(um.BufferClosedError,)):
            graph.launch(self.stream(on))
            self._graph_effect(view, value, src)

    def _capture_op(self, op: str, kind: str, pooled: bool, s: Any, view: View | None) -> list[View]:
        if op in ("empty", "zeros", "from_array"):
            cls = {"managed": um.ManagedBuffer, "device": um.DeviceBuffer, "pinned-pool": um.PinnedBuffer}[kind]
            kw: dict[str, Any] = {"stream": s}
            if op == "empty" and kind == "device" and not pooled and self.counter % 2 == 0:
                # On the legacy stream beside the capture (the counter decides: the seeds draw as before):
                # a free-list block that needs no ordering is served with no driver call; one that does
                # is refused (its wait on the legacy stream would invalidate the capture), as is a new one.
                kw["stream"] = 0
            pool = None
            if kind == "pinned-pool" or pooled:
                pool = {"managed": "managed", "device": "device", "pinned-pool": "pinned"}[kind]
                kw["pool"] = self.pool(pool)
            vals = values_for(self.counter, (8,))
            buf = cls.from_array(vals, **kw) if op == "from_array" else getattr(cls, op)(8, DTYPE, **kw)
            return [self.register(kind, buf, op != "empty", pool, vals if op == "from_array" else None)]
        assert view is not None
        if op == "kernel":
            if len(view.shape) not in (1, 2):
                return []
            grid, block = launch_config(view.shape)
            KERNELS.get(f"fill{len(view.shape)}")[grid, block, s](view.buf, 5)
            view.model()[...] = 5
            view.known()[...] = True
        elif op == "copy_from_host" and view.contiguous():
            vals = values_for(self.counter, view.shape)
            view.buf.copy_from_host(vals, stream=s)
            view.model()[...] = vals
            view.known()[...] = True
        elif op == "copy_to_host" and view.contiguous():
            check_equal(view.buf.copy_to_host(stream=s), view, "copy_to_host in a capture")
        elif op == "um_copy" and view.contiguous():
            m = view.model()
            order = "F" if m.flags.f_contiguous and not m.flags.c_contiguous else "C"  # a DMA keeps the layout
            tmp = um.PinnedBuffer.empty(view.shape, DTYPE, order=order)  # um.copy takes buffers (numpy: copy_to_host)
            try:
                um.copy(tmp, view.buf, stream=s)
                check_equal(np.array(tmp.host), view, "um.copy in a capture")
            finally:
                tmp.close()
        elif op in ("prefetch", "discard") and view.kind == "managed":
            if op == "prefetch":
                view.buf.prefetch(0, stream=s)
            else:
                view.buf.discard(stream=s)
                self.mark_discarded(view)
        elif op == "lend":
            with view.buf.lend(s):
                pass
        return []

    # -- threads ---------------------------------------------------------------------------------------
    @family("threads")
    @rule(
        view=buffers,
        thread=st.sampled_from(("fuzz-a", "fuzz-b")),
        op=st.sampled_from(("fill", "read", "copy_from_host", "close")),
        value=st.integers(1, 1000),
    )
    def in_thread(self, view: View, thread: str, op: str, value: int) -> None:
        """An operation on a worker thread (its per-thread default stream), waited for here."""
        what = f"on thread {thread}: {view.label}.{op}"
        if op == "fill" and (view.kind not in DEVICE_KINDS or len(view.shape) not in (1, 2)):
            return
        if op == "copy_from_host" and not view.contiguous() and not view.kind.startswith("pinned"):
            return  # a strided DMA destination: a documented ValueError (see copy_from_host)

        def job() -> Any:
            if op == "fill":
                grid, block = launch_config(view.shape)
                KERNELS.get(f"fill{len(view.shape)}")[grid, block, cuda.per_thread_default_stream()](view.buf, value)
            elif op == "read":
                return self.read_any(view)
            elif op == "copy_from_host":
                view.buf.copy_from_host(np.full(view.shape, value, DTYPE), stream=2)
            else:
                view.alloc.buf.close()
            return None

        # close() of a closed buffer does nothing (as on the main thread): no BufferClosedError expected.
        with self.run(what, *(() if op == "close" else (view,))):
            got = in_worker(thread, job, what)
            if op == "read":
                check_equal(got, view, what)
            elif op == "close":
                view.alloc.closed = True
            else:
                view.model()[...] = value
                view.known()[...] = True

    # -- VMM --------------------------------------------------------------------------------------------
    @family("vmm")
    @rule(view=buffers, length=st.integers(0, 40), how=st.sampled_from(("grow", "shrink", "resize")))
    def vmm_resize(self, view: View, length: int, how: str) -> None:
        """VMMBuffer.grow / shrink / resize: the address and the kept contents stay."""
        if view.kind != "vmm" or view.ops:
            return
        old = view.alloc.model
        n = old.shape[0] if old.ndim else 0
        if (how == "grow" and length < n) or (how == "shrink" and length > n):
            return
        with self.run(f"{view.label}.{how}({length})", view, allowed=(ValueError,)):
            getattr(view.buf, how)(length)
            shape = (length, *old.shape[1:])
            order = "F" if old.flags.f_contiguous and not old.flags.c_contiguous else "C"
            model, known = np.zeros(shape, DTYPE, order=order), np.zeros(shape, bool, order=order)
            keep = min(n, length)
            model[:keep] = old[:keep]
            known[:keep] = view.alloc.known[:keep]
            view.alloc.model, view.alloc.known = model, known

    # -- probes: bad arguments the docs promise a clear error for ------------------------------------------
    @family("probes")
    @rule(
        view=buffers,
        probe=st.sampled_from(
            ("dlpack-stream-0", "dlpack-stream-True", "dlpack-stream--5", "zero", "lend-None", "lend-0")
        ),
    )
    def probe(self, view: View, probe: str) -> None:
        """``__dlpack__(stream=0|True|-5)`` is refused with a clear error; zero-size prefetch/discard are no-ops;
        a view lent for the legacy stream (``lend(None)``, ``lend(0)``) names a stream in its CAI."""
        if probe == "zero":
            # A zero-size ManagedBuffer of its own (the view drawn need not be one).
            what = "ManagedBuffer.empty((0,)).prefetch/discard/discard_prefetch"
            with self.step(what), um.ManagedBuffer.empty((0,), DTYPE) as empty:
                empty.prefetch(0)
                empty.discard()
                empty.discard_prefetch(0)
            return
        if view.closed or view.kind not in DEVICE_KINDS:
            return
        if probe.startswith("lend-"):
            arg = None if probe == "lend-None" else 0
            what = f"with {view.label}.lend({arg!r}) as v: v.__cuda_array_interface__"
            with self.step(what, view), view.buf.lend(arg) as lent:
                named = lent.__cuda_array_interface__["stream"]
            assert named is not None, (
                f"{view.label}.lend({arg!r}): the lent view's __cuda_array_interface__ has stream None, which "
                "means 'no synchronisation needed' in CAI v3, but the work must be ordered on the legacy stream"
            )
            return

        stream = {"dlpack-stream-0": 0, "dlpack-stream-True": True, "dlpack-stream--5": -5}[probe]
        what = f"{view.label}.__dlpack__(stream={stream!r})"
        try:
            with watchdog(what):
                cap = view.buf.__dlpack__(stream=stream)
        except (ValueError, TypeError, BufferError, um.UnsupportedError):
            return
        except Exception as exc:
            raise UnexpectedError(f"{what}: unexpected {type(exc).__name__}: {exc}") from exc
        del cap
        view.alloc.escaped = True
        raise AssertionError(f"{what} was accepted; the DLPack protocol has no such stream value for CUDA")

    # -- end of a program ------------------------------------------------------------------------------
    def drain(self) -> list[BaseException]:
        """Run all queued device work (the simulated driver's queues; a device synchronise on a GPU)."""
        for name in (*NUMBA_STREAMS, *NON_BLOCKING):
            try:
                self.streams[name].synchronize()
            except Exception as exc:
                return [exc]
        if _sim.active():
            return _driver.api().drv.drain_quietly()
        cuda.synchronize()
        return []

    def teardown(self) -> None:
        """Read every live allocation once more, then settle all work, close everything, check nothing leaked.

        After a failed step it only cleans up (quietly), so that the next program starts clean.
        """
        errors: list[str] = []
        escaped = sum(a.escaped for a in self.allocs)
        try:
            with watchdog("teardown"), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if self.failed:
                    self.drain()
                for graph, *_ in self.graphs:
                    graph.close()
                self.graphs.clear()
                self.plan.clear()  # its buffers are closed below: nothing keeps their objects
                self.plan_entries.clear()
                self.__dict__.pop("_fork", None)  # the forked stream and its events: freed now
                for a in self.allocs:
                    if a.closed or self.failed:
                        continue
                    try:
                        got = np.array(a.buf.host) if a.kind in HOST_KINDS else a.buf.copy_to_host()
                        check_equal(got, a.views[0], f"final read of {a.name}")
                    except AssertionError as exc:
                        errors.append(str(exc))
                left = self.drain()
                if left:
                    errors.append(f"device work failed when it ran at the end: {left[0]!r}")
                # Again once all device work has run: work a read did not wait for (and did not need
                # to, the model says) must not change the contents afterwards (a lost write).
                for a in self.allocs:
                    if a.closed or self.failed or errors:
                        continue
                    try:
                        got = np.array(a.buf.host) if a.kind in HOST_KINDS else a.buf.copy_to_host()
                        check_equal(got, a.views[0], f"read of {a.name} after all device work ran")
                    except AssertionError as exc:
                        errors.append(str(exc))
                for a in self.allocs:
                    if not a.closed:
                        a.buf.close()
                        a.closed = True
                for stg in self.stagings:
                    stg.close()
                for p in self.pools.values():
                    p.close()
                um.release_allocation_cache()  # what the cache keeps is not a leak: measured without it
                left = self.drain()
                if left:
                    errors.append(f"device work failed when it ran after closing everything: {left[0]!r}")
                for name in NON_BLOCKING:
                    um.driver_call("cuStreamDestroy", self.handle(name), detail="fuzz")
            errors += [
                f"at the end: {w.category.__name__}: {w.message}"
                for w in caught
                if issubclass(w.category, RuntimeWarning) and "umem_numba" in str(w.message)
            ]
        except Exception as exc:
            if not self.failed:
                raise
            del exc
        finally:
            self.streams.clear()
            self.allocs.clear()
            self.stagings.clear()
            self.pools.clear()
            # Hypothesis keeps the steps' values (the bundles) until the machine goes: an escaped
            # buffer's memory lives as long as its Python object, so let them go now.
            for bundle in self.bundles.values():
                bundle.clear()
            self.names_to_values.clear()
        events = unaccounted_events()  # collects garbage first
        if self.failed:
            return
        try:
            self._final_checks(errors, events, escaped)
        except AssertionError:
            first_failure()
            raise

    def _final_checks(self, errors: list[str], events: int | None, escaped: int) -> None:
        if errors:
            raise AssertionError("; ".join(errors))
        stats = {k: v.live_count for k, v in um.stats().items() if hasattr(v, "live_count")}
        # Not above: an earlier failed program's buffers may be collected during this one.
        # An escaped buffer's memory stays with its Python object (the docs' promise), which Hypothesis
        # may still hold (the last step's arguments): as many as escaped may stay.
        grew = {k: (self.baseline_stats.get(k, 0), n) for k, n in stats.items() if n > self.baseline_stats.get(k, 0)}
        more = sum(after - before for before, after in grew.values())
        assert more <= escaped, f"live buffers after closing everything, (before, after) per kind: {grew}"
        if events is not None and BASELINE_EVENTS:
            assert events == BASELINE_EVENTS[0], (
                f"driver events leaked: {events - BASELINE_EVENTS[0]} handles neither pooled nor held by a live event"
            )
        free = um.mem_info()[0]
        # Closed buffers of the process-wide pools (DeviceBuffer without pool=) stay on their free
        # lists for the next buffer of their size: held, not leaked.
        cached = max(now - then for now, then in zip(pool_cached(), self.baseline_cached, strict=True))
        # A GPU driver's memory moves by itself too (a thread's or a stream's first use, a module
        # load; in 2 MiB steps): there, a drop of a few steps is its own.  The simulated driver's is exact.
        slack = 0 if _sim.active() else DRIVER_SLACK + (MANAGED_POOL_RESIDUE if self.managed_pool_used else 0)
        if self.baseline_free - free > max(cached, 0) + slack and not escaped:
            now = driver_allocations()
            extra = {hex(b): v for b, v in now.items() if b not in self.baseline_allocations}
            raise AssertionError(
                f"device memory not given back: {self.baseline_free - free} bytes; allocations: {extra}; "
                f"{memory_diagnostics(self.baseline_free)}"
            )


def memory_diagnostics(baseline_free: int) -> str:
    """Where missing device memory may be (for the failure message): pools, numba's deferred frees."""
    pools = um.stats().get("pool")
    parts = [f"pools now: {pools}"]
    if not _sim.active():
        ctx = cuda.current_context()
        pending = len(getattr(ctx.deallocations, "_cons", ()))
        ctx.deallocations.clear()
        cuda.synchronize()
        parts.append(f"numba's pending frees: {pending}, then missing {baseline_free - um.mem_info()[0]} bytes")
        stack = _driver.api().drv.cuCtxGetLimit(_driver.api().drv.CUlimit.CU_LIMIT_STACK_SIZE)
        parts.append(f"stack limit {stack[1]}")
    return "; ".join(parts)


#: Free device memory a GPU's driver may take for itself during a program (see _final_checks).
DRIVER_SLACK = 4 << 20
#: Device memory a GPU's driver keeps after managed pools are gone, and gives back later by itself.
#: Measured on an H100 (driver 580, with raw driver calls): a managed pool's first small
#: allocation takes 128 MiB; destroying the pool gives back 32 MiB, the next pool reuses the rest.
MANAGED_POOL_RESIDUE = 128 << 20


class _RefusedError(Exception):
    """A step was refused with a documented error: the rule stops there, the model is unchanged."""


class _Attempt:
    def __init__(self, machine: UmemMachine, what: str, views: tuple[View, ...], allowed: tuple[type, ...]) -> None:
        self._cm = machine.step(what, *views, allowed=allowed)

    def __enter__(self) -> None:
        self._cm.__enter__()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        try:
            self._cm.__exit__(et, ev, tb)
        except _RefusedError:
            return True
        return False


#: Driver event handles unaccounted for before the first program (numba's own events, say).
BASELINE_EVENTS: list[int] = []


def warm_up() -> None:
    """Make what umem_numba and the driver make once per process, so it is in the baseline.

    The internal staging area; and every kernel of the fuzzer, compiled and launched once: a GPU's
    driver reserves memory for a kernel's local memory at its first launch, and keeps it.
    """
    with um.DeviceBuffer.zeros(4, DTYPE) as buf:
        buf.copy_from_host(np.ones(4, DTYPE), staging=True)
        buf.copy_to_host(staging=True)
    with um.DeviceBuffer.zeros(1, DTYPE) as one, um.DeviceBuffer.zeros((1, 1), DTYPE) as two:
        for nd, a in ((1, one), (2, two)):
            for name in ("fill", "opaquefill", "rowfill", "plainfill"):
                KERNELS.get(f"{name}{nd}")[launch_config(a.shape)](a, 1)
            KERNELS.get(f"sleepfill{nd}")[launch_config(a.shape)](a, 1, 0)
            KERNELS.get(f"plainsleepfill{nd}")[launch_config(a.shape)](a, 1, 0)
            for name in ("add", "copy"):
                KERNELS.get(f"{name}{nd}")[launch_config(a.shape)](a, a, *a.shape)
        one.synchronize()
        two.synchronize()
    cuda.synchronize()
    tour_of_first_uses()
    for name in ("fuzz-a", "fuzz-b"):  # a worker thread's first CUDA call makes its per-thread state
        in_worker(name, tour_of_first_uses, "warm-up")
    cuda.synchronize()
    if _sim.active():
        _driver.api().drv.drain_quietly()
    events = unaccounted_events()
    if events is not None and not BASELINE_EVENTS:
        BASELINE_EVENTS.append(events)


def tour_of_first_uses() -> None:
    """Every kind of buffer, pooled and not, copied every way on every kind of stream, once.

    A GPU's driver takes device memory for itself at some first uses and keeps it for the
    process (measured on an H100, driver 580: 128 MiB at the first copy out of managed memory):
    made here, before any program's baseline, it is not counted as a program's leak.
    """
    cuda.current_context()  # a worker thread's first call: the primary context current, as numba makes it
    nb = int(um.driver_call("cuStreamCreate", 1, detail="fuzz warm-up"))
    streams = [cuda.stream(), cuda.external_stream(nb), cuda.default_stream(), cuda.per_thread_default_stream()]
    pools = {kind: um.MemoryPool(kind) for kind in ("managed", "device", "pinned")}
    values = np.arange(6, dtype=DTYPE).reshape(2, 3)
    try:
        for s in streams:
            bufs = [
                um.ManagedBuffer.from_array(values, stream=s),
                um.ManagedBuffer.from_array(values, pool=pools["managed"], stream=s),
                um.DeviceBuffer.from_array(values, stream=s),
                um.DeviceBuffer.from_array(values, pool=pools["device"], stream=s),
                um.PinnedBuffer.from_array(values, flags=um.HostAllocFlags.DEVICEMAP),
                um.PinnedBuffer.from_array(values, pool=pools["pinned"], stream=s),
                um.VMMBuffer.zeros(values.shape, DTYPE, stream=s),
            ]
            staging = um.PinnedBuffer.empty(1 << 16, np.uint8)
            for buf in bufs:
                for how in (None, True, False, staging):
                    buf.copy_from_host(values, stream=s, staging=how)
                    buf.copy_to_host(stream=s, staging=how)
                with um.DeviceBuffer.empty(values.shape, DTYPE, stream=s) as other:
                    um.copy(other, buf, stream=s)
                    um.copy(buf, other, stream=s)
                    KERNELS.get("add2")[launch_config(values.shape)](buf, other, *values.shape)
                buf.synchronize()
                if isinstance(buf, um.ManagedBuffer):
                    buf.prefetch(0, stream=s)
                    buf.prefetch("cpu", stream=s)
                    buf.synchronize()
                    np.asarray(buf.host).sum()
            for buf in bufs:
                buf.close()
            staging.close()
            s.synchronize()
    finally:
        for pool in pools.values():
            pool.close()
        cuda.synchronize()
        um.driver_call("cuStreamDestroy", nb, detail="fuzz warm-up")


def machine_for(families: frozenset[str]) -> type[UmemMachine]:
    """A machine class enabling ``core`` and ``families`` (its name says which, in Hypothesis's output)."""
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown fuzzer families {sorted(unknown)}; known: {sorted(FAMILIES)}")
    name = "Fuzz_" + "_".join(sorted(families)) if families else "Fuzz_core"
    warm_up()
    attrs: dict[str, Any] = {"ENABLED": frozenset(families)}
    # Hypothesis picks among the rules uniformly: aliases of a rule make it likelier (they share its
    # name, so the program prints the same, and its on/off switch per program).
    for fam in families:
        for rule_name in FAMILY_RULES.get(fam, ()):
            for i in range(FAMILY_WEIGHT - 1):
                attrs[f"{rule_name}_{i}"] = getattr(UmemMachine, rule_name)
    for i in range(READ_WEIGHT - 1):
        attrs[f"host_read_{i}"] = UmemMachine.host_read
    return type(name, (UmemMachine,), attrs)
