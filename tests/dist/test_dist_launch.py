"""Launching: ``coconet run --nproc 2``, torchrun with two agents (--nnodes 2) on localhost, and
``coconet show`` / ``coconet calibrate``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coconet.cache import keyed_cache_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import torch
    import coconet as cc
    from coconet import runtime

    comm = runtime.init(timeout=30)
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    w = cc.Tensor("w", cc.float32, [N], cc.Replicated)
    prog = cc.Program("tiny", [g, w], {"total": cc.all_reduce(g), "wu": cc.update(w, w + 1.0)})
    step = cc.compile(prog, comm=comm, fused_kernels=False)
    w_t = torch.zeros(3)
    out = step(g=torch.full((3,), float(comm.rank + 1)), w=w_t)
    print(f"rank {comm.rank} of {comm.world}: total={out['total'].tolist()} w={w_t.tolist()} "
          f"args={sys.argv[1:]}", flush=True)
    print(f"rank {comm.rank} GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES')}", flush=True)
    runtime.shutdown(exit_code=0)
    """
)


def _env():
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _coconet(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "coconet.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=ROOT,
    )


@pytest.mark.timeout(120)
def test_coconet_run_two_ranks(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    out = _coconet("run", "--nproc", "2", str(script), "--flag", "x")
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert (
            f"rank {rank} of 2: total=[3.0, 3.0, 3.0] w=[1.0, 1.0, 1.0] args=['--flag', 'x']"
            in out.stdout
        ), out.stdout + out.stderr
        # started with glibc's tcache off (coconet.runtime.allocator.rank_environment)
        assert f"rank {rank} GLIBC_TUNABLES=glibc.malloc.tcache_count=0" in out.stdout


@pytest.mark.timeout(240)
def test_an_example_runs_distributed_under_coconet_run():
    """The README's spelling: every schedule of the example on 2 gloo ranks vs the simulator."""
    out = _coconet("run", "--nproc", "2", "examples/sgd.py", "--distributed", timeout=220)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("sgd ")]
    assert [line.split()[1] for line in lines] == [
        "(unscheduled)",
        "AR_C",
        "RS_C_AG",
        "fuse_RS_C_AG",
    ], out.stdout
    assert all(line.endswith("vs the simulator  ok") for line in lines), out.stdout


@pytest.mark.timeout(120)
def test_coconet_run_reports_a_failing_rank(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os\n"
        "from coconet import runtime\n"
        "comm = runtime.init(timeout=10)\n"
        "if comm.rank == 1:\n"
        "    os._exit(3)\n"
        "runtime.shutdown(exit_code=0)\n"
    )
    out = _coconet("run", "--nproc", "2", str(script))
    assert out.returncode == 3, out.stdout + out.stderr
    assert "rank 1 failed first (exit code 3)" in out.stderr


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_torchrun_two_nodes_on_localhost(tmp_path):
    """Two torchrun agents (one through ``coconet run --nnodes 2``) meet at a c10d rendezvous;
    the same script runs unchanged."""
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coconet.cli",
                "run",
                "--nnodes",
                "2",
                "--nproc",
                "1",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "t2n",
                str(script),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            cwd=ROOT,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                "--rdzv-id=t2n",
                str(script),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            cwd=ROOT,
        ),
    ]
    outputs = []
    try:
        for a in agents:
            outputs.append(a.communicate(timeout=150)[0])
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    text = "\n".join(outputs)
    assert all(a.returncode == 0 for a in agents), text
    for rank in (0, 1):
        assert f"rank {rank} of 2: total=[3.0, 3.0, 3.0] w=[1.0, 1.0, 1.0]" in text, text
    # coconet's agent starts its rank with glibc's tcache off; plain torchrun leaves it alone
    assert "GLIBC_TUNABLES=glibc.malloc.tcache_count=0" in outputs[0], outputs[0]
    assert "GLIBC_TUNABLES=None" in outputs[1], outputs[1]


