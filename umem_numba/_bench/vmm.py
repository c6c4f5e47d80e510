"""VMM benchmark: ``python -m umem_numba bench vmm [--json PATH] [--quick]``.

Three comparisons, measured in one process after a warm-up:

1. **grow in place**: ``VMMBuffer.grow`` from 1 GiB to 2 GiB (one ``cuMemCreate`` +
   ``cuMemMap`` + ``cuMemSetAccess``) vs the classic way: ``cuMemAlloc`` 2 GiB, copy
   the 1 GiB device-to-device, ``cuMemFree`` the old block.  Median over repetitions,
   host time around the calls with a context synchronise at both ends (goal >= 10x).
2. **append**: 64 MiB appended (and written with a memset) step by step up to 8 GiB,
   growing a VMMBuffer in place vs a doubling reallocation strategy (allocate twice
   the capacity, copy, free).  Total time and peak device memory of each.
3. **streaming kernel**: ``a[i] = b[i] * s`` (float32, grid-stride) on VMMBuffers (one
   chunk each, and built by 64 MiB growth steps) vs numba ``DeviceNDArray``; bandwidth
   (read + write bytes) between CUDA events, median of interleaved rounds (goal >= 0.98x).

Sizes shrink (halving) when the device has too little free memory; ``--quick`` uses
small sizes for a smoke run, where the goals are printed but not meaningful.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _driver
from .._errors import CudaUnavailableError
from ._common import (
    BenchSkipped,
    command_line,
    device_name,
    goal_row,
    goal_text,
    plain_text,
    print_figures,
    print_table,
    require_gpu,
)

_MIB = 1 << 20
_GIB = 1 << 30
#: Device memory left untouched besides what a benchmark holds.
_HEADROOM = 1 * _GIB


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m umem_numba bench vmm",
        description=plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run)")
    p.add_argument(
        "--repeats", type=int, default=None, metavar="N", help="timed repetitions per figure (default 7, quick 3)"
    )
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def _sync() -> None:
    _driver.call("cuCtxSynchronize", detail="benchmark synchronise")


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds from an idle device to the end of ``fn``'s device work."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _alloc(nbytes: int) -> int:
    return int(_driver.call("cuMemAlloc", nbytes, detail=f"benchmark cuMemAlloc of {nbytes} bytes"))


def _free(ptr: int) -> None:
    _driver.call("cuMemFree", ptr, detail="benchmark cuMemFree")


def _memset(ptr: int, value: int, nbytes: int) -> None:
    _driver.call("cuMemsetD8Async", ptr, value, nbytes, 0, detail="benchmark memset")


# ---------------------------------------------------------------------------
# 1. grow in place vs reallocate + copy


def _bench_grow(size: int, warmup: int, repeats: int) -> dict:
    from .._vmm._buffer import VMMBuffer

    buf = VMMBuffer.empty(size, np.uint8, capacity=2 * size)
    _memset(buf._address, 1, size)
    vmm: list[float] = []
    try:
        for r in range(warmup + repeats):
            t = _timed(lambda: buf.grow(2 * size))
            if buf._address == 0 or buf.chunk_count != 2:
                raise RuntimeError("grow did not map a second chunk")
            buf.shrink(size)  # untimed: back to one chunk for the next round
            if r >= warmup:
                vmm.append(t)
    finally:
        buf.close()

    old = _alloc(size)
    _memset(old, 1, size)
    realloc: list[float] = []
    try:
        for r in range(warmup + repeats):
            holder: dict[str, int] = {}

            def move(holder: dict[str, int] = holder, old: int = old) -> None:  # this round's block and holder
                new = _alloc(2 * size)
                holder["new"] = new
                _driver.call("cuMemcpyDtoDAsync", new, old, size, 0, detail="benchmark copy")
                _free(old)

            t = _timed(move)
            _free(holder["new"])
            old = _alloc(size)  # untimed: a fresh 1x block for the next round
            _memset(old, 1, size)
            if r >= warmup:
                realloc.append(t)
    finally:
        _free(old)
    v, b = statistics.median(vmm), statistics.median(realloc)
    return {
        "size_bytes": size,
        "vmm_grow_s": v,
        "realloc_copy_s": b,
        "speedup": b / v,
        "vmm_all_s": vmm,
        "realloc_all_s": realloc,
    }


# ---------------------------------------------------------------------------
# 2. append in steps: grow in place vs doubling reallocation


def _append_vmm(step: int, total: int) -> tuple[float, int]:
    from .._vmm._buffer import VMMBuffer

    holder: dict[str, Any] = {}

    def run() -> None:
        buf = VMMBuffer.empty(step, np.uint8, capacity=total)
        holder["buf"] = buf
        _memset(buf._address, 1, step)
        while len(buf) < total:
            n = len(buf)
            buf.grow(n + step)
            _memset(buf._address + n, 1, step)

    t = _timed(run)
    buf = holder["buf"]
    peak = buf.mapped_nbytes
    buf.close()
    return t, peak


def _append_doubling(step: int, total: int) -> tuple[float, int]:
    state = {"ptr": 0, "cap": 0, "peak": 0}

    def run() -> None:
        ptr, cap, length, peak = _alloc(step), step, 0, step
        while length < total:
            if length + step > cap:
                new = _alloc(2 * cap)
                peak = max(peak, 3 * cap)  # old and new blocks are both alive here
                _driver.call("cuMemcpyDtoDAsync", new, ptr, length, 0, detail="benchmark copy")
                _free(ptr)
                ptr, cap = new, 2 * cap
            _memset(ptr + length, 1, step)
            length += step
        state.update(ptr=ptr, cap=cap, peak=peak)

    t = _timed(run)
    _free(state["ptr"])
    return t, state["peak"]


def _bench_append(step: int, total: int, warmup: int, repeats: int) -> dict:
    vmm, dbl = [], []
    peaks = {}
    for r in range(warmup + repeats):
        tv, peaks["vmm"] = _append_vmm(step, total)
        td, peaks["doubling"] = _append_doubling(step, total)
        if r >= warmup:
            vmm.append(tv)
            dbl.append(td)
    v, d = statistics.median(vmm), statistics.median(dbl)
    return {
        "step_bytes": step,
        "total_bytes": total,
        "vmm_s": v,
        "doubling_s": d,
        "speedup": d / v,
        "vmm_peak_bytes": peaks["vmm"],
        "doubling_peak_bytes": peaks["doubling"],
        "vmm_all_s": vmm,
        "doubling_all_s": dbl,
    }


# ---------------------------------------------------------------------------
# 3. streaming kernel bandwidth


def _stream_kernel() -> Any:
    from numba import cuda

    @cuda.jit
    def scale(a: Any, b: Any, s: Any) -> None:
        start, step = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, a.shape[0], step):
            a[i] = b[i] * s

    return scale


def _bench_stream(nbytes: int, step: int, launches: int, rounds: int) -> dict:
    from numba import cuda

    from .._vmm._buffer import VMMBuffer

    n = nbytes // 4
    kernel = _stream_kernel()
    dev = cuda.get_current_device()
    blocks, threads = dev.MULTIPROCESSOR_COUNT * 8, 256
    host = np.random.default_rng(0).random(n, dtype=np.float32)

    def grown() -> VMMBuffer:
        buf = VMMBuffer.empty(0, np.float32, capacity=n)
        while len(buf) < n:
            buf.grow(min(n, len(buf) + step // 4))
        buf.copy_from_host(host)
        return buf

    pairs = {
        "DeviceNDArray": (cuda.to_device(host), cuda.to_device(host)),
        "VMMBuffer (1 chunk)": (VMMBuffer.from_array(host, capacity=n), VMMBuffer.from_array(host, capacity=n)),
        f"VMMBuffer ({step // _MIB} MiB chunks)": (grown(), grown()),
    }
    chunks = {name: getattr(a, "chunk_count", 1) for name, (a, _) in pairs.items()}
    for a, b in pairs.values():  # warm-up: compile, first touch of the page tables
        kernel[blocks, threads](a, b, np.float32(2.0))
    cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(rounds):  # interleaved: drift on a shared machine hits every case alike
        for name, (a, b) in pairs.items():
            start, end = cuda.event(), cuda.event()
            start.record()
            for _ in range(launches):
                kernel[blocks, threads](a, b, np.float32(2.0))
            end.record()
            end.synchronize()
            seconds = cuda.event_elapsed_time(start, end) / 1e3
            samples[name].append(2 * nbytes * launches / seconds)
    check = {}
    for name, (a, _b) in pairs.items():
        out = a.copy_to_host()
        check[name] = bool(np.array_equal(out, host * np.float32(2.0)))
    for a, b in pairs.values():
        for x in (a, b):
            if isinstance(x, VMMBuffer):
                x.close()
    bw = {name: statistics.median(v) for name, v in samples.items()}
    return {
        "bytes_per_array": nbytes,
        "launches": launches,
        "rounds": rounds,
        "grid": [blocks, threads],
        "bandwidth_Bps": bw,
        "chunks": chunks,
        "values_ok": check,
        "all_Bps": samples,
    }


# ---------------------------------------------------------------------------


def _fit(wanted: dict[str, int], free: int) -> tuple[dict[str, int], bool]:
    """Halve the sizes until the largest footprint fits in free memory (minus headroom)."""
    sizes = dict(wanted)
    scaled = False
    while max(3 * sizes["grow"], 3 * sizes["append_total"] // 2, 6 * sizes["stream"]) > free - _HEADROOM:
        if sizes["grow"] <= 64 * _MIB:
            raise MemoryError(f"only {free / _GIB:.1f} GiB of device memory is free: too little for this benchmark")
        sizes = {k: (v // 2 if k != "step" else v) for k, v in sizes.items()}
        scaled = True
    return sizes, scaled


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure VMM growth and kernel bandwidth, print the tables and return the results.

    Parameters
    ----------
    argv : list of str, optional
        The benchmark's options (``--quick``, ``--repeats N``).

    Returns
    -------
    dict
        ``benchmark``, ``figures`` (goal rows), and the raw measurements.

    Raises
    ------
    BenchSkipped
        No usable GPU, or too little free device memory.
    """
    return _run(_parse(argv))


