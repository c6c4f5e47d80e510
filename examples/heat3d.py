#!/usr/bin/env python3
"""Heat flow through a cube, on managed memory: the 3-D version of heat2d.py.

An N x N x N block starts cold with a hot ball at its centre; its bottom face
is held hot and the other five faces cold.  Each explicit step

    u_new = u + alpha * (sum of the six neighbours - 6 u)

is one launch of the tuned seven-point kernel of ``umem_numba.kernels``;
two grids are swapped between steps and the kernel copies the fixed faces
through.  The grids live in managed memory, advised to stay on the GPU and
prefetched there before the first step (``--memory managed`` skips both and
lets the first step fault the pages over; ``device`` uses numba device
arrays).  At the end it writes a PNG (matplotlib) of the vertical slice through the centre
and prints the bandwidth achieved (2 * N^3 * itemsize bytes per step).

Without a GPU it says so in one line and runs a small cube (20^3, 20 steps,
unless --size / --steps say otherwise) on numba's CUDA simulator instead, as
heat2d.py does.

Examples:
  python examples/heat3d.py
  python examples/heat3d.py --size 128 --steps 2000 --out ball.png
  python examples/heat3d.py --size 64 --steps 20 --check      # compare with NumPy
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from numba import config as numba_config
from numba import cuda

import umem_numba as um
from umem_numba import kernels

MEMORY_KINDS = ("device", "managed", "managed-prefetch")


#: (--size, --steps) by default on a GPU and on numba's simulator (which runs every thread in Python).
DEFAULTS = {"gpu": (512, 200), "simulator": (20, 20)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; errors exit with status 2 and a message, before any GPU work."""
    p = argparse.ArgumentParser(
        prog="heat3d.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--memory",
        choices=MEMORY_KINDS,
        default="managed-prefetch",
        help="where the two grids live (default: managed-prefetch)",
    )
    p.add_argument(
        "--size",
        type=int,
        metavar="N",
        help="cube side in cells (default 512: two 512 MiB grids in float32; 20 on the simulator)",
    )
    p.add_argument("--steps", type=int, metavar="N", help="time steps (default 200; 20 on the simulator)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="precision (default float32)")
    p.add_argument(
        "--alpha", type=float, default=1 / 6, help="diffusion number D*dt/dx^2; stable up to 1/6 (the default)"
    )
    p.add_argument(
        "--out",
        default="heat3d.png",
        metavar="PATH",
        help="PNG of the centre slice of the final cube (default heat3d.png)",
    )
    p.add_argument("--check", action="store_true", help="also run the NumPy reference and compare (small cubes)")
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="run even if the grids do not fit in free GPU memory (may take very long)",
    )
    args = p.parse_args(argv)
    # No GPU: the run goes to the simulator (see kernels.rerun_on_simulator), with its smaller defaults.
    size, steps = DEFAULTS["simulator" if numba_config.ENABLE_CUDASIM or not um.gpu_available() else "gpu"]
    args.size = size if args.size is None else args.size
    args.steps = steps if args.steps is None else args.steps
    if args.size < 3:
        p.error(f"--size must be at least 3 (a cube with an interior), got {args.size}")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if not 0.0 <= args.alpha <= 1 / 6:
        p.error(f"--alpha must be in [0, 1/6] for a stable explicit step, got {args.alpha}")
    try:  # the picture is written at the end: a bad path is refused now, before any work
        kernels.check_output_path(args.out)
    except ValueError as exc:
        p.error(str(exc))
    return args


def set_initial(u: np.ndarray) -> None:
    """Write the starting cube into ``u`` (z, y, x) in place: cold, hot bottom face, hot central ball."""
    n = u.shape[0]
    u[...] = 0.0
    u[0] = 1.0
    c, radius = (n - 1) / 2, n / 5
    lo, hi = int(c - radius), int(c + radius) + 1
    zz, yy, xx = np.ogrid[lo:hi, lo:hi, lo:hi]
    u[lo:hi, lo:hi, lo:hi][(zz - c) ** 2 + (yy - c) ** 2 + (xx - c) ** 2 < radius**2] = 1.0


