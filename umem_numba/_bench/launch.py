"""Launch overhead: what a kernel argument costs per launch, and what coherence adds.

Measured in one process, interleaved round by round (the machine is shared
and noisy), best of several batches of synchronous-free launches of a trivial
one-block kernel:

* numba ``DeviceNDArray`` (the reference), numba ``managed_array``,
  a plain ``__cuda_array_interface__`` object (what a naive wrapper costs);
* ``ManagedBuffer`` launched as is (numba sees it as device memory);
* ``ManagedBuffer`` through ``umem_numba.coherent`` (orders the stream after
  conflicting work on other streams, records one CUDA event);

each with 1, 2 and 5 buffer arguments; and ``kernel.forall(32)(buf)`` (numba's
on a ``DeviceNDArray``, the coherent kernel's on a ``ManagedBuffer``: tracked like
a configured launch, with numba's block size).  Then the host-side coherence
check with nothing pending, and ``buf.host``.

Goals: a coherent launch <= 1.10x a bare DeviceNDArray launch of the same
kernel with 1, 2 and 5 arguments; coherence adds < 0.3 µs per extra argument
with nothing pending on other streams; the check with nothing pending < 2 µs;
a plain numba launch of ManagedBuffers (tracked on its stream) <= 1.05x the same
launch of DeviceNDArrays, with 1, 2 and 5 arguments on a numba stream umem_numba knows
and with 1 on the legacy stream (issue #28; a stream it never got is shown without a goal); a coherent forall <= 1.05x a
coherent configured launch of the same kernel and argument (issue #28: "as cheap
as a configured launch"); a 256 x 256 float32 heat step (launch-bound) from a
captured graph of 100 steps (``umem_numba.capture``) <= 0.2x the time per step of
one coherent launch per step, both timed to completion (issue #29).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from ._common import (
    command_line,
    goal_row,
    one_block_launches,
    plain_text,
    print_figures,
    print_table,
    require_gpu,
    wall_timer_us,
)

GOAL_RATIO = 1.05
GOAL_COHERENT_RATIO = 1.10
GOAL_PER_ARG_US = 0.3
GOAL_CHECK_US = 2.0
GOAL_FORALL_RATIO = 1.05
ARG_COUNTS = (1, 2, 5)
#: Launch-bound work for graphs (issue #29 item 2): a small heat plate, many steps per graph.
HEAT_N = 256
HEAT_GRAPH_STEPS = 100
GOAL_GRAPH_RATIO = 0.2


class _PlainCAI:
    """A bare ``__cuda_array_interface__`` holder: the naive way to wrap memory."""

    def __init__(self, arr: Any) -> None:
        self._arr = arr
        self.__cuda_array_interface__ = dict(arr.__cuda_array_interface__, stream=None)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m umem_numba bench launch",
        description=plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--launches", type=int, default=None, help="launches per batch (default 2000; 200 with --quick)")
    ap.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds; best is kept (default 5; 2 with --quick)"
    )
    ap.add_argument("--quick", action="store_true", help="fewer launches and rounds (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    args = ap.parse_args(argv)
    args.launches = args.launches if args.launches is not None else (200 if args.quick else 2000)
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    if args.launches < 1 or args.rounds < 1:
        ap.error("--launches and --rounds must be >= 1")
    return args


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure launch costs, print the tables and return the results.

    Parameters
    ----------
    argv : list of str, optional
        The benchmark's options (``--launches``, ``--rounds``, ``--quick``).

    Returns
    -------
    dict
        ``benchmark``, ``figures`` (goal rows), and the raw timings.

    Raises
    ------
    BenchSkipped
        No usable GPU.
    """
    return _run(_parse(argv))


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import umem_numba as um

    require_gpu()
    from numba import cuda

    @cuda.jit
    def bump1(a: Any) -> None:
        if cuda.grid(1) == 0:
            a[0] += 1.0

    @cuda.jit
    def bump2(a: Any, b: Any) -> None:
        if cuda.grid(1) == 0:
            a[0] += b[0]

    @cuda.jit
    def bump5(a: Any, b: Any, c: Any, d: Any, e: Any) -> None:
        if cuda.grid(1) == 0:
            a[0] += b[0] + c[0] + d[0] + e[0]

    kernels = dict(zip(ARG_COUNTS, (bump1, bump2, bump5), strict=True))
    n = 1024
    devs = [cuda.to_device(np.ones(n, np.float32)) for _ in range(5)]
    bufs = [um.ManagedBuffer.from_array(np.ones(n, np.float32)) for _ in range(5)]
    nb_managed = cuda.managed_array(n, np.float32)
    nb_managed[:] = 1.0
    plain = _PlainCAI(devs[0])
    stream = cuda.stream()
    um.stream_handle(stream)  # umem_numba knows the stream (also through the um.launch cases below)
    unseen = cuda.stream()  # never given to umem_numba: numba's launch hands buffers only its handle
    coh1 = um.coherent(bump1)

    # One block on purpose: the launch overhead is the measured quantity, not the kernel.
    cases: dict[str, Any] = {
        "numba managed_array (1 arg)": lambda: bump1[1, 32, stream](nb_managed),
        "plain CAI object (1 arg)": lambda: bump1[1, 32, stream](plain),
        "ManagedBuffer, um.launch (1 arg)": lambda: um.launch(bump1, 1, 32, bufs[0], stream=stream),
        "DeviceNDArray, numba forall (1 arg)": lambda: bump1.forall(32, stream=stream)(devs[0]),
        "ManagedBuffer, coherent forall (1 arg)": lambda: coh1.forall(32, stream=stream)(bufs[0]),
        "DeviceNDArray, legacy stream (1 arg)": lambda: bump1[1, 32](devs[0]),
        "ManagedBuffer, legacy stream (1 arg)": lambda: bump1[1, 32](bufs[0]),
        "DeviceNDArray, unseen stream (1 arg)": lambda: bump1[1, 32, unseen](devs[0]),
        "ManagedBuffer, unseen stream (1 arg)": lambda: bump1[1, 32, unseen](bufs[0]),
    }
    for k, kern in kernels.items():
        coh = um.coherent(kern)
        cases[f"DeviceNDArray ({k} args)"] = lambda kern=kern, k=k: kern[1, 32, stream](*devs[:k])
        cases[f"ManagedBuffer ({k} args)"] = lambda kern=kern, k=k: kern[1, 32, stream](*bufs[:k])
        cases[f"ManagedBuffer, coherent ({k} args)"] = lambda coh=coh, k=k: coh[1, 32, stream](*bufs[:k])
    best = {name: float("inf") for name in cases}
    try:
        with one_block_launches():
            for _ in range(args.rounds):
                for name, fn in cases.items():
                    best[name] = min(best[name], wall_timer_us(fn, args.launches, repeat=1))
                    for b in bufs:
                        b.synchronize()  # a bare launch marks the buffers: settle before the next case

        graph_steps = _heat2d_graph_steps(args, stream)

        # Host-side check with nothing pending: the fast path every host access takes.
        buf = bufs[0]
        tracker = buf._coherence_tracker
        assert tracker is not None
        reps = 200_000
        t0 = time.perf_counter()
        for _ in range(reps):
            tracker.before_host_access("bench")
        check_us = (time.perf_counter() - t0) / reps * 1e6
        reps = 20_000
        t0 = time.perf_counter()
        for _ in range(reps):
            buf.host  # noqa: B018  (the property access is what is timed)
        host_us = (time.perf_counter() - t0) / reps * 1e6
    finally:
        for b in bufs:
            b.close()

    def ref(name: str) -> float:
        k = 5 if "5 arg" in name else 2 if "2 arg" in name else 1
        return best[f"DeviceNDArray ({k} args)"]

    rows = [(name, f"{us:.2f}", f"{us / ref(name):.2f}x") for name, us in best.items()]
    print(f"launch overhead, {args.launches} launches x {args.rounds} rounds, best batch")
    print_table(rows, ["argument(s)", "µs/launch", "vs DeviceNDArray, same args"])

    def per_arg(kind: str) -> float:
        return (best[f"{kind} (5 args)"] - best[f"{kind} (1 args)"]) / 4

    figures = [
        goal_row(
            f"coherent ManagedBuffer launch / DeviceNDArray launch, {k} argument(s)",
            best[f"ManagedBuffer, coherent ({k} args)"] / best[f"DeviceNDArray ({k} args)"],
            GOAL_COHERENT_RATIO,
            higher_is_better=False,
        )
        for k in ARG_COUNTS
    ]
    figures += [
        goal_row(
            "coherence per extra buffer argument",
            per_arg("ManagedBuffer, coherent") - per_arg("ManagedBuffer"),
            GOAL_PER_ARG_US,
            higher_is_better=False,
            unit="µs",
        ),
        *(
            goal_row(
                f"plain ManagedBuffer launch / DeviceNDArray launch, {k} argument(s)",
                best[f"ManagedBuffer ({k} args)"] / best[f"DeviceNDArray ({k} args)"],
                GOAL_RATIO,
                higher_is_better=False,
                note="numba's launch, tracked on its stream (ArgHint.to_device)",
            )
            for k in ARG_COUNTS
        ),
        goal_row(
            "plain ManagedBuffer launch / DeviceNDArray launch, legacy stream, 1 argument",
            best["ManagedBuffer, legacy stream (1 arg)"] / best["DeviceNDArray, legacy stream (1 arg)"],
            GOAL_RATIO,
            higher_is_better=False,
            note="kernel[g, b](buf): the stream's mark, as on a known stream",
        ),
        goal_row(
            "plain ManagedBuffer launch / DeviceNDArray launch, unseen numba stream, 1 argument",
            best["ManagedBuffer, unseen stream (1 arg)"] / best["DeviceNDArray, unseen stream (1 arg)"],
            higher_is_better=False,
            note="a stream umem_numba never got: one event and a capture check per launch; no goal",
        ),
        goal_row(
            "coherent forall / coherent configured launch, 1 argument",
            best["ManagedBuffer, coherent forall (1 arg)"] / best["ManagedBuffer, coherent (1 args)"],
            GOAL_FORALL_RATIO,
            higher_is_better=False,
        ),
        goal_row(
            "coherent forall / numba forall on DeviceNDArray",
            best["ManagedBuffer, coherent forall (1 arg)"] / best["DeviceNDArray, numba forall (1 arg)"],
            higher_is_better=False,
            note="no goal",
        ),
        goal_row(
            f"heat2d {HEAT_N}x{HEAT_N} float32 step: graph launch / one coherent launch per step",
            graph_steps["graph_us_per_step"] / graph_steps["launch_us_per_step"],
            GOAL_GRAPH_RATIO,
            higher_is_better=False,
            note=f"umem_numba.capture of {HEAT_GRAPH_STEPS} steps, launched with coherence (issue #29)",
        ),
        goal_row("host-access check, nothing pending", check_us, GOAL_CHECK_US, higher_is_better=False, unit="µs"),
        goal_row(
            "plain CAI object launch / DeviceNDArray launch",
            best["plain CAI object (1 arg)"] / ref("1"),
            higher_is_better=False,
            note="what a naive wrapper costs; no goal",
        ),
    ]
    print()
    print_figures(figures)
    print(f"\n`buf.host` (check + numpy view creation): {host_us:.2f} µs")
    print(
        f"heat2d {HEAT_N}x{HEAT_N} float32, µs per step to completion: one coherent launch per step "
        f"{graph_steps['launch_us_per_step']:.2f}, graph of {HEAT_GRAPH_STEPS} steps "
        f"{graph_steps['graph_us_per_step']:.2f}"
    )
    return {
        "benchmark": "launch",
        "launches": args.launches,
        "rounds": args.rounds,
        "us_per_launch": best,
        "host_check_us": check_us,
        "heat2d_graph": graph_steps,
        "host_view_us": host_us,
        "ratios": {r["name"]: r["value"] for r in figures},
        "figures": figures,
    }


