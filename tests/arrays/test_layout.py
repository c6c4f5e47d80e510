"""Shape/dtype validation and basic indexing: pure Python, runs without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import umem_numba as um
from umem_numba._arrays import _layout
from umem_numba._arrays import _layout as layout


@pytest.mark.parametrize(
    "shape,expected", [(5, (5,)), ((2, 3), (2, 3)), ([4], (4,)), ((), ()), (0, (0,)), (np.int64(7), (7,))]
)
def test_normalize_shape_accepts(shape, expected):
    assert _layout.normalize_shape(shape) == expected


@pytest.mark.parametrize(
    "shape,exc,match",
    [
        (-1, ValueError, "negative dimension -1"),
        ((3, -2), ValueError, "negative dimension -2"),
        (2.5, TypeError, "float"),
        ((2, "3"), TypeError, "str"),
        (True, TypeError, "bool"),
        ((2, None), TypeError, "NoneType"),
        ("12", TypeError, "str"),
    ],
)
def test_normalize_shape_rejects(shape, exc, match):
    with pytest.raises(exc, match=match):
        _layout.normalize_shape(shape)


def test_huge_sizes_rejected_before_driver():
    with pytest.raises(ValueError, match="more than any device has"):
        _layout.checked_nbytes((1 << 40, 1 << 30), np.dtype(np.float64))


@pytest.mark.parametrize(
    "dtype,match",
    [(object, "Python objects"), ("not-a-dtype", "not a numpy dtype"), (np.dtype([("a", object)]), "Python objects")],
)
def test_bad_dtypes(dtype, match):
    with pytest.raises(TypeError, match=match):
        _layout.normalize_dtype(dtype)


def test_structured_dtype_is_fixed_size():
    dt = _layout.normalize_dtype([("x", np.float32), ("n", np.int16)])
    assert dt.itemsize == 6


KEYS = [
    np.s_[2:7],
    np.s_[::2],
    np.s_[::-1],
    np.s_[1:-1, 2:],
    np.s_[:, 1:-1],
    np.s_[3],
    np.s_[-1],
    np.s_[..., 2],
    np.s_[1, ...],
    np.s_[2:9:3, ::-2],
    np.s_[5:2],
    np.s_[:, 4],
    np.s_[-3:, -4::-1],
]


@pytest.mark.parametrize("key", KEYS, ids=[str(k) for k in KEYS])
def test_index_view_matches_numpy(key, rng):
    base = rng.random((9, 11)).astype(np.float32)
    expected = base[key]
    offset, shape, strides = _layout.index_view(base.shape, base.strides, key)
    assert shape == expected.shape
    if expected.size:
        assert strides == expected.strides or expected.ndim == 0
        got = np.lib.stride_tricks.as_strided(base.ravel()[offset // 4 :], shape=shape, strides=strides)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    "key,exc,match",
    [
        (np.s_[9], IndexError, "out of bounds for axis 0 with size 9"),
        (np.s_[0, -12], IndexError, "axis 1"),
        (np.s_[1, 2, 3], IndexError, "too many indices"),
        (np.s_[..., ...], IndexError, "single ellipsis"),
        ([1, 2], TypeError, "advanced indexing"),
        (np.s_[True], TypeError, "boolean"),
        (1.5, TypeError, "unsupported index"),
    ],
)
def test_index_view_errors(key, exc, match):
    with pytest.raises(exc, match=match):
        _layout.index_view((9, 11), (44, 4), key)


def test_contiguity_flags():
    a = np.empty((4, 6), np.float64)
    assert _layout.is_c_contiguous(a.shape, a.strides, 8)
    assert not _layout.is_f_contiguous(a.shape, a.strides, 8)
    t = a.T
    assert _layout.is_f_contiguous(t.shape, t.strides, 8)
    s = a[:, ::2]
    assert not _layout.is_c_contiguous(s.shape, s.strides, 8)
    assert _layout.c_strides((4, 6), 8) == a.strides


def test_numba_type_layouts():
    from numba.core import types

    a = np.empty((4, 6), np.float32)
    assert _layout.numba_type(a.dtype, a.shape, a.strides) == types.Array(types.float32, 2, "C")
    s = a[:, 1:3]
    assert _layout.numba_type(a.dtype, s.shape, s.strides) == types.Array(types.float32, 2, "A")


@pytest.mark.parametrize(
    "dtype, message",
    [
        (("f4", (3,)), r"subarray dtype .* use dtype float32 with 1 more trailing dimension"),
        (np.dtype(("i2", (2, 2))), "subarray dtype"),
        (">f4", "byte order"),
        (np.dtype([("a", ">i4"), ("b", "<f8")]), "byte order"),
        # issue #30 item 7: text and raw bytes are not numbers a kernel can use; the message names the dtype
        ("U5", "dtype <U5 holds text"),
        (np.str_, "dtype <U0"),
        ("S3", r"dtype \|S3 holds text"),
        (np.dtype([("name", "U4"), ("x", "f4")]), r"field 'name' of dtype .* holds text"),
        ("V8", r"dtype \|V8 is raw bytes"),
        (object, "dtype object holds Python objects"),
    ],
)
@pytest.mark.parametrize(
    "make", [um.ManagedBuffer.empty, um.PinnedBuffer.empty, um.VMMBuffer.empty, um.DeviceBuffer.empty]
)
def test_dtypes_kernels_cannot_use_are_refused_before_the_driver(make, dtype, message):
    with pytest.raises(TypeError, match=message):
        make(4, dtype)


@pytest.mark.parametrize(
    "source, message",
    [
        ("hello", r"from_array\('hello'\): dtype <U5 holds text"),
        (["a", "bc"], r"from_array\(\['a', 'bc'\]\): dtype <U2 holds text"),
        (np.array([b"xyz"]), r"dtype \|S3 holds text"),
        (None, r"from_array\(None\): the source is None; pass the data to copy"),
        ([1, None], r"from_array\(\[1, None\]\): dtype object holds Python objects"),
    ],
)
@pytest.mark.parametrize(
    "make",
    [um.ManagedBuffer.from_array, um.PinnedBuffer.from_array, um.VMMBuffer.from_array, um.DeviceBuffer.from_array],
)
def test_sources_kernels_cannot_use_are_refused_before_the_driver(make, source, message):
    """Issue #30 item 7: ``from_array("hello")`` made a ``<U5`` buffer; ``from_array(None)`` did not name None."""
    with pytest.raises(TypeError, match=message):
        make(source)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ManagedBuffer", "PinnedBuffer", "VMMBuffer", "DeviceBuffer"])
def test_after_a_refused_source_the_next_buffer_is_made_as_usual(kind, rng):
    cls = getattr(um, kind)
    live = um.stats()
    for bad in ("hello", None, np.array([b"xyz"])):
        with pytest.raises(TypeError, match="from_array"):
            cls.from_array(bad)
    assert um.stats() == live  # nothing was allocated for the refused calls
    data = rng.random((5, 7)).astype(np.float32)
    with cls.from_array(data) as buf:
        np.testing.assert_array_equal(buf.copy_to_host(), data)


def test_numpy_integers_are_ints_everywhere():
    from umem_numba._kinds._pinned import _as_flags
    from umem_numba._vmm._access import as_access

    assert _as_flags(np.int32(3)) == um.HostAllocFlags.PORTABLE | um.HostAllocFlags.DEVICEMAP
    assert as_access(np.int64(3)) is um.AccessFlags.READ_WRITE
    assert layout.normalize_shape((np.int64(2), np.uint8(3))) == (2, 3)
