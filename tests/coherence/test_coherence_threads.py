"""Coherence under threads, close/shrink races, and fork().

Threads share one buffer and one tracker; every value they read back must be
right and nothing may hang (each test has a timeout).  What could crash the
CUDA context if it went wrong (freeing or unmapping memory under a running
kernel) runs in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from numba import cuda

import umem_numba as um

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

ROWS, N = 8, 2048


@pytest.fixture(scope="module")
def kernels():
    @um.jit
    def sleep_fill(dst, value, sleeps):
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = value

    return sleep_fill


def _run_threads(targets, timeout=300) -> None:
    errors: list[BaseException] = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported below, with the thread's traceback
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guard(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


def test_eight_threads_share_one_buffer(kernels):
    """Launches, host reads and holds on one managed buffer from 8 threads."""
    buf = um.managed_zeros((ROWS, N), np.float64)
    holds = {"taken": 0}

    def launcher(row: int):
        def run():
            stream = cuda.stream()
            for k in range(15):
                value = float(row * 100 + k)
                while True:
                    try:
                        kernels[N // 128, 128, stream](buf[row], value, 5)
                        break
                    except um.CoherenceError:  # the holder thread holds the buffer right now
                        continue
                got = buf[row].host
                assert (got == value).all(), f"row {row}: read {got[:3]}, expected {value}"

        return run

    def holder():
        for _ in range(20):
            with buf.on_host() as a:
                snapshot = a.copy()
                holds["taken"] += 1
                # while held, no launch may start: the memory does not change under the host
                assert (a == snapshot).all()

    _run_threads([launcher(r) for r in range(ROWS - 1)] + [holder])
    assert holds["taken"] == 20
    for row in range(ROWS - 1):
        assert (buf[row].host == row * 100 + 14).all()


def _subprocess(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True, timeout=timeout
    )


_PRELUDE = """
    import threading, numpy as np
    from numba import cuda
    import umem_numba as um

    @um.jit
    def sleep_fill(dst, value, sleeps):
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = value

    @um.jit
    def sleep_fill_all(dst, value, sleeps):  # grid-stride: a small grid covers a big buffer
        for _ in range(sleeps):
            cuda.nanosleep(1_000_000)
        for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
            dst[i] = value
"""


def test_close_racing_launches_and_host_views():
    """8 threads launch, read and take host views while one closes: no use after free, no hang."""
    proc = _subprocess(
        _PRELUDE
        + """
    for trial in range(10):
        buf = um.managed_zeros(1 << 20, np.float64)
        views, errors, go = [], [], threading.Event()
        def worker():
            go.wait()
            s = cuda.stream()
            for _ in range(20):
                try:
                    sleep_fill[256, 128, s](buf, 1.0, 3)
                    views.append(buf.host)
                except (um.BufferClosedError, um.CoherenceError):
                    pass
                except Exception as exc:
                    errors.append(exc)
        ts = [threading.Thread(target=worker) for _ in range(7)]
        for t in ts: t.start()
        go.set()
        buf.close()
        for t in ts: t.join(60)
        assert not any(t.is_alive() for t in ts), "hang"
        assert not errors, errors
        for v in views:  # every host view is still mapped and holds what the kernels wrote
            assert (v[:16] == 1.0).all() or (v[:16] == 0.0).all()
        cuda.synchronize()
    print("OK", um.stats()["managed"].live_count)
    """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("OK")


def test_shrink_under_every_policy_waits_for_running_kernels():
    proc = _subprocess(
        _PRELUDE
        + """
    for policy in ("off", "warn", "sync"):
        buf = um.VMMBuffer.zeros((64 << 20) // 8, np.float64, chunk_bytes=8 << 20)
        sleep_fill_all[256, 128](buf, 2.0, 80)  # writes the tail after 80 ms
        import warnings
        with warnings.catch_warnings(), um.coherence_policy(policy):
            warnings.simplefilter("ignore")
            buf.shrink(1024)  # unmaps the tail: must wait for the kernel, whatever the policy
        cuda.synchronize()  # a write into unmapped memory would surface here
        assert (buf.copy_to_host() == 2.0).all()
        buf.close()
    with um.coherence_policy("raise"):
        buf = um.VMMBuffer.zeros(1 << 20, np.float64, chunk_bytes=2 << 20)
        sleep_fill_all[256, 128](buf, 2.0, 80)
        try:
            buf.shrink(1024)
        except um.CoherenceError:
            print("RAISED")
        buf.synchronize()
    print("OK")
    """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["RAISED", "OK"]


def test_fork_child_gets_a_clear_error_and_the_parent_goes_on():
    proc = _subprocess("""
    import os, numpy as np
    import umem_numba as um
    buf = um.managed_zeros(1024, np.float64)
    buf.host[:] = 4.0
    pid = os.fork()
    if pid == 0:
        code = 0
        for action in (lambda: buf.host, lambda: um.ManagedBuffer.empty(4)):
            try:
                action()
                code = 3
            except um.CudaUnavailableError as exc:
                if "fork" not in str(exc):
                    code = 4
        del buf  # the finalizer must not touch the parent's CUDA context
        import gc; gc.collect()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, os.WEXITSTATUS(status)
    assert (buf.host == 4.0).all()
    buf.close()
    print("OK")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "OK"


@pytest.mark.multigpu
def test_an_untracked_launch_on_another_device_is_waited_for(kernels):
    """A device-0 managed buffer written by a plain numba launch on device 1."""
    raw = kernels.kernel
    with cuda.gpus[0]:
        buf = um.managed_zeros(N, np.float64)
    for _ in range(10):
        with cuda.gpus[0]:
            buf.host[:] = -1.0
        with cuda.gpus[1]:
            raw[N // 128, 128](buf, 6.0, 40)  # not through umem_numba
        with cuda.gpus[0]:
            assert (buf.host == 6.0).all()


@pytest.mark.multigpu
def test_a_tracked_launch_on_another_device(kernels):
    with cuda.gpus[0]:
        buf = um.managed_zeros(N, np.float64)
    for _ in range(10):
        buf.host[:] = -1.0
        with cuda.gpus[1]:
            s = cuda.stream()
            kernels[N // 128, 128, s](buf, 8.0, 40)
        assert (buf.host == 8.0).all()
