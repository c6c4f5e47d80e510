"""Plain numba launches of buffers (``kernel[g, b, s](buf)``), ordered and recorded on their stream.

numba's launch asks each buffer argument for its device array with the
launch stream (``to_device(retr, stream)``, numba's ``ArgHint`` protocol),
then calls every function appended to ``retr`` once the kernel is queued.
:meth:`PlainLaunch.register` makes the stream wait for conflicting work on
other streams and files the launch as a write of every buffer argument
(numba's kernels are not analysed: a kernel counts as writing every buffer
it is given).

What makes it cheap: a launch on a stream umem_numba can name later (the
legacy stream, or a stream numba created, while its owner lives: known once
umem_numba saw the stream object, since numba's launch hands buffers only a
cuda.core view of the handle) files a
:class:`StreamMark` rather than recording an event.  The mark stands for
"every plain launch queued on this stream so far"; it is recorded as a CUDA
event only when something must wait for it (host access, work on another
stream, a free).  Launches that find the stream's current mark already filed
as the buffer's only pending work change nothing and make no driver call:
a loop of launches on one stream costs no more than numba's own.  The mark
is recorded later than the launch, so it covers more work of that stream,
never less.  A stream umem_numba cannot name later (the per-thread stream,
whose handle means another stream in another thread; a foreign stream its
owner may destroy) gets one event per launch, recorded after the kernel.

A capturing stream, where an event would be a node of the user's graph,
keeps the conservative mark instead (work on an unknown stream).  A mark
whose stream is capturing when it must be recorded cannot be waited for
without breaking the capture: that is refused with a
:class:`~umem_numba.CoherenceError`.
"""

from __future__ import annotations

import weakref
from typing import Any

from .. import _driver
from .._driver._location import stream_handle
from .._errors import CoherenceError
from . import _capture, _events
from ._tracker import Tracker, prefetch_touched

__all__ = ["PlainLaunch", "StreamMark"]


class StreamMark:
    """The plain launches queued on one stream since the mark was made; an event recorded on demand.

    It stands in for an :class:`~umem_numba._memory._events.Event` in a
    tracker: the first use of :attr:`handle`, :meth:`done` or
    :meth:`synchronize` records the event on the stream (after a capture
    check); from then on the mark is that event and plain launches make a
    new mark.

    Parameters
    ----------
    stream : int
        The stream's handle: 0 (the legacy stream of ``device_id``) or a
        stream owned by ``owner``.
    device_id : int
        The device whose context the stream belongs to.
    key : int
        The stream's ``cuStreamGetId``.
    owner : weakref.ref or None
        numba's stream object (numba destroys the stream when it is
        collected); ``None`` for the legacy stream.
    """

    __slots__ = ("__weakref__", "device_id", "event", "key", "owner", "stream")

    def __init__(self, stream: int, device_id: int, key: int, owner: weakref.ref[Any] | None) -> None:
        self.stream = stream
        self.device_id = device_id
        self.key = key
        self.owner = owner
        #: The recorded event, once something needed it (then the mark is fixed).
        self.event: _events.Event | None = None

    def record(self) -> _events.Event:
        """The event covering the mark's launches: recorded now, on the mark's stream, unless it was already.

        Raises
        ------
        CoherenceError
            The stream is capturing a CUDA graph: an event recorded there
            would join the user's graph and could not be waited for.
        """
        event = self.event
        if event is not None:
            return event
        owner = self.owner() if self.owner is not None else None  # held until the record is queued
        with _driver.device_context(self.device_id):
            if self.owner is not None and owner is None:
                # numba destroyed the stream with its owner; the launches on it may still run.
                _driver.synchronize_devices({self.device_id}, "waiting for plain launches on a stream destroyed since")
                event = _events.record(0, self.device_id)
            else:
                if _driver.is_capturing(self.stream):
                    raise CoherenceError(
                        f"waiting for plain numba launches on stream {self.stream:#x}: that stream is "
                        "capturing a CUDA graph now, and an event recorded there would join the graph; "
                        "end the capture first (or synchronize the stream before beginning it)"
                    )
                event = _events.record(self.stream, self.device_id, self.key)
        self.event = event
        self.owner = None
        del owner
        return event

    @property
    def handle(self) -> Any:
        """The recorded event's handle (records it first)."""
        return self.record().handle

    def done(self) -> bool:
        """Whether the marked launches have finished (records the event first; never blocks)."""
        return self.record().done()

    def synchronize(self) -> None:
        """Block until the marked launches have finished."""
        self.record().synchronize()


#: The mark that plain launches on a stream share until it is recorded, by handle (numba's
#: streams) or ``-1 - device`` (the legacy stream of a device).  A mark holds its stream's owner
#: weakly: a forgotten stream is collected (and destroyed) as numba intends.
_marks: dict[int, StreamMark] = {}
_MARKS_KEPT = 256


def _current_mark(handle: int, device: int) -> StreamMark | None:
    """The mark a plain launch on ``handle`` files (made if needed); ``None``: the stream gets events."""
    if handle == 0:
        slot = -1 - device
        mark = _marks.get(slot)
        if mark is not None and mark.event is None:
            return mark
        owner = None
    else:
        owned = _driver.owned_stream(handle)
        if owned is None:
            return None
        mark = _marks.get(handle)
        if mark is not None and mark.event is None and mark.owner is not None and mark.owner() is owned[0]():
            return mark
        slot, owner = handle, owned[0]
    if _driver.is_capturing(handle):
        return None  # cuStreamGetId would break the capture; the launch checks it and refuses
    if len(_marks) >= _MARKS_KEPT:
        _marks.clear()  # marks stay valid in the trackers that filed them
    mark = _marks[slot] = StreamMark(handle, device, _driver.stream_key(handle), owner)
    return mark


