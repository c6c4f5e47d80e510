"""MPI communication the ranks share (mpi4py): CUDA-awareness, errors known to every rank, node layout.

Every function takes the communicator; importing this module imports
neither mpi4py nor numba's CUDA driver.  :mod:`.distributed` (the heat step
on ranks) and :mod:`._fdpass` (descriptor passing) build on it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["collective_errors", "cuda_aware_mpi", "ipc_unavailable", "local_rank", "mismatch", "node_ranks"]


def cuda_aware_mpi(
    environ: Mapping[str, str] | None = None, libraries: Sequence[Any] | None = None
) -> tuple[bool, str]:
    """Whether the MPI library that mpi4py runs on accepts CUDA device buffers.

    Asks the library itself, after ``MPI_Init``: Open MPI's
    ``MPIX_Query_cuda_support()`` (also in MPICH 4), else MPICH's
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``.  The environment
    variable ``UMEM_MPI_CUDA_AWARE=0`` or ``1`` overrides the answer.

    Parameters
    ----------
    environ : mapping, optional
        Environment to read the override from (``os.environ``).
    libraries : sequence, optional
        Objects to look the query functions up on (attributes, as on a
        ``ctypes.CDLL``); by default the library mpi4py loaded.

    Returns
    -------
    (aware, how) : (bool, str)
        The answer and how it was found, for logs.
    """
    env = os.environ if environ is None else environ
    forced = env.get("UMEM_MPI_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"UMEM_MPI_CUDA_AWARE={forced}"
    if libraries is None:
        libraries = _mpi_libraries()
    for lib in libraries:
        fn = _symbol(lib, "MPIX_Query_cuda_support")
        if fn is not None:
            value = int(fn())
            return value == 1, f"MPIX_Query_cuda_support() returned {value}"
        fn = _symbol(lib, "MPIX_GPU_query_support")
        if fn is not None:
            flag = ctypes.c_int(0)
            err = int(fn(0, ctypes.byref(flag)))  # 0 == MPIX_GPU_SUPPORT_CUDA
            if err == 0:
                return flag.value == 1, f"MPIX_GPU_query_support(CUDA) gave {flag.value}"
    return False, (
        "the MPI library has no CUDA-awareness query (MPIX_Query_cuda_support, "
        "MPIX_GPU_query_support): using pinned host buffers"
    )


def _symbol(lib: Any, name: str) -> Any:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return None
    try:
        fn.restype = ctypes.c_int
    except AttributeError:  # a plain Python callable (tests)
        pass
    return fn


def _mpi_libraries() -> list[Any]:
    """The mpi4py extension module as a ctypes library: dlsym searches libmpi behind it."""
    try:
        from mpi4py import MPI

        return [ctypes.CDLL(MPI.__file__, mode=ctypes.RTLD_GLOBAL)]
    except (ImportError, OSError):
        return []


def collective_errors(comm: Any, error: str | None) -> list[str]:
    """Every rank's error (``None`` if it has none), known to every rank: ``'rank R: message'`` lines.

    A collective: call it on every rank, before any halo exchange, so that a
    problem on one rank stops all of them instead of leaving the others
    waiting for a message that never comes.
    """
    errors = comm.allgather(error)
    by_message: dict[str, list[int]] = {}
    for r, e in enumerate(errors):
        if e:
            by_message.setdefault(str(e), []).append(r)
    return [
        f"{'all ranks' if len(rs) == len(errors) > 1 else 'rank ' + ', '.join(map(str, rs))}: {e}"
        for e, rs in by_message.items()
    ]


def mismatch(comm: Any, config: Mapping[str, Any]) -> str | None:
    """A message if ``config`` differs between ranks (collective), else None."""
    configs = comm.allgather(dict(config))
    differ = sorted({k for c in configs for k in c if any(c2.get(k) != configs[0].get(k) for c2 in configs)})
    if not differ:
        return None
    per = "; ".join(f"{k}: " + ", ".join(f"rank {r}={c.get(k)!r}" for r, c in enumerate(configs)) for k in differ)
    return f"the ranks were started with different settings ({per})"


def local_rank(comm: Any) -> int:
    """This rank's index among the ranks on its node (``MPI_COMM_TYPE_SHARED``)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return int(node.Get_rank())
    finally:
        node.Free()


def node_ranks(comm: Any) -> list[int]:
    """The ranks of ``comm`` on this rank's node, in order (collective: ``MPI_COMM_TYPE_SHARED``)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return sorted(int(r) for r in node.allgather(int(comm.Get_rank())))
    finally:
        node.Free()


def ipc_unavailable(comm: Any) -> str | None:
    """Why ``halo="ipc"`` cannot run on the ranks of ``comm``, or None (collective; same answer on every rank).

    The path needs every rank on one node (shared-memory ``MPI_COMM_TYPE_SHARED``
    split): file descriptors cannot cross nodes.  Device support (VMM, POSIX
    descriptor export, peer access) is checked when :class:`RankHeat` sets up.
    """
    from mpi4py import MPI

    size = comm.Get_size()
    counts = comm.allgather(len(node_ranks(comm)))
    if all(c == size for c in counts):
        return None
    hosts = comm.allgather(MPI.Get_processor_name())
    if len(set(hosts)) > 1:
        where = f"on {len(set(hosts))} nodes (" + ", ".join(f"{h}: {hosts.count(h)}" for h in dict.fromkeys(hosts))
        where += " ranks)"
    else:
        groups = ", ".join(map(str, sorted(set(counts))))
        where = f"not on one node (MPI's shared-memory split gives groups of {groups} rank(s))"
    return (
        f"--halo ipc (halo='ipc') needs every rank on one node, but the {size} ranks are {where}: the file "
        "descriptors of exported GPU memory reach only processes of the same node; use --halo mpi"
    )
