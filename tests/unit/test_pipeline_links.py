"""Which transport carries each pipeline channel (routing's verdict:
``coconet.runtime.routing.plan_links``, fed the schedule's ``channel_sizes``), and the
shared-memory channels themselves (``coconet.runtime.p2p.PeerChannels``) between two threads of
this process standing for two ranks of one host: FIFO order through a ring smaller than the
stream (the sender waits only while it is full), the header check of a pair out of step, the
deadline, a peer's abort seen at once, and ranks set up with different channels refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from coconet.errors import ConfigError, RuntimeFault
from coconet.options import TransportKind
from coconet.pipeline import gpipe, one_f_one_b
from coconet.pipeline.schedules import channel_sizes
from coconet.runtime.p2p import ChannelSpec, PeerChannels, layout
from coconet.runtime.routing import plan_links

SHM, GLOO = TransportKind.SHARED_MEMORY, TransportKind.TORCH_DISTRIBUTED


# -- planning ----------------------------------------------------------------------------------


def test_channel_sizes_count_one_step_s_messages_per_direction():
    # 1F1B over 3 stages, 5 micro-batches of (2, 4): each boundary carries 5 activations one way
    # and 5 gradients back, 2 x 4 float32 each
    sizes = channel_sizes(one_f_one_b(3, 5, (2, 4)), 4)
    assert sizes == {(0, 1): (5, 32), (1, 0): (5, 32), (1, 2): (5, 32), (2, 1): (5, 32)}
    # boundaries of different widths: each channel sized by its own
    assert channel_sizes(gpipe(3, 2, [(1, 3), (1, 7)]), 8) == {
        (0, 1): (2, 24), (1, 0): (2, 24), (1, 2): (2, 56), (2, 1): (2, 56)}  # fmt: skip


def test_links_follow_the_host_group():
    channels = channel_sizes(one_f_one_b(4, 8, (2, 4)), 4)
    ranks = (10, 11, 12, 13)  # the job's global ranks of the stages
    # no host group (forced to gloo, or a flat group over hosts): every channel over gloo
    links, specs = plan_links(channels, ranks, None, "forced", member="stage")
    assert {link.transport for link in links.values()} == {GLOO} and specs == []
    assert {link.why for link in links.values()} == {"forced"}
    # every stage on this host: every channel over shared memory, one ring per direction that
    # holds the step's 8 messages
    links, specs = plan_links(channels, ranks, ranks, "", member="stage")
    assert {link.transport for link in links.values()} == {SHM}
    assert sorted(specs) == [ChannelSpec(0, 1, 8, 32), ChannelSpec(1, 0, 8, 32),
                             ChannelSpec(1, 2, 8, 32), ChannelSpec(2, 1, 8, 32),
                             ChannelSpec(2, 3, 8, 32), ChannelSpec(3, 2, 8, 32)]  # fmt: skip
    # stages 2 and 3 on this host (a hierarchical group): their boundary over shared memory,
    # indexed in the host group; the one to stage 1 over gloo
    links, specs = plan_links(channels, ranks, (12, 13), "", member="stage")
    assert links[(2, 3)].transport is SHM and links[(3, 2)].transport is SHM
    assert links[(1, 2)] == (GLOO, "stage 1 is on another host")
    assert sorted(specs) == [ChannelSpec(0, 1, 8, 32), ChannelSpec(1, 0, 8, 32)]
    # a ring over the budget goes over gloo, and says why
    links, specs = plan_links(channels, ranks, ranks, "", ring_bytes=255, member="stage")
    assert links[(0, 1)].transport is GLOO and "more than" in links[(0, 1)].why and not specs


def test_layout_gives_every_counter_a_line_and_every_ring_its_room():
    specs = [ChannelSpec(0, 1, 3, 100), ChannelSpec(1, 0, 2, 64), ChannelSpec(1, 2, 1, 8)]
    places, sizes = layout(specs, 3)
    p01 = places[(0, 1)]
    assert p01.stride == 64 + 128 and p01.ring_at == p01.sent_at + 64
    for (src, dst), p in places.items():
        assert p.sent_at % 64 == 0 and p.consumed_at % 64 == 0 and p.ring_at % 64 == 0
        spec = next(s for s in specs if (s.src, s.dst) == (src, dst))
        assert p.ring_at + spec.slots * p.stride <= sizes[src]
        assert p.consumed_at + 8 <= sizes[dst]
    # in each segment, nothing overlaps
    for r in range(3):
        spans = []
        for (src, dst), p in places.items():
            spec = next(s for s in specs if (s.src, s.dst) == (src, dst))
            if src == r:
                spans.append((p.sent_at, p.ring_at + spec.slots * p.stride))
            if dst == r:
                spans.append((p.consumed_at, p.consumed_at + 64))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans


# -- the channels, between two threads ---------------------------------------------------------


class _Gather:
    """All-gather of Python objects between threads (a rank's control channel, in one process)."""

    def __init__(self, n: int) -> None:
        self.slots, self.barrier = [None] * n, threading.Barrier(n, timeout=10)

    def of(self, i: int):
        def gather(obj):
            self.slots[i] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


_TWO_WAYS = (ChannelSpec(0, 1, 2, 64), ChannelSpec(1, 0, 2, 64))  # 2 slots of 64 bytes each way


def _pair(specs=_TWO_WAYS, timeout=5.0, identities=("same", "same")):
    g = _Gather(2)
    made: list = [None, None]

    def make(i):
        try:
            made[i] = PeerChannels(list(specs), i, 2, g.of(i), timeout=timeout,
                                   identity=identities[i])  # fmt: skip
        except Exception as e:  # noqa: BLE001 - returned to the test
            made[i] = e

    threads = [threading.Thread(target=make, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return made


def test_messages_arrive_in_order_through_a_ring_smaller_than_the_stream():
    a, b = _pair()
    got = []

    def receive():
        for k in range(7):
            out = torch.empty(3, dtype=torch.float64)
            b.recv(0, out, (1, k), f"recv {k}")
            got.append(out.tolist())
            time.sleep(0.002)  # a slow reader: the sender finds the ring full

    t = threading.Thread(target=receive)
    t.start()
    for k in range(7):  # 7 messages through 2 slots of 64 bytes
        a.send(1, torch.full((3,), float(k), dtype=torch.float64), (1, k), f"send {k}")
    t.join(10)
    assert got == [[float(k)] * 3 for k in range(7)]
    # and the other way, a message of another dtype and size in the same slots
    b.send(0, torch.arange(5, dtype=torch.int32), (2, 0), "back")
    out = torch.empty(5, dtype=torch.int32)
    a.recv(1, out, (2, 0), "back")
    assert out.tolist() == [0, 1, 2, 3, 4]
    a.close()
    b.close()


def test_a_pair_out_of_step_is_a_fault_not_a_crossed_tensor():
    a, b = _pair()
    a.send(1, torch.zeros(4), (2, 3), "send gradient 3")
    with pytest.raises(RuntimeFault, match="out of step") as e:
        b.recv(0, torch.empty(4), (1, 3), "recv activation 3")
    assert "words [2, 3]" in str(e.value) and "words [1, 3]" in str(e.value)


def test_a_wait_has_a_deadline_and_sees_the_peer_s_abort_at_once():
    a, b = _pair(timeout=0.3)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeFault, match="no answer within 0.3 s"):
        a.recv(1, torch.empty(4), (1, 0), "recv nothing")
    assert time.perf_counter() - t0 < 2.0
    a2, b2 = _pair(timeout=30.0)
    b2.abort()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeFault, match="aborted its step"):
        a2.recv(1, torch.empty(4), (1, 0), "recv from an aborted peer")
    assert time.perf_counter() - t0 < 1.0
    # a full ring waits with the deadline too
    a3, _ = _pair(timeout=0.3)
    a3.send(1, torch.zeros(4), (1, 0), "m0")
    a3.send(1, torch.zeros(4), (1, 1), "m1")
    with pytest.raises(RuntimeFault, match="m2 did not complete"):
        a3.send(1, torch.zeros(4), (1, 2), "m2")


def test_ranks_set_up_with_different_channels_are_refused_on_each():
    made = _pair(identities=("schedule A", "schedule B"))
    assert all(isinstance(m, ConfigError) for m in made), made
    assert "different channels" in str(made[0])


# -- routing's verdict and the communicator's point-to-point channels -------------------------


def test_peer_plan_names_why_a_group_has_no_shared_memory():
    from types import SimpleNamespace

    from coconet.options import CommOptions, TransportPolicy
    from coconet.runtime.hierarchy import HierGroup
    from coconet.runtime.routing import Route, peer_plan
    from coconet.runtime.shmem import ShmGroup
    from coconet.runtime.transport import Group

    channels = {(0, 1): (2, 64), (1, 0): (2, 64)}
    cpu = torch.device("cpu")

    def route(kind, handle=None):
        return Route(SimpleNamespace(kind=kind), Group("pp", (4, 5), 0, handle))

    def why(r, device=cpu, **options):
        plan = peer_plan(r, channels, CommOptions(**options), device, member="stage")
        assert plan.specs == [] and plan.host is None
        assert {link.transport for link in plan.links.values()} == {GLOO}
        return {link.why for link in plan.links.values()}

    forced = route(GLOO)
    assert why(forced, transport=TransportPolicy.TORCH_DISTRIBUTED) == {
        "CommOptions(transport='torch.distributed') forces it"}  # fmt: skip
    assert why(forced, device=torch.device("meta")) == {"the communicator runs on meta, not CPU"}
    assert why(forced) == {"the group along 'pp' runs on torch.distributed (its ranks span hosts "
                           "and it runs flat)"}  # fmt: skip
    # a hierarchical group whose host holds this rank alone
    alone = HierGroup(layout=None, plan=None, local=Group("pp", (4,), 0, None), cross=None,
                      flat=None)  # fmt: skip
    assert why(route(TransportKind.HIERARCHICAL, alone)) == {
        "no other stage of the group is on this rank's host"}  # fmt: skip
    # on shared memory: every channel there, over the group's ShmGroup
    shm = ShmGroup(0, 2, lambda obj: [obj, obj], timeout=1.0)
    plan = peer_plan(route(SHM, shm), channels, CommOptions(), cpu, member="stage")
    assert {link.transport for link in plan.links.values()} == {SHM}
    assert plan.host.handle is shm and sorted(plan.specs) == [ChannelSpec(0, 1, 2, 64),
                                                              ChannelSpec(1, 0, 2, 64)]  # fmt: skip


def test_peer_links_send_over_the_ring_and_the_guard_sees_every_message():
    """Two ``PeerLinks`` on threads over one shared-memory plan: a send is in the ring when
    ``send_start`` returns, a receive lands at ``wait``, every call goes through the guard (a
    peer out of step is its ``RuntimeFault``), and a channel the plan lacks is refused."""
    from coconet.runtime.p2p import PeerLinks, PeerPlan
    from coconet.runtime.shmem import ShmGroup
    from coconet.runtime.transport import Group

    channels = {(0, 1): (2, 64), (1, 0): (2, 64)}
    links, specs = plan_links(channels, (7, 8), (7, 8), "")
    g = _Gather(2)
    seen: list[tuple[str, str]] = []

    def guard(op, label, axis, fn, /, *args, **kwargs):  # FaultGuard's signature
        seen.append((op, label))
        return fn(*args, **kwargs)

    made: list = [None, None]

    def make(i):
        host = Group("pp", (7, 8), i, ShmGroup(i, 2, g.of(i), timeout=5.0))
        made[i] = PeerLinks(PeerPlan(links, specs, host), host, guard, timeout=5.0,
                            identity="same", op="test")  # fmt: skip

    threads = [threading.Thread(target=make, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = made
    assert a.transport(0, 1) is SHM and a.transport(1, 1) is None
    work = a.send_start(torch.arange(4.0), 1, words=(1, 0), label="act 0")
    assert torch.equal(a.wait(work), torch.arange(4.0))
    out = torch.empty(4)
    got = b.wait(b.recv_start(out, 0, words=(1, 0), label="act 0"))
    assert got is out and out.tolist() == [0.0, 1.0, 2.0, 3.0]
    a.send_start(torch.zeros(4), 1, words=(2, 0), label="grad 0")
    with pytest.raises(RuntimeFault, match="out of step"):
        b.wait(b.recv_start(torch.empty(4), 0, words=(1, 1), label="act 1"))
    assert ("test", "act 1") in seen and ("test", "shared-memory channels") in seen
    with pytest.raises(ConfigError, match="no channel from group rank 0 to 0"):
        a.send_start(torch.zeros(4), 0, words=(1, 0), label="to itself")
    a.close()
    b.close()
