"""Coherence tracking: host code never touches memory that device work may still use.

Every allocation owns a :class:`Tracker` (this module sits below the buffers;
launching, which files work under trackers, sits above them in
:mod:`umem_numba._launch`).  Launches through
:func:`launch`, :func:`coherent` or :func:`jit` record one CUDA event on the
launch stream and file it under every buffer argument (views included), with
no host synchronisation on the launch path.  Host access (``.host``,
``np.asarray``, copies to the host, ``close``) first *settles* the tracker:
under the default ``"sync"`` policy it waits on exactly those events, not on
the whole device.

A launch that bypasses the toolkit (a plain ``kernel[grid, block](buf)``) is
still seen: numba reads the buffer's type and device pointer while launching,
and that marks the allocation as used on an *unknown* stream; the next host
access then synchronises the buffer's whole context (``"sync"``) or raises.

Policies
--------
``"sync"`` (default)
    wait for the pending work, then proceed.
``"raise"``
    raise :class:`~umem_numba.CoherenceError` naming the busy stream.
``"warn"``
    emit a :class:`CoherenceWarning` and proceed without waiting.
``"off"``
    no check at all.

The policy in force for a buffer is its own (``buf.coherence_policy``) if set,
else the innermost ``with coherence_policy(...)`` block of the calling
thread, else the global default (:func:`set_coherence_policy`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from collections.abc import Iterator

from . import _driver, _events
from ._errors import CoherenceError

__all__ = [
    "POLICIES",
    "CoherenceWarning",
    "Tracker",
    "check_policy",
    "coherence_policy",
    "get_coherence_policy",
    "set_coherence_policy",
]

POLICIES = ("sync", "raise", "warn", "off")


class CoherenceWarning(RuntimeWarning):
    """Host access to a buffer with device work that may still be running."""


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown coherence policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return policy


_global_policy = "sync"
_block_policy: contextvars.ContextVar[str | None] = contextvars.ContextVar("umem_coherence_policy", default=None)


def set_coherence_policy(policy: str) -> None:
    """Set the process-wide default coherence policy.

    Parameters
    ----------
    policy : {"sync", "raise", "warn", "off"}
    """
    global _global_policy
    _global_policy = check_policy(policy)


def get_coherence_policy() -> str:
    """The policy in force here: the innermost ``with`` block's, else the global one."""
    return _block_policy.get() or _global_policy


@contextlib.contextmanager
def coherence_policy(policy: str) -> Iterator[str]:
    """Use ``policy`` for host accesses inside the ``with`` block (this thread/task only).

    Examples
    --------
    >>> with umem_numba.coherence_policy("raise"):  # doctest: +SKIP
    ...     buf.host  # CoherenceError if a kernel may still write buf
    """
    token = _block_policy.set(check_policy(policy))
    try:
        yield policy
    finally:
        _block_policy.reset(token)


class _LaunchFlag(threading.local):
    active = False


#: True on a thread while the toolkit itself launches: numba's reads of the
#: buffers' types then are ours and must not mark an unknown-stream launch.
_launching = _LaunchFlag()


