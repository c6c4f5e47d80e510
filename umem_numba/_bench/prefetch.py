"""Prefetch benchmark: ``python -m umem_numba bench prefetch [--json PATH] [--size-gib N] [--quick]``.

One run, one buffer size (>= 1 GiB by default), four comparisons:

1. ``buf.prefetch(device)`` host->device vs a pinned ``cuMemcpyHtoDAsync`` of the same size (goal >= 0.9x);
2. ``buf.prefetch("cpu")`` device->host vs a pinned ``cuMemcpyDtoHAsync`` (goal >= 0.8x), plus two
   alternative ways of issuing it (an explicit host NUMA node; a 64-range batch) so the report
   says whether anything beats the plain call;
3. a kernel touching host-resident managed memory with no prefetch (page faults) vs
   prefetch + the same kernel, values checked;
4. a 64-entry :class:`PrefetchPlan` (one batched driver call where available) vs 64
   ``prefetch_range`` calls;
6. automatic prefetch (``set_auto_prefetch``, issue #28 item 3), 256 MiB: a launch after the
   host wrote the buffer, and a host read after the device wrote it, against an explicit
   prefetch followed by the same work (goal >= 0.9x the speed) and against page faults;
5. ``buf.discard_prefetch("cpu")`` of the device-resident buffer vs the plain device->host
   prefetch of (2) (goal >= 1x; discarded pages carry no data, so nothing should cross the
   bus: the figure says how much of the transfer the discard saves).  Where the driver has no
   ``cuMemDiscardAndPrefetchBatchAsync`` (before CUDA 13) the row is left out with a note.

Every figure is the median of the repetitions, measured on one stream after a warm-up,
with the same statistic on both sides of a ratio.  The managed buffer is never larger
than the free device memory (``cuMemGetInfo``): oversubscribing managed memory can hang
the GPU, so the benchmark refuses instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _driver
from .._errors import CudaUnavailableError
from ._common import BenchSkipped, command_line, goal_row, goal_text, print_figures, print_table, require_gpu

#: Device memory left alone besides the benchmark's own buffer.
_HEADROOM = 512 << 20
_PLAN_ENTRIES = 64
_GIB = 1 << 30


class _Refused(Exception):  # noqa: N818  (a refusal to run, reported as a skip, not an error)
    """The benchmark cannot run here (too little free memory, too small a size)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m umem_numba bench prefetch",
        description="Managed-memory prefetch vs pinned copies, faults and batching.",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "--size-gib",
        type=float,
        default=1.0,
        metavar="N",
        help="buffer size in GiB (default 1; the goals are defined for >= 1)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = p.parse_args(argv)
    if not args.size_gib > 0:
        p.error(f"--size-gib must be positive, got {args.size_gib}")
    return args


