"""Issue #19 item 8: a process that leaves umem_numba memory, exports and work behind exits cleanly.

Each case runs in a fresh interpreter (``python -X faulthandler -c ...``): the exit
status must be 0, stderr empty, and no umem_numba free may run once the process
exits.  A spy reports every umem_numba release, driver free/destroy and plugin
free made from the moment ``weakref``'s exit handler is about to run (numba's
memory finalizers, the plugin's free callback and ``PriorityStream`` ran there)
until the process ends; the driver reclaims everything itself then.

The first tests need no GPU: they pin down the exit guard itself
(:func:`umem_numba._driver.shutting_down`) and the DLPack deleter, whose C
callbacks a consumer may call after this package's modules are torn down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from support.helpers import TESTS_DIR


def _run(code: str, *, timeout: int = 240, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ)
    full.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=full,
        cwd=TESTS_DIR,
    )


def _assert_clean_exit(proc: subprocess.CompletedProcess[str]) -> None:
    report = f"exit status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert proc.stderr == "", report
    assert "DONE" in proc.stdout, report
    assert "AT EXIT" not in proc.stdout, report


# ---------------------------------------------------------------------------
# The guard itself (no GPU)


def test_exit_guard_is_on_while_atexit_finalizers_run():
    """Issue #19 item 8: finalizers run by weakref at exit see shutting_down() (sys.is_finalizing() is still False).

    Before the fix shutting_down() was sys.is_finalizing(), False while atexit
    handlers run, so numba's memory finalizers, the plugin's free callback and
    PriorityStream's finalizer freed memory in whatever context was current.
    """
    proc = _run(
        """
        import sys, weakref
        from umem_numba import _driver

        class Held:
            pass

        held = Held()  # alive at exit: weakref's exit handler runs its finalizer, as numba's
        weakref.finalize(held, lambda: print("finalizer at exit:", _driver.shutting_down(), sys.is_finalizing()))
        print("running:", _driver.shutting_down())
        """
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == ["running: False", "finalizer at exit: True False"]


def test_allocation_dropped_by_an_exit_finalizer_is_not_freed():
    """Issue #19 item 8: memory whose last reference goes in an atexit finalizer is left to the driver.

    numba's finalizers run at exit (weakref, atexit=True) and drop what they
    hold; before the fix Allocation.__del__ then freed (sys.is_finalizing() was
    still False), in a context that may be going.
    """
    proc = _run(
        """
        import weakref
        from umem_numba._memory._lifetime import Allocation, Memory
        from umem_numba._memory._tracker import Tracker

        class Loud(Memory):
            kind = "managed"
            nbytes = 4096

            def __init__(self, name):
                self.name = name

            def free(self, tracker):
                print("freed", self.name)

        class Owner:  # stands for a numba object whose finalizer drops umem_numba memory
            pass

        owner = Owner()
        held = [Allocation("managed", Loud("at exit"), 0x1000, 0, Tracker(0))]
        weakref.finalize(owner, held.clear)  # atexit=True, as numba's memory finalizers
        del held
        closed = Allocation("managed", Loud("while running"), 0x2000, 0, Tracker(0))
        closed.close()
        print("DONE")
        """
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == ["freed while running", "DONE"]


def test_umem_finalizer_collected_during_atexit_does_nothing():
    """Issue #19 item 8: a umem_numba finalizer (atexit=False) whose object is collected in a late atexit handler.

    atexit=False only keeps weakref's exit handler from running it; an object
    collected by an atexit handler that runs after umem_numba's hook (one
    registered before umem_numba was imported) still ran its finalizer before
    the fix.
    """
    proc = _run(
        """
        import atexit, weakref

        weakref.finalize(lambda: None, lambda: None)  # weakref's exit handler first: it runs last
        box = []
        atexit.register(box.clear)  # registered before the import: runs after umem_numba's hook

        from umem_numba._memory._lifetime import finalizer

        class Held:
            pass

        held = Held()
        finalizer(held, print, "FREED AT EXIT")
        box.append(held)
        del held
        gone = Held()
        finalizer(gone, print, "collected while running")
        del gone
        print("DONE")
        """
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == ["collected while running", "DONE"]


def test_dlpack_consumer_that_outlives_the_module_does_not_crash():
    """Issue #19 item 8: a DLPack consumer that frees its tensors after module teardown (as PyTorch can).

    The consumer's arrays are kept in ``sys``, cleared after every other
    module.  Before the fix module teardown freed the deleter's C thunk and the
    DLManagedTensor structures while the consumer still pointed at them: the
    process died with SIGSEGV ("Fatal Python error: Segmentation fault",
    "<no Python frame>"), the crash seen with PyTorch.  Now the callbacks and
    the structures live as long as the process and release nothing at exit; an
    export let go while running is still released.
    """
    proc = _run(
        """
        import sys
        import numpy as np
        from umem_numba._arrays import _dlpack

        class Exporter:
            def __init__(self, a):
                self.a = a

            def __dlpack_device__(self):
                return (_dlpack.KDL_CPU, 0)

            def __dlpack__(self, **kwargs):
                a = self.a
                device = (_dlpack.KDL_CPU, 0)
                return _dlpack.make_capsule(a.ctypes.data, a.shape, a.strides, a.dtype, device, a, self.release)

            def release(self):
                print("RELEASED AT EXIT" if _exiting else "released", flush=True)

        _exiting = False
        src = np.arange(1000.0)
        views = [np.from_dlpack(Exporter(src)) for _ in range(50)]
        assert float(views[3][7]) == 7.0
        gone = np.from_dlpack(Exporter(src))
        del gone  # let go while running: released
        unconsumed = Exporter(src).__dlpack__()  # a capsule nobody consumed, alive at exit
        sys._umem_test_views = (views, unconsumed)  # cleared after every other module
        import atexit
        atexit.register(globals().__setitem__, "_exiting", True)
        print("DONE")
        """
    )
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr}"
    assert proc.stderr == ""
    assert proc.stdout.splitlines() == ["released", "DONE"]


class _FakeDriver:
    """Records the driver calls of the exit hook: device 0 inactive, device 1 active."""

    def __init__(self, sync_result: int = 0) -> None:
        self.calls: list[tuple] = []
        self.sync_result = sync_result

    def cuDeviceGetCount(self):
        self.calls.append(("count",))
        return 0, 2

    def cuDevicePrimaryCtxGetState(self, d):
        self.calls.append(("state", d))
        return 0, 0, d == 1

    def cuDevicePrimaryCtxRetain(self, d):
        self.calls.append(("retain", d))
        return 0, f"ctx{d}"

    def cuCtxPushCurrent(self, ctx):
        self.calls.append(("push", ctx))
        return (0,)

    def cuCtxSynchronize(self):
        self.calls.append(("sync",))
        return (self.sync_result,)

    def cuCtxPopCurrent(self):
        self.calls.append(("pop",))
        return 0, None

    def cuDevicePrimaryCtxRelease(self, d):
        self.calls.append(("release", d))
        return (0,)


def test_exit_hook_lets_queued_device_work_finish_then_turns_the_guard_on(monkeypatch):
    """Issue #19 item 8: the exit hook synchronises each active primary context (pure driver calls), then guards.

    Nothing is freed after the hook, and the driver destroys the contexts, with
    their pools and queued frees, after Python: the work still queued (a kernel
    still running, frees behind it) finishes first, while everything is intact.
    Without a loaded driver (a CPU-only process) the hook makes no driver call.
    """
    from umem_numba import _driver

    monkeypatch.setattr(_driver, "_exiting", False)
    fake = _FakeDriver(sync_result=700)  # a sticky error: still quiet, still guarded afterwards
    monkeypatch.setattr(_driver, "_api", SimpleNamespace(drv=fake))
    assert not _driver.shutting_down()
    _driver._at_exit()
    assert fake.calls == [
        ("count",),
        ("state", 0),
        ("state", 1),
        ("retain", 1),
        ("push", "ctx1"),
        ("sync",),
        ("pop",),
        ("release", 1),
    ]
    assert _driver.shutting_down()
    monkeypatch.setattr(_driver, "_exiting", False)
    monkeypatch.setattr(_driver, "_api", None)
    _driver._at_exit()  # no driver loaded: nothing to wait for, and CUDA is not initialised at exit
    assert _driver.shutting_down()


# ---------------------------------------------------------------------------
# On the GPU: each case of the issue, then all of them together

# Runs first in every child.  The spy flag is set by an atexit handler registered
# before umem_numba is imported, right after weakref's exit handler exists: it runs
# after umem_numba's hook and just before weakref runs the finalizers still alive.
_PRELUDE = """
import atexit, os, sys, weakref, warnings
weakref.finalize(lambda: None, lambda: None)  # weakref's exit handler registered first (runs last)
_exiting = [False]
atexit.register(_exiting.__setitem__, 0, True)

