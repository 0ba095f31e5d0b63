"""coconet.pipeline: GPipe and 1F1B as per-rank steps, and the proof that a schedule's sends match
and cannot deadlock (coconet.pipeline.check), on the peers' reported traps and on random
schedules, against a real threaded run over rendezvous channels."""

from __future__ import annotations

import queue
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.errors import ScheduleError
from coconet.pipeline import Action, Kind, check, format_table, gpipe, one_f_one_b, peak_activations


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3, 8])
def test_the_schedules_are_proven(build, stages, micro):
    schedule = build(stages, micro)
    check(schedule)
    for r, steps in enumerate(schedule):
        computed = [(a.kind, a.micro_batch) for step in steps for a in step if a.peer is None]
        assert sorted(computed, key=str) == sorted(
            [(Kind.FORWARD, m) for m in range(micro)] + [(Kind.BACKWARD, m) for m in range(micro)],
            key=str,
        ), r
    assert _runs(schedule)


def test_1f1b_holds_fewer_activations_than_gpipe():
    for stages, micro in ((2, 8), (4, 8), (4, 16)):
        f1b = [peak_activations(s) for s in one_f_one_b(stages, micro)]
        gp = [peak_activations(s) for s in gpipe(stages, micro)]
        assert f1b == [min(stages - r, micro) for r in range(stages)]
        assert gp == [micro] * stages
        assert max(f1b) <= max(gp) / 2


def test_the_table_prints_each_rank_as_a_column():
    table = format_table(one_f_one_b(2, 3))
    assert table.splitlines()[0].split() == ["rank", "0", "rank", "1"]
    assert table.splitlines()[1].split() == ["F0", "F0"]


def _act(kind, m, peer, shape=(4,), dtype="float32"):
    return (Action(kind, m, peer, shape, dtype),)


def _f(m):
    return (Action(Kind.FORWARD, m),)


def _b(m):
    return (Action(Kind.BACKWARD, m),)


def test_two_stages_previous_is_next_gradients_out_of_order():
    """PP=2: the previous and next peer are one rank. Gradients sent back in the other order
    than the receiver expects them (equal byte sizes) are refused, naming both actions
    (Megatron-LM #5271's crossed tensors)."""
    ranks = gpipe(2, 2)
    last = [s for s in ranks[1]]
    # rank 1 does its backwards in the forward order: grad 0 then grad 1; rank 0 expects 1, 0
    ranks[1] = [s for s in last if s[0].kind is not Kind.BACKWARD and
                s[0].kind is not Kind.SEND_GRADIENT]  # fmt: skip
    ranks[1] += [_b(0), _act(Kind.SEND_GRADIENT, 0, 0), _b(1), _act(Kind.SEND_GRADIENT, 1, 0)]
    with pytest.raises(ScheduleError, match="would receive rank 1's send_gradient of "
                                            "micro-batch 0") as info:  # fmt: skip
        check(ranks)
    assert any("rank 1" in d for d in info.value.details)
    assert any("rank 0" in d for d in info.value.details)


def test_shapes_and_dtypes_must_match():
    ok = gpipe(3, 2, shapes=[(2, 8), (2, 16)])  # variable shapes between the stages
    check(ok)
    bad = gpipe(3, 2, shapes=[(2, 8), (2, 16)])
    bad[1][0] = _act(Kind.RECV_ACTIVATION, 0, 0, shape=(2, 16))
    with pytest.raises(ScheduleError, match=r"\[2, 16\].*\[2, 8\]|\[2, 8\].*\[2, 16\]"):
        check(bad)
    mixed = gpipe(2, 1, shapes=(3,), dtype="bfloat16")
    mixed[1][0] = _act(Kind.RECV_ACTIVATION, 0, 0, shape=(3,), dtype="float32")
    with pytest.raises(ScheduleError, match="bfloat16"):
        check(mixed)


def test_a_blocking_1f1b_deadlocks_and_says_where():
    """1F1B whose steady state sends before it receives, one at a time (no batched
    isend/irecv): two neighbours both send and wait. Refused with every waiting rank."""
    sched = one_f_one_b(3, 4)
    blocking = [[(a,) for step in steps for a in step] for steps in sched]
    with pytest.raises(ScheduleError, match="deadlocks") as info:
        check(blocking)
    assert len(info.value.details) >= 2 and all("waits" in d for d in info.value.details)
    assert not _runs(blocking, timeout=0.5)  # and it hangs for real


def test_fewer_micro_batches_than_stages():
    check(one_f_one_b(4, 2))  # torchtitan #775: refused there, run here
    assert _runs(one_f_one_b(4, 2))


def test_unreceived_sends_and_bad_peers():
    sched = gpipe(2, 1)
    sched[1] = [s for s in sched[1] if not s[0].kind.is_recv]
    with pytest.raises(ScheduleError, match="before receiving its activation"):
        check(sched)
    with pytest.raises(ScheduleError, match="no rank 5"):
        check([[_act(Kind.SEND_ACTIVATION, 0, 5)], []])
    with pytest.raises(ScheduleError, match="never received|deadlocks"):
        check([[_f(0), _act(Kind.SEND_ACTIVATION, 0, 1)], []])


# -- random schedules: what check accepts runs, over real threads, without hanging ---------------


