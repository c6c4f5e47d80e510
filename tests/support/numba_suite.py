"""numba-cuda's own test suites with and without umem_numba's memory-manager plugin, side by side.

The acceptance run of the EMM plugin (issue #11): numba-cuda's tests ship in
its wheel and must give the same results with ``NUMBA_CUDA_MEMORY_MANAGER=
umem_numba`` as without it.  Run on a GPU machine (numba's harness needs the
``filecheck`` package: ``pip install -e ".[numbatests]"``)::

    python tests/support/numba_suite.py --out DIR                 # both runs of cudadrv and cudapy
    python tests/support/numba_suite.py --out DIR --recheck       # plugin run; the tests that did not pass
                                                          # are run again, with and without the plugin

Every test's outcome is read from the harness's verbose output; ``DIR``
receives each run's log, ``numba_suite.json`` (outcome per test and mode) and
``numba_suite.md`` (the counts side by side and every test whose outcome
differs).  ``--recheck`` is the cheap form when a baseline run is known: it
shows, test by test, whether what fails or skips with the plugin does so
without it as well.  The runs start in a temporary directory (numba's
harness must not import the project's tests).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUITES = ("numba.cuda.tests.cudadrv", "numba.cuda.tests.cudapy")
_ID = re.compile(r"^(\w+) \(([\w.]+)\)")
_OUTCOME = re.compile(r" \.\.\. (ok|FAIL|ERROR|skipped.*|expected failure|unexpected success)\s*$")


def parse(log: str) -> dict[str, str]:
    """``{test id: outcome}`` from numba's ``runtests -v`` output (a docstring may sit between id and outcome)."""
    outcomes: dict[str, str] = {}
    current = None
    for line in log.splitlines():
        m = _ID.match(line)
        if m:
            current = m.group(2)
        o = _OUTCOME.search(line)
        if o and current is not None:
            word = o.group(1)
            outcomes[current] = "skipped" if word.startswith("skipped") else word
            current = None
    return outcomes


def run(tests: list[str], plugin: bool, log_path: Path, processes: int, timeout: float) -> dict[str, str]:
    """Run numba's harness on ``tests`` (modules or test ids); returns each test's outcome."""
    env = dict(os.environ)
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    if plugin:
        env["NUMBA_CUDA_MEMORY_MANAGER"] = "umem_numba"
        env["UMEM_NUMBA_EMM_IPC"] = "1"  # numba's IPC tests need the plugin's pool exportable (off by default)
    cmd = [sys.executable, "-m", "numba.runtests", "-v", "-m", str(processes), *tests]
    t0 = time.perf_counter()
    note = ""
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:  # keep what ran: each outcome is a line of its own
            log = "".join(b.decode() if isinstance(b, bytes) else (b or "") for b in (exc.stdout, exc.stderr))
            note = f", STOPPED after {timeout:.0f} s"
    log_path.write_text(f"$ {' '.join(cmd)}  (plugin: {plugin}, {time.perf_counter() - t0:.0f} s{note})\n{log}")
    return parse(log)


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    c = collections.Counter(outcomes.values())
    return {"tests": len(outcomes), **{k: c.get(k, 0) for k in ("ok", "FAIL", "ERROR", "skipped", "expected failure")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory for the logs and the report")
    p.add_argument("--suites", nargs="+", default=list(SUITES), help="test modules (default: cudadrv and cudapy)")
    p.add_argument("--processes", type=int, default=16, help="harness processes (-m; default 16)")
    p.add_argument("--recheck", action="store_true", help="plugin run, then its non-passing tests in both modes")
    p.add_argument("--timeout", type=float, default=560.0, help="seconds per harness run (default 560)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, dict] = {}
    lines = [
        "| suite | mode | tests | ok | FAIL | ERROR | skipped | expected failure |",
        "|---|---|---|---|---|---|---|---|",
    ]
    diffs: list[str] = []
    for suite in args.suites:
        short = suite.rsplit(".", 1)[-1]
        modes = {"plugin": run([suite], True, args.out / f"{short}-plugin.log", args.processes, args.timeout)}
        if args.recheck:
            # The plugin run's non-passing tests, again in both modes under the same conditions.
            again = sorted(t for t, o in modes["plugin"].items() if o != "ok")
            if again:
                for mode, plugin in (("recheck with plugin", True), ("recheck without plugin", False)):
                    log = args.out / f"{short}-{mode.replace(' ', '-')}.log"
                    modes[mode] = run(again, plugin, log, args.processes, args.timeout)
            pair = ("recheck with plugin", "recheck without plugin")
        else:
            modes["default"] = run([suite], False, args.out / f"{short}-default.log", args.processes, args.timeout)
            pair = ("plugin", "default")
        report[suite] = {mode: {"counts": counts(o), "outcomes": o} for mode, o in modes.items()}
        for mode, o in modes.items():
            lines.append(f"| {short} | {mode} | " + " | ".join(str(v) for v in counts(o).values()) + " |")
        with_plugin, without = modes.get(pair[0], {}), modes.get(pair[1], {})
        for test in sorted(set(with_plugin) | set(without)):
            a, b = with_plugin.get(test, "-"), without.get(test, "-")
            if a != b:
                diffs.append(f"| {test} | {a} | {b} | {pair[0]} vs {pair[1]} |")
    md = ["# numba-cuda's tests with and without umem_numba's memory manager", "", *lines, ""]
    md += ["## Tests whose outcome differs", ""]
    md += ["| test | with plugin | without | runs |", "|---|---|---|---|", *diffs] if diffs else ["None."]
    (args.out / "numba_suite.md").write_text("\n".join(md) + "\n")
    (args.out / "numba_suite.json").write_text(json.dumps(report, indent=1))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
