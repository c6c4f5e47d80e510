"""Issue #27 item 3: two threads copying through one user ``PinnedBuffer`` given as ``staging=``.

The internal staging area has a lock that makes one copy use it at a time; a user's staging
buffer had none: the chunks of two concurrent copies were mixed (5 in 10 trials on an H100).
Copies through one user staging buffer now take turns (the second waits for the first, as
with the internal area): every destination holds exactly its own source.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array

import umem_numba as um
from umem_numba._driver import _sim

#: Elements of each copy, and bytes of the shared staging buffer: many chunks per copy.
N = 1 << 22
STAGING_BYTES = (256 << 10) if _sim.active() else (1 << 20)
TRIALS = ORDERING_TRIALS


def _run_together(*fns):
    """Start every function at once on its own thread; re-raise the first error.

    The interpreter switches threads every microsecond meanwhile (not every 5 ms): over the
    simulated driver, whose calls never release the GIL, the two copies then interleave as
    they do on a GPU, where driver calls release it.
    """
    barrier = threading.Barrier(len(fns))
    errors: list[BaseException] = []

    def run(fn):
        try:
            cuda.current_context() if not _sim.active() else None  # the thread's CUDA context
            barrier.wait()
            fn()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("directions", ["up-up", "up-down", "down-down"])
@pytest.mark.parametrize("kind", ["device", "managed"])
def test_two_threads_share_one_staging_buffer(kind, directions, rng):
    cls = um.DeviceBuffer if kind == "device" else um.ManagedBuffer
    staging = um.PinnedBuffer.empty(STAGING_BYTES, np.uint8)
    a = cls.empty(N, np.float32)
    b = cls.empty(N, np.float32)
    try:
        for trial in range(TRIALS):
            data_a = random_array(rng, N, np.float32)
            data_b = random_array(rng, N, np.float32) + 2.0  # never equal to data_a
            out: dict[str, np.ndarray] = {}
            first, second = directions.split("-")
            # A download reads what the buffer already holds.
            if first == "down":
                a.copy_from_host(data_a)
            if second == "down":
                b.copy_from_host(data_b)
            cuda.synchronize()

            def one(buf, data, direction, name, out=out):
                if direction == "up":
                    return lambda: buf.copy_from_host(data, staging=staging)
                return lambda: out.__setitem__(name, buf.copy_to_host(staging=staging))

            _run_together(one(a, data_a, first, "a"), one(b, data_b, second, "b"))
            got_a = out["a"] if first == "down" else a.copy_to_host(staging=False)
            got_b = out["b"] if second == "down" else b.copy_to_host(staging=False)
            mixed_a, mixed_b = int((got_a != data_a).sum()), int((got_b != data_b).sum())
            assert not mixed_a and not mixed_b, (
                f"trial {trial}: {mixed_a} elements of a and {mixed_b} of b hold the other copy's data"
            )
    finally:
        a.close()
        b.close()
        staging.close()
