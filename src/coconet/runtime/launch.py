"""Starting ranks and their process group: ``init`` in a rank, ``spawn``/``run_script`` to launch.

``init()`` reads the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so a script calling it runs unchanged under ``torchrun`` (one or many
nodes) and under ``coconet run --nproc N``, which sets the same variables for N local processes.
Without those variables it starts a world of one.

The backend is gloo on CPU, NCCL when every local rank has a GPU of its own. Workers should end
with ``shutdown()``: gloo sometimes aborts a process at interpreter exit after its process group
was destroyed, and ending with ``os._exit`` (what ``shutdown(exit_code=0)`` does) avoids it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from coconet import tracing
from coconet.errors import ConfigError, RuntimeFault
from coconet.ir.mesh import Mesh
from coconet.options import CommOptions
from coconet.runtime.allocator import keep_large_buffers_mapped, rank_environment
from coconet.runtime.comm import Communicator

__all__ = ["RankFailure", "current", "free_port", "init", "run_script", "shutdown", "spawn"]

# The communicator init() made in this process (like torch.distributed's default group).
_current: Communicator | None = None

_BACKENDS = (None, "gloo", "nccl")


def current() -> Communicator | None:
    """The communicator ``init()`` made in this process, if any."""
    return _current


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(
    mesh: Mesh | None = None,
    *,
    backend: str | None = None,
    timeout: float | None = None,
    options: CommOptions | None = None,
) -> Communicator:
    """Join the job's process group (torchrun's environment) and build the communicator.

    ``timeout`` (seconds) bounds every wait for a peer; it overrides ``options.timeout``. With
    ``options.keep_buffers_mapped`` (the default) it also tunes this process's glibc malloc to
    keep large freed buffers mapped (``coconet.runtime.allocator``): steps stop page-faulting
    their buffers, at the cost of keeping about one step's temporaries allocated.
    """
    global _current
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ConfigError(
            f"init takes a coconet.Mesh, got {mesh!r}",
            op="init",
            hint="init(coconet.Mesh(dp=2, tp=2)), or init() for a one-axis world",
        )
    if options is not None and not isinstance(options, CommOptions):
        raise ConfigError(
            f"options must be CommOptions, got {options!r}",
            op="init",
            hint="init(options=coconet.runtime.CommOptions(timeout=60.0))",
        )
    if backend not in _BACKENDS:
        raise ConfigError(
            f"unknown backend {backend!r}",
            op="init",
            hint="backend='gloo' (CPU) or 'nccl' (one GPU per rank); None chooses",
        )
    options = options or CommOptions()
    if timeout is not None:
        options = dataclasses.replace(options, timeout=timeout)  # CommOptions checks it
    if options.keep_buffers_mapped:
        keep_large_buffers_mapped()
    env = os.environ
    rank = int(env.get("RANK", "0"))
    world = int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    if backend is None:
        gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        backend = "nccl" if gpus else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if "MASTER_ADDR" not in env:
            if world != 1:
                raise ConfigError(
                    f"WORLD_SIZE={world} but MASTER_ADDR is not set",
                    op="init",
                    hint="launch with coconet run --nproc N or torchrun",
                )
            kwargs["init_method"] = f"tcp://127.0.0.1:{free_port()}"
        try:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=options.timeout),
                **kwargs,
            )
        except (RuntimeError, ValueError, OSError) as exc:  # DistStoreError, DistNetworkError
            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            raise RuntimeFault(
                f"rank {rank} of {world} could not join the job's process group",
                op="init",
                details=[
                    f"rendezvous: {env.get('MASTER_ADDR', '127.0.0.1')}:"
                    f"{env.get('MASTER_PORT', '(chosen)')}, timeout {options.timeout:g} s",
                    f"torch.distributed said: {first[:300]}",
                ],
                hint="a peer rank did not start or died before joining, or the rendezvous "
                "address is unreachable: look at the other ranks' output",
            ) from None
    tracing.start_from_environment()  # COCONET_TRACE=dir: every rank records its trace there
    _current = Communicator(mesh, options)
    return _current


def shutdown(comm: Communicator | None = None, *, exit_code: int | None = None) -> None:
    """Leave the job: a barrier (when the communicator is healthy), then destroy the process
    group. With ``exit_code``, end the process with it at once (``os._exit``), after flushing."""
    global _current
    comm = comm or _current
    try:
        if comm is not None and comm.broken is None:
            # Told first, so that a peer still waiting for a call this rank will not make fails
            # at once, naming the calls this rank made; then a barrier through the store alone,
            # which the departure does not trip (every rank that made the same calls meets
            # there)
            comm.depart()
            comm.control.store_barrier("shutdown", comm.options.timeout)
    except RuntimeFault:
        pass  # a peer is gone: there is nothing left to synchronize with
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        if comm is _current:
            _current = None
        tracing.stop_from_environment()
        if exit_code is not None:
            _release_multiprocessing_objects()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)


def _release_multiprocessing_objects() -> None:
    """Run the finalizers a normal interpreter exit would run (``os._exit`` skips them): they
    unlink the multiprocessing semaphores this process created (tqdm's lock, which Inductor's
    progress bar makes when tqdm is installed). Skipped, the launcher's resource tracker warns of
    leaked semaphores at its exit (and removes them then)."""
    try:
        from multiprocessing import util

        util._run_finalizers(0)  # exitpriority >= 0: semaphores, not the queues' joins
    except Exception:  # noqa: BLE001 - leaving anyway; the tracker cleans up after us
        pass


# -- launching local ranks ----------------------------------------------------------------------


def _rank_env(rank: int, nproc: int, port: int, base: dict[str, str] | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
    )
    # As torchrun: one thread per rank unless told otherwise, so ranks do not fight for cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def run_script(
    argv: Sequence[str],
    nproc: int,
    *,
    module: bool = False,
    grace: float = 5.0,
    kill_after: float = 10.0,
) -> int:
    """Run ``python argv...`` (or ``python -m``) as ``nproc`` local ranks; the job's exit code.

    As torchrun does:

    - when a rank fails, the others get ``grace`` seconds to notice (their collectives fail), then
      SIGTERM;
    - SIGTERM or SIGINT sent to the launcher is forwarded to every rank;
    - a rank still running ``kill_after`` seconds after it was sent a signal (one that handles
      SIGTERM to write a checkpoint and hangs) gets SIGKILL, so the launcher always returns;
    - the exit code is the first failing rank's (a rank killed by signal S counts as 128 + S, as
      in a shell), not that of ranks the launcher stopped itself; 128 + S when the launcher was
      sent S and every rank went quietly. Which rank failed first is printed.
    """
    port = free_port()
    cmd = [sys.executable, *(["-m"] if module else []), *argv]
    received: list[int] = []  # signals sent to the launcher, handled in the loop below

    def on_signal(signum, _frame):
        received.append(signum)

    handled = (signal.SIGTERM, signal.SIGINT)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in handled} if main_thread else {}
    procs: list[subprocess.Popen] = []
    try:
        procs = [  # glibc's tcache off (allocator.rank_environment)
            subprocess.Popen(cmd, env=rank_environment(_rank_env(r, nproc, port)))
            for r in range(nproc)
        ]
        return _supervise(procs, received, grace, kill_after)
    finally:
        for p in procs:  # only on an error of the launcher itself: _supervise waited for all
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(
    procs: list[subprocess.Popen], received: list[int], grace: float, kill_after: float
) -> int:
    """Wait for every rank, stopping them as ``run_script`` says; the job's exit code.

    Which rank failed first is decided by when each exited, taken by a thread per rank that
    waits for it (a poll every few ms would see a killed rank and the survivor that noticed
    it ~10 ms later over shared memory as one event), and among the ranks that failed within
    ``_SETTLE_S`` of the first, a death by signal comes first: a rank's own error exit may be
    its reaction to a peer's death, a signal never is."""
    codes: list[int | None] = [None] * len(procs)
    exited: dict[int, float] = {}  # rank -> when its waiter saw it exit
    for r, p in enumerate(procs):
        threading.Thread(
            target=_note_exit, args=(p, r, exited), name=f"coconet run: rank {r}", daemon=True
        ).start()
    signalled: dict[int, float] = {}  # rank -> when the launcher sent it a signal
    first: tuple[int, int] | None = None  # (rank, exit code) of the first rank that failed
    failed_at: float | None = None  # when the first failure exited
    stop_at: float | None = None  # when to stop the ranks still running after a failure
    forwarded = 0  # how many of the received signals were forwarded

    def send(sig: int) -> None:
        now = time.monotonic()
        for r, p in enumerate(procs):
            if codes[r] is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    continue
                signalled.setdefault(r, now)

    while any(c is None for c in codes):
        while forwarded < len(received):
            send(received[forwarded])
            forwarded += 1
        for r, p in enumerate(procs):
            if codes[r] is None and r in exited:
                codes[r] = p.returncode
        failures = {
            r: exited[r] for r, c in enumerate(codes) if c and r not in signalled and r in exited
        }
        if failures and failed_at is None:
            failed_at = min(failures.values())
            stop_at = time.monotonic() + grace
        if failed_at is not None and first is None and time.monotonic() >= failed_at + _SETTLE_S:
            first = _first_failure(failures, codes, failed_at)
        now = time.monotonic()
        if stop_at is not None and now >= stop_at:
            send(signal.SIGTERM)
            stop_at = None
        for r, since in signalled.items():
            if codes[r] is None and now - since >= kill_after:
                procs[r].kill()
        time.sleep(0.01)
    if first is None and failed_at is not None:  # every rank exited within the settle time
        failures = {r: exited[r] for r, c in enumerate(codes) if c and r not in signalled}
        first = _first_failure(failures, codes, failed_at)
    for r, c in enumerate(codes):
        if c and r in signalled:
            stopped = f"rank {r} stopped by the launcher ({_describe(c)})"
            print(f"coconet run: {stopped}", file=sys.stderr)
    if first is not None:
        rank, code = first
        print(
            f"coconet run: rank {rank} failed first ({_describe(code)}); the job exits with its "
            "code",
            file=sys.stderr,
        )
        return _exit_code(code)
    if received:
        return 128 + received[0]
    return 0


