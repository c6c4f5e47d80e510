"""Issue #27 item 10: a process that mixes lends, escapes and launches with PyTorch and CuPy exits with status 0.

On an H100 (driver 580) a process that lent a ``ManagedBuffer`` to a PyTorch stream
(``torch.cuda._sleep`` + ``fill_`` inside ``with buf.lend(torch_stream)``) and did other interop
work (an escaped pool ``DeviceBuffer`` closed and dropped while PyTorch reads it; a CuPy lend
and ``um.jit`` launches on CuPy and PyTorch stream objects) exited with status -11 (SIGSEGV at
exit, no Python frame) in some combinations and not others; each operation alone exited 0, and
so did a process with CuPy, PyTorch and numba but no umem_numba.

Each combination runs in fresh interpreters (several trials side by side: the crash depends on timing),
with umem_numba imported before and after the other libraries (their exit handlers then run
after, or before, umem_numba's).  GPU only: numba's simulator has no PyTorch or CuPy device.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
from support.helpers import TESTS_DIR

TRIALS = 3

_IMPORTS = {
    "umem-first": "import umem_numba as um\nimport torch\nimport cupy\n",
    "umem-last": "import torch\nimport cupy\nimport umem_numba as um\n",
}

_PRELUDE = """
import gc, sys
import numpy as np
from numba import cuda
{imports}
assert torch.cuda.is_available()
N = 1 << 20
rng = np.random.default_rng()
cycles = 50_000_000  # torch.cuda._sleep: tens of milliseconds of device time


@um.jit
def scale(a, factor):
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= factor
"""

_STEPS = {
    "torch_lend": """
lent = um.ManagedBuffer.zeros(N, np.float32)
torch_stream = torch.cuda.Stream()
with lent.lend(torch_stream) as view, torch.cuda.stream(torch_stream):
    t_view = torch.as_tensor(view, device="cuda")
    torch.cuda._sleep(cycles)
    t_view.fill_(3.0)
assert float(lent.host[N - 1]) == 3.0
with lent.lend(torch_stream) as view, torch.cuda.stream(torch_stream):
    t_dl = torch.from_dlpack(view)
    torch.cuda._sleep(cycles)
    t_dl.fill_(4.0)
assert float(lent.host[0]) == 4.0
""",
    "torch_escaped_pool": """
pool = um.MemoryPool("device")
escaped = um.DeviceBuffer.from_array(rng.random(N).astype(np.float32), pool=pool)
t_esc = torch.as_tensor(escaped, device="cuda")
torch.cuda._sleep(cycles)
total = t_esc.sum()  # queued behind the sleep
escaped.close()
del escaped, t_esc
gc.collect()
float(total.item())
again = um.DeviceBuffer.zeros(N, pool=pool)  # the pool hands memory out again
""",
    "cupy_lend_jit": """
c_buf = um.ManagedBuffer.from_array(np.ones(N, np.float32))
c_stream = cupy.cuda.Stream(non_blocking=True)
with c_buf.lend(c_stream) as view, c_stream:
    cupy.asarray(view)[...] *= 2
