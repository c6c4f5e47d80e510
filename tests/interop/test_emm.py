"""numba's allocations through umem_numba's memory-manager plugin (EMM).

Each GPU test runs in a fresh interpreter with NUMBA_CUDA_MEMORY_MANAGER set,
since numba picks its memory manager when it creates a context."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from support.helpers import run_with_plugin

import umem_numba as um

_KERNELS = """
import gc, json
import numpy as np
import umem_numba as um
from numba import cuda

@cuda.jit
def axpy(out, a, x, y):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]

@cuda.reduce
def total(a, b):
    return a + b

mgr = cuda.current_context().memory_manager
rng = np.random.default_rng()
x, y = rng.random(100_000), rng.random(100_000)
s0 = um.stats()["emm"]
dx, dy = cuda.to_device(x), cuda.to_device(y)
out = cuda.device_array_like(dx)
axpy[400, 256](out, 2.5, dx, dy)
res = out.copy_to_host()
s1 = um.stats()["emm"]
red = total(dx)  # the reduction allocates its own temporaries
s2 = um.stats()["emm"]
pool = um.stats()["pool"]
from umem_numba import _driver
drv = _driver.api().drv
managed = int(_driver.call("cuPointerGetAttribute",
              drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED, out.device_ctypes_pointer.value))
with cuda.defer_cleanup():
    del dx, dy, out
    gc.collect()
    deferred_live = um.stats()["emm"].live_count
