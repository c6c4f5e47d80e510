"""A tracked launch as a thread's first CUDA call, on the streams named by a handle of the current context.

On 2 x H200 (driver 580, one device visible per process), ``tests/coherence/test_close_then_launch.py``
launched a ``um.jit`` kernel from a new thread on the default stream: with one device nothing
before the launch asked the driver anything, so no context was current in that thread, and the
launch's capture check (``cuStreamIsCapturing(0)``) failed with ``CUDA_ERROR_INVALID_CONTEXT``, a
raw ``CudaError``.  The handles 0, 1 and 2 name a stream of the current context; the launch now
makes numba's context current first.  The simulated driver has one context, current in every
thread, so only a GPU can fail these tests.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um


@cuda.jit
def _scale(out, a, k):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] * k


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", ["0", "1", "2", "legacy object", "per-thread object"])
@pytest.mark.parametrize("cached", [True, False], ids=["direct", "first"])
def test_a_launch_is_a_fresh_threads_first_cuda_call(stream, cached, rng):
    """``cached``: the types were launched before on the main thread (the direct call); else numba's launch."""
    kernel = um.jit(_scale)
    values = random_array(rng, (1000,), np.float64)
    a = um.DeviceBuffer.from_array(values)
    out = um.DeviceBuffer.zeros(1000, np.float64)
    s = {
        "0": 0,
        "1": 1,
        "2": 2,
        "legacy object": cuda.default_stream(),
        "per-thread object": cuda.per_thread_default_stream(),
    }[stream]
    if cached:
        kernel[4, 256, s](out, a, 1.0)
        out.synchronize()

    def job() -> None:
        kernel[4, 256, s](out, a, 3.0)

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:  # a new OS thread: no context current
            ex.submit(job).result(timeout=100)
        np.testing.assert_array_equal(out.copy_to_host(), values * 3.0)
    finally:
        a.close()
        out.close()