def allocate(memory: str, n: int, dtype: np.dtype, device: int, stream: cuda.stream) -> tuple:
    """Two n^3 grids in the chosen memory, the first holding the starting cube."""
    shape = (n, n, n)
    if memory == "device":
        start = np.empty(shape, dtype)
        set_initial(start)
        return cuda.to_device(start, stream=stream), cuda.device_array(shape, dtype, stream=stream)
    a = um.ManagedBuffer.empty(shape, dtype)
    b = um.ManagedBuffer.empty(shape, dtype)
    set_initial(a.host)  # the host writes straight into managed memory
    if memory == "managed-prefetch":
        for buf in (a, b):
            buf.apply_policy(um.MigrationPolicy.PREFER_DEVICE(device))
            buf.prefetch(device, stream=stream)
    return a, b


def run(args: argparse.Namespace) -> int:
    dtype = np.dtype(args.dtype)
    n = args.size
    grid_bytes = n**3 * dtype.itemsize
    simulated = bool(numba_config.ENABLE_CUDASIM)
    try:
        if not simulated:  # the simulator's buffers are host memory
            kernels.require_free_memory(
                2 * grid_bytes, f"2 grids of {n}^3 {dtype}", allow_oversubscribe=args.allow_oversubscribe
            )
    except kernels.MemoryBudgetError as exc:
        print(f"heat3d: {exc}", file=sys.stderr)
        return 2

    device = 0 if simulated else cuda.get_current_device().id  # the simulator has one device
    stream = cuda.stream()
    print(
        f"heat3d: {n}^3 {dtype} cube on {args.memory} memory (2 grids of {kernels.human_bytes(grid_bytes)}), "
        f"{args.steps} steps, alpha {args.alpha:.4g}"
    )
    # Compile first (a 3-D array is the same type to numba in any memory), then allocate.
    kernels.heat3d_compile((n, n, n), dtype)
    a, b = allocate(args.memory, n, dtype, device, stream)
    try:
        wall = time.perf_counter()
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        chunk = max(1, args.steps // 50)
        with kernels.progress(total=args.steps, desc="heat3d", unit="step") as bar:
            for first in range(0, args.steps, chunk):
                for _ in range(min(chunk, args.steps - first)):
                    kernels.heat3d_step(a, b, args.alpha, stream=stream)
                    a, b = b, a
                if first + chunk >= args.steps:
                    end.record(stream)  # right after the last launch, before the host waits
                # A bar of finished steps: waiting here leaves the GPU a short gap per
                # update, negligible at 50 updates (heat2d.py overlaps them instead).
                stream.synchronize()
                bar.update(min(first + chunk, args.steps) - bar.n)

        if args.memory == "device":
            cube = a.copy_to_host(stream=stream)
            stream.synchronize()
        else:
            cube = a.host  # waits for exactly the last kernel that wrote a
        if simulated:  # the simulator's events hold no times, and its speed says nothing about a GPU's
            print(f"{args.steps} steps in {time.perf_counter() - wall:.1f} s on numba's CUDA simulator")
        else:
            seconds = start.elapsed_time(end) / 1e3
            print(
                f"{args.steps} steps in {seconds:.3f} s: {2 * grid_bytes * args.steps / seconds / 1e9:.1f} GB/s "
                f"achieved (each step reads and writes {kernels.human_bytes(2 * grid_bytes)})"
            )
        # The x-z slice through the centre shows both the hot floor and the ball.
        kernels.save_field(
            args.out,
            cube[:, n // 2, :],
            vmin=0.0,
            vmax=1.0,
            origin="lower",
            label="temperature",
            xlabel="x (cell)",
            ylabel="z (cell)",
            title=f"heat3d: slice y = {n // 2} of a {n}^3 cube after {args.steps} steps"
            + (" (simulator)" if simulated else ""),
        )
        print(f"wrote {args.out} (the vertical slice y = {n // 2}, bottom face at the bottom)")
        return check(cube, n, dtype, args.steps, args.alpha) if args.check else 0
    finally:
        for buf in (a, b):
            if hasattr(buf, "close"):
                buf.close()


def check(cube: np.ndarray, n: int, dtype: np.dtype, steps: int, alpha: float) -> int:
    """Compare with the NumPy reference; 0 if within rounding, else 1."""
    start = np.empty((n, n, n), dtype)
    set_initial(start)
    return kernels.report_check(cube, kernels.heat3d_reference(start, steps, alpha), steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        kernels.require_plot_extra()  # the picture and the progress bar, checked before the run
    except kernels.MissingExtraError as exc:
        print(f"heat3d: {exc}", file=sys.stderr)
        return 1
    if not um.gpu_available() and not numba_config.ENABLE_CUDASIM:
        what = f"a {args.size}^3 cube for {args.steps} steps"
        kernels.rerun_on_simulator(__file__, sys.argv[1:] if argv is None else argv, what)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