import numpy as np
from numba import cuda
from numba.core.errors import NumbaPerformanceWarning
import umem_numba as um
from umem_numba import _driver
from umem_numba._memory import _lifetime
from support.helpers import sleeping

warnings.simplefilter("ignore", NumbaPerformanceWarning)
warnings.filterwarnings("ignore", message="Grid size")
rng = np.random.default_rng()
B = 512  # threads per block
G = 128  # blocks: G * B == N
N = G * B


def _report(what, _w=os.write, _flag=_exiting):
    if _flag[0]:
        _w(1, b"FREED AT EXIT: " + what.encode() + b"\\n")


def _spy_release(memory, tracker, generation, settled=False, _real=_lifetime._release, _r=_report):
    _r("release of " + type(memory).__name__)
    _real(memory, tracker, generation, settled)


_FREES = frozenset({
    "cuStreamDestroy", "cuMemFree", "cuMemFreeHost", "cuMemFreeAsync", "cuMemUnmap", "cuMemRelease",
    "cuMemAddressFree", "cuMemPoolDestroy", "cuMemHostUnregister",
})


def _spy_call(name, *args, detail="", _real=_driver.call, _r=_report, _frees=_FREES):
    if name in _frees:
        _r(name)
    return _real(name, *args, detail=detail)


