"""Shared fixtures: GPU gating, fresh random data, leak checks (helpers live in ``support/helpers.py``)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from support.helpers import test_seed

import umem_numba as um
from umem_numba import _driver
from umem_numba._driver import _sim


def _gpu_reason() -> str:
    return _driver.unavailable_reason()


#: Under numba's simulator (NUMBA_ENABLE_CUDASIM=1) every GPU test runs over umem_numba's simulated
#: driver, except those that need what it does not simulate: by capability, the node ids (or
#: their prefixes; "::name" matches a test name in any file) that need it.
#: A test can also say so itself: ``@pytest.mark.real_gpu("why")``.
SIM_NEEDS: dict[str, tuple[str, ...]] = {
    "numba's compiled kernels launched through cuLaunchKernel (the direct launch path): numba's "
    "simulator compiles nothing": ("tests/launch/test_launch_direct.py::",),
    "numba's memory-manager plugin (NUMBA_CUDA_MEMORY_MANAGER): numba's simulator has no memory managers": (
        "tests/interop/test_emm.py::",
    ),
    "numba's memory-manager plugin (NUMBA_CUDA_MEMORY_MANAGER), which numba's simulator does not have": (
        "tests/memory/test_fastpath_pool.py::test_plugin_",
        "tests/memory/test_fastpath_exit.py::test_process_exits_cleanly_leaving[plugin_arrays]",
        "tests/memory/test_fastpath_exit.py::test_process_exits_cleanly_leaving_everything_open",
    ),
    "numba's compiled kernels launched through cuLaunchKernel (the direct launch path)": (
        "tests/launch/test_fastpath_launch.py::test_pre_launch_callbacks_run_on_direct_launches",
    ),
    "numba's real driver: its own refusal of a managed_array view at launch": (
        "tests/arrays/test_managed.py::test_numba_managed_array_slice_fails_but_ours_works",
    ),
    "cuda.core's own device, stream and memory resource (cuda.core.Device, DeviceMemoryResource), which "
    "call the CUDA driver through cuda.bindings directly, not umem_numba's simulated driver": (
        "tests/hints/test_parity.py::test_cuda_core_pool_memory_round_trip",
    ),
    "numba's real driver objects (DeviceNDArray, the context's deferred deallocations)": (
        "tests/memory/test_fastpath_pool.py::test_remembered_stream_id_dies_with_its_stream",
        "tests/memory/test_fastpath_pool.py::test_last_stream_cache_orders_a_buffer_after_a_dead_streams_reader",
    ),
    "timing a real GPU (benchmarks)": (
        "tests/cli/test_bench_report.py::test_bench_all_quick_on_the_gpu",
        "tests/vmm/test_vmm.py::test_bench_quick_run_writes_checked_results",
        "tests/kernels/test_stencil_gpu.py::test_bench_stencil",
    ),
    "a fault on a write through a read-only VMM mapping (the simulated driver does not tell a "
    "kernel's reads from its writes)": ("tests/vmm/test_vmm.py::test_read_only_access_is_enforced_in_a_child_process",),
    "kernels with syncthreads on GPU-sized grids (numba's simulator runs them with a Python thread per "
    "CUDA thread: minutes each; the kernels run on the simulator at small sizes in "
    "tests/kernels/test_kernels_sim.py)": (
        "tests/kernels/test_stencil3d_vec.py::test_every_variant_on_the_gpu_aligned_misaligned_and_windowed[float32-tile]",
        "tests/kernels/test_stencil3d_vec.py::test_every_variant_on_the_gpu_aligned_misaligned_and_windowed[float64-tile]",
    ),
    "the examples' GPU path (under numba's simulator they take their own simulator branch, tested "
    "by examples/heat2d.py's fallback)": (
        "tests/examples/test_examples.py::test_heat2d_end_to_end",
        "tests/examples/test_examples.py::test_heat3d_end_to_end",
        "tests/examples/test_examples.py::test_residual_end_to_end",
        "tests/examples/test_examples.py::test_examples_refuse_to_oversubscribe",
    ),
    "a GPU in every MPI rank: examples/heat2d_mpi.py refuses the simulated driver (GPU-sized plates "
    "would take hours on numba's simulator; the MPI tests without a GPU run in every CI job)": (
        "tests/kernels/test_mpi.py::test_mpi_gpu_",
    ),
}


#: The skip reason of every GPU test on a machine without a GPU; the note at the end of the run
#: (pytest_terminal_summary) says why once, and how to run them on the simulator.
NO_GPU_SKIP = 'no CUDA GPU (why, and how to run these tests on the simulator: the "GPU tests" line above)'
#: The command that runs the GPU tests on numba's simulator (README, docs/contributing.md).
SIM_COMMAND = 'NUMBA_ENABLE_CUDASIM=1 python -m pytest -q -m "gpu or multigpu"'
#: Set on an item that this file skips: its report names this file, so that ``-rs`` folds the skips of
#: every test file into one line per reason instead of one line per file.
_FOLDED = pytest.StashKey[bool]()


def _skip(item: pytest.Item, reason: str) -> None:
    item.add_marker(pytest.mark.skip(reason=reason))
    item.stash[_FOLDED] = True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _sim.active():
        # numba's CUDA simulator: the GPU tests run over umem_numba's simulated driver.
        for item in items:
            if "gpu" not in item.keywords and "multigpu" not in item.keywords:
                continue
            mark = item.get_closest_marker("real_gpu")
            why = (mark.args[0] if mark.args else "a real GPU") if mark is not None else None
            for need, prefixes in SIM_NEEDS.items():
                for prefix in prefixes:  # "::name" matches a test name in any file
                    hit = prefix in item.nodeid if prefix.startswith("::") else item.nodeid.startswith(prefix)
                    if why is None and hit:
                        why = need
            if why is None and "multigpu" in item.keywords:
                why = (
                    "two GPUs: numba's simulator has one device (cuda.gpus holds one context, "
                    "cuda.select_device(1) fails its assertion, its device arrays are host memory of no "
                    "device) and so does the simulated driver (cuDeviceGetCount is 1, no peer access)"
                )
            if why is not None:
                _skip(item, f"needs {why}; numba's simulator runs over a simulated driver")
        return
    reason = _gpu_reason()
    many = None
    for item in items:
        if reason and ("gpu" in item.keywords or "multigpu" in item.keywords):
            _skip(item, NO_GPU_SKIP)
        elif "multigpu" in item.keywords:
            if many is None:
                many = _driver.device_count()
            if many < 2:
                _skip(item, f"needs 2 GPUs, this machine has {many}")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    """Say once why the GPU tests skipped on a machine without a GPU, and how to run them on the simulator."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if _skip_reason(r) == NO_GPU_SKIP]
    if skipped:
        terminalreporter.write_line(
            f"GPU tests: {len(skipped)} skipped, no CUDA GPU here ({_gpu_reason()}). They run on numba's CUDA "
            f"simulator, over umem_numba's simulated driver (docs/concepts/simulator.md): {SIM_COMMAND}"
        )


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else ""
    return reason.removeprefix("Skipped: ")


