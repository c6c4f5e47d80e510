"""Defaults and shortcuts as numpy and numba have them (issue #30, item 1).

float64 is the default dtype wherever one defaults (``np.empty``, numba's ``device_array`` and
``managed_array`` default to it); every shortcut takes ``pool=``, ``stream=`` and (managed
memory) ``prefetch=``; the stream defaults to ``0`` (the legacy default stream, numba's
default) for ``empty``, ``zeros`` and ``from_array`` alike; ``device_empty`` / ``device_zeros``
/ ``device_like`` / ``device_from`` are the :class:`DeviceBuffer` shortcuts, after numba's
``device_array`` / ``device_array_like`` / ``to_device``.  The signature checks need no GPU.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from numba import cuda
from support.helpers import random_array

import umem_numba as um

CONSTRUCTORS = [
    um.ManagedBuffer.empty,
    um.ManagedBuffer.zeros,
    um.PinnedBuffer.empty,
    um.PinnedBuffer.zeros,
    um.DeviceBuffer.empty,
    um.DeviceBuffer.zeros,
    um.VMMBuffer.empty,
    um.VMMBuffer.zeros,
    um.VMMBuffer.from_shareable_handle,
    um.managed_empty,
    um.managed_zeros,
    um.device_empty,
    um.device_zeros,
]

#: Every function that takes ``stream=`` to allocate, fill or copy into a new buffer.
WITH_STREAM = [
    um.ManagedBuffer.empty,
    um.ManagedBuffer.zeros,
    um.ManagedBuffer.from_array,
    um.PinnedBuffer.empty,
    um.PinnedBuffer.zeros,
    um.PinnedBuffer.from_array,
    um.DeviceBuffer.empty,
    um.DeviceBuffer.zeros,
    um.DeviceBuffer.from_array,
    um.VMMBuffer.zeros,
    um.managed_empty,
    um.managed_zeros,
    um.managed_like,
    um.managed_from,
    um.device_empty,
    um.device_zeros,
    um.device_like,
    um.device_from,
]


@pytest.mark.parametrize("fn", CONSTRUCTORS, ids=lambda f: f.__qualname__)
def test_the_default_dtype_is_float64(fn):
    assert inspect.signature(fn).parameters["dtype"].default is np.float64


@pytest.mark.parametrize("fn", WITH_STREAM, ids=lambda f: f.__qualname__)
def test_the_stream_defaults_to_0_everywhere(fn):
    assert inspect.signature(fn).parameters["stream"].default == 0


@pytest.mark.parametrize(
    "fn, names",
    [
        (um.managed_empty, ("pool", "stream", "prefetch", "attach", "order")),
        (um.managed_zeros, ("pool", "stream", "prefetch", "attach", "order")),
        (um.managed_like, ("pool", "stream", "prefetch", "attach", "order")),
        (um.managed_from, ("pool", "stream", "prefetch", "attach", "order")),
        (um.device_empty, ("pool", "stream", "order")),
        (um.device_zeros, ("pool", "stream", "order")),
        (um.device_like, ("pool", "stream", "order")),
        (um.device_from, ("pool", "stream", "order")),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_every_shortcut_takes_what_its_constructor_takes(fn, names):
    params = inspect.signature(fn).parameters
    assert set(names) <= set(params), sorted(set(names) - set(params))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "make",
    [
        lambda: um.ManagedBuffer.empty(4),
        lambda: um.ManagedBuffer.zeros(4),
        lambda: um.PinnedBuffer.empty(4),
        lambda: um.PinnedBuffer.zeros(4),
        lambda: um.DeviceBuffer.empty(4),
        lambda: um.DeviceBuffer.zeros(4),
        lambda: um.VMMBuffer.empty(4),
        lambda: um.VMMBuffer.zeros(4),
        lambda: um.managed_empty(4),
        lambda: um.managed_zeros(4),
        lambda: um.device_empty(4),
        lambda: um.device_zeros(4),
    ],
)
def test_buffers_made_without_a_dtype_are_float64(make):
    with make() as buf:
        assert buf.dtype == np.float64
        assert buf.nbytes == 32


@pytest.mark.gpu
def test_pinned_buffers_take_stream_0_without_a_pool_and_refuse_another():
    um.PinnedBuffer.empty(4, stream=0).close()
    with pytest.raises(ValueError, match="pass pool= too"):
        um.PinnedBuffer.empty(4, stream=cuda.stream())


@pytest.mark.gpu
@pytest.mark.parametrize("pooled", [False, True])
def test_managed_shortcuts_take_pool_stream_and_prefetch(pooled, rng):
    pool = um.MemoryPool("managed") if pooled else None
    s = cuda.stream()
    data = random_array(rng, (6, 5), np.float64)
    made = [
        um.managed_empty((6, 5), pool=pool, stream=s, prefetch=0),
        um.managed_zeros((6, 5), pool=pool, stream=s, prefetch=0),
        um.managed_like(np.asfortranarray(data), pool=pool, stream=s, prefetch=0),
        um.managed_from(data, pool=pool, stream=s, prefetch=0),
    ]
    for buf in made:
        assert isinstance(buf, um.ManagedBuffer) and buf.shape == (6, 5) and buf.dtype == np.float64
        assert buf.hints.last_prefetch_location == um.Location.device(0)
    assert made[2].is_f_contiguous and not made[2].is_c_contiguous  # "like" keeps an F array's order
    np.testing.assert_array_equal(made[1].host, 0.0)
    np.testing.assert_array_equal(made[3].host, data)
    for buf in made:
        buf.close()
    if pool is not None:
        pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("pooled", [False, True])
def test_device_shortcuts_follow_numbas_device_array_family(pooled, rng):
    pool = um.MemoryPool("device") if pooled else None
    s = cuda.stream()
    data = random_array(rng, (7, 3), np.float32)
    empty = um.device_empty((7, 3), np.float32, pool=pool, stream=s)
    zeros = um.device_zeros(9, pool=pool, stream=s)
    like = um.device_like(cuda.to_device(np.asfortranarray(data)), pool=pool, stream=s)
    like_buffer = um.device_like(empty)
    copied = um.device_from(data, pool=pool, stream=s)
    for buf in (empty, zeros, like, like_buffer, copied):
        assert isinstance(buf, um.DeviceBuffer)
    assert empty.shape == like.shape == like_buffer.shape == copied.shape == (7, 3)
    assert like.dtype == like_buffer.dtype == np.float32 and zeros.dtype == np.float64
    assert like.is_f_contiguous and not like.is_c_contiguous
    np.testing.assert_array_equal(zeros.copy_to_host(), 0.0)
    np.testing.assert_array_equal(copied.copy_to_host(), data)
    for buf in (empty, zeros, like, like_buffer, copied):
        buf.close()
    if pool is not None:
        pool.close()
