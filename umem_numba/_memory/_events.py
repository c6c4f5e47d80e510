"""A pool of CUDA events, one free list per device.

Coherence records one event per kernel launch; creating and destroying an
event each time would cost more than the record itself, so finished events go
back to a free list when the last buffer stops referring to them.
"""

from __future__ import annotations

from typing import Any

from .. import _driver

# list.append/list.pop are atomic under the GIL: the hot path takes no lock.
_free: dict[int, list[Any]] = {}


class Event:
    """A recorded CUDA event; returns its handle to the pool when collected."""

    __slots__ = ("device_id", "handle", "key", "stream")

    def __init__(self, handle: Any, device_id: int, stream: int, key: int) -> None:
        self.handle = handle
        self.device_id = device_id
        self.stream = stream
        #: The stream's identity (``cuStreamGetId``): the handle alone is ambiguous.
        self.key = key

    def done(self) -> bool:
        """Whether all work before the record has finished (never blocks)."""
        return _driver.is_finished(
            _driver.api().drv.cuEventQuery(self.handle), "cuEventQuery", "checking device work on a buffer"
        )

    def synchronize(self) -> None:
        """Block until the recorded work has finished."""
        _driver.call("cuEventSynchronize", self.handle, detail="waiting for device work on a buffer")

    def __del__(self) -> None:
        try:
            _pool(self.device_id).append(self.handle)
        except Exception:  # interpreter exit: the module is already torn down
            pass


def _pool(device_id: int) -> list[Any]:
    pool = _free.get(device_id)
    if pool is None:
        pool = _free.setdefault(device_id, [])
    return pool


def record(stream: int, device_id: int, key: int | None = None) -> Event:
    """Record a pooled event on ``stream`` (in the current context, whose device is ``device_id``).

    ``key`` is the stream's identity (:func:`umem_numba._driver.stream_key`);
    it is looked up when not given.
    """
    api = _driver.api()
    drv = api.drv
    pool = _pool(device_id)
    try:
        handle = pool.pop()
    except IndexError:
        handle = _driver.check(drv.cuEventCreate(api.c.event_disable_timing), "cuEventCreate")
    err = drv.cuEventRecord(handle, stream)[0]
    if err != 0:
        # A handle whose record failed is in an unknown state: never reuse it.
        drv.cuEventDestroy(handle)
        _driver.raise_for(err, "cuEventRecord", f"recording completion on stream {stream:#x}")
    return Event(handle, device_id, stream, _driver.stream_key(stream) if key is None else key)
