"""Behaviour without a usable GPU: importing works, the first GPU call raises one clear error.

These run everywhere: where a GPU exists, a subprocess that sees no device
(``CUDA_VISIBLE_DEVICES=""``, numba's simulator off) stands in for a machine
without one.  Under numba's simulator umem_numba works on host memory instead
(tests/driver/test_sim.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import umem_numba

ROOT = Path(__file__).resolve().parents[2]


def _no_gpu_env() -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def _run_without_gpu(code: str) -> subprocess.CompletedProcess:
    env = _no_gpu_env()
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=False, env=env, capture_output=True, text=True, timeout=120
    )


def test_import_and_first_call_raise_one_clear_error():
    proc = _run_without_gpu("""
        import numpy as np
        import umem_numba as um
        assert um.gpu_available() is False
        for make in (lambda: um.ManagedBuffer.empty(4), lambda: um.PinnedBuffer.empty(4),
                     lambda: um.managed_zeros((2, 2))):
            try:
                make()
            except um.CudaUnavailableError as exc:
                print("ERR", exc)
            else:
                raise SystemExit("no error raised")
        # validation errors still come first and name the culprit
        try:
            um.ManagedBuffer.empty(-3)
        except ValueError as exc:
            print("VAL", exc)
        info = um.info()
        assert info["available"] is False and info["devices"] == []
        print("INFO", info["reason"])
    """)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    errs = [ln for ln in lines if ln.startswith("ERR")]
    assert len(errs) == 3
    assert all("simulator" in ln or "driver" in ln or "GPU" in ln for ln in errs)
    assert any(ln.startswith("VAL") and "negative dimension -3" in ln for ln in lines)


def test_the_first_gpu_call_says_how_to_run_on_the_simulator():
    """Issue #30 item 5: README's example, on a machine without a GPU, raised
    ``umem_numba._errors.CudaUnavailableError: ... libcuda could not be loaded`` and no word of the
    simulator.  The error is the public ``umem_numba.CudaUnavailableError`` and says how."""
    proc = _run_without_gpu("""
        import numpy as np
        import umem_numba as um
        um.ManagedBuffer.from_array(np.random.rand(1000).astype(np.float32))
    """)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("umem_numba.CudaUnavailableError: "), last
    assert "NUMBA_ENABLE_CUDASIM=1" in last and "simulator" in last, last


def test_cli_info_without_gpu():
    env = _no_gpu_env()
    proc = subprocess.run(
        [sys.executable, "-m", "umem_numba", "info"], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "CUDA: not available" in proc.stdout
    assert "numba-cuda" in proc.stdout
    # Issue #30 item 5: it said only "not available"; now also how to run without a GPU.
    assert "NUMBA_ENABLE_CUDASIM=1 python -m umem_numba info" in proc.stdout, proc.stdout


def test_pytest_without_a_gpu_says_once_why_the_gpu_tests_skip_and_how_to_run_them():
    """Issue #30 item 5: ``pytest -q -rs`` printed one SKIPPED line per GPU test (184 of 193 the same
    libcuda sentence) and never said that they run on the simulator, or how."""
    files = ["tests/arrays/test_pointer_probes.py", "tests/docs/test_readme.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files],
        check=False,
        env=_no_gpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skipped = [ln for ln in proc.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert len(skipped) == 1, proc.stdout  # one line for every GPU test, not one per test
    assert skipped[0].startswith("SKIPPED [7] ") and "no CUDA GPU" in skipped[0], skipped
    assert proc.stdout.count("NUMBA_ENABLE_CUDASIM=1") == 1, proc.stdout
    command = 'NUMBA_ENABLE_CUDASIM=1 python -m pytest -q -m "gpu or multigpu"'
    assert command in proc.stdout, proc.stdout


def test_public_api_is_declared():
    assert len(set(umem_numba.__all__)) == len(umem_numba.__all__)
    for name in umem_numba.__all__:
        obj = getattr(umem_numba, name)
        assert not name.startswith("_")
        if callable(obj) or isinstance(obj, type):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"


def test_dir_shows_the_public_api_only():
    """Issue #30 item 7: ``dir(um)`` (and so tab completion) listed ``annotations`` and the private modules."""
    names = dir(umem_numba)
    assert names == sorted(names)
    assert set(names) == {*umem_numba.__all__, "__version__"}, sorted(set(names) ^ {*umem_numba.__all__})
    for name in names:
        assert getattr(umem_numba, name) is not None


