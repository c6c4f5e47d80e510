"""A pool closed (or let go) while buffers or raw addresses of it are still allocated (found by the API fuzzer).

The fuzzer crashed on an H100 (driver 580) with SIGSEGV inside ``cuEventSynchronize`` /
``cuCtxSynchronize`` after programs that closed their pools while escaped pool buffers were still
alive.  A probe showed the cause: ``cuMemPoolDestroy`` while allocations of the pool are
outstanding, then freeing one of them, crashes the process at the next synchronise, for device and
pinned pools alike, though the driver documents the destroy as deferred until the last free.  The
driver pool is now destroyed with its last allocation.  The simulated driver refuses such a
destroy (it cannot crash as the GPU does).  Each scenario runs in a child process: on a GPU the
defect kills the process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from umem_numba import _sim

_PRELUDE = """
import gc, sys
import numpy as np
from numba import cuda
import umem_numba as um

kind, how = sys.argv[1], sys.argv[2]
cls = {"device": um.DeviceBuffer, "pinned": um.PinnedBuffer, "managed": um.ManagedBuffer}[kind]
rng = np.random.default_rng()
s = cuda.stream()

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


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["device", "pinned"])
@pytest.mark.parametrize("how", ["closed", "collected", "raw"])
def test_buffers_outlive_their_closed_pool(kind, how):
    """Sleeping kernels write three pool buffers; the pool is closed (or collected) before they are read
    and freed (and, ``raw``, before an address of ``allocate()`` is freed): the values are right and
    the process lives on (20 trials)."""
    trials = 3 if _sim.active() else 20
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(_SCENARIO).replace("TRIALS", str(trials))
    proc = subprocess.run(
        [sys.executable, "-c", code, kind, how], capture_output=True, text=True, timeout=280, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit status {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
