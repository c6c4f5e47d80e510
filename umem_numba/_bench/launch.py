"""Launch overhead: what a kernel argument costs per launch, and what coherence adds.

Measured in one process, interleaved round by round (the machine is shared
and noisy), best of several batches of synchronous-free launches of a trivial
one-block kernel:

* numba ``DeviceNDArray`` (the reference), numba ``managed_array``,
  a plain ``__cuda_array_interface__`` object (what a naive wrapper costs);
* ``ManagedBuffer`` launched as is (numba sees it as device memory);
* ``ManagedBuffer`` through ``umem_numba.coherent`` (records one CUDA event).

Then the host-side coherence check with nothing pending, and ``buf.host``.

Goals (issue 2 and 4): ManagedBuffer <= 1.25x DeviceNDArray; coherent launch
adds <= 3 µs over a bare launch of the same buffer and stays within 1.25x of a
bare DeviceNDArray launch; the check with nothing pending < 2 µs.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from ._common import goal_text, print_table, wall_timer_us, write_json


class _PlainCAI:
    """A bare ``__cuda_array_interface__`` holder: the naive way to wrap memory."""

    def __init__(self, arr: Any) -> None:
        self._arr = arr
        self.__cuda_array_interface__ = dict(arr.__cuda_array_interface__, stream=None)


def main(argv: list[str] | None = None) -> int:
    """Run the launch benchmark; see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m umem_numba bench launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=2000, help="launches per batch (default 2000)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; best is kept (default 5)")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    args = ap.parse_args(argv)
    if args.launches < 1 or args.rounds < 1:
        ap.error("--launches and --rounds must be >= 1")

    from numba import cuda

    import umem_numba as um

    @cuda.jit
    def bump(a):
        if cuda.grid(1) == 0:
            a[0] += 1.0

    n = 1024
    dev = cuda.to_device(np.ones(n, np.float32))
    nb_managed = cuda.managed_array(n, np.float32)
    nb_managed[:] = 1.0
    buf = um.ManagedBuffer.from_array(np.ones(n, np.float32))
    plain = _PlainCAI(dev)
    kbump = um.coherent(bump)
    stream = cuda.stream()

    cases = {
        "DeviceNDArray": lambda: bump[1, 32, stream](dev),
        "numba managed_array": lambda: bump[1, 32, stream](nb_managed),
        "plain CAI object": lambda: bump[1, 32, stream](plain),
        "ManagedBuffer": lambda: bump[1, 32, stream](buf),
        "ManagedBuffer, coherent": lambda: kbump[1, 32, stream](buf),
        "ManagedBuffer, um.launch": lambda: um.launch(bump, 1, 32, buf, stream=stream),
    }
    best = {k: float("inf") for k in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            best[name] = min(best[name], wall_timer_us(fn, args.launches, repeat=1))
            buf.synchronize()  # a bare launch marks the buffer: settle before the next case

    # Host-side check with nothing pending: the fast path every host access takes.
    buf.synchronize()
    tracker = buf._coherence_tracker
    reps = 200_000
    t0 = time.perf_counter()
    for _ in range(reps):
        tracker.before_host_access("bench")
    check_us = (time.perf_counter() - t0) / reps * 1e6
    reps = 20_000
    t0 = time.perf_counter()
    for _ in range(reps):
        buf.host
    host_us = (time.perf_counter() - t0) / reps * 1e6

    ref = best["DeviceNDArray"]
    rows = [(name, f"{us:.2f}", f"{us / ref:.2f}x") for name, us in best.items()]
    print(f"launch overhead, {args.launches} launches x {args.rounds} rounds, best batch")
    print_table(rows, ["argument", "µs/launch", "vs DeviceNDArray"])
    added = best["ManagedBuffer, coherent"] - best["ManagedBuffer"]
    goals = [
        ("ManagedBuffer / DeviceNDArray", best["ManagedBuffer"] / ref, "<= 1.25"),
        ("coherent ManagedBuffer / DeviceNDArray", best["ManagedBuffer, coherent"] / ref, "<= 1.25"),
        ("coherent launch added µs", added, "<= 3"),
        ("host check, nothing pending, µs", check_us, "< 2"),
    ]
    print()
    print_table([(g, f"{v:.2f}", goal, goal_text(v, float(goal.split()[-1]), higher_is_better=False))
                 for g, v, goal in goals], ["figure", "value", "goal", ""])
    print(f"\n`buf.host` (check + numpy view creation): {host_us:.2f} µs")
    write_json(args.json, {"benchmark": "launch", "us_per_launch": best, "coherent_added_us": added,
                           "host_check_us": check_us, "host_view_us": host_us,
                           "ratios": {g: v for g, v, _ in goals}})
    # keep the buffers alive until the end; close explicitly
    buf.close()
    return 0
