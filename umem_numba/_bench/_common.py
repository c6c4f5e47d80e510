"""What the benchmarks share: timing with CUDA events, goal rows, tables, JSON.

Every benchmark module ``umem_numba._bench.NAME`` (registered in
``umem_numba._bench._BENCHES``) exposes the same two functions:

``run(argv: list[str] | None = None) -> dict``
    Parse ``argv`` (the benchmark's own options; ``--quick`` makes a short
    run), measure, print the human-readable tables on stdout and return the
    results: a JSON-able dict with at least ``"benchmark"`` (its name) and
    ``"figures"``, a list of :func:`goal_row` dicts (each measured figure
    next to its goal).  Raises :class:`BenchSkipped` when it cannot run here
    (no GPU, numba's simulator, too little free memory): :func:`require_gpu`
    first.
``main(argv: list[str] | None = None) -> int``
    The command line, ``python -m umem_numba bench NAME``: ``run`` plus
    ``--json PATH``; returns the exit status.

``python -m umem_numba bench all --out DIR`` calls every ``run`` and writes
one report from the ``figures`` (see :mod:`umem_numba._bench._report`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def plain_text(doc: str | None) -> str:
    """A docstring as ``--help`` shows it: reST markup taken out (literals, roles, emphasis, escapes).

    ``:class:`~a.b.C``` becomes ``C``, ``:sup:`2``` becomes ``^2`` and
    ````x```` becomes ``x``; the line breaks stay (the parsers print the
    description as written).
    """
    text = inspect.cleandoc(doc or "")
    text = re.sub(r"\\ ?:sup:`([^`]*)`", r"^\1", text)
    text = re.sub(r":[a-z]+:`~?(?:[\w.]*\.)?([^`.]+)`", r"\1", text)
    text = re.sub(r"``([^`]*)``", r"\1", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    text = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"\1", text)
    return text.replace("\\ ", "")


def cuda_timer_ms(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1, stream: Any = 0) -> float:
    """Best wall time of ``fn`` in ms between CUDA events recorded on ``stream``.

    Warms up first; events bracket each call and the elapsed time is read
    after the end event completes, so host-side queuing is included only as
    far as it delays the GPU.
    """
    from numba import cuda

    for _ in range(warmup):
        fn()
    cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        best = min(best, cuda.event_elapsed_time(start, end))
    return best


def wall_timer_us(fn: Callable[[], Any], n: int, repeat: int = 3) -> float:
    """Best host time per call in µs over ``repeat`` batches of ``n`` calls (synchronised after each batch)."""
    from numba import cuda

    fn()
    cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        cuda.synchronize()
        best = min(best, (t1 - t0) / n * 1e6)
    return best


class BenchSkipped(Exception):  # noqa: N818  (a skip, like pytest's Skipped, not an error)
    """A benchmark cannot run on this machine; the message says why (no GPU, too little memory)."""


#: Why no benchmark runs under numba's simulator (the same reason for all: the report names it once).
SIMULATOR_SKIP = (
    "timing needs a real GPU: under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) kernels run on the "
    "CPU and buffers are host memory, so no figure would say anything about a GPU"
)


def require_gpu() -> None:
    """Raise :class:`BenchSkipped` unless a real GPU is in use: first thing in every benchmark's ``run``."""
    from .. import _driver
    from .._driver import _sim

    if _sim.active():
        raise BenchSkipped(SIMULATOR_SKIP)
    reason = _driver.unavailable_reason()
    if reason:
        raise BenchSkipped(f"no usable GPU: {reason}")


def goal_row(
    name: str,
    value: float,
    goal: float | None = None,
    *,
    higher_is_better: bool = True,
    unit: str = "x",
    note: str = "",
) -> dict[str, Any]:
    """One measured figure next to its goal, as every benchmark reports it.

    Parameters
    ----------
    name : str
        What was measured (``"ManagedBuffer / DeviceNDArray launch"``).
    value : float
        The measurement, usually a ratio of two measurements from the same run.
    goal : float, optional
        The target; ``None`` for a figure reported without a goal.
    higher_is_better : bool
        Whether the goal is a floor (``value >= goal``) or a ceiling.
    unit : str
        ``"x"`` for ratios, else the unit of ``value`` (``"us"``, ``"GB/s"``).
    note : str
        Anything a reader needs to read the figure right.

    Returns
    -------
    dict
        ``name``, ``value``, ``goal``, ``higher_is_better``, ``unit``,
        ``note`` and ``met`` (``None`` without a goal).
    """
    value = float(value)
    met = None if goal is None else bool(value >= goal if higher_is_better else value <= goal)
    return {
        "name": name,
        "value": value,
        "goal": None if goal is None else float(goal),
        "higher_is_better": bool(higher_is_better),
        "unit": unit,
        "note": note,
        "met": met,
    }