gc.collect()
cuda.synchronize()
print(json.dumps({
    "manager": type(mgr).__name__, "pool_kind": mgr.pool.kind,
    "ok": bool(np.allclose(res, 2.5 * x + y)), "red_ok": bool(np.isclose(red, x.sum())),
    "alloc_after_kernels": s1.total_allocations - s0.total_allocations,
    "alloc_by_reduce": s2.total_allocations - s1.total_allocations,
    "live_bytes": s1.live_bytes - s0.live_bytes, "pool_used": pool.used_current,
    "pool_count": pool.pools, "managed": managed,
    "deferred_live": deferred_live - s0.live_count, "live_end": um.stats()["emm"].live_count - s0.live_count,
    "info": list(cuda.current_context().get_memory_info()),
}))
"""


@pytest.mark.gpu
def test_numba_allocations_go_through_the_device_pool():
    r = run_with_plugin(_KERNELS)
    assert r["manager"] == "UmemNumbaMemoryManager" and r["pool_kind"] == "device"
    assert r["ok"] and r["red_ok"]
    assert r["alloc_after_kernels"] >= 3  # to_device x2, device_array_like
    assert r["alloc_by_reduce"] >= 1
    assert r["live_bytes"] >= 3 * 100_000 * 8
    assert r["pool_count"] >= 1 and r["pool_used"] >= 3 * 100_000 * 8
    assert r["managed"] == 0
    assert r["deferred_live"] >= 3  # still held inside defer_cleanup()
    assert r["live_end"] <= 0  # freed once the block ended
    free, total = r["info"]
    assert 0 < free <= total


@pytest.mark.gpu
def test_numba_allocations_from_a_managed_pool():
    from umem_numba._memory._resources import managed_pool_support

    missing = managed_pool_support()
    if missing:
        proc = subprocess.run(
            [sys.executable, "-c", "from numba import cuda; cuda.device_array(4)"],
            check=False,
            env=dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="umem_numba", UMEM_NUMBA_EMM_POOL="managed"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode != 0 and "managed memory pools need" in proc.stderr
        pytest.skip(f"managed pools unsupported: {missing}")
    r = run_with_plugin(_KERNELS, UMEM_NUMBA_EMM_POOL="managed")
    assert r["pool_kind"] == "managed" and r["managed"] == 1
    assert r["ok"] and r["red_ok"] and r["alloc_after_kernels"] >= 3


@pytest.mark.gpu
def test_managed_pool_refuses_ipc_clearly():
    from umem_numba._memory._resources import managed_pool_support

    if managed_pool_support():
        pytest.skip("managed pools unsupported here")
    r = run_with_plugin(
        """
        import json
        import numpy as np
        import umem_numba as um
        from numba import cuda
        d = cuda.to_device(np.arange(10.0))
        try:
            d.get_ipc_handle()
        except um.UnsupportedError as exc:
            print(json.dumps({"err": str(exc)}))
    """,
        UMEM_NUMBA_EMM_POOL="managed",
    )
    assert "managed pool here (UMEM_NUMBA_EMM_POOL=managed), which the driver cannot export" in r["err"]


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_ipc_handles_of_pool_memory_open_in_another_process():
    """numba's IPC through the plugin (on with UMEM_NUMBA_EMM_IPC=1): a whole array and a view, opened by
    children with and without the plugin."""
    tests_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
    r = run_with_plugin(
        f"""
        import json, multiprocessing as mp, os, sys
        import numpy as np
        from numba import cuda
        sys.path.insert(0, {tests_dir!r})
        import _emm_ipc_child as child

        x = np.random.default_rng().random(100_003)
        d = cuda.to_device(x)
        whole, view = d.get_ipc_handle(), d[17:5017].get_ipc_handle()
        spawn = mp.get_context("spawn")
        with spawn.Pool(1) as p:
            before, child_manager = p.apply(child.read_then_double, (whole,))
        os.environ.pop("NUMBA_CUDA_MEMORY_MANAGER")  # the next child keeps numba's own manager
        with spawn.Pool(1) as p:
            part, other_manager = p.apply(child.read_then_double, (view,))
        after = d.copy_to_host()
        expect = 2 * x
        expect[17:5017] *= 2
        print(json.dumps({{
            "handle": type(whole._ipc_handle).__name__,
            "manager": type(cuda.current_context().memory_manager).__name__,
            "child_manager": child_manager, "other_manager": other_manager,
            "before_ok": bool(np.array_equal(before, x)),
            "part_ok": bool(np.array_equal(part, 2 * x[17:5017])),
            "after_ok": bool(np.array_equal(after, expect)),
        }}))
    """,
        UMEM_NUMBA_EMM_IPC="1",
    )
    assert r["handle"] == "PoolIpcHandle" and r["manager"] == "UmemNumbaMemoryManager"
    assert r["child_manager"] == "UmemNumbaMemoryManager" and r["other_manager"] != "UmemNumbaMemoryManager"
    assert r["before_ok"], "the child read other values than the parent wrote"
    assert r["part_ok"], "the view's handle opened at the wrong offset"
    assert r["after_ok"], "the children's writes did not reach the parent's array"


@pytest.mark.gpu
def test_selecting_the_plugin_after_a_context_exists_is_a_clear_error():
    r = run_with_plugin(
        """
        import json
        import umem_numba as um
        from numba import cuda
        cuda.current_context()  # numba's own manager (the env var is unset here)
        try:
            cuda.set_memory_manager(um.UmemNumbaMemoryManager)
            err = ""
        except RuntimeError as exc:
            err = str(exc)
        print(json.dumps({"err": err, "name": type(cuda.current_context().memory_manager).__name__}))
    """,
        NUMBA_CUDA_MEMORY_MANAGER="default",
    )
    assert "before numba creates a CUDA context" in r["err"] and "device 0 already has one" in r["err"]
    assert r["name"] != "UmemNumbaMemoryManager"  # the context keeps numba's own allocator


# ---------------------------------------------------------------------------
# CPU


def test_plugin_is_what_numba_loads_and_checks_its_setting():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import umem_numba, umem_numba._interop._emm as e
        from numba.cuda.cudadrv import driver
        assert umem_numba._numba_memory_manager is e.UmemNumbaMemoryManager
        assert issubclass(e.UmemNumbaMemoryManager, driver.BaseCUDAMemoryManager)
        assert e.UmemNumbaMemoryManager(context=None).interface_version == 1
        print("ok")
    """),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
    proc = subprocess.run(
        [sys.executable, "-c", "import umem_numba._interop._emm"],
        check=False,
        env=dict(os.environ, UMEM_NUMBA_EMM_POOL="pinned"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "UMEM_NUMBA_EMM_POOL must be 'device' or 'managed'" in proc.stderr


def test_buffers_are_numbas_arg_hints_and_the_plugin_loads_lazily():
    """Buffers subclass numba's ``ArgHint`` (a plain launch hands them its stream), so importing
    umem_numba imports ``numba.cuda``; the memory-manager plugin's module is still loaded only when
    numba asks for it (at its first context, once ``numba.cuda`` is fully imported)."""
    code = (
        "import sys, umem_numba\n"
        "from numba.cuda.args import ArgHint, wrap_arg\n"
        "print(issubclass(umem_numba.ManagedBuffer, ArgHint), 'umem_numba._interop._emm' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "False"], proc.stdout + proc.stderr
    assert hasattr(um, "UmemNumbaMemoryManager")


def test_numba_suite_reads_every_outcome_of_the_harness():
    """tests/support/numba_suite.py (the plugin's acceptance run) reads numba's verbose output test by test."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
    import numba_suite

    log = textwrap.dedent("""\
        Parallel: 4. Serial: 0
        test_a (numba.cuda.tests.cudadrv.test_x.T.test_a) ... ok
        test_b (numba.cuda.tests.cudadrv.test_x.T.test_b)
        A docstring line. ... FAIL
        test_c (numba.cuda.tests.cudapy.test_y.U.test_c) ... skipped 'needs two GPUs'
        test_d (numba.cuda.tests.cudapy.test_y.U.test_d) ... expected failure
        test_e (numba.cuda.tests.cudapy.test_y.U.test_e) ... ERROR
        ======================================================================
        ERROR: test_e (numba.cuda.tests.cudapy.test_y.U.test_e)
        """)
    outcomes = numba_suite.parse(log)
    assert outcomes == {
        "numba.cuda.tests.cudadrv.test_x.T.test_a": "ok",
        "numba.cuda.tests.cudadrv.test_x.T.test_b": "FAIL",
        "numba.cuda.tests.cudapy.test_y.U.test_c": "skipped",
        "numba.cuda.tests.cudapy.test_y.U.test_d": "expected failure",
        "numba.cuda.tests.cudapy.test_y.U.test_e": "ERROR",
    }
    assert numba_suite.counts(outcomes) == {
        "tests": 5,
        "ok": 1,
        "FAIL": 1,
        "ERROR": 1,
        "skipped": 1,
        "expected failure": 1,
    }
