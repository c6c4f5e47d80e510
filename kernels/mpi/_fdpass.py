"""File descriptors between the MPI ranks of one node: ``SCM_RIGHTS`` over Unix sockets.

Used by the same-node halo path of :class:`~umem_numba.kernels.mpi.distributed.RankHeat`
(``halo="ipc"``): a rank exports the VMM memory its neighbours read as POSIX
file descriptors (:meth:`umem_numba.VMMBuffer.export_fds`), and a descriptor
is a number that means something only in its own process.  Passing it as
``SCM_RIGHTS`` ancillary data of a message on an ``AF_UNIX`` socket makes the
kernel install a duplicate in the receiving process.

Why ``SCM_RIGHTS`` and not ``pidfd_getfd(2)``: ``pidfd_getfd`` lets a process
take a descriptor out of another one by number, but it needs
``PTRACE_MODE_ATTACH`` rights over that process, which the Yama LSM
(``kernel.yama.ptrace_scope >= 1``, the default on Ubuntu) and container
runtimes without ``CAP_SYS_PTRACE`` deny between sibling processes such as
MPI ranks; it also needs Linux 5.6.  ``SCM_RIGHTS`` needs only a socket both
processes can reach, works on every Linux kernel and under any ptrace
policy, and the sender decides what it gives away.

Rendezvous: rank 0 creates a private directory (``tempfile.mkdtemp``, mode
0700, so only this user's processes can connect), broadcasts its path, every
rank listens on ``<dir>/r<rank>.sock``, and after a collective check that all
of them listen each rank connects to its peers and sends.  A ``directory=``
given by the caller must be a directory owned by this user with mode 0700,
or it is refused.  The ranks' process ids are allgathered first; a connection
is accepted only from a process of this user (``SO_PEERCRED``) whose pid is
the pid of the rank its message claims to come from, so another process of
the node cannot pose as a rank and hand over descriptors of its choosing.  A connect to a
listening Unix socket completes without the peer's ``accept`` and a small
message fits in the socket buffer, so no rank waits for another to send; each
then accepts one connection per peer.  Every socket operation has a timeout,
and every step ends in a collective error check, so a failure on one rank
raises :class:`FdPassError` on all of them instead of leaving any waiting.
Each rank removes its socket; rank 0 removes the directory at the end.

Nothing here touches a GPU: the CPU tests pass pipes and memfds between real
MPI ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from .comm import collective_errors

__all__ = ["MAX_FDS", "FdPassError", "exchange_fds", "recv_fds", "send_fds"]

#: Most descriptors one message carries (a VMM export is one per chunk: a few).
MAX_FDS = 64
#: Length prefix of the JSON body.
_HEADER = struct.Struct("<I")
#: Longest JSON body accepted (the payload is a few hundred bytes of metadata).
_MAX_BODY = 1 << 20
#: ``sockaddr_un.sun_path`` holds 108 bytes with its terminating NUL on Linux.
_MAX_PATH = 107


class FdPassError(RuntimeError):
    """Passing descriptors failed on at least one rank; raised on every rank (the message names them)."""


def send_fds(sock: socket.socket, fds: Sequence[int], payload: Mapping[str, Any]) -> None:
    """Send ``fds`` and a JSON-able ``payload`` over a connected ``AF_UNIX`` stream socket.

    The descriptors travel as ``SCM_RIGHTS`` ancillary data
    (:func:`socket.send_fds`); the receiver gets duplicates.  The caller still
    owns its own descriptors (close them when no longer needed).

    Parameters
    ----------
    sock : socket.socket
        A connected ``AF_UNIX`` ``SOCK_STREAM`` socket.
    fds : sequence of int
        Open descriptors, at most :data:`MAX_FDS`.
    payload : mapping
        Metadata for the receiver (sizes, shapes, who sends); JSON-encoded.

    Raises
    ------
    ValueError
        Too many descriptors, or a payload too large.
    OSError
        The socket failed (``TimeoutError`` past the socket's timeout).
    """
    fds = [int(fd) for fd in fds]
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} descriptors per message, got {len(fds)}")
    body = json.dumps({"nfds": len(fds), "payload": dict(payload)}).encode()
    if len(body) > _MAX_BODY:
        raise ValueError(f"the payload is {len(body)} bytes encoded; at most {_MAX_BODY}")
    data = _HEADER.pack(len(body)) + body
    # The descriptors ride on the first bytes; sendmsg on a stream socket may send part of the data.
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_fds(sock: socket.socket, *, max_fds: int = MAX_FDS) -> tuple[list[int], dict[str, Any]]:
    """Receive what :func:`send_fds` sent: ``(fds, payload)``; the caller owns (and closes) the fds.

    Parameters
    ----------
    sock : socket.socket
        A connected ``AF_UNIX`` ``SOCK_STREAM`` socket.
    max_fds : int
        Most descriptors accepted; a message with more is refused (the
        kernel drops the rest, ``MSG_CTRUNC``).

    Returns
    -------
    (list of int, dict)
        The new descriptors, in the order sent, and the payload.

    Raises
    ------
    ConnectionError
        The sender closed the socket early, sent more descriptors than
        ``max_fds``, or a message that is not :func:`send_fds`'s.  Any
        descriptors received are closed first.
    OSError
        The socket failed (``TimeoutError`` past the socket's timeout).
    """
    msg, fds, flags, _ = socket.recv_fds(sock, 1 << 16, max_fds)
    try:
        if flags & getattr(socket, "MSG_CTRUNC", 0):
            raise ConnectionError(f"the message carried more than {max_fds} descriptors (the rest were dropped)")
        while len(msg) < _HEADER.size:
            more = sock.recv(_HEADER.size - len(msg))
            if not more:
                raise ConnectionError("the sender closed the socket before its message was complete")
            msg += more
        (size,) = _HEADER.unpack_from(msg)
        if size > _MAX_BODY:
            raise ConnectionError(f"the message announces a {size}-byte body; at most {_MAX_BODY}")
        body = msg[_HEADER.size :]
        while len(body) < size:
            more = sock.recv(size - len(body))
            if not more:
                raise ConnectionError("the sender closed the socket before its message was complete")
            body += more
        try:
            data = json.loads(body[:size].decode())
            nfds, payload = int(data["nfds"]), data["payload"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConnectionError(f"not a descriptor message ({type(exc).__name__}: {exc})") from exc
        if nfds != len(fds):
            raise ConnectionError(f"the sender announced {nfds} descriptors, {len(fds)} arrived")
        if not isinstance(payload, dict):
            raise ConnectionError(f"the payload is a {type(payload).__name__}, not an object")
    except BaseException:
        _close_all(fds)
        raise
    return list(fds), payload


def exchange_fds(
    comm: Any,
    peers: Sequence[int],
    fds: Sequence[int],
    payload: Mapping[str, Any],
    *,
    timeout: float = 60.0,
    directory: str | None = None,
) -> dict[int, tuple[list[int], dict[str, Any]]]:
    """Give each peer rank this rank's ``fds`` and ``payload``; get each peer's (collective).

    Every rank of ``comm`` must call it, with its own peers (the relation
    must be symmetric: ``j`` in rank ``i``'s peers exactly when ``i`` is in
    ``j``'s), and all ranks must be on one node.  See the module notes for
    the protocol.

    Parameters
    ----------
    comm : mpi4py communicator
    peers : sequence of int
        Ranks to exchange with (possibly none: the rank still takes part).
    fds : sequence of int
        Descriptors to give every peer (duplicated; the caller keeps and closes its own).
    payload : mapping
        JSON-able metadata sent with them; ``"rank"`` is added.
    timeout : float
        Seconds any one socket operation may take.
    directory : str, optional
        Where the sockets go: an existing directory, owned by this user with
        mode 0700, reachable by every rank; default: a new private directory
        made by rank 0 and removed at the end.

    Returns
    -------
    dict
        peer rank -> ``(fds, payload)``: the peer's descriptors, new in this
        process (the caller closes them), and its payload.

    Raises
    ------
    FdPassError
        On every rank, when any rank failed (the message has one line per
        distinct error, naming the ranks): among others a ``directory`` that
        is not private to this user, or a connection from a process that is
        not the rank it claims to be.
    """
    rank = int(comm.Get_rank())
    peers = sorted({int(p) for p in peers})
    own_dir = directory is None
    where: str | None = directory
    error: str | None = None
    if own_dir and rank == 0:
        try:
            where = tempfile.mkdtemp(prefix="umem-fds-")
        except OSError as exc:
            error = f"cannot create a directory for the sockets: {exc}"
    if own_dir:
        where = comm.bcast(where, root=0)
    # Who each rank is, for the SO_PEERCRED check of every connection accepted below.
    pids = [int(p) for p in comm.allgather(os.getpid())]
    server: socket.socket | None = None
    path = ""
    got: dict[int, tuple[list[int], dict[str, Any]]] = {}
    try:
        if error is None and where is not None:
            path = os.path.join(where, f"r{rank}.sock")
            error = _directory_error(where) or _listen_error(path)
            if error is None:
                server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    server.bind(path)
                    server.listen(len(peers) + 1)
                    server.settimeout(timeout)
                except OSError as exc:
                    error = f"cannot listen on {path}: {exc}"
        elif error is None:
            error = "rank 0 could not create a directory for the sockets"
        _raise_collective(comm, error, "listening")
        assert server is not None and where is not None
        try:
            message = {**dict(payload), "rank": rank}
            for peer in peers:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.settimeout(timeout)
                    c.connect(os.path.join(where, f"r{peer}.sock"))
                    send_fds(c, fds, message)
            for _ in peers:
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(timeout)
                    pid, uid = _peer_credentials(conn)
                    their_fds, theirs = recv_fds(conn)
                sender = theirs.get("rank")
                refused = _refusal(sender, pid, uid, peers, pids, got)
                if refused:
                    _close_all(their_fds)
                    raise ConnectionError(refused)
                got[int(sender)] = (their_fds, theirs)
        except (OSError, ValueError) as exc:  # ConnectionError and TimeoutError are OSErrors
            error = f"passing descriptors to/from ranks {peers} failed: {type(exc).__name__}: {exc}"
        finally:
            server.close()
            server = None
            _unlink(path)
        _raise_collective(comm, error, "passing")
    except BaseException:
        for their_fds, _ in got.values():
            _close_all(their_fds)
        raise
    finally:
        if server is not None:
            server.close()
            _unlink(path)
        # Every rank has unlinked its socket before the last collective check (or failed to listen).
        if own_dir and rank == 0 and where is not None:
            shutil.rmtree(where, ignore_errors=True)
    return got


def _directory_error(where: str) -> str | None:
    """Why the socket directory is unsafe (None if it is a directory of this user's, mode 0700)."""
    try:
        st = os.lstat(where)
    except OSError as exc:
        return f"the socket directory {where!r} cannot be used: {exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"the socket directory {where!r} is not a directory (a symbolic link is refused too)"
    euid = os.geteuid()
    if st.st_uid != euid:
        return (
            f"the socket directory {where!r} is owned by uid {st.st_uid}, not by this user (uid {euid}): "
            "another user could replace the sockets in it"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        return (
            f"the socket directory {where!r} has mode {mode:#o}, not 0o700: other users could reach or "
            "replace the sockets in it (chmod 700 it, or leave directory= unset)"
        )
    return None


def _peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process that connected (``SO_PEERCRED``, recorded by the kernel at connect)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    return pid, uid


def _refusal(
    sender: Any, pid: int, uid: int, peers: Sequence[int], pids: Sequence[int], got: Mapping[int, Any]
) -> str | None:
    """Why the descriptors of process ``pid``/``uid``, claiming to be rank ``sender``, are refused (None: taken)."""
    euid = os.geteuid()
    if uid != euid:
        return f"a process of uid {uid} (pid {pid}) connected, not one of this user (uid {euid}): refused"
    if not isinstance(sender, int) or isinstance(sender, bool) or sender not in peers:
        return f"unexpected descriptors from rank {sender!r} (pid {pid}; peers: {list(peers)})"
    if sender in got:
        return f"rank {sender} sent its descriptors twice (the second time from pid {pid})"
    if pids[sender] != pid:
        owner = [r for r, p in enumerate(pids) if p == pid]
        who = f"rank {owner[0]}" if owner else "not a rank of this communicator"
        return (
            f"a process claiming to be rank {sender} connected, but its pid is {pid} ({who}) and rank "
            f"{sender}'s pid is {pids[sender]}: refused (ranks in different PID namespaces cannot use halo='ipc')"
        )
    return None


def _listen_error(path: str) -> str | None:
    if len(os.fsencode(path)) > _MAX_PATH:
        return (
            f"the socket path {path!r} is longer than a Unix socket address allows ({_MAX_PATH} bytes): "
            "set TMPDIR to a shorter directory"
        )
    return None


def _raise_collective(comm: Any, error: str | None, what: str) -> None:
    """Every rank's error known to every rank; :class:`FdPassError` on all of them if any."""
    errors = collective_errors(comm, error)
    if errors:
        raise FdPassError(f"{what} (SCM_RIGHTS over Unix sockets): " + "; ".join(errors))


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _unlink(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass
