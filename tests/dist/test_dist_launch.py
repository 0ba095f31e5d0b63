"""Launching: ``coconet run --nproc 2``, torchrun with two agents (--nnodes 2) on localhost, and
``coconet show`` / ``coconet calibrate``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coconet.cache import keyed_cache_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent(
    """
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
    assert "rank 1 exited with code 3" in out.stderr


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
