"""The same-node descriptor exchange of halo='ipc': who may hand descriptors over, and that none leak (no GPU).

One rank runs here against a stand-in communicator (the other ranks' allgathered
values are given); the other side of each Unix socket is a real process or
thread of this machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from umem_numba.kernels.mpi import _fdpass, distributed
from umem_numba.kernels.mpi._fdpass import FdPassError, exchange_fds, send_fds

pytestmark = pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED"), reason="SO_PEERCRED is Linux's")


class _Comm:
    """Rank ``rank`` of ``len(pids)`` ranks, alone in this process: the others' pids are given, their errors None."""

    def __init__(self, rank: int, pids: list[int]) -> None:
        self.rank = rank
        self.pids = pids

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.pids)

    def bcast(self, value: Any, root: int = 0) -> Any:
        return value

    def allgather(self, value: Any) -> list[Any]:
        if isinstance(value, int) and not isinstance(value, bool):  # the pids
            return [value if r == self.rank else p for r, p in enumerate(self.pids)]
        return [value if r == self.rank else None for r in range(len(self.pids))]  # errors: none elsewhere


def _private_dir(tmp_path: Path) -> Path:
    d = tmp_path / "socks"
    d.mkdir()
    os.chmod(d, 0o700)
    return d


def _listener(path: Path) -> socket.socket:
    """A peer's listening socket: rank 0's connect and send complete without an accept."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(4)
    return s


def _connect_when_listening(path: str, deadline: float = 30.0) -> socket.socket:
    end = time.monotonic() + deadline
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except OSError:
            s.close()
            if time.monotonic() > end:
                raise
            time.sleep(0.01)


_IMPOSTOR = textwrap.dedent(
    """
    import os, socket, sys, time
    from umem_numba.kernels.mpi._fdpass import send_fds

    path = sys.argv[1]
    end = time.monotonic() + 30
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            break
        except OSError:
            s.close()
            if time.monotonic() > end:
                raise
            time.sleep(0.01)
    r, w = os.pipe()
    send_fds(s, [w], {"rank": 1, "note": "I am rank 1"})
    s.settimeout(30)
    s.recv(1)  # until rank 0 lets go
    """
)


@pytest.mark.timeout(120)
def test_fd_exchange_refuses_a_process_posing_as_another_rank(tmp_path: Path) -> None:
    """Issue #19 item 12: a process of this user that claims to be rank 1 but is not gets refused, clearly.

    Before the fix ``accept()`` took the rank from the peer's JSON: any process
    that could reach the socket handed rank 0 descriptors of its choosing as
    rank 1's (exchange_fds returned them).  Now the peer's pid (SO_PEERCRED)
    must be rank 1's allgathered pid.
    """
    d = _private_dir(tmp_path)
    rank1 = _listener(d / "r1.sock")
    impostor = subprocess.Popen([sys.executable, "-c", _IMPOSTOR, str(d / "r0.sock")])
    # Rank 1 is some other process of this machine (our parent); the impostor is not it.
    comm = _Comm(0, [os.getpid(), os.getppid()])
    try:
        with pytest.raises(FdPassError) as info:
            got = exchange_fds(comm, [1], [], {}, timeout=30.0, directory=str(d))
            for fds, _ in got.values():
                for fd in fds:
                    os.close(fd)
        message = str(info.value)
        assert "claiming to be rank 1" in message, message
        assert f"its pid is {impostor.pid}" in message and f"rank 1's pid is {os.getppid()}" in message, message
        assert "refused" in message
    finally:
        rank1.close()
        impostor.wait(timeout=30)
    assert not (d / "r0.sock").exists()  # rank 0 removed its socket


@pytest.mark.timeout(120)
def test_fd_exchange_takes_the_descriptors_of_the_real_rank(tmp_path: Path) -> None:
    """Issue #19 item 12: the process whose pid was allgathered for rank 1 is accepted (only impostors are refused)."""
    d = _private_dir(tmp_path)
    rank1 = _listener(d / "r1.sock")
    r_end, w_end = os.pipe()
    failures: list[BaseException] = []

    def real_rank1() -> None:
        try:
            with _connect_when_listening(str(d / "r0.sock")) as s:
                send_fds(s, [w_end], {"rank": 1, "note": "from rank 1"})
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    sender = threading.Thread(target=real_rank1)
    sender.start()
    try:
        got = exchange_fds(
            _Comm(0, [os.getpid(), os.getpid()]), [1], [], {"note": "from 0"}, timeout=30.0, directory=str(d)
        )
    finally:
        sender.join(30)
        rank1.close()
    assert not failures, failures
    assert list(got) == [1]
    fds, payload = got[1]
    assert payload == {"note": "from rank 1", "rank": 1}
    os.close(w_end)
    token = os.urandom(8)
    os.write(fds[0], token)  # a live duplicate of rank 1's pipe end
    os.close(fds[0])
    assert os.read(r_end, 64) == token
    os.close(r_end)


