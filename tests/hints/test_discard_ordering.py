"""Issue #27 item 2: a discard is ordered after the device work still pending on the buffer.

A ``um.jit`` writer sleeps on stream 1; ``buf.discard(stream=s2)``; a writer on s2; then
``buf.host``.  On an H100 (driver 580) the later write was lost in 5 of 5 trials: the discard
did not order itself after the pending writer.  The simulated driver queued the discard behind
its stream's waits and passed; this test fails there once the simulator expresses the driver's
behaviour, and fails on the GPU today.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim

N = 16 * 1024
GRID, BLOCK = 16, 1024
#: Device time of the first writer on a GPU; over the simulated driver the work runs late anyway.
SLEEP_MS = 1 if _sim.active() else 60


def _needs_discard() -> None:
    api = _driver.api()
    if api.discard_missing:
        pytest.skip(api.discard_missing)
    if not cuda.get_current_device().CONCURRENT_MANAGED_ACCESS:
        pytest.skip("discards need concurrentManagedAccess")


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("second", ["other-stream", "same-stream-as-first"])
@pytest.mark.parametrize("op", ["discard", "discard_range", "discard_prefetch"])
def test_write_after_a_discard_behind_a_pending_writer_is_kept(op, second, rng):
    """writer (sleeping) on s1 -> discard on s2 -> writer on s2 -> host: the last writer's values.

    ``same-stream-as-first`` puts the discard and the second writer on s1 too (the discard
    then has its own stream's sleeping work in front of it).
    """
    _needs_discard()
    fill = um.jit(sleeping.fill.py_func)
    s1 = cuda.stream()
    s2 = s1 if second == "same-stream-as-first" else cuda.stream()
    buf = um.ManagedBuffer.zeros(N, np.float32)
    try:
        for trial in range(ORDERING_TRIALS):
            first = float(rng.integers(1, 1000))
            last = first + float(rng.integers(1, 1000))
            fill[GRID, BLOCK, s1](buf, first, SLEEP_MS)
            if op == "discard":
                buf.discard(s2)
            elif op == "discard_range":
                buf.discard_range(0, N, s2)
            else:
                buf.discard_prefetch(0, s2)
            fill[GRID, BLOCK, s2](buf, last, 0)
            got = buf.host
            wrong = int((got != last).sum())
            assert not wrong, (
                f"trial {trial}: {wrong} of {N} elements lost the write made after the discard "
                f"(values seen: {sorted(set(np.unique(got).tolist()))[:4]})"
            )
    finally:
        buf.close()