@pytest.mark.timeout(120)
def test_show_prints_generated_code(tmp_path):
    out = _coconet(
        "show",
        "examples/adam.py:program",
        "--schedule",
        "fuse_RS_C_AG",
        "--world",
        "2",
        "--cache-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "def step(comm, env, kernels, g, p, m, v," in text
    assert "comm.reduce_scatter_start(" in text and "comm.all_gather_start(" in text
    assert "kernels.fused_1(" in text
    assert "# g_sum_rs = reduce_scatter(g, dim=0, reduce_op=sum)  at " in text
    assert "collective algorithms" in text
    out = _coconet(
        "show",
        "examples/pipeline_parallel.py:program",
        "--schedule",
        "RS_P2P_C_AG",
        "--mesh",
        "pp=2,tp=2",
        "--cache-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert "comm.send_start(" in out.stdout and "axis='tp'" in out.stdout


@pytest.mark.timeout(120)
def test_calibrate_records_choices_that_show_prints(tmp_path):
    out = _coconet(
        "calibrate", "--nproc", "2", "--classes", "<=64KiB", "--cache-dir", str(tmp_path)
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for op in ("all_reduce", "reduce_scatter", "all_gather", "reduce"):
        assert f"{op}" in out.stdout
    assert (keyed_cache_dir(tmp_path) / "algorithms.json").exists()
    shown = _coconet(
        "show", "examples/sgd.py:program", "--world", "2", "--cache-dir", str(tmp_path)
    )
    assert "reduce_scatter  <=64KiB  gloo  world=2" in shown.stdout, shown.stdout


# -- the launcher keeps control of its ranks (as torchrun) ---------------------------------------
# The ranks here are plain Python scripts (no torch): what is tested is the launcher.

RANK_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    behaviour = sys.argv[1].split(",")[rank]
    with open(sys.argv[2] + f".{rank}", "w") as f:
        f.write(str(os.getpid()))
    if behaviour == "ignore-term":          # a checkpoint-on-SIGTERM handler that never ends
        signal.signal(signal.SIGTERM, lambda *a: None)
    elif behaviour.startswith("exit"):
        time.sleep(0.3)
        sys.exit(int(behaviour[4:]))
    elif behaviour == "kill9":               # a rank killed (OOM, a node's reaper)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    elif behaviour.startswith("follow"):     # the survivor: it sees the peer die, and fails
        peer = sys.argv[2] + "." + behaviour[6:]
        while not os.path.exists(peer) or not open(peer).read():
            time.sleep(0.001)
        pid = int(open(peer).read())
        def running():
            try:
                return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
            except OSError:
                return False
        while running():
            time.sleep(0.001)
        sys.exit(1)
    while True:
        time.sleep(0.05)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not reaped yet by a dead parent's reaper) is not running
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _launcher(tmp_path, behaviours: str, **kwargs):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    code = (
        "import sys; from coconet.runtime.launch import run_script; "
        f"sys.exit(run_script([{str(script)!r}, {behaviours!r}, {str(tmp_path / 'pid')!r}], "
        f"{len(behaviours.split(','))}, **{kwargs!r}))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], env=_env(), stderr=subprocess.PIPE, text=True, cwd=ROOT
    )


def _pids(tmp_path, n: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    files = [tmp_path / f"pid.{r}" for r in range(n)]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_reaches_every_rank(tmp_path, sig):
    launcher = _launcher(tmp_path, "run,run")
    pids = _pids(tmp_path, 2)
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + sig, err
    assert not any(_alive(p) for p in pids), err
    assert "stopped by the launcher" in err


@pytest.mark.timeout(60)
def test_a_rank_that_ignores_sigterm_is_killed_and_the_first_failure_decides_the_exit(tmp_path):
    # rank 0 fails with 3; rank 1 ignores the SIGTERM that follows and is SIGKILLed after
    # kill_after: the launcher returns, with rank 0's code (not the signal it sent itself).
    launcher = _launcher(tmp_path, "exit3,ignore-term", grace=0.2, kill_after=1.0)
    pids = _pids(tmp_path, 2)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 3, err
    assert "rank 0 failed first (exit code 3)" in err, err
    assert "rank 1 stopped by the launcher (killed by SIGKILL)" in err, err
    assert not any(_alive(p) for p in pids)


@pytest.mark.timeout(60)
def test_the_launcher_exits_with_the_first_failing_ranks_code(tmp_path):
    launcher = _launcher(tmp_path, "exit5,run,run", grace=0.2)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 5, err
    assert "rank 0 failed first (exit code 5)" in err and "rank 2 stopped" in err, err


@pytest.mark.timeout(120)
def test_the_killed_rank_is_named_not_the_survivor_that_failed_just_after(tmp_path):
    """Over shared memory a survivor fails ~10 ms after its peer is killed; the launcher once
    polled every 50 ms and named whichever it saw first in rank order. Now each rank's exit time
    is taken as it happens, and a death by signal comes first among failures that close."""
    for trial in range(5):
        where = tmp_path / str(trial)
        where.mkdir()
        launcher = _launcher(where, "follow1,kill9", grace=0.5)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 137, err
        assert "rank 1 failed first (killed by SIGKILL)" in err, err


SHM_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import coconet as cc
    from coconet import runtime
    comm = runtime.init(options=runtime.CommOptions(transport="shared memory", timeout=20.0))
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    p_new = (p - cc.all_reduce(g, name="g_sum")).named("p_new")
    step = cc.compile(cc.Program("sgd", [g, p], [cc.update(p, p_new)]), comm=comm,
                      fused_kernels=False)
    x, w = torch.ones(64), torch.zeros(64)
    step(g=x, p=w)
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # killed between two steps
    step(g=x, p=w)  # the survivor's RuntimeFault ends its script with exit code 1
    """
)


@pytest.mark.timeout(120)
def test_a_real_job_over_shared_memory_names_the_killed_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SHM_SCRIPT)
    for _ in range(2):
        out = _coconet("run", "--nproc", "2", str(script))
        assert out.returncode == 137, out.stderr
        assert "rank 1 failed first (killed by SIGKILL)" in out.stderr, out.stderr
