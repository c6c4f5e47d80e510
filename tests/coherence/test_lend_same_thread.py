"""Issue #27 item 4: host access to a buffer inside its own ``lend`` block, on the same thread, raises.

``buf.host``, ``np.asarray(buf)``, ``buf.synchronize()``, ``buf.on_host()`` and ``buf.close()``
inside ``with buf.lend(s):`` on the thread that opened the block waited for the block's own
in-flight registration: they hung forever.  They must raise
:class:`~umem_numba.CoherenceError` naming the operation and the open lend block.  Another
thread may still wait: its host access returns once the block has ended, with the values the
lent work wrote.

Each operation runs in a worker thread, so that a hang fails the test instead of stopping the
run (the join's limit is a hang detector, not a timing bound).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array, sleeping

import umem_numba as um

N = 1024
HANG = 60.0  # seconds: far beyond anything these operations take when they do not hang

OPS = {
    "host": lambda b: b.host,
    "np.asarray": np.asarray,
    "synchronize": lambda b: b.synchronize(),
    "on_host": lambda b: b.on_host().__enter__(),
    "close": lambda b: b.close(),
}

MESSAGES = {
    "host": "host access",
    "np.asarray": "np.asarray",
    "synchronize": "synchronize",
    "on_host": "on_host",
    "close": "clos",
}


def _in_thread(fn):
    """Run ``fn`` in a daemon thread; ``(finished, result or exception)``."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # reported to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG)
    return (not t.is_alive()), box


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["sync", "raise", "warn"])
@pytest.mark.parametrize("op", list(OPS))
def test_host_access_inside_its_own_lend_block_raises(op, policy, rng):
    data = random_array(rng, N, np.float32)
    buf = um.ManagedBuffer.from_array(data)
    buf.synchronize()
    s = cuda.stream()

    def inside():
        with um.coherence_policy(policy), buf.lend(s):
            with pytest.raises(um.CoherenceError) as info:
                OPS[op](buf)
            return str(info.value)

    finished, box = _in_thread(inside)
    assert finished, f"{op} inside its own lend block hung"
    if "error" in box:
        raise box["error"]
    message = box["result"]
    assert "lend" in message and MESSAGES[op] in message, message
    # The block ended normally: the buffer is usable, its data intact.
    np.testing.assert_array_equal(buf.host, data)
    buf.close()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["device default pool", "managed pool"])
def test_closing_pool_memory_inside_its_own_lend_block_raises_and_the_buffer_stays_usable(kind, rng):
    """Pool memory's close (stream-ordered: its free is queued after the recorded work) decides
    under the record's lock; inside the thread's own lend block the lent work is not recorded
    yet, so a close there must raise rather than queue a free that would not come after it."""
    data = random_array(rng, N, np.float32)
    pool = um.MemoryPool("managed") if kind == "managed pool" else None
    buf = um.ManagedBuffer.from_array(data, pool=pool) if pool is not None else um.DeviceBuffer.from_array(data)
    s = cuda.stream()

    def inside():
        with buf.lend(s):
            with pytest.raises(um.CoherenceError) as info:
                buf.close()
            closed_inside = buf.closed
            # The lent work, on the lend's stream, after the refused close.
            um.coherent(sleeping.fill)[(N + 127) // 128, 128, s](buf, 3.0, 0)
        return str(info.value), closed_inside

    finished, box = _in_thread(inside)
    assert finished, "close inside its own lend block hung"
    if "error" in box:
        raise box["error"]
    message, closed_inside = box["result"]
    assert "lend" in message and "clos" in message, message
    assert not closed_inside, "the refused close closed the buffer"
    np.testing.assert_array_equal(buf.copy_to_host(), np.full(N, 3.0, np.float32))
    buf.close()
    assert buf.closed
    if pool is not None:
        pool.close()


def _consumer_array(view):
    """A plain numba array over the lent memory, made from the view's CUDA Array Interface (as a consumer does)."""
    iface = dict(view.__cuda_array_interface__)
    iface["stream"] = None  # ordered already: the consumer works on the lending stream
    return cuda.as_cuda_array(SimpleNamespace(__cuda_array_interface__=iface))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_another_thread_waits_for_the_lend_block_and_sees_its_work(rng):
    """Thread-affinity: a host access from another thread during the block waits for the block's end."""
    copy = um.coherent(sleeping.copy)
    buf = um.ManagedBuffer.zeros(N, np.float32)
    values = random_array(rng, N, np.float32)
    src = um.ManagedBuffer.from_array(values)  # a tracked argument: the simulated driver queues the launch
    s = cuda.stream()
    entered, reading = threading.Event(), threading.Event()
    box: dict = {}

    def reader():
        entered.wait()
        reading.set()
        box["seen"] = buf.host.copy()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    with buf.lend(s) as view:
        entered.set()
        reading.wait()
        copy[1, N, s](src, _consumer_array(view), 1)  # the lent work, on the lending stream
    t.join(HANG)
    assert not t.is_alive(), "the other thread's host access never returned"
    np.testing.assert_array_equal(box["seen"], values, err_msg="the other thread did not wait for the lent work")
    np.testing.assert_array_equal(buf.host, values)
    buf.close()
    src.close()
