"""Shared fixtures: GPU gating, fresh random data, leak checks."""

from __future__ import annotations

import os

import numpy as np
import pytest

import umem_numba
from umem_numba import _driver


def _gpu_reason() -> str:
    return _driver.unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
def rng() -> np.random.Generator:
    """A generator with a fresh seed per test (printed on failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)


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


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random, never-zero data of any numeric dtype."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return (rng.random(shape) + 0.5).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(1, 100, size=shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.random(shape) + 0.5 + 1j * rng.random(shape)).astype(dtype)
    raise TypeError(dtype)
