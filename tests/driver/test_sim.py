"""umem_numba under numba's CUDA simulator: what is particular to it (the shared API is tested by
the GPU tests marked ``sim``, which CI runs with ``NUMBA_ENABLE_CUDASIM=1``).

These run everywhere, in subprocesses with the simulator switched on (it must be chosen before
``numba.cuda`` is first imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from support.helpers import random_array

ROOT = Path(__file__).resolve().parents[2]


def _sim(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"simulator run failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_info_and_hints_read_back_the_simulated_driver():
    proc = _sim("""
        import numpy as np
        import umem_numba as um
        info = um.info()
        assert info["simulator"] is True and info["available"] is False and info["devices"] == []
        print("INFO", info["reason"])
        buf = um.ManagedBuffer.from_array(np.arange(4096, dtype=np.float32))
        buf.hints.set_read_mostly()
        buf.prefetch(0)
        state = buf.hints.state()
        assert state.read_mostly is True and state.last_prefetch_location == um.Location.device(0), state
        buf.prefetch_range(0, 4096, "cpu")
        assert buf.hints.last_prefetch_location == um.HOST
        # checked as on a GPU: the simulated driver has one device
        for bad in (lambda: buf.prefetch(1), lambda: buf.hints.set_accessed_by(3)):
            try:
                bad()
            except ValueError as exc:
                print("BAD", exc)
        try:
            um.MemoryPool("device", exportable=True)
        except um.UnsupportedError as exc:
            print("UNSUPPORTED", exc)
    """)
    out = proc.stdout
    assert "INFO numba's CUDA simulator" in out and "simulated driver" in out
    assert out.count("BAD") == 2
    assert out.count("UNSUPPORTED") == 1


def test_cli_info_says_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run(
        [sys.executable, "-m", "umem_numba", "info"], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "numba's CUDA simulator" in proc.stdout and "simulated driver" in proc.stdout


@pytest.mark.parametrize("manager", ["umem_numba", ""])
def test_the_memory_manager_variable_warns_that_the_simulator_ignores_it(manager):
    """Issue #30 item 5: ``NUMBA_CUDA_MEMORY_MANAGER=umem_numba`` was silently ignored on the simulator."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBA_CUDA_MEMORY_MANAGER=manager)
    code = "import numpy as np, umem_numba as um; print(um.ManagedBuffer.from_array(np.arange(3.0)).copy_to_host())"
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0. 1. 2.]"  # and the program goes on
    warned = "NUMBA_CUDA_MEMORY_MANAGER=umem_numba has no effect under numba's CUDA simulator"
    assert (warned in proc.stderr) is bool(manager), proc.stderr
    assert proc.stderr.count("NUMBA_CUDA_MEMORY_MANAGER") == (1 if manager else 0), proc.stderr


def test_kernels_see_views_and_aliasing_and_hold_is_enforced(tmp_path, rng):
    """Kernels get the buffer's own memory: strided views, two views of one buffer, every launch form."""
    data = random_array(rng, (40, 30), np.float64)
    np.save(tmp_path / "in.npy", data)
    proc = _sim(
        """
        import sys
        import numpy as np
        from numba import cuda
        import umem_numba as um

        @cuda.jit
        def shift(dst, src):
            i, j = cuda.grid(2)
            if i < dst.shape[0] and j < dst.shape[1]:
                dst[i, j] = src[i, j] * 2 + 1

        data = np.load(sys.argv[1])
        buf = um.ManagedBuffer.from_array(data)
        # two strided views of one buffer in one launch: the kernel reads and writes the buffer itself
        shift[(4, 4), (16, 8)](buf[20:, ::2], buf[:20, ::2])
        um.launch(shift, (4, 4), (16, 8), buf[:, 1::2], buf[:, 1::2], stream=cuda.stream())
        vmm = um.VMMBuffer.from_array(data[:5])
        ptr = vmm.ptr
        vmm.grow(9)
        um.jit(shift.py_func)[(1, 1), (16, 32)](vmm[5:], vmm[:4])
        assert vmm.ptr == ptr
        got_vmm = vmm.copy_to_host()
        np.save(sys.argv[2], buf.host)
        np.save(sys.argv[3], got_vmm)
        with buf.on_host():
            try:
                shift[1, 1](buf, buf)
            except um.CoherenceError:
                print("held")
        """,
        str(tmp_path / "in.npy"),
        str(tmp_path / "buf.npy"),
        str(tmp_path / "vmm.npy"),
    )
    expected = data.copy()
    expected[20:, ::2] = data[:20, ::2] * 2 + 1
    expected[:, 1::2] = data[:, 1::2] * 2 + 1
    np.testing.assert_array_equal(np.load(tmp_path / "buf.npy"), expected)
    vmm = np.load(tmp_path / "vmm.npy")
    np.testing.assert_array_equal(vmm[:5], data[:5])
    np.testing.assert_array_equal(vmm[5:9], data[:4] * 2 + 1)
    assert proc.stdout.split() == ["held"]


@pytest.mark.parametrize("script,size,steps", [("heat2d.py", 40, 30), ("heat3d.py", 12, 10)])
def test_example_without_gpu_runs_on_the_simulator_and_matches_numpy(tmp_path, script, size, steps):
    """The main job on the simulator: one line says so (without a GPU), the picture is written, --check passes."""
    import umem_numba as um

    env = dict(os.environ)
    if um.gpu_available():
        env["NUMBA_ENABLE_CUDASIM"] = "1"  # a GPU machine: ask for the simulator
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)  # no GPU: the example falls back by itself
    out = tmp_path / "field.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / script),
            "--size",
            str(size),
            "--steps",
            str(steps),
            "--out",
            str(out),
            "--check",
        ],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    if "NUMBA_ENABLE_CUDASIM" not in env:
        assert lines[0].startswith(f"{script.removesuffix('.py')}: no CUDA GPU here")
        assert "numba's CUDA simulator" in lines[0]
        assert sum("no CUDA GPU" in ln for ln in lines) == 1
    assert any("on numba's CUDA simulator" in ln and f"{steps} steps" in ln for ln in lines)
    assert "max error 0.00e+00" in proc.stdout and ": OK" in proc.stdout  # the simulator: bit for bit
    assert out.stat().st_size > 1000
    assert "Warning" not in proc.stderr
