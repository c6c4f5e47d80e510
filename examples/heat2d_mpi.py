#!/usr/bin/env python3
"""Heat flow across a plate on several MPI ranks: one slab of rows per rank (and GPU).

    mpirun -np 2 python examples/heat2d_mpi.py --size 4096 --steps 500
    mpirun -np 2 python examples/heat2d_mpi.py --cpu --size 256 --steps 50 --check   # no GPU
    mpiexec -n 2 python examples/heat2d_mpi.py ...    # MPICH: see README (MPI)

(as root, Open MPI also wants ``--allow-run-as-root``; more ranks than cores,
``--oversubscribe``).  Each rank takes the GPU ``local_rank % GPUs`` of its
node, so ranks share GPUs when there are fewer GPUs than ranks.

Per step each rank queues its slab step first, then computes the two rows its
neighbours need with small launches on a second, high-priority stream (from
the rows received the step before), sends them with non-blocking MPI, and
writes them over the slab step's edge rows: the messages travel while the
next slab step runs (``umem_numba.kernels.mpi``).  On the GPU a step is two
CUDA graph launches, one per stream, and the messages are persistent MPI
requests, so that the host keeps ahead of the GPU (``--launches``: every
launch and copy issued from the host, for comparison).  Where the
MPI library is CUDA-aware (``MPIX_Query_cuda_support``; override with
``UMEM_MPI_CUDA_AWARE=0/1``) the halo rows go from device buffers directly,
otherwise through ``umem_numba.PinnedBuffer`` staging.  With ``--halo ipc``
(every rank on one node) no row goes through MPI or host memory: each rank
exports a small VMM buffer holding the rows its neighbours need, passes its
file descriptors to them over a Unix socket (``SCM_RIGHTS``), and reads
theirs in place, device to device; 8-byte MPI messages order the ranks.
Rank 0 gathers the plate and writes a PNG (matplotlib if installed, else
umem_numba's writer).

The slabs are aligned to the kernel's strips (``umem_numba.kernels.decomp``),
so the plate is bitwise the one-GPU (``--cpu``: one-rank NumPy) result;
``--check`` verifies that on rank 0.  Bad input (a grid with fewer rows than
ranks, ranks started with different settings, a rank without a GPU,
``--halo ipc`` with ``--cpu`` or on ranks of several nodes) is reported by
every rank, and all ranks exit with status 2, before any halo moves.
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import sys
import time
from typing import Any

import numpy as np


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="heat2d_mpi.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=int, default=4096, metavar="N", help="plate side (default 4096)")
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        metavar="N",
        help="plate height if different from --size (e.g. weak scaling: rows per rank x ranks)",
    )
    p.add_argument("--steps", type=int, default=200, metavar="N", help="time steps (default 200)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--alpha", type=float, default=0.25, help="diffusion number, stable up to 0.25")
    p.add_argument(
        "--init",
        choices=("discs", "random"),
        default="discs",
        help="starting plate: hot discs and a hot left edge, or random values (--seed)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="NumPy reference kernels, no GPU")
    p.add_argument(
        "--staging",
        choices=("auto", "pinned", "device"),
        default="auto",
        help="--halo mpi buffers: auto (device if MPI is CUDA-aware, else pinned), or force one",
    )
    p.add_argument(
        "--halo",
        choices=("mpi", "ipc"),
        default="mpi",
        help="how halo rows move: mpi (messages, --staging) or ipc (ranks of one node read their "
        "neighbours' exported GPU memory in place; GPU only)",
    )
    issue = p.add_mutually_exclusive_group()
    issue.add_argument(
        "--graphs",
        dest="launches",
        action="store_false",
        default=False,
        help="GPU (the default): a step as two CUDA graph launches, the last step's edge-row fix-ups and the "
        "slab kernel on one stream, the edge bands and rows out on the other; messages as persistent requests",
    )
    issue.add_argument(
        "--launches",
        action="store_true",
        help="GPU: issue every kernel launch, copy and event of a step from the host, and post each step's "
        "messages anew (the schedule before graph steps; for comparison)",
    )
    p.add_argument("--out", default="heat2d_mpi.png", metavar="PATH", help="PNG written by rank 0 ('' for none)")
    p.add_argument("--save", default="", metavar="PATH", help="rank 0 saves the final plate as .npy")
    p.add_argument(
        "--check",
        action="store_true",
        help="rank 0 also runs the one-GPU (or one-rank NumPy) steps and demands bitwise equality",
    )
    p.add_argument("--json", default="", metavar="PATH", help="rank 0 writes timings as JSON")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps first (GPU; default 2)")
    p.add_argument(
        "--no-compute-timing",
        dest="compute_timing",
        action="store_false",
        help="GPU: skip timing the same steps again without the exchange (what the exchange adds per step)",
    )
    return p


def initial_plate(
    shape: tuple[int, int], dtype: np.dtype, init: str, seed: int, rows: slice = slice(None)
) -> np.ndarray:
    """The starting plate (or its ``rows``), identical on every rank."""
    n, m = shape
    if init == "random":
        return np.random.default_rng(seed).random(shape).astype(dtype)[rows]
    lo, hi, _ = rows.indices(n)
    u = np.zeros((hi - lo, m), dtype)
    u[:, 0] = 1.0
    radius = min(n, m) / 12
    yy = np.arange(lo, hi)[:, None]
    xx = np.arange(m)[None, :]
    for cy, cx in [(0.30, 0.35), (0.70, 0.35), (0.50, 0.60), (0.25, 0.80), (0.75, 0.80)]:
        u[(yy - cy * n) ** 2 + (xx - cx * m) ** 2 < radius**2] = 1.0
    return u


def _say(rank: int, msg: str, *, err: bool = False) -> None:
    print(f"heat2d_mpi[rank {rank}]: {msg}", file=sys.stderr if err else sys.stdout, flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        print(f"heat2d_mpi: needs mpi4py and an MPI library (pip install -e '.[mpi]'): {exc}", file=sys.stderr)
        return 1
    from umem_numba.kernels.decomp import Decomposition
    from umem_numba.kernels.mpi.comm import collective_errors, cuda_aware_mpi, ipc_unavailable, local_rank, mismatch
    from umem_numba.kernels.mpi.distributed import RankHeat

    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()

    # 1. Arguments: a bad command line on any rank stops every rank (collectively, no hang).
    error: str | None = None
    args: Any = None
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse printed its message already
        if not exc.code:
            return 0  # --help
        error = f"bad command line (argparse exit {exc.code})"
    if args is not None and error is None:
        if args.size < 3 or (args.rows is not None and args.rows < 3):
            error = f"--size/--rows must be at least 3, got {args.size}/{args.rows}"
        elif args.steps < 1:
            error = f"--steps must be at least 1, got {args.steps}"
        elif not 0.0 <= args.alpha <= 0.25:
            error = f"--alpha must be in [0, 0.25], got {args.alpha}"
        elif args.halo == "ipc" and args.cpu:
            error = "--halo ipc maps GPU memory between the ranks: it needs the GPU path, not --cpu"
        elif args.halo == "ipc" and args.staging != "auto":
            error = f"--staging {args.staging} chooses the buffers of MPI halos: it does not go with --halo ipc"
        elif rank == 0 and args.out:  # rank 0 writes the picture at the end: a bad path stops every rank now
            from umem_numba.kernels import check_output_path

            try:
                check_output_path(args.out)
            except ValueError as exc:
                error = str(exc)
    keys = ("size", "rows", "steps", "dtype", "alpha", "init", "seed", "cpu", "staging", "halo", "launches")
    config = {} if args is None else {k: getattr(args, k) for k in keys}
    errors = collective_errors(comm, error)
    if not errors:
        errors = collective_errors(comm, mismatch(comm, config))
    if not errors and args.halo == "ipc":  # every rank takes part: the settings agree
        errors = collective_errors(comm, ipc_unavailable(comm))
    if errors:
        return _abort(rank, errors)

    # 2. Layout and devices.
    dtype = np.dtype(args.dtype)
    shape = (args.rows or args.size, args.size)
    align = 1
    error = None
    if not args.cpu:
        import umem_numba as um
        from umem_numba.kernels import TUNED_2D

        align = TUNED_2D[dtype][0]
        if not um.gpu_available():
            error = f"no usable GPU on {socket.gethostname()}: {um.gpu_unavailable_reason()}"
    decomp = None
    try:
        decomp = Decomposition(shape, nranks, align)
    except ValueError as exc:
        error = error or str(exc)
    # Collectives first, on every rank (a rank that already failed must still take part).
    lrank = local_rank(comm)
    hosts = comm.allgather(socket.gethostname())
    if error is None and not args.cpu:
        error = _pick_gpu(rank, lrank, hosts.count(socket.gethostname()), decomp, dtype)
    errors = collective_errors(comm, error)
    if errors:
        return _abort(rank, errors)

    # 3. Transport: every rank agrees.
    if args.cpu:
        device_buffers, how = False, "--cpu"
    elif args.halo == "ipc":
        device_buffers, how = False, "--halo ipc: all ranks on one node"
    elif args.staging == "auto":
        aware, how = cuda_aware_mpi()
        device_buffers = bool(comm.allreduce(int(aware), op=MPI.MIN))
    else:
        device_buffers, how = args.staging == "device", f"--staging {args.staging}"
    s = decomp.slabs[rank]
    local = initial_plate(shape, dtype, args.init, args.seed, slice(s.start, s.stop))
    if rank == 0:
        print(
            f"heat2d_mpi: {shape[0]} x {shape[1]} {dtype} plate, {args.steps} steps, {nranks} rank(s), "
            f"{'CPU (NumPy)' if args.cpu else 'GPU'}; halos via "
            f"{_transport_name(args, device_buffers)} [{how}]; MPI: {_library()}",
            flush=True,
        )
    run, error = None, None
    try:
        run = RankHeat(
            comm,
            decomp,
            local,
            args.alpha,
            cpu=args.cpu,
            device_buffers=device_buffers,
            halo=args.halo,
            graphs=not args.launches,
        )
    except Exception as exc:  # e.g. no memory left for the slab or the staging buffers: stop every rank
        error = f"setting up the halo exchange failed: {type(exc).__name__}: {exc}"
    errors = collective_errors(comm, error)
    if errors:
        if run is not None:
            run.close()
        return _abort(rank, errors)
    assert run is not None
    try:
        warm = 0 if args.cpu else min(args.warmup, args.steps)
        run.step(warm)
        run.synchronize()
        # A full garbage collection walks every object of the process (numba's compiled kernels
        # and typing state: tens of milliseconds) and lands on whichever step it falls in; with
        # steps of a fifth of a millisecond it dominated the timing and differed from rank to
        # rank.  What exists now is kept for good (gc.freeze): the steps' own garbage is young.
        gc.collect()
        gc.freeze()
        run.halo_seconds = run.band_seconds = 0.0
        comm.Barrier()
        t0 = time.perf_counter()
        run.step(args.steps - warm)
        run.synchronize()
        comm.Barrier()
        seconds = time.perf_counter() - t0
        halo = comm.allreduce(run.halo_seconds, op=MPI.MAX)
        # What the host spent issuing work (not waiting for messages or bands), on the busiest rank.
        busy = comm.allreduce(seconds - run.halo_seconds - run.band_seconds, op=MPI.MAX)
        plate = run.gather(0)
        # The same steps without edge bands and messages (the field is done with): what the
        # exchange adds to a step is the difference.
        compute = None
        if not args.cpu and args.compute_timing and args.steps > warm:
            compute = comm.allreduce(run.timed(args.steps - warm, exchange=False), op=MPI.MAX)
    finally:
        run.close()
    if rank != 0:
        return 0
    timed = args.steps - warm
    per_step = seconds / max(timed, 1)
    compute_per_step = None if compute is None else compute / max(timed, 1)
    exposed = None if compute_per_step is None else max(per_step - compute_per_step, 0.0)
    print(
        f"{timed} timed steps in {seconds:.3f} s: {per_step * 1e3:.3f} ms/step; host wait for messages "
        f"{halo / max(timed, 1) * 1e6:.1f} us/step (max over ranks); host busy issuing work "
        f"{busy / max(timed, 1) * 1e6:.1f} us/step"
        + (
            ""
            if exposed is None or compute_per_step is None
            else f"; without the exchange {compute_per_step * 1e3:.3f} ms/step, so the exchange adds "
            f"{exposed * 1e6:.1f} us/step"
        ),
        flush=True,
    )
    status = 0
    if args.save:
        np.save(args.save, plate)
        print(f"wrote {args.save}")
    if args.out:
        _picture(args.out, plate)
    if args.check:
        status = _check(args, shape, dtype, plate)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "ranks": nranks,
                    "shape": list(shape),
                    "dtype": str(dtype),
                    "steps": timed,
                    "seconds": seconds,
                    "ms_per_step": per_step * 1e3,
                    "halo_us_per_step": halo / max(timed, 1) * 1e6,
                    "host_busy_us_per_step": busy / max(timed, 1) * 1e6,
                    "compute_ms_per_step": None if compute_per_step is None else compute_per_step * 1e3,
                    "exposed_halo_us_per_step": None if exposed is None else exposed * 1e6,
                    "mpi_library": _library(),
                    "cpu": args.cpu,
                    "device_buffers": device_buffers,
                    "halo": args.halo,
                    "graphs": not args.cpu and not args.launches,
                    "transport_how": how,
                },
                fh,
                indent=2,
            )
        print(f"wrote {args.json}")
    return status


def _library() -> str:
    """The MPI library mpi4py runs on (first line of MPI_Get_library_version)."""
    from mpi4py import MPI

    lines = MPI.Get_library_version().strip().splitlines()
    return " ".join(lines[0].split(",")[0].split()) if lines else "unknown"


def _transport_name(args: Any, device_buffers: bool) -> str:
    if args.cpu:
        return "host arrays"
    if args.halo == "ipc":
        return "exported VMM rows read in place (fds over SCM_RIGHTS, MPI tokens order the ranks)"
    return "device buffers" if device_buffers else "pinned host buffers"


def _pick_gpu(rank: int, lrank: int, on_node: int, decomp: Any, dtype: np.dtype) -> str | None:
    """Select GPU ``lrank % GPUs`` and check that the slabs of the ranks sharing it fit; a message if not.

    Not a collective: it runs only on ranks that have no error so far.
    """
    from numba import cuda

    import umem_numba as um
    from umem_numba.kernels import MemoryBudgetError, require_free_memory

    try:
        count = um.device_count()
        dev = lrank % count
        cuda.select_device(dev)
        same = sum(1 for j in range(on_node) if j % count == dev)
        nbytes = 2 * int(np.prod(decomp.local_shape(rank))) * dtype.itemsize * same + (64 << 20)
        require_free_memory(nbytes, f"{same} rank(s)' slabs on GPU {dev}")
    except MemoryBudgetError as exc:
        return str(exc)
    except Exception as exc:  # a rank whose GPU cannot be used
        return f"GPU setup failed on {socket.gethostname()}: {type(exc).__name__}: {exc}"
    return None


def _abort(rank: int, errors: list[str]) -> int:
    for e in errors:
        _say(rank, f"error: {e}", err=True)
    _say(rank, "stopping before any halo exchange", err=True)
    return 2


def _picture(path: str, plate: np.ndarray) -> None:
    from umem_numba.kernels import save_field

    save_field(
        path, plate, vmin=0.0, vmax=1.0, title=f"heat2d_mpi {plate.shape[0]} x {plate.shape[1]}", label="temperature"
    )
    print(f"wrote {path}")


def _check(args: Any, shape: tuple[int, int], dtype: np.dtype, plate: np.ndarray) -> int:
    u0 = initial_plate(shape, dtype, args.init, args.seed)
    if args.cpu:
        from umem_numba.kernels import heat2d_reference

        expected, what = heat2d_reference(u0, args.steps, args.alpha), "one-rank NumPy reference"
    else:
        from numba import cuda

        from umem_numba.kernels import heat2d_step

        a, b = cuda.to_device(u0), cuda.device_array_like(u0)
        for _ in range(args.steps):
            heat2d_step(a, b, args.alpha)
            a, b = b, a
        expected, what = a.copy_to_host(), "one-GPU run"
    differ = int(np.count_nonzero(plate != expected))
    print(f"check against the {what}: {'bitwise equal' if differ == 0 else f'{differ} cells DIFFER'}", flush=True)
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