class _Clock:
    """Host timing around a stream synchronise (transfers here take tens of milliseconds)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def sync(self) -> None:
        _driver.call("cuStreamSynchronize", self.handle)

    def time(self, issue: Callable[[], Any]) -> tuple[float, float]:
        """``(seconds to complete, seconds the host spent issuing)``."""
        self.sync()
        t0 = time.perf_counter()
        issue()
        t1 = time.perf_counter()
        self.sync()
        return time.perf_counter() - t0, t1 - t0


def _median_time(clock: _Clock, reps: int, setup: Callable[[], Any], issue: Callable[[], Any]) -> tuple[float, float]:
    totals, issues = [], []
    for _ in range(reps):
        setup()
        clock.sync()
        total, issued = clock.time(issue)
        totals.append(total)
        issues.append(issued)
    return statistics.median(totals), statistics.median(issues)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _check_free(nbytes: int, what: str) -> str:
    free, _ = _driver.mem_get_info()
    if nbytes + _HEADROOM > free:
        return (
            f"refusing to run: {what} needs {nbytes / _GIB:.2f} GiB of device memory plus "
            f"{_HEADROOM >> 20} MiB headroom, but only {free / _GIB:.2f} GiB is free "
            "(managed memory must never oversubscribe the GPU); try a smaller --size-gib"
        )
    return ""


def _fill_random(host: np.ndarray, rng: np.random.Generator) -> None:
    # A random 4 MiB tile repeated: random-looking data without seconds of RNG time.
    tile = (rng.random(1 << 20, dtype=np.float32) + 0.5).astype(np.float32)
    flat = host.reshape(-1)
    for i in range(0, flat.size, tile.size):
        chunk = flat[i : i + tile.size]
        chunk[:] = tile[: chunk.size]


def _pinned_reference(nbytes: int, clock: _Clock, reps: int) -> dict[str, float]:
    from .._kinds._pinned import PinnedBuffer

    host = PinnedBuffer.empty(nbytes, np.uint8)
    dptr = int(_driver.call("cuMemAlloc", nbytes, detail="device buffer for the pinned-copy reference"))
    try:
        hptr = host._address
        h = clock.handle
        h2d = lambda: _driver.call("cuMemcpyHtoDAsync", dptr, hptr, nbytes, h)  # noqa: E731
        d2h = lambda: _driver.call("cuMemcpyDtoHAsync", hptr, dptr, nbytes, h)  # noqa: E731
        h2d(), d2h()  # warm-up
        t_h2d, _ = _median_time(clock, reps, lambda: None, h2d)
        t_d2h, _ = _median_time(clock, reps, lambda: None, d2h)
    finally:
        clock.sync()
        _driver.call("cuMemFree", dptr)
        host.close()
    return {"h2d": _gbps(nbytes, t_h2d), "d2h": _gbps(nbytes, t_d2h)}


def _d2h_variants(buf: Any, dev: int, clock: _Clock, reps: int) -> dict[str, float]:
    """Other ways to issue the device->host prefetch; each is timed like the plain call."""
    from .._driver._location import Host
    from .._hints._prefetch import PrefetchPlan

    out: dict[str, float] = {}
    nbytes = buf.nbytes
    to_dev = lambda: buf.prefetch(dev, clock.handle)  # noqa: E731
    try:
        numa = _driver.device_attribute("HOST_NUMA_ID", dev)
    except AttributeError:  # cuda-bindings 12.x has no such attribute
        numa = -1
    if numa >= 0:
        node = Host(numa=numa)
        numa_prefetch = lambda: buf.prefetch(node, clock.handle)  # noqa: E731
        numa_prefetch()
        t, _ = _median_time(clock, reps, to_dev, numa_prefetch)
        out[f"host NUMA node {numa}, one call"] = _gbps(nbytes, t)
    chunk = buf.size // _PLAN_ENTRIES
    plan = PrefetchPlan()
    for i in range(_PLAN_ENTRIES):
        plan.add_range(buf, i * chunk, buf.size if i == _PLAN_ENTRIES - 1 else (i + 1) * chunk, "cpu")
    t, _ = _median_time(clock, reps, to_dev, lambda: plan.execute(clock.handle))
    out[f"{_PLAN_ENTRIES}-range plan to the host"] = _gbps(nbytes, t)
    return out


def _discard_d2h(buf: Any, clock: _Clock, reps: int, to_dev: Callable[[], Any], notes: list[str]) -> float | None:
    """Median seconds of ``discard_prefetch("cpu")`` on the device-resident buffer; ``None`` where unsupported.

    Runs last: the buffer's values are gone afterwards.
    """
    missing = _driver.api().discard_missing
    if missing:
        notes.append(f"no discard row: {missing}")
        return None
    discard_to_host = lambda: buf.discard_prefetch("cpu", clock.handle)  # noqa: E731
    discard_to_host()  # warm-up: the first one may populate host pages
    t, _ = _median_time(clock, reps, to_dev, discard_to_host)
    return t


#: Size of the automatic-prefetch comparison (issue #28 item 3 states its goals at 256 MiB).
_AUTO_BYTES = 256 << 20


def _auto_prefetch(dev: int, stream: Any, clock: _Clock, reps: int, kernel: Any, notes: list[str]) -> dict[str, Any]:
    """(6) Automatic prefetch both ways against an explicit prefetch and against page faults.

    To the device: the host writes every page, then one launch (timed: launch to completion).
    ``auto``: the launch prefetches what the host touched (``set_auto_prefetch(True)``);
    ``explicit``: ``prefetch(device)`` then the launch, automatic prefetch off; ``faults``:
    the launch alone, off.  To the host: a kernel writes every element, then the host reads the
    buffer into a numpy array (timed: the read, the wait for the kernel done before).  ``auto``: a
    host view of the device's data prefetches it; ``explicit``: ``prefetch("cpu")``, then the
    read, off; ``faults``: the read alone, off.  Values are checked.
    """
    from .. import get_auto_prefetch, launch, set_auto_prefetch
    from .._kinds._managed import ManagedBuffer

    refusal = _check_free(_AUTO_BYTES, "the automatic-prefetch buffer")
    if refusal:
        notes.append(f"no automatic-prefetch rows: {refusal}")
        return {}
    n = _AUTO_BYTES // 4
    blocks = 8 * _driver.device_attribute("MULTIPROCESSOR_COUNT", dev)
    buf = ManagedBuffer.zeros(n, np.float32)
    out = np.empty(n, np.float32)
    before = get_auto_prefetch()
    times: dict[str, dict[str, list[float]]] = {"to_device": {}, "to_host": {}}
    try:
        value = np.float32(0.0)

        def host_writes() -> None:
            nonlocal value
            value = np.float32(value + 1.0)
            buf.host[:] = value  # every page, on the host

        def device_writes() -> None:
            launch(kernel, blocks, 256, buf, stream=stream)  # every element, on the device
            buf.synchronize()

        def read_back() -> None:
            np.copyto(out, buf.host)

        def launch_only() -> None:
            launch(kernel, blocks, 256, buf, stream=stream)

        def explicit_then_launch() -> None:
            buf.prefetch(dev, clock.handle)
            launch(kernel, blocks, 256, buf, stream=stream)

        for _ in range(reps + 1):  # the first round warms every path up
            for how in ("auto", "explicit", "faults"):
                set_auto_prefetch(how == "auto")
                host_writes()
                clock.sync()
                issue = explicit_then_launch if how == "explicit" else launch_only
                times["to_device"].setdefault(how, []).append(clock.time(issue)[0])
                if float(buf[0]) != value * 2 + 1 or float(buf[n - 1]) != value * 2 + 1:  # elements: no prefetch
                    notes.append(f"automatic prefetch to the device ({how}): values WRONG")
                device_writes()
                t0 = time.perf_counter()
                if how == "explicit":
                    buf.prefetch("cpu", clock.handle)
                    clock.sync()
                read_back()
                times["to_host"].setdefault(how, []).append(time.perf_counter() - t0)
                value = np.float32((value * 2 + 1) * 2 + 1)
                if out[0] != value or out[-1] != value:
                    notes.append(f"automatic prefetch to the host ({how}): values WRONG")
    finally:
        set_auto_prefetch(before)
        buf.close()
    med = {way: {how: statistics.median(ts[1:]) for how, ts in d.items()} for way, d in times.items()}
    return {"bytes": _AUTO_BYTES, "seconds": med}


def _kernel() -> Any:
    from numba import cuda

    @cuda.jit
    def twice_plus_one(a: Any) -> None:
        start = cuda.grid(1)
        step = cuda.gridsize(1)
        for i in range(start, a.shape[0], step):
            a[i] = a[i] * 2.0 + 1.0

    return twice_plus_one


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from numba import cuda

    from .. import launch
    from .._hints._prefetch import PrefetchPlan, _batch_possible
    from .._kinds._managed import ManagedBuffer

    reps = 2 if args.quick else 5
    nbytes = int(args.size_gib * _GIB) // (_PLAN_ENTRIES * 4 * 4096) * (_PLAN_ENTRIES * 4 * 4096)
    if nbytes == 0:
        raise _Refused(f"--size-gib {args.size_gib} is too small")
    dev = _driver.ensure_context()
    name = _driver.call("cuDeviceGetName", 256, dev)
    name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
    stream = cuda.stream()
    clock = _Clock(int(stream.handle))
    notes: list[str] = []
    if args.size_gib < 1:
        notes.append(f"size {args.size_gib} GiB is below the 1 GiB the goals are defined for")

    refusal = _check_free(nbytes, "the pinned-copy reference")
    if refusal:
        raise _Refused(refusal)
    pinned = _pinned_reference(nbytes, clock, reps)

    refusal = _check_free(nbytes, "the managed buffer")
    if refusal:
        raise _Refused(refusal)
    rng = np.random.default_rng()
    buf = ManagedBuffer.empty(nbytes // 4, np.float32)
    try:
        with buf.on_host() as host:
            _fill_random(host, rng)
        to_host = lambda: buf.prefetch("cpu", clock.handle)  # noqa: E731
        to_dev = lambda: buf.prefetch(dev, clock.handle)  # noqa: E731

        # The first device->host prefetch may land in host pages the driver has
        # to populate: it is reported on its own, the repetitions are warm.
        to_dev()
        first_d2h, _ = clock.time(to_host)
        t_h2d, issue_h2d = _median_time(clock, reps, to_host, to_dev)
        t_d2h, issue_d2h = _median_time(clock, reps, to_dev, to_host)
        variants = _d2h_variants(buf, dev, clock, reps)

        # (3) first touch by a kernel: faults vs prefetch first.  Values are checked.
        kernel = _kernel()
        warm = ManagedBuffer.from_array(np.ones(1024, np.float32))
        launch(kernel, 4, 256, warm, stream=stream)
        warm.close()
        blocks = 8 * _driver.device_attribute("MULTIPROCESSOR_COUNT", dev)
        idx = rng.integers(0, buf.size, 4096)
        expect = buf.host[idx].astype(np.float32)
        run_kernel = lambda: launch(kernel, blocks, 256, buf, stream=stream)  # noqa: E731
        fault_times: list[float] = []
        prefetch_times: list[float] = []
        for _ in range(max(1, reps - 2)):
            for timed_list, issue in ((fault_times, run_kernel), (prefetch_times, lambda: (to_dev(), run_kernel()))):
                to_host()
                clock.sync()
                timed_list.append(clock.time(issue)[0])
                expect = expect * np.float32(2.0) + np.float32(1.0)
        got = buf.host[idx]
        values_ok = bool(np.allclose(got, expect, rtol=1e-6, atol=0))
        if not values_ok:
            notes.append("kernel values WRONG after the first-touch test")
        t_fault, t_pf_kernel = statistics.median(fault_times), statistics.median(prefetch_times)
        auto = _auto_prefetch(dev, stream, clock, reps, kernel, notes)

        # (4) 64 ranges: one plan vs 64 calls.
        chunk = buf.size // _PLAN_ENTRIES
        bounds = [(i * chunk, buf.size if i == _PLAN_ENTRIES - 1 else (i + 1) * chunk) for i in range(_PLAN_ENTRIES)]
        plan = PrefetchPlan()
        for a, b in bounds:
            plan.add_range(buf, a, b, dev)
        t_plan, issue_plan = _median_time(clock, reps, to_host, lambda: plan.execute(clock.handle))
        batched = _batch_possible(clock.handle, len(plan))  # after: a driver without it is found out by running

        def singles() -> None:
            for a, b in bounds:
                buf.prefetch_range(a, b, dev, clock.handle)

        t_single, issue_single = _median_time(clock, reps, to_host, singles)
        t_discard = _discard_d2h(buf, clock, reps, to_dev, notes)
        if not batched:
            notes.append("the plan went out as single calls (no cuMemPrefetchBatchAsync here)")
        elif issue_plan > 0.5 * t_plan:
            notes.append(
                f"the batched call held the host for {issue_plan * 1e3:.1f} of its {t_plan * 1e3:.1f} ms: "
                "the driver did the migration before returning, not asynchronously"
            )
    finally:
        buf.close()

    d2h = _gbps(nbytes, t_d2h)
    best_variant = max(variants.items(), key=lambda kv: kv[1]) if variants else None
    if d2h < 0.8 * pinned["d2h"]:
        msg = f"device->host prefetch reaches {d2h / pinned['d2h']:.2f}x of a pinned copy, short of 0.8x"
        if best_variant and best_variant[1] > 1.1 * d2h:
            msg += f"; {best_variant[0]} does better ({best_variant[1]:.1f} GB/s)"
        else:
            msg += (
                "; no alternative way of issuing it helps (see d2h variants): the driver's migration "
                "into host pages is the limit"
            )
        notes.append(msg)
    rows: list[dict[str, Any]] = [
        {
            "test": "(1) prefetch host->device vs pinned copy",
            "gbps": _gbps(nbytes, t_h2d),
            "reference_gbps": pinned["h2d"],
            "goal": 0.9,
        },
        {"test": "(2) prefetch device->host vs pinned copy", "gbps": d2h, "reference_gbps": pinned["d2h"], "goal": 0.8},
        {
            "test": "(3) kernel on host-resident data: prefetch+kernel vs faults",
            "gbps": _gbps(nbytes, t_pf_kernel),
            "reference_gbps": _gbps(nbytes, t_fault),
            "goal": None,
        },
        {
            "test": f"(4) {_PLAN_ENTRIES}-entry plan vs {_PLAN_ENTRIES} calls, host->device",
            "gbps": _gbps(nbytes, t_plan),
            "reference_gbps": _gbps(nbytes, t_single),
            "goal": None,
        },
    ]
    if t_discard is not None:
        rows.append(
            {
                "test": "(5) discard+prefetch device->host vs plain prefetch",
                "gbps": _gbps(nbytes, t_discard),
                "reference_gbps": d2h,
                "goal": 1.0,
            }
        )
    if auto:
        sec = auto["seconds"]
        for way, label in (
            ("to_device", "host-written buffer, then a launch"),
            ("to_host", "device-written, host read"),
        ):
            rows.append(
                {
                    "test": f"(6) {_AUTO_BYTES >> 20} MiB {label}: automatic vs explicit prefetch",
                    "gbps": _gbps(_AUTO_BYTES, sec[way]["auto"]),
                    "reference_gbps": _gbps(_AUTO_BYTES, sec[way]["explicit"]),
                    "goal": 0.9,
                }
            )
            rows.append(
                {
                    "test": "    the same by page faults (automatic prefetch off) vs explicit",
                    "gbps": _gbps(_AUTO_BYTES, sec[way]["faults"]),
                    "reference_gbps": _gbps(_AUTO_BYTES, sec[way]["explicit"]),
                    "goal": None,
                }
            )
    for r in rows:
        r["ratio"] = r["gbps"] / r["reference_gbps"]
        r["met"] = None if r["goal"] is None else bool(r["ratio"] >= r["goal"])
    figures = [
        goal_row("prefetch host->device / pinned copy", rows[0]["ratio"], 0.9),
        goal_row("prefetch device->host / pinned copy", rows[1]["ratio"], 0.8),
        goal_row(
            "kernel on host-resident data: faults time / (prefetch + kernel) time",
            rows[2]["ratio"],
            note="how much sooner prefetch + kernel finishes than a kernel faulting the pages in",
        ),
        goal_row(
            f"{_PLAN_ENTRIES}-entry plan / {_PLAN_ENTRIES} single calls, host->device bandwidth", rows[3]["ratio"]
        ),
    ]
    if t_discard is not None:
        figures.append(
            goal_row(
                "discard+prefetch device->host / plain prefetch device->host, speed",
                rows[4]["ratio"],
                1.0,
                note="a device-resident buffer; discarded pages move no data to the host",
            )
        )
    if auto:
        sec = auto["seconds"]
        figures += [
            goal_row(
                "automatic prefetch before a launch / explicit prefetch + launch, speed (256 MiB the host wrote)",
                sec["to_device"]["explicit"] / sec["to_device"]["auto"],
                0.9,
                note=f"by page faults: {sec['to_device']['explicit'] / sec['to_device']['faults']:.2f}x",
            ),
            goal_row(
                "automatic prefetch before a host read / explicit prefetch + read, speed (256 MiB the device wrote)",
                sec["to_host"]["explicit"] / sec["to_host"]["auto"],
                0.9,
                note=f"by page faults: {sec['to_host']['explicit'] / sec['to_host']['faults']:.2f}x",
            ),
        ]
    return {
        "benchmark": "prefetch",
        "figures": figures,
        "auto_prefetch": auto,
        "device": {"ordinal": dev, "name": name},
        "versions": {"cuda_bindings": _driver.api().version},
        "size_bytes": nbytes,
        "repetitions": reps,
        "statistic": "median",
        "rows": rows,
        "d2h": {"first_cold_gbps": _gbps(nbytes, first_d2h), "plain_gbps": d2h, "variants_gbps": variants},
        "kernel": {"fault_s": t_fault, "prefetch_plus_kernel_s": t_pf_kernel, "values_ok": values_ok},
        "plan": {
            "batched_driver_call": batched,
            "issue_us_plan": issue_plan * 1e6,
            "issue_us_singles": issue_single * 1e6,
        },
        "host_issue_us": {"prefetch_h2d": issue_h2d * 1e6, "prefetch_d2h": issue_d2h * 1e6},
        "notes": notes,
    }


def _print(res: dict[str, Any]) -> None:
    dev = res["device"]
    print(
        f"umem_numba prefetch benchmark: {dev['name']} (device {dev['ordinal']}), "
        f"{res['size_bytes'] / _GIB:.2f} GiB, median of {res['repetitions']}"
    )
    rows = []
    for r in res["rows"]:
        goal = "-" if r["goal"] is None else f">= {r['goal']:.2f}x"
        met = "-" if r["goal"] is None else goal_text(r["ratio"], r["goal"])
        rows.append([r["test"], f"{r['gbps']:.1f}", f"{r['reference_gbps']:.1f}", f"{r['ratio']:.2f}x", goal, met])
    print_table(rows, ["test", "GB/s", "reference GB/s", "ratio", "goal", ""])
    d2h = res["d2h"]
    print(
        f"device->host: first (cold) {d2h['first_cold_gbps']:.1f} GB/s, "
        f"plain call {d2h['plain_gbps']:.1f} GB/s"
        + "".join(f"; {k} {v:.1f} GB/s" for k, v in d2h["variants_gbps"].items())
    )
    k, p, i = res["kernel"], res["plan"], res["host_issue_us"]
    print(
        f"host time to issue one whole-buffer prefetch: {i['prefetch_h2d']:.0f} us host->device, "
        f"{i['prefetch_d2h']:.0f} us device->host"
    )
    print(
        f"kernel: faults {k['fault_s'] * 1e3:.1f} ms, prefetch+kernel {k['prefetch_plus_kernel_s'] * 1e3:.1f} ms, "
        f"values {'ok' if k['values_ok'] else 'WRONG'}"
    )
    print(
        f"plan: {'one batched call' if p['batched_driver_call'] else 'single calls'}, host issue "
        f"{p['issue_us_plan']:.0f} us vs {p['issue_us_singles']:.0f} us for {_PLAN_ENTRIES} calls"
    )
    for n in res["notes"]:
        print(f"note: {n}")


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure prefetch against pinned copies, print the tables and return the results.

    Parameters
    ----------
    argv : list of str, optional
        The benchmark's options (``--size-gib``, ``--quick``).

    Returns
    -------
    dict
        ``benchmark``, ``figures`` (goal rows), and the raw measurements.

    Raises
    ------
    BenchSkipped
        No usable GPU, or too little free device memory.
    """
    return _run_and_print(_parse(argv))


def _run_and_print(args: argparse.Namespace) -> dict[str, Any]:
    require_gpu()
    try:
        res = _run(args)
    except (_Refused, CudaUnavailableError) as exc:
        raise BenchSkipped(str(exc)) from exc
    _print(res)
    print()
    print_figures(res["figures"])
    return res


def main(argv: list[str] | None = None) -> int:
    """Run the prefetch benchmark; print a table and optionally write JSON.

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments (``sys.argv[1:]`` when ``None``).

    Returns
    -------
    int
        0 on success, 2 when the benchmark cannot run (no GPU, not enough free memory).
    """
    return command_line("prefetch", _parse, _run_and_print, argv)


if __name__ == "__main__":
    sys.exit(main())
