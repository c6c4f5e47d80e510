"""The launch fast path keeps numba's semantics and the coherence promise (issue #19 items 3, 9, 14).

* Read-only inference is sound: a store through an element, an alias, a loop
  target or a call counts as a write (CPU table; GPU ordering test).
* CuPy and PyTorch streams (objects and raw handles) launch, are ordered
  against other streams, and hit the launch-configuration cache.
* ``pre_launch_callbacks`` run on every launch, and a plain numba launch of an
  unmapped ``PinnedBuffer`` is refused like a coherent one.
* A raw or borrowed stream handle is identified by ``cuStreamGetId`` at every
  launch (it may name another stream later); only a stream the launch holds
  and that owns its handle keeps its identity cached.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import pytest
from numba import cuda, uint64
from support.helpers import ORDERING_TRIALS, random_array, sleeping

import umem_numba as um
from umem_numba import _driver
from umem_numba._launch import _coherent as _launch
from umem_numba._launch import _write_inference
from umem_numba._memory import _events

SLEEP_MS = 30


# ---------------------------------------------------------------------------
# Item 3: which parameters a kernel may write (pure source analysis, CPU)
#
# The functions below are never compiled or run: only their source is read.


def store(a, v):  # a device function the analysis does not look into
    a[0] = v


def k_plain(out, inp, i):
    out[i] = inp[i]


def k_row_element(out, inp, i):
    out[i][0] = inp[i]


def k_row_element_augmented(out, inp, i, j):
    out[i][j] += inp[i, j]


def k_record_field(out, inp, i):
    out[i].x = inp[i]


def k_row_alias(out, inp, i):
    row = out[i]
    row[0] = inp[i]


def k_alias_chain(out, inp, i):
    a = out
    b = a
    c = b[i]
    c[0] = inp[i]


def k_loop_rows(out, inp):
    for row in out:
        row[0] = inp[0]


def k_loop_enumerate(out, inp):
    for k, row in enumerate(out):
        row[0] = inp[k]


def k_loop_zip(out, inp):
    for r, s in zip(out, inp):  # noqa: B905 (numba has no strict=)
        r[0] = s[0]


def k_device_function_row(out, inp, i):
    store(out[i], inp[i])


def k_device_function_whole(out, inp):
    store(out, inp[0])


def k_device_function_read_arg(out, inp, i):
    out[i] = 0
    store(inp[i], 1.0)  # inp[i] may be a row: the device function may write through it


def k_atomic(out, inp, i):
    cuda.atomic.add(out, i, inp[i])


def k_atomic_row(out, inp, i):
    cuda.atomic.add(out[i], 0, inp[i])


def k_tuple_unpack(out, inp, i):
    a, b = out, inp
    a[i] = b[i]


def k_tuple_swap(out, inp, i):
    a, b = inp, out
    b[i] = a[i]


def k_tuple_container(out, inp, i):
    t = (out, inp)
    t[0][i] = 1.0


def k_walrus(out, inp, i):
    (row := out[i])[0] = inp[i]  # noqa: F841 (the walrus itself is the point)


def k_conditional_alias(out, inp, i, c):
    a = out if c else inp
    a[i] = 0.0


def k_boolop_alias(out, inp, i):
    a = out or inp
    a[i] = 0.0


def k_param_rebound(out, inp, i):
    inp = out
    inp[i] = 0.0


def k_inplace_alias(out, inp, i):
    row = out[i]
    row += inp[i]


def k_method_call(out, inp):
    out.fill(inp[0])


def k_nested_function(out, inp, i):
    def inner():
        out[i] = inp[i]

    inner()


def k_lambda_returning_param(out, inp, i):
    get = lambda: out  # noqa: E731
    get()[i] = inp[i]


def k_delete_element(out, inp, i):
    del out[i]


def k_annotated_alias(out, inp, i):
    row: object = out[i]
    row[0] = inp[i]


def k_record_field_named_like_metadata(out, inp, i):
    store(out[i].shape, inp[i])  # a record field called "shape" may be a nested array


def k_local_array_from_row(out, inp, i):
    row = inp[i]
    tmp = cuda.local.array(4, row.dtype)  # new memory: reads row's type only
    tmp[0] = row[0]
    out[i] = tmp[0]


def k_reads_only(out, inp, i):
    n, m = inp.shape
    x = inp[i]
    y = math.sqrt(abs(x)) + len(inp) + inp.shape[0] + inp.size + min(x, 0.0) + max(n, m)
    tmp = cuda.local.array(4, inp.dtype)
    tmp[0] = x
    for k in range(inp.size):
        y += inp[k] if inp[k] > 0 else -inp[k]
    out[i] = uint64(y) + tmp[0] + float(inp[i]) + round(inp[i])


def k_reads_through_loop(out, inp):
    for v in inp:
        out[0] += v


#: kernel -> (parameters it must be inferred to write, array parameters it must be inferred to only read).
#: Scalar parameters (``i``, ``j``, ``c``) are never tracked, whatever is inferred for them.
WRITE_TABLE = [
    (k_plain, {"out"}, {"inp"}),
    (k_row_element, {"out"}, {"inp"}),
    (k_row_element_augmented, {"out"}, {"inp"}),
    (k_record_field, {"out"}, {"inp"}),
    (k_row_alias, {"out"}, {"inp"}),
    (k_alias_chain, {"out"}, {"inp"}),
    (k_loop_rows, {"out"}, {"inp"}),
    (k_loop_enumerate, {"out"}, {"inp"}),
    (k_loop_zip, {"out"}, set()),
    (k_device_function_row, {"out"}, set()),
    (k_device_function_whole, {"out"}, set()),
    (k_device_function_read_arg, {"out", "inp"}, set()),
    (k_atomic, {"out"}, set()),
    (k_atomic_row, {"out"}, set()),
    (k_tuple_unpack, {"out"}, {"inp"}),
    (k_tuple_swap, {"out"}, {"inp"}),
    (k_tuple_container, {"out"}, set()),
    (k_walrus, {"out"}, {"inp"}),
    (k_conditional_alias, {"out", "inp"}, set()),
    (k_boolop_alias, {"out", "inp"}, set()),
    (k_param_rebound, {"out"}, set()),
    (k_inplace_alias, {"out"}, set()),
    (k_method_call, {"out"}, set()),
    (k_nested_function, {"out"}, set()),
    (k_lambda_returning_param, {"out"}, set()),
    (k_delete_element, {"out"}, {"inp"}),
    (k_annotated_alias, {"out"}, {"inp"}),
    (k_record_field_named_like_metadata, {"out"}, set()),
    (k_local_array_from_row, {"out"}, {"inp"}),
    (k_reads_only, {"out"}, {"inp"}),
    (k_reads_through_loop, {"out"}, {"inp"}),
]


class _FakeKernel:
    """Enough of a numba dispatcher for ``um.coherent`` to infer writes (no GPU needed)."""

    def __init__(self, py_func):
        self.py_func = py_func
        self.configs: list[tuple] = []

    def __getitem__(self, config):
        self.configs.append(config)
        return _FakeConfigured(config)


class _FakeConfigured:
    def __init__(self, config):
        self.config = config
        self.calls = 0
        self.pre_launch_callbacks: list = []

    def __call__(self, *args):
        self.calls += 1


@pytest.mark.parametrize(("kernel", "writes", "reads"), WRITE_TABLE, ids=[k.__name__ for k, _, _ in WRITE_TABLE])
def test_readonly_inference_sees_stores_through_elements_aliases_and_calls(kernel, writes, reads):
    """Issue #19 item 3: a store through an element, alias, loop target or call is a write.

    Today's inference looks only at a parameter's own parent node, so
    ``out[i][0] = v``, ``row = out[i]; row[0] = v``, ``for row in out``,
    ``store(out[i], v)`` and the others are inferred read-only.
    """
    inferred = um.coherent(_FakeKernel(kernel)).writes
    written = {p for p, w in inferred.items() if w}
    assert writes <= written, f"{kernel.__name__}: stores to {sorted(writes - written)} were missed"
    assert not (reads & written), f"{kernel.__name__}: {sorted(reads & written)} only read, inferred written"


def test_readonly_inference_without_source_counts_everything_written():
    """Issue #19 item 3: a kernel whose source cannot be read writes every parameter."""
    namespace: dict = {}
    exec("def k(out, inp, i):\n    out[i] = inp[i]\n", namespace)
    assert um.coherent(_FakeKernel(namespace["k"])).writes == {"out": True, "inp": True, "i": True}
    assert _write_inference.written_params(namespace["k"]) is None


