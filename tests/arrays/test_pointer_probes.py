"""A correct program makes no driver call fail (issue #30 item 9).

compute-sanitizer's memcheck reports every driver call that returns an error as an error of the
program.  The copy layer and the managed-memory checks ask the driver about pointers that may be
plain (pageable) numpy memory, which the driver does not know: ``cuPointerGetAttribute`` answers
that with ``CUDA_ERROR_INVALID_VALUE`` (two "errors" in a correct ``heat2d.py --memory vmm`` run);
``cuPointerGetAttributes`` answers it with ``CUDA_SUCCESS`` and NULL values.  These tests record
every driver call the operations make and demand that none failed, on the simulated driver (which
answers those calls as the driver does) and on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.helpers import random_array

import umem_numba as um
from umem_numba import _driver

#: Results that are answers, not errors (a query of unfinished work); memcheck does not report them.
_ANSWERS = {0, 600}  # CUDA_SUCCESS, CUDA_ERROR_NOT_READY


@pytest.fixture
def failed_calls(monkeypatch):
    """Every driver call made through the binding from now on that returns an error: ``[(name, CUresult)]``."""
    drv = _driver.api().drv
    failed: list[tuple[str, int]] = []

    def recording(name, call):
        def wrapper(*args, **kwargs):
            res = call(*args, **kwargs)
            err = res[0] if isinstance(res, tuple) and res else None
            if err is not None and int(err) not in _ANSWERS:
                failed.append((name, int(err)))
            return res

        return wrapper

    for name in dir(drv):
        if name.startswith("cu") and callable(getattr(drv, name)):
            monkeypatch.setattr(drv, name, recording(name, getattr(drv, name)))
    return failed


def _make(kind, data):
    return {
        "managed": um.ManagedBuffer.from_array,
        "pinned": um.PinnedBuffer.from_array,
        "vmm": um.VMMBuffer.from_array,
        "device": um.DeviceBuffer.from_array,
    }[kind](data)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["managed", "pinned", "vmm", "device"])
def test_copies_of_pageable_numpy_memory_make_no_driver_call_fail(kind, rng, failed_calls):
    data = random_array(rng, (37, 41), np.float32)
    again = random_array(rng, (37, 41), np.float32)
    buf = _make(kind, data)  # from_array: a copy from pageable memory
    try:
        np.testing.assert_array_equal(buf.copy_to_host(), data)
        buf.copy_from_host(again)  # asks whether `again` is memory the driver knows
        out = np.empty_like(again)
        buf.copy_to_host(out, staging=True)  # through the staging slots: asks about `out`
        np.testing.assert_array_equal(out, again)
        assert failed_calls == [], f"driver calls that failed (memcheck reports each): {failed_calls}"
    finally:
        buf.close()


class _HostArray:
    """A CUDA Array Interface over plain numpy memory (which no GPU can reach): not managed memory."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (array.ctypes.data, False),
            "version": 3,
            "strides": None,
        }


@pytest.mark.gpu
def test_prefetch_of_memory_the_driver_does_not_know_says_so_and_makes_no_driver_call_fail(rng, failed_calls):
    foreign = _HostArray(random_array(rng, 1024, np.float32))
    with pytest.raises(um.UnsupportedError, match="not managed memory"):
        um.PrefetchPlan().add(foreign, 0)
    assert failed_calls == [], f"driver calls that failed (memcheck reports each): {failed_calls}"
    with um.ManagedBuffer.from_array(random_array(rng, 1024, np.float32)) as buf:
        um.PrefetchPlan().add(buf, 0)  # managed memory: recognised, no failed call either
    assert failed_calls == [], f"driver calls that failed (memcheck reports each): {failed_calls}"


@pytest.mark.gpu
def test_pointer_attributes_answer_for_every_kind_of_memory(rng):
    """``cuPointerGetAttributes`` as umem_numba asks it: the simulated driver's answers are the driver's."""
    api = _driver.api()
    attrs = [api.c.pointer_is_managed, api.c.pointer_memory_type]
    plain = random_array(rng, 256, np.float32)
    err, values = api.drv.cuPointerGetAttributes(len(attrs), attrs, plain.ctypes.data)
    assert int(err) == 0 and [int(v) for v in values] == [0, 0]  # unknown memory: no error, NULL values
    with um.ManagedBuffer.empty(256, np.float32) as managed, um.PinnedBuffer.empty(256, np.float32) as pinned:
        err, values = api.drv.cuPointerGetAttributes(len(attrs), attrs, managed.ptr)
        assert int(err) == 0 and int(values[0]) == 1
        err, values = api.drv.cuPointerGetAttributes(len(attrs), attrs, pinned.ptr)
        assert int(err) == 0 and int(values[0]) == 0 and int(values[1]) == api.c.memorytype_host
