"""Issue #27 item 9: ``prefetch()`` and ``discard()`` of a zero-size buffer do nothing, like every other operation.

They raised ``ValueError: range [0, 0) is empty``.  Their arguments are still checked (a bad
target or stream raises as for any buffer), and an explicitly empty range
(``prefetch_range(0, 0, ...)``) is still refused: the caller named nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import umem_numba as um
from umem_numba import _driver


def _needs_prefetch() -> None:
    if not cuda.get_current_device().CONCURRENT_MANAGED_ACCESS:
        pytest.skip("prefetch needs concurrentManagedAccess")


def _needs_discard() -> None:
    _needs_prefetch()
    api = _driver.api()
    if api.discard_missing:
        pytest.skip(api.discard_missing)


OPS = {
    "prefetch-device": (lambda b, s: b.prefetch(0, s), _needs_prefetch),
    "prefetch-cpu": (lambda b, s: b.prefetch("cpu", s), _needs_prefetch),
    "discard": (lambda b, s: b.discard(s), _needs_discard),
    "discard-legacy": (lambda b, s: b.discard(), _needs_discard),
    "discard_prefetch": (lambda b, s: b.discard_prefetch(0, s), _needs_discard),
    "PrefetchPlan": (lambda b, s: um.PrefetchPlan().add(b, 0).execute(s), _needs_prefetch),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [0, (0, 5), (3, 0)], ids=["0", "0x5", "3x0"])
@pytest.mark.parametrize("op", list(OPS))
def test_hint_on_a_zero_size_buffer_is_a_no_op(op, shape):
    run, needs = OPS[op]
    needs()
    buf = um.ManagedBuffer.empty(shape, np.float32)
    s = cuda.stream()
    run(buf, s)  # raised ValueError: range [0, 0) is empty
    assert buf.host.shape == buf.shape
    assert not buf.busy
    buf.close()


@pytest.mark.gpu
def test_bad_arguments_are_still_refused_on_a_zero_size_buffer():
    _needs_prefetch()
    buf = um.ManagedBuffer.empty(0, np.float32)
    with pytest.raises((ValueError, TypeError)):
        buf.prefetch("nowhere")
    with pytest.raises(TypeError):
        buf.prefetch(0, stream="not a stream")
    with pytest.raises(TypeError):
        buf.discard(stream=True)
    with pytest.raises(ValueError, match="empty"):
        buf.prefetch_range(0, 0, 0)
    buf.close()
    with pytest.raises(um.BufferClosedError):
        buf.prefetch(0)
