"""Issue #19, the copy layer's fast paths: staging slots under every coherence policy (item 2),
the copier-thread setting (item 4), host sources the driver knows (item 6), and refused
operations that must leave a graph capture intact (item 10).

Ordering tests put a kernel that sleeps on the device in front of the copy, so that a
missing wait shows as a wrong value, and run :data:`helpers.ORDERING_TRIALS` trials."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from numba import cuda
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._arrays import _copy
from umem_numba._driver._location import stream_handle

#: Device time of each sleeping kernel: the copies behind it stay queued that long.
SLEEP_MS = 30
#: Elements of each copy: one staging slot, so that the whole copy is still queued at return.
N = 1 << 16

POLICIES = ("sync", "raise", "warn", "off")


def _sleep(stream, dummy) -> None:
    """Queue about SLEEP_MS of device time on ``stream`` (a plain numba kernel on a numba array)."""
    sleeping.fill[1, 1, stream](dummy, 0.0, SLEEP_MS)


# ---------------------------------------------------------------------------
# Item 2: the internal staging area always waits for its own DMA


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", POLICIES)
def test_staged_uploads_never_refill_slots_the_copy_engine_still_reads(policy, rng):
    """Issue #19 item 2: two staged uploads behind a sleeping kernel, under every coherence policy.

    The first upload's DMA is still queued when the second one starts: its slot must not be
    refilled until that DMA has run.  Today the staging area's tracker takes the user's policy:
    under "off" and "warn" the second upload overwrites the slot (the first destination gets
    the second's data), under "raise" it raises a CoherenceError about the internal buffer,
    under "warn" it warns about it.  Both destinations must hold their own data, and no
    warning or error may mention the internal staging area.
    """
    dummy = cuda.device_array(1, np.float32)
    s = cuda.stream()
    a = um.DeviceBuffer.empty(N, np.float32)
    b = um.DeviceBuffer.empty(N, np.float32)
    try:
        for trial in range(ORDERING_TRIALS):
            first = random_array(rng, N, np.float32)
            second = random_array(rng, N, np.float32) + 2.0  # never equal to first
            with warnings.catch_warnings(record=True) as caught, um.coherence_policy(policy):
                warnings.simplefilter("always")
                _sleep(s, dummy)
                a.copy_from_host(first, stream=s, staging=True)
                b.copy_from_host(second, stream=s, staging=True)
            coherence = [w for w in caught if issubclass(w.category, um.CoherenceWarning)]
            assert not coherence, f"trial {trial}: a warning about the internal staging area: {coherence[0].message}"
            np.testing.assert_array_equal(a.copy_to_host(stream=s), first, err_msg=f"trial {trial}: a")
            np.testing.assert_array_equal(b.copy_to_host(stream=s), second, err_msg=f"trial {trial}: b")
    finally:
        a.close()
        b.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", POLICIES)
def test_staged_download_after_a_pending_staged_upload_on_another_stream(policy, rng):
    """Issue #19 item 2 (the reverse direction): a staged upload queued behind a sleeping kernel on s1,
    then a staged download on s2 through the same slots, under every coherence policy.

    The download's DMA must wait (on the device) for the upload's DMA that still reads the
    slot, and its copier thread must wait for its own DMA before reading the slot: the upload's
    destination holds the upload's data and the download returns the other buffer's data.
    """
    dummy = cuda.device_array(1, np.float32)
    s1, s2 = cuda.stream(), cuda.stream()
    a = um.DeviceBuffer.empty(N, np.float32)
    c = um.DeviceBuffer.empty(N, np.float32)
    try:
        for trial in range(ORDERING_TRIALS):
            up = random_array(rng, N, np.float32)
            other = random_array(rng, N, np.float32) + 2.0
            c.copy_from_host(other, stream=s2)
            c.synchronize()
            with um.coherence_policy(policy):
                _sleep(s1, dummy)
                a.copy_from_host(up, stream=s1, staging=True)
                down = c.copy_to_host(stream=s2, staging=True)
            np.testing.assert_array_equal(down, other, err_msg=f"trial {trial}: download")
            np.testing.assert_array_equal(a.copy_to_host(stream=s1), up, err_msg=f"trial {trial}: upload")
    finally:
        a.close()
        c.close()


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_a_failed_staged_copy_does_not_leave_the_staging_area_refusing_under_raise(rng, monkeypatch):
    """Issue #19 item 2: a staged copy that fails half way marks the staging area as used by unknown
    work; under "raise" every later staged copy then raised, for good (the mark is cleared only
    by a wait that "raise" never makes).  The staging area must wait and clear it instead."""
    buf = um.DeviceBuffer.empty(N, np.float32)
    real_run = _copy._Pipeline.run

    def failing_run(self, *args, **kwargs):
        raise RuntimeError("injected failure inside a staged copy")

    monkeypatch.setattr(_copy._Pipeline, "run", failing_run)
    with pytest.raises(RuntimeError, match="injected"):
        buf.copy_from_host(random_array(rng, N, np.float32), staging=True)
    monkeypatch.setattr(_copy._Pipeline, "run", real_run)
    buf.synchronize()  # the user's buffer: its own mark is cleared by waiting (the staging area's is not)
    try:
        for trial in range(3):
            data = random_array(rng, N, np.float32)
            with um.coherence_policy("raise"):
                buf.copy_from_host(data, staging=True)
                back = buf.copy_to_host(staging=True)
            np.testing.assert_array_equal(back, data, err_msg=f"copy {trial} after the failure")
    finally:
        buf.close()


# ---------------------------------------------------------------------------
# Item 4: UMEM_NUMBA_COPY_THREADS is read once, and checked


def _run_child(code: str, env_extra: dict[str, str], timeout: int = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_changing_copy_threads_after_the_first_staged_copy_does_not_crash(rng):
    """Issue #19 item 4: UMEM_NUMBA_COPY_THREADS=1, a 64 MiB staged copy, then 8 (and then 'abc'), copy again.

    Today the staging area is sized for one thread (two 8 MiB slots) but every copy re-reads
    the variable: the second copy uses sixteen slots of a two-slot area and the process dies
    with SIGSEGV.  The child must exit 0 with every value right and nothing on stderr.
    """
    seed = int(rng.integers(1 << 31))
    code = f"""
        import os
        import numpy as np
        import umem_numba as um

        rng = np.random.default_rng({seed})
        n = 16 << 20  # float32: 64 MiB, eight 8 MiB chunks
        buf = um.DeviceBuffer.empty(n, np.float32)
        for setting in ("1", "8", "abc", "100000"):
            os.environ["UMEM_NUMBA_COPY_THREADS"] = setting
            data = rng.random(n, dtype=np.float32)
            buf.copy_from_host(data, staging=True)
            back = buf.copy_to_host(staging=True)
            assert np.array_equal(back, data), f"wrong values after setting {{setting!r}}"
            managed = um.ManagedBuffer.empty(n, np.float32)
            managed.copy_from_host(data[::-1], staging=True)
            assert np.array_equal(managed.copy_to_host(staging=True), data[::-1]), setting
            managed.close()
        buf.close()
        print("ok")
    """
    out = _run_child(code, {"UMEM_NUMBA_COPY_THREADS": "1"})
    assert out.returncode == 0, f"exit status {out.returncode}\nstdout: {out.stdout}\nstderr: {out.stderr}"
    assert out.stdout.strip() == "ok"
    assert not out.stderr.strip(), out.stderr


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["0", "-3", "abc", "100000"])
def test_a_bad_copy_threads_setting_is_refused_by_the_first_staged_copy(setting):
    """Issue #19 item 4: a bad UMEM_NUMBA_COPY_THREADS makes the first staged copy raise a ValueError
    that names the variable and the valid range (today '100000' asks for 1.6 TB of pinned
    staging memory), and the process stays usable: an unstaged copy still works."""
    code = f"""
        import numpy as np
        import umem_numba as um

        buf = um.DeviceBuffer.empty(1 << 10, np.float32)
        data = np.arange(1 << 10, dtype=np.float32)
        try:
            buf.copy_from_host(data, staging=True)
        except ValueError as exc:
            print(exc)
        else:
            raise SystemExit("no error for UMEM_NUMBA_COPY_THREADS={setting}")
        buf.copy_from_host(data, staging=False)
        assert np.array_equal(buf.copy_to_host(staging=False), data)
        buf.close()
    """
    out = _run_child(code, {"UMEM_NUMBA_COPY_THREADS": setting})
    assert out.returncode == 0, f"exit status {out.returncode}\nstdout: {out.stdout}\nstderr: {out.stderr}"
    assert "UMEM_NUMBA_COPY_THREADS" in out.stdout and f"1 to {_copy.MAX_COPY_THREADS}" in out.stdout, out.stdout
    assert repr(setting) in out.stdout, out.stdout


@pytest.mark.parametrize("setting", ["0", "-3", "abc", "100000", "2.5", "65", " "])
def test_copy_threads_setting_outside_the_valid_range_is_refused(setting, monkeypatch):
    """Issue #19 item 4: bad values get a ValueError naming the variable, the value and the range (CPU)."""
    monkeypatch.setenv("UMEM_NUMBA_COPY_THREADS", setting)
    if not setting.strip():  # blank means unset: the default
        assert 1 <= _copy.copier_threads() <= 8
        return
    with pytest.raises(ValueError) as info:
        _copy.copier_threads()
    message = str(info.value)
    assert "UMEM_NUMBA_COPY_THREADS" in message
    assert f"1 to {_copy.MAX_COPY_THREADS}" in message
    assert repr(setting.strip()) in message


def test_copy_threads_setting_accepts_the_whole_valid_range(monkeypatch):
    """Issue #19 item 4: 1 and the maximum are valid, surrounding spaces are ignored (CPU)."""
    for value in (1, 8, _copy.MAX_COPY_THREADS):
        monkeypatch.setenv("UMEM_NUMBA_COPY_THREADS", f" {value} ")
        assert _copy.copier_threads() == value


def test_copy_threads_setting_is_read_once(monkeypatch):
    """Issue #19 item 4: the copier threads keep the count read when they started; later changes
    (even bad values) are ignored, so the staging area sized from it stays consistent (CPU)."""
    monkeypatch.setattr(_copy, "_copiers", None)
    monkeypatch.setenv("UMEM_NUMBA_COPY_THREADS", "1")
    first = _copy._copier_pool()
    assert first.threads == 1
    for later in ("8", "abc", "0", "100000"):
        monkeypatch.setenv("UMEM_NUMBA_COPY_THREADS", later)
        assert _copy._copier_pool() is first
        assert first.threads == 1


def test_a_bad_copy_threads_setting_is_refused_before_any_driver_call(monkeypatch):
    """Issue #19 item 4: a staged copy checks the setting before it calls the driver (CPU: a
    driver call would raise CudaUnavailableError here instead of the ValueError)."""
    monkeypatch.setattr(_copy, "_copiers", None)
    monkeypatch.setenv("UMEM_NUMBA_COPY_THREADS", "abc")
    side = _copy.Side(1 << 20, (N,), np.dtype(np.float32), True, None, 0, True, None, "device")
    with pytest.raises(ValueError, match="UMEM_NUMBA_COPY_THREADS"):
        _copy.from_host(side, np.ones(N, np.float32), None, True)
    with pytest.raises(ValueError, match="UMEM_NUMBA_COPY_THREADS"):
        _copy.to_host(side, None, None, True)


def test_user_staging_slots_fit_the_staging_buffer():
    """Issue #19 item 4: slots cut from a user's staging buffer never pass its end, whatever the
    thread count (CPU: pure arithmetic)."""
    for nbytes in (2, 3, 4096, 3 * 4096 + 8, 1 << 16, (1 << 20) + 5, 64 << 20):
        for threads in (1, 3, 8, _copy.MAX_COPY_THREADS):
            count, size = _copy._user_slots(nbytes, threads)
            assert count >= 2 and size >= 1
            assert count * size <= nbytes, (nbytes, threads, count, size)


# ---------------------------------------------------------------------------
# Item 6: a host source the driver knows (managed, pinned) has been read on return


def _host_source(kind: str, data: np.ndarray):
    """``(owner, numpy view)``: a numpy array over managed or pinned memory holding ``data``."""
    if kind == "managed":
        owner = um.ManagedBuffer.from_array(data)
        return owner, owner.host
    if kind == "pinned":
        owner = um.PinnedBuffer.from_array(data)
        return owner, owner.host
    view = cuda.pinned_array(data.shape, data.dtype)  # numba's pinned numpy array
    view[:] = data
    return None, view


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("staging", [None, False, True])
@pytest.mark.parametrize("kind", ["managed", "pinned", "numba-pinned"])
def test_copy_from_host_has_read_a_managed_or_pinned_source_when_it_returns(kind, staging, rng):
    """Issue #19 item 6: ``b.copy_from_host(h)`` where ``h`` is a numpy array over managed or pinned
    memory, queued behind a sleeping kernel, then ``h[:] = 0`` right after the call returns.

    The docstring promises that a host source has been read when the call returns.  Today
    such memory is not pageable, so the copy is a truly asynchronous cuMemcpyAsync that reads
    ``h`` after the kernel: ``b`` receives the zeros.
    """
    dummy = cuda.device_array(1, np.float32)
    s = cuda.stream()
    b = um.DeviceBuffer.empty(N, np.float32)
    try:
        for trial in range(ORDERING_TRIALS):
            data = random_array(rng, N, np.float32)
            owner, h = _host_source(kind, data)
            _sleep(s, dummy)
            b.copy_from_host(h, stream=s, staging=staging)
            h[:] = 0
            np.testing.assert_array_equal(b.copy_to_host(stream=s), data, err_msg=f"trial {trial}")
            del owner, h  # the view keeps the memory; both go together
    finally:
        b.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_copy_from_host_into_managed_memory_from_a_managed_view(rng):
    """Issue #19 item 6: the same with a managed destination (prefetched, then written by DMA) and a
    view of another managed buffer as the source: the source has been read on return."""
    dummy = cuda.device_array(1, np.float32)
    s = cuda.stream()
    dst = um.ManagedBuffer.empty(N, np.float32)
    try:
        for trial in range(ORDERING_TRIALS):
            data = random_array(rng, N, np.float32)
            src = um.ManagedBuffer.from_array(data)
            h = src.host
            _sleep(s, dummy)
            dst.copy_from_host(h, stream=s)
            h[:] = -1.0
            np.testing.assert_array_equal(dst.copy_to_host(stream=s), data, err_msg=f"trial {trial}")
            src.close()
    finally:
        dst.close()


# ---------------------------------------------------------------------------
# Item 10: a refused operation leaves the user's graph capture intact


def _capture_ops():
    """``{name: op(stream, objects)}``: every operation that refuses a capturing stream."""
    return {
        "copy_from_host-managed": lambda s, o: o["managed"].copy_from_host(o["data"], stream=s),
        "copy_from_host-managed-staged": lambda s, o: o["managed"].copy_from_host(o["data"], stream=s, staging=True),
        "copy_from_host-device": lambda s, o: o["device"].copy_from_host(o["data"], stream=s),
        "copy_from_host-device-staged": lambda s, o: o["device"].copy_from_host(o["data"], stream=s, staging=True),
        "copy_from_host-pinned-source": lambda s, o: o["device"].copy_from_host(o["pinned_view"], stream=s),
        "copy_from_host-buffer": lambda s, o: o["device"].copy_from_host(o["managed"], stream=s),
        "copy_to_host": lambda s, o: o["device"].copy_to_host(stream=s),
        "copy_to_host-staged": lambda s, o: o["managed"].copy_to_host(stream=s, staging=True),
        "copy_to_host-pinned": lambda s, o: o["device"].copy_to_host(out=o["pinned"], stream=s),
        "copy": lambda s, o: um.copy(o["device"], o["managed"], stream=s),
        "DeviceBuffer.zeros": lambda s, o: um.DeviceBuffer.zeros(N, np.float32, stream=s),
        "DeviceBuffer.from_array": lambda s, o: um.DeviceBuffer.from_array(o["data"], stream=s),
        "ManagedBuffer.zeros": lambda s, o: um.ManagedBuffer.zeros(N, np.float32, stream=s),
        "VMMBuffer.zeros": lambda s, o: um.VMMBuffer.zeros(N, np.float32, stream=s),
        "prefetch": lambda s, o: o["managed"].prefetch(0, s),
        "prefetch_range": lambda s, o: o["managed"].prefetch_range(0, N // 2, "cpu", s),
        "PrefetchPlan.execute": lambda s, o: o["plan"].execute(s),
    }


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["GLOBAL", "RELAXED"])
@pytest.mark.parametrize("op", list(_capture_ops()))
def test_refused_operation_leaves_the_graph_capture_intact(op, mode, rng):
    """Issue #19 item 10: begin a capture on a numba stream, call an operation that refuses capture,
    expect CoherenceError, then end the capture: it must succeed with an empty graph.

    Today ``copy_from_host`` into managed memory issues ``cuMemPrefetchAsync`` (and the zeros
    constructors allocate, some on the stream) before the capture check, which invalidates
    the capture (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED at cuStreamEndCapture) or adds nodes
    to the user's graph.
    """
    if op.startswith(("prefetch", "PrefetchPlan")) and not cuda.get_current_device().CONCURRENT_MANAGED_ACCESS:
        pytest.skip("prefetch needs concurrentManagedAccess")
    data = random_array(rng, N, np.float32)
    objects = {
        "data": data,
        "managed": um.ManagedBuffer.from_array(data),
        "managed2": um.ManagedBuffer.from_array(data),
        "device": um.DeviceBuffer.from_array(data),
        "pinned": um.PinnedBuffer.from_array(data),
    }
    objects["pinned_view"] = objects["pinned"].host  # taken before the capture
    if op == "PrefetchPlan.execute":  # built (and validated) before the capture
        objects["plan"] = um.PrefetchPlan().add(objects["managed"], 0).add(objects["managed2"], 0)
    for o in objects.values():
        if hasattr(o, "synchronize"):
            o.synchronize()
    cuda.synchronize()
    drv = _driver.api().drv
    s = cuda.stream()
    h = stream_handle(s)
    run = _capture_ops()[op]
    # A finalizer freeing memory inside the window would break a global-mode capture
    # for a reason that is not the operation's: collect first, and not during it.
    gc.collect()
    gc.disable()
    try:
        _driver.call("cuStreamBeginCapture", h, getattr(drv.CUstreamCaptureMode, f"CU_STREAM_CAPTURE_MODE_{mode}"))
        try:
            with pytest.raises(um.CoherenceError, match="capturing a CUDA graph"):
                run(s, objects)
        finally:
            err, graph = drv.cuStreamEndCapture(h)
    finally:
        gc.enable()
    assert int(err) == 0, f"the capture was broken: cuStreamEndCapture returned {drv.CUresult(err).name}"
    try:
        res = drv.cuGraphGetNodes(graph)
        assert int(res[0]) == 0
        assert int(res[-1]) == 0, f"the refused {op} left {int(res[-1])} node(s) in the user's graph"
    finally:
        _driver.call("cuGraphDestroy", graph)
    # Nothing was left half done: the buffers still work and hold their data.
    for name in ("managed", "device", "pinned"):
        np.testing.assert_array_equal(objects[name].copy_to_host(stream=s), data, err_msg=name)
    for o in objects.values():
        if hasattr(o, "close"):
            o.close()


# ---------------------------------------------------------------------------
# CPU checks of the decisions above, with the driver replaced by fakes


class _FakeApi:
    """Answers cuPointerGetAttributes like the driver for one kind of memory."""

    def __init__(self, kind: str) -> None:
        from types import SimpleNamespace

        from cuda.bindings import driver as drv

        self.c = _driver._constants(drv)
        answers = {
            "pageable": {"managed": False, "type": 0},  # unknown to the driver: NULL values, no error
            "managed": {"managed": True, "type": 2},
            "pinned": {"managed": False, "type": self.c.memorytype_host},
        }.get(kind)

        def get(count, attributes, ptr):
            assert count == len(attributes)
            if answers is None:  # a sticky error from earlier work: the answer says nothing
                return (drv.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, None)
            return (0, [answers["managed" if a == self.c.pointer_is_managed else "type"] for a in attributes])

        self.drv = SimpleNamespace(cuPointerGetAttributes=get)


@pytest.mark.parametrize(
    ("kind", "known"), [("pageable", False), ("sticky-error", False), ("managed", True), ("pinned", True)]
)
def test_host_memory_the_driver_reads_asynchronously_is_recognised(kind, known, monkeypatch):
    """Issue #19 item 6: managed and page-locked numpy memory is recognised (the copy then waits);
    pageable memory is not (memory type 0), so it keeps the staged path (CPU, fake driver answers).
    Issue #30 item 9: asked with cuPointerGetAttributes, which answers unknown memory without an error."""
    pytest.importorskip("cuda.bindings.driver")
    monkeypatch.setattr(_driver, "api", lambda: _FakeApi(kind))
    assert _copy._driver_memory(np.ones(8, np.float32)) is known
    assert _copy._driver_memory(np.ones(0, np.float32)) is False


def _record_copy_steps(monkeypatch, *, capturing: bool, known: bool) -> list[str]:
    """Replace every step of from_host/to_host by a recorder (the capture check raises when ``capturing``)."""
    import contextlib

    calls: list[str] = []

    def refuse(handle, what):
        calls.append("capture check")
        if capturing:
            raise um.CoherenceError(f"{what}: the stream is capturing a CUDA graph")

    def step(name, result=None):
        def record(*args, **kwargs):
            calls.append(name if name != "dma" else f"dma sync={kwargs.get('sync')}")
            return result

        return record

    monkeypatch.setattr(_copy, "refuse_capture", refuse)
    monkeypatch.setattr(_copy, "_driver_memory", step("memory type", known))
    monkeypatch.setattr(_copy, "_prefetch_for_write", step("prefetch"))
    monkeypatch.setattr(_copy, "_staged", step("staged"))
    monkeypatch.setattr(_copy, "_dma", step("dma"))
    monkeypatch.setattr(_copy, "_copier_pool", step("copier pool", _copy._Copiers.__new__(_copy._Copiers)))
    monkeypatch.setattr(_driver, "device_context", contextlib.nullcontext)
    return calls


def _device_side() -> _copy.Side:
    return _copy.Side(1 << 20, (N,), np.dtype(np.float32), True, None, 0, True, None, "managed")


@pytest.mark.parametrize("staging", [None, True, False])
def test_a_capturing_stream_is_refused_before_any_work_on_it(staging, monkeypatch):
    """Issue #19 item 10: copy_from_host / copy_to_host check for a capture before the prefetch,
    the memory-type query, the staging and the copy (CPU, every step replaced by a recorder)."""
    calls = _record_copy_steps(monkeypatch, capturing=True, known=False)
    with pytest.raises(um.CoherenceError, match="capturing"):
        _copy.from_host(_device_side(), np.ones(N, np.float32), 7, staging)
    assert [c for c in calls if c != "copier pool"] == ["capture check"], calls
    calls.clear()
    with pytest.raises(um.CoherenceError, match="capturing"):
        _copy.to_host(_device_side(), None, 7, staging)
    assert [c for c in calls if c != "copier pool"] == ["capture check"], calls


@pytest.mark.parametrize(
    ("known", "staging", "expected"),
    [
        (True, None, "dma sync=True"),
        (True, True, "dma sync=True"),
        (True, False, "dma sync=True"),
        (False, True, "staged"),
        (False, False, "dma sync=False"),
        (False, None, "dma sync=False"),  # below STAGE_MIN_BYTES
    ],
)
def test_copy_from_host_waits_for_a_source_the_driver_reads_asynchronously(known, staging, expected, monkeypatch):
    """Issue #19 item 6: a source in managed or page-locked memory is copied by a DMA that the call
    waits for (never staged, never left pending); pageable sources keep their paths (CPU)."""
    calls = _record_copy_steps(monkeypatch, capturing=False, known=known)
    _copy.from_host(_device_side(), np.ones(N, np.float32), 7, staging)
    copies = [c for c in calls if c.startswith(("dma", "staged"))]
    assert copies == [expected], calls
    assert calls.index("capture check") < calls.index("prefetch") < calls.index(expected)
