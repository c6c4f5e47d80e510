"""``python -m umem_numba bench all``: the registry, the uniform ``run`` protocol, and the report.

On a machine without a GPU every benchmark is skipped with its reason, and
the report says so; the report's plumbing (goal rows, charts, Markdown) is
checked with stand-in benchmark modules whose figures are random.  The GPU
test runs the real benchmarks in their quick form.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from umem_numba.__main__ import _BENCHES
from umem_numba._bench import _common, _report

pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
pytest.importorskip("tqdm", reason="tqdm (the plot extra) is not installed")


@pytest.mark.parametrize("name", sorted(_BENCHES))
def test_every_registered_benchmark_has_run_and_main(name):
    module = importlib.import_module(f"umem_numba._bench.{name}")
    assert callable(module.run) and callable(module.main)


@pytest.mark.parametrize(
    "value, goal, higher, met",
    [(0.95, 0.9, True, True), (0.85, 0.9, True, False), (2.0, 3.0, False, True), (3.5, 3.0, False, False)],
)
def test_goal_row_decides_met(rng, value, goal, higher, met):
    scale = float(rng.uniform(0.5, 2.0))
    row = _common.goal_row("x", value * scale, goal * scale, higher_is_better=higher)
    assert row["met"] is met and row["value"] == pytest.approx(value * scale)
    assert _common.goal_row("y", 1.0)["met"] is None
    assert _common.format_goal(row).endswith(f"{goal * scale:.3g}x")
    assert _common.format_goal(row).startswith("\u2265" if higher else "\u2264")


def _fake_modules(rng) -> tuple[dict, dict]:
    values = {"alpha": rng.uniform(0.5, 1.5, 3), "beta": rng.uniform(1, 5, 2)}

    def alpha_run(argv):
        print("alpha table")  # goes to alpha.log, not the terminal
        assert argv == ["--quick"]
        v = values["alpha"]
        return {
            "benchmark": "alpha",
            "figures": [
                _common.goal_row("ratio one", v[0], 1.0),
                _common.goal_row("ratio two", v[1], 1.0, higher_is_better=False),
                _common.goal_row("time", v[2], unit="µs", note="no goal | pipes kept, kernel[g, b](buf) literal"),
            ],
        }

    def beta_run(argv):
        return {
            "benchmark": "beta",
            "ok": True,
            "figures": [_common.goal_row("bandwidth", values["beta"][0], 2.0, unit="GB/s")],
        }

    def beta_charts(result, out_dir):
        path = f"{out_dir}/beta-extra.png"
        from umem_numba.kernels._plot import save_bar_chart

        save_bar_chart(path, ["b"], [result["figures"][0]["value"]])
        return [path]

    def skipped_run(argv):
        raise _common.BenchSkipped("needs 2 GPUs, this machine has 0.")

    def broken_run(argv):
        raise RuntimeError("kernel exploded")

    def old_style_main(argv):  # a benchmark with only main(): its --json output is read instead
        path = argv[argv.index("--json") + 1]
        with open(path, "w") as fh:
            json.dump({"benchmark": "old", "speed": float(values["beta"][1])}, fh)
        return 0

    modules = {
        "alpha": types.SimpleNamespace(run=alpha_run),
        "old": types.SimpleNamespace(main=old_style_main),
        "beta": types.SimpleNamespace(run=beta_run, charts=beta_charts),
        "gamma": types.SimpleNamespace(run=skipped_run),
        "delta": types.SimpleNamespace(run=broken_run),
    }
    return modules, values


def test_report_puts_every_figure_next_to_its_goal(tmp_path, rng):
    modules, values = _fake_modules(rng)
    load = modules.__getitem__
    entries = _report.run_all(list(modules), str(tmp_path), quick=True, load=load)
    assert [e["status"] for e in entries.values()] == ["ran", "ran", "ran", "skipped", "error"]
    assert entries["old"]["result"]["speed"] == values["beta"][1] and entries["old"]["result"]["figures"] == []
    assert "kernel exploded" in entries["delta"]["error"]
    assert (tmp_path / "alpha.log").read_text().startswith("alpha table")
    assert "RuntimeError" in (tmp_path / "delta.log").read_text()

    machine = {"available": False, "reason": "no driver here", "versions": {"numba": "0"}, "devices": []}
    paths = _report.write_report(str(tmp_path), entries, machine, quick=True, load=load)
    md = (tmp_path / "report.md").read_text()
    assert paths["markdown"].endswith("report.md")
    a, b = values["alpha"], values["beta"]
    for line in (
        f"| alpha | ratio one | {a[0]:.3g}x | \u2265 1x | {'met' if a[0] >= 1 else '**MISSED**'} |",
        f"| alpha | ratio two | {a[1]:.3g}x | \u2264 1x | {'met' if a[1] <= 1 else '**MISSED**'} |",
        f"| alpha | time | {a[2]:.3g} µs | - | - |",
        f"| beta | bandwidth | {b[0]:.3g} GB/s | \u2265 2 GB/s | {'met' if b[0] >= 2 else '**MISSED**'} |",
        "| gamma | skipped: needs 2 GPUs, this machine has 0. | | | |",
    ):
        assert line in md, line
    # Notes are list items under the table; brackets escaped, or MyST reads kernel[g, b](buf) as a link.
    assert "- time: no goal | pipes kept, kernel\\[g, b\\](buf) literal" in md
    assert "delta | **error**: RuntimeError: kernel exploded" in md
    assert "CUDA: not available (no driver here)" in md
    assert "**Quick run**" in md
    for png in ("alpha.png", "beta.png", "beta-extra.png"):
        assert f"]({png})" in md and (tmp_path / png).stat().st_size > 1000
    assert not (tmp_path / "gamma.png").exists()
    assert "this benchmark has no run() returning figures" in md

    data = json.loads((tmp_path / "report.json").read_text())
    assert data["quick"] is True and data["machine"]["reason"] == "no driver here"
    got = [f["value"] for f in data["benchmarks"]["alpha"]["result"]["figures"]]
    np.testing.assert_allclose(got, a)
    assert data["benchmarks"]["gamma"]["reason"].startswith("needs 2 GPUs")


def test_bench_all_cli_argument_errors():
    for argv, message in ([[], "--out"], [["--out", "x", "--only", "launch,warp"], "unknown benchmark(s) warp"]):
        proc = subprocess.run(
            [sys.executable, "-m", "umem_numba", "bench", "all", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_bench_all_without_a_gpu_reports_every_benchmark_skipped(tmp_path):
    from umem_numba import _driver

    if _driver.available():
        pytest.skip("this machine has a GPU: the skipped path is for machines without one")
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "umem_numba", "bench", "all", "--out", str(out), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    md = (out / "report.md").read_text()
    reason = _driver.unavailable_reason()
    # Issue #30 item 5: the reason was repeated 14 times and seven empty logs were written.
    assert f"| {', '.join(_BENCHES)} | skipped: no usable GPU: {reason}" in md, md
    assert md.count(reason) == 2, md  # the shared skip reason once, and `info` in the machine section
    for name in _BENCHES:
        assert f"{name}: skipped" in proc.stderr
    assert proc.stderr.count(reason) == 1, proc.stderr
    data = json.loads((out / "report.json").read_text())
    assert list(data["benchmarks"]) == list(_BENCHES)
    assert all(e["status"] == "skipped" for e in data["benchmarks"].values())
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]  # no empty logs


def test_bench_all_on_the_simulator_skips_every_benchmark_with_one_reason(tmp_path):
    """Issue #30 item 5: under the simulator vmm, copy and pool crashed (numba.cuda has no
    event_elapsed_time; the simulated device has no name) and ``bench all`` exited 1."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "umem_numba", "bench", "all", "--out", str(out), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "report.json").read_text())
    entries = data["benchmarks"]
    assert list(entries) == list(_BENCHES)
    assert all(e["status"] == "skipped" for e in entries.values()), entries
    reasons = {e["reason"] for e in entries.values()}
    assert len(reasons) == 1, reasons
    (reason,) = reasons
    assert "numba's CUDA simulator" in reason and "real GPU" in reason, reason
    md = (out / "report.md").read_text()
    assert md.count(reason) == 1, md
    assert f"| {', '.join(_BENCHES)} | skipped: {reason}" in md, md
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]  # no empty logs
    for name in _BENCHES:  # each benchmark alone says so too, and exits 2 (it cannot run here)
        alone = subprocess.run(
            [sys.executable, "-m", "umem_numba", "bench", name, "--quick"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"),
        )
        assert alone.returncode == 2 and alone.stderr.strip() == f"bench {name}: {reason}", alone.stderr


@pytest.mark.gpu
@pytest.mark.timeout(900)  # every benchmark, e2e's examples included: minutes, not the suite's usual bound
def test_bench_all_quick_on_the_gpu(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "umem_numba", "bench", "all", "--out", str(out), "--quick"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Benchmarks launch tiny grids on purpose (one-block launches, thin halo bands): numba's
    # occupancy warning is expected there; any other warning is not.
    others = [ln for ln in proc.stderr.splitlines() if "Warning" in ln and "NumbaPerformanceWarning" not in ln]
    assert not others, proc.stderr
    data = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    for name in _BENCHES:
        entry = data["benchmarks"][name]
        assert entry["status"] in ("ran", "skipped"), entry
        if entry["status"] == "skipped":
            continue
        figures = entry["result"]["figures"]
        assert figures and all(np.isfinite(f["value"]) for f in figures)
        # Ratios are positive; a difference (e.g. coherence per extra argument, in µs) may be negative.
        assert all(f["value"] > 0 for f in figures if f["unit"] == "x"), figures
        assert (out / f"{name}.png").exists()
        for f in figures:
            assert f"| {name} | {f['name']} |" in md.replace("\\|", "|")
    assert data["machine"]["available"] is True
    assert data["machine"]["devices"][0]["name"] in md
