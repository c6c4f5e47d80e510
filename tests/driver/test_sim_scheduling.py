"""Issue #27 item 2: the simulated driver's streams, events and queries behave as a GPU's do, harshly.

These build a :class:`~umem_numba._driver._simulated.SimDriver` of their own (no numba
simulator needed: copies, memsets, events and streams only), so they run in the CPU suite too:

- a destroyed stream's or event's handle is handed out again, last freed first, once the work
  queued before has run (the driver releases it then); the new stream gets a new id;
- with a spread (``reseed(seed, spread=...)``), independent streams run ahead: a synchronisation
  also runs work that nothing it waits for needs, so a writer can overtake a reader queued
  earlier on another stream when nothing orders them;
- a query answers from what has run (not from a count of polls), and each query that answers
  "not ready" lets one operation run (time passes), picked as a synchronisation of that work
  picks its next one, so polling finishes;
- non-blocking streams (``cuStreamCreate(CU_STREAM_NON_BLOCKING)``) keep the rules: the legacy
  stream does not order them, either way, and a missing wait between two of them is a stale read.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from umem_numba._driver._simulated import SimDriver, tracing

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


# ---------------------------------------------------------------------------
# Independent streams run ahead


def _reader_then_unordered_writer(seed: int, spread: float) -> tuple[bool, np.ndarray]:
    """A copy reads ``x`` on stream A, a memset writes ``x`` on stream B (not ordered after it), then
    a synchronisation of a third stream's own work, then of A.

    Returns whether the writer ran during the third stream's synchronisation, before the reader,
    and what the reader copied.
    """
    n = 256
    drv = SimDriver(seed_value=seed)
    drv.reseed(seed, spread=spread)
    x, y, z = (ok(drv.cuMemAlloc(n)) for _ in range(3))
    host(x, n)[:] = 1  # no work queued yet: the host writes device memory directly
    a, b, c = (ok(drv.cuStreamCreate(1)) for _ in range(3))
    sid_a, sid_b = ok(drv.cuStreamGetId(a)), ok(drv.cuStreamGetId(b))
    drv.cuMemcpyAsync(y, x, n, a)  # the reader, queued first
    drv.cuMemsetD8Async(x, 2, n, b)  # the writer: nothing orders it after the reader
    drv.cuMemsetD8Async(z, 3, n, c)
    with tracing(drv) as trace:
        ok((*drv.cuStreamSynchronize(c), None))
    ran = [sid for sid, _ in trace]
    overtook = sid_b in ran and (sid_a not in ran or ran.index(sid_b) < ran.index(sid_a))
    if spread == 0.0:
        assert ran == [ok(drv.cuStreamGetId(c))], f"seed {seed}: with no spread only the awaited work runs"
    ok((*drv.cuStreamSynchronize(a), None))
    got = host(y, n).copy()
    ok((*drv.cuCtxSynchronize(), None))
    return overtook, got


def test_sim_with_a_spread_an_unordered_writer_overtakes_an_earlier_reader():
    overtakes = 0
    for seed in range(12):
        overtook, got = _reader_then_unordered_writer(seed, 0.5)
        if overtook:
            overtakes += 1
            assert (got == 2).all(), f"seed {seed}: the writer ran first, yet the reader did not see its value"
        else:
            assert (got == 1).all() or (got == 2).all()
    assert overtakes, "with spread 0.5 the unordered writer never ran ahead of the reader in 12 seeds"


def test_sim_without_a_spread_unawaited_work_never_runs_early():
    for seed in range(12):
        overtook, got = _reader_then_unordered_writer(seed, 0.0)
        assert not overtook
        assert (got == 1).all(), f"seed {seed}: the reader saw the unordered writer's value"


def test_sim_spread_is_a_probability():
    drv = SimDriver(seed_value=1)
    with pytest.raises(ValueError, match="probability"):
        drv.reseed(1, spread=1.5)


# ---------------------------------------------------------------------------
# Queries answer by what has run


def test_sim_event_query_answers_by_what_has_run_and_polling_finishes(drv):
    n = 64
    mem, other = ok(drv.cuMemAlloc(n)), ok(drv.cuMemAlloc(n))
    s, busy = ok(drv.cuStreamCreate(1)), ok(drv.cuStreamCreate(1))
    ev = ok(drv.cuEventCreate(2))
    for v in range(1, 6):
        drv.cuMemsetD8Async(mem, v, n, s)
        drv.cuMemsetD8Async(other, v, n, busy)  # work no one polls for
    ok((*drv.cuEventRecord(ev, s), None))
    polls = 0
    while True:
        ran = (host(mem, n) == 5).all()  # the last memset before the record
        answer = drv.cuEventQuery(ev)[0]
        polls += 1
        if not ran:
            assert answer == _NOT_READY, f"poll {polls}: done, yet the recorded work had not run"
        if answer == 0:
            break
        assert answer == _NOT_READY
        assert polls <= 12, "polling did not finish: each poll should let one needed operation run"
    assert polls == 7, f"{polls} polls: each poll that answers not ready runs one of the 6 operations needed"
    assert (host(mem, n) == 5).all()
    assert not host(other, n).any(), "work no one waits for ran while the host polled (no spread)"
    assert drv.cuEventQuery(ev)[0] == 0, "done stays done"


def test_sim_query_of_work_that_has_run_is_done_without_a_poll(drv):
    n = 64
    mem = ok(drv.cuMemAlloc(n))
    s = ok(drv.cuStreamCreate(0))
    ev = ok(drv.cuEventCreate(2))
    assert drv.cuEventQuery(ev)[0] == 0, "an event never recorded is complete"
    drv.cuMemsetD8Async(mem, 4, n, s)
    ok((*drv.cuEventRecord(ev, s), None))
    assert drv.cuStreamQuery(s)[0] == _NOT_READY
    ok((*drv.cuStreamSynchronize(s), None))
    assert drv.cuStreamQuery(s)[0] == 0 and drv.cuEventQuery(ev)[0] == 0


def test_sim_each_poll_runs_one_operation_the_polled_work_needs_or_with_the_spread_another():
    """A poll of unfinished work runs one operation, picked as a synchronisation picks its next one.

    With no spread it is one the polled work needs (work no one waits for runs as late as
    possible): polling the last of three dependent operations takes four polls, whatever the
    seed.  With a spread, other streams' ready work runs now and then too: more polls, varying.
    """
    n = 64

    def polls(seed: int, spread: float) -> tuple[int, bool]:
        drv = SimDriver(seed_value=seed)
        drv.reseed(seed, spread=spread)
        mem, other = ok(drv.cuMemAlloc(n)), ok(drv.cuMemAlloc(n))
        s, s2, busy = (ok(drv.cuStreamCreate(1)) for _ in range(3))
        ev = ok(drv.cuEventCreate(2))
        for v in range(1, 4):
            drv.cuMemsetD8Async(other, v, n, busy)  # nothing polled waits for these
        drv.cuMemsetD8Async(mem, 1, n, s2)
        ok((*drv.cuEventRecord(ev, s2), None))
        ok((*drv.cuStreamWaitEvent(s, ev, 0), None))
        drv.cuMemsetD8Async(mem, 2, n, s)  # needs: the memset and record on s2, the wait on s
        count = 1
        while drv.cuStreamQuery(s)[0] == _NOT_READY:
            count += 1
            assert count <= 10, f"seed {seed}: polling did not finish"
        assert (host(mem, n) == 2).all()
        return count, bool(host(other, n).any())

    for seed in range(8):
        count, unrelated = polls(seed, 0.0)
        assert count == 5, f"seed {seed}: {count} polls for 4 needed operations"
        assert not unrelated, f"seed {seed}: work no one waits for ran during polling with no spread"
    spread = [polls(seed, 0.5) for seed in range(8)]
    assert any(unrelated for _, unrelated in spread), "with a spread, other streams' work never ran while polling"
    assert len({count for count, _ in spread}) > 1


# ---------------------------------------------------------------------------
# Non-blocking streams


def test_sim_legacy_stream_does_not_order_non_blocking_streams_either_way():
    """Legacy work queued before a non-blocking stream's reader is not run for it; a blocking stream's is."""
    n = 128
    for seed in range(6):
        drv = SimDriver(seed_value=seed)
        x, y_blocking, y_non_blocking = (ok(drv.cuMemAlloc(n)) for _ in range(3))
        blocking, non_blocking = ok(drv.cuStreamCreate(0)), ok(drv.cuStreamCreate(1))
        drv.cuMemsetD8Async(x, 5, n, 0)  # legacy stream
        drv.cuMemcpyAsync(y_non_blocking, x, n, non_blocking)
        drv.cuMemcpyAsync(y_blocking, x, n, blocking)
        ok((*drv.cuStreamSynchronize(non_blocking), None))
        assert not host(y_non_blocking, n).any(), f"seed {seed}: the legacy stream ordered a non-blocking stream"
        assert not host(x, n).any(), f"seed {seed}: the legacy stream's work ran for a non-blocking stream"
        ok((*drv.cuStreamSynchronize(blocking), None))
        assert (host(y_blocking, n) == 5).all(), f"seed {seed}: a blocking stream ran before earlier legacy work"
        # The other way: legacy work does not wait for a non-blocking stream's earlier work.
        drv.cuMemsetD8Async(x, 9, n, non_blocking)
        drv.cuMemcpyAsync(y_blocking, x, n, 0)
        ok((*drv.cuStreamSynchronize(0), None))
        assert (host(y_blocking, n) == 5).all(), f"seed {seed}: legacy work waited for a non-blocking stream"
        ok((*drv.cuCtxSynchronize(), None))
        assert (host(x, n) == 9).all()


def test_sim_missing_wait_between_non_blocking_streams_is_a_stale_read_and_the_wait_fixes_it():
    n = 128
    for seed in range(6):
        drv = SimDriver(seed_value=seed)
        x, y = ok(drv.cuMemAlloc(n)), ok(drv.cuMemAlloc(n))
        writer, reader = ok(drv.cuStreamCreate(1)), ok(drv.cuStreamCreate(1))
        ev = ok(drv.cuEventCreate(2))
        drv.cuMemsetD8Async(x, 3, n, writer)
        drv.cuMemcpyAsync(y, x, n, reader)  # no wait: the bug
        ok((*drv.cuStreamSynchronize(reader), None))
        assert not host(y, n).any(), f"seed {seed}: the reader saw a write nothing ordered before it"
        drv.cuMemsetD8Async(x, 4, n, writer)
        ok((*drv.cuEventRecord(ev, writer), None))
        ok((*drv.cuStreamWaitEvent(reader, ev, 0), None))
        drv.cuMemcpyAsync(y, x, n, reader)
        ok((*drv.cuStreamSynchronize(reader), None))
        assert (host(y, n) == 4).all(), f"seed {seed}: the wait did not order the reader after the writer"
