"""What a CUDA graph capture of toolkit work uses: recorded while the capturing thread issues it.

Inside ``with umem_numba.capture(stream)`` (:mod:`umem_numba._launch._graphs`)
the work the thread queues on that stream is recorded into the graph, not run,
so nothing may be ordered or recorded for it then: an event recorded in a
capture cannot be waited for outside the graph, and waiting on an event from
outside breaks the capture.  Launches on the capturing stream therefore skip
their waits and events and note here which buffers they use (and whether they
write them); each replay of the graph then orders itself and records its
completion with that read and write set, as one launch would.

Only the capturing thread records, and only for the stream it captures
(compared by handle: ``cuStreamGetId`` is refused inside a capture, and the
capture keeps its stream alive until it ends).
"""

from __future__ import annotations

import threading
from typing import Any

from .._errors import CoherenceError
from ._tracker import Tracker

__all__ = ["CaptureRecorder", "capturing", "recorder_for", "start", "stop"]


class CaptureRecorder:
    """The buffers a capture on one stream uses, in the order first used.

    Parameters
    ----------
    handle : int
        The capturing stream's handle.
    device : int
        The device whose context the capture runs in.
    """

    __slots__ = ("device", "handle", "keep", "uses")

    def __init__(self, handle: int, device: int) -> None:
        self.handle = handle
        self.device = device
        #: tracker -> (writes, epoch when first used): the graph's read and write sets.
        self.uses: dict[Tracker, tuple[bool, int]] = {}
        #: The buffers (and other operands) the graph must keep alive.
        self.keep: list[Any] = []

    def add(self, tracker: Tracker, write: bool, owner: Any = None, epoch: int | None = None) -> None:
        """Note that the captured work uses ``tracker``'s memory (through ``owner``), writing it or not.

        ``epoch``: the tracker's epoch when the work took the buffer's address, if known.

        Raises
        ------
        CoherenceError
            The host holds the buffer (``with buf.on_host()``), or it is being closed or resized.
        """
        old = self.uses.get(tracker)
        if old is None:
            tracker.join_capture()
            self.uses[tracker] = (write, tracker.epoch if epoch is None else epoch)
            if owner is not None:
                self.keep.append(owner)
        elif write and not old[0]:
            self.uses[tracker] = (True, old[1])

    def end(self) -> None:
        """The capture ended (a graph was made or not): the buffers are the host's again."""
        for tracker in self.uses:
            tracker.count_uses(captures=-1)


class _Recording(threading.local):
    recorder: CaptureRecorder | None = None


_recording = _Recording()


def recorder_for(handle: int) -> CaptureRecorder | None:
    """The calling thread's recorder if it captures the stream ``handle``, else ``None``."""
    recorder = _recording.recorder
    if recorder is not None and recorder.handle == handle:
        return recorder
    return None


def capturing() -> bool:
    """Whether the calling thread is inside a ``umem_numba.capture`` block."""
    return _recording.recorder is not None


def start(recorder: CaptureRecorder) -> None:
    """Make ``recorder`` the calling thread's (one capture per thread at a time)."""
    if _recording.recorder is not None:
        raise CoherenceError("umem_numba.capture: this thread is already capturing a graph; end that capture first")
    _recording.recorder = recorder


def stop() -> None:
    """The calling thread's capture ended."""
    recorder = _recording.recorder
    _recording.recorder = None
    if recorder is not None:
        recorder.end()
