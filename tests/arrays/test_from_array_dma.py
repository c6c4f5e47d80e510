"""``ManagedBuffer.from_array`` of ``FROM_ARRAY_DMA_MIN_BYTES`` (256 KiB) or more copies by DMA (#28 item 2):
the pages start on the device.

The copy is tracked: a kernel on another stream and the host see the copied values, also when the
copy's stream is held up by a sleeping kernel (20 trials); the source may change as soon as
``from_array`` returns; the driver's last prefetch location of the new memory is the device.
Small arrays, ``prefetch="cpu"`` and ``attach="host"`` are still copied on the host.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba._driver import _sim
from umem_numba._kinds._managed import FROM_ARRAY_DMA_MIN_BYTES

pytestmark = pytest.mark.gpu

N = FROM_ARRAY_DMA_MIN_BYTES // 4  # float32: exactly the threshold
BLOCKS = (N + 255) // 256
TRIALS = 3 if _sim.active() else ORDERING_TRIALS
SLEEP_MS = 1 if _sim.active() else 10


def test_a_large_array_lands_on_the_device_and_reads_back(rng):
    data = random_array(rng, N, np.float32)
    with um.ManagedBuffer.from_array(data) as buf:
        assert buf.hints.last_prefetch_location == um.Location.device(0), "the new pages were not placed on the device"
        out = um.DeviceBuffer.empty(N, np.float32)
        um.coherent(sleeping.copy)[BLOCKS, 256, cuda.stream()](buf, out, 0)
        np.testing.assert_array_equal(out.copy_to_host(), data)
        np.testing.assert_array_equal(buf.host, data)
        out.close()


def test_the_copy_behind_a_sleeping_stream_is_waited_for_by_other_streams_and_the_host(rng):
    s, s2 = cuda.stream(), cuda.stream()
    gate = cuda.device_array(N, np.float32)
    out = um.DeviceBuffer.empty(N, np.float32)
    for trial in range(TRIALS):
        data = random_array(rng, N, np.float32)
        sleeping.fill[BLOCKS, 256, s](gate, 0.0, SLEEP_MS)  # the copy's stream is busy first
        buf = um.ManagedBuffer.from_array(data, stream=s)
        data_copy = data.copy()
        data[:] = -1.0  # the source may change once from_array returned
        um.coherent(sleeping.copy)[BLOCKS, 256, s2](buf, out, 0)  # another stream reads the new buffer
        np.testing.assert_array_equal(out.copy_to_host(stream=s2), data_copy, err_msg=f"trial {trial}: stream s2")
        np.testing.assert_array_equal(buf.host, data_copy, err_msg=f"trial {trial}: host")
        buf.close()
    out.close()


@pytest.mark.parametrize("how", ["small", "prefetch_cpu", "attach_host"])
def test_host_copies_where_dma_does_not_pay(rng, how):
    # (1 MiB of pages of its own for the last two: a small buffer may share a page another prefetched)
    n = 1000 if how == "small" else max(N, (1 << 20) // 4)
    data = random_array(rng, n, np.float32)
    kwargs = {"prefetch": "cpu"} if how == "prefetch_cpu" else {"attach": "host"} if how == "attach_host" else {}
    with um.ManagedBuffer.from_array(data, **kwargs) as buf:
        np.testing.assert_array_equal(buf.host, data)
        if how == "prefetch_cpu":
            assert buf.hints.last_prefetch_location == um.HOST
        elif how == "attach_host":
            assert buf.hints.last_prefetch_location != um.Location.device(0)