def format_value(value: float | None, unit: str) -> str:
    """``1.23x``, ``2.30 us``: a figure with its unit."""
    if value is None:
        return "-"
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return f"{text}x" if unit == "x" else f"{text} {unit}"


def format_goal(row: dict) -> str:
    """``>= 0.9x``, ``<= 3 us`` or ``-``."""
    if row.get("goal") is None:
        return "-"
    return ("\u2265 " if row["higher_is_better"] else "\u2264 ") + format_value(row["goal"], row["unit"])


def met_text(row: dict) -> str:
    """``met``, ``MISSED`` or ``-`` (no goal)."""
    return "-" if row.get("met") is None else ("met" if row["met"] else "MISSED")


def print_figures(rows: Iterable[dict], file: Any = None) -> None:
    """Print goal rows as a table: figure, value, goal, met."""
    print_table(
        [(r["name"], format_value(r["value"], r["unit"]), format_goal(r), met_text(r)) for r in rows],
        ["figure", "value", "goal", ""],
        file=file,
    )


@contextlib.contextmanager
def one_block_launches() -> Iterator[None]:
    """Turn off numba's low-occupancy warning while benchmarks time one-block launches on purpose.

    numba-cuda warns on every launch with fewer than 128 blocks; in a launch
    benchmark the tiny grid is the point, and issuing the warning would be
    part of what is timed.
    """
    configs: list[Any] = []  # numba's config modules: their settings are set at run time
    for name in ("numba.cuda.core.config", "numba.core.config"):
        try:
            configs.append(importlib.import_module(name))
        except ImportError:
            pass
    saved = [(c, getattr(c, "CUDA_LOW_OCCUPANCY_WARNINGS", None)) for c in configs]
    for c, _ in saved:
        c.CUDA_LOW_OCCUPANCY_WARNINGS = 0
    try:
        yield
    finally:
        for c, old in saved:
            if old is None:
                del c.CUDA_LOW_OCCUPANCY_WARNINGS
            else:
                c.CUDA_LOW_OCCUPANCY_WARNINGS = old


def progress(iterable: Iterable, desc: str, total: int | None = None) -> Iterable:
    """``iterable`` under a tqdm bar on stderr when tqdm is installed (the ``plot`` extra), else as is.

    Progress is a convenience here: a benchmark runs the same without it.
    """
    try:
        from umem_numba.kernels._plot import progress as bar

        return bar(iterable, total=total, desc=desc, unit="step", leave=False)
    except ImportError:
        return iterable


def print_table(rows: Iterable[Iterable[Any]], header: Iterable[str], file: Any = None) -> None:
    """Print rows as an aligned text table."""
    file = file or sys.stdout
    cells = [[str(c) for c in r] for r in rows]
    heads = [str(h) for h in header]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(heads)]
    print("  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells:
        # cells past the header are not shown
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)), file=file)


def goal_text(value: float, goal: float, higher_is_better: bool = True) -> str:
    """'met' or 'MISSED' for a ratio against its goal."""
    ok = value >= goal if higher_is_better else value <= goal
    return "met" if ok else "MISSED"


def write_json(path: str | None, data: dict) -> None:
    """Write results as JSON when a path was given."""
    if path:
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2, default=str)
        print(f"wrote {path}")


def device_name() -> str:
    from numba import cuda

    return (
        cuda.get_current_device().name.decode()
        if isinstance(cuda.get_current_device().name, bytes)
        else str(cuda.get_current_device().name)
    )


def command_line(
    name: str,
    parse: Callable[[list[str] | None], Any],
    measure: Callable[[Any], dict[str, Any]],
    argv: list[str] | None,
) -> int:
    """What every benchmark's ``main`` does: parse, measure, write ``--json``, return the exit status.

    Parameters
    ----------
    name : str
        The benchmark's name, for the message when it cannot run.
    parse : callable
        ``argv -> argparse.Namespace`` (with a ``json`` attribute).
    measure : callable
        ``Namespace -> dict`` of results; raises :class:`BenchSkipped` when it cannot run.
    argv : list of str or None
        Command-line arguments.

    Returns
    -------
    int
        0 after a run, 1 when the results say ``ok: False`` (or a non-zero ``status``),
        2 when the benchmark cannot run here (no GPU, too little memory).
    """
    args = parse(argv)
    try:
        results = measure(args)
    except BenchSkipped as exc:
        print(f"bench {name}: {exc}", file=sys.stderr)
        return 2
    write_json(args.json, results)
    if results.get("status"):
        return int(results["status"])
    return 0 if results.get("ok", True) else 1
