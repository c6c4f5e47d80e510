"""Shared fixtures: GPU gating, fresh random data, leak checks (helpers live in ``helpers.py``)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import test_seed

from umem_numba import _driver, _sim

def _gpu_reason() -> str:
    return _driver.unavailable_reason()


#: Under numba's simulator (the simulated driver): why a test marked ``real_gpu`` skips is its own
#: reason (``@pytest.mark.real_gpu("reads numba's real driver objects")``); these are the others.
SIM_ONE_DEVICE = "needs 2 GPUs; the simulated driver (NUMBA_ENABLE_CUDASIM=1) has one device"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _sim.active():
        # numba's CUDA simulator: the GPU tests run over umem_numba's simulated driver.
        for item in items:
            if "multigpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=SIM_ONE_DEVICE))
                continue
            mark = item.get_closest_marker("real_gpu")
            if mark is not None:
                why = mark.args[0] if mark.args else "needs a real GPU"
                item.add_marker(pytest.mark.skip(reason=f"needs a real GPU, not the simulated driver: {why}"))
        return
    reason = _gpu_reason()
    many = None
    for item in items:
        if reason and ("gpu" in item.keywords or "multigpu" in item.keywords):
            item.add_marker(pytest.mark.skip(reason=f"no CUDA GPU: {reason}"))
        elif "multigpu" in item.keywords:
            if many is None:
                many = _driver.device_count()
            if many < 2:
                item.add_marker(pytest.mark.skip(reason=f"needs 2 GPUs, this machine has {many}"))


@pytest.fixture(autouse=True)
def _sim_seed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under the simulated driver: each test draws its stream order from ``UMEM_SIM_SEED`` and its own name.

    A test's order therefore does not depend on the tests run before it:
    ``UMEM_SIM_SEED=<seed> pytest <node id>`` replays it.
    """
    if not _sim.active():
        yield
        return
    from umem_numba import _sim_driver

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
    if report.failed:
        for name, value in item.user_properties:
            if name == "random seed":
                report.sections.append(("random seed", f"UMEM_TEST_SEED={value}"))
            elif name == "simulator seed":
                report.sections.append(("simulator seed", f"UMEM_SIM_SEED={value} (stream order of the simulated driver)"))


@pytest.fixture
def device_memory():
    """Assert that a test gives back the device memory it took (cuMemGetInfo)."""
    from numba import cuda

    cuda.synchronize()
    before, _ = _driver.mem_get_info()

    def check(slack: int = 8 << 20) -> None:
        import gc

        gc.collect()
        cuda.synchronize()
        after, _ = _driver.mem_get_info()
        assert before - after <= slack, f"device memory leaked: {(before - after) / 2**20:.1f} MiB"

    return check
