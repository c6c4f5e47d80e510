"""Shared fixtures: GPU gating, fresh random data, leak checks (helpers live in ``helpers.py``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import test_seed

from umem_numba import _driver, _sim

#: Under numba's simulator: why a GPU test that is not marked ``sim`` is skipped.
SIM_SKIP = "reads driver state or needs real device memory: needs a real GPU (not marked `sim`)"


def _gpu_reason() -> str:
    return _driver.unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _sim.active():
        # numba's CUDA simulator: the GPU tests marked `sim` run on host-backed buffers.
        for item in items:
            if "multigpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs 2 GPUs; numba's simulator has one device"))
            elif "gpu" in item.keywords and "sim" not in item.keywords and not os.environ.get("UMEM_SIM_ALL"):
                item.add_marker(pytest.mark.skip(reason=SIM_SKIP))
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


@pytest.fixture
def device_memory():
    """Assert that a test gives back the device memory it took (cuMemGetInfo)."""
    from numba import cuda

    if _sim.active():
        pytest.skip("cuMemGetInfo: needs a real GPU")

    cuda.synchronize()
    before, _ = _driver.mem_get_info()

    def check(slack: int = 8 << 20) -> None:
        import gc

        gc.collect()
        cuda.synchronize()
        after, _ = _driver.mem_get_info()
        assert before - after <= slack, f"device memory leaked: {(before - after) / 2**20:.1f} MiB"

    return check
