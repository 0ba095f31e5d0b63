"""Several "hosts" on one machine, for tests of what crosses hosts (tests/dist/test_hosts.py).

A host is a process tree in its own network, UTS (hostname), PID and mount namespaces with a
private /dev/shm (a tmpfs of its own), so coconet's same-host evidence (hostname, boot id, PID
namespace: ``coconet.runtime.symmem.host_identity``) sees different hosts, and shared memory
works inside a host but cannot reach across. The hosts are wired to one bridge in a switch
namespace by a veth pair each (10.77.0.<i + 1>/24), optionally rate-shaped with ``tc tbf`` on
each host's side (egress; ``netem`` is not available here, so there is no added latency). Each
host runs a torchrun agent (``--nnodes`` = the hosts, static rendezvous at host 0), whose ranks
run ``host_main.py``: one function (of ``tests/support``, or of a module on ``path``) called
with the communicator.

What it does not model: separate kernels (the hosts share the boot id, the page cache and the
two cores: a 2 x 2 job oversubscribes the machine), latency, packet loss. Needs root and
iproute2; ``Hosts.unavailable()`` says why not otherwise (the tests skip with that reason).
Everything is removed on exit: the namespaces (and with them the links), every process in them
(PID 1 of a host's namespace is its torchrun agent: when it ends, the kernel ends the rest), the
private /dev/shm mounts.
"""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN = Path(__file__).with_name("host_main.py")
SUBNET = "10.77.0"
MASTER_PORT = 29511
GRACE = 10.0  # seconds a job may take to end after its ranks gave their results


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _kill(pid: str) -> None:
    try:
        os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
        pass


