"""Pool buffers allocated by a thread whose first CUDA call is the allocation (found by the API fuzzer).

The fuzzer's ``races`` family, run on an H100, allocated a pool buffer on a worker thread's
default stream: the pool's capture check asked ``cuStreamIsCapturing(2)`` with no context current
in that thread, and the driver answered ``CUDA_ERROR_INVALID_CONTEXT``, raised as a raw
``CudaError``.  The handles 0, 1 and 2 name a stream of the current context; the pool now checks
them with its own context current.  The simulated driver has one context, current everywhere,
so only a GPU can fail these tests.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um

CLASSES = {"device": um.DeviceBuffer, "managed": um.ManagedBuffer, "pinned": um.PinnedBuffer}


def _pool(kind: str) -> um.MemoryPool:
    from umem_numba._memory._resources import managed_pool_support

    if kind == "managed" and managed_pool_support():
        pytest.skip(f"managed pools unsupported here: {managed_pool_support()}")
    return um.MemoryPool(kind)


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(CLASSES))
@pytest.mark.parametrize("stream", ["per-thread object", "per-thread 2", "legacy object", "legacy 0"])
def test_pool_allocation_is_a_fresh_threads_first_cuda_call(kind, stream, rng):
    """The allocation, then a copy in and out, all on a new thread that made no CUDA call before."""
    pool = _pool(kind)
    # Made here, on the main thread: numba's stream calls would make a context current there.
    s = {
        "per-thread object": cuda.per_thread_default_stream(),
        "per-thread 2": 2,
        "legacy object": cuda.default_stream(),
        "legacy 0": 0,
    }[stream]
    values = random_array(rng, (257,), np.float32)

    def job() -> np.ndarray:
        buf = CLASSES[kind].empty(values.shape, np.float32, pool=pool, stream=s)
        try:
            buf.copy_from_host(values, stream=s)
            return buf.copy_to_host(stream=s)
        finally:
            buf.close()

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:  # a new OS thread: no context current
            got = ex.submit(job).result(timeout=50)
        np.testing.assert_array_equal(got, values)
    finally:
        pool.close()
