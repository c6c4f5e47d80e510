"""``python -m umem_numba bench all --out DIR``: every registered benchmark, one report.

Runs each benchmark of ``umem_numba._bench._BENCHES`` in turn (its
``run(argv)``, see :mod:`umem_numba._bench._common`) under a tqdm progress
bar, with its printed tables going to ``DIR/NAME.log``, and writes:

``DIR/report.json``
    the machine's :func:`umem_numba.info`, and every benchmark's full results
    (or why it was skipped, or the error it raised);
``DIR/NAME.png``
    each benchmark's figures against their goals, plus any extra chart the
    benchmark module draws (an optional ``charts(result, out_dir)``);
``DIR/report.md``
    the Markdown summary: the machine, then every figure next to its goal.

A benchmark that cannot run here (no GPU, too little memory) is reported as
skipped with its reason; one that fails is reported with its error, and the
others still run.  A module with only ``main(argv)`` is run with ``--json
DIR/NAME.json`` and its JSON is kept, with no figures in the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ._common import BenchSkipped, format_goal, format_value, met_text

__all__ = ["main", "run_all", "write_report"]


def _registry() -> dict[str, str]:
    from . import _BENCHES

    return dict(_BENCHES)


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"umem_numba._bench.{name}")


#: ``bench all --help``: what a user runs and gets (the module docstring is about the protocol).
DESCRIPTION = """\
Run every benchmark, one after the other, and write one report into DIR:

  DIR/report.md     the summary: the machine, then every figure next to its goal
  DIR/report.json   the machine (python -m umem_numba info) and every benchmark's
                    full results, or why it was skipped, or the error it raised
  DIR/NAME.png      each benchmark's figures against their goals (and its own charts)
  DIR/NAME.log      the tables each benchmark printed

