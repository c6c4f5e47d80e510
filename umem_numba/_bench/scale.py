"""Scaling benchmark: the 2-D heat step on 1 and N GPUs, single-process peer path and MPI path.

``python -m umem_numba bench scale [--gpus N] [--size N] [--weak-rows N] [--steps N] [--no-mpi]
[--mpi-halos LIST] [--json PATH] [--png PATH]``

*Weak scaling*: ``--weak-rows`` x ``--size`` cells per GPU (default 16384 x
16384 float32), so N GPUs step an ``N*rows x size`` plate; efficiency
``t(1) / t(N)`` (goal >= 0.95 on both paths).
*Strong scaling*: one ``--size``\\ :sup:`2` plate (default 16384\\ :sup:`2`
float32) in total; speedup ``t(1) / t(N)`` (goals: on two GPUs >= 1.9x peer and
>= 1.75x MPI; on N >= 3 GPUs >= 0.85 N for both, so >= 3.4x on four).

Peer path: :class:`umem_numba.kernels.multigpu.MultiGPUHeat` (one slab per
GPU; the rows a slab sends are computed first by a small band launch on a
second stream and moved while the interior runs, ordered with events; each
slab's step is one CUDA graph launch, or with ``--launches`` every launch and
copy issued from the host), once per ``--halos`` mode: ``copy`` (peer copy
into a landing row) and ``vmm`` (the band launch writes the row into a VMM
buffer on the neighbour, through the peer mapping); timed with the host clock
between synchronizes of every GPU over ``--steps`` steps after warm-up, the
median of ``--trials``.  Its *halo time per step* is the time of a step with
the exchange minus one without.  The N-GPU strong-scaling field is compared
bit for bit with the one-GPU field.

MPI path: ``mpirun -np N python examples/heat2d_mpi.py --staging pinned``
(from the source tree; the ``mpirun`` first on ``PATH``, Open MPI or MPICH) in a
subprocess per point (each step two CUDA graph launches per rank, or with
``--launches`` every launch and copy issued from the host: ``--launches`` there
too); the example reports ms per step, the same steps again
without the exchange (its *halo time per step* is the difference, as for the
peer path) and the longest host wait for messages of any rank (``--json``).
Once per ``--mpi-halos`` mode: ``pinned`` (rows in MPI messages through pinned
host buffers) and ``ipc`` (``--halo ipc``: ranks of one node read their
neighbours' rows in place from exported VMM memory; 8-byte MPI messages order
them).  The one-rank points have no exchange, so they are run once and shared;
the N-rank points of both modes are compared (step time and halo time per
step, ``mpi_ipc_vs_pinned`` in the JSON).
Skipped, with the reason, when mpirun, mpi4py or the example is missing.

With fewer GPUs than ``--gpus`` the slabs share GPUs (a simulated
decomposition: it measures the exchange overhead, not a speed-up).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ._common import command_line, goal_row, goal_text, plain_text, print_table, require_gpu

GOAL_WEAK = 0.95
#: Strong speed-up goals on two GPUs; on N >= 3, STRONG_EFFICIENCY * N (3.4x on four).
GOAL_STRONG_2 = {"peer": 1.9, "mpi": 1.75}
STRONG_EFFICIENCY = 0.85


def strong_goal(path: str, n: int) -> float | None:
    """The strong-scaling speed-up goal of ``path`` (``"peer"`` or ``"mpi"``) on ``n`` GPUs; None for one."""
    if n < 2:
        return None
    return GOAL_STRONG_2[path] if n == 2 else round(STRONG_EFFICIENCY * n, 2)


#: MPI path transports: rows in MPI messages through pinned buffers, or read in place on one node.
MPI_HALOS = ("pinned", "ipc")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "heat2d_mpi.py"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m umem_numba bench scale",
        description=plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--gpus", type=int, default=None, metavar="N", help="GPUs for the N-GPU points (default: all, >= 2)"
    )
    ap.add_argument("--size", type=int, default=16384, metavar="N", help="plate width; strong-scaling side (16384)")
    ap.add_argument("--weak-rows", type=int, default=None, metavar="N", help="rows per GPU for weak scaling (= --size)")
    ap.add_argument("--steps", type=int, default=100, metavar="N", help="timed steps per trial (100)")
    ap.add_argument("--trials", type=int, default=3, metavar="N", help="trials, median reported (3)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--no-mpi", action="store_true", help="skip the MPI path")
    ap.add_argument("--no-peer", action="store_true", help="skip the single-process peer path")
    ap.add_argument(
        "--launches",
        action="store_true",
        help="issue every launch and copy of a step from the host (default: one CUDA graph launch per slab and "
        "step on the peer path, two per rank and step on the MPI path: examples/heat2d_mpi.py --launches)",
    )
    ap.add_argument(
        "--halos",
        default="copy,vmm",
        metavar="LIST",
        help="peer path halo modes to measure, from copy,vmm (default both)",
    )
    ap.add_argument(
        "--mpi-halos",
        default="pinned,ipc",
        metavar="LIST",
        help="MPI path halo transports, from pinned,ipc (default both; ipc: examples/heat2d_mpi.py --halo ipc)",
    )
    ap.add_argument("--quick", action="store_true", help="8192 wide, 30 steps (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--png", metavar="PATH", help="write a chart (matplotlib)")
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.steps = min(args.size, 8192), min(args.steps, 30)
    args.weak_rows = args.weak_rows or args.size
    if args.size < 3 or args.weak_rows < 3 or args.steps < 1 or args.trials < 1:
        ap.error("--size and --weak-rows must be >= 3, --steps and --trials >= 1")
    if args.gpus is not None and args.gpus < 1:
        ap.error("--gpus must be >= 1")
    args.halos = [h.strip() for h in args.halos.split(",") if h.strip()]
    if not args.halos or any(h not in ("copy", "vmm") for h in args.halos):
        ap.error(f"--halos takes copy and/or vmm, got {args.halos}")
    args.mpi_halos = list(dict.fromkeys(h.strip() for h in args.mpi_halos.split(",") if h.strip()))
    if not args.mpi_halos or any(h not in MPI_HALOS for h in args.mpi_halos):
        ap.error(f"--mpi-halos takes pinned and/or ipc, got {args.mpi_halos}")
    return args


def _plate(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    u = np.zeros(shape, dtype)
    u[:, 0] = 1.0
    u[shape[0] // 3 : shape[0] // 2, shape[1] // 3 : shape[1] // 2] = 1.0
    return u


def _peer_point(
    u0: np.ndarray, devices: list[int], args: argparse.Namespace, halo: str = "copy"
) -> tuple[dict, np.ndarray]:
    import warnings

    from umem_numba.kernels.multigpu import MultiGPUHeat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a vmm fallback is reported in the point
        run = MultiGPUHeat(u0, devices, halo=halo, graphs=not args.launches)
    with run:
        run.step(3)
        # A full garbage collection (tens of ms in a process holding numba's state) would land in
        # one step of one trial: what exists now is exempt while timing (the steps' garbage is young).
        gc.collect()
        gc.freeze()
        try:
            with_ex = [run.timed(args.steps) for _ in range(args.trials)]
            without = (
                [run.timed(args.steps, exchange=False) for _ in range(args.trials)] if len(devices) > 1 else with_ex
            )
        finally:
            gc.unfreeze()
        t, t0 = statistics.median(with_ex), statistics.median(without)
        point = {
            "gpus": len(devices),
            "devices": devices,
            "shape": list(u0.shape),
            "transports": run.transports,
            "halo": run.halo,
            "halo_fallback": run.fallback,
            "ms_per_step": t / args.steps * 1e3,
            "compute_ms_per_step": t0 / args.steps * 1e3,
            "halo_us_per_step": max(t - t0, 0.0) / args.steps * 1e6,
            "trials_s": with_ex,
        }
        # A fixed number of steps from the start for the bitwise comparison.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run = MultiGPUHeat(u0, devices, halo=halo, graphs=not args.launches)
    with run:
        run.step(10)
        final = run.result()
    return point, final


def _mpirun() -> tuple[list[str] | None, str]:
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        return None, "mpirun is not installed"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None, "mpi4py is not installed"
    if not EXAMPLE.exists():
        return None, f"{EXAMPLE} is not there (run from a source checkout)"
    cmd = [exe]
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    if "Open MPI" in version or "OpenRTE" in version or "prterun" in version.lower():
        cmd.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd, ""


def _mpi_point(mpirun: list[str], ranks: int, rows: int, args: argparse.Namespace, halo: str = "pinned") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [
            *mpirun,
            "-np",
            str(ranks),
            sys.executable,
            str(EXAMPLE),
            "--size",
            str(args.size),
            "--rows",
            str(rows),
            "--steps",
            str(args.steps + 3),
            "--warmup",
            "3",
            "--dtype",
            args.dtype,
            "--out",
            "",
            "--json",
            out,
            *(["--halo", "ipc"] if halo == "ipc" else ["--staging", "pinned"]),
            *(["--launches"] if args.launches else []),
        ]
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
        if r.returncode != 0:
            return {"ranks": ranks, "error": f"exit {r.returncode}: {(r.stderr or r.stdout)[-800:]}"}
        with open(out) as fh:
            data = json.load(fh)
    exposed = data.get("exposed_halo_us_per_step")
    return {
        "ranks": ranks,
        "shape": data["shape"],
        "ms_per_step": data["ms_per_step"],
        "compute_ms_per_step": data.get("compute_ms_per_step"),
        # what the exchange adds to a step (as for the peer path); the host's wait for messages besides
        "halo_us_per_step": data["halo_us_per_step"] if exposed is None else exposed,
        "host_wait_us_per_step": data["halo_us_per_step"],
        # the host's time issuing work (not waiting): near ms_per_step, the host limits the run
        "host_busy_us_per_step": data.get("host_busy_us_per_step"),
        "device_buffers": data["device_buffers"],
        "halo": data.get("halo", "mpi"),
        "transport_how": data["transport_how"],
        "mpi_library": data.get("mpi_library", ""),
    }


def _mpi_transport(p: dict) -> str:
    kind = "device bufs" if p["device_buffers"] else "pinned"
    busy = p.get("host_busy_us_per_step")
    return (
        ("ipc (VMM, in place)" if p.get("halo") == "ipc" else kind)
        + f" ({p['mpi_library']})"
        + ("" if busy is None else f"; host busy {busy:.0f} us/step")
    )


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The benchmark protocol's ``run`` (see :mod:`umem_numba._bench._common`)."""
    return _run(_parse(argv))


