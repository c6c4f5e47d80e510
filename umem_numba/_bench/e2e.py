"""numba-cuda's documented examples end to end: numba's own idiom vs umem_numba's buffers.

Each example is numba-cuda's documented one (vecadd, matmul, laplace, montecarlo and random
number generation), its kernels, launches and host reads as numba writes them; only numba's
allocation calls change (``cuda.to_device``, ``cuda.device_array``, ``cuda.device_array_like``,
``create_xoroshiro128p_states``).  One timed run is the whole example: allocate, upload, the
kernels, the reads on the host and its own checks, between two ``cuda.synchronize()`` calls,
with numba's deferred frees flushed inside the timing (umem_numba's buffers free when dropped).
Each memory gets one warm-up run (numba compiles there), whose results must be bitwise equal to
numba's (else the benchmark stops, naming the example); then the median of at least ``--runs``
runs (default 7, at least 5), interleaved round by round, each round starting with the next memory
in turn so that no memory always runs first after the reference (the machine is shared and noisy).
Short examples run more rounds: until numba's idiom has been timed for at least
:data:`MIN_TIMED_MS` in all, at most :data:`MAX_RUNS` rounds (vecadd at 100000 elements takes about
5 ms a run, and single runs of it spread by a factor of two on a shared machine).

The memories:

* numba idiom: numba's own calls (the reference);
* umem default buffers: the managed shortcuts ``um.managed_from``, ``um.managed_empty`` and
  ``um.managed_like``, umem_numba's default for a numba user coming from ``cuda.to_device``
  or ``cuda.managed_array`` (the goal is on these);
* umem device: ``um.device_from``, ``um.device_empty``, ``um.device_like``;
* umem managed pool= / device pool=: the same shortcuts with ``pool=`` a
  ``um.MemoryPool("managed")`` / ``("device")``, one new pool per run, made before its timing
  starts and closed after it ends (a pool that cannot be made here is reported, not timed).

Sizes are numba's documented ones, larger where those are trivially short: vecadd at numba's
100000 elements and at 10 million, matmul's square matrices 256 x 256 (numba's 4 x 4; 256 is the
largest at which the example's exact check of its float32 sums holds) and its non-square case 80
x 368 times 368 x 112 (numba's 5 x 23 times 23 x 7), laplace 1001 points x 10000 steps,
montecarlo 1000000 samples, random numbers 701 x 900 x 719 float32.  ``--quick`` makes them
smaller (a smoke run: the goals are not meaningful).

Goal: every example's umem default buffers at most 1.0x numba's idiom, end to end.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import io
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._common import (
    command_line,
    device_name,
    goal_row,
    plain_text,
    print_figures,
    print_table,
    progress,
    require_gpu,
)

GOAL_RATIO = 1.0
MIN_RUNS = 5
#: Short examples run more rounds, until the reference has been timed this long in all ...
MIN_TIMED_MS = 250.0
#: ... but at most this many rounds.
MAX_RUNS = 41

#: The benchmark's examples: name -> (example in ``_numba_examples``, sizes, ``--quick`` sizes).
SIZES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "vecadd": ("vecadd", {"N": 100_000}, {"N": 100_000}),
    "vecadd (large)": ("vecadd", {"N": 10_000_000}, {"N": 1_000_000}),
    "matmul": ("matmul", {"n": 256, "nonsquare": (80, 368, 112)}, {"n": 64, "nonsquare": (5, 23, 7)}),
    "laplace": ("laplace", {"size": 1001, "niter": 10000}, {"size": 1001, "niter": 1000}),
    "montecarlo": ("montecarlo", {"nsamps": 1_000_000}, {"nsamps": 100_000}),
    "random_3d": ("random_3d", {"shape": (701, 900, 719)}, {"shape": (175, 225, 180)}),
}

#: The memories, in the table's order; the first is the reference.
NUMBA_IDIOM = "numba idiom"
DEFAULT = "umem default (managed)"
CASE_NAMES = (NUMBA_IDIOM, DEFAULT, "umem device", "umem managed pool=", "umem device pool=")

#: A memory to time: a context manager giving the ``Mem`` of one run (made and closed outside the timing).
Case = Callable[[], contextlib.AbstractContextManager[Any]]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m umem_numba bench e2e",
        description=plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=None,
        help=f"fewest timed runs per memory, median kept (default 7; >= {MIN_RUNS}; short examples run more)",
    )
    ap.add_argument("--quick", action="store_true", help="smaller sizes and 5 runs (a smoke run)")
    ap.add_argument(
        "--only", metavar="NAMES", default=None, help=f"comma-separated subset of {','.join(SIZES)} (default: all)"
    )
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    args = ap.parse_args(argv)
    args.runs = args.runs if args.runs is not None else (MIN_RUNS if args.quick else 7)
    if args.runs < MIN_RUNS:
        ap.error(f"--runs must be >= {MIN_RUNS} (the median of at least {MIN_RUNS} runs)")
    if args.only is not None:
        chosen = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in SIZES]
        if unknown or not chosen:
            ap.error(f"unknown example(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SIZES)}")
        args.only = chosen
    return args


def cases() -> tuple[dict[str, Case], dict[str, str]]:
    """The memories to time, by name (:data:`CASE_NAMES`), and why any could not be made here.

    Returns
    -------
    tuple
        ``{name: case}`` in table order, numba's idiom first; ``{name: reason}`` for a pool
        kind this machine does not have (``um.MemoryPool`` raised ``UnsupportedError``).
    """
    import umem_numba as um
    from umem_numba._errors import UnsupportedError

    from . import _numba_examples as ex

    def fixed(mem: Any) -> Case:
        return lambda: contextlib.nullcontext(mem)

    def pooled(kind: str) -> Case:
        @contextlib.contextmanager
        def run_with_new_pool() -> Iterator[Any]:
            pool = um.MemoryPool(kind)
            try:
                yield ex.pooled_mem(kind, pool)
            finally:
                gc.collect()  # the run's buffers go back to the pool before it closes
                pool.close()

        return run_with_new_pool

    made: dict[str, Case] = {
        NUMBA_IDIOM: fixed(ex.NUMBA),
        DEFAULT: fixed(ex.MEMS["managed"]),
        "umem device": fixed(ex.MEMS["device"]),
    }
    missing: dict[str, str] = {}
    for kind in ("managed", "device"):
        name = f"umem {kind} pool="
        try:
            um.MemoryPool(kind).close()
        except UnsupportedError as exc:
            missing[name] = str(exc)
            continue
        made[name] = pooled(kind)
    return made, missing


def time_example(
    name: str,
    example: Callable[[Any], dict[str, Any]],
    memories: dict[str, Case],
    runs: int,
    min_timed_ms: float = 0.0,
    max_runs: int | None = None,
) -> dict[str, list[float]]:
    """Time ``example(mem)`` end to end for each memory: warm up and check once, then rounds of runs.

    Round ``r`` runs every memory once, starting with the ``r``-th (mod their number), so that a
    position in the round (after the garbage of a given memory, first after a pause) falls on
    each memory alike.  Rounds go on until there are ``runs`` of them and the reference (the first
    memory) has been timed for ``min_timed_ms`` in all, or there are ``max_runs``.

    Parameters
    ----------
    name : str
        The example's name, for the message when a result differs.
    example : callable
        ``mem -> dict of host results`` (an example of ``_numba_examples`` with its sizes bound).
    memories : dict
        ``{memory name: case}``; the first is the reference the others' results must equal.
    runs : int
        The fewest timed runs per memory.
    min_timed_ms : float, optional
        Go on with more rounds until the reference's runs add up to this many milliseconds.
    max_runs : int, optional
        The most rounds when ``min_timed_ms`` asks for more (default: ``runs``, no more rounds).

    Returns
    -------
    dict
        ``{memory name: [ms per run]}``.

    Raises
    ------
    AssertionError
        A memory's warm-up results are not bitwise equal to the reference's (naming the example).
    """
    from numba import cuda

    from .. import _numba_compat
    from . import _numba_examples as ex

    def one_run(case: Case) -> tuple[float, dict[str, Any]]:
        gc.collect()  # the previous run's garbage is not this run's cost
        with case() as mem:
            cuda.synchronize()
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):  # the examples print what they read
                results = example(mem)
            cuda.synchronize()
            _numba_compat.flush_deferred_frees()  # numba frees late; umem's buffers freed when dropped
            t1 = time.perf_counter()
        return (t1 - t0) * 1e3, results

    reference: dict[str, Any] | None = None
    for memory, case in memories.items():  # warm-up: numba compiles; every result checked once
        _, results = one_run(case)
        if reference is None:
            reference = results
        else:
            ex.compare_results(results, reference, f"bench e2e, {name} on {memory}")
        del results
    del reference
    order = list(memories.items())
    times: dict[str, list[float]] = {memory: [] for memory in memories}
    reference_ms = times[order[0][0]]
    most = max(runs, max_runs if max_runs is not None else runs)
    rounds = 0
    while rounds < runs or (rounds < most and sum(reference_ms) < min_timed_ms):
        start = rounds % len(order)
        for memory, case in order[start:] + order[:start]:
            times[memory].append(one_run(case)[0])
        rounds += 1
    return times


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Time numba's documented examples end to end, print the tables and return the results.

    Parameters
    ----------
    argv : list of str, optional
        The benchmark's options (``--runs``, ``--quick``, ``--only``).

    Returns
    -------
    dict
        ``benchmark``, ``figures`` (goal rows), the device, and per example its sizes, the
        median and every run's milliseconds per memory, and the ratios to numba's idiom.

    Raises
    ------
    BenchSkipped
        No usable GPU.
    """
    return _run(_parse(argv))


