"""Toolkit device work on an escaped buffer comes after the other library's work on it.

A buffer handed out for good (``__dlpack__(stream=s)``, ``__cuda_array_interface__``) escapes:
the other library may write it at any time, on a stream umem_numba cannot see.  A later tracked
launch or copy on another stream must still see those writes, as host access does (issue #27:
found by the API fuzzer's ``export`` family, ``tests/fuzz``).

Each trial: the consumer's stream (non-blocking, so nothing orders it implicitly) sleeps on the
device, then copies fresh random values into the buffer; a toolkit kernel or copy on another
stream then reads the buffer.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

N = 4096
SLEEP_MS = 20


@pytest.mark.parametrize("op", ["tracked-launch", "copy_to_host"])
@pytest.mark.parametrize("protocol", ["dlpack", "cai"])
def test_toolkit_work_on_an_escaped_buffer_comes_after_the_consumers_write(protocol, op, rng):
    _driver.ensure_context()  # a raw driver call needs a current context (first test of a worker)
    consumer = int(_driver.call("cuStreamCreate", 1))  # CU_STREAM_NON_BLOCKING
    other = cuda.stream()
    tracked_copy = um.coherent(sleeping.copy)
    idle = cuda.device_array(1, np.float32)
    try:
        for trial in range(3 if _sim.active() else ORDERING_TRIALS):
            values = random_array(rng, N, np.float32)
            source = um.PinnedBuffer.from_array(values)
            buf = um.DeviceBuffer.zeros(N, np.float32)
            buf.synchronize()
            if protocol == "dlpack":
                capsule = buf.__dlpack__(stream=consumer)  # the consumer's stream waits for the zeros
                ptr = buf.ptr
            else:
                capsule = None
                ptr = buf.__cuda_array_interface__["data"][0]
            # the other library's work: a sleep, then the values, on its own stream
            sleeping.fill[1, 1, cuda.external_stream(consumer)](idle, 0.0, SLEEP_MS)
            _driver.call("cuMemcpyHtoDAsync", ptr, source.ptr, source.nbytes, consumer)
            if op == "tracked-launch":
                out = um.ManagedBuffer.zeros(N, np.float32)
                tracked_copy[N // 128, 128, other](buf, out, 0)
                got = np.array(out.host)
                out.close()
            else:
                got = buf.copy_to_host(stream=other)
            wrong = int((got != values).sum())
            assert not wrong, f"trial {trial}: {wrong} of {N} elements read before the consumer's write"
            del capsule
            _driver.call("cuStreamSynchronize", consumer)
            source.close()
    finally:
        _driver.call("cuStreamSynchronize", consumer)
        _driver.call("cuStreamDestroy", consumer)


@pytest.mark.parametrize("before", ["tracked-writer", "earlier-consumer"])
def test_a_cuda_array_interface_consumer_starts_after_earlier_work(before, rng):
    """The buffer's ``__cuda_array_interface__`` names no stream ("no synchronisation needed"),
    so a consumer reading it works at once, on its own stream: the work that may still write the
    memory (a tracked kernel on another stream, or an earlier consumer of the escaped buffer) must
    be done by then.  The consumer here copies the buffer out on its own non-blocking stream.

    Found by the API fuzzer's ``export`` family (two consumers: the later one's write was lost).
    """
    _driver.ensure_context()  # a raw driver call needs a current context (first test of a worker)
    first = int(_driver.call("cuStreamCreate", 1))
    second = int(_driver.call("cuStreamCreate", 1))
    writer = cuda.stream()
    tracked_fill = um.coherent(sleeping.fill)
    idle = cuda.device_array(1, np.float32)
    try:
        for trial in range(3 if _sim.active() else ORDERING_TRIALS):
            value = float(rng.integers(1, 1 << 20))
            buf = um.DeviceBuffer.zeros(N, np.float32)
            if before == "tracked-writer":
                tracked_fill[N // 128, 128, writer](buf, value, SLEEP_MS)
                capsule = None
            else:
                source = um.PinnedBuffer.from_array(np.full(N, value, np.float32))
                capsule = buf.__dlpack__(stream=first)  # escapes; the first consumer sleeps, then writes
                sleeping.fill[1, 1, cuda.external_stream(first)](idle, 0.0, SLEEP_MS)
                _driver.call("cuMemcpyHtoDAsync", buf.ptr, source.ptr, source.nbytes, first)
            out = um.PinnedBuffer.empty(N, np.float32)
            iface = buf.__cuda_array_interface__
            assert iface["stream"] is None
            _driver.call("cuMemcpyDtoHAsync", out.ptr, iface["data"][0], out.nbytes, second)
            _driver.call("cuStreamSynchronize", second)
            wrong = int((out.host != value).sum())
            assert not wrong, f"trial {trial}: the consumer read {wrong} of {N} elements before the earlier write"
            del capsule
            _driver.call("cuStreamSynchronize", first)
            out.close()
    finally:
        for h in (first, second):
            _driver.call("cuStreamSynchronize", h)
            _driver.call("cuStreamDestroy", h)