def _kill_all(ns: str) -> None:
    """Every process in network namespace ``ns``."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        _kill(pid)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class HostsFailed(RuntimeError):
    """A host's job failed or ran past its timeout: every host's log is in the message."""


class Hosts:
    """``n`` namespace hosts (a context manager); ``run`` starts a job of ``nproc`` ranks on
    each (or a count per host)."""

    def __init__(self, n: int = 2, *, rate: str | None = None) -> None:
        self.n = n
        self.rate = rate  # e.g. "1gbit": tc tbf on each host's link
        tag = str(os.getpid())  # (a stale run is recognised by its process: _remove_stale)
        self.names = [f"cch{tag}_{i}" for i in range(n)]
        self.switch = f"ccsw{tag}"
        self.links = [f"cc{tag}h{i}" for i in range(n)]  # the host's end (<= 15 characters)
        self._made: list[str] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why namespace hosts cannot be made here, or None."""
        if sys.platform != "linux":
            return "namespace hosts need Linux"
        if os.geteuid() != 0:
            return "namespace hosts need root (ip netns, unshare, private /dev/shm mounts)"
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                return f"namespace hosts need {tool!r} (iproute2, util-linux)"
        probe = f"ccprobe{os.getpid() % 100000}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"'ip netns add' failed: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def __enter__(self) -> Hosts:
        try:
            self._up()
        except BaseException:
            self._down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._down()

    @staticmethod
    def _remove_stale() -> None:
        """The namespaces of an earlier run that could not clean up (killed outright): named
        after a process that no longer exists."""
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            for prefix in ("cch", "ccsw"):
                tag = name[len(prefix):].split("_")[0]
                if name.startswith(prefix) and tag.isdigit() and not _exists(int(tag)):
                    _kill_all(name)
                    _ip("netns", "del", name, check=False)
                    break

    def _up(self) -> None:
        self._remove_stale()
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, link) in enumerate(zip(self.names, self.links, strict=True)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            port = f"{link}s"
            _ip("link", "add", link, "type", "veth", "peer", "name", port)
            _ip("link", "set", link, "netns", ns)
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate:
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root",
                     "tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"],
                    check=True, capture_output=True, text=True,
                )

    def _down(self) -> None:
        for ns in reversed(self._made):
            _kill_all(ns)
            _ip("netns", "del", ns, check=False)  # its links go with it
        self._made.clear()

    def run(self, fn: str, *args, nproc: int | tuple[int, ...] = 1, timeout: float = 240.0,
            env: dict[str, str] | None = None, dead: set[int] = frozenset(),
            path: tuple[str, ...] = ()) -> list:
        """``<module>.<function>(comm, *args)`` (``fn``: "support.host_workers:where"; the
        module importable from tests/ or from ``path``) on every rank of a job of ``nproc``
        ranks per host, or ``nproc[i]`` on host ``i`` (hosts holding different numbers of
        ranks: torchrun agents with their own ``--nproc-per-node``; host ``i``'s ranks follow
        host ``i - 1``'s, as torchrun numbers them); returns the ranks' results in rank order
        (the ranks in ``dead``, expected to die, give None). Raises ``HostsFailed`` with every
        host's log when another rank gives no result, raises (its traceback first), or the job
        runs past ``timeout``."""
        per_host = (nproc,) * self.n if isinstance(nproc, int) else tuple(nproc)
        if len(per_host) != self.n or min(per_host) < 1:
            raise ValueError(f"Hosts.run: nproc={nproc!r} for {self.n} hosts: one count >= 1 "
                             "for all, or one per host")
        work = Path(tempfile.mkdtemp(prefix="coconet-hosts-"))
        try:
            (work / "args.pkl").write_bytes(pickle.dumps(args))
            procs, logs = [], []
            for i, (ns, link) in enumerate(zip(self.names, self.links, strict=True)):
                log = open(work / f"host{i}.log", "w")  # noqa: SIM115 (closed below)
                logs.append(log)
                procs.append(subprocess.Popen(
                    self._command(i, ns, fn, work, per_host[i]), stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env(link, env, path), cwd=ROOT, start_new_session=True,
                ))
            late = self._wait(procs, work, sum(per_host), dead, timeout)
            if any(p.poll() is None for p in procs):
                self._down_jobs(procs)
            for log in logs:
                log.close()
            results = []
            for r in range(sum(per_host)):
                out = work / f"rank{r}.pkl"
                results.append(pickle.loads(out.read_bytes()) if out.exists() else None)
            raised = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
            if late or raised or any(r is None and i not in dead for i, r in enumerate(results)):
                text = "\n".join(
                    f"--- host {i} (exit {p.returncode}) ---\n"
                    + (work / f"host{i}.log").read_text()[-6000:]
                    for i, p in enumerate(procs)
                )
                why = "".join(f"rank {i} raised {type(r).__name__}: {r}\n"
                              + "".join(getattr(r, "__notes__", ())) for i, r in raised)
                if late:
                    why = f"ran past {timeout:.0f} s\n{why}"
                elif not raised:
                    why = "a rank gave no result"
                raise HostsFailed(f"{fn} on {self.n} hosts x {nproc}: {why}\n{text}")
            return results
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _wait(self, procs: list[subprocess.Popen], work: Path, ranks: int, dead: set[int],
              timeout: float) -> bool:
        """Wait for the jobs to end, or for every rank not in ``dead`` to have given its result
        and ``GRACE`` seconds more (the agents of a job that lost a host wait at torchrun's
        exit barrier for its 300 s); True when ``timeout`` ran out first."""
        deadline = time.monotonic() + timeout
        given_at = None
        expected = [work / f"rank{r}.pkl" for r in range(ranks) if r not in dead]
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                return True
            if given_at is None and all(f.exists() for f in expected):
                given_at = now
            if given_at is not None and now - given_at > GRACE:
                return False
            time.sleep(0.1)
        return False

    def _down_jobs(self, procs: list[subprocess.Popen]) -> None:
        for ns in self.names:
            _kill_all(ns)
        for p in procs:
            p.wait(timeout=30)

    def _command(self, i: int, ns: str, fn: str, work: Path, nproc: int) -> list[str]:
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.n}",
            f"--nproc-per-node={nproc}", f"--node-rank={i}", f"--master-addr={SUBNET}.1",
            f"--master-port={MASTER_PORT}", str(MAIN), fn, str(work),
        ]
        # in the host's namespaces: its hostname, a private /dev/shm, then the agent as PID 1
        inside = (f"hostname host{i} && mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "
                  + shlex.join(torchrun))
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "--pid", "--fork", "--mount",
                "--mount-proc", "sh", "-c", inside]

    @staticmethod
    def _env(link: str, extra: dict[str, str] | None, path: tuple[str, ...]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env["GLOO_SOCKET_IFNAME"] = link  # the host's own address (its hostname resolves nowhere)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "tests"), *path, *filter(None, [env.get("PYTHONPATH")])])
        env.update(extra or {})
        return env

