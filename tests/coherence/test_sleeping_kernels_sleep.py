"""The ordering tests' sleeping kernels really sleep on this GPU.

Every adversarial ordering test makes a kernel sleep (``cuda.nanosleep(1_000_000)`` in a loop) so
that a missing wait shows as a wrong value.  CUDA documents the sleep as approximately in
``[0, 2 t]``: on a GPU where it returns early those tests still pass but can no longer fail.  This
test times the shared sleeping kernel with CUDA events and fails when 20 sleeps of about 1 ms take
less than 5 ms, so a lost tooth is reported rather than silent.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from support.helpers import sleeping

pytestmark = [pytest.mark.gpu, pytest.mark.real_gpu("numba's simulator records no event times")]


def test_twenty_sleeps_take_at_least_five_milliseconds():
    s = cuda.stream()
    a = cuda.device_array(128, np.float64)
    sleeping.fill[1, 128, s](a, 1.0, 0)  # compiled and loaded before the clock starts
    start, end = cuda.event(), cuda.event()
    start.record(s)
    sleeping.fill[1, 128, s](a, 2.0, 20)
    end.record(s)
    end.synchronize()
    ms = cuda.event_elapsed_time(start, end)
    assert ms >= 5.0, (
        f"20 x cuda.nanosleep(1_000_000) took {ms:.3f} ms on this GPU: the ordering tests' sleeping kernels "
        "do not sleep long enough to expose a missing wait here"
    )
    assert (a.copy_to_host() == 2.0).all()