@pytest.fixture(autouse=True)
def _sim_seed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under the simulated driver: each test draws its stream order from ``UMEM_SIM_SEED`` and its own name.

    A test's order therefore does not depend on the tests run before it:
    ``UMEM_SIM_SEED=<seed> pytest <node id>`` replays it.
    """
    if not _sim.active():
        yield
        return
    from umem_numba._driver import _simulated as _sim_driver

    base = _sim_driver.seed()
    drv = _driver.api().drv
    drv.drain_quietly()
    drv.reseed(zlib.crc32(request.node.nodeid.encode()) ^ base)
    request.node.user_properties.append(("simulator seed", base))
    yield
    # Work the test left queued runs now (a GPU would run it too); its errors are this test's.
    errors = drv.drain_quietly()
    if errors:
        pytest.fail(f"device work left queued by this test failed when it ran: {errors[0]!r}")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator with a fresh seed per test; ``UMEM_TEST_SEED`` fixes it; a failure reports it."""
    seed = test_seed()
    request.node.user_properties.append(("random seed", seed))
    print(f"random seed: {seed} (rerun with UMEM_TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.stash.get(_FOLDED, False) and isinstance(report.longrepr, tuple):
        # pytest points a mark's skip at the test's own line; this file decided it (one line per reason).
        report.longrepr = (__file__, None, report.longrepr[2])
    if report.failed:
        for name, value in item.user_properties:
            if name == "random seed":
                report.sections.append(("random seed", f"UMEM_TEST_SEED={value}"))
            elif name == "simulator seed":
                report.sections.append(
                    ("simulator seed", f"UMEM_SIM_SEED={value} (stream order of the simulated driver)")
                )


@pytest.fixture
def fresh_allocations():
    """Buffers made without ``pool=`` get new driver memory for the test (the allocation cache is off).

    For tests that read back the driver's state of a fresh range (its last prefetch location):
    an allocation from the cache carries the state its last buffer left (documented).
    """
    before = um.get_allocation_cache()
    um.set_allocation_cache(False)
    yield
    um.set_allocation_cache(before)


@pytest.fixture
def device_memory():
    """Assert that a test gives back the device memory it took (cuMemGetInfo)."""
    from numba import cuda

    cuda.synchronize()
    before, _ = _driver.mem_get_info()

    def check(slack: int = 8 << 20) -> None:
        import gc

        gc.collect()
        um.release_allocation_cache()  # closed buffers' allocations kept for reuse are not a leak
        cuda.synchronize()
        after, _ = _driver.mem_get_info()
        assert before - after <= slack, f"device memory leaked: {(before - after) / 2**20:.1f} MiB"

    return check
