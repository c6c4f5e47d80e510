"""Stencil benchmark: the tuned 2-D heat step on every memory kind, against device_array and a copy.

``python -m umem_numba bench stencil [--size N] [--steps N] [--quick] [--json PATH] [--png PATH]``

On one ``N x N`` grid, in one run, the same kernel (``umem_numba.kernels``,
launched as a plain numba launch for every kind, so only the memory differs):

``device_array``
    numba ``cuda.to_device``: the reference.
``managed``
    :class:`~umem_numba.ManagedBuffer`, filled on the host, no hints: the
    first sweep migrates every page on demand (GPU page faults), and is
    reported with its own GB/s; the steady state after it is the kind's GB/s.
``managed+prefetch``
    filled on the host, then ``buf.prefetch(device)`` (its GB/s reported too).
``managed+prefetch+advice``
    as above after ``buf.apply_policy(MigrationPolicy.PREFER_DEVICE(device))``.
``vmm``
    :class:`~umem_numba.VMMBuffer` filled with ``copy_from_host``.

GB/s counts what a step must move: ``2 * N * N * itemsize`` bytes (read the
old field, write the new one).  Each kind runs the same number of steps from
the same initial field, and its final field is compared bit for bit with
device_array's.  The copy reference is ``cuMemcpyDtoDAsync`` (numba
``copy_to_device`` of a device array) of one grid, counted read + write, in
the same run.  Times are CUDA events around ``--steps`` back-to-back launches;
the median of ``--trials`` trials is reported, after two warm-up steps.

The default run also times the 3-D kernel that ``heat3d_step`` uses
(:data:`~umem_numba.kernels.stencil3d.DEFAULT_VARIANT_3D`) on a ``--size3d``
cube against the copy of that cube.

Goals: managed+prefetch >= 0.98x device_array; the stencil on device_array
>= 0.85x the copy; heat3d float32 >= 0.92x the copy.  How the kernel got there, per design step:
``docs/stencil-performance.md``; the latest figures: the benchmark report in
``docs/``.

``--variants`` instead times every 3-D kernel design and launch shape
(:data:`VARIANT_SWEEP_3D`: ``column``, ``tile``, ``vec2``, ``vec4``,
``march2`` and ``march4`` of ``umem_numba.kernels.stencil3d``, several
planes per thread and block shapes) on one ``--size3d`` cubed grid (default
512) against the same copy, in one run, and prints which wins (goal: heat3d
float32 >= 0.92x the copy).  Each variant's field after the same steps is compared with the
default variant's (bitwise, and to 1e-5 relative: the GPU may fuse
multiply-adds differently in different code).

The grids must fit in free GPU memory (checked with ``cuMemGetInfo``);
``--allow-oversubscribe`` runs anyway, at the risk of a very long run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._common import (
    BenchSkipped,
    command_line,
    goal_row,
    goal_text,
    plain_text,
    print_figures,
    print_table,
    progress,
    require_gpu,
)

KINDS = ("device_array", "managed", "managed+prefetch", "managed+prefetch+advice", "vmm")
GOAL_PREFETCH_VS_DEVICE = 0.98
GOAL_STENCIL_VS_COPY = 0.85
GOAL_3D_VS_COPY = 0.92

#: ``(variant, planes_per_thread, (bx, by))`` launches that ``--variants`` times (tile shapes that do
#: not fit in 48 KiB of shared memory for the dtype are left out).  The ``vec`` variants keep
#: ``planes * width <= 32`` (past that numba's loops stay rolled and spill to local memory); the
#: ``march`` variants' registers do not grow with their strips.
VARIANT_SWEEP_3D = [
    *[("column", p, b) for p in (4, 8, 16) for b in ((64, 2), (32, 4), (32, 8), (64, 4), (128, 1))],
    *[("tile", p, b) for p in (4, 8, 16) for b in ((32, 4), (32, 8), (64, 4), (64, 8), (32, 16))],
    *[("vec2", p, b) for p in (4, 8, 16) for b in ((32, 2), (32, 4), (64, 2), (32, 8))],
    *[("vec4", p, b) for p in (2, 4, 8) for b in ((32, 2), (32, 4), (64, 2), (32, 8))],
    *[("march4", p, b) for p in (32, 64, 128) for b in ((32, 4), (32, 8), (64, 4))],
    *[("march2", p, b) for p in (32, 64) for b in ((32, 4), (32, 8))],
]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m umem_numba bench stencil",
        description=plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--size", type=int, default=None, metavar="N", help="grid side N (default 16384; 8192 with --quick)"
    )
    ap.add_argument(
        "--steps", type=int, default=None, metavar="N", help="timed steps per trial (default 50; 10 with --quick)"
    )
    ap.add_argument(
        "--trials",
        type=int,
        default=None,
        metavar="N",
        help="timed trials per kind; the median is reported (default 5; 3 with --quick)",
    )
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="element type")
    ap.add_argument("--quick", action="store_true", help="smaller grid and fewer steps (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--png", metavar="PATH", help="write a bar chart of the results as PNG")
    ap.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)} (default: all)"
    )
    ap.add_argument(
        "--rows-per-thread",
        type=int,
        default=None,
        metavar="K",
        help="override the kernel's tuned register-blocking factor",
    )
    ap.add_argument("--block", default=None, metavar="BX,BY", help="override the tuned block shape")
    ap.add_argument(
        "--variants", action="store_true", help="time every 3-D kernel variant against the copy instead (see above)"
    )
    ap.add_argument(
        "--size3d", type=int, default=None, metavar="N", help="3-D cube side (default 512; 256 with --quick)"
    )
    ap.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="run even if the grids do not fit in free GPU memory (may take very long)",
    )
    args = ap.parse_args(argv)
    args.size = args.size if args.size is not None else (8192 if args.quick else 16384)
    args.steps = args.steps if args.steps is not None else (10 if args.quick else 50)
    args.trials = args.trials if args.trials is not None else (3 if args.quick else 5)
    args.size3d = args.size3d if args.size3d is not None else (256 if args.quick else 512)
    if args.size3d < 3:
        ap.error(f"--size3d must be at least 3, got {args.size3d}")
    if args.size < 3:
        ap.error(f"--size must be at least 3 (a grid with an interior), got {args.size}")
    if args.steps < 1 or args.trials < 1:
        ap.error("--steps and --trials must be >= 1")
    if args.rows_per_thread is not None and args.rows_per_thread < 1:
        ap.error("--rows-per-thread must be >= 1")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        ap.error(f"unknown kind(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(KINDS)}")
    args.kinds = kinds
    if args.block is not None:
        try:
            bx, by = (int(v) for v in args.block.split(","))
        except ValueError:
            ap.error(f"--block must be two integers like 256,1, got {args.block!r}")
        if bx < 1 or by < 1 or bx * by > 1024:
            ap.error(f"--block needs positive sizes with at most 1024 threads, got {args.block}")
        args.block = (bx, by)
    return args


def _initial_field(n: int, dtype: np.dtype) -> np.ndarray:
    """A smooth non-constant field, built without an N x N float64 temporary."""
    u = np.empty((n, n), dtype)
    u[...] = np.sin(np.linspace(0.0, 3.0, n, dtype=np.float64)).astype(dtype)[:, None]
    u += np.cos(np.linspace(0.0, 5.0, n, dtype=np.float64)).astype(dtype)[None, :]
    return u


class _Runner:
    """Times the kernel on one pair of buffers; every kind goes through the same code."""

    def __init__(self, args: argparse.Namespace, dtype: np.dtype, stream: Any) -> None:
        from umem_numba.kernels import TUNED_2D, heat2d_launch, stencil_weights

        self.args = args
        self.stream = stream
        shape = (args.size, args.size)
        self.kernel, self.grid, self.block = heat2d_launch(shape, dtype, args.rows_per_thread, args.block)
        self.rows = args.rows_per_thread if args.rows_per_thread is not None else TUNED_2D[dtype][0]
        self.weights = stencil_weights(0.2, 2, dtype)
        self.bytes_per_step = 2 * args.size * args.size * dtype.itemsize

    def step(self, bufs: list, k: int) -> None:
        self.kernel[self.grid, self.block, self.stream](bufs[k % 2], bufs[1 - k % 2], *self.weights)

    def timed_ms(self, fn: Callable[[int], None], count: int, start: int = 0) -> float:
        from numba import cuda

        begin, end = cuda.event(), cuda.event()
        begin.record(self.stream)
        for k in range(start, start + count):
            fn(k)
        end.record(self.stream)
        end.synchronize()
        return cuda.event_elapsed_time(begin, end)

    def measure(self, bufs: list, fault_sweep: bool) -> dict:
        """Two first steps (the first timed alone if ``fault_sweep``), then the timed trials."""
        out: dict[str, Any] = {}
        if fault_sweep:
            ms = self.timed_ms(lambda k: self.step(bufs, k), 1)
            out["first_sweep_ms"] = ms
            out["first_sweep_gbps"] = self.bytes_per_step / (ms * 1e-3) / 1e9
            self.step(bufs, 1)
        else:
            self.step(bufs, 0)
            self.step(bufs, 1)
        self.stream.synchronize()
        k, rates = 2, []
        for _ in range(self.args.trials):
            ms = self.timed_ms(lambda i: self.step(bufs, i), self.args.steps, start=k)
            k += self.args.steps
            rates.append(self.bytes_per_step * self.args.steps / (ms * 1e-3) / 1e9)
        out.update(gbps=statistics.median(rates), gbps_best=max(rates), gbps_trials=rates, steps_run=k)
        out["latest"] = k % 2  # index in bufs of the newest field
        return out


def _copy_bandwidth(runner: _Runner, u0: np.ndarray) -> dict:
    """cuMemcpyDtoDAsync of one grid, read + write bytes, same trials as the stencil."""
    from numba import cuda

    s = runner.stream
    a = cuda.to_device(u0, stream=s)
    b = cuda.device_array_like(a)
    pair = (a, b)

    def copy(k: int) -> None:
        pair[1 - k % 2].copy_to_device(pair[k % 2], stream=s)

    copy(0)
    copy(1)
    rates = []
    for _ in range(runner.args.trials):
        ms = runner.timed_ms(copy, runner.args.steps)
        rates.append(runner.bytes_per_step * runner.args.steps / (ms * 1e-3) / 1e9)
    del a, b
    return {
        "gbps": statistics.median(rates),
        "gbps_best": max(rates),
        "gbps_trials": rates,
        "what": "cuMemcpyDtoDAsync via numba copy_to_device, 2 x nbytes per copy",
    }


def _allocate(kind: str, u0: np.ndarray, device_id: int, stream: Any) -> tuple[list, dict, Callable[[Any], np.ndarray]]:
    """Two buffers holding ``u0`` on the device (per the kind), setup figures, a fetch function.

    Raises ``_SkipError`` when this build of umem_numba lacks what the kind needs.
    """
    from numba import cuda

    import umem_numba as um

    info: dict[str, Any] = {}
    if kind == "device_array":
        bufs = [cuda.to_device(u0, stream=stream), cuda.to_device(u0, stream=stream)]
        stream.synchronize()
        return bufs, info, lambda a: a.copy_to_host()
    if kind == "vmm":
        vmm = getattr(um, "VMMBuffer", None)
        if vmm is None:
            raise _SkipError("umem_numba.VMMBuffer is not available in this build")
        bufs = [vmm.empty(u0.shape, u0.dtype, device=device_id) for _ in range(2)]
        for b in bufs:
            b.copy_from_host(u0, stream=stream)
        stream.synchronize()
        return bufs, info, lambda a: a.copy_to_host()
    # Managed kinds: filled on the host, so every page starts in host memory.
    bufs = [um.ManagedBuffer.from_array(u0), um.ManagedBuffer.from_array(u0)]
    if kind in ("managed+prefetch", "managed+prefetch+advice"):
        if not hasattr(bufs[0], "prefetch"):
            _close(bufs)
            raise _SkipError("ManagedBuffer.prefetch is not available in this build")
        if kind == "managed+prefetch+advice":
            policy = getattr(um, "MigrationPolicy", None)
            if policy is None or not hasattr(bufs[0], "apply_policy"):
                _close(bufs)
                raise _SkipError("MigrationPolicy / ManagedBuffer.apply_policy are not available in this build")
            for b in bufs:
                b.apply_policy(policy.PREFER_DEVICE(device_id))
            info["advice"] = f"MigrationPolicy.PREFER_DEVICE({device_id})"
        t0 = time.perf_counter()
        for b in bufs:
            b.prefetch(device_id, stream=stream)
        stream.synchronize()
        seconds = time.perf_counter() - t0
        info["prefetch_s"] = seconds
        info["prefetch_gbps"] = 2 * u0.nbytes / seconds / 1e9
    return bufs, info, lambda a: np.array(a.host)


class _SkipError(Exception):
    pass


def _close(bufs: list) -> None:
    for b in bufs:
        close = getattr(b, "close", None)
        if close is not None:
            close()


def _chart(path: str, title: str, rows: list[dict], copy_gbps: float) -> None:
    """Bar chart of GB/s per kind (and of the fault-driven first sweep) against the copy."""
    from umem_numba.kernels._plot import save_bar_chart

    labels, values, texts = [], [], []
    for r in rows:
        if "gbps" not in r:
            continue
        labels.append(r["kind"])
        values.append(r["gbps"])
        texts.append(f"{r['gbps']:.0f} GB/s, {r['vs_device_array']:.3f}x device_array, {r['vs_copy']:.3f}x copy")
        if "first_sweep_gbps" in r:
            labels.append(f"{r['kind']}, 1st sweep")
            values.append(r["first_sweep_gbps"])
            texts.append(f"{r['first_sweep_gbps']:.1f} GB/s (page faults)")
    save_bar_chart(
        path,
        labels,
        values,
        texts=texts,
        reference=copy_gbps,
        reference_label=f"device-to-device copy {copy_gbps:.0f} GB/s",
        xlabel="GB/s (read + write)",
        title=title,
    )


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Time the stencil on every memory kind, print the tables and return the results.

    Parameters
    ----------
    argv : list of str, optional
        The benchmark's options (see ``--help``; ``--png PATH`` draws a chart).

    Returns
    -------
    dict
        ``benchmark``, ``figures`` (goal rows), ``ok`` (every kind produced
        the same field) and the raw measurements.

    Raises
    ------
    BenchSkipped
        No usable GPU, or the grids do not fit in free memory.
    """
    return _run(_parse(argv))


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from umem_numba import _driver
    from umem_numba.kernels import MemoryBudgetError, require_free_memory

    require_gpu()
    from numba import cuda

    from ._common import device_name

    if args.variants:
        return _variants_main(args)
    dtype = np.dtype(args.dtype)
    n = args.size
    grid_bytes = n * n * dtype.itemsize
    try:
        # One kind at a time holds two grids (the copy reference too).
        free, total = require_free_memory(
            2 * grid_bytes, f"2 grids of {n}x{n} {dtype}", allow_oversubscribe=args.allow_oversubscribe
        )
    except MemoryBudgetError as exc:
        raise BenchSkipped(str(exc)) from exc

    device_id = _driver.ensure_context()
    stream = cuda.stream()
    runner = _Runner(args, dtype, stream)
    u0 = _initial_field(n, dtype)
    print(
        f"heat2d step on {n}x{n} {dtype} ({grid_bytes / 2**30:.2f} GiB per grid), {device_name()}; "
        f"kernel rows_per_thread={runner.rows} block={runner.block} grid={runner.grid}; "
        f"{args.trials} trials x {args.steps} steps, median"
    )

    copy = _copy_bandwidth(runner, u0)
    rows: list[dict] = []
    reference_final = None
    for kind in progress(args.kinds, desc="bench stencil"):
        row: dict[str, Any] = {"kind": kind}
        try:
            bufs, info, fetch = _allocate(kind, u0, device_id, stream)
        except _SkipError as exc:
            row["skipped"] = str(exc)
            rows.append(row)
            print(f"  {kind}: skipped ({exc})", file=sys.stderr)
            continue
        try:
            row.update(info)
            row.update(runner.measure(bufs, fault_sweep=(kind == "managed")))
            final = fetch(bufs[row.pop("latest")])
        finally:
            _close(bufs)
            del bufs
        if reference_final is None:
            reference_final, row["identical_to_first_kind"] = final, True
        else:
            row["identical_to_first_kind"] = bool(np.array_equal(final, reference_final))
        del final
        rows.append(row)

    base = next((r["gbps"] for r in rows if r["kind"] == "device_array" and "gbps" in r), None)
    for r in rows:
        if "gbps" in r:
            r["vs_device_array"] = r["gbps"] / base if base else float("nan")
            r["vs_copy"] = r["gbps"] / copy["gbps"]

    table = [("DtoD copy", f"{copy['gbps']:.1f}", f"{copy['gbps_best']:.1f}", "", "1.000", "")]
    for r in rows:
        if "gbps" not in r:
            table.append((r["kind"], "skipped", "", "", "", r["skipped"]))
            continue
        notes = []
        if "first_sweep_gbps" in r:
            notes.append(f"first sweep {r['first_sweep_gbps']:.1f} GB/s ({r['first_sweep_ms']:.1f} ms)")
        if "prefetch_gbps" in r:
            notes.append(f"prefetch {r['prefetch_gbps']:.1f} GB/s")
        if not r["identical_to_first_kind"]:
            notes.append("RESULT DIFFERS from the first kind")
        table.append(
            (
                r["kind"],
                f"{r['gbps']:.1f}",
                f"{r['gbps_best']:.1f}",
                f"{r['vs_device_array']:.3f}",
                f"{r['vs_copy']:.3f}",
                "; ".join(notes),
            )
        )
    print()
    print_table(table, ["memory", "GB/s", "best", "vs device_array", "vs copy", "notes"])

    goals = {}
    figures = []
    by_kind = {r["kind"]: r for r in rows if "gbps" in r}
    if base:
        v = base / copy["gbps"]
        goals["stencil (device_array) / DtoD copy"] = {
            "value": v,
            "goal": GOAL_STENCIL_VS_COPY,
            "status": "met" if v >= GOAL_STENCIL_VS_COPY else "MISSED",
        }
        figures.append(goal_row(f"stencil on device_array / device-to-device copy ({dtype})", v, GOAL_STENCIL_VS_COPY))
    if "managed+prefetch" in by_kind and base:
        v = by_kind["managed+prefetch"]["vs_device_array"]
        goals["managed+prefetch / device_array"] = {
            "value": v,
            "goal": GOAL_PREFETCH_VS_DEVICE,
            "status": "met" if v >= GOAL_PREFETCH_VS_DEVICE else "MISSED",
        }
        figures.append(goal_row("stencil on managed+prefetch / device_array", v, GOAL_PREFETCH_VS_DEVICE))
    if base:
        for kind in ("managed", "managed+prefetch+advice", "vmm"):
            if kind in by_kind:
                figures.append(goal_row(f"stencil on {kind} / device_array", by_kind[kind]["vs_device_array"]))
        if "managed" in by_kind:
            figures.append(
                goal_row(
                    "first sweep of managed memory without hints (page faults)",
                    by_kind["managed"]["first_sweep_gbps"],
                    unit="GB/s",
                )
            )
    # 3-D: the default kernel against the copy, in the same run (every design: --variants).
    print()
    try:
        three_d = _variants_main(args, only_default=True)
    except BenchSkipped as exc:
        three_d = {"skipped": str(exc)}
        print(f"heat3d skipped: {exc}")
    else:
        best = three_d["winner"]
        if best is not None:
            figures.append(
                goal_row(
                    f"heat3d {best['variant']} ({dtype}, {args.size3d}^3) / device-to-device copy",
                    best["vs_copy"],
                    GOAL_3D_VS_COPY,
                )
            )
    if figures:
        print()
        print_figures(figures)
    warnings = []
    ms_per_step = runner.bytes_per_step / (copy["gbps"] * 1e9) * 1e3
    if ms_per_step < 0.1:
        # At 4096^2 float32 (32 us per copy) numba's copy_to_device and the
        # kernel launches are host-bound, so the ratios mean little.
        warnings.append(
            f"a step moves only {runner.bytes_per_step / 2**20:.0f} MiB ({ms_per_step * 1e3:.0f} us "
            "at copy speed): launch overhead and L2 hits skew these numbers; use --size 8192 or more"
        )
    for w in warnings:
        print(f"\nnote: {w}")
    identical = all(r.get("identical_to_first_kind", True) for r in rows)
    if not identical:
        print("\nERROR: the memory kinds produced different fields from the same steps", file=sys.stderr)

    result = {
        "benchmark": "stencil",
        "device": device_name(),
        "device_memory": {"free_bytes": free, "total_bytes": total},
        "size": n,
        "dtype": str(dtype),
        "steps_per_trial": args.steps,
        "trials": args.trials,
        "bytes_per_step": runner.bytes_per_step,
        "kernel": {
            "name": "heat2d",
            "rows_per_thread": runner.rows,
            "block": list(runner.block),
            "grid": list(runner.grid),
        },
        "copy": copy,
        "results": rows,
        "heat3d": three_d,
        "goals": goals,
        "figures": figures,
        "all_kinds_identical": identical,
        "ok": identical,
        "warnings": warnings,
    }
    if args.png:
        _chart(args.png, f"heat2d {n}^2 {dtype} on {device_name()}", rows, copy["gbps"])
        print(f"wrote {args.png}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the stencil benchmark; see the module docstring.

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments (``sys.argv[1:]`` when ``None``).

    Returns
    -------
    int
        0 after a run, 1 when the memory kinds disagreed, 2 when it cannot run here.
    """
    return command_line("stencil", _parse, _run, argv)


def charts(result: dict[str, Any], out_dir: str) -> list[str]:
    """Extra charts for the benchmark report: GB/s per memory kind against the copy.

    Parameters
    ----------
    result : dict
        What :func:`run` returned.
    out_dir : str
        Folder to write into.

    Returns
    -------
    list of str
        The files written.
    """
    import os

    path = os.path.join(out_dir, "stencil-bandwidth.png")
    _chart(
        path,
        f"heat2d {result['size']}^2 {result['dtype']} on {result['device']}",
        result["results"],
        result["copy"]["gbps"],
    )
    return [path]


# -- 3-D kernel variants ------------------------------------------------------------------------


def _initial_cube(n: int, dtype: np.dtype) -> np.ndarray:
    """A smooth non-constant cube, built plane by plane."""
    u = np.empty((n, n, n), dtype)
    yx = (np.sin(np.linspace(0.0, 3.0, n))[:, None] + np.cos(np.linspace(0.0, 5.0, n))[None, :]).astype(dtype)
    for z, w in enumerate(np.linspace(0.5, 1.5, n, dtype=np.float64)):
        u[z] = yx * dtype.type(w)
    return u


def _variants_main(args: argparse.Namespace, only_default: bool = False) -> dict[str, Any]:
    """``--variants``: every 3-D kernel design and launch shape against the copy, one run.

    ``only_default``: just the kernel :func:`~umem_numba.kernels.heat3d_step` uses (the 3-D row
    of the default run).
    """
    from numba import cuda

    from umem_numba import _driver
    from umem_numba.kernels import (
        DEFAULT_VARIANT_3D,
        TUNED_3D,
        MemoryBudgetError,
        heat3d_launch,
        require_free_memory,
        stencil_weights,
    )
    from umem_numba.kernels.stencil3d import tile_shared_bytes

    from ._common import device_name

    dtype = np.dtype(args.dtype)
    n = args.size3d
    grid_bytes = n * n * n * dtype.itemsize
    try:
        free, total = require_free_memory(
            2 * grid_bytes, f"2 grids of {n}^3 {dtype}", allow_oversubscribe=args.allow_oversubscribe
        )
    except MemoryBudgetError as exc:
        raise BenchSkipped(str(exc)) from exc
    _driver.ensure_context()
    stream = cuda.stream()
    shape = (n, n, n)
    bytes_per_step = 2 * grid_bytes
    weights = stencil_weights(1.0 / 7.0, 3, dtype)
    u0 = _initial_cube(n, dtype)
    default_planes, default_block = TUNED_3D[dtype]
    default = (DEFAULT_VARIANT_3D[dtype], default_planes, tuple(default_block))
    sweep = [default] + ([] if only_default else [v for v in VARIANT_SWEEP_3D if v != default])
    print(
        f"heat3d variants on {n}^3 {dtype} ({grid_bytes / 2**30:.2f} GiB per grid), {device_name()}; "
        f"{args.trials} trials x {args.steps} steps, median; default {default}"
    )

    a = cuda.to_device(u0, stream=stream)
    b = cuda.to_device(u0, stream=stream)
    stream.synchronize()

    def timed(fn: Callable[[int], None]) -> list[float]:
        fn(0)
        fn(1)
        rates = []
        for _ in range(args.trials):
            begin, end = cuda.event(), cuda.event()
            begin.record(stream)
            for k in range(args.steps):
                fn(k)
            end.record(stream)
            end.synchronize()
            rates.append(bytes_per_step * args.steps / (cuda.event_elapsed_time(begin, end) * 1e-3) / 1e9)
        return rates

    pair = (a, b)

    def copy(k: int) -> None:
        pair[1 - k % 2].copy_to_device(pair[k % 2], stream=stream)

    copy_rates = timed(copy)
    copy_gbps = statistics.median(copy_rates)
    check_steps = 6
    rows: list[dict[str, Any]] = []
    reference = None
    for variant, planes, block in sweep:
        row: dict[str, Any] = {"variant": variant, "planes_per_thread": planes, "block": list(block)}
        if variant == "tile" and tile_shared_bytes(planes, block, dtype.itemsize) > 48 * 1024:
            row["error"] = (
                f"skipped: the tile needs {tile_shared_bytes(planes, block, dtype.itemsize)} bytes "
                f"of shared memory for {dtype}, more than 48 KiB"
            )
            rows.append(row)
            continue
        try:
            kernel, grid, blk = heat3d_launch(shape, dtype, planes, block, variant)
            a.copy_to_device(u0, stream=stream)
            b.copy_to_device(u0, stream=stream)

            def step(k: int, kernel: Any = kernel, grid: Any = grid, blk: Any = blk) -> None:
                kernel[grid, blk, stream](pair[k % 2], pair[1 - k % 2], *weights)

            for k in range(check_steps):  # also compiles
                step(k)
            final = a.copy_to_host(stream=stream) if check_steps % 2 == 0 else b.copy_to_host(stream=stream)
            stream.synchronize()
            rates = timed(step)
        except Exception as exc:  # a launch shape this GPU or numba refuses: report, go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(f"  {variant} {planes} {block}: {row['error']}", file=sys.stderr)
            continue
        if reference is None:
            reference = final
        scale = float(np.max(np.abs(reference))) or 1.0
        row.update(
            gbps=statistics.median(rates),
            gbps_best=max(rates),
            gbps_trials=rates,
            vs_copy=statistics.median(rates) / copy_gbps,
            bitwise_equal_to_default=bool(np.array_equal(final, reference)),
            max_rel_diff_to_default=float(np.max(np.abs(final - reference))) / scale,
        )
        rows.append(row)
        del final
    del a, b

    ok = [r for r in rows if "gbps" in r]
    ok_sorted = sorted(ok, key=lambda r: -r["gbps"])
    table = [("DtoD copy", "", "", f"{copy_gbps:.1f}", "1.000", "")]
    for r in ok_sorted:
        note = "" if r["bitwise_equal_to_default"] else f"rel diff {r['max_rel_diff_to_default']:.1e}"
        if r["max_rel_diff_to_default"] > 1e-5:
            note = "RESULT DIFFERS " + note
        table.append(
            (
                r["variant"],
                r["planes_per_thread"],
                "x".join(map(str, r["block"])),
                f"{r['gbps']:.1f}",
                f"{r['vs_copy']:.3f}",
                note,
            )
        )
    for r in rows:
        if "error" in r:
            table.append(
                (r["variant"], r["planes_per_thread"], "x".join(map(str, r["block"])), "error", "", r["error"][:80])
            )
    print()
    print_table(table, ["variant", "planes", "block", "GB/s", "vs copy", "notes"])
    winner = ok_sorted[0] if ok_sorted else None
    default_row = next((r for r in ok if (r["variant"], r["planes_per_thread"], tuple(r["block"])) == default), None)
    goals = {}
    if winner is not None:
        print(
            f"\nwinner: variant={winner['variant']!r} planes_per_thread={winner['planes_per_thread']} "
            f"block={tuple(winner['block'])}: {winner['gbps']:.1f} GB/s = {winner['vs_copy']:.3f}x the copy"
        )
        if default_row is not None:
            print(f"default: {default}: {default_row['gbps']:.1f} GB/s = {default_row['vs_copy']:.3f}x the copy")
        goals["heat3d best variant / DtoD copy"] = {
            "value": winner["vs_copy"],
            "goal": GOAL_3D_VS_COPY,
            "status": goal_text(winner["vs_copy"], GOAL_3D_VS_COPY),
        }
        print(f"goal heat3d {dtype} >= {GOAL_3D_VS_COPY}x copy: {goals['heat3d best variant / DtoD copy']['status']}")
    differs = [r for r in ok if r["max_rel_diff_to_default"] > 1e-5]
    if differs:
        print("\nERROR: some variants' fields differ from the default's beyond rounding", file=sys.stderr)
    return {
        "benchmark": "stencil-variants",
        "device": device_name(),
        "device_memory": {"free_bytes": free, "total_bytes": total},
        "size": n,
        "dtype": str(dtype),
        "steps_per_trial": args.steps,
        "trials": args.trials,
        "bytes_per_step": bytes_per_step,
        "copy": {"gbps": copy_gbps, "gbps_best": max(copy_rates), "gbps_trials": copy_rates},
        "default": {"variant": default[0], "planes_per_thread": default[1], "block": list(default[2])},
        "winner": winner,
        "results": rows,
        "goals": goals,
        "figures": [goal_row(name, g["value"], g["goal"]) for name, g in goals.items()],
        "ok": not differs and winner is not None,
    }
