#!/usr/bin/env python3
"""Heat flow across a plate, on managed memory: umem_numba's main example.

An N x N plate starts cold with five hot discs; its left edge is held hot and
its other edges cold.  Each explicit time step

    u_new = u + alpha * (north + south + west + east - 4 u)

is one launch of the tuned five-point kernel of ``umem_numba.kernels`` over
the whole plate.  Two grids are swapped between steps: the kernel copies the
fixed edge values through, so only the first grid needs setting up.

Memory (--memory):
  device            numba device arrays, copied in and out: the baseline
  managed           ManagedBuffer written by the host, no hints: the first
                    step pulls every page over on demand (GPU page faults)
  managed-prefetch  ManagedBuffer with PREFER_DEVICE advice, prefetched to the
                    GPU in bulk before the first step (the default)
  vmm               VMMBuffer: device memory from CUDA's virtual memory API

At the end it writes a PNG of the plate (matplotlib: axes, colorbar, title)
and prints the bandwidth achieved
(each step reads and writes the whole grid: 2 * N * N * itemsize bytes).
Heat spreads about sqrt(steps) cells, so on the default 8192^2 plate the
discs only soften at the edges; try --size 512 --steps 20000 to watch it flow.

Without a GPU it says so in one line and runs a small plate (64 x 64, 60 steps,
unless --size / --steps say otherwise) on numba's CUDA simulator instead: the
same code, with umem_numba's buffers in host memory (NUMBA_ENABLE_CUDASIM=1
chooses the simulator on a machine with a GPU too).

--graph N captures N steps into a CUDA graph once (umem_numba.capture) and
launches the graph instead of N kernels: the plate is the same, bit for bit,
and small, launch-bound plates run several times faster (N must be even, so
that each launch starts from the same grid; steps beyond a multiple of N run
as plain steps).

Examples:
  python examples/heat2d.py
  python examples/heat2d.py --size 256 --steps 20000 --graph 100   # launch-bound: graphs win
  python examples/heat2d.py --memory managed --steps 100
  python examples/heat2d.py --size 1024 --steps 50 --check    # compare with NumPy
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

MEMORY_KINDS = ("device", "managed", "managed-prefetch", "vmm")
#: (--size, --steps) by default on a GPU and on numba's simulator (which runs every thread in Python).
DEFAULTS = {"gpu": (8192, 500), "simulator": (64, 60)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; errors exit with status 2 and a message, before any GPU work."""
    p = argparse.ArgumentParser(
        prog="heat2d.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
        help="plate side in cells (default 8192: two 256 MiB grids in float32; 64 on the simulator)",
    )
    p.add_argument("--steps", type=int, metavar="N", help="time steps (default 500; 60 on the simulator)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="precision (default float32)")
    p.add_argument(
        "--alpha", type=float, default=0.25, help="diffusion number D*dt/dx^2; stable up to 0.25 (the default)"
    )
    p.add_argument("--out", default="heat2d.png", metavar="PATH", help="PNG of the final plate (default heat2d.png)")
    p.add_argument(
        "--check",
        action="store_true",
        help="also run the NumPy reference and compare (slow beyond a few thousand cells a side)",
    )
    p.add_argument(
        "--graph",
        type=int,
        default=0,
        metavar="N",
        help="capture N steps (even) into a CUDA graph and launch it instead (default 0: one launch per step)",
    )
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="run even if the grids do not fit in free GPU memory (pages then thrash; may take very long)",
    )
    args = p.parse_args(argv)
    # No GPU: the run goes to the simulator (see kernels.rerun_on_simulator), with its smaller defaults.
    size, steps = DEFAULTS["simulator" if numba_config.ENABLE_CUDASIM or not um.gpu_available() else "gpu"]
    args.size = size if args.size is None else args.size
    args.steps = steps if args.steps is None else args.steps
    if args.size < 3:
        p.error(f"--size must be at least 3 (a plate with an interior), got {args.size}")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.graph < 0 or args.graph % 2:
        p.error(
            f"--graph must be an even number of steps (each launch then starts from the same grid), got {args.graph}"
        )
    if not 0.0 <= args.alpha <= 0.25:
        p.error(f"--alpha must be in [0, 0.25] for a stable explicit step, got {args.alpha}")
    try:  # the picture is written at the end: a bad path is refused now, before any work
        kernels.check_output_path(args.out)
    except ValueError as exc:
        p.error(str(exc))
    return args