def main(argv: list[str] | None = None) -> int:
    """The benchmark protocol's ``main``: ``python -m umem_numba bench NAME``."""
    return command_line("scale", _parse, _run, argv)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from umem_numba import _driver

    require_gpu()
    from ._common import device_name

    count = _driver.device_count()
    n = args.gpus or max(count, 2)
    devices = [i % count for i in range(n)]
    simulated = n > count
    dtype = np.dtype(args.dtype)
    print(
        f"bench scale: heat2d {dtype} on {device_name()} x{count}; N = {n} "
        f"{'(SIMULATED: slabs share GPUs, no speed-up expected)' if simulated else 'GPUs'}; "
        f"weak {args.weak_rows} x {args.size} per GPU, strong {args.size}^2; {args.steps} steps x {args.trials}"
    )
    result: dict[str, Any] = {
        "benchmark": "scale",
        "device": device_name(),
        "gpus_visible": count,
        "n": n,
        "simulated": simulated,
        "dtype": str(dtype),
        "size": args.size,
        "weak_rows": args.weak_rows,
        "steps": args.steps,
        "trials": args.trials,
        "steps_issued_as": "launches" if args.launches else "graphs",
    }
    rows: list[tuple[Any, ...]] = []
    goals: dict[str, tuple[float, float | None]] = {}  # name -> (value, goal)
    status = 0
    if not args.no_peer:
        for halo in args.halos:
            key = "peer" if halo == "copy" else f"peer-{halo}"
            peer: dict[str, Any] = {}
            for mode, shapes in (
                ("weak", [(args.weak_rows, args.size), (n * args.weak_rows, args.size)]),
                ("strong", [(args.size, args.size)] * 2),
            ):
                p1, f1 = _peer_point(_plate(shapes[0], dtype), [0], args, halo)
                pn, fn = _peer_point(_plate(shapes[1], dtype), devices, args, halo)
                ratio = p1["ms_per_step"] / pn["ms_per_step"]
                peer[mode] = {"one": p1, "n": pn, "efficiency" if mode == "weak" else "speedup": ratio}
                if mode == "strong":
                    peer[mode]["bitwise_equal_to_one_gpu"] = bool(np.array_equal(f1, fn))
                    if not peer[mode]["bitwise_equal_to_one_gpu"]:
                        status = 1
                        print(f"\nERROR: {key}: the N-GPU field differs from the one-GPU field", file=sys.stderr)
                del f1, fn
                for p in (p1, pn):
                    how = ",".join(sorted(set(p["transports"]))) or "-"
                    if p["halo_fallback"]:
                        how += " (vmm fell back)"
                    rows.append(
                        (
                            key,
                            mode,
                            p["gpus"],
                            "x".join(map(str, p["shape"])),
                            f"{p['ms_per_step']:.3f}",
                            f"{p['halo_us_per_step']:.1f}",
                            how,
                        )
                    )
            result[key] = peer
            goals[f"{key} weak efficiency"] = (peer["weak"]["efficiency"], GOAL_WEAK)
            goals[f"{key} strong speedup ({n} GPUs)"] = (peer["strong"]["speedup"], strong_goal("peer", n))
    if not args.no_mpi:
        mpirun, why = _mpirun()
        if mpirun is None:
            result["mpi"] = {"skipped": why}
            print(f"MPI path skipped: {why}", file=sys.stderr)
        else:
            points = {
                "weak": [(1, args.weak_rows), (n, n * args.weak_rows)],
                "strong": [(1, args.size), (n, args.size)],
            }
            # One rank exchanges nothing: its point is the same for every transport (and for weak and
            # strong scaling when --weak-rows is --size), so each distinct one runs once.
            cache: dict[tuple[int, int], dict] = {}
            for pts in points.values():
                if pts[0] not in cache:
                    cache[pts[0]] = _mpi_point(mpirun, *pts[0], args)
            one = {mode: cache[pts[0]] for mode, pts in points.items()}
            for halo in args.mpi_halos:
                key = "mpi" if halo == "pinned" else f"mpi-{halo}"
                mpi: dict[str, Any] = {}
                for mode, pts in points.items():
                    p1, pn = one[mode], _mpi_point(mpirun, *pts[1], args, halo)
                    mpi[mode] = {"one": p1, "n": pn}
                    for p in (p1, pn):
                        if "error" in p:
                            rows.append((key, mode, p["ranks"], "", "error", "", p["error"][-120:]))
                        else:
                            rows.append(
                                (
                                    key,
                                    mode,
                                    p["ranks"],
                                    "x".join(map(str, p["shape"])),
                                    f"{p['ms_per_step']:.3f}",
                                    f"{p['halo_us_per_step']:.1f}",
                                    _mpi_transport(p),
                                )
                            )
                    if "error" not in p1 and "error" not in pn:
                        mpi[mode]["efficiency" if mode == "weak" else "speedup"] = p1["ms_per_step"] / pn["ms_per_step"]
                    else:
                        status = 1
                result[key] = mpi
                if "efficiency" in mpi["weak"]:
                    goals[f"{key} weak efficiency"] = (mpi["weak"]["efficiency"], GOAL_WEAK)
                if "speedup" in mpi["strong"]:
                    goals[f"{key} strong speedup ({n} ranks)"] = (mpi["strong"]["speedup"], strong_goal("mpi", n))
            if "mpi" in result and "mpi-ipc" in result:
                result["mpi_ipc_vs_pinned"] = _compare_ipc(result["mpi"], result["mpi-ipc"], n, goals)
    print()
    print_table(rows, ["path", "scaling", "GPUs", "grid", "ms/step", "halo us/step", "transport"])
    print()
    gtable = []
    result["goals"] = {}
    for name, (value, goal) in goals.items():
        status_text = "" if goal is None else goal_text(value, goal) + (" (simulated)" if simulated else "")
        gtable.append((name, f"{value:.3f}", "" if goal is None else f">= {goal}", status_text))
        result["goals"][name] = {"value": value, "goal": goal, "status": status_text}
    print_table(gtable, ["goal", "value", "target", ""])
    if "peer" in result and not result["peer"]["strong"]["bitwise_equal_to_one_gpu"]:
        print("\nERROR: the N-GPU field differs from the one-GPU field", file=sys.stderr)
    if args.png:
        _chart(args.png, result)
    result["status"] = status
    # Slabs sharing one GPU measure the decomposition's overhead, not scaling: no goal applies.
    result["figures"] = [
        goal_row(name, g["value"], None, note=f"simulated: {n} slabs on {count} GPU(s), no goal")
        if simulated
        else goal_row(name, g["value"], g["goal"])
        for name, g in result["goals"].items()
    ]
    return result


