"""The shared-memory transport (the default for ranks on one host).

- every collective, in float32/bfloat16/float16, uneven sizes, on 2, 3 and 4 ranks (4 ranks on
  2 cores: waits must yield), is bitwise the op's group meaning (what the simulator computes:
  rank-ordered reductions, 16-bit floats accumulated in float32), inputs untouched;
- 1000 collectives with random per-rank delays: no torn or stale read;
- ranks that only pretend to share a host (``COCONET_HOST_ID``) route their cross-host groups to
  torch.distributed and keep shared memory within a host; forcing shared memory across hosts
  is a ConfigError; three pretend hosts of 1, 1 and 2 ranks go through leaders, in host order;
- nothing is ever left in /dev/shm, and no process keeps a segment mapped, after a normal exit,
  an exception, a SIGKILL of one rank and a SIGKILL of the whole job; two jobs on one host at
  once do not collide.

Every example x schedule runs over shared memory in test_dist_examples.py (the default
transport); dead and stalled peers on it are in test_dist_faults.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import host_workers, shm_workers

from coconet.runtime import CommOptions, RankFailure, spawn

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = CommOptions(timeout=30)
# Every process this test run starts inherits the tag (killed and orphaned ranks too), so a
# leak is told apart from another job's live segments on the same machine.
TAG = f"COCONET_TEST_RUN={os.getpid()}"
os.environ["COCONET_TEST_RUN"] = str(os.getpid())


def _segments_mapped() -> list[str]:
    """Processes of this test run that map a coconet segment (a memfd named coconet-symmem)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if TAG.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/maps") as f:
                if "coconet-symmem" in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


@pytest.fixture
def clean_host():
    """/dev/shm as it was, and no segment mapped, once the test's job is over."""
    before = set(os.listdir("/dev/shm"))
    yield
    # Killed ranks take a moment to be reaped: wait for them, then what is left is a leak.
    # multiprocessing's own semaphores (sem.mp-*) are not coconet's and may belong to another
    # process on the machine (a concurrent test run): they are left out here; .ci/run checks
    # that the whole suite leaves /dev/shm exactly as it found it, those included.
    def new_files() -> set[str]:
        return {f for f in set(os.listdir("/dev/shm")) - before if not f.startswith("sem.mp-")}

    deadline = time.time() + 10
    while time.time() < deadline and (_segments_mapped() or new_files()):
        time.sleep(0.1)
    assert new_files() == set()
    assert _segments_mapped() == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_collectives_equal_their_meaning(nproc, clean_host):
    dtypes = ["float32", "bfloat16", "float16"] if nproc != 4 else ["float32", "bfloat16"]
    sizes = (1, 7, 64, 100_003)  # 100_003 rows x 3: past the first segment, which grows
    results = spawn(
        shm_workers.collectives_vs_meaning, nproc, sizes, dtypes, options=OPTIONS, timeout=220
    )
    for rank, rows in enumerate(results):
        assert len(rows) == len(sizes) * len(dtypes) * 9
        bad = [
            r for r in rows if not (r["equal"] and r["input_untouched"] and r.get("in_place", 1))
        ]
        assert bad == [], f"rank {rank}: {bad[:5]}"


@pytest.mark.timeout(120)
def test_many_steps_with_random_delays(clean_host):
    results = spawn(shm_workers.stress, 2, 1200, 7, options=OPTIONS, timeout=100)
    for out in results:
        assert out["transport"].value == "shared memory"
        assert out["bad"] == []


@pytest.mark.timeout(200)
def test_groups_that_cross_hosts_use_torch_distributed(clean_host):
    results = spawn(shm_workers.split_hosts, 4, (4, 7), options=OPTIONS, timeout=180)
    for out in results:
        assert (out["world"], out["pp"], out["tp"]) == (
            "torch.distributed",
            "torch.distributed",
            "shared memory",
        )
        assert all(err == 0.0 for _, _, err in out["rows"]), out["rows"]
        assert "spans 2 hosts" in out["forced"]


@pytest.mark.timeout(120)
def test_three_pretend_hosts_of_different_sizes_go_through_leaders_in_host_order(clean_host):
    """Ranks pretending to be on hosts a, b, c, c: the world goes through one leader per host,
    the three leaders exchanging point to point (gloo's all_reduce is only for two); every
    collective case equals bitwise the sum over hosts of each host's sum
    (``hierarchy.reduce_order``) and rank order within rounding; nothing is left behind
    (tests/dist/test_hosts.py runs two leaders on namespace hosts)."""
    results = spawn(host_workers.pretend_hosts, 4, "abcc", options=OPTIONS, timeout=100)
    for out in results:
        assert out["transport"] == "hierarchical"
        assert out["plan"] == "through one leader per host"
        assert out["layout"] == [[0, 1, 2, 2], [0, 0, 0, 1]]
        assert len(out["cases"]) == 20
        for c in out["cases"]:
            assert c["all_reduce"] and c["reduce_scatter"] and c["all_gather"], c
            assert c["vs_rank_order"] <= (1e-6 if "float32" in c["case"] else 1e-2), c
        assert out["exact"] and out["exact_transport"] == "torch.distributed"


def _run_job(script: Path, nproc: int = 2) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "coconet.cli", "run", "--nproc", str(nproc), str(script)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: killable as a whole
    )


