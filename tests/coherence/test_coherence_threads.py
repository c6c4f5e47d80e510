"""Coherence under threads, close/shrink races, and fork().

Threads share one buffer and one tracker; every value they read back must be
right and nothing may hang (each test has a timeout).  What could crash the
CUDA context if it went wrong (freeing or unmapping memory under a running
kernel) runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

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


def test_eight_threads_share_one_buffer(kernels, rng):
    """Launches, host reads and holds on one managed buffer from 8 threads."""
    buf = um.managed_zeros((ROWS, N), np.float64)
    holds = {"taken": 0}
    holder_values = rng.random(20) + 2.0  # the holder's row: fresh values, unlike the launchers'

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
        stream = cuda.stream()
        mine = ROWS - 1  # no launcher writes this row
        for k, value in enumerate(holder_values):
            while True:
                try:
                    kernels[N // 128, 128, stream](buf[mine], float(value), 5)  # writes after ~5 ms
                    break
                except um.CoherenceError:  # cannot happen (only this thread holds), but as the launchers
                    continue
            with buf.on_host() as a:
                # the hold waited for the kernels launched before it: this thread's, and the launchers'
                assert (a[mine] == value).all(), f"hold {k}: the host saw row {mine} before the kernel wrote it"
                snapshot = a.copy()
                holds["taken"] += 1
                time.sleep(0.02)  # a launcher's kernel not waited for (~5 ms) would write meanwhile
                # while held, no launch may start: the memory does not change under the host
                changed = int((a != snapshot).sum())
                assert not changed, f"hold {k}: {changed} elements changed under the host"

    _run_threads([launcher(r) for r in range(ROWS - 1)] + [holder])
    assert holds["taken"] == 20
    for row in range(ROWS - 1):
        assert (buf[row].host == row * 100 + 14).all()


def _subprocess(code: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, **env),
    )


_PRELUDE = """
    import os, threading, numpy as np
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


def test_close_racing_launches_and_host_views(rng):
    """8 threads launch, read and take host views while one closes: no use after free, no hang.

    Each worker writes its own part of the buffer with fresh values: a host view taken after its
    launch holds that launch's value at once, and at the end its last launch's value.
    """
    proc = _subprocess(
        _PRELUDE
        + """
    rng = np.random.default_rng(int(os.environ["SEED"]))
    WORKERS, PART = 7, (1 << 20) // 8
    for trial in range(10):
        buf = um.managed_zeros(1 << 20, np.float64)
        views, errors, go, viewed = [[] for _ in range(WORKERS)], [], threading.Event(), threading.Semaphore(0)
        launched = [None] * WORKERS
        values = rng.random((WORKERS, 20)) + 1.0  # fresh and never 0.0
        def worker(w):
            go.wait()
            s = cuda.stream()
            for j in range(20):
                try:
                    part = buf[w * PART:(w + 1) * PART]  # only this worker writes it
                    sleep_fill_all[32, 128, s](part, values[w, j], 3)
                    launched[w] = j
                    view = part.host  # waits for that kernel: its value, at once
                    if not (view[:16] == values[w, j]).all():
                        errors.append(AssertionError(f"worker {w}, launch {j}: read {view[:3]}, not {values[w, j]}"))
                    views[w].append(view)
                    viewed.release()
                except (um.BufferClosedError, um.CoherenceError):
                    pass
                except Exception as exc:
                    errors.append(exc)
        ts = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
        for t in ts: t.start()
        go.set()
        for _ in range(3):  # close while the workers are under way, not before they start
            viewed.acquire(timeout=30)
        buf.close()
        for t in ts: t.join(60)
        assert not any(t.is_alive() for t in ts), "hang"
        assert not errors, errors
        assert sum(map(len, views)) >= 3, "close() came before the launches it should race"
        for w in range(WORKERS):  # every host view is still mapped and holds the worker's last launch
            for view in views[w]:  # (close() waited for it; the launches it refused wrote nothing)
                assert (view == values[w, launched[w]]).all(), (w, launched[w], view[:3])
        cuda.synchronize()
    print("OK", um.stats()["managed"].live_count)
    """,
        SEED=str(int(rng.integers(1 << 31))),
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
