"""A launch's device on a machine with several GPUs: from its stream, not a driver call per launch.

Every tracked launch needs the device it runs on (its event lives in that device's context).
With one GPU that is device 0; with more it was ``cuCtxGetDevice`` at every launch, which cost a
plain launch 6 % on two H200s (#28 item 4).  A stream numba made belongs to one device for good,
so its ``cuStreamGetDevice`` is asked once and kept (``umem_numba._driver.launch_device``), outside
any capture: a capture refuses that call, and the refusal invalidates it.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um
from umem_numba import _driver

pytestmark = pytest.mark.gpu


def _bump(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1


_plain = cuda.jit(_bump)
_tracked = um.jit(_bump)

_LAUNCHES = {
    "plain": lambda buf, s: _plain[8, 128, s](buf),
    "um.jit": lambda buf, s: _tracked[8, 128, s](buf),
    "forall": lambda buf, s: _tracked.forall(buf.size, stream=s)(buf),
}


def _counting_current_device(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = _driver.current_device

    def counted() -> int:
        calls.append(1)
        return real()

    monkeypatch.setattr(_driver, "current_device", counted)
    return calls


@pytest.mark.multigpu
@pytest.mark.parametrize("how", sorted(_LAUNCHES))
def test_launch_on_a_stream_of_device_1_takes_the_stream_s_device(rng, monkeypatch, how):
    """Launches on a numba stream of device 1: events in device 1's context, no current-device call."""
    launch = _LAUNCHES[how]
    data = random_array(rng, 1024, np.float32)
    with cuda.gpus[1]:
        s = cuda.stream()
        um.stream_handle(s)  # umem_numba knows the stream (a plain launch hands it only the handle)
        buf = um.managed_from(data)
        assert buf.device_id == 1
        launch(buf, s)  # compiles; the stream's device is asked once
        calls = _counting_current_device(monkeypatch)
        for _ in range(3):
            launch(buf, s)
        ((_key, event),) = buf._coherence_tracker.pending.items()
        assert event.device_id == 1
        assert calls == [], f"{how}: {len(calls)} current-device call(s) for 3 launches on a known stream"
    expected = data
    for _ in range(4):
        expected = expected + np.float32(1)
    np.testing.assert_array_equal(buf.host, expected)  # waits for device 1's stream


@pytest.mark.parametrize("how", sorted(_LAUNCHES))
def test_launch_device_of_a_known_stream_is_its_own(rng, how):
    """On any machine: the kept device is the one the driver gives for the stream, and values are right."""
    launch = _LAUNCHES[how]
    data = random_array(rng, 1024, np.float32)
    s = cuda.stream()
    with um.managed_from(data) as buf:
        launch(buf, s)
        handle = int(s.handle)
        assert _driver.launch_device(handle) == _driver.current_device()
        np.testing.assert_array_equal(buf.host, data + 1)


def test_launch_device_of_an_unowned_handle_is_the_current_device():
    """The legacy stream, and a handle no live numba stream owns, are launched on in the current context."""
    assert _driver.owned_stream(0) is None
    assert _driver.launch_device(0) == _driver.current_device()


@pytest.mark.multigpu
@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("how", sorted(_LAUNCHES))
def test_first_launch_on_a_stream_inside_a_capture(rng, device, how):
    """With several GPUs, a stream's first launch may come inside ``um.capture``: captured, replayed right.

    The device of a new stream was asked of the driver (``cuStreamGetDevice``), which a capture
    refuses: every capture test failed on 4 x H200 outside the one-GPU lanes.
    """
    launch = _LAUNCHES[how]
    data = random_array(rng, 1024, np.float32)
    with cuda.gpus[device]:
        with um.managed_from(data) as warm:  # compiled before the capture, on another stream
            launch(warm, cuda.stream())
            np.testing.assert_array_equal(warm.host, data + 1)
        s = cuda.stream()
        with um.managed_from(data) as buf:
            with um.capture(s) as graph:
                launch(buf, s)
            np.testing.assert_array_equal(buf.host, data, err_msg="the capture ran the launch")
            for _ in range(3):
                graph.launch()
            expected = data
            for _ in range(3):
                expected = expected + np.float32(1)
            np.testing.assert_array_equal(buf.host, expected)
            graph.close()
