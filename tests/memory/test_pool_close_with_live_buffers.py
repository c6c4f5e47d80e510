"""A pool closed (or let go) while buffers or raw addresses of it are still allocated (found by the API fuzzer).

The fuzzer crashed on an H100 (driver 580) with SIGSEGV inside ``cuEventSynchronize`` /
``cuCtxSynchronize`` after programs that closed their pools while escaped pool buffers were still
alive.  A probe showed the cause: ``cuMemPoolDestroy`` while allocations of the pool are
outstanding, then freeing one of them, crashes the process at the next synchronise, for device and
pinned pools alike, though the driver documents the destroy as deferred until the last free.  The
driver pool is now destroyed with its last allocation.  The simulated driver refuses such a
destroy (it cannot crash as the GPU does).  Each scenario runs in a child process: on a GPU the
defect kills the process.

The ``cycle`` case (the fuzzer again, on a GPU and on the simulated driver): the pool is closed,
and its buffers are then collected in one garbage cycle.  A cycle collection runs every weak
reference callback before any ``__del__``, so the driver pool's finalizer ran first and destroyed
the pool under allocations the buffers' ``__del__`` freed a moment later: SIGSEGV on an H200 (driver
580); on the simulated driver a refused destroy, swallowed, and the pool's memory lost.  The pool now
counts its outstanding driver allocations and is destroyed at the free of the last one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from umem_numba import _sim

_PRELUDE = """
import gc, os, sys, warnings
import numpy as np
from numba import cuda
import umem_numba as um

kind, how = sys.argv[1], sys.argv[2]
cls = {"device": um.DeviceBuffer, "pinned": um.PinnedBuffer, "managed": um.ManagedBuffer}[kind]
rng = np.random.default_rng()
s = cuda.stream()

# A free or destroy that fails is reported as a RuntimeWarning, from a finalizer: fatal here.
warnings.filterwarnings("error", message="umem_numba", category=RuntimeWarning)
def fatal(unraisable):
    print(f"in a finalizer: {unraisable.exc_value!r}", file=sys.stderr, flush=True)
    os._exit(3)
sys.unraisablehook = fatal

@um.jit
def sleepfill(a, v, ns):
    i = cuda.grid(1)
    if i == 0:
        cuda.nanosleep(ns)
    if i < a.size:
        a[i] = v[i]
"""

_SCENARIO = """
for trial in range(TRIALS):
    pool = um.MemoryPool(kind)
    values = [rng.random(256) for _ in range(3)]
    bufs = [cls.empty(256, np.float64, pool=pool, stream=s) for _ in range(3)]
    for b, v in zip(bufs, values):
        sleepfill[2, 128, s](b, um.DeviceBuffer.from_array(v), 1_000_000)
    if how == "raw":
        ptr = pool.allocate(1024, stream=s)
    if how == "collected":
        del pool
        gc.collect()
    else:
        pool.close()
    for b, v in zip(bufs, values):
        np.testing.assert_array_equal(b.copy_to_host(), v)
    for b in bufs:
        b.close()
    if how == "raw":
        pool.free(ptr, stream=s)
    cuda.synchronize()
print("ok")
"""

_CYCLE = """
from umem_numba import _driver
def free_memory():
    gc.collect()
    cuda.synchronize()
    return _driver.mem_get_info()[0]

for trial in range(TRIALS + 1):
    if trial == 1:  # the driver's first-use memory is taken by now
        before = free_memory()
    pool = um.MemoryPool(kind)
    values = [rng.random(256) for _ in range(3)]
    bufs = [cls.empty(256, np.float64, pool=pool, stream=s) for _ in range(3)]
    for b, v in zip(bufs, values):
        sleepfill[2, 128, s](b, um.DeviceBuffer.from_array(v), 1_000_000)
    np.testing.assert_array_equal(bufs[0].copy_to_host(), values[0])
    pool.close()
    cycle = [bufs]
    cycle.append(cycle)  # the buffers are garbage only to a cycle collection
    del bufs, b, cycle, pool
    gc.collect()  # weakref callbacks run before __del__ here: the pool's before its buffers'
    check = um.DeviceBuffer.from_array(values[1])  # the process still works
    sleepfill[2, 128, s](check, um.DeviceBuffer.from_array(values[2]), 1_000)
    np.testing.assert_array_equal(check.copy_to_host(stream=s), values[2])
    check.close()
    cuda.synchronize()
lost = before - free_memory()
# A device pool left undestroyed keeps at least 2 MiB per trial; the driver's own bookkeeping moves
# by a few pages (64 KiB seen on an H200).  A pinned pool holds host memory: there the warning tells.
assert lost <= 8 << 20, f"{lost} bytes of device memory not given back: a driver pool was not destroyed"
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["device", "pinned"])
@pytest.mark.parametrize("how", ["closed", "collected", "raw", "cycle"])
def test_buffers_outlive_their_closed_pool(kind, how):
    """Sleeping kernels write three pool buffers; the pool is closed (or collected) before they are read
    and freed (and, ``raw``, before an address of ``allocate()`` is freed; ``cycle``, the closed pool's
    buffers collected in one garbage cycle): the values are right, the process lives on and gives its
    memory back (20 trials)."""
    trials = 3 if _sim.active() else 20
    scenario = _CYCLE if how == "cycle" else _SCENARIO
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(scenario).replace("TRIALS", str(trials))
    proc = subprocess.run(
        [sys.executable, "-c", code, kind, how], capture_output=True, text=True, timeout=280, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit status {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
