"""Pipeline parallelism: train_gpt's GPT over 2 stages (PP=2), every contender in one process group.

The model is ``examples/train_gpt.py``'s GPT (default 4 layers, d_model 256, 4 heads, bytes as
a 256-symbol vocabulary, float32), cut as ``examples/train_gpt_pp.py`` cuts it: stage 0 = token
and position embeddings + the first half of the blocks, stage 1 = the other blocks + the final
LayerNorm + the head, the loss ``cross_entropy`` of the logits reshaped (-1, 256). 2 local ranks
x 1 torch thread (spawned with ``coconet.runtime.spawn``, gloo): the two ranks fill this
machine's two cores, so nothing else runs beside them and one rank's idle time (the bubble) is
not lent to anyone. A step is the forward + backward of the whole batch (``--batch`` 16
sequences of ``--seq`` 32 tokens) as ``--micro`` 8 micro-batches, the parameter gradients
accumulated over them (each micro-batch's mean loss / 8: the batch mean's gradient). **No
optimizer step** is timed: the step measures the pipeline, not AdamW.

Contenders, in alternation (A B C ... A B C ...) after a warm-up, an untimed ``zero_grad``
and a barrier before each timed step, the slowest rank's time of each step:

- ``one_process``: the whole model on the whole batch on rank 0, one thread (rank 1 idles):
  the reference every other contender is checked against, and the scaling baseline;
- ``coconet_1f1b`` / ``coconet_gpipe``: ``coconet.pipeline.Pipeline`` with ``schedule="1f1b"``
  / ``"gpipe"`` (the schedule proven by ``coconet.pipeline.check`` when it is built), on a
  communicator with the default transport: the two stages share this host, so activations and
  their gradients go over shared memory (``coconet.runtime.p2p``: a ring per direction; checked
  through ``Pipeline.links`` before anything is timed);
- ``coconet_1f1b_gloo`` / ``coconet_gpipe_gloo``: the same on a communicator forced to gloo
  (``CommOptions(transport="torch.distributed")``): the messages over torch.distributed's pair
  messages (``isend``/``irecv``, through the communicator), as every coconet row was before,
  side by side in the same run;
- ``torch_1f1b`` / ``torch_gpipe``: ``torch.distributed.pipelining``'s ``PipelineStage`` (the
  same stage modules, the micro-batch's input and output shapes declared, so torch runs in its
  STATIC mode with no shape inference at each step) with ``Schedule1F1B`` / ``ScheduleGPipe``
  (``loss_fn`` the same cross-entropy, ``scale_grads=True``, ``return_outputs=False``) on
  the same gloo group. Both schedules run on gloo / CPU in torch 2.13 (a step's mixed sends
  and receives go through ``batch_isend_irecv``); the declared example tensors must carry
  ``requires_grad=True``, else torch's STATIC mode never receives stage 0's output gradient
  ("grad can be implicitly created only for scalar outputs").

Correctness, before anything is timed and again after the timed steps: every contender's loss
(on the last stage) and the gradient of every parameter of both stages (each rank its stage's)
against one process on the same weights and batch: max |diff| / max |reference| <= 1e-5 per
tensor (float32; the micro-batches' sums re-associate the batch's). A contender that disagrees
or raises is reported FAILED and not timed; the exit status is then 1.

Memory, per rank, in one extra untimed step of each contender: the peak bytes autograd holds
saved for backward, counted with ``torch.autograd.graph.saved_tensors_hooks`` (each distinct
tensor storage counted once while any graph node holds it; the parameters' own storages
excluded): the activation memory the schedule keeps alive, not the process's RSS (the
parameters, their gradients, the received/sent boundary buffers and allocator slack are not in
it). For coconet the schedule's own count (``peak_activations``: micro-batches whose forward ran
and whose backward has not) is printed next to it.

Messages (a probe after the timed steps): one message of the boundary's activation size (one
micro-batch's ``(batch / micro, seq, d_model)`` float32) each way between the two ranks, rank 0
to rank 1 and back (the activation forward, its gradient back), ``MESSAGE_ROUNDS`` round trips
over each transport, in blocks of ``MESSAGE_BLOCK`` back to back (a barrier before each block,
not each round trip: a barrier's exit skew between the ranks would be timed too), the
transports' blocks in alternation after a warm-up block, each as the pipeline sends its
messages: through its communicator's point-to-point channels (``comm.p2p``: ``send_start`` /
``recv_start`` / ``wait``, under the communicator's fault guard), over shared memory (its ring
of ``--micro`` slots each way) and over gloo (torch.distributed's ``isend`` / ``irecv``, on the
communicator forced to gloo); the median over rank 0's blocks of a block's time per round trip.

Lower bound (the bubble-aware bound): a probe in the same alternation runs each rank's stage
alone on the ``--micro`` micro-batches (forward + backward, no communication, a random output
gradient on stage 0), both ranks at once as in the pipeline; t_mb = the slower stage's median /
m; a pipeline of p stages over m micro-batches cannot finish before (m + p - 1) x t_mb (p - 1
micro-batch slots of fill and drain). Communication is counted as free.

``--json`` writes every step time, the medians, the memory and a ``targets`` list (issue 21's
targets, each measured as a ratio of this run's medians or peaks, its threshold, met);
``--plot`` a PNG (matplotlib).

    python benchmarks/pipeline_parallel.py --json benchmarks/results/pipeline_parallel.json \\
        --plot benchmarks/results/pipeline_parallel.png \\
        | tee benchmarks/results/pipeline_parallel.txt
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpt  # noqa: E402 - the model, the data
import train_gpt_pp  # noqa: E402 - the stage split, the loss
from data_parallel_adam import agree_failed, emit, loadavg, machine, pyplot  # noqa: E402

ONE = "one_process"
CONTENDERS = (ONE, "coconet_1f1b", "coconet_gpipe", "coconet_1f1b_gloo", "coconet_gpipe_gloo",
              "torch_1f1b", "torch_gpipe")  # fmt: skip
GLOO = "torch.distributed"
SHM = "shared memory"
MESSAGE_ROUNDS = 300  # round trips of the message probe, per transport
MESSAGE_BLOCK = 25  # ... timed in blocks of this many back to back (a barrier before each block)
PROBE = "probe:stage_alone"  # both ranks at once, each its stage: the bound's t_mb
SOLO = "probe:stage_solo"  # one rank's stage, the other rank idle: what the two cores cost
RTOL = 1e-5  # max |diff| / max |reference|, float32
STAGES = 2


# -- memory: bytes saved for backward ---------------------------------------------------------


class _Held:
    """What a graph node keeps instead of a saved tensor while the meter runs."""

    __slots__ = ("meter", "key", "t")

    def __init__(self, meter: SavedBytes, key: int, t: torch.Tensor) -> None:
        self.meter, self.key, self.t = meter, key, t

    def __del__(self) -> None:
        self.meter.release(self.key)


class SavedBytes:
    """The live and peak bytes of the distinct storages autograd saves for backward (storages
    in ``exclude``, the parameters', not counted), under ``saved_tensors_hooks``."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, list[int]] = {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        key, n = st.data_ptr(), st.nbytes()
        if key in self.exclude or n == 0:
            return t
        e = self.refs.get(key)
        if e is None:
            self.refs[key] = [1, n]
            self.live += n
            self.peak = max(self.peak, self.live)
        else:
            e[0] += 1
        return _Held(self, key, t)

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def release(self, key: int) -> None:
        e = self.refs[key]
        e[0] -= 1
        if e[0] == 0:
            self.live -= e[1]
            del self.refs[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


# -- the contenders ----------------------------------------------------------------------------


class Contender:
    """One way to run the step. ``step()`` runs it on this rank (the loss on the last stage, else
    None); ``grads()`` this rank's parameter gradients by the whole model's parameter names;
    ``net`` the model copy whose parameters it trains."""

    def __init__(self, name: str, net: nn.Module, params: nn.Module, step: Callable,
                 here: bool = True, schedule_peak: int | None = None) -> None:  # fmt: skip
        self.name, self.net, self.params, self._step, self.here = name, net, params, step, here
        self.schedule_peak = schedule_peak
        self.transport: str | None = None  # what carries a coconet row's stage messages
        ids = {id(p) for p in params.parameters()}
        self.names = [n for n, p in net.named_parameters() if id(p) in ids]

    def zero(self) -> None:
        self.net.zero_grad(set_to_none=True)

    def step(self) -> torch.Tensor | None:
        return self._step() if self.here else None

    def grads(self) -> dict[str, torch.Tensor | None]:
        ps = dict(self.net.named_parameters())
        return {n: ps[n].grad for n in self.names}

    def param_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.net.parameters()}


def one_process(cfg: train_gpt.Config, rank: int, x, y) -> Contender:
    net = train_gpt.model(cfg)
    return Contender(ONE, net, net, lambda: _whole(net, x, y), here=rank == 0)


def _whole(net, x, y) -> torch.Tensor:
    loss = train_gpt.loss_of(net, x, y)
    loss.backward()
    return loss.detach()


def coconet_pipeline(cfg, comm, schedule: str, micro: int, x, y, name: str) -> Contender:
    """``Pipeline`` over ``comm``; its messages must go over the transport ``comm`` was made to
    give them (shared memory by default, gloo for a ``_gloo`` row), else it is not this row."""
    from coconet.pipeline import Pipeline, peak_activations

    net = train_gpt.model(cfg)
    stage = train_gpt_pp.stage_of(net, comm.rank, STAGES)
    pipe = Pipeline(stage, comm, micro_batches=micro, schedule=schedule, axis=None,
                    activation_shape=(cfg.batch // micro, cfg.seq, cfg.d_model),
                    loss_fn=train_gpt_pp.loss_fn)  # fmt: skip
    want = GLOO if name.endswith("_gloo") else SHM
    got = {link.transport.value for link in pipe.links.values()}
    if got != {want}:
        raise RuntimeError(f"{name}: the stage messages go over {sorted(got)}, not {want}: "
                           f"{pipe.links}")  # fmt: skip
    xs, ys = (x if pipe.is_first else None), (y if pipe.is_last else None)
    c = Contender(name, net, stage, lambda: pipe.step(xs, ys),
                  schedule_peak=peak_activations(pipe.steps))  # fmt: skip
    c.transport = want
    return c


def message_probe(comms: dict, cfg, micro: int) -> dict[str, list[float]]:
    """Round trips of one activation-sized message each way (see the module docstring), per
    transport, in alternation; this rank's times in seconds."""
    comm = comms[SHM]
    rank, peer = comm.rank, 1 - comm.rank
    shape = (cfg.batch // micro, cfg.seq, cfg.d_model)
    out_t, in_t = torch.randn(shape), torch.empty(shape)
    nbytes = out_t.numel() * out_t.element_size()
    # what a pipeline of ``micro`` micro-batches sets up: a ring of ``micro`` slots each way
    # over shared memory, the same channels over gloo on the communicator forced to it
    channels = {(0, 1): (micro, nbytes), (1, 0): (micro, nbytes)}
    links = {name: comms[name].p2p(None, channels, identity="message probe", op="message probe")
             for name in (SHM, GLOO)}  # fmt: skip
    for name, p2p in links.items():
        got = {link.transport.value for link in p2p.links.values()}
        if got != {name}:
            raise RuntimeError(f"the message probe's {name} channels run on {got}: "
                               f"{p2p.links}")  # fmt: skip

    def round_trip(p2p) -> Callable[[], None]:
        def one() -> None:
            if rank == 0:
                p2p.wait(p2p.send_start(out_t, peer, words=(1, 0), label="probe"))
                p2p.wait(p2p.recv_start(in_t, peer, words=(2, 0), label="probe"))
            else:
                p2p.wait(p2p.recv_start(in_t, peer, words=(1, 0), label="probe"))
                p2p.wait(p2p.send_start(out_t, peer, words=(2, 0), label="probe"))

        return one

    shm_round, gloo_round = round_trip(links[SHM]), round_trip(links[GLOO])
    rounds = {SHM: shm_round, GLOO: gloo_round}
    times: dict[str, list[float]] = {k: [] for k in rounds}
    for b in range(1 + MESSAGE_ROUNDS // MESSAGE_BLOCK):  # the first block warms up
        for name, fn in rounds.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(MESSAGE_BLOCK):
                fn()
            dt = (time.perf_counter() - t0) / MESSAGE_BLOCK
            if b:
                times[name].append(dt)
    for p2p in links.values():
        p2p.close()
    return times


def torch_pipeline(cfg, rank: int, schedule: str, micro: int, x, y) -> Contender:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    net = train_gpt.model(cfg)
    stage = train_gpt_pp.stage_of(net, rank, STAGES)
    mb = cfg.batch // micro
    # the example tensors' requires_grad is what torch records: activations and outputs need it
    act = torch.empty(mb, cfg.seq, cfg.d_model, requires_grad=True)
    inp = x[:mb] if rank == 0 else act
    out = act if rank < STAGES - 1 else torch.empty(mb * cfg.seq, 256, requires_grad=True)
    pstage = PipelineStage(stage, rank, STAGES, torch.device("cpu"), input_args=(inp,),
                           output_args=(out,))  # fmt: skip
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = kind(pstage, n_microbatches=micro, loss_fn=train_gpt_pp.loss_fn, scale_grads=True)

    def step():
        if rank == 0:
            sched.step(x, return_outputs=False)
            return None
        losses: list[torch.Tensor] = []
        sched.step(target=y, losses=losses, return_outputs=False)
        return torch.stack([v.detach() for v in losses]).mean()

    return Contender(f"torch_{schedule}", net, stage, step)


def stage_probe(cfg, rank: int, micro: int, x, y) -> Callable[[], None]:
    """This rank's stage alone on the micro-batches: forward + backward, no communication."""
    net = train_gpt.model(cfg)
    stage = train_gpt_pp.stage_of(net, rank, STAGES)
    mb = cfg.batch // micro
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    xs, ys = list(x.chunk(micro)), list(y.chunk(micro))
    acts = [torch.randn(mb, cfg.seq, cfg.d_model, generator=gen) for _ in range(micro)]
    dout = torch.randn(mb, cfg.seq, cfg.d_model, generator=gen)

    def run():
        net.zero_grad(set_to_none=True)
        for i in range(micro):
            if rank == 0:
                stage(xs[i]).backward(dout)
            else:
                a = acts[i].requires_grad_()
                (train_gpt_pp.loss_fn(stage(a), ys[i]) / micro).backward()
                a.grad = None

    return run


# -- the ranks ---------------------------------------------------------------------------------


def worker(comm, cfg: train_gpt.Config, opts: dict) -> dict:
    torch.set_num_threads(1)
    rank = comm.rank
    # the default transport (shared memory: both ranks on this host), and the same ranks forced
    # to gloo for the _gloo rows; torch's contenders use the default process group directly
    comms = {SHM: comm, GLOO: comm.variant(replace(comm.options, transport=GLOO))}
    say = (lambda *a: print("  [rank 0]", *a, file=sys.stderr, flush=True)) if rank == 0 else None
    micro = opts["micro"]
    x, y = train_gpt.batch(train_gpt.corpus(), cfg, 0)
    wanted = opts["contenders"]
    failed: dict[str, str] = {}
    found: dict[str, Contender] = {}

    # the reference: one process on the whole model and batch (every rank, untimed)
    ref_net = train_gpt.model(cfg)
    ref_loss = _whole(ref_net, x, y)
    ref_grads = {n: p.grad.clone() for n, p in ref_net.named_parameters()}
    del ref_net

    makers = {
        ONE: lambda: one_process(cfg, rank, x, y),
        **{f"coconet_{sched}{tail}": (lambda sched=sched, tail=tail: coconet_pipeline(
            cfg, comms[GLOO if tail else SHM], sched, micro, x, y, f"coconet_{sched}{tail}"))
           for sched in ("1f1b", "gpipe") for tail in ("", "_gloo")},
        "torch_1f1b": lambda: torch_pipeline(cfg, rank, "1f1b", micro, x, y),
        "torch_gpipe": lambda: torch_pipeline(cfg, rank, "gpipe", micro, x, y),
    }
    for name in wanted:
        try:
            found[name] = makers[name]()
        except Exception as exc:  # noqa: BLE001 - reported, the contender left out
            failed[name] = f"setup raised {type(exc).__name__}: {exc}"
            if say:
                say(f"{name}: {traceback.format_exc()}")
    agree_failed(failed, list(wanted))
    for name in failed:
        found.pop(name, None)

    def check(c: Contender) -> dict[str, float]:
        """This rank's errors of one step of ``c`` (one_process on rank 1: run there too,
        untimed, so both ranks check it)."""
        c.zero()
        loss = c._step()
        errs = {f"d_{n}": rel_err(g, ref_grads[n]) for n, g in c.grads().items()}
        if loss is not None and (c.name == ONE or rank == STAGES - 1):
            errs["loss"] = rel_err(loss, ref_loss)
        errs["max"] = max(errs.values())
        return errs

    errors: dict[str, dict] = {}
    worst: dict[str, float] = {}

    def check_all(when: str) -> None:
        for name, c in list(found.items()):
            dist.barrier()
            try:
                errors.setdefault(name, {})[when] = check(c)
                err = errors[name][when]["max"]
            except Exception as exc:  # noqa: BLE001 - reported, the contender not timed
                failed[name] = f"{when}: raised {type(exc).__name__}: {exc}"
                err = math.inf
                if say:
                    say(f"{name} ({when}): {traceback.format_exc()}")
            t = torch.tensor([err], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            worst[name] = max(worst.get(name, 0.0), t.item())
            if name not in failed and not t.item() <= RTOL:
                failed[name] = f"{when}: wrong result: max rel err {t.item():.2e} > {RTOL:g}"
        agree_failed(failed, list(found))
        for name in failed:
            found.pop(name, None)

    if say:
        say(f"contenders: {', '.join(found)}; checking against one process")
    check_all("first call")

    # memory: one untimed step of each, under the saved-tensor meter
    memory: dict[str, int] = {}
    for name, c in found.items():
        c.zero()
        meter = SavedBytes(c.param_storages())
        dist.barrier()
        with meter.hooks():
            c.step()
        memory[name] = meter.peak

    probe = stage_probe(cfg, rank, micro, x, y)
    timed = [(n, c.zero, c.step) for n, c in found.items()]
    # each stage alone with the other rank idle (the slowest rank's time: that stage's)
    for r in range(comm.world):
        timed.append((f"{SOLO}[{r}]", lambda: None, probe if r == rank else lambda: None))
    timed.append((PROBE, lambda: None, probe))
    n_steps, warm = opts["steps"], opts["warmup"]
    times = torch.zeros(len(timed), n_steps, dtype=torch.float64)
    if say:
        say(f"{warm} warm-up rounds, then {n_steps} timed rounds of {len(timed)} (incl. probe)")
    for r in range(warm + n_steps):
        for i, (_name, prepare, step) in enumerate(timed):
            prepare()
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if r >= warm:
                times[i, r - warm] = dt
    probe_t = torch.zeros(comm.world, n_steps, dtype=torch.float64)
    probe_t[rank] = times[-1]
    dist.all_reduce(probe_t)  # each rank's own probe times, side by side
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank, step by step

    check_all("after the timed steps")
    if say:
        say(f"message probe: {MESSAGE_ROUNDS} round trips per transport")
    try:
        message_s = message_probe(comms, cfg, micro)
    except Exception:  # noqa: BLE001 - reported; the pipeline rows stand without it
        message_s = {}
        if say:
            say(f"message probe: {traceback.format_exc()}")
    mem = torch.zeros(comm.world, len(CONTENDERS), dtype=torch.float64)
    for name, v in memory.items():
        mem[rank, CONTENDERS.index(name)] = v
    dist.all_reduce(mem)
    return {
        "times_s": {n: times[i].tolist() for i, (n, _, _) in enumerate(timed)
                    if not n.startswith("probe:") and n not in failed},
        "solo_s": [times[i].tolist() for i, (n, _, _) in enumerate(timed) if n.startswith(SOLO)],
        "probe_s": probe_t.tolist(),
        "errors": errors,
        "max_rel_err": worst,
        "failed": failed,
        "saved_bytes": {n: [int(mem[r, CONTENDERS.index(n)]) for r in range(comm.world)]
                        for n in memory if n not in failed},
        "schedule_peak": {n: c.schedule_peak for n, c in found.items()
                          if c.schedule_peak is not None},
        "transport": {n: c.transport for n, c in found.items() if c.transport is not None},
        "message_s": message_s,
        "threads": torch.get_num_threads(),
    }  # fmt: skip


def rel_err(a: torch.Tensor | None, ref: torch.Tensor) -> float:
    if a is None or tuple(a.shape) != tuple(ref.shape):
        return math.inf
    den = ref.double().abs().max().item()
    return (a.detach().double() - ref.double()).abs().max().item() / (den or 1.0)


# -- the report --------------------------------------------------------------------------------


def summarize(res: list[dict], opts: dict) -> dict:
    r0 = res[0]
    m, p = opts["micro"], STAGES
    rows: dict[str, dict] = {}
    for name, ts in r0["times_s"].items():
        ms = [v * 1e3 for v in ts]
        rows[name] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
                      "max_rel_err": r0["max_rel_err"].get(name),
                      "saved_bytes_per_rank": r0["saved_bytes"].get(name),
                      "schedule_peak_micro_batches": [o["schedule_peak"].get(name) for o in res]
                      if name in r0["schedule_peak"] else None,
                      "stage_messages": r0["transport"].get(name)}  # fmt: skip
    stage_ms = [statistics.median(ts) * 1e3 for ts in r0["probe_s"]]
    solo_ms = [statistics.median(ts) * 1e3 for ts in r0["solo_s"]]
    t_mb = max(stage_ms) / m
    bound = (m + p - 1) * t_mb
    # rounds where both stages at once ran well behind each alone in the same round: the two
    # ranks slowing each other, or a third process on the cores
    alone = [max(a, b) for a, b in zip(*r0["probe_s"], strict=True)]
    solo = [max(a, b) for a, b in zip(*r0["solo_s"], strict=True)]
    slow = sum(1 for a, b in zip(alone, solo, strict=True) if a > 1.25 * b)
    t1 = rows.get(ONE, {}).get("median_ms")
    for name, row in rows.items():
        row["x_bound"] = row["median_ms"] / bound if name != ONE else None  # a pipeline's bound
        if t1:
            row["speedup_vs_one_process"] = t1 / row["median_ms"]
    messages = {name: {"round_trip_median_us": statistics.median(ts) * 1e6,
                       "round_trip_min_us": min(ts) * 1e6, "blocks": len(ts),
                       "rounds": len(ts) * MESSAGE_BLOCK}
                for name, ts in r0["message_s"].items()}  # fmt: skip
    return {
        "rows": rows,
        "messages": messages,
        "bound": {"ms": bound, "per_micro_batch_ms": t_mb, "stage_alone_median_ms": stage_ms,
                  "stage_solo_median_ms": solo_ms,
                  "solo_bound_ms": (m + p - 1) * max(solo_ms) / m,
                  "rounds_concurrent_over_1.25x_solo": slow, "rounds": len(alone),
                  "formula": f"(m + p - 1) x t_mb = ({m} + {p} - 1) x {t_mb:.3f} ms"},
    }  # fmt: skip


def targets(s: dict) -> list[dict]:
    """Issue 21's targets, from this run's medians and peaks; a target whose contenders did not
    run (or failed) gives an entry with measured None, met False."""
    rows = s["rows"]
    out = []

    def med(n):
        return rows[n]["median_ms"] if n in rows else None


    def add(name, ratio, a, b, op, threshold):
        measured = a / b if a and b else None
        met = measured is not None and (measured >= threshold if op == ">=" else
                                        measured <= threshold)  # fmt: skip
        out.append({"name": name, "ratio": ratio, "measured": measured, "op": op,
                    "threshold": threshold, "met": met})  # fmt: skip

    add("1F1B: speedup over torch.distributed.pipelining", "torch_1f1b / coconet_1f1b",
        med("torch_1f1b"), med("coconet_1f1b"), ">=", 1.2)
    add("GPipe: speedup over torch.distributed.pipelining", "torch_gpipe / coconet_gpipe",
        med("torch_gpipe"), med("coconet_gpipe"), ">=", 1.2)
    add("1F1B: within the bubble-aware bound", "coconet_1f1b / bound", med("coconet_1f1b"),
        s["bound"]["ms"], "<=", 1.15)
    # the worst rank's ratio: max over ranks of coconet_1f1b's peak / coconet_gpipe's there
    a, b = (rows.get(n, {}).get("saved_bytes_per_rank") for n in ("coconet_1f1b", "coconet_gpipe"))
    worst = max(x / y for x, y in zip(a, b, strict=True)) if a and b and all(b) else None
    add("1F1B's peak activation memory vs GPipe's", "saved bytes 1f1b / gpipe, worst rank",
        worst, 1.0, "<=", 0.5)
    return out


def table(doc: dict) -> str:
    cfg, o, mch, s = doc["config"], doc["options"], doc["machine"], doc["summary"]
    lines = [
        f"pipeline_parallel: train_gpt's GPT ({cfg['layers']} layers, d_model {cfg['d_model']}, "
        f"{cfg['heads']} heads, {doc['parameters']:,} parameters, float32), PP={STAGES}, "
        f"{STAGES} ranks x {doc['threads']} thread; batch {cfg['batch']} x {cfg['seq']} tokens "
        f"as {o['micro']} micro-batches; a step = forward + backward, no optimizer step",
        f"machine: {mch['cpus']} cpus ({mch['cpu_model']}), torch {mch['torch']}, load average "
        f"{mch['loadavg_before']} before / {mch['loadavg_after']} after; coconet source digest "
        f"{mch['coconet_source_digest']}",
        f"timed: {o['steps']} steps after {o['warmup']} warm-up rounds and the check, in "
        "alternation, a barrier before each, slowest rank",
    ]
    for name, why in doc["failed"].items():
        lines.append(f"FAILED {name}, not timed: {why}")
    lines += ["", f"{'contender':<19} {'messages':<8} {'median ms':>10} {'min':>8} {'max':>8} "
              f"{'1proc/this':>10} {'x bound':>8} {'saved MiB r0':>12} {'r1':>6} "
              f"{'sched peak':>10} {'max rel err':>11}"]  # fmt: skip
    for name, r in s["rows"].items():
        sp = f"{r['speedup_vs_one_process']:.2f}x" if "speedup_vs_one_process" in r else ""
        mem = r["saved_bytes_per_rank"] or [0, 0]
        xb = f"{r['x_bound']:.2f}x" if r["x_bound"] is not None else ""
        pk = "/".join(str(v) for v in r["schedule_peak_micro_batches"]) \
            if r["schedule_peak_micro_batches"] else ""  # fmt: skip
        via = {SHM: "shm", GLOO: "gloo", None: "gloo" if name.startswith("torch") else ""}[
            r.get("stage_messages")]
        lines.append(f"{name:<19} {via:<8} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} "
                     f"{r['max_ms']:>8.2f} {sp:>10} {xb:>8} {mem[0] / 2**20:>12.2f} "
                     f"{mem[1] / 2**20:>6.2f} {pk:>10} {r['max_rel_err']:>11.1e}")  # fmt: skip
    rows = s["rows"]
    for sched in ("1f1b", "gpipe"):
        a, b = rows.get(f"coconet_{sched}"), rows.get(f"coconet_{sched}_gloo")
        if a and b:
            lines.append(f"coconet {sched}: stage messages over shared memory "
                         f"{a['median_ms']:.2f} ms vs gloo {b['median_ms']:.2f} ms "
                         f"({b['median_ms'] / a['median_ms']:.3f}x)")  # fmt: skip
    b = s["bound"]
    contention = [a / c for a, c in zip(b["stage_alone_median_ms"], b["stage_solo_median_ms"],
                                        strict=True)]  # fmt: skip
    lines += [
        f"bubble-aware bound {b['ms']:.2f} ms = {b['formula']}; t_mb = the slower stage alone "
        f"(stage medians {ms_list(b['stage_alone_median_ms'])} ms for "
        f"{o['micro']} micro-batches, both ranks at once) / {o['micro']}",
        f"each stage solo, the other rank idle: {ms_list(b['stage_solo_median_ms'])} ms (both at "
        f"once / solo: {ms_list(contention, 'x')}: what two busy ranks cost each other on the "
        f"two cores); the bound from the solo times would be {b['solo_bound_ms']:.2f} ms; in "
        f"{b['rounds_concurrent_over_1.25x_solo']} of {b['rounds']} rounds both at once took "
        "> 1.25x the slower solo stage of the same round",
        *message_lines(s.get("messages", {}), o["micro"], cfg),
        "saved MiB = peak bytes autograd holds saved for backward during one step, per rank "
        "(distinct storages, parameters excluded; one_process: all on rank 0); sched peak = "
        "coconet's schedule count of micro-batches held (rank 0/rank 1)",
        f"correct = loss and every parameter gradient of both stages within max|diff|/max|ref| "
        f"<= {RTOL:g} of one process, at the first call and after the timed steps",
        "",
        "targets (ratios of this run's medians / peaks):",
    ]
    for t in doc["targets"]:
        m = f"{t['measured']:.3f}" if t["measured"] is not None else "n/a"
        lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['name']:<50} {t['ratio']:<28} "
                     f"{m:>7} {t['op']} {t['threshold']}")  # fmt: skip
    if doc["failed"]:
        lines += ["", "!" * 78, f"!!! FAILED: {', '.join(sorted(doc['failed']))} (see above)",
                  "!" * 78]  # fmt: skip
    return "\n".join(lines)


def message_lines(messages: dict, micro: int, cfg: dict) -> list[str]:
    """The message probe's line: one activation-sized message each way, per transport."""
    if not messages:
        return ["message probe: not run (see the log)"]
    kib = cfg["batch"] // micro * cfg["seq"] * cfg["d_model"] * 4 / 1024
    parts = [f"{name} {m['round_trip_median_us']:.1f} us (best block "
             f"{m['round_trip_min_us']:.1f})" for name, m in messages.items()]  # fmt: skip
    shm, gloo = messages.get(SHM), messages.get(GLOO)
    ratio = ""
    if shm and gloo:
        times = gloo["round_trip_median_us"] / shm["round_trip_median_us"]
        ratio = f"; gloo / shared memory {times:.1f}x"
    first = next(iter(messages.values()))
    return [f"message probe, one {kib:g} KiB float32 message each way (rank 0 -> 1 -> 0), "
            f"{first['rounds']} round trips per transport in blocks of {MESSAGE_BLOCK}, median "
            f"block's time per round trip: {', '.join(parts)}{ratio}"]  # fmt: skip


def ms_list(vs: list[float], unit: str = "") -> str:
    return ", ".join(f"{v:.2f}{unit}" for v in vs)


def plot(doc: dict, path: str) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    s = doc["summary"]
    rows = s["rows"]
    names = list(rows)
    colors = {ONE: "tab:gray", "coconet_1f1b": "tab:blue", "coconet_gpipe": "tab:cyan",
              "coconet_1f1b_gloo": "tab:purple", "coconet_gpipe_gloo": "tab:pink",
              "torch_1f1b": "tab:orange", "torch_gpipe": "tab:red"}  # fmt: skip
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    med = [rows[n]["median_ms"] for n in names]
    err = [[rows[n]["median_ms"] - rows[n]["min_ms"] for n in names],
           [rows[n]["max_ms"] - rows[n]["median_ms"] for n in names]]  # fmt: skip
    a1.bar(range(len(names)), med, yerr=err, capsize=3, color=[colors[n] for n in names])
    a1.axhline(s["bound"]["ms"], color="k", linestyle="--", label="bubble-aware bound")
    a1.set_xticks(range(len(names)), names, rotation=30, ha="right")
    a1.set_ylabel("ms per step (median, min-max bars, slowest rank)")
    a1.set_title("forward + backward of the batch")
    a1.legend(fontsize=8)
    w = 0.4
    for r in range(STAGES):
        a2.bar([i + (r - 0.5) * w for i in range(len(names))],
               [rows[n]["saved_bytes_per_rank"][r] / 2**20 for n in names], w,
               label=f"rank {r}", color=["tab:green", "tab:olive"][r])  # fmt: skip
    a2.set_xticks(range(len(names)), names, rotation=30, ha="right")
    a2.set_ylabel("MiB saved for backward (peak)")
    a2.set_title("activation memory per rank")
    a2.legend(fontsize=8)
    cfg = doc["config"]
    fig.suptitle(f"train_gpt GPT {cfg['layers']} layers d_model {cfg['d_model']}, batch "
                 f"{cfg['batch']} x {cfg['seq']}, {doc['options']['micro']} micro-batches, PP=2 "
                 f"on {doc['machine']['cpus']} cores, 1 thread per rank")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up rounds after the check")
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated subset of {','.join(CONTENDERS)}")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1, --warmup >= 0")
    if args.batch % args.micro:
        ap.error(f"--micro {args.micro} must divide --batch {args.batch}")
    if args.layers < STAGES or args.d_model % args.heads:
        ap.error(f"--layers must be >= {STAGES}, --heads must divide --d-model")
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if not wanted or set(wanted) - set(CONTENDERS):
        ap.error(f"--contenders: choose from {','.join(CONTENDERS)}")
    wanted = [c for c in CONTENDERS if c in wanted]

    from coconet.runtime import CommOptions, spawn

    cfg = replace(train_gpt.Config(), seq=args.seq, batch=args.batch, d_model=args.d_model,
                  layers=args.layers, heads=args.heads, world=STAGES)  # fmt: skip
    opts = {"steps": args.steps, "warmup": args.warmup, "micro": args.micro,
            "contenders": wanted}  # fmt: skip
    before = loadavg()
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks inherit it
    print(f"spawning {STAGES} ranks ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = spawn(worker, STAGES, cfg, opts, options=CommOptions(timeout=120),
                timeout=args.timeout)  # fmt: skip
    wall = time.perf_counter() - t0
    summary = summarize(res, opts)
    doc = {
        "benchmark": "pipeline_parallel",
        "machine": machine(before),
        "world_size": STAGES,
        "threads": res[0]["threads"],
        "config": asdict(cfg),
        "options": {**opts, "dtype": "float32", "rtol": RTOL, "optimizer_step": False},
        "parameters": sum(p.numel() for p in train_gpt.model(cfg).parameters()),
        "failed": res[0]["failed"],
        "errors": {r: o["errors"] for r, o in enumerate(res)},
        "summary": summary,
        "raw_times_s": {**res[0]["times_s"], PROBE: res[0]["probe_s"],
                        SOLO: res[0]["solo_s"]},
        "wall_s": round(wall, 1),
    }
    doc["targets"] = targets(summary)
    emit(doc, table(doc), wall, args.json, plot, args.plot)
    return 1 if doc["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