A benchmark that cannot run here (no GPU, numba's simulator, too little memory)
is reported as skipped with its reason; one that fails is reported with its
error, and the others still run.  Each benchmark alone: python -m umem_numba
bench NAME --help."""


def _parse(argv: list[str] | None, names: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m umem_numba bench all",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, metavar="DIR", help="folder for the report (created if missing)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="pass --quick to every benchmark (a smoke run: the goals are not meaningful)",
    )
    ap.add_argument(
        "--only", metavar="NAMES", default=None, help=f"comma-separated subset of {','.join(names)} (default: all)"
    )
    args = ap.parse_args(argv)
    if args.only is not None:
        chosen = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in names]
        if unknown or not chosen:
            ap.error(f"unknown benchmark(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(names)}")
        args.only = chosen
    return args


def run_all(
    names: list[str], out_dir: str, *, quick: bool = False, load: Callable[[str], ModuleType] = _load
) -> dict[str, dict[str, Any]]:
    """Run the named benchmarks one after the other; return ``{name: entry}``.

    Each entry has ``status`` (``"ran"``, ``"skipped"`` or ``"error"``),
    ``seconds``, and ``result`` (what ``run`` returned), ``reason`` or
    ``error``.  Printed output goes to ``out_dir/NAME.log`` (``log``), and
    a benchmark that printed nothing leaves no log (``log`` is ``None``).

    Parameters
    ----------
    names : list of str
        Registered benchmark names, in order.
    out_dir : str
        Existing folder for the logs.
    quick : bool
        Pass ``--quick`` to each benchmark.
    load : callable, optional
        ``name -> module`` (tests substitute their own).

    Returns
    -------
    dict
        One entry per name.
    """
    from umem_numba.kernels._plot import progress

    entries: dict[str, dict[str, Any]] = {}
    argv = ["--quick"] if quick else []
    skipped_for: dict[str, str] = {}  # a skip reason -> the first benchmark skipped for it
    with progress(total=len(names), desc="bench all", unit="benchmark") as bar:
        for name in names:
            bar.set_postfix_str(name)
            t0 = time.perf_counter()
            log = os.path.join(out_dir, f"{name}.log")
            entry: dict[str, Any]
            with open(log, "w") as fh, contextlib.redirect_stdout(fh):
                try:
                    result = _run_one(load(name), list(argv), os.path.join(out_dir, f"{name}.json"))
                    entry = {"status": "ran", "result": result}
                except BenchSkipped as exc:
                    entry = {"status": "skipped", "reason": str(exc)}
                except Exception as exc:  # one failing benchmark must not stop the report
                    entry = {
                        "status": "error",
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc(),
                    }
                    print(entry["traceback"])
            entry["seconds"] = time.perf_counter() - t0
            entry["log"] = os.path.basename(log)
            if not os.path.getsize(log):  # a skip prints nothing: no empty file in the report folder
                os.remove(log)
                entry["log"] = None
            entries[name] = entry
            first = skipped_for.setdefault(entry["reason"], name) if entry["status"] == "skipped" else name
            line = f"skipped (as {first})" if first != name else _one_line(entry)
            bar.write(f"{name}: {line}", file=sys.stderr)
            bar.update(1)
    return entries


def _run_one(module: ModuleType, argv: list[str], json_path: str) -> dict[str, Any]:
    """``module.run(argv)``; for a module that has only ``main``, its ``--json`` output instead."""
    run = getattr(module, "run", None)
    if run is not None:
        return run(argv)
    status = module.main([*argv, "--json", json_path])
    if status == 2:
        raise BenchSkipped("it cannot run here (its main() returned 2; the log says why)")
    if status:
        raise RuntimeError(f"its main() returned {status}")
    with open(json_path) as fh:
        result = json.load(fh)
    result.setdefault("figures", [])
    if not result["figures"]:
        result["figures_note"] = "this benchmark has no run() returning figures: see its JSON and log"
    return result


def _one_line(entry: dict[str, Any]) -> str:
    if entry["status"] == "skipped":
        return f"skipped ({entry['reason']})"
    if entry["status"] == "error":
        return f"ERROR {entry['error']}"
    figures = entry["result"].get("figures", [])
    missed = [f["name"] for f in figures if f.get("met") is False]
    goals = sum(1 for f in figures if f.get("goal") is not None)
    text = f"{goals - len(missed)} of {goals} goals met in {entry['seconds']:.0f} s"
    return text + (f"; missed: {', '.join(missed)}" if missed else "")


def _md_escape(text: str, *, cell: bool = True) -> str:
    """``text`` as literal Markdown: link brackets (``kernel[g, b](buf)``) escaped, and pipes in a table ``cell``."""
    text = str(text).replace("[", "\\[").replace("]", "\\]")
    return text.replace("|", "\\|") if cell else text


def _machine_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    versions = ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items())
    if not data.get("available"):
        # why: `python -m umem_numba info` just below says it (once in the report)
        lines.append("- CUDA: not available (`python -m umem_numba info` below says why)")
    else:
        dv = data["driver_version"]
        lines.append(f"- CUDA driver {dv // 1000}.{dv % 1000 // 10}, cuda-bindings {data.get('cuda_bindings', '?')}")
        for d in data["devices"]:
            cc = d["compute_capability"]
            features = [k for k in ("concurrent_managed_access", "pageable_memory_access", "vmm_supported") if d.get(k)]
            lines.append(
                f"- device {d['ordinal']}: {d['name']}, compute capability {cc[0]}.{cc[1]}, "
                f"{d['multiprocessors']} SMs, {d['memory_total'] / 2**30:.1f} GiB "
                f"({', '.join(features) or 'no unified-memory features'})"
            )
    lines.append(f"- {versions}")
    return lines


def write_report(
    out_dir: str,
    entries: dict[str, dict[str, Any]],
    machine: dict[str, Any],
    *,
    quick: bool = False,
    load: Callable[[str], ModuleType] = _load,
    started: str | None = None,
) -> dict[str, str]:
    """Write ``report.json``, the charts and ``report.md`` for finished runs.

    Parameters
    ----------
    out_dir : str
        Existing folder.
    entries : dict
        What :func:`run_all` returned.
    machine : dict
        What :func:`umem_numba.info` returned.
    quick : bool
        Whether the runs were ``--quick`` (said at the top of the summary).
    load : callable, optional
        ``name -> module``, for the optional per-benchmark ``charts``.
    started : str, optional
        ISO time the runs started.

    Returns
    -------
    dict
        ``{"json": path, "markdown": path}``.
    """
    from umem_numba.kernels._plot import save_goal_chart

    from .._cli._info import format_info

    charts: dict[str, list[str]] = {}
    for name, entry in entries.items():
        if entry["status"] != "ran":
            continue
        files = []
        path = os.path.join(out_dir, f"{name}.png")
        save_goal_chart(path, entry["result"].get("figures", []), title=f"bench {name}: figures against goals")
        files.append(os.path.basename(path))
        extra = getattr(load(name), "charts", None)
        if extra is not None:
            try:
                files += [os.path.basename(p) for p in extra(entry["result"], out_dir)]
            except Exception as exc:  # a chart must not lose the report
                entry.setdefault("chart_errors", []).append(f"{type(exc).__name__}: {exc}")
        charts[name] = files

    report = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "started": started,
        "quick": quick,
        "machine": machine,
        "benchmarks": entries,
    }
    json_path = os.path.join(out_dir, "report.json")
    with open(json_path, "w") as fh:
        json.dump(report, fh, indent=2, default=str)

    md: list[str] = ["# Benchmark report", ""]
    md.append(
        f"Written by `python -m umem_numba bench all{' --quick' if quick else ''}` on "
        f"{report['created']}. Every figure is measured in the same run as its reference; "
        "ratios compare the two."
    )
    if quick:
        md += ["", "**Quick run**: small sizes and few repetitions; the goals are not meaningful here."]
    md += ["", "## Machine", "", *_machine_lines(machine)]
    md += [
        "",
        "<details><summary><code>python -m umem_numba info</code></summary>",
        "",
        "```text",
        format_info(machine),
        "```",
        "",
        "</details>",
    ]
    md += ["", "## Figures and goals", "", "| benchmark | figure | value | goal | |", "|---|---|---|---|---|"]
    # Benchmarks skipped for the same reason share one row: the reason is said once.
    skipped: dict[str, list[str]] = {}
    for name, entry in entries.items():
        if entry["status"] == "skipped":
            skipped.setdefault(entry["reason"], []).append(name)
    for name, entry in entries.items():
        if entry["status"] == "skipped":
            names = skipped[entry["reason"]]
            if names[0] == name:
                md.append(f"| {', '.join(names)} | skipped: {_md_escape(entry['reason'])} | | | |")
        elif entry["status"] == "error":
            md.append(f"| {name} | **error**: {_md_escape(entry['error'])} | | | |")
        else:
            for f in entry["result"].get("figures", []):
                met = met_text(f)
                md.append(
                    f"| {name} | {_md_escape(f['name'])} | {format_value(f['value'], f['unit'])} | "
                    f"{format_goal(f)} | {'**MISSED**' if met == 'MISSED' else met} |"
                )
    for name, entry in entries.items():
        if entry["status"] == "skipped":  # the table says why; there is nothing more to say
            continue
        md += ["", f"## {name}", ""]
        if entry["status"] == "error":
            md += [f"Failed: `{entry['error']}` (traceback in `{entry['log']}`)."]
            continue
        printed = f"; its printed tables are in `{entry['log']}`" if entry.get("log") else ""
        md.append(f"Ran in {entry['seconds']:.0f} s{printed}.")
        if entry["result"].get("figures_note"):
            md += ["", entry["result"]["figures_note"] + "."]
        notes = [f for f in entry["result"].get("figures", []) if f.get("note")]
        if notes:
            md.append("")
            md += [f"- {_md_escape(f['name'], cell=False)}: {_md_escape(f['note'], cell=False)}" for f in notes]
        for png in charts.get(name, []):
            md += ["", f"![{name}: {png}]({png})"]
        for err in entry.get("chart_errors", []):
            md += ["", f"(a chart failed: `{err}`)"]
    md_path = os.path.join(out_dir, "report.md")
    with open(md_path, "w") as fh:
        fh.write("\n".join(md) + "\n")
    return {"json": json_path, "markdown": md_path}


def main(argv: list[str] | None = None) -> int:
    """Run every registered benchmark and write the report; see the module docstring.

    Parameters
    ----------
    argv : list of str, optional
        ``--out DIR`` (required), ``--quick``, ``--only NAMES``.

    Returns
    -------
    int
        0 when every benchmark ran or was skipped with a reason, 1 when one
        failed or reported wrong results, 2 without the ``plot`` extra.
    """
    registry = _registry()
    args = _parse(argv, list(registry))
    from umem_numba.kernels._plot import MissingExtraError, require_plot_extra

    try:
        require_plot_extra()
    except MissingExtraError as exc:
        print(f"bench all: {exc}", file=sys.stderr)
        return 2
    from .._cli._info import info

    os.makedirs(args.out, exist_ok=True)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = info()
    names = args.only or list(registry)
    entries = run_all(names, args.out, quick=args.quick)
    paths = write_report(args.out, entries, machine, quick=args.quick, started=started)
    print(f"wrote {paths['markdown']} and {paths['json']}")
    failed = [
        n
        for n, e in entries.items()
        if e["status"] == "error" or (e["status"] == "ran" and e["result"].get("ok") is False)
    ]
    if failed:
        print(f"bench all: {', '.join(failed)} failed or produced wrong results (see the report)", file=sys.stderr)
        return 1
    return 0
