"""Fixtures of the memory tests."""

from __future__ import annotations

import pytest

import umem_numba as um


@pytest.fixture
def cache_on():
    """The allocation cache on and empty for the test (the suite's conftest turns it off), as before after."""
    before = um.get_allocation_cache()
    um.set_allocation_cache(True)
    um.release_allocation_cache()
    yield
    um.release_allocation_cache()
    um.set_allocation_cache(before)
