"""Issue #27 item 1: a lend covers the streams its consumers were told to use, not only the lending stream.

``with buf.lend(s1) as view:`` hands the view to a consumer that works on another stream: a
DLPack consumer that passes ``__dlpack__(stream=s2)``, or a CUDA Array Interface consumer on a
stream of its own.  The block's end recorded only s1: host access after the block read stale
values (1 in 5 trials on an H100), and a pool buffer closed after the block was handed out
again while the consumer still wrote it.

The consumer here is a tracked launch (so that the simulated driver queues it; on a GPU it
sleeps first) whose destination is a plain numba array over the lent memory, made from what
the consumer was given: the toolkit sees the launch, not that it touches the buffer, as with
CuPy or PyTorch.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba._driver import _sim
from umem_numba._driver._location import stream_handle

N = 4096
GRID, BLOCK = 4, 1024
#: Device time of the consumer's kernel on a GPU; over the simulated driver the work runs late anyway.
SLEEP_MS = 1 if _sim.active() else 60
SEVEN = np.float32(7.0)


def _raw_array(iface: dict):
    """A numba array over what a consumer was given (its CUDA Array Interface, or the capsule's pointer)."""
    return cuda.as_cuda_array(SimpleNamespace(__cuda_array_interface__=iface))


def _consumer_array(view, protocol: str, consumer_stream):
    """What the consumer makes of the lent view, told (DLPack) or not (CAI) about its own stream."""
    iface = dict(view.__cuda_array_interface__) if protocol == "cai" else None
    if protocol == "dlpack":
        capsule = view.__dlpack__(stream=stream_handle(consumer_stream))
        del capsule  # the consumer would take the pointer from it; the view's pointer is the same
        buf = view._live()
        iface = {
            "data": (view.ptr, False),
            "shape": buf.shape,
            "strides": None,
            "typestr": buf.dtype.str,
            "version": 3,
            "stream": None,
        }
    assert iface is not None
    iface["stream"] = None  # the consumer has ordered itself already (DLPack) or syncs as CAI says
    return _raw_array(iface)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", ["dlpack", "cai"])
def test_host_access_after_the_block_sees_the_consumers_writes(protocol, rng):
    copy = um.coherent(sleeping.copy)
    s1, s2 = cuda.stream(), cuda.stream()
    buf = um.ManagedBuffer.zeros(N, np.float32)
    src = um.ManagedBuffer.zeros(N, np.float32)
    try:
        for trial in range(ORDERING_TRIALS):
            values = random_array(rng, N, np.float32)
            src.host[:] = values
            buf.host[:] = -1.0
            with buf.lend(s1) as view:
                dst = _consumer_array(view, protocol, s2)
                copy[GRID, BLOCK, s2](src, dst, SLEEP_MS)  # the consumer's work, on its own stream
            got = buf.host.copy()
            stale = int((got != values).sum())
            assert not stale, f"trial {trial}: {stale} of {N} elements stale after the lend block ({protocol})"
    finally:
        cuda.synchronize()
        buf.close()
        src.close()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", ["dlpack", "cai"])
def test_a_readonly_lend_orders_later_writes_after_the_consumers_reads(protocol, rng):
    """``lend(s1, readonly=True)``: a consumer reads on s2; a toolkit write on s3 after the block must wait for it."""
    copy = um.coherent(sleeping.copy)
    fill = um.coherent(sleeping.fill)
    s1, s2, s3 = cuda.stream(), cuda.stream(), cuda.stream()
    buf = um.ManagedBuffer.zeros(N, np.float32)
    out = um.ManagedBuffer.zeros(N, np.float32)
    try:
        for trial in range(ORDERING_TRIALS):
            values = random_array(rng, N, np.float32)
            buf.host[:] = values
            with buf.lend(s1, readonly=True) as view:
                seen = _consumer_array(view, protocol, s2)
                copy[GRID, BLOCK, s2](seen, out, SLEEP_MS)  # the consumer reads buf (out is its own)
            fill[GRID, BLOCK, s3](buf, SEVEN, 0)  # a toolkit write after the block
            cuda.synchronize()  # everything queued runs, in whatever order the streams allow
            got = out.host.copy()
            wrong = int((got != values).sum())
            assert not wrong, f"trial {trial}: the consumer read {wrong} of {N} elements after the later write"
            assert (buf.host == SEVEN).all()
    finally:
        cuda.synchronize()
        buf.close()
        out.close()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", ["dlpack", "cai"])
def test_a_pool_buffer_closed_after_the_block_is_not_reused_under_the_consumer(protocol, rng):
    """Lend a pool buffer, a consumer writes it on s2, close it after the block: the next buffer
    from the pool (taken and written on s3) must not be overwritten by the consumer's write."""
    copy = um.coherent(sleeping.copy)
    pool = um.MemoryPool("device")
    s1, s2, s3 = cuda.stream(), cuda.stream(), cuda.stream()
    src = um.DeviceBuffer.empty(N, np.float32)
    sevens = np.full(N, SEVEN, np.float32)
    taken = []
    try:
        for trial in range(ORDERING_TRIALS):
            src.copy_from_host(random_array(rng, N, np.float32), stream=s2)
            buf = um.DeviceBuffer.empty(N, np.float32, pool=pool, stream=s1)
            with buf.lend(s1) as view:
                dst = _consumer_array(view, protocol, s2)
                copy[GRID, BLOCK, s2](src, dst, SLEEP_MS)
            address = buf._address
            buf.close()
            nxt = um.DeviceBuffer.empty(N, np.float32, pool=pool, stream=s3)
            taken.append(nxt)
            nxt.copy_from_host(sevens, stream=s3)
            cuda.synchronize()  # everything queued runs, the consumer's write included
            got = nxt.copy_to_host()
            wrong = int((got != SEVEN).sum())
            assert not wrong, (
                f"trial {trial}: {wrong} of {N} elements of the next pool buffer overwritten by the "
                f"consumer of the closed one (same address: {nxt._address == address})"
            )
    finally:
        cuda.synchronize()
        for b in taken:
            b.close()
        src.close()
        pool.close()
