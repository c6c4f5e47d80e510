"""Issue #27 item 2: the simulated driver's streams, events and queries behave as a GPU's do, harshly.

These build a :class:`~umem_numba._driver._simulated.SimDriver` of their own (no numba
simulator needed: copies, memsets, events and streams only), so they run in the CPU suite too:

- a destroyed stream's or event's handle is handed out again, last freed first, once the work
  queued before has run (the driver releases it then); the new stream gets a new id;
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from umem_numba._driver._simulated import SimDriver

_NOT_READY = 600


def ok(res):
    assert res[0] == 0, f"simulated driver returned {res[0]}"
    return res[1] if len(res) == 2 else res[1:]


def host(ptr: int, n: int, dtype=np.uint8) -> np.ndarray:
    """A numpy view of simulated memory (it is host memory)."""
    buf = (ctypes.c_byte * (n * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype)


@pytest.fixture
def drv() -> SimDriver:
    return SimDriver(seed_value=4321)


# ---------------------------------------------------------------------------
# Handles handed out again


def test_sim_destroyed_stream_handles_come_back_last_freed_first_with_new_ids(drv):
    a, b = ok(drv.cuStreamCreate(0)), ok(drv.cuStreamCreate(1))
    ids = {ok(drv.cuStreamGetId(a)), ok(drv.cuStreamGetId(b))}
    ok((*drv.cuStreamDestroy(a), None))
    ok((*drv.cuStreamDestroy(b), None))
    assert drv.cuStreamGetId(a)[0] != 0, "a destroyed stream's handle names no stream"
    c = ok(drv.cuStreamCreateWithPriority(0, -1))
    d = ok(drv.cuStreamCreate(0))
    assert (c, d) == (b, a), "the driver hands out the last freed handle first"
    new_ids = {ok(drv.cuStreamGetId(c)), ok(drv.cuStreamGetId(d))}
    assert not new_ids & ids, "stream ids are never reused"
    assert ok(drv.cuStreamGetFlags(c)) == 0 and ok(drv.cuStreamGetPriority(c)) == -1, "the new stream's own flags"
    # Other tables do not reuse: a pool handle is new.
    props = drv.CUmemPoolProps()
    props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    ok((*drv.cuStreamDestroy(c), None))
    assert ok(drv.cuMemPoolCreate(props)) != c


def test_sim_destroyed_stream_handle_is_free_once_its_work_has_run(drv):
    """Its queued work still runs when needed, on the old stream; only then is the handle reused."""
    n = 256
    mem = ok(drv.cuMemAlloc(n))
    s = ok(drv.cuStreamCreate(1))
    old_id = ok(drv.cuStreamGetId(s))
    drv.cuMemsetD8Async(mem, 7, n, s)
    ok((*drv.cuStreamDestroy(s), None))
    other = ok(drv.cuStreamCreate(1))
    assert other != s, "the handle of a stream whose work is queued was handed out (the driver keeps it)"
    assert not host(mem, n).any(), "destroying a stream ran its work"
    drv.cuMemsetD8Async(mem, 9, n, other)
    ok((*drv.cuStreamSynchronize(other), None))  # the destroyed stream's memset is not ordered with it
    assert (host(mem, n) == 9).all()
    ok((*drv.cuCtxSynchronize(), None))
    assert (host(mem, n) == 7).all(), "the destroyed stream's work ran when needed, after the unordered one"
    again = ok(drv.cuStreamCreate(1))
    assert again == s and ok(drv.cuStreamGetId(again)) != old_id
    drv.cuMemsetD8Async(mem, 3, n, again)
    ok((*drv.cuStreamSynchronize(again), None))
    assert (host(mem, n) == 3).all()


def test_sim_destroyed_event_handle_is_free_once_its_record_has_run(drv):
    n = 64
    mem = ok(drv.cuMemAlloc(n))
    s = ok(drv.cuStreamCreate(0))
    idle = ok(drv.cuEventCreate(2))
    ok((*drv.cuEventDestroy(idle), None))
    assert ok(drv.cuEventCreate(2)) == idle, "a never-recorded event's handle is free at once"
    ev = ok(drv.cuEventCreate(2))
    drv.cuMemsetD8Async(mem, 5, n, s)
    ok((*drv.cuEventRecord(ev, s), None))
    ok((*drv.cuEventDestroy(ev), None))
    assert drv.cuEventQuery(ev)[0] != 0, "a destroyed event's handle names no event"
    assert ok(drv.cuEventCreate(2)) != ev, "the handle of an event whose record is queued was handed out"
    ok((*drv.cuStreamSynchronize(s), None))
    again = ok(drv.cuEventCreate(2))
    assert again == ev
    assert drv.cuEventQuery(again)[0] == 0, "the new event is a new one: never recorded, so complete"