def _runs(schedule, timeout: float = 5.0) -> bool:
    """Run the schedule on one thread per rank over rendezvous channels (a send returns when its
    receive took it); False if any rank is still blocked after ``timeout`` seconds."""
    n = len(schedule)
    slots = {(s, d): queue.Queue(maxsize=1) for s in range(n) for d in range(n)}
    taken = {(s, d): queue.Queue() for s in range(n) for d in range(n)}
    failed = []

    def rank(r):
        try:
            for step in schedule[r]:
                for a in step:  # a step's sends are posted first, then its receives
                    if a.kind.is_send:
                        message = (a.kind, a.micro_batch)
                        threading.Thread(target=slots[(r, a.peer)].put, args=(message,),
                                         daemon=True).start()  # fmt: skip
                for a in step:
                    if a.kind.is_recv:
                        slots[(a.peer, r)].get(timeout=timeout)
                        taken[(a.peer, r)].put(True)
                for a in step:
                    if a.kind.is_send:
                        taken[(r, a.peer)].get(timeout=timeout)
        except queue.Empty:
            failed.append(r)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    return not failed and not any(t.is_alive() for t in threads)


@settings(max_examples=200, deadline=None)
@given(stages=st.integers(1, 4), micro=st.integers(1, 6), gp=st.booleans(),
       swaps=st.integers(0, 2), seed=st.integers(0, 2**16))  # fmt: skip
def test_random_schedules_are_refused_or_run(stages, micro, gp, swaps, seed):
    """Good schedules with up to two random swaps of a rank's steps: check either refuses the
    result with a ScheduleError or it runs to the end on threads."""
    schedule = (gpipe if gp else one_f_one_b)(stages, micro)
    rng = random.Random(seed)
    for _ in range(swaps):
        r = rng.randrange(stages)
        if len(schedule[r]) >= 2:
            i, j = rng.sample(range(len(schedule[r])), 2)
            schedule[r][i], schedule[r][j] = schedule[r][j], schedule[r][i]
    try:
        check(schedule)
    except ScheduleError:
        return
    assert _runs(schedule, timeout=2.0)


# -- a schedule the caller built, given to Pipeline --------------------------------------------


def _fake_comm(world: int, rank: int = 0):
    """What Pipeline reads of a communicator before anything runs (no processes here): its
    group along ``pp`` routed to torch.distributed (so no shared memory is set up)."""
    from types import SimpleNamespace

    import torch

    from coconet import Mesh
    from coconet.options import TransportKind, TransportPolicy
    from coconet.runtime.p2p import PeerLinks
    from coconet.runtime.routing import Route, peer_plan
    from coconet.runtime.transport import Group

    group = Group("pp", tuple(range(world)), rank)
    options = SimpleNamespace(timeout=5.0, transport=TransportPolicy.TORCH_DISTRIBUTED)
    route = Route(SimpleNamespace(kind=TransportKind.TORCH_DISTRIBUTED), group)

    def p2p(axis, channels, *, identity, op, member):
        # routing's verdict on the fake route (all gloo: nothing is set up, nothing sent)
        plan = peer_plan(route, channels, options, torch.device("cpu"), member)
        return PeerLinks(plan, group, None, timeout=5.0, identity=identity, op=op)

    return SimpleNamespace(
        mesh=Mesh(pp=world), rank=rank, options=options,
        route=lambda axis: route, group=lambda axis: group, p2p=p2p,
    )  # fmt: skip


def test_pipeline_takes_a_built_schedule_and_proves_it():
    import torch.nn.functional as F
    from torch import nn

    from coconet.errors import ConfigError
    from coconet.pipeline import Pipeline

    stage = nn.Linear(4, 4)
    kw = dict(activation_shape=(2, 4), loss_fn=F.mse_loss)
    good = one_f_one_b(2, 3, (2, 4))
    pipe = Pipeline(stage, _fake_comm(2), micro_batches=3, schedule=good, **kw)
    assert pipe.steps == [tuple(s) for s in good[0]]
    with pytest.raises(ConfigError, match="one list of steps per stage"):
        Pipeline(stage, _fake_comm(2), micro_batches=3, schedule=good[:1], **kw)
    with pytest.raises(ConfigError, match="each of the 4 micro-batches once"):
        Pipeline(stage, _fake_comm(2), micro_batches=4, schedule=good, **kw)
    blocking = [list(r) for r in good]
    # the last stage's first backward before its first forward: its input never arrived
    last = blocking[1]
    f = next(i for i, s in enumerate(last) if s[0].kind is Kind.FORWARD)
    b = next(i for i, s in enumerate(last) if s[0].kind is Kind.BACKWARD)
    last[f], last[b] = last[b], last[f]
    with pytest.raises(ScheduleError):
        Pipeline(stage, _fake_comm(2, rank=1), micro_batches=3, schedule=blocking, **kw)


def test_slice_dim_is_refused_without_slice_over_or_outside_the_activation():
    import torch.nn.functional as F
    from torch import nn

    from coconet.errors import ConfigError
    from coconet.pipeline import Pipeline

    kw = dict(activation_shape=(2, 4), loss_fn=F.mse_loss, micro_batches=2)
    with pytest.raises(ConfigError, match="slice_dim needs slice_over"):
        Pipeline(nn.Linear(4, 4), _fake_comm(2), slice_dim=0, **kw)


def test_a_send_before_the_compute_that_makes_it_is_refused():
    # found by tests/dist's random schedules: the messages still pair, the tensor is not there
    schedule = gpipe(2, 2, (4,))
    first = schedule[0]
    f1 = next(i for i, s in enumerate(first) if s[0].kind is Kind.FORWARD and s[0].micro_batch == 1)
    send1 = next(i for i, s in enumerate(first)
                 if s[0].kind is Kind.SEND_ACTIVATION and s[0].micro_batch == 1)  # fmt: skip
    first[f1], first[send1] = first[send1], first[f1]
    with pytest.raises(ScheduleError, match="before running the forward of micro-batch 1"):
        check(schedule)
