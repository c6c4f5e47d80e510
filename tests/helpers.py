"""Helpers the tests share (imported as ``from helpers import ...``; fixtures live in conftest)."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["random_array", "test_seed"]


def test_seed() -> int:
    """``UMEM_TEST_SEED`` if set, else a fresh random seed."""
    env = os.environ.get("UMEM_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "little")


test_seed.__test__ = False  # type: ignore[attr-defined]  # not a test, despite its name


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