def _compare_ipc(pinned: dict, ipc: dict, n: int, goals: dict[str, tuple[float, float | None]]) -> dict:
    """The N-rank points of both MPI transports side by side; their ratios go into ``goals`` without a goal."""
    out: dict[str, Any] = {}
    for mode in ("weak", "strong"):
        a, b = pinned[mode]["n"], ipc[mode]["n"]
        if "error" in a or "error" in b:
            continue
        c = {
            "pinned_ms_per_step": a["ms_per_step"],
            "ipc_ms_per_step": b["ms_per_step"],
            # > 1: the ipc path's step is shorter
            "pinned_over_ipc_step": a["ms_per_step"] / b["ms_per_step"],
            "pinned_halo_us_per_step": a["halo_us_per_step"],
            "ipc_halo_us_per_step": b["halo_us_per_step"],
            "pinned_host_wait_us_per_step": a["host_wait_us_per_step"],
            "ipc_host_wait_us_per_step": b["host_wait_us_per_step"],
        }
        out[mode] = c
        goals[f"mpi {mode} step, pinned / ipc ({n} ranks)"] = (c["pinned_over_ipc_step"], None)
        print(
            f"MPI {mode}, {n} ranks: ipc {c['ipc_ms_per_step']:.3f} ms/step vs pinned "
            f"{c['pinned_ms_per_step']:.3f} ms/step (pinned / ipc {c['pinned_over_ipc_step']:.3f}); halo "
            f"{c['ipc_halo_us_per_step']:.1f} vs {c['pinned_halo_us_per_step']:.1f} us/step; host wait "
            f"{c['ipc_host_wait_us_per_step']:.1f} vs {c['pinned_host_wait_us_per_step']:.1f} us/step"
        )
    return out


def _chart(path: str, result: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench scale: --png needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    n = result["n"]
    for ax, mode, key in ((axes[0], "weak", "efficiency"), (axes[1], "strong", "speedup")):
        labels, values, goals = [], [], []
        for path_name in ("peer", "peer-vmm", "mpi", "mpi-ipc"):
            value = result.get(path_name, {}).get(mode, {}).get(key)
            goal = GOAL_WEAK if mode == "weak" else strong_goal(path_name.split("-")[0], n)
            if value is not None:
                labels.append(path_name)
                values.append(value)
                goals.append(goal or 0.0)
        ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
        for i, (v, g) in enumerate(zip(values, goals, strict=True)):
            ax.text(i, v, f"{v:.3f}", ha="center", va="bottom")
            ax.hlines(g, i - 0.4, i + 0.4, colors="k", linestyles="--")
        ax.set_title(f"{mode} scaling, {key} on {n} GPUs" + (" (simulated)" if result["simulated"] else ""))
        ax.set_ylim(0, max(values + goals + [1.0]) * 1.15)
    fig.suptitle(f"heat2d {result['dtype']} on {result['device']}; dashed: goals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