def _run(args: argparse.Namespace) -> dict[str, Any]:
    require_gpu()
    try:
        _driver.ensure_context()
        free, total = _driver.mem_get_info()
    except CudaUnavailableError as exc:
        raise BenchSkipped(f"no usable GPU: {exc}") from exc
    if args.quick:
        wanted = {"grow": 64 * _MIB, "step": 16 * _MIB, "append_total": 256 * _MIB, "stream": 64 * _MIB}
        repeats, warmup, launches, rounds = args.repeats or 3, 1, 5, 3
    else:
        wanted = {"grow": _GIB, "step": 64 * _MIB, "append_total": 8 * _GIB, "stream": _GIB}
        repeats, warmup, launches, rounds = args.repeats or 7, 2, 20, 7
    try:
        sizes, scaled = _fit(wanted, free)
    except MemoryError as exc:
        raise BenchSkipped(str(exc)) from exc

    from .._vmm._access import allocation_granularity

    gran = allocation_granularity()
    grow = _bench_grow(sizes["grow"], warmup, repeats)
    append = _bench_append(sizes["step"], sizes["append_total"], 1, max(1, repeats // 2))
    stream = _bench_stream(sizes["stream"], sizes["step"], launches, rounds)

    ref = stream["bandwidth_Bps"]["DeviceNDArray"]
    g, a = grow["size_bytes"], append
    rows = [
        (
            f"grow {g / _GIB:g} GiB -> {2 * g / _GIB:g} GiB",
            _fmt_time(grow["vmm_grow_s"]),
            f"alloc+copy+free {_fmt_time(grow['realloc_copy_s'])}",
            f"{grow['speedup']:.1f}x",
            ">= 10x",
            goal_text(grow["speedup"], 10.0),
        ),
        (
            f"append {a['step_bytes'] // _MIB} MiB steps to {a['total_bytes'] / _GIB:g} GiB",
            _fmt_time(a["vmm_s"]),
            f"doubling {_fmt_time(a['doubling_s'])}",
            f"{a['speedup']:.2f}x",
            "-",
            "-",
        ),
        (
            "  peak device memory",
            f"{a['vmm_peak_bytes'] / _GIB:.2f} GiB",
            f"{a['doubling_peak_bytes'] / _GIB:.2f} GiB",
            f"{a['doubling_peak_bytes'] / a['vmm_peak_bytes']:.2f}x less",
            "-",
            "-",
        ),
    ]
    figures = [
        goal_row(
            f"grow {g / _GIB:g} -> {2 * g / _GIB:g} GiB in place: alloc+copy+free time / grow time",
            grow["speedup"],
            10.0,
        ),
        goal_row(
            f"append {a['step_bytes'] // _MIB} MiB steps to {a['total_bytes'] / _GIB:g} GiB: doubling time / VMM time",
            a["speedup"],
        ),
        goal_row("append: doubling peak memory / VMM peak memory", a["doubling_peak_bytes"] / a["vmm_peak_bytes"]),
    ]
    for name, bw in stream["bandwidth_Bps"].items():
        if name == "DeviceNDArray":
            continue
        ratio = bw / ref
        rows.append(
            (
                f"stream a=b*s, {name}",
                f"{bw / 1e12:.3f} TB/s",
                f"DeviceNDArray {ref / 1e12:.3f} TB/s",
                f"{ratio:.3f}x",
                ">= 0.98x",
                goal_text(ratio, 0.98),
            )
        )
        figures.append(goal_row(f"streaming kernel on {name} / DeviceNDArray", ratio, 0.98))
    note = " (quick: small sizes, goals not meaningful)" if args.quick else ""
    print(
        f"VMM benchmark on {device_name()}: granularity {gran // _MIB} MiB, "
        f"{free / _GIB:.1f} of {total / _GIB:.1f} GiB free"
        + note
        + (" (sizes halved to fit free memory)" if scaled else "")
    )
    print_table(rows, ["figure", "VMM", "baseline", "ratio", "goal", ""])
    print()
    print_figures(figures)
    if not all(stream["values_ok"].values()):
        print(f"WARNING: wrong kernel results: {stream['values_ok']}")
    return {
        "benchmark": "vmm",
        "device": device_name(),
        "quick": args.quick,
        "scaled": scaled,
        "granularity": gran,
        "free_bytes": free,
        "total_bytes": total,
        "grow": grow,
        "append": append,
        "stream": stream,
        "goals": {
            "grow_speedup": {"value": grow["speedup"], "goal": 10.0},
            **{
                f"stream {k}": {"value": v / ref, "goal": 0.98}
                for k, v in stream["bandwidth_Bps"].items()
                if k != "DeviceNDArray"
            },
        },
        "figures": figures,
        "ok": all(stream["values_ok"].values()),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the VMM benchmark; see the module docstring.

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments (``--json PATH``, ``--quick``, ``--repeats N``).

    Returns
    -------
    int
        0 after a run (goals missed included: they are reported), 2 without a GPU
        or with too little free device memory.
    """
    return command_line("vmm", _parse, _run, argv)
