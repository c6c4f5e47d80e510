"""A plain numba launch (``kernel[g, b, s](buf)``) comes after earlier device work on the buffer.

numba launches on a stream umem_numba is not told, so such a launch cannot be ordered after earlier
work on the device: the tracker settles that work on the host first (a tracked writer on another
stream, or an earlier plain launch).  Found by the API fuzzer's ``plain`` family once the simulated
driver queued plain launches on their streams: a plain fill on s1 after ``DeviceBuffer.zeros`` on a
non-blocking stream was overwritten by the zeros.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, sleeping

import umem_numba as um
from umem_numba._driver import _sim

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

N = 4096
SLEEP_MS = 20


@pytest.mark.parametrize("earlier", ["tracked", "plain"])
def test_a_plain_launch_comes_after_earlier_work_on_another_stream(earlier, rng):
    first, second = cuda.stream(), cuda.stream()
    tracked_fill = um.coherent(sleeping.fill)
    for trial in range(3 if _sim.active() else ORDERING_TRIALS):
        old, new = (float(v) for v in rng.integers(1, 1 << 20, 2))
        buf = um.ManagedBuffer.zeros(N, np.float32)
        fill = tracked_fill if earlier == "tracked" else sleeping.fill
        fill[N // 128, 128, first](buf, old, SLEEP_MS)  # sleeps, then writes the old value
        sleeping.fill[N // 128, 128, second](buf, new, 0)  # plain: must land after it
        got = np.array(buf.host)
        wrong = int((got != new).sum())
        assert not wrong, f"trial {trial}: {wrong} of {N} elements hold the earlier write, not the later plain one"
        buf.close()