def _run(args: argparse.Namespace) -> dict[str, Any]:
    require_gpu()
    from . import _numba_examples as ex

    device = device_name()
    memories, missing = cases()
    names = args.only or list(SIZES)
    min_timed_ms = 0.0 if args.quick else MIN_TIMED_MS
    runs = (
        f"{args.runs} to {max(args.runs, MAX_RUNS)} runs (at least {min_timed_ms:.0f} ms of numba's)"
        if min_timed_ms
        else f"{args.runs} runs"
    )
    print(f"bench e2e on {device}: numba-cuda's documented examples, median of {runs}, ms end to end")
    results: dict[str, Any] = {}
    for name in progress(names, desc="bench e2e", total=len(names)):
        function, sizes, quick_sizes = SIZES[name]
        bound = sizes if not args.quick else quick_sizes
        times = time_example(
            name,
            functools.partial(ex.EXAMPLES[function], **bound),
            memories,
            args.runs,
            min_timed_ms=min_timed_ms,
            max_runs=MAX_RUNS,
        )
        medians = {memory: statistics.median(ms) for memory, ms in times.items()}
        results[name] = {
            "example": function,
            "sizes": bound,
            "median_ms": medians,
            "runs_ms": times,
            "ratio_to_numba": {m: medians[m] / medians[NUMBA_IDIOM] for m in medians if m != NUMBA_IDIOM},
        }

    rows = []
    for name, r in results.items():
        cells = [name]
        for memory in CASE_NAMES:
            if memory not in r["median_ms"]:
                cells.append("-")
            elif memory == NUMBA_IDIOM:
                cells.append(f"{r['median_ms'][memory]:.2f}")
            else:
                cells.append(f"{r['median_ms'][memory]:.2f} ({r['ratio_to_numba'][memory]:.2f}x)")
        rows.append(cells)
    print_table(rows, ["example", *(f"{m} ms" for m in CASE_NAMES)])
    for memory, reason in missing.items():
        print(f"{memory}: not timed: {reason}")

    figures = []
    for name, r in results.items():
        figures.append(
            goal_row(
                f"{name}: umem default buffers / numba idiom, end to end",
                r["ratio_to_numba"][DEFAULT],
                GOAL_RATIO,
                higher_is_better=False,
                note="managed shortcuts (um.managed_from / managed_empty / managed_like)",
            )
        )
        figures += [
            goal_row(f"{name}: {memory} / numba idiom, end to end", ratio, higher_is_better=False, note="no goal")
            for memory, ratio in r["ratio_to_numba"].items()
            if memory != DEFAULT
        ]
    print()
    print_figures(figures)
    return {
        "benchmark": "e2e",
        "device": device,
        "runs": args.runs,
        "min_timed_ms": min_timed_ms,
        "max_runs": MAX_RUNS,
        "quick": bool(args.quick),
        "examples": results,
        "not_timed": missing,
        "figures": figures,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the end-to-end benchmark from the command line; see the module docstring.

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments (``sys.argv[1:]`` when ``None``).

    Returns
    -------
    int
        0 after a run, 2 without a usable GPU.
    """
    return command_line("e2e", _parse, _run, argv)