@pytest.mark.timeout(120)
def test_two_jobs_at_once_and_a_normal_exit(tmp_path, clean_host):
    jobs = []
    for tag in (1.0, 1000.0):
        script = tmp_path / f"job{int(tag)}.py"
        script.write_text(shm_workers.job_script(300, tag))
        jobs.append(_run_job(script))
    for job in jobs:
        out, _ = job.communicate(timeout=100)
        assert job.returncode == 0, out
        assert out.count("bad=0") == 2, out


@pytest.mark.timeout(120)
def test_a_job_killed_whole_leaves_nothing(tmp_path, clean_host):
    script = tmp_path / "long.py"
    script.write_text(shm_workers.job_script(10**7, 3.0))
    job = _run_job(script)
    deadline = time.time() + 60
    while not _segments_mapped() and time.time() < deadline:
        time.sleep(0.2)  # until the ranks have their segments
    assert _segments_mapped(), "the job never mapped its segments"
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)


@pytest.mark.timeout(90)
def test_an_exception_and_a_killed_rank_leave_nothing(clean_host):
    results = spawn(shm_workers.raise_after_one, 2, options=OPTIONS, timeout=60, failures="return")
    assert results[0] == "ok" and isinstance(results[1], RankFailure)
    t0 = time.time()
    results = spawn(
        shm_workers.killed_mid_collective, 2, options=OPTIONS, timeout=60, failures="return"
    )
    assert "RuntimeFault" in results[0] and "a peer rank died" in results[0], results[0]
    assert time.time() - t0 < 30
    assert isinstance(results[1], RankFailure) and results[1].exit_code == -9


@pytest.mark.timeout(120)
def test_a_gradient_in_symmetric_memory_is_read_in_place(clean_host):
    results = spawn(shm_workers.registered_gradient, 2, 1001, 40, options=OPTIONS, timeout=100)
    for out in results:
        for name, r in out.items():
            assert r["in_symmetric_memory"], name
            assert r["equal"], name


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nproc", [2, 3])
def test_symmetric_tensors_of_uneven_shapes(nproc, clean_host):
    """Every rank its own shape: no rank fails alone (the others were left in the next
    collective until the timeout), the gather equals its meaning, and only even ones are read
    in place."""
    for out in spawn(shm_workers.uneven_symmetric, nproc, options=OPTIONS, timeout=80):
        assert out == {"gathered": True, "reduced": True, "uneven_read_in_place": False,
                       "even_read_in_place": True}, out


@pytest.mark.timeout(90)
def test_a_swapping_commit_equals_a_copying_one(clean_host):
    for out in spawn(shm_workers.swap_commit, 2, 1001, options=OPTIONS, timeout=80):
        assert out["equal"]
        assert out["copy"] == {"same_object": True, "m_moved": False, "p_in_place": True}
        assert out["swap"] == {"same_object": True, "m_moved": True, "p_in_place": True}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_the_one_round_all_reduce_equals_its_meaning(nproc, clean_host):
    """Small all_reduces run in one round (and in C for the exact dtypes): every dtype and
    reduction, plain, donated, in symmetric memory, strided and 2-D, at the one-round limit and
    past it, and the agreement's words, bit for bit the simulator's rank-order reduction."""
    results = spawn(shm_workers.one_shot_vs_meaning, nproc, options=OPTIONS, timeout=220)
    for rank, rows in enumerate(results):
        bad = [
            r for r in rows if not (r["equal"] and r["input_untouched"] and r.get("in_place", 1))
        ]
        assert bad == [], f"rank {rank}: {bad[:5]}"
        assert len(rows) == len(shm_workers.ONE_SHOT_DTYPES) * 4 * 5 * 6 + 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_one_round_all_reduce_called_again_reuses_its_plan_correctly(nproc, clean_host):
    """The second call of a kind of one-round all_reduce skips deciding where its data lives
    (``ShmGroup.one_shot_plans``): with new data every call in every mode, after a registration
    and after the segment grew, every result is still the rank-order sum, a donated input
    receives it and any other result is a new tensor; a one-round limit lowered at run time is
    obeyed."""
    for rank, rows in enumerate(
        spawn(shm_workers.one_shot_repeated, nproc, options=OPTIONS, timeout=100)
    ):
        bad = [r for r in rows if not (r["equal"] and r["input_untouched"]
                                       and r.get("in_place", 1) and r.get("fresh", 1))]
        assert bad == [], f"rank {rank}: {bad[:5]}"
        assert len(rows) == 3 * 4 * 5 + 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("words", [False, True], ids=["tensor", "words"])
@pytest.mark.parametrize("how", ["abort", "kill", "stall"])
def test_a_failing_peer_in_a_one_round_all_reduce_is_reported(how, words, clean_host):
    """A peer that aborts, dies or stalls between two one-round all_reduces (the waits poll
    before they sleep): the other rank gets a RuntimeFault at once (abort, kill) or at the
    timeout (stall), never a hang."""
    options = CommOptions(timeout=3)
    results = spawn(
        shm_workers.one_shot_fault, 2, how, words, options=options, timeout=80, failures="return"
    )
    seen = results[0]
    assert isinstance(seen, str) and seen.startswith("RuntimeFault after "), seen
    took = float(seen.split()[2])
    expected = {"abort": "aborted its step", "kill": "died", "stall": "no answer within 3 s"}
    assert expected[how] in seen, seen
    assert took < (6.0 if how == "stall" else 1.0), seen
