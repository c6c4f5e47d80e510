"""The direct launch path: coherent launches of compiled kernels go straight to cuLaunchKernel.

Every test runs a real kernel twice or more (the first launch of a kind goes
through numba and compiles; later ones are direct), checks the values against
NumPy on fresh random data, and checks which path was taken.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.helpers import random_array

import umem_numba as um

pytestmark = pytest.mark.gpu


def _direct_calls(kernel: um.CoherentKernel) -> int:
    """How many (argument types, device) entries of ``kernel`` launch directly."""
    return sum(1 for cfg in kernel._configs.values() for _types, call in cfg._calls.values() if call is not None)


def _kernels():
    from numba import cuda

    @um.jit
    def affine(out, x, a, b, n):
        i = cuda.grid(1)
        if i < n:
            out[i] = x[i] * a + b

    @um.jit
    def add2d(out, x, y, s):
        i, j = cuda.grid(2)
        if i < out.shape[0] and j < out.shape[1]:
            out[i, j] = x[i, j] + y[i, j] * s

    return affine, add2d


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_direct_launch_values_match_numpy_for_scalars_of_every_kind(rng, dtype):
    affine, _ = _kernels()
    n = int(rng.integers(1000, 5000))
    x_h = random_array(rng, n, dtype)
    a_values = [2, np.dtype(dtype).type(3), 4.0 if np.dtype(dtype).kind == "f" else 5]
    with um.ManagedBuffer.from_array(x_h) as x, um.ManagedBuffer.empty(n, dtype) as out:
        for launch_no in range(3):
            for a in a_values:
                b = int(rng.integers(1, 50))
                affine[(n + 127) // 128, 128](out, x, a, b, n)
                expected = (x_h.astype(np.float64) * float(a) + b).astype(dtype)
                np.testing.assert_allclose(out.host, expected, rtol=1e-6, err_msg=f"launch {launch_no}")
        assert _direct_calls(affine) >= 1, "repeated launches of one kind never took the direct path"


def test_direct_launch_handles_views_strides_and_fortran_order(rng):
    _, add2d = _kernels()
    base = random_array(rng, (64, 96), np.float64)
    yf = np.asfortranarray(random_array(rng, (32, 48), np.float64))
    with (
        um.ManagedBuffer.from_array(base) as xb,
        um.ManagedBuffer.from_array(yf) as y,
        um.ManagedBuffer.zeros((32, 48), np.float64) as out,
    ):
        x = xb[::2, 1::2]  # a strided view: layout "A"
        for s in (2.0, -0.5, 0.25):  # exact products: a fused multiply-add rounds the same
            add2d[(4, 6), (8, 8)](out, x, y, s)
            np.testing.assert_array_equal(out.host, base[::2, 1::2] + yf * s)
        assert _direct_calls(add2d) >= 1


def test_closed_buffer_is_refused_after_direct_launches(rng):
    affine, _ = _kernels()
    n = 256
    x = um.ManagedBuffer.from_array(random_array(rng, n, np.float32))
    out = um.ManagedBuffer.empty(n, np.float32)
    view = x[: n // 2]
    for _ in range(3):
        affine[2, 128](out, view, 1.0, 0.0, n // 2)
    assert _direct_calls(affine) >= 1
    x.close()
    with pytest.raises(um.BufferClosedError):
        affine[2, 128](out, view, 1.0, 0.0, n // 2)
    out.close()


def test_vmm_buffer_grown_in_place_launches_with_its_new_shape(rng):
    from numba import cuda

    @um.jit
    def fill_len(out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = out.shape[0]

    with um.VMMBuffer.empty(1000, np.int64, capacity=1 << 22) as v:
        for _ in range(2):
            fill_len[64, 128](v)
        np.testing.assert_array_equal(v.copy_to_host(), np.full(1000, 1000))
        n = int(rng.integers(2000, 6000))
        v.grow(n)
        fill_len[64, 128](v)
        np.testing.assert_array_equal(v.copy_to_host(), np.full(n, n))


def test_int_beyond_int64_falls_back_to_numba_and_stays_right():
    from numba import cuda

    @um.jit
    def store(out, v):
        if cuda.grid(1) == 0:
            out[0] = v

    with um.ManagedBuffer.zeros(1, np.uint64) as out:
        for v in (7, 9):
            store[1, 32](out, v)
            assert int(out.host[0]) == v
        big = 2**64 - 5  # numba types it as uint64; the direct int64 slot cannot hold it
        store[1, 32](out, big)
        assert int(out.host[0]) == big


def test_debug_kernels_keep_numba_launch(rng):
    from numba import cuda

    @um.jit(debug=True, opt=False)
    def copy(out, x):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = x[i]

    x_h = random_array(rng, 300, np.float32)
    with um.ManagedBuffer.from_array(x_h) as x, um.ManagedBuffer.zeros(300, np.float32) as out:
        for _ in range(3):
            copy[3, 128](out, x)
        np.testing.assert_array_equal(out.host, x_h)
    assert _direct_calls(copy) == 0


@pytest.mark.timeout(120)
def test_threads_share_one_configured_launch(rng):
    """Eight threads launch one cached configuration on their own buffers and streams."""
    from numba import cuda

    affine, _ = _kernels()
    n = 4096
    inputs = [random_array(rng, n, np.float32) for _ in range(8)]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            with um.ManagedBuffer.from_array(inputs[k]) as x, um.ManagedBuffer.empty(n, np.float32) as out:
                for step in range(40):
                    affine[n // 128, 128](out, x, float(k), float(step), n)
                    if step % 10 == 9:
                        np.testing.assert_allclose(out.host, inputs[k] * k + step, rtol=1e-6)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    cuda.synchronize()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not any(t.is_alive() for t in threads), "a launching thread hung"
    assert not errors, errors[0]
    assert _direct_calls(affine) >= 1


def test_direct_launches_are_ordered_across_streams(rng):
    """A slow write on s1 then a read on s2, both direct: s2 waits on the device (20 trials)."""
    from numba import cuda

    @um.jit
    def slow_fill(a, v, sleeps):
        i = cuda.grid(1)
        for _ in range(sleeps):  # ~1 ms each: the reader on s2 would see the old values
            cuda.nanosleep(1_000_000)
        if i < a.shape[0]:
            a[i] = v

    @um.jit
    def copy(out, a):
        i = cuda.grid(1)
        if i < a.shape[0]:
            out[i] = a[i]

    s1, s2 = cuda.stream(), cuda.stream()
    n = 1024
    with um.ManagedBuffer.zeros(n, np.float64) as a, um.ManagedBuffer.zeros(n, np.float64) as out:
        for trial in range(20):
            v = float(rng.integers(1, 1 << 20)) + trial
            slow_fill[8, 128, s1](a, v, 20)
            copy[8, 128, s2](out, a)
            np.testing.assert_array_equal(out.host, np.full(n, v), err_msg=f"trial {trial}")
    assert _direct_calls(slow_fill) >= 1 and _direct_calls(copy) >= 1