def set_initial(u: np.ndarray) -> None:
    """Write the starting plate into ``u`` in place: cold, a hot left edge, five hot discs."""
    n = u.shape[0]
    u[...] = 0.0
    u[:, 0] = 1.0
    radius = n / 12
    for fy, fx in [(0.30, 0.35), (0.70, 0.35), (0.50, 0.60), (0.25, 0.80), (0.75, 0.80)]:
        cy, cx = fy * n, fx * n
        # Only the disc's bounding box, so no N x N temporaries are built.
        y0, y1 = int(cy - radius), int(cy + radius) + 1
        x0, x1 = int(cx - radius), int(cx + radius) + 1
        yy, xx = np.ogrid[y0:y1, x0:x1]
        u[y0:y1, x0:x1][(yy - cy) ** 2 + (xx - cx) ** 2 < radius**2] = 1.0


def allocate(memory: str, n: int, dtype: np.dtype, device: int, stream: cuda.stream) -> tuple:
    """Two n x n grids in the chosen memory, the first holding the starting plate."""
    shape = (n, n)
    if memory in ("device", "vmm"):
        start = np.empty(shape, dtype)
        set_initial(start)
        if memory == "device":
            return cuda.to_device(start, stream=stream), cuda.device_array(shape, dtype, stream=stream)
        a = um.VMMBuffer.empty(shape, dtype, device=device)
        a.copy_from_host(start, stream=stream)
        return a, um.VMMBuffer.empty(shape, dtype, device=device)

    # Managed: the host writes the plate straight into the buffer; no copy, no transfer call.
    a = um.ManagedBuffer.empty(shape, dtype)
    b = um.ManagedBuffer.empty(shape, dtype)
    set_initial(a.host)
    if memory == "managed-prefetch":
        for buf in (a, b):
            buf.apply_policy(um.MigrationPolicy.PREFER_DEVICE(device))  # keep the pages on the GPU...
            buf.prefetch(device, stream=stream)  # ...and move them now, in bulk
    return a, b


def fetch(memory: str, buf, stream: cuda.stream) -> np.ndarray:
    """The final plate as a numpy array."""
    if memory in ("device", "vmm"):
        plate = buf.copy_to_host(stream=stream)
        stream.synchronize()
        return plate
    if memory == "managed-prefetch":
        buf.prefetch("cpu", stream=stream)  # one bulk migration instead of a fault per page
    # No synchronize: .host waits for exactly the kernels (and prefetch) that used buf.
    return buf.host