def _heat2d_graph_steps(args: argparse.Namespace, stream: Any) -> dict[str, float]:
    """µs per heat2d step on a HEAT_N plate, to completion: coherent launches vs a captured graph."""
    import umem_numba as um
    from umem_numba.kernels import heat2d_compile, heat2d_step

    shape = (HEAT_N, HEAT_N)
    heat2d_compile(shape, np.float32)
    rounds = max(1, args.rounds)
    launches = 2 if args.quick else 10  # graph launches per batch (each HEAT_GRAPH_STEPS steps)
    with um.ManagedBuffer.zeros(shape, np.float32) as a, um.ManagedBuffer.zeros(shape, np.float32) as b:
        a.host[:, 0] = 1.0

        def steps(n: int) -> None:
            for i in range(n):
                src, dst = (a, b) if i % 2 == 0 else (b, a)
                heat2d_step(src, dst, 0.25, stream=stream)

        with um.capture(stream) as graph:
            steps(HEAT_GRAPH_STEPS)
        try:

            def timed(fn: Any) -> float:
                fn()
                stream.synchronize()
                best = float("inf")
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    fn()
                    stream.synchronize()
                    best = min(best, time.perf_counter() - t0)
                return best / (launches * HEAT_GRAPH_STEPS) * 1e6

            def replay() -> None:
                for _ in range(launches):
                    graph.launch(stream)

            graph_us = timed(replay)
            launch_us = timed(lambda: steps(launches * HEAT_GRAPH_STEPS))
        finally:
            graph.close()
    return {"graph_us_per_step": graph_us, "launch_us_per_step": launch_us}


def main(argv: list[str] | None = None) -> int:
    """Run the launch benchmark from the command line; see the module docstring.

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments (``sys.argv[1:]`` when ``None``).

    Returns
    -------
    int
        0 after a run, 2 without a usable GPU.
    """
    return command_line("launch", _parse, _run, argv)
