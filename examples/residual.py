#!/usr/bin/env python3
"""Solve Laplace's equation by Jacobi sweeps, reading the residual with no explicit synchronize.

A square plate with its top edge held at 1 and the others at 0 relaxes to
the steady temperature field.  Every --check-every sweeps, a reduction kernel
writes ``max |new - old|`` into a one-element managed buffer, and the host
simply reads it:

    kernels.max_abs_diff(a, b, residual, stream=stream)
    value = residual.host[0]

``residual.host`` waits for exactly the launches that wrote ``residual``
(umem_numba records one CUDA event per launch and files it under every
buffer argument): no ``cuda.synchronize()``, no ``stream.synchronize()``, and
no risk of reading a stale value.  The host waits for that reduction (and so,
by stream order, for the sweeps queued before it), not for the whole device.

Examples:
  python examples/residual.py
  python examples/residual.py --size 128 --tol 1e-7 --out laplace.png
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from numba import cuda

import umem_numba as um
from umem_numba import kernels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; errors exit with status 2 and a message, before any GPU work."""
    p = argparse.ArgumentParser(
        prog="residual.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # Jacobi needs on the order of N^2 sweeps to converge, so the default plate is small.
    p.add_argument("--size", type=int, default=256, metavar="N", help="plate side in cells (default 256)")
    p.add_argument(
        "--max-steps", type=int, default=200_000, metavar="N", help="give up after this many sweeps (default 200000)"
    )
    p.add_argument(
        "--check-every", type=int, default=5000, metavar="N", help="sweeps between residual checks (default 5000)"
    )
    p.add_argument(
        "--tol",
        type=float,
        default=1e-5,
        help="stop when no cell changes by more than this in one sweep (default 1e-5)",
    )
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64", help="precision (default float64)")
    p.add_argument("--out", default=None, metavar="PATH", help="write a PNG of the final field")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also check every residual the GPU reported against NumPy on the same two fields",
    )
    args = p.parse_args(argv)
    if args.size < 3:
        p.error(f"--size must be at least 3 (a plate with an interior), got {args.size}")
    if args.max_steps < 1 or args.check_every < 1:
        p.error("--max-steps and --check-every must be at least 1")
    if not args.tol > 0:
        p.error(f"--tol must be positive, got {args.tol}")
    if args.out:
        try:  # the picture is written at the end: a bad path is refused now, before any work
            kernels.check_output_path(args.out)
        except ValueError as exc:
            p.error(str(exc))
    return args


def run(args: argparse.Namespace) -> int:
    n, dtype = args.size, np.dtype(args.dtype)
    kernels.require_free_memory(2 * n * n * dtype.itemsize, f"2 grids of {n}x{n} {dtype}")
    device = cuda.get_current_device().id
    stream = cuda.stream()

    a = um.ManagedBuffer.zeros((n, n), dtype)
    b = um.ManagedBuffer.empty((n, n), dtype)
    a.host[0, :] = 1.0  # the hot top edge; .host waited for the zeroing memset first
    residual = um.ManagedBuffer.zeros(1, dtype)
    for buf in (a, b):
        buf.prefetch(device, stream=stream)  # the grids live on the GPU; only `residual` crosses over

    print(f"Jacobi on a {n} x {n} {dtype} plate, residual every {args.check_every} sweeps, tol {args.tol:g}")
    steps, value, failures = 0, float("inf"), 0
    t0 = time.perf_counter()
    try:
        while steps < args.max_steps:
            sweeps = min(args.check_every, args.max_steps - steps)
            for _ in range(sweeps):
                kernels.heat2d_step(a, b, 0.25, stream=stream)  # alpha 1/4: the Jacobi sweep
                a, b = b, a
            steps += sweeps
            # The last sweep went b -> a: compare the two newest fields on the device...
            kernels.max_abs_diff(a, b, residual, stream=stream)
            # ...and read the answer.  No synchronize: this waits for the reduction's event only.
            value = float(residual.host[0])
            if args.verify:
                failures += verify(a, b, value, dtype)
            print(f"  sweep {steps:7d}: max change {value:.3e}")
            if value < args.tol:
                break
        seconds = time.perf_counter() - t0
        state = "converged" if value < args.tol else "stopped at --max-steps"
        print(f"{state} after {steps} sweeps in {seconds:.2f} s (residual {value:.3e})")
        if args.out:
            kernels.save_field(
                args.out,
                a.host,
                vmin=0.0,
                vmax=1.0,
                label="temperature",
                title=f"Laplace on a {n} x {n} plate, {steps} Jacobi sweeps",
            )
            print(f"wrote {args.out}")
        return 1 if failures else 0
    finally:
        for buf in (a, b, residual):
            buf.close()


def verify(a: um.ManagedBuffer, b: um.ManagedBuffer, value: float, dtype: np.dtype) -> int:
    """1 if the GPU's residual differs from NumPy's on the same fields, else 0."""
    expected = float(kernels.max_abs_diff_reference(a.host, b.host))
    if value != expected:
        print(f"  MISMATCH: the GPU reported {value!r}, NumPy computes {expected!r}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out:
        try:
            kernels.require_plot_extra()  # matplotlib for the picture, checked before the run
        except kernels.MissingExtraError as exc:
            print(f"residual: {exc}", file=sys.stderr)
            return 1
    if not um.gpu_available():
        print(
            "residual: this example needs a CUDA GPU (`python -m umem_numba info` says why there is none)",
            file=sys.stderr,
        )
        return 1
    try:
        return run(args)
    except kernels.MemoryBudgetError as exc:
        print(f"residual: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
