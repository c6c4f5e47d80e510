"""The one parser of targets (devices, the host) and streams: one table each, no GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

import umem_numba as um
from umem_numba._driver._location import HOST, Location, as_location, stream_handle


class _NumbaDevice:
    def __init__(self, id: int) -> None:
        self.id = id


class _CudaStreamProtocol:  # cuda.core, CuPy, PyTorch
    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


class _NumbaStream:
    def __init__(self, handle: int) -> None:
        self.handle = handle


class _TorchStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


@pytest.mark.parametrize(
    "target, expected",
    [
        (3, Location.device(3)),
        (np.int64(2), Location.device(2)),
        (np.uint8(1), Location.device(1)),
        (_NumbaDevice(4), Location.device(4)),
        (_NumbaDevice(np.int32(5)), Location.device(5)),
        ("cpu", HOST),
        ("HOST", HOST),
        (HOST, HOST),
        (Location.device(7), Location.device(7)),
    ],
)
def test_targets_that_parse(target, expected):
    assert as_location(target, check=False) == expected


@pytest.mark.parametrize(
    "target, error, message",
    [
        (True, TypeError, "bool"),
        (np.bool_(False), TypeError, "bool"),
        (1.0, TypeError, "float"),
        ("gpu", TypeError, "unknown target 'gpu'"),
        (-1, ValueError, "must be >= 0"),
        (np.int16(-2), ValueError, "must be >= 0"),
        (object(), TypeError, "object"),
    ],
)
def test_targets_that_do_not_parse(target, error, message):
    with pytest.raises(error, match=message):
        as_location(target, check=False)


def test_the_caller_is_named_and_the_host_can_be_refused():
    with pytest.raises(TypeError, match=r"^prefetch: unknown target"):
        as_location("gpu", check=False, what="prefetch")
    with pytest.raises(ValueError, match="needs a device"):
        as_location("cpu", allow_host=False, what="VMMBuffer.empty")


@pytest.mark.parametrize(
    "stream, expected",
    [
        (None, 0),
        (0, 0),
        (0x1234, 0x1234),
        (np.int64(0x55), 0x55),
        (np.uint64(2**64 - 1), 2**64 - 1),
        (_NumbaStream(0xABC), 0xABC),
        (_NumbaStream(np.uint64(9)), 9),
        (_CudaStreamProtocol(0xDEF), 0xDEF),
        (_TorchStream(0x77), 0x77),
    ],
)
def test_streams_that_parse(stream, expected):
    assert stream_handle(stream) == expected


@pytest.mark.parametrize(
    "stream, error, message",
    [
        ("fast", TypeError, "str"),
        (True, TypeError, "bool"),
        (-5, ValueError, "64-bit"),
        (2**70, ValueError, "64-bit"),
        (np.int64(-1), ValueError, "64-bit"),
        (1.5, TypeError, "float"),
    ],
)
def test_streams_that_do_not_parse(stream, error, message):
    with pytest.raises(error, match=message):
        stream_handle(stream, what="launch")


def test_public_as_location_is_the_parser():
    assert um.as_location is as_location


def test_stream_handles_are_remembered_per_object_not_per_id():
    """The parser remembers a stream object's handle; a new object at a reused id is parsed again."""

    class Stream:
        def __init__(self, handle: int) -> None:
            self.handle_value = handle
            self.asked = 0

        def __cuda_stream__(self) -> tuple[int, int]:
            self.asked += 1
            return (0, self.handle_value)

    for value in range(1, 50):  # CPython reuses the id of a collected object for the next one
        s = Stream(0x1000 + value)
        assert stream_handle(s) == stream_handle(s) == 0x1000 + value
        assert s.asked == 1  # parsed once, then remembered
        del s
    assert stream_handle(np.uint64(7)) == 7  # no weak reference possible: parsed every time