scale[N // 256, 256, c_stream](c_buf, 3.0)  # a CuPy stream object
t_stream = torch.cuda.Stream()
scale[N // 256, 256, t_stream](c_buf, 0.5)  # a PyTorch stream object
assert float(c_buf.host[7]) == 3.0
""",
}


def _combinations():
    names = sorted(_STEPS)
    for r in range(1, len(names) + 1):
        yield from itertools.combinations(names, r)


def _start(code: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=TESTS_DIR,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s)"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return _finish(_start(code))


@pytest.mark.gpu
@pytest.mark.real_gpu("PyTorch and CuPy on a CUDA device (numba's simulator gives them none)")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("order", sorted(_IMPORTS))
@pytest.mark.parametrize("steps", ["+".join(c) for c in _combinations()])
def test_interop_process_exits_cleanly(steps, order):
    pytest.importorskip("torch")
    pytest.importorskip("cupy")
    code = _PRELUDE.format(imports=_IMPORTS[order])
    code += "".join(_STEPS[s] for s in steps.split("+"))
    code += '\nprint("DONE", flush=True)\n'
    # The trials run side by side: a third of the wall time (this file is the GPU suite's longest),
    # and each process's exit falls while the others' work runs, one more source of timing.
    procs = [_start(code) for _ in range(TRIALS)]
    for trial, proc in enumerate([_finish(p) for p in procs]):
        report = f"trial {trial}: exit status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        assert "DONE" in proc.stdout, report
        assert proc.returncode == 0, report


# ---------------------------------------------------------------------------
# The two exit paths the fix hardens, without a GPU (the crash itself needs one, above)


def test_exit_hook_runs_before_handlers_of_libraries_imported_later():
    """A library imported after umem_numba registers its exit handler later, so it ran before
    umem_numba's hook, with the guard off: umem_numba memory it dropped there was freed while
    it tore down.  Once its objects reach umem_numba (here: a foreign stream object), umem_numba's
    hook runs first."""
    proc = _run(
        """
        import atexit
        from umem_numba import _driver
        from umem_numba._driver._location import stream_handle

        def later_library_exit():  # registered after umem_numba: runs before its hook, unless moved
            print("guard on in the other library's exit handler:", _driver.shutting_down(), flush=True)

        atexit.register(later_library_exit)

        class ForeignStream:  # a CuPy / PyTorch stream object, as umem_numba sees one
            __cuda_stream__ = (0, 12345)

        assert stream_handle(ForeignStream(), what="test") == 12345
        print("DONE", flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["DONE", "guard on in the other library's exit handler: True"], proc.stdout


def test_dlpack_deleters_are_cleared_at_exit():
    """A consumer that frees its tensor after the interpreter finalized must find no deleter to call
    (DLPack allows NULL): the ctypes deleter needs an interpreter that is gone."""
    proc = _run(
        """
        import ctypes
        import numpy as np
        from umem_numba import _driver
        from umem_numba._arrays import _dlpack

        a = np.arange(10.0)
        cpu = (_dlpack.KDL_CPU, 0)
        capsule = _dlpack.make_capsule(a.ctypes.data, a.shape, a.strides, a.dtype, cpu, a, lambda: None)
        (entry,) = _dlpack._live.values()
        assert bool(entry[0].deleter)
        _driver._at_exit()  # umem_numba's exit hook, as atexit runs it
        print("deleter after the exit hook:", bool(entry[0].deleter), flush=True)
        print("DONE", flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["deleter after the exit hook: False", "DONE"], proc.stdout


@pytest.mark.multigpu
def test_kernels_on_two_gpus_and_captures_then_exit_ends_with_status_0():
    """``tests/launch/test_launch_device.py`` in a fresh interpreter with every GPU visible exits with status 0.

    Its tests launch one kernel on GPUs 0 and 1 and capture it into graphs on each.  On
    4 x H200 every test passed and the process then died in numba's exit finalizers, in
    ``cuLibraryUnload`` of a kernel module ("double free or corruption", or a segfault; the one-GPU
    lanes never saw it).  numba-cuda 0.30 loads one linked kernel object into every context it
    runs in, so the modules of two contexts hold one ``cuLibrary`` handle, and each queues its
    unload at exit.  umem_numba's exit hook defers numba's cleanups when contexts on several
    devices are live.  (A kernel on two GPUs without the captures exited cleanly.)
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or multigpu"]
    out = subprocess.run(
        [*cmd, os.path.join(TESTS_DIR, "launch", "test_launch_device.py")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
        cwd=os.path.dirname(TESTS_DIR),
    )
    tail = (out.stdout + out.stderr)[-3000:]
    assert " passed" in out.stdout and " failed" not in out.stdout, tail
    assert out.returncode == 0, f"exit status {out.returncode} after the tests passed: {tail}"
