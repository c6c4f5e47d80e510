"""The fuzzer's race rules: the orderings a single random operation rarely sets up, made on purpose.

A random program seldom puts, one step after the other, device work on one stream and then the
operation that must wait for it on another: a pool block handed out again, a second reader, a
discard, a DMA from memory the host changes next, a shrink.  Each rule here is such a pattern,
with its streams, kinds and order of checks drawn, so that the ordering code is tried where a
missing wait changes a value (on the simulated driver, queued work runs only when something
needs it, and an unordered writer can overtake a reader).  :class:`RaceRules` is a mixin of
:class:`~support.fuzz_machine.UmemMachine` (family ``races``): its rules use the machine's
streams, pools, model and steps.
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import multiple, rule
from numba import cuda

import umem_numba as um
from support.fuzz_consumers import Capsule, memset_elements
from support.fuzz_model import (
    BUFFERS,
    DEVICE_KINDS,
    DTYPE,
    HOST_KINDS,
    KERNELS,
    NON_BLOCKING,
    NUMBA_STREAMS,
    SLEEP_NS,
    STEP_TIMEOUT,
    STREAMS,
    StepHungError,
    View,
    check_equal,
    family,
    in_worker,
    launch_config,
    page_locked,
    values_for,
)
from support.helpers import worker_thread
from umem_numba._memory._tracker import Tracker

#: Temporaries of the reuse races: ``(kind of the model, pool name or None, buffer class)``.
#: ``device`` is a DeviceBuffer without ``pool=`` (the process-wide pool), ``vmm`` a VMMBuffer
#: (unmapped when it goes: no stream order at all), ``*-shared`` a buffer of the driver's own pool
#: (``MemoryPool.default``: no free lists, every block goes back to the driver and comes from it).
TEMPS: dict[str, tuple[str, str | None]] = {
    "device-pool": ("device", "device"),
    "managed-pool": ("managed", "managed"),
    "pinned-pool": ("pinned-pool", "pinned"),
    "device": ("device", None),
    "device-shared": ("device", None),
    "managed-shared": ("managed", None),
    "vmm": ("vmm", None),
    "managed": ("managed", None),  # a default ManagedBuffer: the allocation cache reuses a closed one's memory
}
#: Streams a numba program makes and drops (the others live as long as the machine).
RENEWABLE = NUMBA_STREAMS
#: The streams of the reuse races, the per-thread stream twice as likely (and first: Hypothesis
#: favours a strategy's first values): its handle (2) names another stream in every thread, which
#: is what a pool's free lists must not confuse.
REUSE_STREAMS = ("per-thread", *STREAMS)


class RaceRules:
    """Race patterns (module docstring); mixed into the machine, which provides ``step``, ``pool``, ..."""

    # -- temporaries ----------------------------------------------------------------------------------
    def temporary(self: Any, temp: str, shape: tuple[int, ...], stream: str) -> Any:
        """A new ``empty`` buffer of kind ``temp`` (:data:`TEMPS`), allocated on ``stream``."""
        s = self.stream(stream)
        if temp == "device-pool":
            return um.DeviceBuffer.empty(shape, DTYPE, pool=self.pool("device"), stream=s)
        if temp == "managed-pool":
            return um.ManagedBuffer.empty(shape, DTYPE, pool=self.pool("managed"), stream=s)
        if temp == "pinned-pool":
            return um.PinnedBuffer.empty(shape, DTYPE, pool=self.pool("pinned"), stream=s)
        if temp == "device":
            return um.DeviceBuffer.empty(shape, DTYPE, stream=s)
        if temp == "device-shared":
            return um.DeviceBuffer.empty(shape, DTYPE, pool=um.MemoryPool.default("device"), stream=s)
        if temp == "managed-shared":
            self.managed_pool_used = True
            return um.ManagedBuffer.empty(shape, DTYPE, pool=um.MemoryPool.default("managed"), stream=s)
        if temp == "managed":
            return um.ManagedBuffer.empty(shape, DTYPE)
        return um.VMMBuffer.empty(shape, DTYPE)

    def write_temp(self: Any, buf: Any, kind: str, value: int, stream: str, sleep: bool) -> None:
        """Device work that writes ``value`` into all of ``buf`` on ``stream`` (a kernel where one can run)."""
        if kind in DEVICE_KINDS and len(buf.shape) in (1, 2):
            k = KERNELS.get(f"{'sleep' if sleep else ''}fill{len(buf.shape)}")
            grid, block = launch_config(buf.shape)
            k[grid, block, self.stream(stream)](buf, value, *((SLEEP_NS,) if sleep else ()))
        else:
            buf.copy_from_host(np.full(buf.shape, value, DTYPE), stream=self.stream(stream), staging=False)

    def renew_stream(self: Any, name: str) -> None:
        """Drop numba stream ``name`` and make a new one (the driver may hand the old handle out again)."""
        self.streams[name] = None
        gc.collect()  # numba's stream goes: its handle is the driver's to give out again
        self.streams[name] = cuda.stream()

    def read_checked(self: Any, view: View, what: str) -> None:
        got = np.array(view.buf.host) if view.kind in HOST_KINDS else self.read_any(view)
        check_equal(got, view, what)

    # -- a pool block (or a VMM range) handed out again while earlier work may still use it -------------
    @family("races")
    @rule(
        target=BUFFERS,
        dst=BUFFERS,
        temp=st.sampled_from(tuple(TEMPS)),
        alloc_stream=st.sampled_from(REUSE_STREAMS),
        rounds=st.lists(
            st.tuples(
                st.sampled_from(REUSE_STREAMS),
                st.sampled_from(REUSE_STREAMS),
                st.integers(1, 1000),
                st.booleans(),
                st.sampled_from(("fuzz-a", "main", "fuzz-b")),
                st.booleans(),
            ),
            min_size=1,
            max_size=3,
        ),
        renew=st.booleans(),
        trim=st.booleans(),
        last=st.sampled_from(("raw", "device", "host")),
        seed=st.integers(0, 2**16),
        temp_first=st.booleans(),
    )
    def reuse_race(
        self: Any,
        dst: View,
        temp: str,
        alloc_stream: str,
        rounds: list[tuple[str, str, int, bool, str, bool]],
        renew: bool,
        trim: bool,
        last: str,
        seed: int,
        temp_first: bool,
    ) -> Any:
        """Temporaries of ``dst``'s shape, one per round, each written on one stream, copied into ``dst``
        on another and dropped (closed, or let go; the pool's cached blocks then given back to the
        driver, with ``trim``), all allocated on ``alloc_stream`` (renewed between rounds: a new
        numba stream that may get the old handle); then one more, written at once on
        its stream (tracked, or raw through the untracked address, ``_address``: stream order is all the user
        promises; ``ptr`` would mark the buffer shared, and the pool then holds its block) or
        through ``.host``, kept.  Nothing of an earlier round may land on it, and
        ``dst`` must hold the last round's value, whichever is read first.
        """
        model_kind, pool = TEMPS[temp]
        if dst.closed or dst.kind not in DEVICE_KINDS or not dst.contiguous() or not 1 <= len(dst.shape) <= 2:
            return multiple()  # closed operands are the core rules' concern
        if last == "host" and model_kind not in HOST_KINDS:
            last = "device"
        if last == "raw" and temp == "vmm":
            last = "device"  # a VMMBuffer is not stream-ordered memory: nothing orders raw work after it
        order = "F" if dst.model().flags.f_contiguous and not dst.model().flags.c_contiguous else "C"
        shape = dst.shape
        if model_kind == "vmm" and order == "F" and len(shape) > 1:
            order = "C"
        if order == "F" and len(shape) > 1:
            return multiple()  # temporaries are C-ordered: um.copy needs one layout
        what = f"reuse race: {temp} temporaries of {dst.label} allocated on {alloc_stream}"
        with self.run(what, dst):
            for drawn_fill, drawn_copy, value, close, thread, local in rounds:
                # local: all of the round's work on its thread's default stream
                fill, copy = ("per-thread", "per-thread") if local else (drawn_fill, drawn_copy)

                def one_round(
                    fill_stream: str = fill, copy_stream: str = copy, value: int = value, close: bool = close
                ) -> None:
                    tmp = self.temporary(temp, shape, alloc_stream)
                    self.write_temp(tmp, model_kind, value, fill_stream, sleep=True)
                    um.copy(dst.buf, tmp, stream=self.stream(copy_stream))
                    if close:
                        tmp.close()
                    del tmp  # let go: its finalizer releases it now (no close, no settle of its own)

                # On a worker thread, "per-thread" is that thread's default stream: another stream, with
                # the same handle (2) as the main thread's.
                if thread == "main":
                    one_round()
                else:
                    in_worker(thread, one_round, what)
                dst.model()[...] = value
                dst.known()[...] = True
                if trim and pool is not None:
                    self.pool(pool).release_cached()  # the block goes back to the driver, which may hand it out
                if renew and alloc_stream in RENEWABLE:
                    self.renew_stream(alloc_stream)
            buf = self.temporary(temp, shape, alloc_stream)
        if "buf" not in locals():
            return multiple()
        values = values_for(seed, shape)
        keep = self.register(model_kind, buf, True, pool, values)
        with self.run(f"{what}: the last one written {last}-side", keep, dst):
            if last == "host":
                buf.host[...] = values
            elif last == "raw":
                # Stream-ordered allocation: any work on the allocation's stream may use the memory,
                # also work umem_numba never sees (a library given only the address).
                host = np.ascontiguousarray(values)
                n = host.nbytes
                if n:
                    um.driver_call(
                        "cuMemcpyAsync", buf._address, host.ctypes.data, n, self.handle(alloc_stream), detail="fuzz"
                    )
                    um.driver_call("cuStreamSynchronize", self.handle(alloc_stream), detail="fuzz")
            else:
                buf.copy_from_host(values, stream=self.stream(alloc_stream), staging=False)
            for v in (keep, dst) if temp_first else (dst, keep):
                self.read_checked(v, f"{what}: {v.label}")
        return keep

    # -- two or three readers on their streams, then a writer -------------------------------------------
    @family("races")
    @rule(
        target=BUFFERS,
        src=BUFFERS,
        readers=st.lists(st.sampled_from(STREAMS), min_size=2, max_size=3),
        writer=st.sampled_from(("kernel", "opaque", "rows", "host", "copy_from_host")),
        writer_stream=st.sampled_from(STREAMS),
        seed=st.integers(0, 2**16),
        data=st.data(),
    )
    def readers_race(
        self: Any, src: View, readers: list[str], writer: str, writer_stream: str, seed: int, data: Any
    ) -> Any:
        """Kernels on ``readers``' streams copy ``src`` into new buffers, then ``src`` is overwritten:
        the writer must wait for every reader, not only the last one recorded."""
        if src.closed or src.kind not in DEVICE_KINDS or not 1 <= len(src.shape) <= 2:
            return multiple()
        if writer == "host" and src.kind not in HOST_KINDS:
            writer = "kernel"
        if writer == "copy_from_host" and not src.contiguous() and src.kind not in HOST_KINDS:
            writer = "kernel"
        nd, shape = len(src.shape), src.shape
        copies: list[View] = []
        what = f"readers race on {src.label}: readers on {readers}, {writer} writer on {writer_stream}"
        with self.run(what, src):
            for r in readers:
                out = um.DeviceBuffer.zeros(shape, DTYPE) if r != "legacy" else um.ManagedBuffer.zeros(shape, DTYPE)
                kind = "device" if r != "legacy" else "managed"
                view = self.register(kind, out, True, None, src.model())
                view.alloc.known[...] = src.known()
                copies.append(view)
                grid, block = launch_config(shape)
                KERNELS.get(f"copy{nd}")[grid, block, self.stream(r)](out, src.buf, *shape)
            values = values_for(seed, shape)
            if writer == "host":
                src.buf.host[...] = values
            elif writer == "copy_from_host":
                src.buf.copy_from_host(values, stream=self.stream(writer_stream), staging=False)
            else:
                value = int(values.flat[0]) if values.size else 1
                values = np.full(shape, value, DTYPE)
                # "rows": a[i][j] = v, a store through an element (the kernel's source says so only
                # through the row it indexes); "opaque": source umem_numba cannot read.
                name = {"opaque": "opaquefill", "rows": "rowfill"}.get(writer, "sleepfill")
                k = KERNELS.get(f"{name}{nd}")
                grid, block = launch_config(shape)
                extra = () if writer in ("opaque", "rows") else (SLEEP_NS,)
                k[grid, block, self.stream(writer_stream)](src.buf, value, *extra)
            src.model()[...] = values
            src.known()[...] = True
            order = data.draw(st.permutations([src, *copies]), label="reads")
            for v in order:
                self.read_checked(v, f"{what}: {v.label}")
        return multiple(*copies)

    # -- a discard between two writers (issue #27 item 2) ------------------------------------------------
    @family("races")
    @rule(
        view=BUFFERS,
        first=st.sampled_from(STREAMS),
        discard_stream=st.sampled_from(STREAMS),
        then=st.sampled_from(STREAMS),
        op=st.sampled_from(("discard", "discard_prefetch")),
        where=st.sampled_from((0, "cpu")),
        values=st.tuples(st.integers(1, 1000), st.integers(1, 1000)),
    )
    def discard_race(
        self: Any, view: View, first: str, discard_stream: str, then: str, op: str, where: Any, values: tuple[int, int]
    ) -> None:
        """A sleeping writer on ``first``, a discard on another stream, a writer after it: the last write stays."""
        # A strided view's discard is refused (a documented ValueError, the hints rule's case): no race to set up.
        if view.closed or view.kind != "managed" or not 1 <= len(view.shape) <= 2 or not view.contiguous():
            return
        nd = len(view.shape)
        grid, block = launch_config(view.shape)
        what = f"discard race on {view.label}: writer on {first}, {op} on {discard_stream}, writer on {then}"
        with self.run(what, view):
            KERNELS.get(f"sleepfill{nd}")[grid, block, self.stream(first)](view.buf, values[0], SLEEP_NS)
            view.model()[...] = values[0]
            view.known()[...] = True
            s = self.stream(discard_stream)
            if op == "discard":
                view.buf.discard(stream=s)
            else:
                view.buf.discard_prefetch(where, stream=s)
            self.mark_discarded(view)
            KERNELS.get(f"fill{nd}")[grid, block, self.stream(then)](view.buf, values[1])
            view.model()[...] = values[1]
            view.known()[...] = True
            self.read_checked(view, what)

    # -- page-locked host memory the host changes right after a copy --------------------------------------
    @family("races")
    @rule(
        view=BUFFERS,
        host=st.sampled_from(("pinned_array", "PinnedBuffer.host", "ManagedBuffer.host")),
        direction=st.sampled_from(("from_host", "to_host")),
        stream=st.sampled_from(STREAMS),
        staging=st.sampled_from((None, False, True)),
        seeds=st.tuples(st.integers(0, 2**16), st.integers(0, 2**16)),
    )
    def page_locked_race(
        self: Any, view: View, host: str, direction: str, stream: str, staging: Any, seeds: tuple[int, int]
    ) -> None:
        """``copy_from_host`` from, or ``copy_to_host`` into, numpy memory the driver knows (page-locked or
        managed): the copy has read (or written) it when the call returns, so the host may change the
        source (or read the result) at once."""
        if view.closed or not view.contiguous():
            return
        shape = view.shape
        order = "F" if view.model().flags.f_contiguous and not view.model().flags.c_contiguous else "C"
        what = f"{view.label}.copy_{direction}({host}, stream={stream}, staging={staging})"
        owner: Any = None
        with self.run(what, view):
            if host == "pinned_array":
                arr = page_locked(shape, order)
            else:
                cls = um.PinnedBuffer if host.startswith("Pinned") else um.ManagedBuffer
                owner = cls.empty(shape, DTYPE, order=order)
                arr = owner.host
            try:
                s = self.stream(stream)
                if direction == "from_host":
                    arr[...] = values_for(seeds[0], shape)
                    view.buf.copy_from_host(arr, stream=s, staging=staging)
                    view.model()[...] = arr
                    view.known()[...] = True
                    arr[...] = values_for(seeds[1], shape)  # the host reuses its array at once
                    self.read_checked(view, what)
                else:
                    arr[...] = -7
                    view.buf.copy_to_host(arr, stream=s, staging=staging)
                    check_equal(np.array(arr), view, what)
            finally:
                if owner is not None:
                    owner.close()

    # -- a copy between two parts of one allocation --------------------------------------------------------
    @family("races")
    @rule(
        view=BUFFERS,
        writer_stream=st.sampled_from(STREAMS),
        stream=st.sampled_from(STREAMS),
        value=st.integers(1, 1000),
        upward=st.booleans(),
    )
    def same_allocation_copy(self: Any, view: View, writer_stream: str, stream: str, value: int, upward: bool) -> None:
        """``um.copy`` from one half of an allocation into the other, its source written just before:
        the copy writes the allocation (it reads it too), so host access waits for it."""
        alloc = view.alloc
        a = alloc.model
        if alloc.closed or a.ndim not in (1, 2) or a.shape[0] < 2 or not a.flags.c_contiguous:
            return
        h = a.shape[0] // 2
        lo, hi = (slice(0, h), slice(h, 2 * h))
        dst_key, src_key = (lo, hi) if upward else (hi, lo)
        dst, src = alloc.buf[dst_key], alloc.buf[src_key]
        what = f"um.copy({alloc.name}[{dst_key.start}:{dst_key.stop}], {alloc.name}[{src_key.start}:{src_key.stop}])"
        with self.run(what, alloc.views[0]):
            if alloc.kind in DEVICE_KINDS:
                grid, block = launch_config(src.shape)
                KERNELS.get(f"sleepfill{a.ndim}")[grid, block, self.stream(writer_stream)](src, value, SLEEP_NS)
            else:
                src.copy_from_host(np.full(src.shape, value, DTYPE), stream=self.stream(writer_stream), staging=False)
            alloc.model[src_key] = value
            alloc.known[src_key] = True
            um.copy(dst, src, stream=self.stream(stream))
            alloc.model[dst_key] = alloc.model[src_key]
            alloc.known[dst_key] = True
            self.read_checked(alloc.views[0], what)

    # -- pool memory another library used, let go, and the next buffer of its size -------------------------
    @family("races")
    @rule(
        target=BUFFERS,
        temp=st.sampled_from(("device-pool", "managed-pool", "device")),
        shape=st.tuples(st.integers(1, 24)),
        consumer_stream=st.sampled_from((*NON_BLOCKING, "s1", "legacy")),
        protocol=st.sampled_from(("dlpack", "cai")),
        alloc_stream=st.sampled_from(STREAMS),
        values=st.tuples(st.integers(1, 1000), st.integers(1, 1000)),
    )
    def escaped_reuse(
        self: Any,
        temp: str,
        shape: tuple[int, ...],
        consumer_stream: str,
        protocol: str,
        alloc_stream: str,
        values: tuple[int, int],
    ) -> Any:
        """A temporary handed over for good (DLPack, CAI) to a consumer that writes it on its stream,
        then closed and let go; the next temporary of its size must not get the memory while the
        consumer may still write it."""
        model_kind, pool = TEMPS[temp]
        what = f"escaped {temp} temporary written by a {protocol} consumer on {consumer_stream}"
        with self.run(what):
            tmp = self.temporary(temp, shape, alloc_stream)
            handle = self.handle(consumer_stream)
            if protocol == "dlpack":
                cap = Capsule(tmp.__dlpack__(stream=self.dlpack_stream(consumer_stream)))
                try:
                    memset_elements(cap.ptr, cap.shape, cap.strides, values[0], handle)
                finally:
                    cap.release()
                del cap
            else:
                iface = tmp.__cuda_array_interface__
                memset_elements(iface["data"][0], tuple(iface["shape"]), (4,), values[0], handle)
            tmp.close()
            del tmp
            gc.collect()
            buf = self.temporary(temp, shape, alloc_stream)
        if "buf" not in locals():
            return multiple()
        keep = self.register(model_kind, buf, True, pool)
        with self.run(f"{what}: the next temporary of its size", keep):
            self.write_temp(buf, model_kind, values[1], alloc_stream, sleep=False)
            keep.model()[...] = values[1]
            self.read_checked(keep, what)
        return keep

    # -- a VMM buffer of several chunks, shrunk or let go while a copy into it is queued --------------------
    @family("races")
    @rule(
        chunks=st.integers(2, 3),
        stream=st.sampled_from(STREAMS),
        how=st.sampled_from(("shrink", "resize", "close", "let go")),
        seed=st.integers(0, 2**16),
    )
    def vmm_chunk_race(self: Any, chunks: int, stream: str, how: str, seed: int) -> None:
        """A DMA into every chunk of a VMMBuffer, queued on ``stream``; then chunks are unmapped
        (shrink, resize, close, or the buffer let go): the unmap waits for the copy."""
        rows = um.allocation_granularity() // DTYPE.itemsize
        what = f"VMMBuffer of {chunks} chunks: a copy on {stream}, then {how}"
        with self.run(what):
            buf = um.VMMBuffer.empty((chunks * rows,), DTYPE, chunk_bytes=rows * DTYPE.itemsize)
            try:
                values = values_for(seed, (chunks * rows,))
                buf.copy_from_host(values, stream=self.stream(stream), staging=False)
                if how in ("shrink", "resize"):
                    getattr(buf, how)(rows)
                    got = buf.copy_to_host()
                    np.testing.assert_array_equal(got, values[:rows], err_msg=f"{what}: the kept chunk")
                elif how == "close":
                    buf.close()
                else:
                    del buf
                    gc.collect()
            finally:
                if "buf" in locals():
                    buf.close()

    # -- raw pool memory: allocate / free, ordered on a stream or not at all --------------------------------
    @family("races")
    @rule(
        kind=st.sampled_from(("device", "managed")),
        n=st.integers(1, 64),
        alloc_stream=st.sampled_from(STREAMS),
        user_stream=st.sampled_from(STREAMS),
        next_stream=st.sampled_from(STREAMS),
        values=st.tuples(st.integers(1, 1000), st.integers(1, 1000)),
    )
    def raw_pool_reuse(
        self: Any, kind: str, n: int, alloc_stream: str, user_stream: str, next_stream: str, values: tuple[int, int]
    ) -> None:
        """``pool.allocate`` / ``pool.free``: memory written on the allocation's stream and freed there,
        or written on any stream and freed ``unordered=True``; the next allocation of its size, on
        another stream, written at once, must keep its own value."""
        pool = self.pool(kind)
        unordered = user_stream != alloc_stream
        what = (
            f"{kind} pool: allocate on {alloc_stream}, write on {user_stream}, "
            f"free({'unordered' if unordered else alloc_stream}), allocate and write on {next_stream}"
        )
        with self.run(what):
            ptr = pool.allocate(4 * n, stream=self.stream(alloc_stream))
            um.driver_call("cuMemsetD32Async", ptr, values[0], n, self.handle(user_stream), detail="fuzz")
            if unordered:
                pool.free(ptr, unordered=True)  # "may still be used by work on any stream"
            else:
                pool.free(ptr, self.stream(alloc_stream))
            again = pool.allocate(4 * n, stream=self.stream(next_stream))
            try:
                h = self.handle(next_stream)
                um.driver_call("cuMemsetD32Async", again, values[1], n, h, detail="fuzz")
                out = np.zeros(n, DTYPE)
                for when in ("once its stream is done", "once all device work ran"):
                    um.driver_call("cuStreamSynchronize", h, detail="fuzz")
                    um.driver_call("cuMemcpyDtoH", out.ctypes.data, again, 4 * n, detail="fuzz")
                    bad = np.flatnonzero(out != values[1])
                    assert not bad.size, f"{what}: {when}, [{bad[0]}] = {out[bad[0]]} (expected {values[1]})"
                    self.drain()
            finally:
                pool.free(again, self.stream(next_stream))

    # -- staged copies under the "off" coherence policy: the staging area waits all the same -----------------
    @family("races")
    @rule(
        view=BUFFERS,
        seeds=st.lists(st.integers(0, 2**16), min_size=2, max_size=3),
        streams=st.lists(st.sampled_from(STREAMS), min_size=3, max_size=3),
        staging=st.sampled_from(("internal", "user")),
    )
    def staged_under_policy_off(self: Any, view: View, seeds: list[int], streams: list[str], staging: str) -> None:
        """Staged uploads back to back into two buffers inside ``coherence_policy("off")``, then a synchronise: the user
        opted out of waits on their buffers, never on the staging area (the copy layer's own memory)."""
        if view.closed or not view.contiguous() or view.kind not in DEVICE_KINDS:
            return
        stg: Any = True if staging == "internal" else self.staging_arg("user")
        what = f"{len(seeds)} staged uploads into {view.label} under coherence_policy('off'), staging={staging}"
        with self.run(what, view):
            # Into the view and a second buffer in turn: a slot refilled under the copy engine shows as
            # the other upload's values.
            other = um.DeviceBuffer.empty(view.shape, DTYPE, order="F" if view.model().flags.f_contiguous else "C")
            # A program that opts out synchronises itself, before as after: earlier device work on
            # the buffer (a queued kernel) is not waited for inside the block.
            self.drain()
            try:
                with um.coherence_policy("off"):
                    for i, (seed, stream) in enumerate(zip(seeds, streams, strict=False)):
                        target = view.buf if i % 2 == 0 else other
                        target.copy_from_host(values_for(seed, view.shape), stream=self.stream(stream), staging=stg)
                self.drain()  # "off": the program synchronises itself
                last_own = seeds[(len(seeds) - 1) // 2 * 2]
                view.model()[...] = values_for(last_own, view.shape)
                view.known()[...] = True
                self.read_checked(view, what)
                got = other.copy_to_host()
                np.testing.assert_array_equal(
                    got, values_for(seeds[1], view.shape), err_msg=f"{what}: the second buffer"
                )
            finally:
                other.close()

    # -- another library reads what a kernel still writes --------------------------------------------------
    @family("races")
    @rule(
        view=BUFFERS,
        writer_stream=st.sampled_from((*NON_BLOCKING, *STREAMS)),  # non-blocking first: the legacy stream skips them
        consumer_stream=st.sampled_from(("none", *STREAMS)),
        via=st.sampled_from(("export", "lend")),
        lend_stream=st.sampled_from(STREAMS),
        value=st.integers(1, 1000),
    )
    def consumer_reads_race(
        self: Any, view: View, writer_stream: str, consumer_stream: str, via: str, lend_stream: str, value: int
    ) -> None:
        """A sleeping writer, then a DLPack consumer (``__dlpack__(stream=...)``, ``None``: the legacy
        stream; of the buffer, or of a lent view) that copies the tensor out on its stream and waits for
        that stream alone: it must get the writer's values."""
        if view.closed or view.kind not in DEVICE_KINDS or not view.contiguous() or not 1 <= len(view.shape) <= 2:
            return
        nd = len(view.shape)
        grid, block = launch_config(view.shape)
        what = f"{view.label}: writer on {writer_stream}, a DLPack consumer on {consumer_stream} reads it ({via})"
        with self.run(what, view):
            KERNELS.get(f"sleepfill{nd}")[grid, block, self.stream(writer_stream)](view.buf, value, SLEEP_NS)
            view.model()[...] = value
            view.known()[...] = True
            handle = 0 if consumer_stream == "none" else self.handle(consumer_stream)
            named = None if consumer_stream == "none" else self.dlpack_stream(consumer_stream)
            m = view.model()
            out = page_locked(m.shape, "F" if m.flags.f_contiguous and not m.flags.c_contiguous else "C")

            def copy_out(capsule: Any) -> None:
                cap = Capsule(capsule)
                try:
                    if out.size:
                        um.driver_call("cuMemcpyDtoHAsync", out.ctypes.data, cap.ptr, out.nbytes, handle, detail="fuzz")
                finally:
                    cap.release()

            if via == "export":
                copy_out(view.buf.__dlpack__(stream=named))
                view.alloc.escaped = True
            else:
                with view.buf.lend(self.stream(lend_stream)) as lent:
                    copy_out(lent.__dlpack__(stream=named))
            um.driver_call("cuStreamSynchronize", handle, detail="fuzz consumer")
            check_equal(np.array(out), view, what)

    # -- another thread reads while a lend block is open ------------------------------------------------------
    @family("races")
    @rule(
        view=BUFFERS,
        lend_stream=st.sampled_from(STREAMS),
        consumer_stream=st.sampled_from(STREAMS),
        value=st.integers(1, 1000),
    )
    def read_during_lend(self: Any, view: View, lend_stream: str, consumer_stream: str, value: int) -> None:
        """``with buf.lend(s) as v:`` on this thread, ``.host`` on another thread started inside the
        block, then a DLPack consumer writes ``v``: the other thread's read waits for the block and the
        consumer's work filed at its end, so it gets the consumer's value."""
        # Host access (.host) waits for the registrations in flight on other threads; device work
        # (copy_to_host is a DMA) is ordered by what is filed when it is issued, so a copy started
        # while the block is open may rightly read the values from before it.
        if view.closed or view.kind not in DEVICE_KINDS or view.kind not in HOST_KINDS:
            return
        what = f"{view.label}: .host on another thread during lend({lend_stream}), a consumer on {consumer_stream}"

        def read() -> np.ndarray:
            return np.array(view.buf.host)

        with self.run(what, view):
            with view.buf.lend(self.stream(lend_stream)) as lent:
                pending = worker_thread("fuzz-a").submit(read)
                time.sleep(0.01)  # let it reach its wait
                cap = Capsule(lent.__dlpack__(stream=self.dlpack_stream(consumer_stream)))
                try:
                    memset_elements(cap.ptr, cap.shape, cap.strides, value, self.handle(consumer_stream))
                finally:
                    cap.release()
            view.model()[...] = value
            view.known()[...] = True
            try:
                got = pending.result(timeout=STEP_TIMEOUT)
            except concurrent.futures.TimeoutError:
                raise StepHungError(f"{what}: the other thread's read did not return") from None
            check_equal(got, view, what)

    # -- a pool block freed by one thread's default stream, taken by another's ----------------------------
    @family("races")
    @rule(
        target=BUFFERS,
        temp=st.sampled_from(("device-pool", "managed-pool", "device")),
        shape=st.tuples(st.integers(1, 24)),
        thread=st.sampled_from(("fuzz-a", "fuzz-b")),
        values=st.tuples(st.integers(1, 1000), st.integers(1, 1000)),
        raw=st.booleans(),
    )
    def cross_thread_reuse(
        self: Any, temp: str, shape: tuple[int, ...], thread: str, values: tuple[int, int], raw: bool
    ) -> Any:
        """A worker thread allocates a temporary on its default stream (handle 2), writes it, copies it
        into a kept buffer there and lets it go; this thread then allocates one of its size on its own
        default stream (handle 2 too, another stream) and writes it at once (raw through the untracked ``_address``, or
        tracked): the worker's copy must still read the worker's value."""
        model_kind, pool = TEMPS[temp]
        what = f"{temp} temporary let go on {thread}'s default stream, the next one taken on this thread's"
        out = um.DeviceBuffer.zeros(shape, DTYPE)
        kept = self.register("device", out, True, None)

        def worker() -> None:
            tmp = self.temporary(temp, shape, "per-thread")
            self.write_temp(tmp, model_kind, values[0], "per-thread", sleep=True)
            um.copy(out, tmp, stream=self.stream("per-thread"))
            del tmp

        with self.run(what, kept):
            in_worker(thread, worker, what)
            kept.model()[...] = values[0]
            buf = self.temporary(temp, shape, "per-thread")
            keep = self.register(model_kind, buf, True, pool, np.full(shape, values[1], DTYPE))
            if raw:
                host = np.full(shape, values[1], DTYPE)
                h = self.handle("per-thread")
                um.driver_call("cuMemcpyAsync", buf._address, host.ctypes.data, host.nbytes, h, detail="fuzz")
                um.driver_call("cuStreamSynchronize", h, detail="fuzz")
            else:
                self.write_temp(buf, model_kind, values[1], "per-thread", sleep=False)
            self.read_checked(kept, what)
            self.read_checked(keep, what)
            return multiple(kept, keep)
        return multiple(kept)

    # -- work that took a pool buffer's address registers only after a close on another thread ----------
    @family("races")
    @rule(
        target=BUFFERS,
        temp=st.sampled_from(("device-pool", "managed-pool", "device", "managed")),
        n=st.integers(1, 24),
        op=st.sampled_from(("launch", "copy_from_host", "um.copy")),
        values=st.tuples(st.integers(1, 1000), st.integers(1, 1000)),
    )
    def late_registration(self: Any, temp: str, n: int, op: str, values: tuple[int, int]) -> Any:
        """A thread starts work that writes a pool temporary (or a default ManagedBuffer, whose memory the
        allocation cache hands on) and stops right before the work registers (it has taken the address);
        this thread closes the temporary, takes the next one of its size (the pool or the cache may hand
        the same memory on) and writes it.  The late work must be refused with
        BufferClosedError: never write the next buffer."""
        model_kind, pool = TEMPS[temp]
        shape = (n,)
        what = f"{op} on a {temp} temporary registering after its close on another thread"
        reached, go = threading.Event(), threading.Event()
        begin_use = Tracker.begin_use

        def paused(tracker: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == "fuzz-late" and not reached.is_set():
                reached.set()
                go.wait(STEP_TIMEOUT)
            return begin_use(tracker, *args, **kwargs)

        outcome: list[BaseException | None] = []
        with self.run(what):
            tmp = self.temporary(temp, shape, "s1")
            src = um.DeviceBuffer.from_array(np.full(shape, values[0], DTYPE))
            grid, block = launch_config(shape)
            launch = KERNELS.get("fill1")[grid, block, self.stream("s2")]
            launch(tmp, values[0])  # compiled for these types and cached: the late launch is the direct one
            launch(tmp, values[0])

            def late() -> None:
                try:
                    if op == "launch":
                        launch(tmp, values[0])
                    elif op == "copy_from_host":
                        tmp.copy_from_host(np.full(shape, values[0], DTYPE), stream=self.stream("s2"), staging=False)
                    else:
                        um.copy(tmp, src, stream=self.stream("s2"))
                    outcome.append(None)
                except BaseException as exc:
                    outcome.append(exc)

            Tracker.begin_use = paused  # type: ignore[method-assign]
            worker = threading.Thread(target=late, name="fuzz-late", daemon=True)
            try:
                worker.start()
                if not reached.wait(STEP_TIMEOUT):
                    raise StepHungError(f"{what}: the work never reached its registration")
                tmp.close()
                nxt = self.temporary(temp, shape, "s1")
                nxt.copy_from_host(np.full(shape, values[1], DTYPE), stream=self.stream("s1"), staging=False)
            finally:
                go.set()
                worker.join(STEP_TIMEOUT)
                Tracker.begin_use = begin_use  # type: ignore[method-assign]
            keep = self.register(model_kind, nxt, True, pool, np.full(shape, values[1], DTYPE))
            src.close()
            if worker.is_alive():
                raise StepHungError(f"{what}: the late work did not return")
            if not (outcome and isinstance(outcome[0], um.BufferClosedError)):
                raise AssertionError(f"{what}: the late work was not refused (BufferClosedError): {outcome!r}")
            self.read_checked(keep, what)
            return keep
        return multiple()
