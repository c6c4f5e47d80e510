"""The same-node halo path's CPU pieces on real MPI ranks (a helper of tests/kernels/test_mpi.py).

    mpirun -np N python tests/support/mpi_ipc_worker.py fds          # descriptors really pass between ranks
    mpirun -np 2 python tests/support/mpi_ipc_worker.py fds-fail     # rank 1 fails: every rank raises, none hangs
    mpirun -np N python tests/support/mpi_ipc_worker.py two-nodes ARGS...   # heat2d_mpi.py ARGS, ranks as if on N nodes

``fds``: each rank passes a memfd holding a message and the write end of a
pipe to its neighbours (``kernels.mpi._fdpass.exchange_fds``); each checks the
memfd's contents it received, writes into the neighbour's pipe through the
received descriptor, and after a barrier reads its own pipe to its end: the
descriptors are live in the other process.  ``two-nodes`` replaces the
shared-memory split (``kernels.mpi.comm.node_ranks``) by one node per rank and runs
the example's ``main``.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from mpi4py import MPI

from umem_numba.kernels.mpi import comm as mpi_comm
from umem_numba.kernels.mpi._fdpass import FdPassError, exchange_fds


def _peers(rank: int, size: int) -> list[int]:
    return [r for r in (rank - 1, rank + 1) if 0 <= r < size]


def fds() -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    peers = _peers(rank, size)
    memfd = os.memfd_create(f"rank{rank}")
    os.write(memfd, f"memory of rank {rank}".encode())
    r_end, w_end = os.pipe()
    got = exchange_fds(comm, peers, [memfd, w_end], {"note": f"hello from {rank}"}, timeout=30.0)
    os.close(memfd)
    os.close(w_end)  # the neighbours hold their own duplicates
    assert sorted(got) == peers, got
    for peer, (their, payload) in got.items():
        assert payload == {"note": f"hello from {peer}", "rank": peer}, payload
        assert len(their) == 2 and all(fd > 2 for fd in their), their
        assert os.pread(their[0], 64, 0) == f"memory of rank {peer}".encode()
        os.write(their[1], f"{rank}->{peer};".encode())
        for fd in their:
            os.close(fd)
    comm.Barrier()  # every rank wrote and closed its duplicates: this pipe has no writer left
    data = b""
    while chunk := os.read(r_end, 4096):
        data += chunk
    os.close(r_end)
    seen = sorted(x for x in data.decode().split(";") if x)
    assert seen == sorted(f"{p}->{rank}" for p in peers), seen
    print(f"rank {rank}: descriptors from {peers} passed and live", flush=True)
    return 0


def fds_fail() -> int:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    r_end, w_end = os.pipe()
    bad = 1 << 20  # not an open descriptor: sendmsg fails with EBADF on rank 1
    try:
        exchange_fds(comm, _peers(rank, comm.Get_size()), [bad if rank == 1 else w_end], {}, timeout=20.0)
    except FdPassError as exc:
        print(f"rank {rank}: FdPassError: {exc}", flush=True)
        return 0
    finally:
        os.close(r_end)
        os.close(w_end)
    print(f"rank {rank}: no error", flush=True)
    return 1


def two_nodes(argv: list[str]) -> int:
    mpi_comm.node_ranks = lambda c: [int(c.Get_rank())]
    example = Path(__file__).resolve().parents[2] / "examples" / "heat2d_mpi.py"
    module = runpy.run_path(str(example), run_name="heat2d_mpi")
    return int(module["main"](argv))


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "fds":
        sys.exit(fds())
    if mode == "fds-fail":
        sys.exit(fds_fail())
    if mode == "two-nodes":
        sys.exit(two_nodes(sys.argv[2:]))
    sys.exit(f"unknown mode {mode!r}")