def run(args: argparse.Namespace) -> int:
    dtype = np.dtype(args.dtype)
    n = args.size
    grid_bytes = n * n * dtype.itemsize
    simulated = numba_config.ENABLE_CUDASIM
    try:
        if not simulated:  # the simulator's buffers are host memory
            kernels.require_free_memory(
                2 * grid_bytes, f"2 grids of {n}x{n} {dtype}", allow_oversubscribe=args.allow_oversubscribe
            )
    except kernels.MemoryBudgetError as exc:
        print(f"heat2d: {exc}", file=sys.stderr)
        return 2

    device = 0 if numba_config.ENABLE_CUDASIM else cuda.get_current_device().id  # the simulator has one
    stream = cuda.stream()
    print(
        f"heat2d: {n} x {n} {dtype} plate on {args.memory} memory "
        f"(2 grids of {kernels.human_bytes(grid_bytes)}), {args.steps} steps, alpha {args.alpha}"
    )
    # numba compiles on first launch: compile now, so the clock measures only the steps.
    kernels.heat2d_compile((n, n), dtype)
    a, b = allocate(args.memory, n, dtype, device, stream)
    graph = None
    try:
        if args.graph:
            # N steps recorded once (nothing runs now); each launch replays them with coherence.
            with um.capture(stream) as graph:
                for i in range(args.graph):
                    src, dst = (a, b) if i % 2 == 0 else (b, a)
                    kernels.heat2d_step(src, dst, args.alpha, stream=stream)
        per_launch = args.graph or 1
        wall = time.perf_counter()
        start = cuda.event()
        start.record(stream)
        chunk = max(per_launch, args.steps // 50 // per_launch * per_launch)
        marks = []  # (event recorded after a chunk, steps done when it fires)
        with kernels.progress(total=args.steps, desc="heat2d", unit="step") as bar:
            for first in range(0, args.steps, chunk):
                todo = min(chunk, args.steps - first)
                while graph is not None and todo >= per_launch:
                    graph.launch(stream)  # an even number of steps: the new plate is in a again
                    todo -= per_launch
                for _ in range(todo):
                    kernels.heat2d_step(a, b, args.alpha, stream=stream)
                    a, b = b, a  # double buffering: the new plate is the next step's input
                mark = cuda.event()
                mark.record(stream)
                marks.append((mark, min(first + chunk, args.steps)))
                # Show finished steps, not queued ones, without starving the GPU:
                # wait for the previous chunk while this one runs.
                if len(marks) > 1:
                    event, steps_done = marks.pop(0)
                    event.synchronize()
                    bar.update(steps_done - bar.n)
            end, steps_done = marks.pop()
            end.synchronize()
            bar.update(steps_done - bar.n)
        plate = fetch(args.memory, a, stream)
        if simulated:  # the simulator's events hold no times, and its speed says nothing about a GPU's
            print(f"{args.steps} steps in {time.perf_counter() - wall:.1f} s on numba's CUDA simulator")
        else:
            seconds = start.elapsed_time(end) / 1e3
            print(
                f"{args.steps} steps in {seconds:.3f} s: {2 * grid_bytes * args.steps / seconds / 1e9:.1f} GB/s "
                f"achieved (each step reads and writes {kernels.human_bytes(2 * grid_bytes)})"
            )
        kernels.save_field(
            args.out,
            plate,
            vmin=0.0,
            vmax=1.0,
            label="temperature",
            # Two short lines: one long line ran past the axes, under the colorbar, off the right edge.
            title=f"heat2d: {n} x {n} {dtype} plate, {args.steps} steps\n{args.memory} memory"
            + (f", graphs of {args.graph} steps" if args.graph else "")
            + (" (numba's simulator)" if simulated else ""),
        )
        print(f"wrote {args.out}")

        if args.check:
            return check(plate, n, dtype, args.steps, args.alpha)
        return 0
    finally:
        if graph is not None:
            graph.close()
        for buf in (a, b):
            if hasattr(buf, "close"):  # umem_numba buffers free now; numba arrays when collected
                buf.close()


def check(plate: np.ndarray, n: int, dtype: np.dtype, steps: int, alpha: float) -> int:
    """Compare with the NumPy reference; 0 if within rounding, else 1."""
    start = np.empty((n, n), dtype)
    set_initial(start)
    return kernels.report_check(plate, kernels.heat2d_reference(start, steps, alpha), steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        kernels.require_plot_extra()  # the picture and the progress bar, checked before the run
    except kernels.MissingExtraError as exc:
        print(f"heat2d: {exc}", file=sys.stderr)
        return 1
    if not um.gpu_available() and not numba_config.ENABLE_CUDASIM:
        what = f"a {args.size} x {args.size} plate for {args.steps} steps"
        kernels.rerun_on_simulator(__file__, sys.argv[1:] if argv is None else argv, what)
    if args.memory == "vmm" and not hasattr(um, "VMMBuffer"):
        print("heat2d: this build of umem_numba has no VMMBuffer; choose another --memory", file=sys.stderr)
        return 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