class Tracker:
    """Outstanding device work and host holds of one allocation.

    Parameters
    ----------
    device_id : int
        The device whose context the allocation belongs to.
    concurrent : bool
        The device's concurrentManagedAccess: without it *any* running kernel
        makes host access to managed memory fault, so settling waits for the
        whole context.
    """

    __slots__ = (
        "_lock",
        "attached",
        "concurrent",
        "device_id",
        "holds",
        "pending",
        "policy",
        "unknown",
    )

    def __init__(self, device_id: int, concurrent: bool = True) -> None:
        self.pending: dict[int, _events.Event] = {}
        self.unknown = False
        self.holds = 0
        self.policy: str | None = None
        self.device_id = device_id
        self.concurrent = concurrent
        #: None (attached globally), "host", or the stream handle it is attached to.
        self.attached: str | int | None = None
        self._lock = threading.Lock()

    # -- device side ----------------------------------------------------------
    def on_device_export(self) -> None:
        """numba (or another consumer) took the device view outside the toolkit."""
        if _launching.active:
            return
        if self.holds:
            raise CoherenceError("a kernel launch (or other device use) was attempted while the host "
                                 "holds this buffer (inside `with buf.on_host()`)")
        self.unknown = True

    def add(self, stream: int, event: _events.Event) -> None:
        """File ``event`` as the latest work on ``stream`` (supersedes the previous one)."""
        self.pending[stream] = event

    # -- host side ------------------------------------------------------------
    def effective_policy(self) -> str:
        return self.policy or _block_policy.get() or _global_policy

    def before_host_access(self, what: str) -> None:
        """Settle before host code reads or writes the memory."""
        if not self.pending and not self.unknown and self.concurrent:
            return
        self.settle(what, self.effective_policy())

    def _extra_wait(self, unknown: bool) -> str | int | None:
        """Beyond recorded events, what host access must also wait for.

        ``"context"`` after an unknown-stream launch, or on a device without
        concurrentManagedAccess for globally attached memory (any running
        kernel makes host access fault there); a stream handle for memory
        attached to one stream on such a device; else ``None``.
        """
        if unknown:
            return "context"
        if self.concurrent or self.attached == "host":
            return None
        return "context" if self.attached is None else self.attached

    def settle(self, what: str, policy: str) -> None:
        if policy == "off":
            return
        with self._lock:
            busy = []
            for stream, event in list(self.pending.items()):
                if event.done():
                    del self.pending[stream]
                else:
                    busy.append((stream, event))
            unknown = self.unknown
        extra = self._extra_wait(unknown)
        if not busy and extra is None:
            return
        if policy in ("raise", "warn") and (busy or unknown):
            if busy:
                streams = ", ".join(f"{s:#x}" if s else "0 (default)" for s, _ in busy)
                msg = f"{what}: kernel work on stream(s) {streams} may still be using this buffer"
            else:
                msg = (f"{what}: a kernel was launched on this buffer outside umem_numba (stream unknown); "
                       "launch through umem_numba.launch/coherent/jit or call buf.synchronize() first")
            if policy == "raise":
                raise CoherenceError(msg)
            warnings.warn(msg, CoherenceWarning, stacklevel=4)
            if extra is None or unknown:
                return
        # The no-concurrent-access rule is enforced under every policy but "off":
        # breaking it is a segmentation fault, not a stale read.
        self.wait(busy, extra)

    def wait(self, busy: list | None = None, extra: str | int | None = "context") -> None:
        """Block until the recorded work, and ``extra`` (see :meth:`_extra_wait`), is done."""
        if busy is None:
            with self._lock:
                busy = list(self.pending.items())
        for _, event in busy:
            event.synchronize()
        if extra is not None:
            with _driver.device_context(self.device_id):
                if extra == "context":
                    _driver.call("cuCtxSynchronize", detail="waiting for device work on a buffer")
                else:
                    _driver.call("cuStreamSynchronize", extra,
                                 detail="waiting for the stream this buffer is attached to")
        with self._lock:
            for stream, event in busy:
                if self.pending.get(stream) is event:
                    del self.pending[stream]
            if extra == "context":
                self.unknown = False

    def order_before(self, stream: int, what: str) -> None:
        """Make ``stream`` wait (on the device) for work recorded on other streams.

        Work on an unknown stream cannot be ordered against: it is settled on
        the host first.
        """
        if self.holds:
            raise CoherenceError(f"{what}: the buffer is held by the host (inside `with buf.on_host()`)")
        if self.unknown:
            self.settle(what, self.effective_policy())
        with self._lock:
            events = [e for s, e in self.pending.items() if s != stream]
        for event in events:
            _driver.call("cuStreamWaitEvent", stream, event.handle, 0, detail=what)

    def hold(self, what: str) -> None:
        self.before_host_access(what)
        with self._lock:
            self.holds += 1

    def release_hold(self) -> None:
        with self._lock:
            self.holds -= 1

    def busy_streams(self) -> list[int]:
        """Streams with launches not yet known to be finished."""
        with self._lock:
            return [s for s, e in self.pending.items() if not e.done()]