def test_error_types_are_catchable_as_builtin_kinds():
    assert issubclass(umem_numba.OutOfMemoryError, MemoryError)
    assert issubclass(umem_numba.CudaError, RuntimeError)
    assert issubclass(umem_numba.BufferClosedError, ValueError)
    err = umem_numba.OutOfMemoryError("cuMemAllocManaged", 2, "CUDA_ERROR_OUT_OF_MEMORY", "3 TiB")
    assert str(err) == "cuMemAllocManaged failed with CUDA_ERROR_OUT_OF_MEMORY (2): 3 TiB"
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert again.code == 2 and again.call == "cuMemAllocManaged"


@pytest.mark.parametrize("target,exc", [(True, TypeError), (-2, ValueError), ("gpu", TypeError), (1.0, TypeError)])
def test_bad_targets_rejected_before_driver(target, exc):
    with pytest.raises(exc):
        umem_numba.as_location(target, check=False)


def test_locations():
    from umem_numba import HOST, Location

    assert umem_numba.as_location("cpu") is HOST and umem_numba.as_location("HOST") is HOST
    assert umem_numba.as_location(3, check=False) == Location.device(3)
    assert Location.from_legacy_id(-1) is HOST and Location.from_legacy_id(-2) is None
    assert Location.from_legacy_id(1) == Location.device(1)
    with pytest.raises(ValueError):
        Location("moon", 0)
    assert str(HOST) == "host" and str(Location.device(2)) == "device 2"


def test_stream_handles():
    from umem_numba._driver._location import stream_handle

    class Fake:
        def __cuda_stream__(self):
            return (0, 0xABC)

    assert stream_handle(None) == 0 and stream_handle(0) == 0 and stream_handle(0x1234) == 0x1234
    assert stream_handle(Fake()) == 0xABC
    with pytest.raises(TypeError, match="stream"):
        stream_handle("fast")
    with pytest.raises(ValueError):
        stream_handle(-5)


def test_coherence_policy_validation():
    with pytest.raises(ValueError, match="unknown coherence policy 'later'"):
        umem_numba.set_coherence_policy("later")
    assert umem_numba.get_coherence_policy() == "sync"
    with umem_numba.coherence_policy("raise"):
        assert umem_numba.get_coherence_policy() == "raise"
        with umem_numba.coherence_policy("off"):
            assert umem_numba.get_coherence_policy() == "off"
        assert umem_numba.get_coherence_policy() == "raise"
    assert umem_numba.get_coherence_policy() == "sync"


def test_host_alloc_flags_algebra():
    F = umem_numba.HostAllocFlags
    f = F.DEFAULT
    f |= F.PORTABLE
    assert f == F.PORTABLE and int(f) == 1
    f |= F.DEVICEMAP
    assert F.PORTABLE in f and F.DEVICEMAP in f and F.WRITECOMBINED not in f
    assert (f & F.DEVICEMAP) == F.DEVICEMAP and (f & F.WRITECOMBINED) == F.DEFAULT
    assert int(F.PORTABLE | F.DEVICEMAP | F.WRITECOMBINED) == 7
    assert int(F.DEFAULT) == 0 and (F.PORTABLE & F.DEFAULT) == F.DEFAULT
    assert F.PORTABLE not in F.DEVICEMAP and F.DEVICEMAP not in F.PORTABLE
    from umem_numba._kinds._pinned import _as_flags

    with pytest.raises(ValueError, match="unknown host allocation flag bits 0x8"):
        _as_flags(8)
    with pytest.raises(TypeError):
        _as_flags("portable")


@pytest.mark.parametrize("name", ["all", "launch", "prefetch", "vmm", "stencil"])
def test_bench_help_runs_anywhere(name):
    proc = subprocess.run(
        [sys.executable, "-m", "umem_numba", "bench", name, "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"bench {name}" in proc.stdout


def test_cli_rejects_unknown_benchmark():
    proc = subprocess.run(
        [sys.executable, "-m", "umem_numba", "bench", "warp-speed"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "invalid choice: 'warp-speed'" in proc.stderr
