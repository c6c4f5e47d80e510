"""PriorityStream: a numba-usable stream with the context's greatest (or least) scheduling priority."""

from __future__ import annotations

import numpy as np
import pytest
from support.helpers import random_array

import umem_numba as um
from umem_numba import PriorityStream, _driver, kernels
from umem_numba._driver import _sim


def test_priority_stream_without_gpu_raises_the_one_error() -> None:
    if _driver.available() or _sim.active():
        pytest.skip("this machine has a GPU (or the simulated driver of numba's simulator)")
    with pytest.raises(um.CudaUnavailableError):
        PriorityStream()


@pytest.mark.gpu
@pytest.mark.parametrize("highest", [True, False])
def test_priority_stream_priority_read_back_and_kernels_run_on_it(rng: np.random.Generator, highest: bool) -> None:
    from numba import cuda

    ps = PriorityStream(highest=highest)
    try:
        least, greatest = _driver.call("cuCtxGetStreamPriorityRange")
        assert ps.priority == (greatest if highest else least)
        assert int(_driver.call("cuStreamGetPriority", ps.handle)) == ps.priority
        flags = int(_driver.call("cuStreamGetFlags", ps.handle))
        assert flags & int(_driver.api().drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        # A real step on it, against the same launch on numba's own stream.
        u0 = random_array(rng, (300, 257), np.float32)
        a, b = cuda.to_device(u0, stream=ps.stream), cuda.device_array(u0.shape, u0.dtype, stream=ps.stream)
        kernels.heat2d_step(a, b, 0.2, stream=ps.stream)
        got = b.copy_to_host(stream=ps.stream)
        ps.stream.synchronize()
        s = cuda.stream()
        a2, b2 = cuda.to_device(u0, stream=s), cuda.device_array(u0.shape, u0.dtype, stream=s)
        kernels.heat2d_step(a2, b2, 0.2, stream=s)
        expected = b2.copy_to_host(stream=s)
        s.synchronize()
        assert not np.array_equal(got, u0)
        assert np.array_equal(got, expected)
    finally:
        ps.close()
    assert not ps._finalizer.alive  # destroyed
    ps.close()  # a second close does nothing