_lifetime._release = _spy_release
_driver.call = _spy_call
fill = um.coherent(sleeping.fill)
"""

_CASES = {
    "managed": """
m = um.ManagedBuffer.zeros(N, np.float32)
fill[G, B, 0](m, 3.0, 1)
m_host = m.host  # a numpy view over it, alive at exit
assert float(m_host[N - 1]) == 3.0
""",
    "pinned": """
p = um.PinnedBuffer.zeros(N, np.float32, flags=um.HostAllocFlags.DEVICEMAP)
fill[G, B, 0](p, 4.0, 1)
p_host = p.host
assert float(p_host[5]) == 4.0
""",
    "pool_free_list": """
pool = um.MemoryPool("device")
kept = um.DeviceBuffer.zeros(N, pool=pool)
fill[G, B, 0](kept, 5.0, 1)
to_list = um.DeviceBuffer.zeros(N, pool=pool)
fill[G, B, 0](to_list, 6.0, 1)
to_list.close()  # its memory waits on the pool's free list
dflt = um.DeviceBuffer.from_array(rng.random(N).astype(np.float32))
um.DeviceBuffer.zeros(N).close()  # and on the default pool's
assert float(kept.copy_to_host()[N - 1]) == 5.0
""",
    "vmm_grown_twice": """
v = um.VMMBuffer.zeros(N, np.float32, capacity=64 * N)
v.grow(16 * N)  # each grow maps new memory (16 N floats are 4 MiB, past the first 2 MiB)
v.grow(40 * N)
assert v.mapped_nbytes >= 40 * N * 4
fill[40 * G, B, 0](v, 7.0, 1)
v_view = v[N : 2 * N]
assert float(v.copy_to_host()[40 * N - 1]) == 7.0
""",
    "torch_lent": """
import torch
assert torch.cuda.is_available()
t_src = um.DeviceBuffer.from_array(rng.random(N).astype(np.float32))
t_dl = torch.from_dlpack(t_src)  # the buffer escapes to PyTorch through DLPack
t_lend = um.ManagedBuffer.zeros(N, np.float32)
with t_lend.lend() as t_view:
    t_lent = torch.from_dlpack(t_view)  # lent, and kept past the block
    t_lent += 1