def test_readonly_inference_refuses_source_edited_after_import(tmp_path, monkeypatch):
    """Issue #19 item 3: a source file edited after import no longer describes the code: all written.

    Today the edited file is analysed as if it were the running code: here it
    says ``out`` is written, while the running kernel writes ``inp``.
    """
    import importlib
    import linecache

    path = tmp_path / "umem_edited_kernel.py"
    path.write_text("def k(out, inp):\n    inp[0] = out[0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("umem_edited_kernel")
    try:
        assert _write_inference.written_params(module.k) == ("inp",)
        path.write_text("def k(out, inp):\n    out[0] = inp[0]\n")
        linecache.clearcache()
        assert _write_inference.written_params(module.k) is None
        assert um.coherent(_FakeKernel(module.k)).writes == {"out": True, "inp": True}
    finally:
        sys.modules.pop("umem_edited_kernel", None)


def test_readonly_inference_of_the_shipped_kernels():
    """Issue #19 item 3: the shipped stencils still read ``src`` only; a device function argument is written."""
    from umem_numba.kernels import stencil2d, stencil3d

    assert um.coherent(stencil2d.heat2d_kernel(16)).writes == {
        "src": False,
        "dst": True,
        "w_center": False,
        "w_neighbour": False,
    }
    for variant, block in (("column", None), ("tile", (32, 4))):
        writes = um.coherent(stencil3d.heat3d_kernel(8, variant, block)).writes
        assert writes["src"] is False and writes["dst"] is True, variant
    # src goes to device functions (vector loads) the inference does not look into: written.
    assert um.coherent(stencil3d.heat3d_kernel(8, "vec2")).writes["src"] is True


# ---------------------------------------------------------------------------
# Item 9 and the stream identity rule (CPU, fakes)


class _ForeignStream:
    """A stream object of another library: ``__cuda_stream__`` gives ``(version, handle)``."""

    def __init__(self, handle: int) -> None:
        self.handle_value = handle

    def __cuda_stream__(self):
        return (0, self.handle_value)


@pytest.fixture
def fake_external(monkeypatch):
    """Replace numba's external stream factory; returns the list of handles it was asked for."""
    made: list[int] = []

    def make(handle: int):
        made.append(handle)
        return ("external", handle, len(made))

    def forget() -> None:
        for cache in ("_external_streams", "_external_handles"):
            getattr(_launch, cache, {}).clear()
        # This thread's wrapper of handle 2: a fake one must not outlive the test (a later real
        # launch on handle 2 in this thread would hand numba the fake), nor a real one hide the fake.
        vars(_launch._per_thread).pop("stream", None)

    monkeypatch.setattr(_launch, "_make_external_stream", make, raising=False)
    forget()
    yield made
    forget()


def test_foreign_streams_are_wrapped_once_per_stream(fake_external):
    """Issue #19 item 9: foreign streams become one numba external stream each, reused by every launch."""
    from cuda.bindings import driver as drv
    from numba.cuda.cudadrv import driver as nbdriver

    foreign = _ForeignStream(0x7F00_1000)
    wrapped = _launch._launch_stream(foreign)
    assert wrapped == ("external", 0x7F00_1000, 1)
    assert _launch._launch_stream(foreign) is wrapped  # cached by identity
    handle = 0x7F00_2000
    by_handle = _launch._launch_stream(int(str(handle)))  # a fresh int object each time
    assert by_handle[1] == handle
    assert _launch._launch_stream(int(str(handle))) is by_handle
    assert fake_external == [0x7F00_1000, 0x7F00_2000]
    for native in (0, None, nbdriver.Stream(drv.CUstream(0x7F00_3000))):
        assert _launch._launch_stream(native) is native  # numba takes these itself
    assert _launch._launch_stream(_ForeignStream(0)) == 0  # the legacy default stream
    with pytest.raises(TypeError, match="bool"):
        _launch._launch_stream(True)
    with pytest.raises(TypeError, match="CUDA stream"):
        _launch._launch_stream("s1")


class _OldCupyStream:
    """A CuPy stream from before ``__cuda_stream__``: only ``ptr``."""

    __module__ = "cupy.cuda.stream"

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def test_old_cupy_stream_without_protocol_is_wrapped_by_its_ptr(fake_external):
    """Issue #19 item 9: a CuPy stream without ``__cuda_stream__`` is taken by ``ptr`` (only CuPy's)."""
    old = _OldCupyStream(0x7F00_A000)
    assert _launch._launch_stream(old)[1] == 0x7F00_A000

    class NotAStream:
        ptr = 0x7F00_B000  # a buffer's address, say: not a stream

    with pytest.raises(TypeError, match="CUDA stream"):
        _launch._launch_stream(NotAStream())


def test_per_thread_stream_handle_is_not_shared_between_threads(fake_external):
    """Issue #19 item 9: handle 2 names each thread's own stream, so its wrapper is per thread."""
    mine = _launch._launch_stream(2)
    assert _launch._launch_stream(2) is mine
    theirs: list = []
    t = threading.Thread(target=lambda: theirs.append(_launch._launch_stream(2)))
    t.start()
    t.join()
    assert theirs and theirs[0] is not mine
    assert fake_external == [2, 2]


def test_configured_launch_cache_hits_for_foreign_streams_and_raw_handles(fake_external):
    """Issue #19 item 9: a foreign stream or a raw handle hits the launch-configuration cache."""
    fake = _FakeKernel(k_plain)
    k = um.coherent(fake)
    foreign = _ForeignStream(0x7F00_4000)
    first = k[4, 32, foreign]
    assert k[4, 32, foreign] is first
    assert fake.configs[-1][2] == ("external", 0x7F00_4000, 1)  # numba is given its own stream type
    handle = 0x7F00_5000
    by_handle = k[4, 32, int(str(handle))]
    assert k[4, 32, int(str(handle))] is by_handle
    assert len(fake.configs) == 2


class _FakeTracker:
    def __init__(self) -> None:
        self.keys: list[int] = []
        self.migrate = None  # nothing for the launch to prefetch

    def begin_use(self, key, write, what, epoch=None):
        self.keys.append(key)
        return [], ()

    def end_use(self, key, recorded, write, covered=(), issued=True):
        pass


@pytest.fixture
def fake_driver(monkeypatch):
    """Driver calls of a launch replaced: ``cuStreamGetId`` counts its calls per handle."""
    asked: list[int] = []

    def stream_key(handle: int) -> int:
        asked.append(handle)
        return 10_000 + len(asked)  # a destroyed stream's handle names a new stream: a new id

    monkeypatch.setattr(_driver, "stream_key", stream_key)
    monkeypatch.setattr(_driver, "is_capturing", lambda handle: False)
    monkeypatch.setattr(_driver, "current_device", lambda: 0)
    monkeypatch.setattr(_events, "record", lambda handle, device, key: None)
    return asked


def test_borrowed_stream_handles_are_identified_at_every_launch(fake_driver, fake_external):
    """Stream rule (_driver.stream_key): a raw or borrowed handle may name another stream later.

    Today a configured launch keeps the first ``cuStreamGetId`` of any handle
    but 0, 1 and 2, so a raw handle reused by a new stream keeps the old
    stream's identity, and the tracker skips the wait between the two streams.
    """
    from cuda.bindings import driver as drv
    from numba.cuda.cudadrv import driver as nbdriver

    k = um.coherent(_FakeKernel(k_plain))
    borrowed = [
        0x7F00_6000,  # a raw handle
        _ForeignStream(0x7F00_7000),  # a CuPy/PyTorch stream: it may be an external one
        nbdriver.Stream(drv.CUstream(0x7F00_8000), external=True),  # numba's external stream
    ]
    for stream in borrowed:
        tracker = _FakeTracker()
        launch = k[1, 32, stream]
        for _ in range(2):
            launch._issue([(tracker, True)], ())
        assert len(set(tracker.keys)) == 2, f"{stream!r}: the stream's identity was cached"
    owned = nbdriver.Stream(drv.CUstream(0x7F00_9000))  # numba's own stream: alive while the launch holds it
    tracker = _FakeTracker()
    launch = k[1, 32, owned]
    for _ in range(3):
        launch._issue([(tracker, True)], ())
    assert len(set(tracker.keys)) == 1


def test_configured_launch_forwards_numba_launch_attributes():
    """Issue #19 item 14: ``k[g, b]`` of a coherent kernel exposes numba's ``pre_launch_callbacks``."""
    k = um.coherent(_FakeKernel(k_plain))
    cfg = k[4, 32]
    cfg.pre_launch_callbacks.append(print)
    assert cfg._configured.pre_launch_callbacks == [print]
    assert cfg.config == (4, 32)


def _unmapped_pinned_without_driver():
    """A zero-size PinnedBuffer without DEVICEMAP, built without a driver (CPU)."""
    from umem_numba._memory._lifetime import Allocation
    from umem_numba._memory._tracker import Tracker

    buf = object.__new__(um.PinnedBuffer)
    buf._init(Allocation("pinned", None, 0, 0, Tracker(0)), 0, (0,), (4,), np.dtype(np.float32), True)
    buf._flags = um.HostAllocFlags.DEFAULT
    buf._device_accessible = False
    return buf


def test_numba_typing_refuses_unmapped_pinned_buffer():
    """Issue #19 item 14: numba's typing of an unmapped PinnedBuffer raises a clear error (CPU check).

    Today the buffer's error is an AttributeError, which numba's typing takes
    as "no ``_numba_type_``": it falls through to ``__dlpack__`` and types the
    host memory as an array, so a plain launch runs on the host pointer.
    """
    from numba.cuda.typing.typeof import typeof

    buf = _unmapped_pinned_without_driver()
    with pytest.raises(um.UnsupportedError, match="DEVICEMAP"):
        typeof(buf)
    assert not hasattr(buf, "__cuda_array_interface__")  # still no device view for other libraries


# ---------------------------------------------------------------------------
# GPU: item 3, ordering of a writer inferred from an element store


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_row_element_writer_is_ordered_before_reader_on_another_stream(rng):
    """Issue #19 item 3: ``a[i][j] = v`` is a write, so a reader on another stream waits for it.

    Today the writer is filed as a read of ``a``: the reader on stream 2 does
    not wait for it and copies the old values (5 of 6 trials on an H200).
    """

    @um.jit
    def slow_fill_rows(a, v, ms):
        for _ in range(ms):
            cuda.nanosleep(1_000_000)
        i, j = cuda.grid(2)
        if i < a.shape[0] and j < a.shape[1]:
            a[i][j] = v

    @um.jit
    def copy2d(out, a):
        i, j = cuda.grid(2)
        if i < a.shape[0] and j < a.shape[1]:
            out[i, j] = a[i, j]

    s1, s2 = cuda.stream(), cuda.stream()
    shape = (64, 64)
    stale = []
    with um.ManagedBuffer.zeros(shape, np.float64) as a, um.ManagedBuffer.zeros(shape, np.float64) as out:
        for trial in range(ORDERING_TRIALS):
            v = float(trial * 1000 + rng.integers(1, 1000))
            slow_fill_rows[(8, 8), (8, 8), s1](a, v, SLEEP_MS)
            copy2d[(8, 8), (8, 8), s2](out, a)
            if not (out.host == v).all():
                stale.append(trial)
            assert (a.host == v).all()
    assert not stale, f"the reader overtook the writer in {len(stale)} of {ORDERING_TRIALS} trials: {stale}"
    assert slow_fill_rows.writes["a"] is True and copy2d.writes == {"out": True, "a": False}


# ---------------------------------------------------------------------------
# GPU: item 9, launches on CuPy and PyTorch streams


def _foreign_stream_trials(rng, foreign, handle: int) -> None:
    """Writer then reader, 20 trials: foreign stream (object or raw handle) against a numba stream."""
    fill = um.coherent(sleeping.fill)
    copy = um.coherent(sleeping.copy)
    n = 4096
    grid, block = n // 128, 128
    own = cuda.stream()
    with um.ManagedBuffer.zeros(n, np.float64) as a, um.ManagedBuffer.zeros(n, np.float64) as out:
        for trial in range(ORDERING_TRIALS):
            v = float(trial * 1000 + rng.integers(1, 1000))
            theirs = foreign if trial % 4 < 2 else int(str(handle))  # the object, or a fresh raw handle
            writer, reader = (theirs, own) if trial % 2 == 0 else (own, theirs)
            fill[grid, block, writer](a, v, SLEEP_MS)  # sleeps, then writes a
            um.launch(copy, grid, block, a, out, 0, stream=reader)  # reads a: must wait on the device
            np.testing.assert_array_equal(out.host, np.full(n, v), err_msg=f"trial {trial}")
        # The launch configurations are cached: the stream object and its raw handle each hit.
        assert fill[grid, block, foreign] is fill[grid, block, foreign]
        assert fill[grid, block, int(str(handle))] is fill[grid, block, int(str(handle))]
        values = random_array(rng, n, np.float64)
        a.copy_from_host(values)
        um.launch(copy, grid, block, a, out, 0, stream=foreign)
        np.testing.assert_array_equal(out.host, values)


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_launch_on_cupy_stream_is_ordered_against_other_streams(rng):
    """Issue #19 item 9: ``k[g, b, cupy_stream]`` and ``um.launch(..., stream=cupy_stream)`` launch.

    Today numba's launch raises ``TypeError: Expected a Stream object, ...``
    for a CuPy stream and for a raw handle.
    """
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    stream = cupy.cuda.Stream(non_blocking=True)
    _foreign_stream_trials(rng, stream, int(stream.ptr))


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_launch_on_pytorch_stream_is_ordered_against_other_streams(rng):
    """Issue #19 item 9: a PyTorch stream (object or ``cuda_stream`` handle) launches and is ordered."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA support")
    cuda.current_context()  # numba's context first: PyTorch then shares the primary context
    stream = torch.cuda.Stream()
    _foreign_stream_trials(rng, stream, int(stream.cuda_stream))


# ---------------------------------------------------------------------------
# GPU: item 14, numba's semantics on the direct path


def _direct_calls(kernel: um.CoherentKernel) -> int:
    return sum(1 for cfg in kernel._configs.values() for _types, call in cfg._calls.values() if call is not None)


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_pre_launch_callbacks_run_on_direct_launches(rng):
    """Issue #19 item 14: numba's ``pre_launch_callbacks`` run before every launch, direct ones too.

    Today, once a kind of launch takes the direct path, the callbacks that
    numba's configured launch holds are skipped.
    """

    @um.jit
    def affine(out, x, a):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = x[i] * a + 1.0

    n = 1024
    x_h = random_array(rng, n, np.float64)
    seen: list = []
    with um.ManagedBuffer.from_array(x_h) as x, um.ManagedBuffer.zeros(n, np.float64) as out:
        for _ in range(3):
            affine[n // 128, 128](out, x, 2.0)
        assert _direct_calls(affine) >= 1
        numba_config = affine[n // 128, 128]._configured  # numba's own configured launch
        numba_config.pre_launch_callbacks.append(lambda kernel, config: seen.append(config))
        for step in range(3):
            affine[n // 128, 128](out, x, float(step))
            np.testing.assert_allclose(out.host, x_h * step + 1.0, rtol=1e-15)  # FMA rounds once
        assert len(seen) == 3, f"the callback ran before {len(seen)} of 3 launches"
        assert all(c is numba_config for c in seen)
        # Through the coherent kernel's own configured launch, as with numba's.
        affine[n // 128, 128].pre_launch_callbacks.clear()
        affine[n // 128, 128](out, x, 5.0)
        assert len(seen) == 3
        np.testing.assert_allclose(out.host, x_h * 5.0 + 1.0, rtol=1e-15)  # FMA rounds once


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_plain_launch_of_unmapped_pinned_buffer_is_refused(rng):
    """Issue #19 item 14: ``kernel[g, b](pinned)`` of an unmapped PinnedBuffer raises, as ``um.jit`` does.

    Today numba's typing swallows the buffer's error and takes it as a DLPack
    host array: the kernel runs on the host pointer with nothing tracked.
    """

    @cuda.jit
    def fill(a, v):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] = v

    n = 256
    values = random_array(rng, n, np.float32)
    with um.PinnedBuffer.from_array(values) as unmapped:
        with pytest.raises(um.UnsupportedError, match="DEVICEMAP"):
            fill[2, 128](unmapped, 7.0)
        with pytest.raises(um.UnsupportedError, match="DEVICEMAP"):
            um.jit(fill.py_func)[2, 128](unmapped, 7.0)
        cuda.synchronize()
        np.testing.assert_array_equal(unmapped.host, values)  # nothing ran on it
    with um.PinnedBuffer.from_array(values, flags=um.HostAllocFlags.DEVICEMAP) as mapped:
        fill[2, 128](mapped, 7.0)  # a mapped one still works in a plain launch
        np.testing.assert_array_equal(mapped.host, np.full(n, 7.0, np.float32))