def _capture_refusal(handle: int) -> str:
    """Why a plain launch of a buffer on capturing stream ``handle`` is refused."""
    if _capture.capturing():
        return (
            f"a plain numba launch of a buffer on stream {handle:#x}, forked into this thread's "
            "umem_numba.capture: a graph's read and write sets hold what the capturing stream's "
            "launches use, so a buffer written on another branch would be replayed untracked; launch "
            "it on the capturing stream"
        )
    return (
        f"a plain numba launch of a buffer on stream {handle:#x}, which is capturing a CUDA graph "
        "umem_numba did not begin: its launches would replay untracked; capture with "
        "`with umem_numba.capture(stream) as graph:` and launch it with graph.launch()"
    )


class PlainLaunch:
    """One plain numba launch of buffers: what it filed, and what it does once numba queued the kernel.

    numba calls the object (appended to ``retr``) after queuing the kernel.
    Built by :meth:`register` for the launch's first buffer argument; the
    others join it.
    """

    __slots__ = (
        "captured",
        "checked",
        "device",
        "eager",
        "handle",
        "key",
        "mark",
        "recorder",
        "stream",
        "trackers",
    )

    #: The simulated driver calls such functions as soon as the kernel is queued (numba's own
    #: copies back wait for the kernel; these need not).
    after_launch = True

    def __init__(self, stream: Any) -> None:
        #: numba's stream object of the launch (the same one for every argument of a launch).
        self.stream = stream
        self.handle = handle = stream_handle(stream, what="a kernel launch")
        self.device = device = _driver.launch_device(handle)
        self.trackers: list[Tracker] = []
        #: Without a mark: per tracker, what :meth:`Tracker.end_plain_launch` needs.
        self.eager: list[tuple[Tracker, tuple[_events.Event, ...], int | None]] = []
        #: This thread's umem_numba.capture of the launch stream: the kernel joins its graph.
        self.recorder = recorder = _capture.recorder_for(handle)
        if recorder is not None:  # nothing is asked of the capturing stream (cuStreamGetId breaks a capture)
            self.mark, self.checked, self.captured, self.key = None, True, True, 0
            return
        # Inside this thread's umem_numba.capture another stream may be forked into it: no mark's
        # fast path (it asks nothing of the stream), the launch checks the stream first.
        self.mark = mark = None if _capture.capturing() else _current_mark(handle, device)
        #: Whether the stream was checked for a capture (once per launch, when needed).
        self.checked = False
        self.captured = False
        if mark is None:
            self._check_capture()
            self.key = 0 if self.captured else _driver.stream_key(handle)
        else:
            self.key = mark.key

    def _check_capture(self) -> bool:
        if not self.checked:
            self.captured = _driver.is_capturing(self.handle)
            self.checked = True
        return self.captured

    @staticmethod
    def register(tracker: Tracker, stream: Any, retr: list[Any], owner: Any = None) -> None:
        """Order numba's launch ``stream`` for a plain launch using ``tracker``'s memory; file it (``retr``).

        ``owner``: the buffer the memory was given as (kept alive by a graph capturing the launch).
        """
        launch = None
        for done in retr:
            if type(done) is PlainLaunch and done.stream is stream:
                launch = done
                break
        if launch is None:
            launch = PlainLaunch(stream)
            retr.append(launch)
        elif tracker in launch.trackers:
            return  # the same allocation twice in one launch: one record
        launch.trackers.append(tracker)
        if launch.recorder is not None:
            launch.recorder.add(tracker, True, owner)  # each replay of the graph files the write
            return
        mark = launch.mark
        if mark is not None and tracker.plain_launch_unchanged(mark):
            return  # the stream's current mark is all the buffer waits for: this launch is under it
        if launch._check_capture():
            raise CoherenceError(_capture_refusal(launch.handle))
        waits, covered, gen = tracker.begin_plain_launch(launch.key, launch.device, mark)
        if mark is None:
            launch.eager.append((tracker, covered, gen))
        for event in waits:
            _driver.call("cuStreamWaitEvent", launch.handle, event.handle, 0, detail="ordering a plain numba launch")
        if mark is not None:
            tracker.supersede(covered, mark)  # the stream now comes after them: the mark implies them
        if tracker.migrate:
            prefetch_touched([tracker], launch.handle, launch.device)

    def __call__(self) -> None:
        # numba calls it once the kernel is queued.
        if self.captured:
            return  # no event inside the user's graph
        mark = self.mark
        if mark is not None:
            if mark.event is None:
                return  # the mark, recorded later, covers the kernel
            # Recorded while this launch registered its buffers (settling one of them): before the
            # kernel.  The kernel gets an event of its own.
            event = _events.record(self.handle, self.device, self.key)
            for tracker in self.trackers:
                tracker.end_plain_launch(event, (), None)
            return
        if self.eager:
            event = _events.record(self.handle, self.device, self.key)
            for tracker, covered, gen in self.eager:
                tracker.end_plain_launch(event, covered, gen)
