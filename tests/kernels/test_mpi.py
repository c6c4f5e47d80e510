"""The MPI example and its pieces: CUDA-awareness detection, collective error reporting, 2 ranks vs 1.

The mpirun tests run ``examples/heat2d_mpi.py`` in a subprocess with a
timeout (a hang fails the test instead of stalling the suite); they skip
with the reason where mpirun or mpi4py is missing.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from umem_numba.kernels.mpi._fdpass import MAX_FDS, recv_fds, send_fds
from umem_numba.kernels.mpi.comm import collective_errors, cuda_aware_mpi, mismatch
from umem_numba.kernels.mpi.distributed import RankHeat

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "heat2d_mpi.py"
IPC_WORKER = ROOT / "tests" / "support" / "mpi_ipc_worker.py"


def _mpirun() -> list[str]:
    """mpirun (Open MPI) or mpiexec (MPICH's Hydra), with the flags these tests need."""
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("mpirun is not installed (pip install -e '.[mpi]')")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed (pip install -e '.[mpi]')")
    cmd = [exe]
    if _is_open_mpi(exe):
        cmd += ["--oversubscribe"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd += ["--allow-run-as-root"]
    return cmd


def _is_open_mpi(exe: str) -> bool:
    version = subprocess.run([exe, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    return "Open MPI" in version or "OpenRTE" in version or "prterun" in version.lower()


def _env_flag(mpirun: list[str], name: str, value: str) -> list[str]:
    """Set an environment variable for the ranks of one app context (Open MPI: -x, Hydra: -env)."""
    return ["-x", f"{name}={value}"] if _is_open_mpi(mpirun[0]) else ["-env", name, value]


def _env() -> dict[str, str]:
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONUNBUFFERED="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun hung (timeout {timeout} s): {' '.join(args)}\n{exc.stdout}\n{exc.stderr}")


# -- detection ----------------------------------------------------------------------------
class _Lib:
    def __init__(self, **fns):
        self.__dict__.update(fns)


def test_cuda_aware_detection_open_mpi_query() -> None:
    assert cuda_aware_mpi({}, [_Lib(MPIX_Query_cuda_support=lambda: 1)]) == (
        True,
        "MPIX_Query_cuda_support() returned 1",
    )
    aware, how = cuda_aware_mpi({}, [_Lib(MPIX_Query_cuda_support=lambda: 0)])
    assert aware is False and "returned 0" in how


def test_cuda_aware_detection_mpich_query() -> None:
    def query(kind, flag_ref):
        assert kind == 0  # MPIX_GPU_SUPPORT_CUDA
        ctypes.cast(flag_ref, ctypes.POINTER(ctypes.c_int))[0] = 1
        return 0

    aware, how = cuda_aware_mpi({}, [_Lib(MPIX_GPU_query_support=query)])
    assert aware is True and "MPIX_GPU_query_support" in how


def test_cuda_aware_detection_fallbacks() -> None:
    aware, how = cuda_aware_mpi({}, [_Lib()])
    assert aware is False and "no CUDA-awareness query" in how
    assert cuda_aware_mpi({"UMEM_MPI_CUDA_AWARE": "1"}, [_Lib(MPIX_Query_cuda_support=lambda: 0)])[0] is True
    assert cuda_aware_mpi({"UMEM_MPI_CUDA_AWARE": "0"}, [_Lib(MPIX_Query_cuda_support=lambda: 1)])[0] is False


def test_cuda_aware_detection_real_library_agrees_with_ompi_info() -> None:
    """The real query through mpi4py's libmpi, against what ompi_info says about the same build."""
    if not _is_open_mpi(_mpirun()[0]):
        pytest.skip("the MPI library on PATH is not Open MPI")
    ompi_info = shutil.which("ompi_info")
    if ompi_info is None:
        pytest.skip("ompi_info is not installed (not Open MPI)")
    out = subprocess.run(
        [ompi_info, "--parsable", "--all"], check=False, capture_output=True, text=True, timeout=60
    ).stdout
    built = [ln.rsplit(":", 1)[1] for ln in out.splitlines() if "built_with_cuda_support:value" in ln]
    if not built:
        pytest.skip("ompi_info does not report built_with_cuda_support")
    code = (
        "from umem_numba.kernels.mpi.comm import cuda_aware_mpi; a, how = cuda_aware_mpi(); print(int(a)); print(how)"
    )
    env = _env()
    env.pop("UMEM_MPI_CUDA_AWARE", None)
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    aware, how = r.stdout.splitlines()[:2]
    assert "MPIX_Query_cuda_support" in how
    if built[0] == "false":  # without CUDA in the build the runtime cannot support it
        assert aware == "0"


class _FakeComm:
    def __init__(self, values):
        self.values = values

    def allgather(self, _value):
        return self.values


def test_collective_errors_group_and_name_ranks() -> None:
    assert collective_errors(_FakeComm([None, None]), None) == []
    assert collective_errors(_FakeComm(["x", "x", "x"]), "x") == ["all ranks: x"]
    assert collective_errors(_FakeComm([None, "no GPU", "no GPU", "bad"]), None) == ["rank 1, 2: no GPU", "rank 3: bad"]
    msg = mismatch(_FakeComm([{"size": 64, "steps": 3}, {"size": 65, "steps": 3}]), {})
    assert "size: rank 0=64, rank 1=65" in msg and "steps" not in msg


# -- the example under mpirun, CPU path -----------------------------------------------------
@pytest.mark.parametrize(("ranks", "rows"), [(2, 53), (3, 53), (4, 6)])  # (4, 6): slabs of one row
def test_mpi_cpu_ranks_bitwise_equal_one_rank(tmp_path: Path, ranks: int, rows: int) -> None:
    mpirun = _mpirun()
    seed = int.from_bytes(os.urandom(4), "little")
    common = [
        "--cpu",
        "--size",
        "61",
        "--rows",
        str(rows),
        "--steps",
        "17",
        "--init",
        "random",
        "--seed",
        str(seed),
        "--alpha",
        "0.2",
        "--out",
        "",
    ]
    one, many = tmp_path / "one.npy", tmp_path / "many.npy"
    r1 = _run([*mpirun, "-np", "1", sys.executable, str(EXAMPLE), *common, "--save", str(one)])
    assert r1.returncode == 0, r1.stdout + r1.stderr
    rn = _run([*mpirun, "-np", str(ranks), sys.executable, str(EXAMPLE), *common, "--save", str(many), "--check"])
    assert rn.returncode == 0, rn.stdout + rn.stderr
    assert "bitwise equal" in rn.stdout
    # the ranks ran on the library of the mpirun that started them (Open MPI, or MPICH: README)
    assert ("MPI: Open MPI" if _is_open_mpi(mpirun[0]) else "MPI: MPICH") in rn.stdout, rn.stdout
    a, b = np.load(one), np.load(many)
    u0 = np.random.default_rng(seed).random((rows, 61)).astype(np.float32)
    assert not np.array_equal(a, u0)
    assert np.array_equal(a, b)


@pytest.mark.parametrize(
    ("ranks", "args"),
    [(2, ["70", "20", "5"]), (3, ["70", "20", "6"]), (4, ["6", "9", "4"]), (3, ["29", "5", "4", "3d"])],
)
@pytest.mark.parametrize("mode", ["replaced", "driver", "graphs"])
def test_mpi_gpu_path_data_flow_in_simulator(ranks: int, args: list[str], mode: str) -> None:
    """RankHeat's GPU path (real kernels, band arrays, copy offsets) under numba's simulator, against NumPy.

    ``replaced``: copies that run when queued replace the driver's (see the worker); ``driver``:
    over the simulated driver, which runs stream work late (both: steps issued one by one,
    ``graphs=False``); ``graphs``: the same with graph steps (``graphs=True``, the default).
    """
    mpirun = _mpirun()
    seed = str(int.from_bytes(os.urandom(4), "little"))
    worker = ROOT / "tests" / "support" / "mpi_sim_worker.py"
    cmd = [*mpirun, "-np", str(ranks), *_env_flag(mpirun, "NUMBA_ENABLE_CUDASIM", "1")]
    extra = [] if mode == "replaced" else [mode]
    r = _run([*cmd, sys.executable, str(worker), *args[:3], seed, *args[3:], *extra], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    how = "mpi halos, graphs" if mode == "graphs" else "mpi halos"
    assert f"simulated GPU path ({how}), {ranks} ranks: bitwise equal" in r.stdout


# RankHeat's two GPU schedules side by side in one set of ranks (run by the tests below: the same script
# on the simulated driver and on GPUs).  Each schedule runs a plan with steps that skip the exchange and a
# synchronize between steps (the graph steps defer their edge-row fix-ups to the next step, or to the
# synchronize); the two gathered fields must be bitwise equal, and a plain run must equal the NumPy
# reference.  Halos: mpi (pinned staging), device (device_buffers=True, as with CUDA-aware MPI: the
# simulated driver's device memory is host memory, which any MPI reads) or ipc (on the simulated
# driver, its VMM memory is memfds really exported to the neighbours and mapped there; RankHeat's
# refusal of the simulator, which predates that, is lifted here).
_SCHEDULES_WORKER = """
import sys

import numpy as np
from mpi4py import MPI

from umem_numba.kernels import heat2d_reference, heat3d_reference
from umem_numba.kernels.decomp import Decomposition
from umem_numba.kernels.mpi import distributed
from umem_numba.kernels.stencil2d import TUNED_2D
from umem_numba.kernels.stencil3d import DEFAULT_VARIANT_3D, TUNED_3D, slab_align_3d

rows, cols, seed = (int(x) for x in sys.argv[1:4])
halo, three_d = sys.argv[4], "3d" in sys.argv[5:]
comm = MPI.COMM_WORLD
if distributed._simulating():
    distributed._simulating = lambda: False
else:
    from numba import cuda

    cuda.select_device(comm.Get_rank() % len(cuda.gpus))
shape = (rows, cols, 6) if three_d else (rows, cols)
dtype = np.dtype(np.float32)
u0 = np.random.default_rng(seed).random(shape).astype(dtype)
alpha = 0.15 if three_d else 0.2
align = slab_align_3d(DEFAULT_VARIANT_3D[dtype], TUNED_3D[dtype][0]) if three_d else TUNED_2D[dtype][0]
d = Decomposition(shape, comm.Get_size(), align)
s = d.slabs[comm.Get_rank()]
PLAN = [(2, True), (2, False), (1, True), ("sync", None), (3, True), (1, False), (2, True)]
plates = {}
for graphs in (False, True):
    for plan in (PLAN, [(7, True)]):
        run = distributed.RankHeat(
            comm, d, u0[s.start : s.stop], alpha, halo="ipc" if halo == "ipc" else "mpi", graphs=graphs,
            device_buffers=halo == "device",
        )
        for n, exchange in plan:
            if n == "sync":
                run.synchronize()
            else:
                run.step(n, exchange=exchange)
        plates[graphs, len(plan)] = run.gather(0)
        run.close()
if comm.Get_rank() == 0:
    ref = (heat3d_reference if three_d else heat2d_reference)(u0, 7, alpha)
    for graphs in (False, True):
        # The GPU's kernels round differently from NumPy's (fused multiply-adds): close there, bitwise here.
        if np.array_equal(plates[graphs, 1], ref):
            verdict = "reference bitwise equal"
        elif np.allclose(plates[graphs, 1], ref, rtol=1e-5, atol=1e-6):
            verdict = "reference close"
        else:
            verdict = "DIFFER"
        how = "graphs" if graphs else "launches"
        print(f"{how}, {comm.Get_size()} ranks: {verdict}")
    same = np.array_equal(plates[False, 1], plates[True, 1])
    print("plain run: graphs " + ("bitwise equal to launches" if same else "DIFFER from launches"))
    same = np.array_equal(plates[False, len(PLAN)], plates[True, len(PLAN)])
    print("plan with gaps: graphs " + ("bitwise equal to launches" if same else "DIFFER from launches"))
    assert not np.array_equal(plates[True, len(PLAN)], plates[True, 1])  # the gaps changed the field
"""


def _run_schedules(tmp_path: Path, ranks: int, args: list[str], *, simulate: bool) -> str:
    mpirun = _mpirun()
    script = tmp_path / "schedules.py"
    script.write_text(_SCHEDULES_WORKER)
    seed = str(int.from_bytes(os.urandom(4), "little"))
    cmd = [*mpirun, "-np", str(ranks)]
    if simulate:
        cmd += _env_flag(mpirun, "NUMBA_ENABLE_CUDASIM", "1")
    r = _run([*cmd, sys.executable, str(script), *args[:2], seed, *args[2:]], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    expected = "reference bitwise equal" if simulate else "reference "  # on a GPU: bitwise or close
    for how in ("launches", "graphs"):
        assert f"{how}, {ranks} ranks: {expected}" in r.stdout, r.stdout
    assert "plain run: graphs bitwise equal to launches" in r.stdout, r.stdout
    assert "plan with gaps: graphs bitwise equal to launches" in r.stdout, r.stdout
    return r.stdout


@pytest.mark.parametrize(
    ("ranks", "args"),
    [
        (2, ["70", "20", "mpi"]),
        (3, ["70", "20", "ipc"]),
        (3, ["70", "20", "device"]),
        (4, ["6", "9", "mpi"]),  # slabs of one row: both bands share the edge row
        (4, ["6", "9", "ipc"]),
        (3, ["29", "5", "mpi", "3d"]),
    ],
)
def test_mpi_graph_steps_match_launches_in_simulator(tmp_path: Path, ranks: int, args: list[str]) -> None:
    """Graph steps (deferred fix-ups, two band slots, persistent requests) against steps issued one by one.

    Over the simulated driver, whose streams run their work late and in a seeded order: a missing
    event or a band slot read in the wrong step shows up as a wrong cell.
    """
    _run_schedules(tmp_path, ranks, args, simulate=True)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("ranks", "args"), [(2, ["777", "1000", "mpi"]), (3, ["777", "1000", "ipc"])])
def test_mpi_gpu_graph_steps_match_launches(tmp_path: Path, ranks: int, args: list[str]) -> None:
    """The same on GPUs (ranks share them where there are fewer)."""
    _run_schedules(tmp_path, ranks, args, simulate=False)


def test_mpi_grid_smaller_than_ranks_fails_on_every_rank() -> None:
    mpirun = _mpirun()
    r = _run(
        [
            *mpirun,
            "-np",
            "4",
            sys.executable,
            str(EXAMPLE),
            "--cpu",
            "--size",
            "16",
            "--rows",
            "3",
            "--steps",
            "2",
            "--out",
            "",
        ],
        timeout=120,
    )
    assert r.returncode != 0
    for rank in range(4):
        assert (
            f"[rank {rank}]: error: all ranks: a grid of 3 rows along the split axis cannot be cut into "
            "4 slabs" in r.stderr
        ), r.stderr


def test_mpi_mismatched_sizes_fail_on_every_rank() -> None:
    mpirun = _mpirun()
    base = [sys.executable, str(EXAMPLE), "--cpu", "--steps", "2", "--out", ""]
    r = _run([*mpirun, "-np", "1", *base, "--size", "32", ":", "-np", "1", *base, "--size", "33"], timeout=120)
    assert r.returncode != 0
    for rank in range(2):
        assert (
            f"[rank {rank}]: error: all ranks: the ranks were started with different settings (size: "
            f"rank 0=32, rank 1=33)" in r.stderr
        ), r.stderr


def test_mpi_unwritable_out_fails_on_every_rank_before_any_work(tmp_path: Path) -> None:
    """Rank 0 writes the picture at the end: a missing folder stops every rank at the start (exit 2)."""
    mpirun = _mpirun()
    bad = tmp_path / "missing" / "plate.png"
    cmd = [sys.executable, str(EXAMPLE), "--cpu", "--size", "32", "--steps", "2", "--out", str(bad)]
    r = _run([*mpirun, "-np", "2", *cmd], timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    for rank in range(2):
        assert f"[rank {rank}]: error: rank 0: --out {bad}: folder" in r.stderr, r.stderr
        assert f"[rank {rank}]: stopping before any halo exchange" in r.stderr
    assert not bad.parent.exists()


def test_mpi_rank_without_gpu_fails_on_every_rank() -> None:
    """GPU mode with one rank that sees no GPU (CUDA_VISIBLE_DEVICES empty); on a CPU machine, both ranks."""
    mpirun = _mpirun()
    base = [sys.executable, str(EXAMPLE), "--size", "64", "--steps", "2", "--out", ""]
    no_gpu = _env_flag(mpirun, "CUDA_VISIBLE_DEVICES", "")
    r = _run([*mpirun, "-np", "1", *base, ":", "-np", "1", *no_gpu, *base], timeout=120)
    assert r.returncode != 0
    for rank in range(2):
        assert f"[rank {rank}]: error:" in r.stderr and "no usable GPU" in r.stderr, r.stderr
        assert f"[rank {rank}]: stopping before any halo exchange" in r.stderr


# -- GPU path ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("staging", "ranks", "how"),
    [("pinned", 2, "graphs"), ("auto", 2, "graphs"), ("pinned", 3, "graphs"), ("pinned", 3, "launches")],
)
def test_mpi_gpu_ranks_bitwise_one_gpu(tmp_path: Path, staging: str, ranks: int, how: str) -> None:
    """Two or three ranks (sharing GPUs where there are fewer) against the one-GPU run, checked by rank 0.

    ``graphs``: each step as graph launches (the default); ``launches``: one by one (``--launches``).
    """
    mpirun = _mpirun()
    seed = int.from_bytes(os.urandom(4), "little")
    out = tmp_path / "plate.npy"
    r = _run(
        [
            *mpirun,
            "-np",
            str(ranks),
            sys.executable,
            str(EXAMPLE),
            "--size",
            "1000",
            "--rows",
            "777",
            "--steps",
            "40",
            "--init",
            "random",
            "--seed",
            str(seed),
            "--staging",
            staging,
            "--check",
            "--save",
            str(out),
            "--out",
            "",
            *(["--launches"] if how == "launches" else []),
        ],
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check against the one-GPU run: bitwise equal" in r.stdout
    plate = np.load(out)
    u0 = np.random.default_rng(seed).random((777, 1000)).astype(np.float32)
    assert not np.array_equal(plate, u0)


# -- same-node zero copy (--halo ipc): the descriptor transport on the CPU ----------------------
def _memfd(text: str) -> int:
    fd = os.memfd_create("umem-test")
    os.write(fd, text.encode())
    return fd


def test_fds_pass_over_a_socketpair_with_their_payload() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine = [_memfd("first"), _memfd("second")]
    try:
        with a, b:
            a.settimeout(10)
            b.settimeout(10)
            send_fds(a, mine, {"sizes": [1, 2], "note": "x" * 100_000})  # a body larger than one recvmsg
            got, payload = recv_fds(b)
        assert payload == {"sizes": [1, 2], "note": "x" * 100_000}
        assert len(got) == 2 and not set(got) & set(mine)  # new descriptors in this process
        assert [os.pread(fd, 16, 0) for fd in got] == [b"first", b"second"]
        for fd in got:
            os.close(fd)
    finally:
        for fd in mine:
            os.close(fd)


def test_fds_receive_refuses_more_than_it_takes_and_closes_what_came() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine = [_memfd(str(i)) for i in range(3)]
    before = len(os.listdir("/proc/self/fd"))
    try:
        with a, b:
            send_fds(a, mine, {})
            with pytest.raises(ConnectionError, match="more than 1 descriptors"):
                recv_fds(b, max_fds=1)
        assert len(os.listdir("/proc/self/fd")) == before - 2  # the socket pair; nothing received leaks
    finally:
        for fd in mine:
            os.close(fd)
    with socket.socket(socket.AF_UNIX) as c, pytest.raises(ValueError, match=f"at most {MAX_FDS} descriptors"):
        send_fds(c, [0] * (MAX_FDS + 1), {})


@pytest.mark.parametrize("sent", [b"", b"\x05\x00", b"\x05\x00\x00\x00{}", b"\x02\x00\x00\x00[]"])
def test_fds_receive_names_a_short_or_foreign_message(sent: bytes) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(10)
        a.sendall(sent)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match=r"closed the socket|not a descriptor message"):
            recv_fds(b)


def test_rank_heat_ipc_refuses_the_cpu_path_and_unknown_modes() -> None:
    from umem_numba.kernels.decomp import Decomposition

    d = Decomposition((8, 8), 1)
    u = np.zeros((8, 8), np.float32)
    with pytest.raises(ValueError, match="needs the GPU path"):
        RankHeat(_FakeComm([None]), d, u, 0.2, cpu=True, halo="ipc")
    with pytest.raises(ValueError, match="halo must be one of"):
        RankHeat(_FakeComm([None]), d, u, 0.2, cpu=True, halo="shm")


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_fds_pass_between_mpi_ranks(tmp_path: Path, ranks: int) -> None:
    """Real ranks: memfd contents and a pipe's write end reach the neighbours; the socket directory goes."""
    mpirun = _mpirun()
    r = _run(
        [
            *mpirun,
            "-np",
            str(ranks),
            *_env_flag(mpirun, "TMPDIR", str(tmp_path)),
            sys.executable,
            str(IPC_WORKER),
            "fds",
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(ranks):
        assert f"rank {rank}: descriptors from " in r.stdout and "passed and live" in r.stdout
    assert not list(tmp_path.glob("umem-fds-*")), "the socket directory was left behind"


def test_fds_failure_on_one_rank_raises_on_every_rank() -> None:
    mpirun = _mpirun()
    r = _run([*mpirun, "-np", "2", sys.executable, str(IPC_WORKER), "fds-fail"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(2):
        assert f"rank {rank}: FdPassError: passing (SCM_RIGHTS over Unix sockets): " in r.stdout, r.stdout
    assert "rank 1: passing descriptors to/from ranks [0] failed: OSError" in r.stdout  # the cause, on both


@pytest.mark.parametrize(
    ("ranks", "args"),
    [(2, ["70", "20", "5"]), (3, ["70", "20", "6"]), (4, ["6", "9", "4"]), (3, ["29", "5", "4", "3d"])],
)
def test_mpi_ipc_halos_data_flow_in_simulator(ranks: int, args: list[str]) -> None:
    """halo='ipc' under numba's simulator: outboxes are memfds really passed and mapped by the neighbours."""
    mpirun = _mpirun()
    seed = str(int.from_bytes(os.urandom(4), "little"))
    worker = ROOT / "tests" / "support" / "mpi_sim_worker.py"
    cmd = [*mpirun, "-np", str(ranks), *_env_flag(mpirun, "NUMBA_ENABLE_CUDASIM", "1")]
    r = _run([*cmd, sys.executable, str(worker), *args[:3], seed, *args[3:], "ipc"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"simulated GPU path (ipc halos), {ranks} ranks: bitwise equal" in r.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cpu"], "--halo ipc maps GPU memory between the ranks: it needs the GPU path, not --cpu"),
        (["--staging", "pinned"], "--staging pinned chooses the buffers of MPI halos: it does not go with --halo ipc"),
    ],
)
def test_mpi_ipc_bad_options_fail_on_every_rank(extra: list[str], message: str) -> None:
    mpirun = _mpirun()
    cmd = [sys.executable, str(EXAMPLE), "--halo", "ipc", "--size", "64", "--steps", "2", "--out", "", *extra]
    r = _run([*mpirun, "-np", "2", *cmd], timeout=120)
    assert r.returncode != 0
    for rank in range(2):
        assert f"[rank {rank}]: error: all ranks: {message}" in r.stderr, r.stderr
        assert f"[rank {rank}]: stopping before any halo exchange" in r.stderr


def test_mpi_ipc_ranks_on_several_nodes_fail_on_every_rank() -> None:
    """The shared-memory split answering one node per rank (as on a cluster): every rank says why, none hangs."""
    mpirun = _mpirun()
    args = ["two-nodes", "--halo", "ipc", "--size", "64", "--steps", "2", "--out", ""]
    r = _run([*mpirun, "-np", "3", sys.executable, str(IPC_WORKER), *args], timeout=120)
    assert r.returncode != 0
    for rank in range(3):
        assert (
            f"[rank {rank}]: error: all ranks: --halo ipc (halo='ipc') needs every rank on one node, but the 3 "
            "ranks are not on one node" in r.stderr
        ), r.stderr
        assert f"[rank {rank}]: stopping before any halo exchange" in r.stderr


def test_mpi_ipc_without_gpu_fails_on_every_rank() -> None:
    from umem_numba import _driver

    if _driver.available():
        pytest.skip("this machine has a GPU (the GPU test runs --halo ipc)")
    mpirun = _mpirun()
    cmd = [sys.executable, str(EXAMPLE), "--halo", "ipc", "--size", "64", "--steps", "2", "--out", ""]
    r = _run([*mpirun, "-np", "2", *cmd], timeout=120)
    assert r.returncode != 0
    for rank in range(2):
        assert f"[rank {rank}]: error: all ranks: no usable GPU" in r.stderr, r.stderr


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("ranks", "rows", "cols", "how"), [(2, 512, 512, "graphs"), (3, 777, 1000, "graphs"), (3, 777, 1000, "launches")]
)
def test_mpi_gpu_ipc_halos_bitwise_one_gpu(tmp_path: Path, ranks: int, rows: int, cols: int, how: str) -> None:
    """--halo ipc (ranks sharing the GPUs where there are fewer): bitwise the one-GPU run, checked by rank 0."""
    mpirun = _mpirun()
    seed = int.from_bytes(os.urandom(4), "little")
    out, js = tmp_path / "plate.npy", tmp_path / "r.json"
    args = ["--halo", "ipc", "--size", str(cols), "--rows", str(rows), "--steps", "20", "--init", "random"]
    args += ["--launches"] if how == "launches" else []
    args += ["--seed", str(seed), "--check", "--save", str(out), "--json", str(js), "--out", ""]
    r = _run([*mpirun, "-np", str(ranks), sys.executable, str(EXAMPLE), *args], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "halos via exported VMM rows read in place" in r.stdout, r.stdout
    assert "check against the one-GPU run: bitwise equal" in r.stdout, r.stdout
    assert json.loads(js.read_text())["halo"] == "ipc"
    plate = np.load(out)
    u0 = np.random.default_rng(seed).random((rows, cols)).astype(np.float32)
    assert not np.array_equal(plate, u0)


def test_bench_scale_compares_the_mpi_transports(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """bench scale's MPI bookkeeping with the mpirun points faked: the one-rank point runs once, both
    transports get their rows and ratios, the comparison and its figures (no goal) come out."""
    from umem_numba import _driver
    from umem_numba._bench import _common, scale

    calls = []

    def point(mpirun, ranks, rows, args, halo="pinned"):
        calls.append((ranks, rows, halo))
        ms = {1: 0.5, 2: {"pinned": 1.2, "ipc": 1.0}}[ranks]
        ms = ms if ranks == 1 else ms[halo] * (1.5 if rows > args.size else 1.0)
        return {
            "ranks": ranks,
            "shape": [rows, args.size],
            "ms_per_step": ms,
            "compute_ms_per_step": 0.5,
            "halo_us_per_step": (ms - 0.5) * 1e3 if ranks > 1 else 0.0,
            "host_wait_us_per_step": 7.0,
            "device_buffers": False,
            "halo": "ipc" if halo == "ipc" else "mpi",
            "transport_how": "",
            "mpi_library": "Open MPI vX",
        }

    monkeypatch.setattr(scale, "require_gpu", lambda: None)  # the benchmarks' one check for a real GPU
    monkeypatch.setattr(_driver, "device_count", lambda: 1)
    monkeypatch.setattr(_common, "device_name", lambda: "Fake GPU")
    monkeypatch.setattr(scale, "_mpirun", lambda: (["mpirun"], ""))
    monkeypatch.setattr(scale, "_mpi_point", point)
    result = scale.run(["--no-peer", "--size", "64", "--steps", "2"])
    out = capsys.readouterr().out
    assert sorted(calls) == [(1, 64, "pinned"), (2, 64, "ipc"), (2, 64, "pinned"), (2, 128, "ipc"), (2, 128, "pinned")]
    assert result["status"] == 0 and result["simulated"]
    assert result["mpi"]["strong"]["speedup"] == pytest.approx(0.5 / 1.2)
    assert result["mpi-ipc"]["weak"]["efficiency"] == pytest.approx(0.5 / 1.5)
    cmp = result["mpi_ipc_vs_pinned"]
    assert cmp["strong"]["pinned_over_ipc_step"] == pytest.approx(1.2)
    assert cmp["weak"]["ipc_halo_us_per_step"] == pytest.approx(1000.0)
    assert "MPI strong, 2 ranks: ipc 1.000 ms/step vs pinned 1.200 ms/step (pinned / ipc 1.200)" in out
    assert "ipc (VMM, in place) (Open MPI vX)" in out
    figures = {f["name"]: f for f in result["figures"]}
    assert figures["mpi strong step, pinned / ipc (2 ranks)"]["goal"] is None
    assert "simulated" in figures["mpi-ipc weak efficiency"]["note"]
    with pytest.raises(SystemExit):
        scale.run(["--mpi-halos", "pinned,shm"])


def test_bench_scale_cli_without_gpu_says_why() -> None:
    from umem_numba import _driver

    if _driver.available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    r = subprocess.run(
        [sys.executable, "-m", "umem_numba", "bench", "scale", "--quick"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=ROOT,
    )
    assert r.returncode == 2 and "bench scale: no usable GPU" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "umem_numba", "bench", "scale", "--steps", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=ROOT,
    )
    assert r.returncode == 2 and "--steps and --trials >= 1" in r.stderr
