"""Issue #27 items 7 and 8: the stream a lent view names, and the stream a DLPack consumer passes.

Item 7: ``lend(None)`` / ``lend(0)`` lend on the legacy default stream, but the view's CUDA
Array Interface said ``"stream": None``, which CAI v3 defines as "no synchronisation needed";
the legacy stream is 1 there (0 is not allowed).

Item 8: DLPack's ``stream`` argument for CUDA: ``None`` is the legacy default stream, 1 the
legacy stream, 2 the per-thread default stream, -1 "no synchronisation", any other positive int
a stream handle; 0 is forbidden (ambiguous), a bool is no stream.  ``stream=0`` and
``stream=True`` were accepted and ``-5`` gave the binding's OverflowError: each must raise a
clear ValueError / TypeError naming the argument, before any driver call.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver._location import stream_handle

N = 1024


# ---------------------------------------------------------------------------
# Item 7


@pytest.mark.gpu
@pytest.mark.parametrize("given", [None, 0, 1], ids=["None", "0", "1"])
def test_a_view_lent_on_the_legacy_stream_names_stream_1(given, rng):
    data = random_array(rng, N, np.float32)
    buf = um.ManagedBuffer.from_array(data)
    with buf.lend(given) as view:
        iface = view.__cuda_array_interface__
    assert iface["stream"] == 1, f"lend({given!r}) names stream {iface['stream']!r}; CAI v3's legacy stream is 1"
    np.testing.assert_array_equal(buf.host, data)
    buf.close()


@pytest.mark.gpu
def test_a_view_lent_on_other_streams_names_them(rng):
    buf = um.ManagedBuffer.from_array(random_array(rng, N, np.float32))
    s = cuda.stream()
    with buf.lend(s) as view:
        assert view.__cuda_array_interface__["stream"] == stream_handle(s)
    with buf.lend(2) as view:
        assert view.__cuda_array_interface__["stream"] == 2  # the per-thread default stream
    buf.close()


# ---------------------------------------------------------------------------
# Item 8

BAD_STREAMS = [
    (0, ValueError, r"stream=0"),
    (-5, ValueError, r"stream=-5"),
    (-2, ValueError, r"stream=-2"),
    (1 << 64, ValueError, r"stream=18446744073709551616"),
    (True, TypeError, r"stream=True"),
    (False, TypeError, r"stream=False"),
    (2.0, TypeError, r"stream"),
    ("1", TypeError, r"stream"),
]


class _NoDriver:
    """Stands in for the driver binding: any call is a failure of the test."""

    def __getattr__(self, name):
        raise AssertionError(f"__dlpack__ called the driver ({name}) before checking its stream argument")


@pytest.mark.gpu
@pytest.mark.parametrize(("stream", "error", "match"), BAD_STREAMS, ids=[repr(s[0]) for s in BAD_STREAMS])
@pytest.mark.parametrize("producer", ["buffer", "lent-view"])
def test_a_bad_dlpack_stream_is_refused_before_any_driver_call(producer, stream, error, match, rng, monkeypatch):
    data = random_array(rng, N, np.float32)
    buf = um.DeviceBuffer.from_array(data)
    s = cuda.stream()
    api = _driver.api()
    with buf.lend(s) as view:
        target = buf if producer == "buffer" else view
        monkeypatch.setattr(api, "drv", _NoDriver())
        try:
            with pytest.raises(error, match=match) as info:
                target.__dlpack__(stream=stream)
        finally:
            monkeypatch.undo()
    assert "__dlpack__" in str(info.value)
    assert not buf._coherence_tracker.escaped, "a refused export must not make the buffer escape"
    np.testing.assert_array_equal(buf.copy_to_host(), data)
    buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("stream", [None, 1, 2, -1, "own"], ids=["None", "1", "2", "-1", "a-stream"])
@pytest.mark.parametrize("producer", ["buffer", "lent-view"])
def test_good_dlpack_streams_are_accepted(producer, stream, rng):
    """None, 1, 2, -1 and a stream's handle are what the DLPack spec allows for CUDA."""
    data = random_array(rng, N, np.float32)
    buf = um.ManagedBuffer.from_array(data)
    s = cuda.stream()
    own = cuda.stream()  # alive until the end: its handle stays valid
    consumer = stream_handle(own) if stream == "own" else stream
    with buf.lend(s) as view:
        target = buf if producer == "buffer" else view
        capsule = target.__dlpack__(stream=consumer)
        assert type(capsule).__name__ == "PyCapsule"
        del capsule
    cuda.synchronize()
    np.testing.assert_array_equal(buf.host, data)
    buf.close()