def test_fd_exchange_refusal_names_uid_and_unknown_ranks() -> None:
    """Issue #19 item 12: the refusals say what was wrong (another user; a rank that is no peer; a second message)."""
    me = os.getpid()
    pids = [me, me + 1, me + 2]
    euid = os.geteuid()
    assert "uid 4242" in _fdpass._refusal(1, pids[1], 4242, [1, 2], pids, {})
    assert "unexpected descriptors from rank 7" in _fdpass._refusal(7, me, euid, [1, 2], pids, {})
    assert "unexpected descriptors from rank '1'" in _fdpass._refusal("1", pids[1], euid, [1, 2], pids, {})
    assert "twice" in _fdpass._refusal(1, pids[1], euid, [1, 2], pids, {1: None})
    posing = _fdpass._refusal(1, pids[2], euid, [1, 2], pids, {})
    assert f"its pid is {pids[2]} (rank 2)" in posing and f"rank 1's pid is {pids[1]}" in posing
    assert _fdpass._refusal(2, pids[2], euid, [1, 2], pids, {}) is None


def _bad_directories(tmp_path: Path) -> list[tuple[str, Path, str]]:
    cases = []
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    cases.append(("mode 0755", shared, "mode 0o755, not 0o700"))
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    cases.append(("mode 0770", group, "mode 0o770, not 0o700"))
    private = tmp_path / "private"
    private.mkdir()
    os.chmod(private, 0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    cases.append(("a symbolic link", link, "is not a directory"))
    cases.append(("missing", tmp_path / "missing", "cannot be used"))
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chmod(theirs, 0o700)
        os.chown(theirs, 65534, 65534)
        cases.append(("another owner", theirs, "owned by uid 65534, not by this user"))
    return cases


def test_fd_exchange_refuses_a_directory_that_is_not_private(tmp_path: Path) -> None:
    """Issue #19 item 12: ``directory=`` must be this user's, mode 0700 (not a link): anything else is refused.

    Before the fix any directory was used: in a shared one another user can
    reach the sockets, or replace one with their own.
    """
    for what, where, message in _bad_directories(tmp_path):
        with pytest.raises(FdPassError, match=message):
            exchange_fds(_Comm(0, [os.getpid()]), [], [], {}, directory=str(where))
        assert not (where / "r0.sock").exists(), what
    ok = _private_dir(tmp_path)
    assert exchange_fds(_Comm(0, [os.getpid()]), [], [], {}, directory=str(ok)) == {}
    assert exchange_fds(_Comm(0, [os.getpid()]), [], [], {}) == {}  # its own private directory


# ---------------------------------------------------------------------------
# Item 13: the descriptors received are closed whatever the mapping does


class _Outbox:
    def __init__(self) -> None:
        self.fd = os.memfd_create("outbox")
        self.closed = False

    def export_fds(self) -> list[tuple[int, int]]:
        return [(os.dup(self.fd), 4096)]

    def close(self) -> None:
        self.closed = True
        os.close(self.fd)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
@pytest.mark.parametrize("failing", [0, 2])
def test_ipc_setup_closes_every_received_fd_when_a_mapping_fails(monkeypatch: pytest.MonkeyPatch, failing: int) -> None:
    """Issue #19 item 13: mapping one neighbour's outbox fails: the descriptors of every neighbour are closed.

    Before the fix a failure on the first peer skipped the loop's later peers,
    whose descriptors stayed open (a leak per failed set-up).
    """
    import umem_numba as um
    from umem_numba import _driver

    rh = object.__new__(distributed.RankHeat)
    rh.comm = _Comm(1, [os.getpid()] * 3)
    rh.rank = 1
    rh.bands = (SimpleNamespace(peer=0), SimpleNamespace(peer=2))
    rh.decomp = SimpleNamespace(shape=(12, 8))
    rh.dtype = np.dtype(np.float32)
    rh._ipc_in = {}
    rh._outbox = None
    outbox = _Outbox()
    monkeypatch.setattr(_driver, "ensure_context", lambda: 0)
    monkeypatch.setattr(_driver, "device_attribute", lambda name, dev: 1)
    monkeypatch.setattr(um.VMMBuffer, "empty", classmethod(lambda cls, *a, **k: outbox))
    monkeypatch.setattr(distributed, "_device_uuid", lambda dev: "00" * 16)

    before = _open_fds()
    received: dict[int, tuple[list[int], dict[str, Any]]] = {}

    def fake_exchange(comm, peers, fds, payload, *, timeout, directory=None):
        assert peers == [0, 2]
        for peer in peers:
            r, w = os.pipe()
            received[peer] = ([r, w, os.memfd_create(f"from{peer}")], {"rank": peer})
        return received

    mapped: list[int] = []

    class _Mapped:
        def close(self) -> None:
            pass

    def fake_map(self, peer, fds, theirs):
        if peer == failing:
            raise RuntimeError(f"cannot map rank {peer}'s outbox")
        mapped.append(peer)
        return _Mapped()

    monkeypatch.setattr(_fdpass, "exchange_fds", fake_exchange)
    monkeypatch.setattr(distributed.RankHeat, "_map_neighbour", fake_map)
    with pytest.raises(distributed.HaloSetupError, match=f"cannot map rank {failing}'s outbox"):
        rh._setup_ipc(5.0)
    assert mapped == ([] if failing == 0 else [0])
    assert outbox.closed
    leaked = _open_fds() - before
    assert not leaked, f"descriptors left open: {sorted(leaked)} (received: {received})"
    for fds, _ in received.values():
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