t_cai = torch.as_tensor(um.ManagedBuffer.zeros(N, np.float32), device="cuda")  # escaped (CUDA Array Interface)
torch.cuda.synchronize()
assert float(t_dl[5]) == float(t_src.copy_to_host()[5]) and float(t_lent[5]) == 1.0
""",
    "cupy_escaped": """
import cupy
c_src = um.ManagedBuffer.from_array(rng.random(N).astype(np.float32))
c_view = cupy.asarray(c_src)  # escaped through __cuda_array_interface__
c_dl = cupy.from_dlpack(um.DeviceBuffer.zeros(N))
c_view *= 2
assert float(c_dl.sum()) == 0.0
cupy.cuda.Device().synchronize()
""",
    "kernel_running": """
busy = um.ManagedBuffer.zeros(N, np.float32)
busy_stream = cuda.stream()
fill[G, B, busy_stream](busy, 8.0, 400)  # about 0.4 s of device time, not waited for
""",
    "plugin_arrays": """
from umem_numba._interop import _emm
assert isinstance(cuda.current_context().memory_manager, um.UmemNumbaMemoryManager)


def _spy_pool_free(pool, ctx, ptr, size, _real=_emm._pool_free, _r=_report):
    _r("plugin free")
    _real(pool, ctx, ptr, size)


_emm._pool_free = _spy_pool_free
d_kept = cuda.to_device(rng.random(N))
d_out = cuda.device_array(N)
sleeping.copy[G, B](d_kept, d_out, 1)
del d_out  # freed to the plugin pool's free list
d_more = [cuda.device_array(1000 + i) for i in range(20)]  # numba's finalizers free these at exit
""",
    "priority_stream": """
from umem_numba import PriorityStream
ps = PriorityStream()
ps_buf = um.ManagedBuffer.zeros(N, np.float32)
fill[G, B, ps.stream](ps_buf, 9.0, 50)  # still queued on it at exit
""",
}

_NEEDS = {"torch_lent": "torch", "cupy_escaped": "cupy"}


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(_CASES))
def test_process_exits_cleanly_leaving(case: str) -> None:
    """Issue #19 item 8: one thing left open at exit (the cases of the issue): status 0, empty stderr, no free.

    Before the fix the process leaving these behind died with SIGSEGV at exit;
    the spy also shows the frees that ran at exit (the plugin's free callback,
    PriorityStream's cuStreamDestroy, releases from DLPack deleters).
    """
    if case in _NEEDS:
        pytest.importorskip(_NEEDS[case])
    if case == "torch_lent":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("PyTorch has no CUDA here")
    env = {"NUMBA_CUDA_MEMORY_MANAGER": "umem_numba"} if case == "plugin_arrays" else {}
    proc = _run(_PRELUDE + _CASES[case] + '\nprint("DONE", flush=True)\n', **env)
    _assert_clean_exit(proc)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_process_exits_cleanly_leaving_everything_open() -> None:
    """Issue #19 item 8: everything of the issue left open at once, with numba's plugin on: status 0, empty stderr.

    A ManagedBuffer, a PinnedBuffer, pool DeviceBuffers with free-list entries,
    a VMMBuffer grown twice, buffers lent to PyTorch, escaped CuPy views, the
    plugin's arrays, a PriorityStream and a kernel still running: the process
    of the issue, which exited with status -11 before the fix.
    """
    parts = []
    for case, code in _CASES.items():
        needs = _NEEDS.get(case)
        if needs is not None:
            try:
                __import__(needs)
            except ImportError:
                continue
            if needs == "torch":
                import torch

                if not torch.cuda.is_available():
                    continue
        parts.append(code)
    code = _PRELUDE + "\n".join(parts) + '\nprint("DONE", flush=True)\n'
    proc = _run(code, NUMBA_CUDA_MEMORY_MANAGER="umem_numba")
    _assert_clean_exit(proc)


def test_gpu_cases_name_every_item_of_the_issue():
    """The parametrised cases cover the list of issue #19 item 8 (a guard against dropping one)."""
    assert set(_CASES) >= {
        "managed",
        "pinned",
        "pool_free_list",
        "vmm_grown_twice",
        "torch_lent",
        "cupy_escaped",
        "kernel_running",
    }
    assert set(_NEEDS) <= set(_CASES), "a case's optional library is named for a case that does not exist"