# Failures this close to the first are one event: among them, a death by signal is the cause.
_SETTLE_S = 0.25


def _first_failure(
    failures: dict[int, float], codes: list[int | None], failed_at: float
) -> tuple[int, int]:
    """(rank, exit code) of the failure that caused the others: among those that exited within
    ``_SETTLE_S`` of the first, a death by signal (a negative code), else the earliest."""
    early = [r for r, t in failures.items() if t <= failed_at + _SETTLE_S]
    rank = min(early, key=lambda r: (codes[r] > 0, failures[r]))
    return rank, codes[rank]


def _note_exit(p: subprocess.Popen, rank: int, exited: dict[int, float]) -> None:
    p.wait()
    exited[rank] = time.monotonic()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _exit_code(code: int) -> int:
    """A child's return code as a shell reports it: 128 + S for a death by signal S."""
    return 128 - code if code < 0 else code


def _send(queue, item) -> None:  # pragma: no cover - child
    # os._exit would kill the queue's feeder thread with the item still in it: flush first.
    queue.put(item)
    queue.close()
    queue.join_thread()


def _worker(rank, nproc, port, fn, args, mesh, options, queue):  # pragma: no cover - child
    os.environ.update(_rank_env(rank, nproc, port))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        comm = init(mesh, options=options)
        result = fn(comm, *args)
        _send(queue, (rank, True, result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        _send(queue, (rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        if _current is not None and _current.broken is None:
            # The peers may be inside a collective this rank will never join: a barrier now
            # would not line up with it. Leave without one; our exit closes the connections.
            _current.broken = f"rank {rank} raised {type(exc).__name__}"
        shutdown(exit_code=1)
    shutdown(exit_code=0)


# What spawn does when a rank fails: raise a RuntimeFault, or return a RankFailure for it.
_FAILURES = ("raise", "return")


@dataclass(frozen=True)
class RankFailure:
    """What ``spawn(..., failures="return")`` gives for a rank that raised or died."""

    rank: int
    exit_code: int | None
    error: str | None  # the exception and traceback, when the rank raised

    def __bool__(self) -> bool:
        return False


def spawn(
    fn: Callable[..., Any],
    nproc: int | Mesh,
    *args: Any,
    options: CommOptions | None = None,
    timeout: float = 300.0,
    failures: str = "raise",
) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``nproc`` local ranks (a Mesh: its size, with its axes); return
    each rank's result, in rank order.

    ``fn`` and its results must pickle (a module-level function). If a rank raises, dies or the
    whole run exceeds ``timeout`` seconds, the remaining ranks are stopped and a ``RuntimeFault``
    reports each rank's outcome; with ``failures="return"`` such ranks give a ``RankFailure``
    instead (what fault-injection tests want). This is the in-Python counterpart of
    ``coconet run``.
    """
    import multiprocessing as mp
    import queue as queue_mod

    mesh = nproc if isinstance(nproc, Mesh) else None
    if mesh is None and (not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1):
        raise ConfigError(
            f"spawn needs a positive number of ranks or a Mesh, got {nproc!r}",
            op="spawn",
            hint="spawn(fn, 2) runs fn on 2 local ranks; spawn(fn, Mesh(pp=2, tp=2)) on 4",
        )
    if failures not in _FAILURES:
        raise ConfigError(
            f"failures must be one of {list(_FAILURES)}, got {failures!r}",
            op="spawn",
            hint='failures="return" gives a RankFailure for each rank that failed',
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(
            f"timeout must be a positive number of seconds, got {timeout!r}",
            op="spawn",
            hint="spawn(fn, 2, timeout=300.0)",
        )
    if options is not None and not isinstance(options, CommOptions):
        raise ConfigError(
            f"options must be CommOptions, got {options!r}",
            op="spawn",
            hint="spawn(fn, 2, options=CommOptions(timeout=30))",
        )
    n = mesh.size if mesh is not None else nproc
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        # Not daemonic: a rank may start processes of its own (Inductor's compile workers,
        # data loaders). The finally below stops every rank whatever happens.
        ctx.Process(target=_worker, args=(r, n, port, fn, args, mesh, options, q))
        for r in range(n)
    ]
    # A spawned process reads GLIBC_TUNABLES when it starts, from this process's environment:
    # set while the ranks start (``allocator.rank_environment``), then put back.
    keep = options.keep_buffers_mapped if options is not None else True
    saved = os.environ.get("GLIBC_TUNABLES")
    try:
        if keep:
            os.environ["GLIBC_TUNABLES"] = rank_environment(os.environ)["GLIBC_TUNABLES"]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = saved
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < n and time.monotonic() < deadline:
            try:
                rank, ok, value = q.get(timeout=0.2)
                results[rank] = (ok, value)
            except queue_mod.Empty:
                if all(p.exitcode is not None for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        if r in results and results[r][0] and p.exitcode != 0:
            # It returned, then died on the way out (a C++ abort at exit is the usual suspect).
            results[r] = (False, f"returned a result, then exited with code {p.exitcode}")
    if len(results) == n and all(ok for ok, _ in results.values()):
        return [results[r][1] for r in range(n)]
    if failures == "return":
        return [
            results[r][1]
            if r in results and results[r][0]
            else RankFailure(r, p.exitcode, results[r][1] if r in results else None)
            for r, p in enumerate(procs)
        ]
    details = []
    for r, p in enumerate(procs):
        if r in results:
            ok, value = results[r]
            details.append(f"rank {r}: " + ("ok" if ok else f"raised {value}"))
        else:
            details.append(f"rank {r}: no result (exit code {p.exitcode})")
    raise RuntimeFault(f"spawned job of {n} ranks failed", op="spawn", details=details)
